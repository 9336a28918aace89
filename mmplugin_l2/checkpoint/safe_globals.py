"""Let torch >= 2.6's safe loader (`weights_only=True`, its default) read mmengine's own checkpoints.

mmengine 0.10.7 calls `torch.load` without `weights_only`, so `tools/test.py --checkpoint` and `--resume`
fail on the objects mmengine itself pickles into `meta` / `message_hub`: its HistoryBuffer and the numpy
arrays, scalars and dtypes they hold, and the statistics methods of HistoryBuffer, which pickle protocol 2
writes as `getattr(HistoryBuffer, 'min')`. Only those specific types are allow-listed, and `getattr` is
replaced by `history_buffer_getattr`, which resolves nothing but those methods: safety stays on for
everything else.
"""
import pickle

import numpy as np
import torch


def _numpy_globals():
    core = getattr(np, '_core', None) or np.core
    items = [np.ndarray, np.dtype, core.multiarray._reconstruct, core.multiarray.scalar]
    # numpy >= 1.25 pickles dtypes by their class (np.dtypes.Float64DType, ...).
    dtypes = getattr(np, 'dtypes', None)
    if dtypes is not None:
        items += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith('DType')
                  and isinstance(getattr(dtypes, n), type)]
    return items


def history_buffer_getattr(obj, name):
    """`getattr` restricted to the statistics methods of mmengine's HistoryBuffer."""
    from mmengine.logging.history_buffer import HistoryBuffer
    if obj is HistoryBuffer and name in ('min', 'max', 'current', 'mean'):
        return getattr(obj, name)
    raise pickle.UnpicklingError(f'weights_only load: getattr({obj!r}, {name!r}) is not allowed')


def mmengine_safe_globals():
    from mmengine.logging.history_buffer import HistoryBuffer
    return [HistoryBuffer, (history_buffer_getattr, 'builtins.getattr')] + _numpy_globals()


def register_mmengine_safe_globals():
    """Allow-list the types above for `torch.load(weights_only=True)` (no-op on torch < 2.4)."""
    add = getattr(torch.serialization, 'add_safe_globals', None)
    if add is not None:
        add(mmengine_safe_globals())
