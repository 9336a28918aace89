"""`ops.conv`: the convolution chain's reference (the layers called in turn) and its pieces (bands of output
rows, halo rows recomputed) against the naive form (F.conv2d and the BN formula) in float64 (odd sizes,
batch 2, partial last band, stride-2 layers, channels-last and NCHW maps, a per-pixel `pre`), the op's
dispatch (a train-mode BatchNorm inside an eval model and export take the reference), and the layers on it:
L2ViT's LCM (DWConv -> GELU -> BN2d -> DWConv) against its naive form (the paper's Eqs. 6-7), the stems. A
train-mode BatchNorm must give the batch-statistics output and update the running statistics exactly as the
reference does."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mmplugin_l2.models.ops.conv as conv_op
from mmplugin_l2.models.layers import LCM, Conv2dCL, ConvLayer, ConvStem
from mmplugin_l2.models.ops import INFERENCE, Path, choose
from mmplugin_l2.models.ops.conv import (CONV_CHAIN, ConvBNAct, chain_modules, conv_chain, conv_chain_in_pieces,
                                         conv_chain_reference)
from mmplugin_l2.models.ops.export import export_mode
from mmplugin_l2.models.ops.memory import MemoryPolicy
from mmplugin_l2.models.ops.conv.naive import conv_chain_naive, lcm_naive
from ops.harness import assert_autocast_no_worse, assert_matches_naive, record_calls


def _bn(c):
    bn = nn.BatchNorm2d(c)
    with torch.no_grad():
        bn.weight.normal_(1, 0.3)
        bn.bias.normal_(0, 0.3)
        bn.running_mean.normal_(0, 0.3)
        bn.running_var.uniform_(0.5, 2.0)
    return bn.eval()


def _chain(conv_cls=nn.Conv2d):
    """3x3 s2 + BN + ReLU, depth-wise 5x5 + GELU then BN (act first), 3x3 s2 (no bias), 1x1 + BN: odd channels."""
    torch.manual_seed(1)
    layers = [ConvBNAct(conv_cls(3, 5, 3, stride=2, padding=1), _bn(5), nn.ReLU()),
              ConvBNAct(conv_cls(5, 5, 5, padding=2, groups=5), _bn(5), F.gelu, act_first=True),
              ConvBNAct(conv_cls(5, 7, 3, stride=2, padding=1, bias=False)),
              ConvBNAct(conv_cls(7, 4, 1), _bn(4))]
    for layer in layers:
        layer.conv.double()
        if layer.norm is not None:
            layer.norm.double()
    return layers


def _pre(t):
    """A per-pixel function of the map: tanh of a channel mix (independent of the position)."""
    return torch.tanh(t * torch.arange(1, t.shape[1] + 1, dtype=t.dtype).view(1, -1, 1, 1) - t.mean(1, True))


@pytest.mark.parametrize('train_bn', [False, True])
def test_reference_matches_naive(train_bn):
    """The layers called one after the other = the chain written with F.conv2d and the BN formula (running
    statistics; with a train-mode BN the batch's): values and gradients of the map, NCHW and channels-last
    kernels, a per-pixel `pre`."""
    for conv_cls in (nn.Conv2d, Conv2dCL):
        layers = _chain(conv_cls)
        layers[1].norm.train(train_bn)
        x = torch.randn(2, 3, 13, 17, dtype=torch.float64, requires_grad=True)
        assert_matches_naive(lambda t: conv_chain_reference(layers, t, _pre),
                             lambda t: conv_chain_naive(layers, t, _pre), [x])


@pytest.mark.parametrize('hw', [(23, 9), (13, 17), (3, 5)])
@pytest.mark.parametrize('rows', [1, 2, 5])
@pytest.mark.parametrize('channels_last', [False, True])
@pytest.mark.parametrize('pre', [None, _pre])
def test_chain_in_pieces_matches_naive(hw, rows, channels_last, pre):
    """Bands of `rows` output rows (partial last band), stride-2 layers, batch 2, odd sizes, float64."""
    layers = _chain(Conv2dCL if channels_last else nn.Conv2d)
    x = torch.randn(2, 3, *hw, dtype=torch.float64)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    width_out = (hw[1] + 3) // 4
    piece = 2 * rows * max(4 * width_out * 7, 2 * width_out * 5, width_out * 5)   # the widest per output row
    assert_matches_naive(lambda t: conv_chain_in_pieces(layers, t, piece, pre),
                         lambda t: conv_chain_naive(layers, t, pre), [x], grads=False)
    with torch.no_grad():
        out = conv_chain_in_pieces(layers, x, piece, pre)
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_chain_of_conv_layers_in_pieces():
    """ConvLayer modules (the H-ViT3 stem's) in pieces = the naive chain on the whole map."""
    torch.manual_seed(2)
    layers = nn.Sequential(ConvLayer(3, 6, 3, stride=2, padding=1, bias=False),
                           ConvLayer(6, 6, 3, padding=1, groups=6), ConvLayer(6, 4, 1, act=None)).double()
    for m in layers.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.3)
            m.running_var.uniform_(0.5, 2.0)
    layers.eval()
    x = torch.randn(2, 3, 19, 11, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(conv_chain(Path(INFERENCE, 50), layers, x), conv_chain_naive(layers, x), rtol=1e-12,
                                   atol=1e-12)


def test_chain_with_train_mode_batch_norm_takes_the_reference():
    """Pieces would normalise with the running statistics: a train-mode BatchNorm in the chain (a user's eval
    model that holds one) gets the batch statistics and one running-statistics update, as the reference."""
    layers = _chain()
    layers[3].norm.train()
    x = torch.randn(2, 3, 21, 10, dtype=torch.float64)
    bn = layers[3].norm
    state = {k: v.clone() for k, v in bn.state_dict().items()}
    with torch.no_grad():
        ref = conv_chain_reference(layers, x)
        expected = {k: v.clone() for k, v in bn.state_dict().items()}
        bn.load_state_dict(state)
        owner = nn.Module().eval()      # the eval model that holds the chain
        owner.memory_policy = MemoryPolicy(max_elems=8)
        path = choose(owner, x, x[:, :1].numel() * 16, CONV_CHAIN, modules=chain_modules(layers))
        assert path == Path.reference()
        out = conv_chain(path, layers, x)
        bn.eval()
        running = conv_chain_reference(layers, x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, running, atol=1e-6)
    for k, v in bn.state_dict().items():
        torch.testing.assert_close(v, expected[k], rtol=1e-12, atol=1e-14)
    assert bn.num_batches_tracked.item() == 1


def test_stem_dispatch_train_mode_batch_norm_and_export(monkeypatch):
    """The H-ViT3 stem in an eval model with one train-mode BatchNorm, pieces forced: the batch statistics
    (the reference); under export the reference too (no bands)."""
    torch.manual_seed(0)
    stem = ConvStem(3, 8).double().eval()
    stem.memory_policy = MemoryPolicy(max_elems=1)
    x = torch.randn(2, 3, 17, 13, dtype=torch.float64)
    calls = record_calls(monkeypatch, conv_op, conv_chain_in_pieces='pieces')
    with torch.no_grad():
        eval_out = stem(x)
        assert calls, 'pieces did not run'
        calls.clear()
        with export_mode():
            exported = stem(x)
        assert not calls
        stem.conv[1].norm.train()
        out = stem(x)
        assert not calls
        ref = stem.conv(F.pad(x, (0, 3, 0, 3)))
    torch.testing.assert_close(exported, eval_out, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, eval_out, atol=1e-6)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

C, K = 3, 3     # the LCM tests


def _lcm(seed=0):
    torch.manual_seed(seed)
    m = LCM(C, kernel_size=K).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
        m.bn.running_mean.normal_(0, 0.3)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def _naive(m, x, hw, norm=None):
    return lcm_naive(x, hw, m.conv1, m.bn, m.conv2, norm)


@pytest.mark.parametrize('train', [False, True])
def test_lcm_layer_matches_naive(train):
    """The LCM module in eval / train mode (autograd recording: the reference; a train-mode BN normalises with
    the batch's statistics) = the naive Eqs. 6-7: values and gradients; the kernels are 7x7 depth-wise."""
    torch.manual_seed(0)
    m = LCM(6).double().train(train)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
        m.bn.running_mean.normal_(0, 0.3)
        m.bn.running_var.uniform_(0.5, 2.0)
    assert m.conv1.kernel_size == m.conv2.kernel_size == (7, 7) and m.conv1.groups == m.conv2.groups == 6
    hw = (9, 5)
    x = torch.randn(2, hw[0] * hw[1], 6, dtype=torch.float64, requires_grad=True)
    assert_matches_naive(lambda t: copy.deepcopy(m)(t, hw), lambda t: _naive(m, t, hw), [x])


@pytest.mark.parametrize('hw', [(7, 5), (4, 9)])
@pytest.mark.parametrize('with_norm', [False, True])
def test_lcm_inference_in_pieces_matches_naive(hw, with_norm):
    m = _lcm().eval()
    m.memory_policy = MemoryPolicy(max_elems=2 * hw[1] * C, devices=('cpu',))   # a partial last piece
    norm = nn.LayerNorm(C).double() if with_norm else None
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64)
    with torch.no_grad():
        out = m(x, hw, norm=norm)
        ref = _naive(m, x, hw, norm)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_lcm_eval_model_with_train_mode_bn_uses_batch_statistics():
    """Pieces forced: the batch statistics (the naive form with a train-mode BN) and one running-statistics
    update, the whole-map reference's."""
    hw = (7, 5)
    m = _lcm().eval()
    m.bn.train()      # a user's eval-mode model that holds a train-mode BatchNorm
    whole = copy.deepcopy(m)
    m.memory_policy = MemoryPolicy(max_elems=2 * hw[1] * C, devices=('cpu',))   # pieces forced
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64)
    with torch.no_grad():
        ref = _naive(m, x, hw)
        m.bn.eval()
        eval_ref = _naive(m, x, hw)       # the running statistics (before the update): must differ
        m.bn.train()
        out = m(x, hw)
        whole(x, hw)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, eval_ref, atol=1e-6)
    torch.testing.assert_close(m.bn.running_mean, whole.bn.running_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m.bn.running_var, whole.bn.running_var, rtol=1e-12, atol=1e-14)
    assert m.bn.num_batches_tracked.item() == 1


def test_lcm_eval_with_grad_matches_naive():
    hw = (5, 6)
    m = _lcm().eval()
    m.memory_policy = MemoryPolicy(max_elems=2 * hw[1] * C, devices=('cpu',))
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64)
    (m(x, hw) * g).sum().backward()
    (_naive(m, x2, hw) * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_lcm_pieces_under_autocast(dtype):
    hw = (7, 5)
    m = _lcm().float().eval()
    m.memory_policy = MemoryPolicy(max_elems=2 * hw[1] * C, devices=('cpu',))
    x = torch.randn(2, hw[0] * hw[1], C)
    with torch.no_grad():
        ref = _naive(m, x, hw)
        with torch.autocast('cpu', dtype=dtype):
            out = m(x, hw)
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


# ------------------------------------------------------------------ the depth-wise training pass
DW_CASES = [  # (kernel, stride, padding, dilation, batch, (H, W), channels-last)
    (3, 1, 1, 1, 2, (9, 11), True), (7, 1, 3, 1, 1, (13, 10), True), (3, 2, 1, 1, 2, (9, 11), False),
    (5, 3, 2, 1, 3, (14, 9), True), (3, 1, 2, 2, 2, (8, 7), False), (3, 2, 2, 2, 1, (11, 9), True),
    (9, 8, 4, 1, 2, (17, 26), True)]


def _dw_inputs(k, b, hw, cl, c=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, c, *hw, generator=g, dtype=dtype)
    x = x.to(memory_format=torch.channels_last) if cl else x
    w = torch.randn(c, 1, k, k, generator=g, dtype=dtype) * 0.3
    bias = torch.randn(c, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (x, w, bias)]


def _dw_function(s, p, d):
    return lambda x, w, bias: conv_op.DepthwiseConvFunction.apply(x, w, bias, (s, s), (p, p), (d, d))


def _dw_conv(s, p, d):
    return lambda x, w, bias: F.conv2d(x, w, bias, s, p, d, groups=x.shape[1])


@pytest.mark.parametrize('k,s,p,d,b,hw,cl', DW_CASES)
def test_depthwise_function_matches_naive(k, s, p, d, b, hw, cl):
    """`DepthwiseConvFunction` (a large kernel's weight gradient as a convolution per sample, a strided
    convolution's input gradient as a transposed convolution, torch's kernels for the rest) equals F.conv2d in
    float64: output and the gradients of input, weight and bias, for kernels, strides (rows and columns the strided
    output does not reach included), paddings, dilations, batches and both layouts."""
    assert_matches_naive(_dw_function(s, p, d), _dw_conv(s, p, d), _dw_inputs(k, b, hw, cl))


@pytest.mark.parametrize('k,s,p,d,b,hw,cl', DW_CASES[:4] + DW_CASES[-1:])
def test_depthwise_function_under_bf16_autocast_no_worse_than_reference(k, s, p, d, b, hw, cl):
    """Under bf16 autocast (the one autocast it is declared for) the function's output and gradients are as close
    to float64 as autocast's own convolution's."""
    assert_autocast_no_worse(_dw_function(s, p, d), _dw_conv(s, p, d), _dw_conv(s, p, d),
                             _dw_inputs(k, b, (4 * hw[0], 4 * hw[1]), cl), torch.bfloat16)


@pytest.mark.parametrize('autocast,expected', [(torch.bfloat16, 'train'), (torch.float16, 'reference'),
                                               (None, 'reference')])
def test_depthwise_conv_layer_dispatch(monkeypatch, autocast, expected):
    """A depth-wise 7x7 `Conv2dCL` and a strided depth-wise 3x3 one train with `DepthwiseConvFunction` under bf16
    autocast on CPU (and on bf16 inputs) only: fp32, fp16 autocast, eval mode, a 3x3 stride-1 depth-wise conv, a
    non-depth-wise conv and exports take torch's convolution."""
    calls = record_calls(monkeypatch, conv_op.depthwise, DepthwiseConvFunction='train')
    monkeypatch.setattr('mmplugin_l2.models.layers.conv.DepthwiseConvFunction', conv_op.depthwise.DepthwiseConvFunction)
    dw, full = Conv2dCL(4, 4, 7, padding=3, groups=4), Conv2dCL(4, 4, 7, padding=3)
    small, strided = Conv2dCL(4, 4, 3, padding=1, groups=4), Conv2dCL(4, 4, 3, stride=2, padding=1, groups=4)
    x = torch.randn(2, 4, 9, 9, requires_grad=True)
    with torch.autocast('cpu', dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = dw(x)
        full(x)
        small(x)
        strided(full(x))
        dw.eval()
        dw(x)
        dw.train()
        with export_mode():
            dw(x)
    assert calls.names == ([] if expected == 'reference' else ['train', 'train'])
    assert y.dtype == (autocast or torch.float32)
    y.float().sum().backward()
    assert dw.weight.grad.dtype == torch.float32 and dw.bias.grad.dtype == torch.float32
    calls.clear()
    dw.bfloat16()(x.detach().bfloat16())       # bf16 weights and input without autocast: computed in bf16
    assert calls.names == ['train']
