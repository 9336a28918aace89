"""`ops.ttt.compiled_ttt_core` (the TTT core's SwiGLU heads compiled by inductor through `ops.compiled.Compiled`, the
path `ops.ttt.TTT` declares inside `with_cp` blocks under bf16 autocast) against the naive form in float64 and
under bf16 autocast, and its eager fallback where torch.compile fails. Apart from tests/ops/test_ttt.py so that
pytest-xdist can run its compilations beside that file."""
import functools

import pytest
import torch

import mmplugin_l2.models.ops.ttt as ttt_op
from mmplugin_l2.models.ops.ttt import ttt_core
from mmplugin_l2.models.ops.ttt.naive import ttt_core_naive
from ops.harness import assert_autocast_no_worse, assert_matches_naive, cast_inputs, half_values
from ops.test_ttt import HW, LR, SCALE, _core, _core_inputs, _rot


def _projected(fn, rot, nh, hw=HW):
    """`compiled_ttt_core` (which takes the tokens and the qkv projection) called as `_core` calls `ttt_core`: the
    qkv tokens through an identity projection (its rows taken in any order give the tokens in that order, exactly)."""
    def run(qkv, w1, w2, w3):
        proj = torch.nn.Linear(qkv.shape[-1], qkv.shape[-1]).to(qkv.dtype)
        with torch.no_grad():
            proj.weight.copy_(torch.eye(qkv.shape[-1]))
            proj.bias.zero_()
        return fn(qkv, proj, rot, w1, w2, w3, hw, nh, SCALE, LR)
    return run


@pytest.mark.parametrize('nh,d,with_rope,compiled', [(2, 4, True, 'compiled_swiglu_halves'),
                                                     (4, 3, True, 'compiled_swiglu_heads'),
                                                     (2, 4, False, 'compiled_swiglu_heads'),
                                                     (2, 4, True, 'kept_swiglu_halves')])
def test_compiled_core_matches_naive(nh, d, with_rope, compiled):
    """`compiled_ttt_core` (the SwiGLU heads compiled by inductor with dynamic shapes, the conv head eager) = the
    naive form in float64: values and the gradients of qkv, W1, W2 and w3; a second map size runs without an error
    (dynamic). With RoPE and even heads the halves order (`compiled_swiglu_halves`), with pairs across heads (head
    width 3) or without RoPE the reference's (`compiled_swiglu_heads`, RoPE's table as its real pair): one graph,
    no graph break. `kept_*`: the partition under the memory budget (`kept=True`, outside `with_cp` blocks)."""
    from torch._dynamo.utils import counters
    counters.clear()
    kept = compiled.startswith('kept')
    for hw in (HW, (3, 6)):
        rot = _rot(nh * d, with_rope, hw)
        core = functools.partial(ttt_op.compiled_ttt_core, kept=kept)
        assert_matches_naive(_projected(core, rot, nh, hw), _core(ttt_core_naive, rot, nh, hw),
                             _core_inputs(nh=nh, d=d, hw=hw))
    used = getattr(ttt_op, compiled)
    assert used.failed is None and used._compiled is not None
    assert not counters['graph_break'], dict(counters['graph_break'])


@pytest.mark.parametrize('kept', [False, True])
def test_compiled_core_under_bf16_autocast_no_worse_than_the_reference(kept):
    """Under bf16 autocast (where `TTT` declares the compiled path), on bf16 qkv tokens: the compiled path (halves
    order; both partitions: `kept` under the memory budget) against the naive form in float64, output and every
    gradient, no worse than the eager reference under the same autocast (L2 norm; the compiler fuses the elementwise
    chains and may keep a product's fp32 result where eager rounds it). Heads of H-ViT3's width (32): the compiled
    code's vectorised loops, which the narrow heads above run as scalar tails only."""
    nh, d, b, dtype = 2, 32, 2, torch.bfloat16
    rot = _rot(nh * d, True)
    rot32 = rot.to(torch.complex64)
    g = torch.Generator().manual_seed(0)
    inputs = [half_values(torch.randn(b, HW[0] * HW[1], 3 * nh * d + 3 * d, generator=g, dtype=torch.float64)
                          .requires_grad_(), dtype)]
    inputs += [(torch.randn(*s, generator=g, dtype=torch.float64) * .3).requires_grad_()
               for s in ((1, nh, d, d), (1, nh, d, d), (d, 1, 3, 3))]
    core = functools.partial(ttt_op.compiled_ttt_core, kept=kept)
    e_fast, _ = assert_autocast_no_worse(cast_inputs(_projected(core, rot32, nh), dtype),
                                         cast_inputs(_core(ttt_core, rot32, nh), dtype),
                                         _core(ttt_core_naive, rot, nh), inputs, dtype, norm='l2')
    assert max(e_fast) < 5e-2, e_fast


def test_compiled_core_specialises_on_the_width_only(monkeypatch):
    """The compiled SwiGLU heads compile once per layer width, not for every map size and batch (above 1: torch
    specialises sizes of 1): their arguments' channel sizes are static (`_widths_static`), the batch and the map's
    sizes symbolic. Counted on the graphs dynamo hands to a recording backend (no code generation), from
    `Compiled`'s own torch.compile call (dynamic=True); the sizes as the graphs see them."""
    from mmplugin_l2.models.ops.compiled import Compiled
    from mmplugin_l2.models.ops.ttt import compiled as tc
    graphs = []

    def record(gm, example_inputs):
        graphs.append([tuple(n.meta['example_value'].shape) for n in gm.graph.nodes
                       if n.op == 'placeholder' and isinstance(n.meta.get('example_value'), torch.Tensor)])
        return gm.forward
    compile_ = torch.compile
    monkeypatch.setattr(torch, 'compile', lambda fn, **kw: compile_(fn, backend=record, **kw))
    monkeypatch.setattr(tc, 'compiled_swiglu_halves',
                        Compiled(tc.swiglu_heads_halves, 'the SwiGLU heads', prepare=tc._widths_static))
    torch._dynamo.reset()
    counts = []
    for b, nh, d, hw in [(2, 2, 4, HW), (3, 2, 4, (3, 6)), (2, 2, 4, (6, 4)), (2, 4, 4, HW), (2, 2, 8, (3, 6))]:
        _projected(tc.compiled_ttt_core, _rot(nh * d, True, hw), nh, hw)(
            *_core_inputs(b=b, nh=nh, d=d, hw=hw)).sum().backward()
        counts.append(len(graphs))
    torch._dynamo.reset()
    assert tc.compiled_swiglu_halves.failed is None
    assert counts == [1, 1, 1, 2, 3], counts                    # new map sizes and batches: no; new widths: yes
    for shapes in graphs:        # qkv (B, N, 3C + 3d), RoPE's head table (H, N, d/2, 2), W1, W2 (1, H, d, d)
        (qkv,) = [s for s in shapes if len(s) == 3]
        assert all(isinstance(s, torch.SymInt) for s in qkv[:2]) and type(qkv[2]) is int, qkv
        (table,) = [s for s in shapes if len(s) == 4 and s[-1] == 2 and isinstance(s[1], torch.SymInt)]
        assert all(type(table[i]) is int for i in (0, 2, 3)), table
        weights = [s for s in shapes if s is not table and len(s) == 4]
        assert len(weights) == 2 and all(type(s) is int for t in weights for s in t), shapes


def test_memory_budget_partitions_apart():
    """`Compiled(memory_budget=...)` of a function another `Compiled` already compiled with the default partition is
    compiled apart (its own code object: torch.compile's cache is per code object) under AOTAutograd's activation
    memory budget: with budget 0 it keeps only what backward cannot recompute (the inputs), less than the default
    partition keeps; same values and gradients."""
    from conftest import nbytes, saved_for_backward
    from mmplugin_l2.models.ops.compiled import Compiled

    def fn(x, w):
        return ((x @ w).sin() @ w).cos()
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(n, 32, generator=g).requires_grad_() for n in (64, 32))
    results = []
    for budget in (None, 0.0):
        c = Compiled(fn, 'test fn', memory_budget=budget)
        y, saved = saved_for_backward(lambda: c(x, w))
        results.append((y, torch.autograd.grad(y.sum(), [x, w]), nbytes(saved)))
        assert c.failed is None and c._compiled is not None
    (y0, g0, kept0), (y1, g1, kept1) = results
    assert kept1 < kept0 and kept1 <= nbytes([x, w]), (kept0, kept1)
    torch.testing.assert_close(y1, y0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b)


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


def test_kept_partition_that_failed_to_compile_falls_back_to_the_checkpoint(monkeypatch):
    """Where the kept partition could not compile (`Compiled.failed`), its eager fallback would keep all that autograd
    keeps: the layer then recomputes the core under its checkpoint (the default partition, run twice per step)."""
    import mmplugin_l2.models.ops.ttt.compiled as ttt_compiled
    from mmplugin_l2.models.layers import TTTAttention
    calls = []
    monkeypatch.setattr(ttt_op, 'compiled_core_tokens',
                        lambda t, *a, kept=False: calls.append(kept) or ttt_core(t, *a))
    layer = TTTAttention(8, 2).train()
    x = torch.randn(2, 12, 8, requires_grad=True)
    for failed, want in ((None, [True]), ('RuntimeError: no C++ compiler', [False, False])):
        for c in (ttt_compiled.kept_swiglu_halves, ttt_compiled.kept_swiglu_heads):
            monkeypatch.setattr(c, 'failed', failed)
        calls.clear()
        with torch.autocast('cpu', torch.bfloat16):
            y = layer(x, (3, 4))
        y.float().sum().backward()
        assert calls == want, (failed, calls)


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


@pytest.mark.parametrize('with_cp', [False, True])
def test_compiled_path_recomputes_its_core_once_in_backward(with_cp, monkeypatch):
    """Under bf16 autocast on CPU a training TTT layer takes the compiled path with or without `with_cp`: without,
    the core runs once, partitioned under its memory budget (`kept`: what its compiled backward recomputes is its
    own affair, no checkpoint around it); inside a recomputed block the default partition, recomputed by the block's
    recomputation (no second checkpoint): the core runs twice there, never three times, and the gradients equal
    those of the layer's reference run without any recomputation. The compiled core is replaced by a counting eager
    one (the compiler is tested above)."""
    import mmplugin_l2.models.layers.ttt as ttt_layer
    from mmplugin_l2.models.layers import TTTAttention
    from mmplugin_l2.models.ops import COMPILED, Path
    from mmplugin_l2.models.ops.checkpoint import checkpointed
    calls, paths, choose = [], [], ttt_layer.choose
    monkeypatch.setattr(ttt_op, 'compiled_core_tokens',
                        lambda t, *a, kept=False: calls.append(kept) or ttt_core(t, *a))
    monkeypatch.setattr(ttt_layer, 'choose', lambda *a, **k: paths.append(choose(*a, **k)) or paths[-1])
    torch.manual_seed(0)
    layer = TTTAttention(8, 2).train()
    x = torch.randn(2, 12, 8, requires_grad=True)
    grads = []
    for run in ('compiled', 'reference'):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if run == 'reference':
            monkeypatch.setattr(ttt_layer, 'choose', lambda *a, **k: Path.reference())
        with torch.autocast('cpu', torch.bfloat16):
            y = checkpointed(lambda t: layer(t, (3, 4)), x) if with_cp and run == 'compiled' else layer(x, (3, 4))
        y.float().pow(2).sum().backward()
        grads.append([x.grad] + [p.grad for p in layer.parameters()])
    assert [p.impl for p in paths] == [COMPILED] * (1 + with_cp), paths
    assert calls == ([False, False] if with_cp else [True]), calls
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
