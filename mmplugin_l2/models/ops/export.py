"""Export mode: when a model is traced for ONNX / torch.export / torch.compile, every layer takes its plain
formulation, the one autograd runs in training.

The inference fast paths (pieces of tokens and of rows, in-place and `out=` kernels, the complex-valued RoPE,
size-dependent Python branches) are there for eager speed and memory; a tracer would bake their loop counts
and branch decisions into the graph (fixed input sizes) or cannot express them (complex tensors in ONNX,
`out=` arguments). In export mode the layers use whole maps, out-of-place ops, a real-valued RoPE and
branch-free padding, so one graph serves every input size. Same function, same values up to float rounding.

`export_mode()` turns it on explicitly (tools/deployment/pytorch2onnx.py does); it is also on while
`torch.onnx`, `torch.export` or `torch.compile` trace the model.

Sizes stay symbolic in export mode: no Python `float()` / `int()` of a size, no loop over the batch, no slice
end computed from H or W, no `unflatten` whose output sizes are read back (the TorchScript ONNX exporter bakes
those in). `export_onnx` writes one ONNX graph with dynamic batch, height and width this way.
`stage_boundary()` splits a compiled backbone into one graph per stage.
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


def compiling():
    """True while `torch.compile` traces the model (mmengine's `compile=True`), not while it is exported (ONNX,
    torch.export, `export_mode()`). There the layers still take their export forms (whole maps, out-of-place ops, a
    real-valued RoPE), and in training `ops.dispatch.choose` gives an op the fast path it declares traceable
    (`Supports.traced`) instead of its reference."""
    compiler = getattr(torch, 'compiler', None)
    if _depth or compiler is None or not compiler.is_compiling():
        return False
    return not compiler.is_exporting() and not torch.onnx.is_in_onnx_export()


def stage_boundary():
    """Called by the backbones as the first statement of each function that runs a stage (or its downsampling).
    Under `torch.compile` (not torch.export) it is a graph break: the stage is compiled as its own frame and its
    map size becomes a fresh symbol instead of a nested ceil / floor division of the input size. With
    `dynamic=True` those nested expressions (stem, padding to the window size, four stride-2 downsamplings) made
    the compiler's shape reasoning very slow (docs/deployment.md); with the breaks a second input size reuses the
    graphs. First in its function, the break comes before anything is traced there: dynamo restarts a frame's
    analysis at a graph break, so a break after a stage's layers in the same frame would trace them twice. A
    no-op everywhere else (eager, ONNX export, torch.export). `torch.compile(fullgraph=True)` is therefore not
    supported."""
    compiler = getattr(torch, 'compiler', None)
    if compiler is not None and compiler.is_compiling() and not compiler.is_exporting():
        torch._dynamo.graph_break()


def _onnx_expm1(g, x):
    """aten::expm1 for the TorchScript ONNX exporter (ONNX has no Expm1): tanh(x/2) (exp(x) + 1), which equals
    exp(x) - 1 without its cancellation for small |x| (ResT's EMSA relies on that precision)."""
    half = g.op('Constant', value_t=torch.tensor(0.5))
    one = g.op('Constant', value_t=torch.tensor(1.0))
    return g.op('Mul', g.op('Tanh', g.op('Mul', x, half)), g.op('Add', g.op('Exp', x), one))


def export_onnx(module, x, path, dynamic=True, input_name='input', output_names=None, opset=17):
    """Write `module(x)` to the ONNX file `path` in export mode, without autograd, with the TorchScript-based
    exporter (`torch.onnx.export(dynamo=False)`): with `dynamic`, the batch, height and width of the input
    (and every output dimension that depends on them) are symbolic. The dynamo exporter (`torch.export`)
    cannot do that for these models (docs/deployment.md), so it is used only for fixed sizes
    (dynamic=False)."""
    with torch.no_grad(), export_mode():
        if not dynamic:
            ep = torch.export.export(module, (x,), strict=False)
            torch.onnx.export(ep, (x,), path, dynamo=True, verbose=False)
            return
        torch.onnx.register_custom_op_symbolic('aten::expm1', _onnx_expm1, opset)
        outs = module(x)
        n_out = 1 if torch.is_tensor(outs) else len(outs)
        names = list(output_names or [f'output{i}' for i in range(n_out)])
        axes = {input_name: {0: 'batch', 2: 'height', 3: 'width'}}
        axes.update({name: {0: 'batch'} for name in names})   # the exporter adds the spatial axes it infers
        torch.onnx.export(module, (x,), path, dynamo=False, input_names=[input_name], output_names=names,
                          dynamic_axes=axes, opset_version=opset)
