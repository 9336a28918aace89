"""Export mode: when a model is traced for ONNX / torch.export / torch.compile, every layer takes its plain
formulation, the one autograd runs in training.

The inference fast paths (token chunks, row bands, in-place and `out=` kernels, the complex-valued RoPE,
size-dependent Python branches) are there for eager speed and memory; a tracer would bake their loop counts
and branch decisions into the graph (fixed input sizes) or cannot express them (complex tensors in ONNX,
`out=` arguments). In export mode the layers use whole maps, out-of-place ops, a real-valued RoPE and
branch-free padding, so one graph serves every input size. Same function, same values up to float rounding.

`export_mode()` turns it on explicitly (tools/deployment/pytorch2onnx.py does); it is also on while
`torch.onnx`, `torch.export` or `torch.compile` trace the model.
"""
import contextlib

import torch

_depth = 0


@contextlib.contextmanager
def export_mode():
    """Within this context every layer takes its export-friendly path."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def exporting():
    """True in `export_mode()` and while torch traces the model (ONNX export, torch.export, compile). Not
    for a plain `torch.jit.trace` (the FLOPs counter traces the eager inference paths)."""
    if _depth:
        return True
    compiler = getattr(torch, 'compiler', None)
    if compiler is not None:
        if getattr(compiler, 'is_compiling', lambda: False)() or getattr(compiler, 'is_exporting', lambda: False)():
            return True
    return torch.onnx.is_in_onnx_export()


def eager_inference():
    """No autograd recorded and not exporting: a function (not a module) may use kernels that have no
    autograd formula. Modules decide with `memory.inference(module)`, which also asks for eval mode."""
    return not torch.is_grad_enabled() and not exporting()
