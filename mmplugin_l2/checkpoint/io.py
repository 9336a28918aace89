"""Reading checkpoint files and loading converted weights with a clear error when they do not fit."""
import os
import pickle
import types
import warnings

import torch


class _Placeholder(dict):
    """Stands in for a pickled object whose class is not importable here (e.g. a yacs CfgNode, a dict
    subclass): it takes any constructor arguments, items and state, and is never used."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def __setstate__(self, state):
        self.state = state


class _TolerantUnpickler(pickle.Unpickler):

    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Placeholder,), {'__module__': module})


# torch.load(pickle_module=...) needs an object with Unpickler and load.
_tolerant_pickle = types.SimpleNamespace(
    Unpickler=_TolerantUnpickler,
    load=lambda f, **kw: _TolerantUnpickler(f, **kw).load(),
    __name__='mmplugin_l2_tolerant_pickle')


def load_checkpoint_file(path, trusted=True):
    """Load a checkpoint file on CPU.

    It is first read with torch's safe `weights_only=True` loader. The authors' release files may also
    hold non-tensor objects (a yacs config, optimiser state); when `trusted` those files are read with
    the full unpickler, with classes that are not importable here replaced by placeholders.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint file not found: {path!r}')
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as err:
        if not trusted:
            raise
        warnings.warn(f'{path}: holds objects beyond tensors ({str(err).splitlines()[0][:120]}); '
                      f'loading it as a trusted file. tools/convert_checkpoint.py writes a '
                      f'tensors-only copy.')
        return torch.load(path, map_location='cpu', weights_only=False,
                          pickle_module=_tolerant_pickle)


def extract_state_dict(ckpt, prefix=None, keys=('state_dict', 'model')):
    """The weights of a checkpoint: under `state_dict` (mmengine), `model` (the authors' non-EMA weights,
    which their dense-prediction code loads) or the object itself. With `prefix` (e.g. 'backbone.'),
    only the keys under it are kept, prefix removed; without it, a `backbone.` prefix carried by every
    key is removed as well."""
    if isinstance(ckpt, dict):
        for key in keys:
            if key in ckpt and isinstance(ckpt[key], dict):
                ckpt = ckpt[key]
                break
        else:
            if any(k in ckpt for k in keys) or not all(torch.is_tensor(v) for v in ckpt.values()):
                raise ValueError(f'none of the entries {list(keys)} of the checkpoint holds weights; '
                                 f'it has {sorted(ckpt)[:10]}')
    if not isinstance(ckpt, dict) or not all(torch.is_tensor(v) for v in ckpt.values()):
        raise ValueError(f'no state dict found in the checkpoint (looked under {list(keys)} and at '
                         f'the top level)')
    sd = {k[7:] if k.startswith('module.') else k: v for k, v in ckpt.items()}
    if prefix is None and sd and all(k.startswith('backbone.') for k in sd):
        prefix = 'backbone.'
    if prefix:
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        if not sd:
            raise ValueError(f'no key of the checkpoint starts with {prefix!r}')
    return sd


def check_state_dict_fits(model, sd, source):
    """Raise ValueError listing missing / unexpected keys and shape mismatches of `sd` against `model`.

    Keys that `model` owns but a pretrained classification file cannot have (declared by
    `model.keys_not_in_pretrained()`, e.g. new output norms) may be missing; nothing else may.
    """
    own = model.state_dict()
    optional = set(getattr(model, 'keys_not_in_pretrained', lambda: [])())
    missing = sorted(k for k in own if k not in sd and k not in optional)
    unexpected = sorted(k for k in sd if k not in own)
    shape = sorted(f'{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}'
                   for k in sd if k in own and sd[k].shape != own[k].shape)
    if not (missing or unexpected or shape):
        return

    def show(keys):
        return ', '.join(keys[:12]) + (f' ... (+{len(keys) - 12} more)' if len(keys) > 12 else '')

    arch = getattr(model, 'arch_desc', '')
    parts = [f'{source} does not fit {type(model).__name__}{f" (arch {arch})" if arch else ""}:']
    if missing:
        parts.append(f'  {len(missing)} missing keys: {show(missing)}')
    if unexpected:
        parts.append(f'  {len(unexpected)} unexpected keys: {show(unexpected)}')
    if shape:
        parts.append(f'  {len(shape)} shape mismatches: {show(shape)}')
    parts.append('  Is it a checkpoint of this model family and size?')
    raise ValueError('\n'.join(parts))


def load_pretrained(model, path, convert, prefix=None, logger=None):
    """Load `path` into `model` after `convert(state_dict)`; raise if the keys or shapes do not fit."""
    sd = convert(extract_state_dict(load_checkpoint_file(path), prefix))
    check_state_dict_fits(model, sd, path)
    model.load_state_dict(sd, strict=False)
    return sd
