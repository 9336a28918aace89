"""Recomputation (activation checkpointing), shared by the backbones' `with_cp` (whole blocks) and the
layers' / blocks' `fast_train` (one branch or one layer): in a training step only the inputs are kept for
backward and the function runs again there (non-reentrant torch.utils.checkpoint, RNG state preserved,
so dropout draws the same masks). BatchNorm running statistics are updated once, not again in the
recomputation. Same values and gradients; less memory for more backward time.

Recomputed regions do not nest: inside one (a block under `with_cp`, in its forward and in its recomputation; not
under torch.compile, whose traced graph decides what is recomputed) a branch or layer that would be checkpointed
runs plainly, and `ops.dispatch.choose` gives an op the reference where it would give its checkpoint path
(`dispatch.recomputing`). A nested recomputation would run the inner function a third time for memory that the
enclosing region already bounds: its saved tensors live only while that region's backward runs.

`keep_products=True` makes it selective (torch's selective activation checkpointing): the outputs of the
matrix products and of the fused attention kernel (`PRODUCTS`) are kept from the forward, everything else
(LayerNorm, reshapes, window partitions, elementwise ops) is recomputed. The recomputation then costs
about no multiply-adds and allocates little, for keeping the product outputs. The region's last product (an
attention's output projection), computed inside `output_product()`, is not kept: nothing in the region's backward
reads its output, and the recomputation stops before it (torch's early stop, its default: that product's inputs are
the last tensors the backward needs), so not keeping it costs no work.

`recomputed_output` is the smallest recomputation: a cheap function's output (a residual CPE, x + a depth-wise 3x3
conv of x, whose input its conv keeps anyway) is not kept where the code after it saves it for backward (a
LayerNorm's input, a recomputed branch's input); autograd keeps the recipe instead (the function and its
inputs, which are kept anyway) and runs the function again, with the forward's autocast state, where backward
reads the tensor. The recomputation gives the forward's values bit for bit (the same kernels on the same inputs).

Under `torch.compile` (mmengine's `compile=True` compiles the model's forward) the checkpointed function is
traced once; the compiler then decides from the traced graph what backward recomputes, and a BatchNorm's
running-statistics update is a mutation of its buffers in the forward graph, done once and never part of a
recomputation. There the BN freezer (a Python context manager, which torch.compile refuses as `context_fn`:
it accepts only the two `TorchDispatchMode`s of selective checkpointing) is neither needed nor passed
(`_bn_context_fn`).
"""
import contextlib
import inspect
from functools import partial

import torch
import torch.utils.checkpoint as cp
from torch.nn.modules.batchnorm import _BatchNorm

from .dispatch import counted, recomputed_region, recomputing, trains_fast


@contextlib.contextmanager
def _frozen_bn_statistics(module):
    """BatchNorms keep normalising with batch statistics but do not update their running ones (momentum
    0): the recomputation of a checkpointed function must not count the batch twice."""
    bns = [m for m in module.modules() if isinstance(m, _BatchNorm) and m.training]
    saved = [(m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
             for m in bns]
    for m in bns:
        m.momentum = 0.
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(bns, saved):
            m.momentum = momentum
            if tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def _contexts(module):
    """torch.utils.checkpoint's `context_fn`: nothing special in forward, frozen BN statistics in the
    recomputation."""
    return contextlib.nullcontext(), _frozen_bn_statistics(module)


def _updates_bn_statistics(module):
    """Whether running `module` updates BatchNorm running statistics: it holds a train-mode BatchNorm that
    tracks them."""
    return any(isinstance(m, _BatchNorm) and m.training and m.track_running_stats for m in module.modules())


def _bn_context_fn(module):
    """The `context_fn` that keeps `module`'s BatchNorm statistics from being updated again in the
    recomputation, or None where none is needed: no module, no train-mode BatchNorm in it, or under
    torch.compile (see the module docstring)."""
    if module is None or torch.compiler.is_compiling() or not _updates_bn_statistics(module):
        return None
    return partial(_contexts, module)


_aten = torch.ops.aten


def _sdpa_kernels():
    """The forward kernels of F.scaled_dot_product_attention that this torch build has (every backend, every
    overload): the math fallback, flash (CUDA, CPU; `quantized`), memory-efficient, cuDNN, MPS and the
    overridable fused kernel of other devices."""
    names = ('_scaled_dot_product_attention_math', '_scaled_dot_product_attention_math_for_mps',
             '_scaled_dot_product_flash_attention', '_scaled_dot_product_flash_attention_for_cpu',
             '_scaled_dot_product_efficient_attention', '_scaled_dot_product_cudnn_attention',
             '_scaled_dot_product_fused_attention_overrideable')
    packets = [getattr(_aten, n) for n in names if hasattr(_aten, n)]
    return {getattr(p, o) for p in packets for o in p.overloads()}


#: ops whose outputs `keep_products` keeps for backward instead of recomputing them: the matrix products and
#: every fused attention kernel
PRODUCTS = frozenset({_aten.addmm.default, _aten.mm.default, _aten.bmm.default} | _sdpa_kernels())


#: how many `output_product` contexts enclose the code running now (see `dispatch.counted`)
_OUTPUT_PRODUCT = [0]


def output_product():
    """Context manager around the last product of a function that may run selectively recomputed
    (`checkpointed(keep_products=True)`), e.g. an attention's output projection: its output is not kept (see the
    module docstring). Elsewhere it changes nothing; under torch.compile (whose partitioner decides what is kept)
    it is a null context."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else counted(_OUTPUT_PRODUCT)


def _keep_products(ctx, op, *args, **kwargs):
    keep = op in PRODUCTS and not _OUTPUT_PRODUCT[0]
    return cp.CheckpointPolicy.MUST_SAVE if keep else cp.CheckpointPolicy.PREFER_RECOMPUTE


#: whether this torch's checkpoint can pass what a selective recomputation keeps through the surrounding
#: `saved_tensors_hooks` (as every other saved tensor: `torch.autograd.graph.save_on_cpu` moves it too, and the op
#: profile counts it, `analysis.opprofile`); where it can, it does (eager mode)
_KEPT_THROUGH_HOOKS = 'respect_saved_tensors_hooks' in inspect.signature(cp.checkpoint).parameters


def checkpointed(fn, *args, enabled=True, module=None, keep_products=False):
    """fn(*args); when `enabled` and autograd records, checkpointed (see the module docstring), unless this runs
    inside another recomputed region (then plainly: regions do not nest). `module`: the module whose BatchNorms
    `fn` runs (their statistics are updated once; not with `keep_products`, which is for functions without
    BatchNorm)."""
    if enabled and torch.is_grad_enabled() and not recomputing():
        def region(*a):
            with recomputed_region():
                return fn(*a)
        if torch.compiler.is_compiling():   # the compiler traces fn and decides what backward recomputes
            region = fn
        if keep_products:
            kw = dict(context_fn=partial(cp.create_selective_checkpoint_contexts, _keep_products))
            if _KEPT_THROUGH_HOOKS and not torch.compiler.is_compiling():
                kw['respect_saved_tensors_hooks'] = True
        else:
            context_fn = _bn_context_fn(module)
            kw = {} if context_fn is None else dict(context_fn=context_fn)
        return cp.checkpoint(region, *args, use_reentrant=False, **kw)
    return fn(*args)


class _Recipe:
    """What `recomputed_output` keeps instead of a saved tensor: the function, its inputs (tensors as `_Input`), the
    forward's autocast state (device type, enabled, dtype), and where the saved tensor lies in the output."""
    __slots__ = ('fn', 'args', 'autocast', 'view')

    def __init__(self, fn, args, autocast, view):
        self.fn, self.args, self.autocast, self.view = fn, args, autocast, view

    def tensor(self):
        """The saved tensor, computed again as in the forward: autograd recording (the train paths the forward
        chose; nothing it saves reaches the hooks outside), the forward's autocast state."""
        args = [a.tensor() if isinstance(a, _Input) else a for a in self.args]
        device, enabled, dtype = self.autocast
        with torch.enable_grad(), torch.autocast(device, dtype, enabled=enabled), \
                torch.autograd.graph.saved_tensors_hooks(_same, _same):
            out = self.fn(*args).detach()
        shape, stride, offset = self.view
        return out.as_strided(shape, stride, out.storage_offset() + offset)


class _Input:
    """A tensor input of a recipe: its data (detached) and whether it required a gradient in the forward."""
    __slots__ = ('data', 'requires_grad')

    def __init__(self, t):
        self.data, self.requires_grad = t.detach(), t.requires_grad

    def tensor(self):
        return self.data.detach().requires_grad_(self.requires_grad)


def _same(t):
    return t


#: the saved-tensor hooks in effect now (None: none), or None where this torch cannot say or has no per-device
#: autocast state (`get_autocast_dtype`, torch >= 2.4): there `recomputed_output` keeps its output as autograd would
_top_hooks = (getattr(torch._C._autograd, '_top_saved_tensors_default_hooks', None)
              if hasattr(torch, 'get_autocast_dtype') else None)


@contextlib.contextmanager
def recomputed_output(module, fn, *args):
    """Context manager: runs fn(*args) and gives its output (a tensor); inside the `with`, wherever autograd saves
    that output (or a view of it) for backward, it keeps the recipe instead and recomputes the output there
    (see the module docstring). For a cheap fn whose tensor inputs are kept for backward anyway.

    Active when `module` trains fast (`dispatch.trains_fast`), the output (a plain tensor, on a device with
    autocast: not on the meta device) requires a gradient, and neither torch.compile traces (its partitioner decides
    what is kept) nor a recomputed region runs (ours or torch's checkpoint: nothing in it is kept); elsewhere it only
    runs fn. Saved-tensor hooks around it (`save_on_cpu`, the op profile's counting) still see every other saved
    tensor."""
    out = fn(*args)
    active = (type(out) is torch.Tensor and trains_fast(module) and out.requires_grad and not recomputing()
              and not torch.compiler.is_compiling() and _top_hooks is not None
              and torch.amp.is_autocast_available(out.device.type))
    hooks = _top_hooks(False) if active else None
    if not active or (hooks is not None and getattr(hooks[0], '_checkpoint_internal', False)):
        yield out
        return
    outer_pack, outer_unpack = hooks if hooks is not None else (_same, _same)
    # the inputs without their graph, and what identifies the output, not the output: autograd keeps the hooks
    # (their closures) as long as what they saved
    inputs = tuple(_Input(a) if torch.is_tensor(a) else a for a in args)
    storage, version, offset, dtype = out.untyped_storage().data_ptr(), out._version, out.storage_offset(), out.dtype
    device = out.device.type
    autocast = device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)

    def pack(t):
        if t.untyped_storage().data_ptr() == storage and t._version == version and t.dtype == dtype:
            return _Recipe(fn, inputs, autocast, (t.shape, t.stride(), t.storage_offset() - offset))
        return (outer_pack(t),)

    def unpack(packed):
        return packed.tensor() if isinstance(packed, _Recipe) else outer_unpack(packed[0])

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield out


def recomputed(module, fn, x, *args):
    """fn(x, *args), recomputed in backward when `module` recomputes (`ops.dispatch.trains_fast`: its `fast_train`
    switch, train mode, autograd recording) and x needs a gradient."""
    return checkpointed(fn, x, *args, enabled=trains_fast(module) and x.requires_grad, module=module)


def recomputed_branch(block, norm, module, x, *args, keep_products=False):
    """A pre-norm residual branch `module(x, *args, norm=norm)` (= module(norm(x), *args); `module` takes
    `norm=`), recomputed in backward when `block` recomputes:
    only x (the residual stream, which autograd keeps anyway) is kept, the LayerNorm included in the
    recomputation; with `keep_products` also the outputs of its matrix products (see the module docstring)."""
    def branch(t, *a):
        return module(t, *a, norm=norm)
    return checkpointed(branch, x, *args, enabled=trains_fast(block), module=module, keep_products=keep_products)
