"""Compiled fast paths: an op's reference compiled by inductor (vectorised C++ on CPU, Triton on CUDA, from the one
Python source), its forward and backward fused into few passes over the token maps.

`Compiled(fn, name, prepare)` compiles `fn` on its first call (`torch.compile(dynamic=True)`: sizes are symbolic, so a new
image size or batch does not recompile; torch's caches keep the compiled code across processes, so a later process
loads it instead of compiling). `prepare` may mark the sizes that are fixed by the layer's width static
(`static_sizes`, e.g. the channels): inductor's loops over symbolic sizes compute every index at run time and are
not vectorised across a layout change, so the same code with the channel sizes static runs several times faster;
`fn` is then compiled once per width (once per stage of a pyramid) and still once for every image size. Where it cannot compile (no C++ compiler, a torch or
device inductor does not support) it warns once and runs `fn` itself from then on: same values, eager speed. An
error of `fn` itself (a wrong input) is raised as `fn` raises it. `prepare` (optional) converts the arguments
eagerly before every call, compiled or not, into a form that compiles without graph breaks or unsupported kernels
(e.g. `rope.real_table`: inductor has no complex kernels); `fn` must compute the same function on either form.

The compiled form keeps what autograd through the reference keeps (the compiler's default partition of forward and
backward), so an op runs it recomputed in backward: under its own checkpoint, or plainly inside a recomputed region (a
block under `with_cp`), where those tensors live only while that region's backward runs (`Supports.compiled`, `Fast`
as for the other paths, and the module's `fast_compile` switch; `ops.dispatch.choose` decides). With `memory_budget`
the compiler partitions under AOTAutograd's activation memory budget instead (`activation_memory_budget`: the
fraction of the default partition's saved bytes it may keep): it keeps what is cheap to keep and recomputes the rest
inside the compiled backward, fused, where a checkpoint would run the whole compiled forward again.
"""
import contextlib
import types
import warnings

import torch
import torch.utils.checkpoint

#: exceptions that are not failures: torch.utils.checkpoint stops a recomputation in backward by raising this from
#: inside the recomputed code (here: the compiled function) once every tensor it needs is recomputed
_CONTROL_FLOW = tuple(e for e in (getattr(torch.utils.checkpoint, '_StopRecomputationError', None),) if e)


def static_sizes(t, dims=None):
    """Mark the sizes `dims` (default: all) of tensor `t` static for `torch.compile(dynamic=True)`: the compiled
    code specialises on them (a call with other sizes there compiles again) while the other sizes stay symbolic.
    Returns `t`; without `torch._dynamo.mark_static` (an older torch) it does nothing."""
    mark = getattr(getattr(torch, '_dynamo', None), 'mark_static', None)
    if mark is not None:
        for i in range(t.dim()) if dims is None else dims:
            mark(t, i % t.dim())
    return t


def _budget(memory_budget):
    """The compile context of `Compiled`'s memory budget (nothing for None, or on a torch without the setting)."""
    config = getattr(getattr(torch, '_functorch', None), 'config', None)
    if memory_budget is None or not hasattr(config, 'activation_memory_budget'):
        return contextlib.nullcontext()
    return config.patch(activation_memory_budget=memory_budget)


def _own_code(fn):
    """`fn` with a code object of its own: torch.compile caches compiled code per code object, so a second
    `Compiled` of the same function under another partition must not find the first one's."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class Compiled:
    """`fn` compiled on first use (see the module docstring); call it as `fn`. `memory_budget` (float | None):
    AOTAutograd's activation memory budget for its forward / backward partition (None: the default partition)."""

    def __init__(self, fn, name, prepare=None, memory_budget=None):
        self.fn, self.name, self.prepare, self.memory_budget = fn, name, prepare, memory_budget
        self._compiled, self.failed = None, None

    def __call__(self, *args):
        if torch.compiler.is_compiling():   # inside a compiled model: `fn` is traced into the enclosing graph
            return self.fn(*args)
        if self.prepare is not None:
            args = self.prepare(*args)
        if self.failed is None:
            try:
                if self._compiled is None:
                    fn = self.fn if self.memory_budget is None else _own_code(self.fn)
                    self._compiled = torch.compile(fn, dynamic=True)
                with _budget(self.memory_budget):
                    return self._compiled(*args)
            except _CONTROL_FLOW:
                raise
            except Exception as e:  # noqa: BLE001 (any failure of the compiler: the eager function runs instead)
                out = self.fn(*args)           # fn's own error on these inputs is raised here, as fn raises it
                self.failed = f'{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ""}'
                warnings.warn(f'{self.name}: torch.compile could not compile it ({self.failed[:300]}); the eager '
                              f'{self.name} runs instead from now on (same values, without the fused passes). '
                              f'Pass fast_compile=False to the backbone to skip the attempt.', RuntimeWarning,
                              stacklevel=2)
                return out
        return self.fn(*args)
