"""`ops.ttt.compiled_ttt_core` (the TTT core's reference with its SwiGLU heads compiled by inductor through
`ops.compiled.Compiled`, the path `ops.ttt.TTT` declares inside `with_cp` blocks under bf16 autocast) against the naive form in float64 and under
bf16 autocast, and its eager fallback where torch.compile fails. Apart from tests/ops/test_ttt.py so that
pytest-xdist can run its compilations beside that file."""
import pytest
import torch

import mmplugin_l2.models.ops.ttt as ttt_op
from mmplugin_l2.models.ops.ttt import swiglu_heads, ttt_core
from mmplugin_l2.models.ops.ttt.naive import ttt_core_naive
from ops.harness import assert_autocast_no_worse, assert_matches_naive, cast_inputs, half_values
from ops.test_ttt import HW, _core, _core_inputs, _rot


def test_compiled_core_matches_naive():
    """`compiled_ttt_core` (the reference, its SwiGLU heads compiled by inductor with dynamic shapes) = the naive
    form in float64: values and the gradients of qkv, W1, W2 and w3, with RoPE; a second map size runs without an
    error (dynamic). The RoPE table reaches the compiled function as its real pair (`rope.real_table`): one graph,
    no graph break."""
    from torch._dynamo.utils import counters
    counters.clear()
    rot, nh = _rot(8, True), 2
    assert_matches_naive(_core(ttt_op.compiled_ttt_core, rot, nh), _core(ttt_core_naive, rot, nh),
                         _core_inputs(nh=nh, d=4))
    hw = (3, 6)
    rot = _rot(8, True, hw)
    assert_matches_naive(_core(ttt_op.compiled_ttt_core, rot, nh, hw), _core(ttt_core_naive, rot, nh, hw),
                         _core_inputs(nh=nh, d=4, hw=hw))
    assert ttt_op.compiled_swiglu_heads.failed is None
    assert not counters['graph_break'], dict(counters['graph_break'])


def test_compiled_core_under_bf16_autocast_no_worse_than_the_reference():
    """Under bf16 autocast (where `TTT` declares the compiled path, inside `with_cp` blocks), on bf16 qkv tokens:
    the compiled reference against the naive form in float64, output and every gradient, no worse than the eager
    reference under the same autocast (L2 norm; the compiler fuses the elementwise chains and may keep a
    product's fp32 result where eager rounds it)."""
    nh, d, b, dtype = 2, 4, 2, torch.bfloat16
    rot = _rot(nh * d, True)
    rot32 = rot.to(torch.complex64)
    g = torch.Generator().manual_seed(0)
    inputs = [half_values(torch.randn(b, HW[0] * HW[1], 3 * nh * d + 3 * d, generator=g, dtype=torch.float64)
                          .requires_grad_(), dtype)]
    inputs += [(torch.randn(*s, generator=g, dtype=torch.float64) * .3).requires_grad_()
               for s in ((1, nh, d, d), (1, nh, d, d), (d, 1, 3, 3))]
    e_fast, _ = assert_autocast_no_worse(cast_inputs(_core(ttt_op.compiled_ttt_core, rot32, nh), dtype),
                                         cast_inputs(_core(ttt_core, rot32, nh), dtype),
                                         _core(ttt_core_naive, rot, nh), inputs, dtype, norm='l2')
    assert max(e_fast) < 5e-2, e_fast


def test_compiled_core_specialises_on_the_width_only(monkeypatch):
    """`compiled_swiglu_heads` compiles once per layer width, not for every map size and batch (above 1: torch
    specialises sizes of 1): its arguments' channel sizes are static (`_compile_form`), the batch and the map's sizes
    symbolic. Counted on the graphs dynamo hands to a recording backend (no code generation), from `Compiled`'s own
    torch.compile call (dynamic=True); qkv's sizes as the graphs see them."""
    from mmplugin_l2.models.ops.compiled import Compiled
    graphs = []

    def record(gm, example_inputs):
        graphs.append([tuple(n.meta['example_value'].shape) for n in gm.graph.nodes
                       if n.op == 'placeholder' and isinstance(n.meta.get('example_value'), torch.Tensor)])
        return gm.forward
    compile_ = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda fn, **kw: compile_(fn, backend=record, **kw))
    compiled = Compiled(swiglu_heads, 'the SwiGLU heads', prepare=ttt_op._compile_form)

    def core(qkv, rot, w1, w2, w3, hw_shape, num_heads, scale, lr):
        return compiled(qkv, rot, w1, w2, num_heads, scale, lr)
    torch._dynamo.reset()
    counts = []
    for b, nh, d, hw in [(2, 2, 4, HW), (3, 2, 4, (3, 6)), (2, 2, 4, (6, 4)), (2, 4, 4, HW), (2, 2, 8, (3, 6))]:
        _core(core, _rot(nh * d, True, hw), nh, hw)(*_core_inputs(b=b, nh=nh, d=d, hw=hw)).sum().backward()
        counts.append(len(graphs))
    torch._dynamo.reset()
    assert compiled.failed is None
    assert counts == [1, 1, 1, 2, 3], counts                    # new map sizes and batches: no; new widths: yes
    for shapes in graphs:       # qkv (B, N, 3C + 3d), the tables (N, C/2), W1, W2 (1, H, d, d)
        (qkv,) = [s for s in shapes if len(s) == 3]
        assert all(isinstance(s, torch.SymInt) for s in qkv[:2]) and type(qkv[2]) is int, qkv
        assert all(type(s) is int for t in shapes if len(t) == 4 for s in t), shapes
        assert all(isinstance(t[0], torch.SymInt) and type(t[1]) is int for t in shapes if len(t) == 2), shapes


def test_compile_failure_warns_once_and_runs_eager(monkeypatch):
    """Where torch.compile fails (no C++ compiler, an unsupported torch), `Compiled` warns once, saying what failed
    and how to turn it off, and runs the eager function from then on (same values); an error of the function
    itself on its inputs is raised as the function raises it, without a warning."""
    import warnings

    from mmplugin_l2.models.ops.compiled import Compiled

    def no_compiler(fn, **kwargs):
        def fail(*args):
            raise RuntimeError('InvalidCxxCompiler: No working C++ compiler found\nmore')
        return fail
    monkeypatch.setattr(torch, 'compile', no_compiler)
    core = Compiled(ttt_core, 'the TTT core')
    rot, nh = _rot(8, True), 2
    inputs = _core_inputs(nh=nh, d=4)
    with pytest.warns(RuntimeWarning, match=r'the TTT core: torch.compile could not compile it \(RuntimeError: '
                                            r'InvalidCxxCompiler: No working C\+\+ compiler found\).*'
                                            r'fast_compile=False'):
        out = _core(core, rot, nh)(*inputs)
    assert torch.equal(out, _core(ttt_core, rot, nh)(*inputs)) and core.failed.startswith('RuntimeError')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert torch.equal(_core(core, rot, nh)(*inputs), out)          # no second warning

    def wrong(x):
        raise ValueError('bad input')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(ValueError, match='bad input'):
            Compiled(wrong, 'f')(torch.zeros(1))


def test_compiled_inside_a_recomputation_lets_the_checkpoint_stop_it(monkeypatch):
    """torch.utils.checkpoint (non-reentrant) stops a recomputation in backward by raising from inside the
    recomputed code once it has every tensor it needs: where that happens inside a `Compiled` function (the last op
    of a `with_cp` block), `Compiled` lets it through (no warning, no eager rerun, `failed` stays None) and the
    gradient is that of the plain function. torch.compile is replaced by the function itself here, which runs the
    same Python and raises the same way."""
    import warnings

    from torch.utils.checkpoint import checkpoint

    from mmplugin_l2.models.ops.compiled import Compiled
    monkeypatch.setattr(torch, 'compile', lambda fn, **kwargs: fn)
    core = Compiled(lambda t: (t * t).exp(), 'f')
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        checkpoint(lambda t: core(t.sin()), x, use_reentrant=False).sum().backward()
    assert core.failed is None
    want = (2 * x.sin() * (x.sin() ** 2).exp() * x.cos()).detach()
    torch.testing.assert_close(x.grad, want, rtol=1e-12, atol=0)
