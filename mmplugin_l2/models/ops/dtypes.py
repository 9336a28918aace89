"""Dtype mechanics shared by the layers that pick their own precision under autocast / half weights
(docs/mixed_precision.md)."""
import contextlib

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def autocast_off(device_type):
    """Autocast disabled for `device_type` (the dtypes are explicit inside); a no-op where the device has no
    autocast (e.g. meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


def compute_dtype(t):
    """fp32 for fp16 / bf16 tensors, else the tensor's own dtype."""
    return torch.float32 if t.dtype in HALF_DTYPES else t.dtype


def autocast_on(device_type):
    """Whether autocast is on for `device_type` (False where the device has no autocast, e.g. meta)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocasts_to(t, dtype):
    """Whether autocast on `t`'s device is on and casts to `dtype`."""
    dev = t.device.type
    return autocast_on(dev) and torch.get_autocast_dtype(dev) == dtype


def compute_dtype_of(x):
    """The dtype an op computes in on input `x`: the autocast dtype for an fp32 `x` under autocast on its device
    (autocast casts only fp32 arguments), else `x`'s own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if x.dtype == torch.float32 and autocast_on(dev) else x.dtype


def autocast_state(device_type):
    """The autocast state on `device_type` as `autocast_as` re-enters it: (device type, autocast dtype or None)."""
    return device_type, (torch.get_autocast_dtype(device_type) if autocast_on(device_type) else None)


def autocast_as(state):
    """Autocast on its device as `autocast_state` recorded it (on in that dtype, or off): a custom autograd
    Function's backward runs under its forward's state, as autograd runs the reference's backward ops."""
    device_type, dtype = state
    return torch.autocast(device_type, dtype=dtype) if dtype is not None else autocast_off(device_type)
