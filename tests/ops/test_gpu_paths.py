"""GPU-path choices checked on the CPU: ResT's single-head EMSA as torch's fused SDPA, the TTT output under
autocast without an fp32 round trip, every fused SDPA kernel kept by the selective checkpoint, and window
attention split into calls within CUDA's launch limits."""
import math
import re
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import mmplugin_l2.models.ops.emsa.reference as emsa_ref
import mmplugin_l2.models.layers.ttt as ttt_layer
import mmplugin_l2.models.ops.ttt as ttt_op
import mmplugin_l2.models.ops.ttt.pieces as ttt_pieces
import mmplugin_l2.models.ops.window_attention.reference as wa_ref
from mmplugin_l2.models.backbones import L2ViT
from mmplugin_l2.models.layers import EMSA, TTTAttention, WindowAttention, rope_tables
from mmplugin_l2.models.ops.checkpoint import PRODUCTS
from mmplugin_l2.models.ops.emsa import emsa_attention_reference
from mmplugin_l2.models.ops.emsa.reference import apply_map, centred_keys, softmax_map
from mmplugin_l2.models.ops.window_attention import sdpa_batch_slices, sdpa_in_slices
from ops.harness import assert_matches_reference, record_calls


def _sdpa_calls(monkeypatch):
    """Record the query shape of every F.scaled_dot_product_attention call from now on."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append(tuple(q.shape))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, 'scaled_dot_product_attention', spy)
    return calls


def _randomised(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return module


# ---- ResT's single-head EMSA: softmax(q k^T * scale) v is torch's SDPA --------------------------------------
def _written_out_single_head(q, k, v, scale):
    """The single-head form as it was written out: softmax over the centred keys, then the map times v."""
    return apply_map(softmax_map(q, centred_keys(k), scale), v)


@pytest.mark.parametrize('n_keys', [1, 5, 24])
def test_single_head_emsa_sdpa_equals_written_out(n_keys):
    """float64 values and gradients of the reference's single-head form (now SDPA) = the written-out softmax
    attention it replaced, for one key, a few, and more keys than queries' head width."""
    q = torch.randn(2, 1, 12, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1, n_keys, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1, n_keys, 8, dtype=torch.float64, requires_grad=True)
    assert_matches_reference(lambda q, k, v: emsa_attention_reference(q, k, v, 0.7),
                             lambda q, k, v: _written_out_single_head(q, k, v, 0.7), [q, k, v])


@pytest.mark.parametrize('training', [True, False])
def test_rest_single_head_stage_calls_sdpa(monkeypatch, training):
    """ResT's single-head EMSA (stage 1: no head-mixing conv) on whole maps, as on CUDA, calls SDPA once per
    forward in training and inference, with float64 values and parameter gradients equal to the written-out
    form; the multi-head EMSA (conv + instance norm on the map: not plain softmax attention) does not."""
    layer = _randomised(EMSA(16, 1, sr_ratio=2, qkv_bias=True).double()).train(training)
    layer.memory_policy = None
    x = torch.randn(2, 36, 16, dtype=torch.float64, requires_grad=training)
    calls = _sdpa_calls(monkeypatch)
    with torch.set_grad_enabled(training):
        out = layer(x, (6, 6))
    assert calls == [(2, 1, 36, 16)]
    if training:
        grads = torch.autograd.grad(out.sum(), [x, *layer.parameters()])
        monkeypatch.setattr(emsa_ref, 'fused_softmax_attention', lambda *a: False)
        x2 = x.detach().requires_grad_()
        out2 = layer(x2, (6, 6))
        grads2 = torch.autograd.grad(out2.sum(), [x2, *layer.parameters()])
        torch.testing.assert_close(out, out2, rtol=1e-12, atol=1e-13)
        for g, g2 in zip(grads, grads2):
            torch.testing.assert_close(g, g2, rtol=1e-10, atol=1e-12)
    calls.clear()
    multi = EMSA(16, 2, sr_ratio=2).train(training)
    multi.memory_policy = None
    with torch.set_grad_enabled(training):
        multi(x.float(), (6, 6))
    assert calls == []


# ---- TTT: the output stays in the autocast dtype until `proj` ----------------------------------------------
def _ttt_case():
    torch.manual_seed(0)
    layer = TTTAttention(32, 2)
    x = torch.randn(2, 64, 32)
    return layer, x, rope_tables(8, 8, 32)


#: mode -> the path `choose` gives the layer under bf16 autocast on CPU, and without autocast: 'train' (`fast_compile`
#: off) TTTCore, recomputing by autograd under bf16 (`TTT`'s train path is not declared for it) and with its
#: closed-form backward in float64; 'compiled' the compiled core where `TTT` declares it (bf16 autocast on CPU)
TTT_MODES = dict(train=('checkpoint', 'train'), compiled=('compiled', 'train'), reference=('reference', 'reference'),
                 inference=('inference', 'inference'))


def _run_ttt(layer, x, rot, mode, monkeypatch):
    """The layer in `mode`: 'train' (TTTCore), 'compiled' (the compiled core where `TTT` declares it, else
    TTTCore), 'reference' (plain autograd) or 'inference' (pieces, no grad); the path `choose` gave it is checked
    (`TTT_MODES`)."""
    layer.train(mode != 'inference')
    layer.fast_train = mode in ('train', 'compiled')
    layer.fast_compile = mode == 'compiled'
    calls = record_calls(monkeypatch, ttt_layer, ttt_attention='ttt_attention')
    with torch.set_grad_enabled(mode != 'inference'):
        out = layer(x, (8, 8), rot)
    taken = [args[-1].impl for _, args in calls]
    want = TTT_MODES[mode][0 if torch.is_autocast_enabled('cpu') else 1]
    assert taken == [want], (mode, taken)
    return out


@pytest.mark.parametrize('mode', list(TTT_MODES))
def test_ttt_output_reaches_proj_in_the_autocast_dtype(mode, monkeypatch):
    """Under bf16 autocast the TTT core's output goes into `proj` as bf16 (no fp32 copy of the (B, N, C + d)
    output that autocast casts straight back); without autocast in the weights' dtype as before."""
    layer, x, rot = _ttt_case()
    seen = []
    layer.proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = _run_ttt(layer, x, rot, mode, monkeypatch)
    assert seen and set(seen) == {torch.bfloat16}
    assert out.dtype == torch.bfloat16
    seen.clear()
    _run_ttt(layer.double(), x.double(), rot, mode, monkeypatch)
    assert set(seen) == {torch.float64}


@pytest.mark.parametrize('mode', list(TTT_MODES))
def test_ttt_autocast_result_unchanged_and_close_to_float64(monkeypatch, mode):
    """Dropping the round trip changes no value: the bf16-autocast output equals the one with the fp32 round
    trip bit for bit (its error against float64 is therefore the same), and that error is bf16-sized."""
    layer, x, rot = _ttt_case()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = _run_ttt(layer, x, rot, mode, monkeypatch).float()
    for mod in (ttt_op, ttt_pieces):
        monkeypatch.setattr(mod, 'proj_input', lambda y, proj: y.to(proj.weight.dtype))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        before = _run_ttt(layer, x, rot, mode, monkeypatch).float()
    assert torch.equal(out, before)
    ref = _run_ttt(layer.double(), x.double(), rot, mode, monkeypatch)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 3e-2, err


# ---- selective checkpoint: every fused attention kernel is kept ----------------------------------------------
def _sdpa_forward_kernels():
    """Every overload of every `aten::_scaled_dot_product_*attention*` op of this torch build that is not a
    backward kernel."""
    names = {n.split('.')[0] for n in torch._C._dispatch_get_all_op_names()
             if re.fullmatch(r'aten::_scaled_dot_product_\w*attention\w*(\.\w+)?', n)}
    names = [n[len('aten::'):] for n in names if not n.endswith('_backward')]
    assert '_scaled_dot_product_cudnn_attention' in names, names
    return [getattr(getattr(torch.ops.aten, n), o) for n in names for o in getattr(torch.ops.aten, n).overloads()]


def test_selective_checkpoint_keeps_every_sdpa_kernel():
    """`PRODUCTS` (outputs kept, not recomputed, by `checkpointed(keep_products=True)`) holds every forward
    SDPA kernel torch has: CPU / CUDA flash, memory-efficient, cuDNN, math, MPS, the overridable one."""
    kernels = _sdpa_forward_kernels()
    missing = [str(k) for k in kernels if k not in PRODUCTS]
    assert not missing, missing
    assert torch.ops.aten._scaled_dot_product_cudnn_attention.default in PRODUCTS


# ---- window attention within CUDA's launch limits -----------------------------------------------------------
@pytest.mark.parametrize('with_mask', [False, True])
def test_sdpa_in_slices_equals_one_call(monkeypatch, with_mask):
    """With the limit forced down to 5 (window, head) pairs, 7 windows x 2 heads run as slices of 2, 2, 2 and 1
    windows: float64 values and gradients equal one SDPA call, the padding mask sliced with them."""
    monkeypatch.setattr(wa_ref, 'MAX_SDPA_BATCH_HEADS', 5)
    assert sdpa_batch_slices(7, 2) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]
    q, k, v = (torch.randn(7, 2, 9, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = None
    if with_mask:
        mask = torch.rand(7, 1, 1, 9) > 0.3
        mask[..., 0] = True
    calls = _sdpa_calls(monkeypatch)
    assert_matches_reference(lambda q, k, v: sdpa_in_slices(q, k, v, mask, scale=0.4),
                             lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.4),
                             [q, k, v])
    assert calls[:4] == [(2, 2, 9, 4)] * 3 + [(1, 2, 9, 4)]


@pytest.mark.parametrize('mask_padding', [False, True])
def test_window_attention_split_equals_unsplit(monkeypatch, mask_padding):
    """The layer with the limit forced down (18 windows x 2 heads in slices of 4 windows) = the layer in one
    call: float64 values and gradients w.r.t. the input and every parameter."""
    layer = _randomised(WindowAttention(16, 2, 4, mask_padding=mask_padding).double()).train()
    x = torch.randn(2, 9 * 10, 16, dtype=torch.float64, requires_grad=True)

    def run():
        out = layer(x, (9, 10))
        return out, torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(),
                                        [x, *layer.parameters()])

    whole, whole_grads = run()
    monkeypatch.setattr(wa_ref, 'MAX_SDPA_BATCH_HEADS', 9)
    calls = _sdpa_calls(monkeypatch)
    split, split_grads = run()
    assert [c[0] for c in calls] == [4] * 4 + [2]   # 2 images x 3 x 3 windows of 4 x 4 (padded to 12 x 12)
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-13)
    for a, b in zip(split_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_l2vit_t_at_2048_batch_8_splits_window_attention(monkeypatch):
    """L2ViT-T at 2048 x 2048, batch 8, window 7 (run on the meta device: shapes only): stage 1 has
    8 x ceil(512 / 7)^2 = 43808 windows x 3 heads and stage 2 8 x 37^2 = 10952 windows x 6 heads, both above
    CUDA's 65535; every SDPA call stays within it and the calls cover every window of every LWA block."""
    with torch.device('meta'):
        model = L2ViT('tiny').eval()
    calls = _sdpa_calls(monkeypatch)
    with torch.no_grad():
        model(torch.empty(8, 3, 2048, 2048, device='meta'))
    limit = wa_ref.MAX_SDPA_BATCH_HEADS
    assert limit == 65535
    assert all(b * h <= limit for b, h, _, _ in calls), calls
    arch = L2ViT.arch_zoo['tiny']
    windows = Counter()
    for b, h, _, _ in calls:
        windows[h] += b
    for i, (heads, depth) in enumerate(zip(arch['num_heads'], arch['depths'])):
        per_block = 8 * math.ceil(2048 / 4 / 2 ** i / 7) ** 2
        assert windows[heads] == per_block * (depth // 2), (i, windows)
        assert (per_block * heads > limit) == (i < 2)
    assert len(calls) > sum(d // 2 for d in arch['depths'])   # split: more calls than LWA blocks
