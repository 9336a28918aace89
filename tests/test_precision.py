"""Numerics off the fp32 path (docs/mixed_precision.md): ResT's well-conditioned EMSA against float64 and
across batch sizes, fp16 / bf16 autocast and half-precision weights of every backbone against fp32, gradients
under autocast, and the sums over all tokens that would leave fp16's range at detection sizes."""
import copy

import pytest
import torch

from mmplugin_l2.analysis import authors
from mmplugin_l2.analysis.models import MODELS, build
from mmplugin_l2.analysis.precision import (autocast_error, batch_error, cast_error, fp64_error, grad_error,
                                            rel_l2, run_checks)
from mmplugin_l2.models.layers import EMSA, LinearAttention, TTTAttention, emsa_attention
from mmplugin_l2.models.ops import INFERENCE, TRAIN, Path

MODELS.setdefault('vit3_t', dict(type='ViT3', arch='tiny', drop_path_rate=0.))
BACKBONES = ['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s']
#: the accuracy bounds (relative L2 of every stage against fp32)
BOUND = {torch.bfloat16: 3e-2, torch.float16: 3e-3}

_cache = {}


def model(name):
    """A real-width backbone with random weights (norm affines, biases and BN statistics randomised too)."""
    if name not in _cache:
        torch.manual_seed(0)
        _cache[name] = authors.randomize_(build(name), seed=1).eval()
    return _cache[name]


def images(b, h, w, seed=0):
    return torch.randn(b, 3, h, w, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- ResT conditioning (fp32)
@pytest.mark.parametrize('size', [(224, 224), (256, 320)])
def test_rest_fp32_matches_float64_and_is_batch_independent(size):
    """Today's (and the authors') formulation is off by 3e-5 .. 6e-5 in stages 2-4 at these sizes."""
    m = model('rest_s')
    x = images(2, *size)
    for name, errs in (('fp64', fp64_error(m, x[:1])), ('batch', batch_error(m, x))):
        assert max(errs) <= 1e-5, (name, errs)


def _emsa_path(impl, piece):
    """The path EMSA's dispatch gives with `piece` (None: whole maps, the reference)."""
    return Path.reference() if piece is None else Path(impl, piece)


def test_rest_training_pieces_are_well_conditioned():
    """The training pieces (memory-saving) of the attention and its gradients against float64, on maps whose softmax is
    close to uniform: the regime where P - mean(P) cancels."""
    torch.manual_seed(0)
    b, h, n, nk, d = 2, 4, 300, 75, 16
    q64 = (torch.randn(b, h, n, d, dtype=torch.float64) * 0.05).requires_grad_()
    k64 = (torch.randn(b, h, nk, d, dtype=torch.float64) * 0.05 + 1.0).requires_grad_()
    v64 = torch.randn(b, h, nk, d, dtype=torch.float64).requires_grad_()
    conv64 = torch.nn.Conv2d(h, h, 1).double()
    conv32 = torch.nn.Conv2d(h, h, 1)
    conv32.load_state_dict(conv64.state_dict())
    dout = torch.randn(b, h, n, d, dtype=torch.float64)
    ref = emsa_attention(Path.reference(), q64, k64, v64, d ** -0.5, conv64)
    gref = torch.autograd.grad(ref, [q64, k64, v64, conv64.weight], dout)
    for piece in (None, b * h * nk * 7):
        q, k, v = (t.detach().float().requires_grad_() for t in (q64, k64, v64))
        out = emsa_attention(_emsa_path(TRAIN, piece), q, k, v, d ** -0.5, conv32)
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5, piece
        grads = torch.autograd.grad(out, [q, k, v, conv32.weight], dout.float())
        for g, gr, name in zip(grads, gref, 'q k v w'.split()):
            assert ((g.double() - gr).abs().max() / gr.abs().max()).item() < 1e-4, (piece, name)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
def test_rest_inference_pieces_are_well_conditioned(dtype):
    """The inference blocks (one pass in fp32, two in half precision: the map is scaled before its cast)
    against float64 on near-uniform maps, no worse than the dense path in the same dtype."""
    torch.manual_seed(0)
    b, h, n, nk, d = 2, 4, 300, 75, 16
    q, k, v = (t.to(dtype) for t in (torch.randn(b, h, n, d) * 0.05, torch.randn(b, h, nk, d) * 0.05 + 1.0,
                                     torch.randn(b, h, nk, d)))
    conv = torch.nn.Conv2d(h, h, 1).to(dtype)
    conv64 = torch.nn.Conv2d(h, h, 1).double()
    conv64.load_state_dict(conv.state_dict())
    with torch.no_grad():  # the reference from the same (rounded) inputs: the error is the layer's own
        ref = emsa_attention(Path.reference(), q.double(), k.double(), v.double(), d ** -0.5, conv64)
        errs = {}
        for piece in (None, b * h * nk * 7, 1):
            out = emsa_attention(_emsa_path(INFERENCE, piece), q, k, v, d ** -0.5, conv)
            assert out.dtype == dtype
            errs[piece] = ((out.double() - ref).norm() / ref.norm()).item()
    assert max(errs.values()) <= 2 * torch.finfo(dtype).eps, errs  # the rounding of the dtype
    assert max(errs.values()) <= 1.5 * errs[None] + 1e-7, errs


def test_rest_head_mixing_bias_gets_a_zero_gradient():
    """The softmax ignores the conv bias (a constant over the keys): its true gradient is zero, and it
    stays in the graph (DDP without find_unused_parameters needs every parameter to get a gradient)."""
    m = EMSA(32, 4, 2, qkv_bias=True).train()
    m(torch.randn(2, 64, 32), (8, 8)).square().sum().backward()
    assert m.transform_conv.bias.grad is not None and not m.transform_conv.bias.grad.any()
    assert m.transform_conv.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- autocast and half weights
@pytest.mark.parametrize('name', BACKBONES)
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('how', ['autocast', 'weights'])
def test_low_precision_matches_fp32(name, dtype, how):
    """Autocast at 224^2: ResT's stages 2-4 were off by 0.2 .. 1.4 before its EMSA was reformulated.
    model.half() / model.bfloat16() at 160x192: H-ViT3 raised a dtype error (RoPE returns fp32)."""
    m = model(name)
    if how == 'autocast':
        errs = autocast_error(m, images(1, 224, 224), dtype)
    else:
        errs = cast_error(m, images(1, 160, 192), dtype)
    assert len(errs) == len(m.out_indices) and max(errs) <= BOUND[dtype], errs


@pytest.mark.parametrize('name', BACKBONES)
def test_fp32_training_gradients_against_float64(name):
    """The `grad_fp64` check: one train-mode step's parameter gradients in fp32 against the same model in
    float64 (custom backward functions included): nonzero (the two precisions really differ) and at the
    fp32 rounding level at these sizes."""
    (err,) = grad_error(model(name), images(2, 64, 96), torch.float64)
    assert 1e-9 < err < 1e-4, err


@pytest.mark.parametrize('name', BACKBONES)
def test_gradients_under_autocast_are_finite_and_close(name):
    """One training step under bf16 / fp16 autocast. The error is dominated by the conv + BatchNorm stems
    (train-mode BN removes most of the conv output gradient, what is left carries bf16 rounding). The TTT layers
    take their eager fast paths (`fast_compile` off): the compiled cores' error under bf16 autocast, at H-ViT3's
    head width, is tests/ops/test_ttt_compiled.py's, without compiling every stage's width here."""
    m = copy.deepcopy(model(name))
    for layer in m.modules():
        if isinstance(layer, TTTAttention):
            layer.fast_compile = False
    x = images(1, 64, 96)
    for dtype, bound in ((torch.bfloat16, 0.35), (torch.float16, 0.12)):
        (err,) = grad_error(m, x, dtype)
        assert err <= bound, (dtype, err)


def test_run_checks_reports_every_check():
    res = run_checks(model('rest_s'), images(2, 64, 64), ['batch', 'bf16', 'half'])
    assert set(res) == {'batch', 'bf16', 'half'} and all(len(v) == 4 for v in res.values())
    assert rel_l2(torch.tensor([1., float('nan')]), torch.ones(2)) == float('inf')


# ---------------------------------------------------------------- fp16 range at detection sizes
N_1248 = 312 * 312  # stage-1 tokens of a 1248 x 1248 image


def _large_activations(mod, x, scale):
    """Positive, correlated activations: every sum over the tokens adds up in one direction, as trained
    features do, far beyond random-init magnitudes."""
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.rand_like(p) * scale)
    return x.abs() + 0.5


@pytest.mark.parametrize('grad', [False, True])
def test_ttt_token_sums_stay_in_fp16_range(grad):
    """k^T [a1 | a2] and the conv-head gradient sum over all N tokens; at 1248^2 with these activations
    they reach ~1e6, past fp16's 65504. With `grad`, a training step's backward too (under fp16 autocast the
    closed form, whose token sums q^T dz and k^T dz are as large): with the loss scaled so that fp32's gradients fit
    fp16 (as GradScaler keeps them) every gradient is finite and close to fp32's; unscaled, the inner models'
    weight gradients (~3e6) are still finite, their sums over the tokens being fp32."""
    torch.manual_seed(0)
    m = TTTAttention(16, 1)
    x = _large_activations(m, torch.randn(1, N_1248, 16), 0.15)
    hw = (312, 312)
    with torch.set_grad_enabled(grad):
        ref = m(x, hw)
        with torch.autocast('cpu', dtype=torch.float16):
            low = m(x, hw)
    assert torch.isfinite(low).all()
    assert rel_l2(low, ref) <= BOUND[torch.float16]
    if grad:
        params = list(m.parameters())
        g_ref = torch.autograd.grad(ref.sum() * 1e-3, params, retain_graph=True)
        g_low = torch.autograd.grad(low.float().sum() * 1e-3, params, retain_graph=True)
        for a, b in zip(g_low, g_ref):
            assert torch.isfinite(a).all() and rel_l2(a, b) <= BOUND[torch.float16], rel_l2(a, b)
        inner = torch.autograd.grad(low.float().sum(), [m.w1, m.w2, m.w3])
        assert all(torch.isfinite(g).all() for g in inner) and max(g.abs().max() for g in inner) > 1e6


def test_linear_attention_sums_stay_in_fp16_range():
    torch.manual_seed(0)
    m = LinearAttention(16, 2)
    x = _large_activations(m, torch.randn(1, N_1248, 16), 0.15)
    with torch.no_grad():
        ref = m(x)
        with torch.autocast('cpu', dtype=torch.float16):
            low = m(x)
    assert torch.isfinite(low).all() and rel_l2(low, ref) <= BOUND[torch.float16]


def test_emsa_large_logits_stay_finite():
    """Peaked attention (logits far beyond exp's fp32 range without the per-row shift)."""
    torch.manual_seed(0)
    m = EMSA(32, 4, 8, qkv_bias=True)
    x = torch.randn(1, 64 * 64, 32) * 30
    with torch.no_grad():
        m.q.weight.mul_(50)
        ref = m.double()(x.double(), (64, 64))
        m.float()
        out = m(x, (64, 64))
        with torch.autocast('cpu', dtype=torch.float16):
            low = m(x, (64, 64))
    assert torch.isfinite(out).all() and torch.isfinite(low).all()
    assert rel_l2(out, ref) < 1e-5
