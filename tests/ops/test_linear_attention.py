"""`ops.linear_attention`: L2ViT's linear attention, its reference (the authors' order of operations), its train
function (closed-form backward) and its inference in pieces of tokens against the naive form (the attention
matrix written out), and the dispatch of the `LinearAttention` layer."""

import pytest
import torch
import torch.nn as nn

import mmplugin_l2.models.ops.linear_attention as la_op
from mmplugin_l2.models.layers import LinearAttention
from mmplugin_l2.models.ops import INFERENCE, Path
from mmplugin_l2.models.ops.linear_attention import (LinearAttentionCore, linear_attention,
                                                     linear_attention_reference)
from mmplugin_l2.models.ops.memory import MemoryPolicy, set_memory_policy
from mmplugin_l2.models.ops.linear_attention.naive import linear_attention_naive
from ops.harness import RecordOps, assert_matches_naive, record_calls


def _qkvt(b=2, heads=2, n=45, d=5, scale=3.):
    """Inputs where the clamp (100 / scale^2 here) binds for some queries and not for others."""
    q, k, v = (torch.randn(b, heads, n, d, dtype=torch.float64) * scale for _ in range(3))
    t = torch.randn(heads, 1, 1, dtype=torch.float64)
    den = q.relu() @ k.relu().sum(2, keepdim=True).transpose(-2, -1)
    assert 0.1 < (den < 100).double().mean() < 0.9, 'the test needs both kinds of query'
    return [x.requires_grad_() for x in (q, k, v, t)]


def test_reference_matches_naive():
    """The associative order phi(Q) (phi(K)^T V) = the attention matrix written out: values and gradients."""
    assert_matches_naive(lambda *a: linear_attention_reference(*a, 100.), lambda *a: linear_attention_naive(*a, 100.),
                         _qkvt())


def test_train_function_matches_naive():
    """`LinearAttentionCore` (closed-form backward): values and gradients of q, k, v, t in float64, an odd
    number of tokens, batch 2, the clamp binding for part of the queries; inputs as strided views too."""
    assert_matches_naive(lambda *a: LinearAttentionCore.apply(*a, 100.), lambda *a: linear_attention_naive(*a, 100.),
                         _qkvt())
    qkv = torch.randn(2, 45, 3, 2, 5, dtype=torch.float64, requires_grad=True) * 3

    def views(fn):
        return lambda x, t: fn(*(u.transpose(1, 2) for u in x.unbind(2)), t, 100.)
    t = torch.randn(2, 1, 1, dtype=torch.float64, requires_grad=True)
    assert_matches_naive(views(LinearAttentionCore.apply), views(linear_attention_naive), [qkv, t])


def _layer_parts(c=12, heads=2):
    qkv, proj, norm = nn.Linear(c, 3 * c).double(), nn.Linear(c, c).double(), nn.LayerNorm(c).double()
    with torch.no_grad():
        for p in (*qkv.parameters(), *proj.parameters(), *norm.parameters()):
            p.normal_(0, 1)
    return qkv, proj, norm, torch.randn(heads, 1, 1, dtype=torch.float64)


@pytest.mark.parametrize('tokens', [1, 7, 45])
@pytest.mark.parametrize('fp32_reduce', [True, False])
@pytest.mark.parametrize('with_norm', [True, False])
def test_inference_pieces_match_naive(tokens, fp32_reduce, with_norm):
    """Pieces of 1, 7 (45 tokens: a partial last piece) and all tokens, with and without the pre-norm; the
    whole layer proj(attention(qkv(norm(x)))), the attention naive."""
    qkv, proj, norm, t = _layer_parts()
    x = torch.randn(2, 45, 12, dtype=torch.float64) * 3
    norm = norm if with_norm else None

    def naive(x):
        x = x if norm is None else norm(x)
        q, k, v = qkv(x).view(2, 45, 3, 2, 6).permute(2, 0, 3, 1, 4)
        return proj(linear_attention_naive(q, k, v, t, 100.).transpose(1, 2).reshape(2, 45, 12))
    fast = lambda x: linear_attention(Path(INFERENCE, tokens * 2 * 12), x, qkv, proj, t, 2, 100.,  # noqa: E731
                                      fp32_reduce, norm)
    assert_matches_naive(fast, naive, [x], grads=False)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('fp32_reduce', [True, False])
def test_fast_paths_under_autocast(dtype, fp32_reduce):
    """The inference pieces and the train function under CPU autocast = the float32 reference to half
    precision (gradients of the train function too)."""
    m = LinearAttention(16, 2, fp32_reduce=fp32_reduce)
    with torch.no_grad():
        m.temperature.uniform_(1, 2)
    x = (torch.randn(2, 45, 16) * 3).requires_grad_()
    set_memory_policy(m, MemoryPolicy(max_elems=None))
    m.fast_train = False
    ref = m.train()(x)
    dx_ref, = torch.autograd.grad(ref, x, ref.detach())
    m.fast_train = True
    tol = 8 * torch.finfo(dtype).eps * ref.abs().max().item()
    set_memory_policy(m, MemoryPolicy(max_elems=7 * 2 * 16))
    with torch.autocast('cpu', dtype=dtype):
        out = m(x)
        dx, = torch.autograd.grad(out.float(), x, ref.detach())
        with torch.no_grad():
            low = m.eval()(x)
    torch.testing.assert_close(low.float(), ref, rtol=0, atol=tol)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=tol)
    # relative L2: a query whose denominator lies at the clamp may switch sides in half precision
    assert (dx.float() - dx_ref).norm() <= 8 * torch.finfo(dtype).eps * dx_ref.norm()



@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_train_function_computes_in_fp32_and_keeps_half_inputs(dtype):
    """`LinearAttentionCore` on half q, k, v (strided views of one qkv tensor, as the layer makes them) with
    dtype=float32 = the function on their float32 casts, to the bit (output, the gradients of q, k, v cast to
    the half dtype, the temperature's); what it keeps for backward that is as large as q is in the half dtype."""
    b, n, h, d = 2, 45, 2, 8
    qkv = (torch.randn(b, n, 3 * h * d) * 3).to(dtype).requires_grad_()
    t = torch.rand(h, 1, 1).add_(0.5).requires_grad_()
    g = torch.randn(b, h, n, d)

    def run(cast):
        q, k, v = (u.transpose(1, 2) for u in qkv.view(b, n, 3, h, d).unbind(2))
        kept = []

        def pack(x):
            kept.append(x)
            return x
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            if cast:
                out = LinearAttentionCore.apply(q.float(), k.float(), v.float(), t, 10.)
            else:
                out = LinearAttentionCore.apply(q, k, v, t, 10., torch.float32)
        return (out, *torch.autograd.grad(out, [qkv, t], g)), kept
    ref, _ = run(cast=True)
    ours, kept = run(cast=False)
    assert ours[0].dtype == torch.float32 and ours[1].dtype == dtype
    for a, r in zip(ours, ref):
        assert torch.equal(a, r)
    large = [x for x in kept if x.numel() >= b * h * n * d]
    assert len(large) == 3 and all(x.dtype == dtype for x in large), [(x.dtype, x.shape) for x in large]

# ---------------------------------------------------------------- the layer's dispatch
def _recording(monkeypatch):
    return record_calls(monkeypatch, la_op, linear_attention_in_pieces='inference', LinearAttentionCore='train')


def test_train_eval_with_grad_and_train_under_no_grad(monkeypatch):
    """Training takes `LinearAttentionCore` (fast_train=False: plain autograd); Grad-CAM (eval mode, autograd
    recording) and a train-mode model under no_grad take the reference, on whole maps."""
    calls = _recording(monkeypatch)
    m = LinearAttention(16, 2).double()
    set_memory_policy(m, MemoryPolicy(max_elems=10))
    x = torch.randn(2, 45, 16, dtype=torch.float64, requires_grad=True)
    m.train()(x)
    assert calls.names == ['train']
    m.fast_train = False
    m(x)
    m.fast_train = True
    m.eval()(x).sum().backward()
    with torch.no_grad():
        m.train()(x)
    assert calls.names == ['train'] and x.grad.abs().sum() > 0
    m.fp32_reduce = False     # the train function does not take autocast's mixed dtypes: the reference
    with torch.autocast('cpu', dtype=torch.bfloat16):
        m.float()(x.detach().float().requires_grad_()).float().sum().backward()
    assert calls.names == ['train']


def test_state_dict_keys():
    assert sorted(LinearAttention(16, 2).state_dict()) == ['proj.bias', 'proj.weight', 'qkv.bias', 'qkv.weight',
                                                           'temperature']


def _attention_and_tokens():
    """A float64 LinearAttention with a negative temperature and tokens of growing scale (some clamped)."""
    torch.manual_seed(0)
    attn = LinearAttention(32, 2).double()
    with torch.no_grad():
        attn.temperature.copy_(torch.tensor([0.3, -0.7]).view(2, 1, 1))
        attn.qkv.bias.normal_(0, 0.2)
    return attn, torch.randn(3, 40, 32, dtype=torch.float64) * torch.linspace(0.2, 3., 40)[None, :, None]


def test_linear_attention_training_copies_each_head_operand_once():
    """In training, LinearAttentionCore reads q, k, v (strided views of the qkv output, as LinearAttention
    makes them) into the contiguous head layout once, in forward: its forward + backward make one map-sized
    copy (v; Q and K are written by the ReLU) and no other, where torch.matmul on the views copied an
    operand before every batched product."""
    from mmplugin_l2.models.layers.linear_attention import LinearAttentionCore
    b, n, h, d = 2, 50, 3, 8
    qkv = torch.randn(b, n, 3 * h * d, dtype=torch.float64, requires_grad=True)
    q, k, v = (t.transpose(1, 2) for t in qkv.view(b, n, 3, h, d).unbind(2))
    t = torch.full((h, 1, 1), 0.3, dtype=torch.float64, requires_grad=True)
    copies = []

    def copy(func, args, kwargs, out):
        if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_, torch.ops.aten._to_copy):
            if out.numel() >= n * d:
                copies.append((str(func), tuple(out.shape)))
    with RecordOps(copy):
        out = LinearAttentionCore.apply(q, k, v, t, 2.)
        grads = torch.autograd.grad(out, [q, k, v, t], torch.randn_like(out))
    assert copies == [('aten.clone.default', (b, h, n, d))], copies
    assert all(g.is_contiguous() for g in grads[:3])


def test_clamp_is_active_and_exact():
    """One head, q = k = v = x, identity projection, temperature 1: out_i = x_i (sum_j x_j^T x_j) /
    max(x_i . sum_j x_j, 100), computed by hand. Tokens below 100 are divided by exactly 100."""
    attn = LinearAttention(2, 1).double()
    assert attn.clamp_min == 100.
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.eye(2).repeat(3, 1))
        attn.qkv.bias.zero_()
        attn.proj.weight.copy_(torch.eye(2))
        attn.proj.bias.zero_()
        attn.temperature.fill_(1.)
    x = torch.tensor([[[1., 0.5], [2., 1.], [0.1, 0.2], [6., 3.], [4., 8.]]], dtype=torch.float64)
    s = x[0].sum(0)                  # sum_j k_j
    kv = x[0].T @ x[0]               # sum_j k_j^T v_j
    den = x[0] @ s
    assert (den < 100).any() and (den > 100).any()
    expected = (x[0] @ kv) / torch.maximum(den, torch.tensor(100., dtype=torch.float64))[:, None]
    got = attn(x)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    small = den < 100
    torch.testing.assert_close(got[small], (x[0] @ kv)[small] / 100, rtol=0, atol=1e-12)
    # and the clamp matters: without it those tokens differ
    attn.clamp_min = 1e-6
    assert not torch.allclose(attn(x)[0][small], got[small])


def test_linear_attention_fp16_autocast_stays_finite():
    """Large activations over many tokens: K^T V and the denominator exceed fp16's 65504. With the fp32
    reduction the output is finite and matches fp32; the same computation in fp16 overflows."""
    torch.manual_seed(0)
    n, c = 8192, 32
    attn = LinearAttention(c, 1)
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.eye(c).repeat(3, 1) * 4)
        attn.qkv.bias.fill_(1.)
    x = torch.rand(1, n, c) * 3
    ref = attn(x)
    with torch.no_grad():
        qkv = attn.qkv(x).reshape(1, n, 3, 1, c).permute(2, 0, 3, 1, 4).half()
        assert torch.isinf(qkv[1].relu().transpose(-2, -1) @ qkv[2]).any(), 'K^T V must overflow fp16'
    for dtype in (torch.float16, torch.bfloat16):
        with torch.autocast('cpu', dtype=dtype):
            out = attn(x)
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    attn.fp32_reduce = False
    with torch.autocast('cpu', dtype=torch.float16):
        assert not torch.isfinite(attn(x)).all(), 'without the fp32 reduction fp16 overflows'


def explicit_linear_attention(attn, x, clamp_min=100.):
    """The layer `attn` with the naive op (ops/linear_attention/naive.py: the N x N matrix written out) between
    its qkv and proj Linears; and which (batch, head, query) denominators the clamp binds."""
    b, n, c = x.shape
    q, k, v = attn.qkv(x).view(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    out = linear_attention_naive(q, k, v, attn.temperature, clamp_min)
    clamped = (q.relu() @ k.relu().transpose(-2, -1)).sum(-1) < clamp_min
    return attn.proj(out.transpose(1, 2).reshape(b, n, c)), clamped


def test_linear_attention_against_explicit_matrix():
    attn, x = _attention_and_tokens()
    ref, clamped = explicit_linear_attention(attn, x)
    assert 0 < clamped.double().mean() < 1, 'the test needs clamped and unclamped tokens'
    torch.testing.assert_close(attn(x), ref, rtol=0, atol=1e-12)          # autograd records: the autograd function
    with torch.no_grad():
        torch.testing.assert_close(attn(x), ref, rtol=0, atol=1e-12)      # the plain ops


def test_linear_attention_training_gradients_against_explicit_matrix():
    """While autograd records, the attention runs as LinearAttentionCore (closed-form backward). Its
    gradients (input, qkv, temperature, proj) equal autograd's through the explicit N x N matrix, with
    clamped and unclamped tokens and a negative temperature; and the function passes gradcheck."""
    from mmplugin_l2.models.layers.linear_attention import LinearAttentionCore
    attn, x = _attention_and_tokens()
    g = torch.randn(3, 40, 32, dtype=torch.float64)
    wrt = [attn.qkv.weight, attn.qkv.bias, attn.temperature, attn.proj.weight]
    grads = {}
    for name, fn in (('ours', attn), ('explicit', lambda t: explicit_linear_attention(attn, t)[0])):
        xi = x.clone().requires_grad_()
        grads[name] = torch.autograd.grad(fn(xi), [xi] + wrt, g)
    assert 0 < explicit_linear_attention(attn, x)[1].double().mean() < 1, 'the test needs both kinds of token'
    for a, b in zip(grads['ours'], grads['explicit']):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11 * b.abs().max().item())
    q, k, v = (torch.randn(2, 2, 9, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    t = torch.tensor([0.5, -1.5], dtype=torch.float64).view(2, 1, 1).requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: LinearAttentionCore.apply(*a, 2.), (q, k, v, t))
