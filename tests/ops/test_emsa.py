"""`ops.emsa`: ResT's EMSA attention A @ v, its reference (`emsa_attention_reference`, well-conditioned), inference
pieces and train function against the naive form (`naive.emsa_attention_naive`, the paper's Eq. 4), the
dispatch of the `EMSA` layer, and the overflow guard of large logits."""
import math
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import saved_for_backward

import mmplugin_l2.models.ops.emsa as emsa_op
import mmplugin_l2.models.ops.emsa.reference as reference_op
from mmplugin_l2.models.layers import EMSA
from mmplugin_l2.models.ops import INFERENCE, TRAIN, Path
from mmplugin_l2.models.ops.emsa import emsa_attention, emsa_attention_reference
from mmplugin_l2.models.ops.memory import MemoryPolicy, set_memory_policy
from mmplugin_l2.models.ops.emsa.naive import emsa_attention_naive
from ops.harness import (RecordOps, assert_autocast_no_worse, assert_matches_naive, cast_inputs, half_values,
                         record_calls)


def _qkv(b, h, n, nk, d, dtype=torch.float64, q_std=1., k_std=1.):
    return (torch.randn(b, h, n, d, dtype=dtype) * q_std, torch.randn(b, h, nk, d, dtype=dtype) * k_std,
            torch.randn(b, h, nk, d, dtype=dtype))


def _conv(weight, bias):
    """The head-mixing conv as the op reads it (weight (h, h, 1, 1), bias (h,))."""
    return None if weight is None else types.SimpleNamespace(weight=weight, bias=bias)


def _op(path, scale=0.4):
    def run(q, k, v, w=None, bias=None):
        return emsa_attention(path, q, k, v, scale, _conv(w, bias), 1e-5)
    return run


def _naive(q, k, v, w=None, bias=None, scale=0.4):
    return emsa_attention_naive(q, k, v, scale, _conv(w, bias), 1e-5)


def _inputs(heads, n=63, nk=10, b=2, d=5, grad=True):
    q, k, v = _qkv(b, heads, n, nk, d)
    w = torch.randn(heads, heads, 1, 1, dtype=torch.float64) if heads > 1 else None
    bias = torch.randn(heads, dtype=torch.float64) if heads > 1 else None
    ts = [q, k, v] + ([w, bias] if heads > 1 else [])
    return [t.requires_grad_(grad) for t in ts]


# ---------------------------------------------------------------- the reference and fast paths vs the naive form
@pytest.mark.parametrize('heads', [1, 3])
def test_reference_matches_naive(heads):
    """The well-conditioned reference = the paper's formula: values and gradients of q, k, v and the conv's
    weight and bias (zero: the softmax ignores it) in float64."""
    assert_matches_naive(_op(Path.reference()), _naive, _inputs(heads), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize('heads', [1, 3])
@pytest.mark.parametrize('rows', [1, 5, 63])
def test_inference_pieces_match_naive(heads, rows):
    """Pieces of 1, 5 (63 queries: a partial last piece) and all queries, batch 2, float64."""
    inputs = _inputs(heads, grad=False)
    piece = rows * 2 * heads * 10
    assert_matches_naive(_op(Path(INFERENCE, piece)), _naive, inputs, rtol=1e-9, atol=1e-11, grads=False)


@pytest.mark.parametrize('heads', [1, 3])
@pytest.mark.parametrize('rows', [1, 5])
def test_train_function_matches_naive(heads, rows):
    """`EMSAPiecesFunction` (forward in pieces, backward recomputed piece by piece): values and gradients of
    q, k, v and the conv's weight and bias in float64."""
    assert_matches_naive(_op(Path(TRAIN, rows * 2 * heads * 10)), _naive, _inputs(heads), rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------- the overflow guard of large logits
def _peaked(heads=3):
    """float64 inputs whose logits exceed exp's float64 range (709) on many rows."""
    q, k, v = _qkv(2, heads, 37, 9, 4, q_std=40., k_std=12.)
    w = torch.eye(heads, dtype=torch.float64)[..., None, None] + 0.1 * torch.randn(heads, heads, 1, 1,
                                                                                 dtype=torch.float64)
    bias = torch.randn(heads, dtype=torch.float64)
    t = F.conv2d(q @ (k - k.mean(2, keepdim=True)).transpose(-2, -1) * 0.4, w)
    assert (t.amax(-1) > 710).double().mean() > 0.2, 'the test needs logits beyond exp range'
    return [x.requires_grad_() for x in (q, k, v, w, bias)]


@pytest.mark.parametrize('path', [Path.reference(), Path(TRAIN, 2 * 3 * 9 * 5)])
def test_train_paths_guard_large_logits(path):
    """Autograd (the reference) and the train function, whose backward recomputes the map with autograd:
    finite values and gradients equal to the naive form's in float64."""
    assert_matches_naive(_op(path), _naive, _peaked(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize('path', [Path(INFERENCE, None), Path(INFERENCE, 2 * 3 * 9 * 5)])
def test_inference_paths_guard_large_logits(path):
    """Without autograd (in-place steps, whole map or pieces): finite and equal to the naive form."""
    assert_matches_naive(_op(path), _naive, _peaked(), rtol=1e-9, atol=1e-10, grads=False)


# ---------------------------------------------------------------- autocast on CPU
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('heads', [1, 3])
def test_fast_paths_under_autocast(dtype, heads):
    """Inference pieces and the train function under CPU autocast with half inputs (as the layer's linears
    give them) = the float32 reference to half precision; the train function's gradients too."""
    q, k, v, *wb = [t.detach().float() for t in _inputs(heads)]
    conv = _conv(*wb) if wb else None
    ref = emsa_attention_reference(q, k, v, 0.4, conv)
    tol = dict(rtol=0, atol=4 * torch.finfo(dtype).eps * ref.abs().max().item())
    qh, kh, vh = (t.to(dtype) for t in (q, k, v))
    with torch.autocast('cpu', dtype=dtype):
        with torch.no_grad():
            out = emsa_attention(Path(INFERENCE, 2 * heads * 10 * 5), qh, kh, vh, 0.4, conv, 1e-5)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, **tol)
        qg = qh.detach().requires_grad_()
        out = emsa_attention(Path(TRAIN, 2 * heads * 10 * 5), qg, kh, vh, 0.4, conv, 1e-5)
        assert 'EMSAPiecesFunction' in type(out.grad_fn).__name__
        torch.testing.assert_close(out.float(), ref, **tol)
        dout = torch.randn_like(ref)
        (gq,) = torch.autograd.grad(out.float(), qg, dout)
    qr = q.detach().requires_grad_()
    (gq_ref,) = torch.autograd.grad(emsa_attention_reference(qr, k, v, 0.4, conv), qr, dout)
    torch.testing.assert_close(gq.float(), gq_ref, rtol=0, atol=8 * torch.finfo(dtype).eps * gq_ref.abs().max())


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_pieces_under_autocast_no_worse_than_reference(dtype):
    """With half q, k, v under autocast (as the layer's linears give them: values of that dtype), the pieces
    (inference and the train function: output and gradients) are as close to the naive form in float64 as the
    whole-map reference under the same autocast (the products G @ v in fp32, the output rounded once)."""
    inputs = [half_values(t, dtype) if i < 3 else t for i, t in enumerate(_inputs(3, n=255, nk=40))]
    piece = 2 * 3 * 40 * 16
    assert_autocast_no_worse(cast_inputs(_op(Path(TRAIN, piece)), dtype, 3),
                             cast_inputs(_op(Path.reference()), dtype, 3), _naive, inputs, dtype, norm='l2')
    ref64 = _naive(*inputs).detach()
    low = [t.detach().float() for t in inputs]
    errors = {}
    with torch.autocast('cpu', dtype=dtype), torch.no_grad():
        for name, path in (('pieces', Path(INFERENCE, piece)), ('reference', Path.reference())):
            out = cast_inputs(_op(path), dtype, 3)(*low)
            errors[name] = ((out.double() - ref64).abs().max() / ref64.abs().max()).item()
    assert errors['pieces'] <= 1.1 * errors['reference'], errors


def test_train_function_keeps_no_attention_map():
    """The train function saves no (B, h, N, N') map for backward (the dense form saves at least three: the
    conv input, the softmax output, the IN output)."""
    b, h, n, nk, d = 1, 2, 4096, 64, 4
    map_numel = b * h * n * nk
    q, k, v = (t.float().requires_grad_() for t in _qkv(b, h, n, nk, d))
    conv = torch.nn.Conv2d(h, h, 1)

    def saved(path):
        return [t.numel() for t in saved_for_backward(lambda: emsa_attention(path, q, k, v, 0.3, conv, 1e-5))[1]]
    dense, pieces = saved(Path.reference()), saved(Path(TRAIN, 2 ** 14))
    assert sum(s >= map_numel for s in dense) >= 3
    assert max(pieces) < map_numel // 8 and sum(pieces) < sum(dense) / 8


# ---------------------------------------------------------------- the layer's dispatch
def _Calls(monkeypatch):
    return record_calls(monkeypatch, emsa_op, emsa_in_pieces='inference', EMSAPiecesFunction='train')


def _layer(devices=('cpu',), max_elems=50):
    m = EMSA(12, 3, 2, qkv_bias=True).double()
    set_memory_policy(m, MemoryPolicy(max_elems=max_elems, devices=devices))
    return m


def test_whole_maps_up_to_twice_the_piece_size(monkeypatch):
    """In training the train function takes pieces above 2 * max_elems map entries, whole maps up to it; never
    in eval mode with autograd or with fast_train=False."""
    calls = _Calls(monkeypatch)
    m = EMSA(8, 2, 1, qkv_bias=True)
    x = torch.randn(1, 10, 8)            # 1 x 2 heads x 10 queries x 10 keys = 200 entries

    def pieces(max_elems, train=True, fast_train=True):
        set_memory_policy(m, dict(max_elems=max_elems))
        m.fast_train = fast_train
        calls.clear()
        m.train(train)(x, (2, 5))
        return 'train' in calls.names
    assert not pieces(100) and pieces(99)
    assert not pieces(10, train=False) and not pieces(10, fast_train=False)


def test_eval_with_grad_and_train_under_no_grad_take_the_reference(monkeypatch):
    """Grad-CAM (eval mode, autograd recording) and a train-mode model under no_grad (dropout stays on):
    whole maps through the reference; fast_train=False in training too."""
    calls = _Calls(monkeypatch)
    m, x = _layer(), torch.randn(2, 9 * 7, 12, dtype=torch.float64, requires_grad=True)
    m.eval()
    m(x, (9, 7)).sum().backward()
    assert x.grad.abs().sum() > 0
    m.train()
    with torch.no_grad():
        m(x, (9, 7))
    m.fast_train = False
    m(x, (9, 7)).sum().backward()
    assert calls.names == []


def test_attention_dropout_in_training_takes_the_reference(monkeypatch):
    calls = _Calls(monkeypatch)
    m = EMSA(12, 3, 2, qkv_bias=True, attn_drop=0.5)
    set_memory_policy(m, MemoryPolicy(max_elems=50))
    x = torch.randn(2, 9 * 7, 12)
    a, b = m.train()(x, (9, 7)), m(x, (9, 7))
    assert calls.names == [] and not torch.equal(a, b)


def test_state_dict_keys():
    assert sorted(EMSA(12, 3, 2, qkv_bias=True).state_dict()) == sorted(
        ['q.weight', 'q.bias', 'kv.weight', 'kv.bias', 'proj.weight', 'proj.bias', 'sr.weight', 'sr.bias',
         'sr_norm.weight', 'sr_norm.bias', 'transform_conv.weight', 'transform_conv.bias'])


def slow_emsa(m, x, hw):
    """EMSA written out from the spec (docs/rest.md, Architecture): the reduction by an explicit loop over the
    strided windows, the attention by the naive op (ops/emsa/naive.py)."""
    b, n, c = x.shape
    h = m.num_heads
    d = c // h
    H, W = hw
    q = x @ m.q.weight.T + m.q.bias
    if m.sr_ratio > 1:
        s = m.sr_ratio
        grid = x.transpose(1, 2).reshape(b, c, H, W)
        padded = F.pad(grid, (s // 2,) * 4)
        hk, wk = math.ceil(H / s), math.ceil(W / s)
        red = x.new_zeros(b, c, hk, wk)
        for i in range(hk):
            for j in range(wk):
                patch = padded[:, :, i * s:i * s + s + 1, j * s:j * s + s + 1]
                red[:, :, i, j] = (patch * m.sr.weight[:, 0]).sum((-2, -1)) + m.sr.bias
        t = red.flatten(2).transpose(1, 2)
        mu, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        kv_in = (t - mu) / torch.sqrt(var + 1e-5) * m.sr_norm.weight + m.sr_norm.bias
    else:
        kv_in = x
    kv = kv_in @ m.kv.weight.T + m.kv.bias
    key, val = kv[..., :c], kv[..., c:]  # rows [0:C] are K, [C:2C] are V

    def heads(t):
        return t.unflatten(-1, (h, d)).transpose(1, 2)
    conv = m.transform_conv if h > 1 else None
    out = emsa_attention_naive(heads(q), heads(key), heads(val), d ** -0.5, conv)
    out = out.transpose(1, 2).reshape(b, n, c)
    return out @ m.proj.weight.T + m.proj.bias


@pytest.mark.parametrize('heads,sr,hw', [(1, 8, (9, 13)), (2, 4, (7, 9)), (3, 2, (5, 6)), (4, 1, (3, 5))])
@pytest.mark.parametrize('piece', [None, 7])
def test_layer_against_slow_reference(heads, sr, hw, piece):
    """The EMSA layer (its reduction conv and LayerNorm written out as loops, the attention the naive op) in
    training with and without pieces."""
    torch.manual_seed(heads)
    c = 12 * heads
    m = EMSA(c, heads, sr, qkv_bias=True, fast_train=piece is not None).double()
    if piece is not None:
        set_memory_policy(m, dict(max_elems=piece))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, hw[0] * hw[1], c, dtype=torch.float64)
    torch.testing.assert_close(m(x, hw), slow_emsa(m, x, hw), rtol=0, atol=1e-10)


# ---- expm1 through float64 (torch's CPU float32 expm1 is slow) --------------------------------------------------
def _expm1_input(n):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(n // 4, generator=g) * s for s in (1e-6, 0.3, 5., 30.)])
    return torch.cat([x, torch.tensor([0., -0., 1e-30, -1e-30, 64., -64., -104., -200.])])


@pytest.mark.parametrize('n', [64, 2 * reference_op.EXPM1_CHUNK + 44])
def test_expm1_is_torchs_correctly_rounded(n):
    """`expm1` / `expm1_` on float32 CPU tensors (over several float64 chunks too) give float64 expm1 rounded once to
    float32, within torch's own float32 expm1's rounding of it, and torch's derivative (grad * (expm1(x) + 1))."""
    x = _expm1_input(n)
    exact = torch.expm1(x.double())
    y = reference_op.expm1(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, exact.float())
    assert torch.equal(reference_op.expm1_(x.clone()), exact.float())
    torch.testing.assert_close(y, torch.expm1(x), rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    xs = x.reshape(-1, 4).t().requires_grad_()             # non-contiguous, through autograd
    g = torch.randn(xs.shape)
    ys = reference_op.expm1(xs)
    ys.backward(g)
    assert torch.equal(ys, exact.float().reshape(-1, 4).t())
    assert torch.equal(xs.grad, g * (ys.detach() + 1))


def test_emsa_runs_no_float32_expm1_kernel():
    """The train function and the inference pieces (the fp32 compute dtype of bf16 q, k, v) never run torch's
    float32 expm1 kernel on CPU, the slow one: their expm1 goes through float64."""
    dtypes = set()

    def expm1_dtype(func, args, kwargs, out):
        if func.overloadpacket in (torch.ops.aten.expm1, torch.ops.aten.expm1_):
            dtypes.add(args[0].dtype)

    torch.manual_seed(0)
    q, k, v = (t.bfloat16().requires_grad_() for t in _qkv(1, 2, 40, 12, 8))
    w = torch.randn(2, 2, 1, 1, requires_grad=True)
    with RecordOps(expm1_dtype):
        out = _op(Path(TRAIN, 128))(q, k, v, w)
        out.float().sum().backward()
        with torch.no_grad():
            _op(Path(INFERENCE, 128))(q, k, v, w)
    assert dtypes == {torch.float64}
