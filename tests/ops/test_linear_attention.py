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
from ops.harness import assert_matches_naive, record_calls


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
