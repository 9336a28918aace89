"""Activation checkpointing shared by the backbones' `with_cp` and the layers' `recompute` options."""
import torch
import torch.utils.checkpoint as cp


def checkpointed(fn, *args, enabled=True, context_fn=None):
    """fn(*args); when `enabled` and autograd records, under non-reentrant activation checkpointing: only
    the inputs are kept for backward and `fn` runs again there (RNG state preserved). `context_fn` as for
    torch.utils.checkpoint (e.g. to keep BatchNorm statistics from being updated twice)."""
    if enabled and torch.is_grad_enabled():
        kw = {} if context_fn is None else dict(context_fn=context_fn)
        return cp.checkpoint(fn, *args, use_reentrant=False, **kw)
    return fn(*args)
