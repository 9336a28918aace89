"""One dispatch for every op: which implementation runs, decided once per forward, here only.

Each op under `ops/` has a **naive** form (`naive.py`, the paper's formula, the tests' oracle), a
**reference** (plain PyTorch autograd on whole maps, export-friendly) and fast paths: **inference** (no
autograd: in-place / `out=` kernels, and pieces of the memory policy on its devices) and **train** (the fast
training path: a closed-form or recomputing autograd function, pieces of the memory policy on its devices).
Where its train path does not apply, an op may instead **checkpoint** its reference (recompute it in
backward, RNG state preserved). `choose` returns the final `Path`; an op runs what it is given and no op or
layer re-decides. Its inputs:

* export (`export.exporting`: ONNX, torch.export, `export_mode`): always the reference. While torch.compile traces
  the model in training (`export.compiling`, mmengine's `compile=True`), the first of the paths the op declares
  traceable (`Supports.traced`) that applies, on whole maps (sizes are symbolic): its compiled form where the
  module's `fast_compile` is on (the op's reference with what the compiled path keeps and recomputes; the enclosing
  compile compiles it), its train path where its `Fast` takes the input, its checkpoint; else the reference;
* the module's mode and autograd (`inference`, `trains_fast`, the only definitions of these conditions):
  inference needs eval mode and no autograd recording; the train path needs train mode, autograd recording
  and the module's `fast_train` switch;
* what the op's fast paths support (`Supports`, declared once by each op next to its implementations and
  passed here): half precision, autocast, active dropout, train-mode BatchNorms, the activation, whether
  a path exists on whole maps or only in pieces;
* the memory policy (`MemoryPolicy`): the piece size, only on the policy's devices (CPU by default; CUDA
  runs whole maps unless a user adds it to `devices`);
* whether the op runs inside a recomputed region (`recomputing`: a block under the backbone's `with_cp`, or a
  recomputed branch): there an op's checkpoint path would recompute it a second time in backward for memory the
  region's own recomputation already bounds, so it gets the reference instead (kept for backward only while
  that region's backward runs);
* where the op declares a compiled path (`Supports.compiled`: its reference compiled, `ops.compiled`) and the
  module's `fast_compile` switch is on, that path comes before the checkpoint and the plain reference; it is
  recomputed in backward by the op's own checkpoint, or inside a recomputed region by the region's.

Anything else is the reference, which is always correct.
"""
from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn as nn

from .dtypes import HALF_DTYPES, autocast_on, compute_dtype_of
from .export import compiling, exporting
from .tokens import channels_last

REFERENCE, INFERENCE, TRAIN, CHECKPOINT, COMPILED = 'reference', 'inference', 'train', 'checkpoint', 'compiled'


class Path(NamedTuple):
    """The implementation an op runs: `impl` one of 'reference', 'inference', 'train', 'checkpoint', 'compiled'; `piece`
    the elements per piece (the op's own unit, see `MemoryPolicy`) or None for whole maps."""
    impl: str
    piece: Optional[int] = None

    @classmethod
    def reference(cls):
        return cls(REFERENCE, None)


class Fast(NamedTuple):
    """What one fast path (inference or train) of an op runs on; outside it `choose` does not take it.

    half: fp16 / bf16 inputs (True, False, or 'autocast': only under autocast, where the parameters stay fp32).
    autocast: under autocast on the input's device. dropout: an active dropout (p > 0, train mode) among the op's
    modules. train_norm: a BatchNorm in train mode among them. act: a predicate every activation of the op must
    satisfy (None: any). pieces_only: the path exists only in pieces (whole maps take the reference). input_grad:
    the path needs the input to require a gradient (train paths whose backward is written for it). devices,
    dtypes: the device types and dtypes of the input the path runs on (None: any). channels_last: the path needs
    a channels-last (B, C, H, W) input. half_pieces: where it computes in half precision (`compute_dtype_of`:
    under autocast or on fp16 / bf16 inputs) the path takes the memory policy's pieces (False: whole maps there,
    e.g. where the pieces' partial sums would be rounded to that dtype one by one, less accurate than the
    reference's one product). compute_dtypes: the dtypes the path computes in (`compute_dtype_of`: the autocast
    dtype for an fp32 input under autocast, else the input's) that it runs for (None: any), e.g. a path faster
    than the reference only in bf16. half_recomputed: where it computes in half precision, the path also runs inside
    a recomputed region (`recomputing()`: a `with_cp` block; False: the reference there, whose saved tensors live
    only while the region's backward runs, where a path that recomputes in its own backward would run its forward
    a third time).
    """
    half: Union[bool, str] = True
    autocast: bool = True
    dropout: bool = True
    train_norm: bool = True
    act: Optional[Callable] = None
    pieces_only: bool = False
    input_grad: bool = False
    devices: Optional[tuple] = None
    dtypes: Optional[tuple] = None
    channels_last: bool = False
    half_pieces: bool = True
    compute_dtypes: Optional[tuple] = None
    half_recomputed: bool = True


class Supports(NamedTuple):
    """An op's fast paths, declared by the op (e.g. `ops.mlp.CONV_MLP`): `inference` and `train` are a
    `Fast` or None (no such path); `checkpoint`: where the train path does not apply in training, the
    reference is recomputed in backward instead of kept; `compiled`: a `Fast` or None, where the op's reference
    compiled (`ops.compiled`, recomputed in backward) runs in training with the module's `fast_compile` on,
    before the checkpoint (the train path, where it applies, still comes first); `traced`: the paths among
    'compiled', 'train' and 'checkpoint' that a whole-model torch.compile traces in training, on whole maps, in that
    order of preference (tested under compile against float64: tests/test_compile.py); () there: the reference."""
    inference: Optional[Fast] = Fast()
    train: Optional[Fast] = Fast()
    checkpoint: bool = False
    compiled: Optional[Fast] = None
    traced: tuple = ()


#: an op with an inference fast path and no train path
INFERENCE_ONLY = Supports(train=None)


#: how many recomputed regions (`ops.checkpoint.checkpointed`) enclose the code running now; a list so that the
#: region's forward and its recomputation in backward (on the autograd engine's thread on CUDA) see one count
_RECOMPUTED_DEPTH = [0]


def recomputing():
    """Whether the code running now is inside a recomputed region (`ops.checkpoint.checkpointed`): its forward
    or its recomputation in backward."""
    return _RECOMPUTED_DEPTH[0] > 0


class counted:
    """Context manager: `counter[0]` (a one-element list: a count seen by the forward and by a recomputation in
    backward alike) is one higher while the body runs."""

    def __init__(self, counter):
        self.counter = counter

    def __enter__(self):
        self.counter[0] += 1

    def __exit__(self, *exc):
        self.counter[0] -= 1
        return False


def recomputed_region():
    """Context manager: the body is (the forward or the recomputation of) a recomputed region."""
    return counted(_RECOMPUTED_DEPTH)


def inference(module):
    """The condition of every inference fast path (pieces, in-place and `out=` kernels): `module` in eval
    mode, no autograd recording, not being exported."""
    return not module.training and not torch.is_grad_enabled() and not exporting()


def trains_fast(module):
    """The condition of every fast training path (closed-form backwards, recomputation in backward):
    `module`'s `fast_train` switch on, train mode, autograd recording, not being exported (traced by torch.compile:
    yes, with the paths the op declares traceable)."""
    return (bool(getattr(module, 'fast_train', False)) and module.training and torch.is_grad_enabled()
            and (not exporting() or compiling()))


def _policy_piece(policy, x, whole_elems):
    if policy is None or policy.max_elems is None or x.device.type not in policy.devices:
        return None
    return policy.max_elems if whole_elems > 2 * policy.max_elems else None


def _dropout_active(modules):
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in modules)


def _norm_updates(modules):
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in modules)


def _takes(fast, x, modules, acts):
    """Whether the fast path `fast` runs on input `x` with the op's `modules` and `acts` (its piece aside)."""
    if fast is None:
        return False
    if x.dtype in HALF_DTYPES and (not fast.half or fast.half == 'autocast' and not autocast_on(x.device.type)):
        return False
    if not fast.autocast and autocast_on(x.device.type):
        return False
    if not fast.dropout and _dropout_active(modules):
        return False
    if not fast.train_norm and _norm_updates(modules):
        return False
    if fast.input_grad and not x.requires_grad:
        return False
    if fast.devices is not None and x.device.type not in fast.devices:
        return False
    if fast.dtypes is not None and x.dtype not in fast.dtypes:
        return False
    if fast.channels_last and not (x.dim() == 4 and channels_last(x)):
        return False
    if fast.compute_dtypes is not None and compute_dtype_of(x) not in fast.compute_dtypes:
        return False
    if not fast.half_recomputed and recomputing() and compute_dtype_of(x) in HALF_DTYPES:
        return False
    return fast.act is None or all(fast.act(a) for a in acts)


def _path(impl, fast, policy, x, whole_elems):
    """Path(impl, piece) for a fast path that applies, or None where it exists only in pieces and gets none."""
    piece = _policy_piece(policy, x, whole_elems)
    if piece is not None and not fast.half_pieces and compute_dtype_of(x) in HALF_DTYPES:
        piece = None
    return None if fast.pieces_only and piece is None else Path(impl, piece)


def fast_compile_switch(value, owner):
    """A `fast_compile` argument as the layers keep it: a bool, or a tuple of device types (the devices to run the
    compiled path on, replacing those the op declares); anything else raises, saying what is allowed."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        try:
            if all(torch.device(v).type == v for v in value):
                return tuple(value)
        except RuntimeError:
            pass
    raise ValueError(f'{owner}: fast_compile={value!r}; allowed: True (the compiled path on the devices it was '
                     f"measured faster on), False, or a list of device types such as ['cpu', 'cuda']")


def _compiled_fast(fast, switch):
    """The op's compiled `Fast` as a module's `fast_compile` switch sets it: None where either is off; True keeps
    the devices the op declares, a sequence of device types replaces them (e.g. ('cpu', 'cuda') to run it on a
    GPU, where it was not measured)."""
    if fast is None or not switch:
        return None
    return fast if switch is True else fast._replace(devices=tuple(switch))


def _traced_path(module, x, supports, modules, acts):
    """The `Path` of an op in training while torch.compile traces the model: the first of its `Supports.traced`
    paths that applies (see the module docstring), on whole maps; else the reference."""
    if COMPILED in supports.traced and supports.compiled is not None and getattr(module, 'fast_compile', False):
        return Path(COMPILED, None)
    fast = supports.train
    if TRAIN in supports.traced and _takes(fast, x, modules, acts) and not fast.pieces_only:
        return Path(TRAIN, None)
    if CHECKPOINT in supports.traced and supports.checkpoint:
        return Path(CHECKPOINT, None)
    return Path.reference()


def choose(module, x, whole_elems, supports=Supports(), *, modules=(), acts=(), policy=None):
    """The `Path` of `module`'s op on input `x`, whose whole map holds `whole_elems` elements in the op's
    unit of pieces.

    Args:
        module (nn.Module): the layer (its `training`, `fast_train` and `memory_policy` are read).
        x (Tensor): the op's input (device, dtype, requires_grad).
        whole_elems (int): size of the whole map in the op's piece unit.
        supports (Supports): what the op's fast paths support, as the op declares it. Default: both paths,
            every setting.
        modules (Sequence[nn.Module]): the op's dropouts and norms (their state is read). Default: ().
        acts (Sequence[nn.Module]): the op's activations. Default: ().
        policy (MemoryPolicy | None): the memory policy, when it belongs to another module than the one
            whose mode is read (e.g. a block's MLP). Default: None (`module.memory_policy`).

    Returns:
        Path: the implementation and its piece.
    """
    if exporting() and not compiling():
        return Path.reference()
    if policy is None:
        policy = getattr(module, 'memory_policy', None)
    if inference(module):
        fast = supports.inference
        path = _path(INFERENCE, fast, policy, x, whole_elems) if _takes(fast, x, modules, acts) else None
        return path or Path.reference()
    if trains_fast(module):
        if compiling():
            return _traced_path(module, x, supports, modules, acts)
        fast = supports.train
        path = _path(TRAIN, fast, policy, x, whole_elems) if _takes(fast, x, modules, acts) else None
        if path is None:
            on = _compiled_fast(supports.compiled, getattr(module, 'fast_compile', False))
            if on and _takes(on, x, modules, acts):
                path = Path(COMPILED, None)
            elif supports.checkpoint and not recomputing():
                path = Path(CHECKPOINT, None)
        return path or Path.reference()
    return Path.reference()
