"""Let torch >= 2.6's safe loader (`weights_only=True`, its default) read mmengine's own checkpoints.

mmengine 0.10.7 calls `torch.load` without `weights_only`, so `tools/test.py --checkpoint` and `--resume`
fail on the objects mmengine itself pickles into `meta` / `message_hub`: its HistoryBuffer and the numpy
arrays, scalars and dtypes they hold. Only those specific types are allow-listed; safety stays on for
everything else.
"""
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


def mmengine_safe_globals():
    from mmengine.logging.history_buffer import HistoryBuffer
    return [HistoryBuffer] + _numpy_globals()


def register_mmengine_safe_globals():
    """Allow-list the types above for `torch.load(weights_only=True)` (no-op on torch < 2.4)."""
    add = getattr(torch.serialization, 'add_safe_globals', None)
    if add is not None:
        add(mmengine_safe_globals())
