"""What every op test checks: an implementation of the op against its oracle, values and gradients.

The oracle of an op is its naive form, `ops/<op>/naive.py` (the paper's formula, plain autograd): the
reference and every fast path are compared with it by `assert_matches_naive(impl, naive, inputs)`.
`assert_matches_reference` is the same check with the op's reference as the oracle (e.g. a device's fast path
against the reference on the same device); `assert_matches` with any other oracle (a kernel against a loop).

Both run the two functions on the same float64 inputs (fresh leaf copies, so their gradients are
independent), compare the outputs and, when any input requires a gradient, the gradients of a random
projection of the output with respect to every such input.

Under autocast the oracle is the same: `assert_autocast_no_worse(fast, reference, naive, inputs, dtype)` runs the
fast path and the reference on float32 copies of the inputs under CPU autocast to `dtype`, and requires the fast
path's errors against the naive form in float64 (output and every gradient) to be no worse than the reference's.
Inputs that arrive in the autocast dtype in the model: `half_values` for the float64 leaves, `cast_inputs` for the
functions compared.
"""
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
    grads = torch.autograd.grad(out, wrt, cotangent.to(out.dtype), allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if gr is None else gr for t, gr in zip(wrt, grads)]


def assert_matches(impl, oracle, inputs, rtol=1e-10, atol=1e-12, grads=True):
    """`impl(*inputs)` equals `oracle(*inputs)` (and so do the gradients with `grads`; without, both run
    under no_grad), float64 tolerances by default."""
    if grads:
        out_i, g_i = run_with_grads(impl, inputs)
        out_o, g_o = run_with_grads(oracle, inputs)
    else:
        with torch.no_grad():
            out_i, out_o = impl(*leaf_copies(inputs)), oracle(*leaf_copies(inputs))
        g_i = g_o = []
    torch.testing.assert_close(out_i, out_o, rtol=rtol, atol=atol, msg=lambda m: f'output: {m}')
    for i, (a, b) in enumerate(zip(g_i, g_o)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, i=i: f'gradient {i}: {m}')


def assert_matches_naive(impl, naive, inputs, rtol=1e-10, atol=1e-12, grads=True):
    """`impl` (the reference or a fast path of an op) against the op's naive form: `assert_matches`."""
    assert_matches(impl, naive, inputs, rtol, atol, grads)


def assert_matches_reference(fast, reference, inputs, rtol=1e-10, atol=1e-12, grads=True):
    """`fast` against the op's reference: `assert_matches`."""
    assert_matches(fast, reference, inputs, rtol, atol, grads)


def autocast_errors(fn, naive, inputs, dtype, norm='max'):
    """Relative errors, max |a - ref| / max |ref| (`norm='l2'`: ||a - ref|| / ||ref||), of `fn` run on float32
    copies of the float64 `inputs` under CPU autocast to `dtype` against `naive` on the float64 inputs: [output,
    gradient of each input that requires one] (the gradients of the same random projection of the output)."""
    out_ref, g_ref = run_with_grads(naive, inputs)
    g = torch.Generator().manual_seed(0)
    cotangent = torch.randn(out_ref.shape, generator=g, dtype=out_ref.dtype)
    out_ref, g_ref = run_with_grads(naive, inputs, cotangent)
    low = [t.detach().float().requires_grad_(t.requires_grad) if torch.is_tensor(t) and t.is_floating_point() else t
           for t in inputs]
    with torch.autocast('cpu', dtype=dtype):
        out, grads = run_with_grads(fn, low, cotangent.float())
    assert all(gr.dtype == t.dtype for gr, t in zip(grads, [t for t in low if torch.is_tensor(t) and t.requires_grad]))

    def rel(a, b):
        if norm == 'l2':
            return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()
        return ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
    return [rel(out, out_ref)] + [rel(a, b) for a, b in zip(grads, g_ref)]


def half_values(t, dtype):
    """A float64 leaf of `t`'s values rounded to `dtype` (same requires_grad): inputs a layer receives in that dtype
    under autocast, so that the float64 oracle and the half-precision run start from the same values."""
    return t.detach().to(dtype).double().requires_grad_(t.requires_grad)


def cast_inputs(fn, dtype, n=1):
    """`fn` with its first `n` inputs cast to `dtype` first (as a layer's linears give them under autocast; the cast
    is part of the graph, so the gradients reach the float32 leaves)."""
    return lambda *a: fn(*(t.to(dtype) for t in a[:n]), *a[n:])


def assert_autocast_no_worse(fast, reference, naive, inputs, dtype, slack=1.1, norm='max'):
    """Under CPU autocast to `dtype`, `fast`'s errors against `naive` in float64 (`autocast_errors`: output and
    every gradient, in the `norm`) are at most `slack` times the reference's under the same autocast. `norm='l2'`
    where the largest error of a few thousand half-precision roundings moves by tens of percent with the seed
    and the two paths round differently."""
    e_fast = autocast_errors(fast, naive, inputs, dtype, norm)
    e_ref = autocast_errors(reference, naive, inputs, dtype, norm)
    names = ['output'] + [f'gradient {i}' for i in range(len(e_fast) - 1)]
    for name, a, b in zip(names, e_fast, e_ref):
        assert a <= slack * b, f'{name}: {dtype} autocast error {a:.3g} of the fast path, {b:.3g} of the reference'
    return e_fast, e_ref


class Calls(list):
    """(label, positional arguments) of each call `record_calls` saw, in order."""

    @property
    def names(self):
        return [label for label, _ in self]


def record_calls(monkeypatch, namespace, **labels):
    """Which fast implementation of an op ran: each `namespace.<attr>` of `labels` (attr=label), a function or an
    autograd Function (its `apply`), is replaced by a wrapper that appends (label, args) to the returned `Calls`
    and runs the original."""
    calls = Calls()

    def wrap(label, fn):
        return lambda *a, **k: calls.append((label, a)) or fn(*a, **k)
    for attr, label in labels.items():
        orig = getattr(namespace, attr)
        if isinstance(orig, type):
            monkeypatch.setattr(namespace, attr, types.SimpleNamespace(apply=wrap(label, orig.apply)))
        else:
            monkeypatch.setattr(namespace, attr, wrap(label, orig))
    return calls


class RecordOps(TorchDispatchMode):
    """While active, runs every aten operator as it is and then calls `record(func, args, kwargs, out)`: what a test
    records of the operators some code runs (their kinds, dtypes, copies, new tensors), forward and backward."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out
