"""What every op test checks: a fast implementation against the op's reference, values and gradients.

`assert_matches_reference(fast, reference, inputs)` runs both on the same float64 inputs (fresh leaf copies,
so their gradients are independent), compares the outputs and, when any input requires a gradient, the
gradients of a random projection of the output with respect to every such input.
"""
import torch


def leaf_copies(inputs):
    """Fresh leaves of the tensors in `inputs` (same requires_grad), other values unchanged."""
    return [t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in inputs]


def run_with_grads(fn, inputs, cotangent=None):
    """fn(*inputs) and the gradients of <fn(*inputs), cotangent> w.r.t. the inputs that require one."""
    inputs = leaf_copies(inputs)
    wrt = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    out = fn(*inputs)
    if not wrt:
        return out.detach(), []
    if cotangent is None:
        g = torch.Generator().manual_seed(0)
        cotangent = torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)
    grads = torch.autograd.grad(out, wrt, cotangent, allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if gr is None else gr for t, gr in zip(wrt, grads)]


def assert_matches_reference(fast, reference, inputs, rtol=1e-10, atol=1e-12, grads=True):
    """`fast(*inputs)` equals `reference(*inputs)` (and so do the gradients with `grads`), float64 tolerances
    by default."""
    if grads:
        out_f, g_f = run_with_grads(fast, inputs)
        out_r, g_r = run_with_grads(reference, inputs)
    else:
        with torch.no_grad():
            out_f, out_r = fast(*leaf_copies(inputs)), reference(*leaf_copies(inputs))
        g_f = g_r = []
    torch.testing.assert_close(out_f, out_r, rtol=rtol, atol=atol, msg=lambda m: f'output: {m}')
    for i, (a, b) in enumerate(zip(g_f, g_r)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, i=i: f'gradient {i}: {m}')
