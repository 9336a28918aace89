"""`ops.ttt`: the TTT core of H-ViT3 / ViT3 (`reference.ttt_core`) and its fast paths (inference in pieces of
tokens, the fused whole-map forward, the train function `TTTCore` with its closed-form backward) against the
naive form (`naive.ttt_core_naive`: the inner models trained with autograd), the closed-form inner gradients
against autograd, the batched depth-wise conv kernels against loops, and the dispatch of the `TTTAttention`
layer."""

import pytest
import torch
import torch.nn.functional as F

import mmplugin_l2.models.ops.ttt as ttt_op
from conftest import nbytes, saved_for_backward
from mmplugin_l2.models.layers import TTTAttention, apply_rope, rope_tables
from mmplugin_l2.models.ops import INFERENCE, Path
from mmplugin_l2.models.ops.export import export_mode
from mmplugin_l2.models.ops.memory import MemoryPolicy, set_memory_policy
from mmplugin_l2.models.ops.ttt import (TTTCore, dwconv_inner_grad, dwconv_per_sample, swiglu_inner_grads,
                                        tap_sums, ttt_attention, ttt_core, ttt_core_pieces)
from mmplugin_l2.models.ops.ttt import naive
from mmplugin_l2.models.ops.ttt.naive import ttt_core_naive
from ops.harness import (assert_autocast_no_worse, assert_matches, assert_matches_naive, cast_inputs, half_values,
                        record_calls)

HW = (5, 7)          # odd height and width
SCALE, LR = 1 / 3, 1.0


def _rot(c, with_rope, hw=HW):
    return rope_tables(*hw, c).to(torch.complex128) if with_rope else None


def _core_inputs(b=2, nh=2, d=4, hw=HW, zero_values=False, grad=True):
    """float64 qkv tokens (B, N, 3C + 3d) and inner weights large enough for the inner step to matter."""
    g = torch.Generator().manual_seed(0)
    c = nh * d
    qkv = torch.randn(b, hw[0] * hw[1], 3 * c + 3 * d, generator=g, dtype=torch.float64)
    if zero_values:      # the conv head's inner gradient of sample 1 has norm 0 (the normalisation's kink)
        qkv[1, :, -d:] = 0
    ws = [torch.randn(*s, generator=g, dtype=torch.float64) * .3 for s in ((1, nh, d, d), (1, nh, d, d), (d, 1, 3, 3))]
    return [t.requires_grad_(grad) for t in (qkv, *ws)]


def _core(fn, rot, nh, hw=HW):
    return lambda qkv, w1, w2, w3: fn(qkv, rot, w1, w2, w3, hw, nh, SCALE, LR)


# ---------------------------------------------------------------- the reference against the naive form
@pytest.mark.parametrize('nh,d,with_rope', [(2, 4, True), (4, 3, True), (2, 4, False)])
def test_reference_matches_naive(nh, d, with_rope):
    """Values and gradients (qkv, W1, W2, w3), batch 2, odd map, head width 3 (RoPE pairs across heads):
    the closed-form inner gradients of the reference = autograd's inner step of the naive form."""
    inputs = _core_inputs(nh=nh, d=d)
    rot = _rot(nh * d, with_rope)
    assert_matches_naive(_core(ttt_core, rot, nh), _core(ttt_core_naive, rot, nh), inputs)


def test_reference_at_a_zero_inner_gradient():
    """An all-zero value map (inner gradient 0, the normalisation's kink): values and gradients equal the
    naive form's."""
    rot = _rot(8, True)
    assert_matches_naive(_core(ttt_core, rot, 2), _core(ttt_core_naive, rot, 2), _core_inputs(zero_values=True))


# ---------------------------------------------------------------- fast paths against the naive form
@pytest.mark.parametrize('with_rope', [True, False])
@pytest.mark.parametrize('tokens', [1, 4, 35, None])      # 35 tokens: a partial last piece of 4
def test_forward_without_autograd_matches_naive(with_rope, tokens):
    """The train function's forward (`ttt_core_pieces`, whole map: one piece) without autograd = the
    naive form."""
    rot, b, c = _rot(8, with_rope), 2, 8
    fast = ttt_core_pieces if tokens is None else (
        lambda *a: ttt_core_pieces(*a, piece=tokens * b * c))
    assert_matches_naive(_core(fast, rot, 2), _core(ttt_core_naive, rot, 2), _core_inputs(grad=False), grads=False)


@pytest.mark.parametrize('nh,d', [(2, 4), (4, 3)])
@pytest.mark.parametrize('with_rope', [True, False])
@pytest.mark.parametrize('tokens', [3, None])
def test_train_function_matches_naive(nh, d, with_rope, tokens):
    """`TTTCore` (forward without autograd; closed-form backward on whole maps and in pieces of 3 tokens, a
    partial last piece) = the naive form: values and gradients of qkv, W1, W2 and w3 in float64."""
    rot, b = _rot(nh * d, with_rope), 2
    piece = None if tokens is None else tokens * b * nh * d
    fast = lambda qkv, w1, w2, w3: TTTCore.apply(qkv, rot, w1, w2, w3, HW, nh, SCALE, LR, piece)
    assert_matches_naive(fast, _core(ttt_core_naive, rot, nh), _core_inputs(nh=nh, d=d))


@pytest.mark.parametrize('tokens', [5, None])
def test_train_function_at_a_zero_inner_gradient(tokens):
    """An all-zero value map in one sample (its conv-head inner gradient has norm 0, the normalisation's
    kink): `TTTCore`'s closed-form gradients = the naive form's."""
    rot = _rot(8, True)
    piece = None if tokens is None else tokens * 2 * 8
    fast = lambda qkv, w1, w2, w3: TTTCore.apply(qkv, rot, w1, w2, w3, HW, 2, SCALE, LR, piece)
    assert_matches_naive(fast, _core(ttt_core_naive, rot, 2), _core_inputs(zero_values=True))


def _layer(dim=8, heads=2, max_elems=None, devices=('cpu',), std=0.3):
    torch.manual_seed(1)
    m = TTTAttention(dim, heads).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, std)
    set_memory_policy(m, MemoryPolicy(max_elems=max_elems, devices=devices))
    return m


@pytest.mark.parametrize('with_rope', [True, False])
@pytest.mark.parametrize('tokens', [1, 4, None])
def test_inference_pieces_match_naive(with_rope, tokens):
    """`ttt_inference` (qkv columns, inner models and proj in pieces of tokens) = proj(naive(qkv(x)))."""
    m, b = _layer(), 2
    rot = _rot(8, with_rope)
    x = torch.randn(b, HW[0] * HW[1], 8, dtype=torch.float64)
    piece = None if tokens is None else tokens * b * 8
    fast = lambda x: ttt_attention(x, m.qkv, m.proj, rot, m.w1, m.w2, m.w3, HW, 2, SCALE, LR,  # noqa: E731
                                   Path(INFERENCE, piece))
    naive = lambda x: m.proj(ttt_core_naive(m.qkv(x), rot, m.w1, m.w2, m.w3, HW, 2, SCALE, LR))  # noqa: E731
    assert_matches_naive(fast, naive, [x], grads=False)
    assert naive(x).abs().max() > 1    # inner updates large enough to matter


# ---------------------------------------------------------------- the batched depth-wise conv kernels
def _maps(b=3, h=5, w=7, d=4, dtype=torch.float64):
    """(B, H, W, d) channels-last maps as strided channel slices of one tensor, as the qkv split gives them."""
    t = torch.randn(b, h, w, 3 * d, dtype=dtype)
    return t[..., :d], t[..., d:2 * d], t[..., 2 * d:]


def loop_tap_sums(k, v):
    """sum_yx k_pad(y + dy, x + dx) v(y, x), one sample, channel and tap at a time."""
    b, h, w, d = k.shape
    kp = F.pad(k, (0, 0, 1, 1, 1, 1))
    out = torch.zeros(b, d, 9, dtype=torch.float64)
    for i in range(b):
        for c in range(d):
            for t in range(9):
                out[i, c, t] = (kp[i, t // 3:t // 3 + h, t % 3:t % 3 + w, c].double() * v[i, :, :, c].double()).sum()
    return out


def loop_dwconv(x, weight):
    """F.conv2d sample by sample, the kernels of each sample as their own depth-wise conv."""
    b, h, w, d = x.shape
    outs = [F.conv2d(x[i:i + 1].permute(0, 3, 1, 2), weight[i * d:(i + 1) * d], padding=1, groups=d) for i in range(b)]
    return torch.cat(outs).permute(0, 2, 3, 1).reshape(b, h * w, d)


@pytest.mark.parametrize('b,h,w', [(3, 5, 7), (1, 4, 1), (2, 1, 6)])
@pytest.mark.parametrize('export', [False, True])
def test_tap_sums_and_dwconv_equal_loops(b, h, w, export):
    """One grouped conv (eager) and nine shifted products (export mode) = loops over batch, channels, taps;
    gradients too (the reference differentiates through both)."""
    k, v, q = _maps(b, h, w)
    weight = torch.randn(b * 4, 1, 3, 3, dtype=torch.float64)
    with export_mode() if export else torch.enable_grad():
        assert_matches(tap_sums, loop_tap_sums, [k.clone().requires_grad_(), v.clone().requires_grad_()])
        assert_matches(dwconv_per_sample, loop_dwconv, [q.clone().requires_grad_(), weight.requires_grad_()])


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_tap_sums_accumulate_in_fp32_for_half_maps(dtype):
    """Sums over H*W beyond fp16's range stay finite: fp32 out, equal to the float64 loop to fp32 rounding."""
    k, v, _ = (t.abs().mul(30).to(dtype) for t in _maps(2, 12, 11))
    got = tap_sums(k, v)
    assert got.dtype == torch.float32 and got.max() > 65504
    torch.testing.assert_close(got.double(), loop_tap_sums(k, v), rtol=1e-5, atol=0)


def test_swiglu_inner_grads_equal_autograd():
    """The closed-form normalised gradients of the SwiGLU inner loss (also the fused kernel under no_grad) =
    autograd's, per sample (the naive form's loss and normalisation)."""
    b, h, n, d = 2, 3, 20, 8
    k, v = torch.randn(b, h, n, d, dtype=torch.float64), torch.randn(b, h, n, d, dtype=torch.float64)
    w1 = torch.randn(1, h, d, d, dtype=torch.float64) * 0.3
    w2 = torch.randn(1, h, d, d, dtype=torch.float64) * 0.3
    W1, W2 = naive.per_sample(w1[0], b), naive.per_sample(w2[0], b)
    g1, g2 = torch.autograd.grad(naive.dot_loss(naive.swiglu(k, W1, W2), v, SCALE, n), (W1, W2))
    for fused in (False, True):        # under no_grad the fused kernel aten.silu_backward
        with torch.set_grad_enabled(not fused):
            out1, out2 = swiglu_inner_grads(k, v, w1, w2, SCALE)
        torch.testing.assert_close(out1, naive.normalise(g1, -2), rtol=0, atol=1e-12)
        torch.testing.assert_close(out2, naive.normalise(g2, -2), rtol=0, atol=1e-12)


def test_dwconv_inner_grad_equals_autograd():
    """The closed-form normalised gradient of the conv head's inner loss = autograd's, per sample."""
    b, d, hh, ww = 2, 4, 7, 5
    k, v = torch.randn(b, d, hh, ww, dtype=torch.float64), torch.randn(b, d, hh, ww, dtype=torch.float64)
    w = naive.per_sample(torch.randn(d, 1, 3, 3, dtype=torch.float64) * 0.2, b)
    (g,) = torch.autograd.grad(naive.dot_loss(naive.dwconv3x3(k, w), v, SCALE, hh * ww), w)
    torch.testing.assert_close(dwconv_inner_grad(k.permute(0, 2, 3, 1), v.permute(0, 2, 3, 1), SCALE),
                               naive.normalise(g, (-2, -1)).reshape(b * d, 1, 3, 3), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- autocast on CPU
def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_fast_paths_under_autocast(monkeypatch, dtype):
    """Under CPU autocast: the inference pieces and the train function (`TTTCore`'s forward without autograd; its
    backward in closed form under fp16, by autograd through the reference (the checkpoint path) under bf16, both
    under the forward's autocast state) = the float32 reference to half precision, values and the input's
    gradient. (Under bf16 the layer's compiled path comes first, `fast_compile=False` here:
    tests/ops/test_ttt_compiled.py tests it.)"""
    calls = _Calls(monkeypatch)
    m = _layer(16, 2, max_elems=2 * 16 * 4, std=0.1).float()
    m.fast_compile = False
    x = torch.randn(2, HW[0] * HW[1], 16)
    rot = rope_tables(*HW, 16)
    m.eval()
    xr = x.clone().requires_grad_()
    ref = m(xr, HW, rot)                        # eval with autograd: the reference in float32
    dout = torch.randn_like(ref)
    (gref,) = torch.autograd.grad(ref, xr, dout)
    bound = 2e-2 if dtype == torch.bfloat16 else 4e-3
    with torch.autocast('cpu', dtype=dtype):
        with torch.no_grad():
            low = m(x, HW, rot)
        assert low.dtype == dtype and _rel(low, ref) < bound
        m.train()
        xg = x.clone().requires_grad_()
        y = m(xg, HW, rot)
        assert _rel(y, ref) < bound
        (g,) = torch.autograd.grad(y.float(), xg, dout)
    assert _rel(g, gref) < 2 * bound
    assert calls.names == ['inference', 'train'] and calls[-1][1][-1] is (dtype == torch.float16)   # closed_form


@pytest.mark.parametrize('seed', [0, 1, 2])
@pytest.mark.parametrize('with_rope,tokens', [(True, None), (False, 7), (True, 7)])
def test_train_function_under_fp16_autocast_no_worse_than_the_reference(with_rope, tokens, seed):
    """Under fp16 autocast, on fp16 qkv tokens (`TTT` declares the closed form there): `TTTCore` with its closed-form
    backward (products in fp16, the token sums and the inner step in fp32; whole maps and pieces of 7 tokens)
    against the naive form in float64, output and the gradients of qkv, W1, W2 and w3, no worse than the reference
    (plain autograd) under the same autocast, in the L2 norm. (Under bf16 the pieces' token sums are rounded to
    bf16 one by one and the weight gradients come out no more accurate than the reference's: `TTT` checkpoints
    there.)"""
    nh, d, b, dtype = 2, 4, 2, torch.float16
    rot = _rot(nh * d, with_rope)
    rot32 = None if rot is None else rot.to(torch.complex64)
    piece = None if tokens is None else tokens * b * nh * d
    g = torch.Generator().manual_seed(seed)
    inputs = [half_values(torch.randn(b, HW[0] * HW[1], 3 * nh * d + 3 * d, generator=g, dtype=torch.float64)
                          .requires_grad_(), dtype)]                        # qkv values of the half dtype
    inputs += [(torch.randn(*s, generator=g, dtype=torch.float64) * .3).requires_grad_()
               for s in ((1, nh, d, d), (1, nh, d, d), (d, 1, 3, 3))]
    fast = lambda qkv, w1, w2, w3: TTTCore.apply(qkv, rot32, w1, w2, w3, HW, nh, SCALE, LR, piece)  # noqa: E731
    e_fast, _ = assert_autocast_no_worse(cast_inputs(fast, dtype), cast_inputs(_core(ttt_core, rot32, nh), dtype),
                                         _core(ttt_core_naive, rot, nh), inputs, dtype, norm='l2')
    assert max(e_fast) < 1e-2, e_fast



# ---------------------------------------------------------------- the layer's dispatch
def _Calls(monkeypatch):
    return record_calls(monkeypatch, ttt_op, ttt_inference='inference', TTTCore='train')


def test_eval_with_grad_train_under_no_grad_and_export_take_the_reference(monkeypatch):
    """Grad-CAM (eval mode, autograd recording), a train-mode layer under no_grad, fast_train=False and export
    mode: the reference."""
    calls = _Calls(monkeypatch)
    m = _layer(max_elems=8)
    x = torch.randn(2, HW[0] * HW[1], 8, dtype=torch.float64, requires_grad=True)
    m.eval()
    m(x, HW).sum().backward()
    assert x.grad.abs().sum() > 0
    m.train()
    with torch.no_grad():
        m(x, HW)
    with export_mode():
        m(x, HW)
    m.fast_train = False
    m(x, HW).sum().backward()
    assert calls.names == []


def test_state_dict_keys():
    assert sorted(TTTAttention(8, 2).state_dict()) == sorted(
        ['qkv.weight', 'qkv.bias', 'w1', 'w2', 'w3', 'proj.weight', 'proj.bias'])


def test_ttt_layer_against_explicit_inner_training():
    """The whole TTT layer against a slow path that trains each inner model with autograd."""
    torch.manual_seed(1)
    c, nh, hh, ww, b = 16, 2, 5, 6, 2
    layer = TTTAttention(c, nh).double()
    with torch.no_grad():
        for p in (layer.w1, layer.w2, layer.w3):
            p.normal_(0, 0.3)
    x = torch.randn(b, hh * ww, c, dtype=torch.float64)
    rope = rope_tables(hh, ww, c).to(torch.complex128)
    got = layer(x, (hh, ww), rope)

    d = c // nh
    n = hh * ww
    q1, k1, v1, q2, k2, v2 = layer.qkv(x).split([c, c, c, d, d, d], -1)
    q1, k1 = apply_rope(q1, rope), apply_rope(k1, rope)
    outs = []
    for i in range(b):
        heads = []
        for hd in range(nh):
            sl = slice(hd * d, (hd + 1) * d)
            W1 = layer.w1[0, hd].detach().clone().requires_grad_()
            W2 = layer.w2[0, hd].detach().clone().requires_grad_()
            loss = -((k1[i, :, sl] @ W1) * F.silu(k1[i, :, sl] @ W2) * v1[i, :, sl]).sum() / n / 3
            g1, g2 = torch.autograd.grad(loss, (W1, W2))
            W1 = W1 - g1 / (g1.norm(dim=0, keepdim=True) + 1)
            W2 = W2 - g2 / (g2.norm(dim=0, keepdim=True) + 1)
            heads.append((q1[i, :, sl] @ W1) * F.silu(q1[i, :, sl] @ W2))
        kk = k2[i].T.reshape(1, d, hh, ww)
        vv = v2[i].T.reshape(1, d, hh, ww)
        W3 = layer.w3.detach().clone().requires_grad_()
        loss = -(F.conv2d(kk, W3, padding=1, groups=d) * vv).sum() / n / 3
        (g3,) = torch.autograd.grad(loss, W3)
        W3 = W3 - g3 / (g3.norm(dim=(-2, -1), keepdim=True) + 1)
        conv = F.conv2d(q2[i].T.reshape(1, d, hh, ww), W3, padding=1, groups=d).reshape(d, n).T
        outs.append(torch.cat(heads + [conv], -1))
    ref = layer.proj(torch.stack(outs))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def _ttt_layer_and_input(fast_train, dtype=torch.float64, dim=16, heads=2):
    torch.manual_seed(3)
    layer = TTTAttention(dim, heads, fast_train=fast_train).to(dtype)
    with torch.no_grad():
        for p in (layer.w1, layer.w2, layer.w3):
            p.normal_(0, 0.3)
    x = torch.randn(2, 5 * 6, dim, dtype=dtype, requires_grad=True)
    return layer, x


def test_ttt_recompute_keeps_fewer_tensors_for_backward():
    """What autograd keeps for backward, in bytes: the recomputing layer keeps only x (for qkv), the qkv
    tokens and the proj input, far below the plain graph (which keeps every inner-model temporary)."""
    kept = {}
    for fast_train in (True, False):
        layer, x = _ttt_layer_and_input(fast_train, torch.float32)
        _, saved = saved_for_backward(lambda: layer(x, (5, 6), rope_tables(5, 6, 16)))
        kept[fast_train] = nbytes(saved)
    n, c, d = 2 * 30, 16, 8
    assert kept[True] <= 4 * (n * c + n * (3 * c + 3 * d) + n * (c + d)) + 4 * (16 * 54 + 24 * 16) + 8 * 4 * 1024
    assert kept[True] < 0.5 * kept[False]
