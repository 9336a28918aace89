"""The speed / memory paths of the shared layers compute the same function as the plain ones."""
import pytest
import torch
import torch.nn as nn

from conftest import nbytes, saved_for_backward
from mmplugin_l2.models.layers import (Conv2dCL, ConvDownsample, ConvMlp, ConvStem, ConvStem2L, LinearAttention, Mlp,
                                      TTTAttention, WindowAttention, rope_tables)
from mmplugin_l2.models.layers.bands import can_run_in_bands
from mmplugin_l2.models.layers.ttt import ttt_core


def _saved_bytes(fn):
    out, saved = saved_for_backward(fn)
    return out, nbytes(saved)


@pytest.mark.parametrize('cls', [Mlp, ConvMlp])
def test_mlp_recompute_same_gradients_less_saved(cls):
    torch.manual_seed(0)
    grads, saved = {}, {}
    for recompute in (False, True):
        torch.manual_seed(0)
        m = cls(8, 32, drop=0.1, recompute=recompute).double().train()
        x = torch.randn(2, 6 * 5, 8, dtype=torch.float64, requires_grad=True)
        torch.manual_seed(1)   # same dropout masks
        y, saved[recompute] = _saved_bytes(lambda: m(x, (6, 5)))
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).sin()).sum().backward()
        grads[recompute] = [x.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # kept for backward with recompute: the input only (8 channels), not the 32-wide hidden activations
    assert saved[True] <= 2 * 30 * 8 * 8 + 64
    assert saved[True] * 4 < saved[False]


def test_mlp_token_chunks_equal_whole_map():
    torch.manual_seed(0)
    m = Mlp(8, 32).eval()
    m.chunk_tokens = 16     # 100 tokens -> 7 chunks, the last one partial
    x = torch.randn(2, 100, 8)
    with torch.no_grad():
        chunked = m(x)
    whole = m.fc2(torch.nn.functional.gelu(m.fc1(x))).detach()
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize('groups,k,stride', [(16, 3, 1), (16, 7, 1), (1, 3, 2), (1, 1, 1)])
def test_conv2d_channels_last_equals_conv2d(groups, k, stride):
    torch.manual_seed(0)
    ref = nn.Conv2d(16, 16, k, stride=stride, padding=k // 2, groups=groups)
    cl = Conv2dCL(16, 16, k, stride=stride, padding=k // 2, groups=groups)
    cl.load_state_dict(ref.state_dict())
    assert list(cl.state_dict()) == ['weight', 'bias']
    tokens = torch.randn(2, 9 * 11, 16, requires_grad=True)
    x = tokens.transpose(1, 2).reshape(2, 16, 9, 11)      # the channels-last view our layers pass
    a, b = cl(x), ref(x.contiguous())
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert a.is_contiguous(memory_format=torch.channels_last)
    a.sum().backward()
    assert cl.weight.grad.shape == cl.weight.shape


@pytest.mark.parametrize('hw', [(13, 7), (40, 3), (5, 50)])
def test_conv_mlp_row_bands_equal_whole_map(hw):
    """Inference in bands of rows with one halo row each side = the whole map (band edges, image edges,
    a last partial band)."""
    torch.manual_seed(0)
    m = ConvMlp(8, 32).eval()
    m.chunk_elems = 2 * 20 * 32     # bands of 20 tokens' hidden activations (at least one row)
    x = torch.randn(2, hw[0] * hw[1], 8)
    with torch.no_grad():
        banded = m(x, hw)
    assert banded.shape == x.shape
    with torch.enable_grad():
        whole = m(x, hw).detach()        # the grad-enabled path takes the whole map
    torch.testing.assert_close(banded, whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize('with_rope', [True, False])
@pytest.mark.parametrize('chunk_elems', [64 * 7, 64 * 30, 2 ** 20])
def test_ttt_inference_chunks_equal_plain_path(with_rope, chunk_elems):
    """The chunked inference TTT layer (qkv, inner models and proj chunk by chunk) = the plain path
    (the one autograd runs), for chunks of 7 and 30 tokens (a partial last chunk) and one chunk."""
    torch.manual_seed(0)
    m = TTTAttention(64, 2).eval()
    for p in m.parameters():
        nn.init.normal_(p, std=0.2)
    m.chunk_elems = chunk_elems
    hw = (9, 11)
    x = torch.randn(2, hw[0] * hw[1], 64)
    rot = rope_tables(*hw, 64) if with_rope else None
    with torch.no_grad():
        chunked = m(x, hw, rot)
        plain = m.proj(ttt_core(m.qkv(x), rot, m.w1, m.w2, m.w3, hw, m.num_heads, m.scale, m.lr))
    assert plain.abs().max() > 1
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-5)
    with torch.enable_grad():   # the training path gives the same output too
        torch.testing.assert_close(m(x, hw, rot), chunked, rtol=1e-6, atol=1e-5)


def _random_bn_stats(module):
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2)
            nn.init.normal_(m.weight)
            nn.init.normal_(m.bias)
    return module.eval()


@pytest.mark.parametrize('cls,args,shape', [
    (ConvStem, (3, 16), (1, 3, 64, 48)), (ConvStem, (3, 16), (2, 3, 37, 29)), (ConvStem, (3, 16), (1, 3, 5, 9)),
    (ConvDownsample, (16, 32), (1, 16, 20, 30)), (ConvDownsample, (16, 32), (2, 16, 21, 17)),
    (ConvDownsample, (16, 32), (1, 16, 1, 3)), (ConvStem2L, (3, 16), (1, 3, 64, 48)),
    (ConvStem2L, (3, 16), (2, 3, 37, 29))])
@pytest.mark.parametrize('band_elems', [1, 700, 5000])
def test_conv_chains_in_row_bands_equal_whole_map(cls, args, shape, band_elems):
    """Stem and downsampling at inference, band by band of output rows (halo rows recomputed, zero rows
    only at the image's own top/bottom, odd sizes, batch 2, a band of one row) = the whole-map chain."""
    torch.manual_seed(0)
    m = _random_bn_stats(cls(*args))
    x = torch.randn(shape)
    with torch.no_grad():
        m.band_elems = 10 ** 12
        whole = m(x)
        m.band_elems = band_elems
        banded = m(x)
    assert banded.shape == whole.shape
    torch.testing.assert_close(banded, whole, rtol=1e-6, atol=1e-5)


def test_conv_chains_use_bands_only_when_safe():
    """No bands while autograd records, nor while a BatchNorm would update its running statistics."""
    stem = ConvStem(3, 16)
    with torch.no_grad():
        assert not can_run_in_bands(stem.conv.train())
        assert can_run_in_bands(stem.conv.eval())
    assert not can_run_in_bands(stem.conv)


@pytest.mark.parametrize('chunk_elems', [32 * 7, 32 * 64])
def test_linear_attention_chunks_equal_whole_map(chunk_elems):
    """L2ViT's linear attention at inference in two chunked passes (K^T V and sum K accumulated over
    chunks of 7 or 64 tokens, a partial last chunk) = the whole-map computation."""
    torch.manual_seed(0)
    m = LinearAttention(32, 2).eval()
    for p in m.parameters():
        nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 300, 32)
    with torch.no_grad():
        m.chunk_elems = 10 ** 12
        whole = m(x)
        m.chunk_elems = chunk_elems // 2      # per sample of the batch of 2
        chunked = m(x)
    assert whole.abs().max() > 1
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize('mask_padding', [False, True])
@pytest.mark.parametrize('hw', [(20, 33), (28, 14), (5, 9)])
def test_window_attention_bands_equal_whole_map(mask_padding, hw):
    """Window attention at inference, a band of window rows at a time (padding, masks) = whole map."""
    torch.manual_seed(0)
    m = WindowAttention(32, 2, 7, mask_padding=mask_padding).eval()
    x = torch.randn(2, hw[0] * hw[1], 32)
    with torch.no_grad():
        m.chunk_elems = 10 ** 12
        whole = m(x, hw)
        m.chunk_elems = 1          # one window row per band
        banded = m(x, hw)
    torch.testing.assert_close(banded, whole, rtol=0, atol=1e-6)
