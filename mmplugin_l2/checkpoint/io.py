"""Reading checkpoint files and loading converted weights with a clear error when they do not fit."""
import logging
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


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, or whose weights do not fit the model. The message says
    which file, what is wrong and what was expected; the tools print it without a traceback."""


_EXPECTED = 'expected a PyTorch checkpoint written by torch.save (e.g. a .pth file of tools/train.py)'


def _sniff(path, size):
    """What the first bytes of a file that torch could not read say about it."""
    with open(path, 'rb') as f:
        head = f.read(64)
    if head.startswith(b'PK\x03\x04'):
        return 'a zip archive (the torch.save format) that is truncated or corrupt'
    if head.startswith(b'\x93NUMPY'):
        return 'a NumPy .npy file'
    if head.startswith(b'\x89HDF'):
        return 'an HDF5 file (Keras / h5py?)'
    if head[:1] == b'\x80' or head[:1] in (b'(', b'}', b']'):
        return 'a plain Python pickle, not a torch.save file'
    try:
        text = head.decode('utf-8')
    except UnicodeDecodeError:
        return f'an unknown binary format ({size} bytes, starts with {head[:8]!r})'
    if text.strip() and all(c.isprintable() or c in '\r\n\t' for c in text):
        first = text.strip().splitlines()[0][:40]
        return f'a text file (starts with {first!r}; a Git LFS pointer or an HTML error page?)'
    return f'an unknown format ({size} bytes, starts with {head[:8]!r})'


def _unreadable(path, what, err=None):
    detail = f' ({type(err).__name__}: {str(err).splitlines()[0][:100]})' if err is not None and str(err) \
        else ''
    return CheckpointError(f'cannot read checkpoint {path!r}: it is {what}{detail}; {_EXPECTED}')


def load_checkpoint_file(path, trusted=True):
    """Load a checkpoint file on CPU.

    It is first read with torch's safe `weights_only=True` loader. The authors' release files may also
    hold non-tensor objects (a yacs config, optimiser state); when `trusted` those files are read with
    the full unpickler, with classes that are not importable here replaced by placeholders.

    Every file that cannot be read (missing, a directory, empty, text, truncated, a plain pickle, ...)
    raises one `CheckpointError` (`FileNotFoundError` when missing) naming the file, what it is and what
    was expected.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointError(f'cannot read checkpoint {path!r}: it is a directory; {_EXPECTED}')
    if not os.path.isfile(path):
        raise FileNotFoundError(f'checkpoint file not found: {path!r}')
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f'cannot read checkpoint {path!r}: the file is empty (0 bytes; an '
                              f'interrupted copy or download?); {_EXPECTED}')
    try:
        return torch.load(path, map_location='cpu', weights_only=True)
    except pickle.UnpicklingError as err:
        if not trusted or not str(err).startswith('Weights only load failed'):
            raise _unreadable(path, _sniff(path, size)) from err
        first_err = err
    except (EOFError, KeyError, RuntimeError, ValueError, OSError, IndexError, TypeError,
            AttributeError, UnicodeDecodeError) as err:
        raise _unreadable(path, _sniff(path, size)) from err
    try:
        obj = torch.load(path, map_location='cpu', weights_only=False, pickle_module=_tolerant_pickle)
    except Exception as err:  # noqa: BLE001  (any failure of the full unpickler: the file is not ours)
        raise _unreadable(path, _sniff(path, size), err) from err
    warnings.warn(f'{path}: holds objects beyond tensors ({str(first_err).splitlines()[0][:120]}); '
                  f'loaded it as a trusted file. tools/convert_checkpoint.py writes a tensors-only copy.')
    return obj


def model_state_dict(ckpt, source):
    """The weights of a whole-model checkpoint (`state_dict` of mmengine, else the top level), with a
    DataParallel `module.` prefix removed; `CheckpointError` when it holds none."""
    sd = ckpt.get('state_dict', ckpt) if isinstance(ckpt, dict) else ckpt
    if not isinstance(sd, dict) or not sd or not all(torch.is_tensor(v) for v in sd.values()):
        kind = type(ckpt).__name__
        keys = f' with entries {sorted(map(str, ckpt))[:8]}' if isinstance(ckpt, dict) else ''
        raise CheckpointError(f'{source}: no weights found: it holds a {kind}{keys}; expected a dict of '
                              f'tensors under "state_dict" (an mmengine checkpoint) or at the top level')
    return {k[7:] if k.startswith('module.') else k: v for k, v in sd.items()}


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


def state_dict_mismatch(model, sd, optional=()):
    """(missing, unexpected, shape mismatches) of `sd` against `model`, each a sorted list."""
    own = model.state_dict()
    optional = set(optional)
    missing = sorted(k for k in own if k not in sd and k not in optional)
    unexpected = sorted(k for k in sd if k not in own)
    shape = sorted(f'{k}: checkpoint {tuple(sd[k].shape)} vs model {tuple(own[k].shape)}'
                   for k in sd if k in own and tuple(sd[k].shape) != tuple(own[k].shape))
    return missing, unexpected, shape


def describe_mismatch(model, mismatch, source, hint='Is it a checkpoint of this model family and size?',
                      limit=12):
    """The lines of a does-not-fit message: counts and the first `limit` keys of each kind."""
    missing, unexpected, shape = mismatch

    def show(keys):
        return ', '.join(keys[:limit]) + (f' ... (+{len(keys) - limit} more)' if len(keys) > limit else '')

    arch = getattr(model, 'arch_desc', '')
    parts = [f'{source} does not fit {type(model).__name__}{f" (arch {arch})" if arch else ""}:']
    if missing:
        parts.append(f'  {len(missing)} missing keys: {show(missing)}')
    if unexpected:
        parts.append(f'  {len(unexpected)} unexpected keys: {show(unexpected)}')
    if shape:
        parts.append(f'  {len(shape)} shape mismatches: {show(shape)}')
    parts.append(f'  {hint}')
    return '\n'.join(parts)


def check_state_dict_fits(model, sd, source, hint='Is it a checkpoint of this model family and size?'):
    """Raise CheckpointError (a ValueError) listing missing / unexpected keys and shape mismatches of
    `sd` against `model`.

    Keys that `model` owns but a pretrained classification file cannot have (declared by
    `model.keys_not_in_pretrained()`, e.g. new output norms) may be missing; nothing else may.
    """
    mismatch = state_dict_mismatch(model, sd, getattr(model, 'keys_not_in_pretrained', lambda: [])())
    if any(mismatch):
        raise CheckpointError(describe_mismatch(model, mismatch, source, hint))


def load_pretrained(model, path, convert, prefix=None, logger=None, strict=True):
    """Load `path` into `model` after `convert(state_dict)`; raise CheckpointError if the keys or shapes
    do not fit. With `strict=False` the mismatch is logged as a warning and the keys that fit are loaded."""
    try:
        sd = convert(extract_state_dict(load_checkpoint_file(path), prefix))
    except CheckpointError:
        raise
    except ValueError as err:
        raise CheckpointError(f'{path}: {err}') from err
    if strict:
        check_state_dict_fits(model, sd, path, hint='Is it a checkpoint of this model family and size? '
                              'To load only the keys that fit, set strict=False in init_cfg.')
        model.load_state_dict(sd, strict=False)
        return sd
    mismatch = state_dict_mismatch(model, sd, getattr(model, 'keys_not_in_pretrained', lambda: [])())
    if any(mismatch):
        from mmengine.logging import print_log
        print_log(describe_mismatch(model, mismatch, path, hint='strict=False: loading the keys that fit, '
                                    'the others keep their initialisation.'),
                  logger=logger or 'current', level=logging.WARNING)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in sd.items() if k in own and tuple(v.shape) == tuple(own[k].shape)},
                          strict=False)
    return sd
