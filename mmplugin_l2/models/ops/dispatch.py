"""One dispatch for every op: which implementation runs, decided once per forward.

Each op under `ops/` has a **reference** implementation (plain PyTorch autograd, the paper's formula, whole
maps, export-friendly) and fast implementations: **inference** (no autograd: in-place / `out=` kernels, and
pieces of the memory policy on its devices) and **train** (a closed-form or recomputing autograd function,
pieces of the memory policy on its devices). `choose` picks one of the three from

* export / compile tracing (`export.exporting`): always the reference;
* the module's mode and autograd (`inference`, `recomputes`, the only definitions of these conditions):
  inference needs eval mode and no autograd recording; train needs train mode, autograd recording and the
  module's `recompute` switch;
* dtype / autocast: an op whose fast path does not support half precision or autocast says so
  (`half=False`), and then gets the reference there;
* the memory policy (`MemoryPolicy`): the piece size, only on the policy's devices (CPU by default; CUDA
  runs whole maps unless a user adds it to `devices`).

Anything else falls back to the reference, which is always correct. Ops may refuse a fast path for reasons
of their own (e.g. a train-mode BatchNorm inside an eval-mode module) by calling `Path.reference()`.
"""
from typing import NamedTuple, Optional

import torch

from .dtypes import HALF_DTYPES, autocast_on
from .export import exporting

REFERENCE, INFERENCE, TRAIN = 'reference', 'inference', 'train'


class Path(NamedTuple):
    """The implementation an op runs: `impl` one of 'reference', 'inference', 'train'; `piece` the
    elements per piece (the op's own unit, see `MemoryPolicy`) or None for whole maps."""
    impl: str
    piece: Optional[int] = None

    @classmethod
    def reference(cls):
        return cls(REFERENCE, None)


def inference(module):
    """The condition of every inference fast path (pieces, in-place and `out=` kernels): `module` in eval
    mode, no autograd recording, not being exported."""
    return not module.training and not torch.is_grad_enabled() and not exporting()


def recomputes(module):
    """The condition of every train fast path and of recomputation in backward: `module`'s `recompute`
    switch on, train mode, autograd recording, not being exported."""
    return (bool(getattr(module, 'recompute', False)) and module.training and torch.is_grad_enabled()
            and not exporting())


def _policy_piece(policy, x, whole_elems):
    if policy is None or policy.max_elems is None or x.device.type not in policy.devices:
        return None
    return policy.max_elems if whole_elems > 2 * policy.max_elems else None


def choose(module, x, whole_elems, *, train=True, half=True, policy=None):
    """The `Path` of `module`'s op on input `x`, whose whole map holds `whole_elems` elements in the op's
    unit of pieces.

    Args:
        module (nn.Module): the layer (its `training`, `recompute` and `memory_policy` are read).
        x (Tensor): the op's input (device, dtype).
        whole_elems (int): size of the whole map in the op's piece unit.
        train (bool): the op has a train implementation. Default: True.
        half (bool): the op's fast paths support fp16 / bf16 inputs and autocast. Default: True.
        policy (MemoryPolicy | None): the memory policy, when it belongs to another module than the one
            whose mode is read (e.g. a block's MLP). Default: None (`module.memory_policy`).

    Returns:
        Path: the implementation and its piece.
    """
    if exporting():
        return Path.reference()
    if not half and (x.dtype in HALF_DTYPES or autocast_on(x.device.type)):
        return Path.reference()
    if policy is None:
        policy = getattr(module, 'memory_policy', None)
    if inference(module):
        return Path(INFERENCE, _policy_piece(policy, x, whole_elems))
    if train and recomputes(module):
        return Path(TRAIN, _policy_piece(policy, x, whole_elems))
    return Path.reference()
