"""Renamed public names and arguments: the old name keeps working for one release, with a DeprecationWarning
that names the new one (OpenMMLab's convention)."""
import warnings


def _warn(old, new, owner):
    warnings.warn(f'{owner}: `{old}` is renamed `{new}`; `{old}` will be removed in the next release',
                  DeprecationWarning, stacklevel=3)


def renamed_argument(owner, old, new, old_value, value):
    """`value`, or `old_value` with a DeprecationWarning when the caller still passes the argument under its
    old name `old` (None: not passed)."""
    if old_value is None:
        return value
    _warn(old, new, owner)
    return old_value


def renamed_attributes(module_name, namespace, renames):
    """A module-level `__getattr__` for the module `module_name` whose globals are `namespace`: each old name
    in `renames` ({old: new}) returns the new name's object with a DeprecationWarning."""
    def __getattr__(name):
        if name in renames:
            _warn(name, renames[name], module_name)
            return namespace[renames[name]]
        raise AttributeError(f'module {module_name!r} has no attribute {name!r}')
    return __getattr__
