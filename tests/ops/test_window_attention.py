"""`ops.window_attention`: attention inside windows, its reference (the whole padded map) and its inference in
pieces of window rows against the naive form (window by window, the explicit softmax), with or without the
padding mask, and the dispatch of `WindowAttention`."""
from functools import partial

import pytest
import torch
import torch.nn as nn

import mmplugin_l2.models.ops.window_attention as wa_op
from mmplugin_l2.models.layers import WindowAttention
from mmplugin_l2.models.ops import INFERENCE, TRAIN, Path
from mmplugin_l2.models.ops.memory import MemoryPolicy, set_memory_policy
from mmplugin_l2.models.ops.window_attention import padding_key_mask, window_attention, window_partition, window_reverse
from mmplugin_l2.models.ops.window_attention.naive import window_attention_naive, window_msa_naive
from ops.harness import assert_autocast_no_worse, assert_matches_naive, record_calls


def _naive(m, hw, mask):
    """The naive windowing with the naive per-window attention of the layer `m`."""
    return lambda x: window_attention_naive(x, hw, m.window_size, partial(window_msa_naive, m), mask)


def _attn(mask_padding=False, c=16, heads=2, ws=4):
    m = WindowAttention(c, heads, ws, mask_padding=mask_padding).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
    return m


def _mask(m, hw, b):
    ws = m.window_size
    padded = (-(-hw[0] // ws) * ws, -(-hw[1] // ws) * ws)
    return padding_key_mask(hw, padded, ws, 'cpu').repeat(b, 1) if m.mask_padding and padded != hw else None


@pytest.mark.parametrize('mask_padding', [False, True])
@pytest.mark.parametrize('hw', [(9, 10), (8, 8), (3, 5)])
def test_reference_matches_naive(mask_padding, hw):
    """The reference (windows by reshapes, the layer's fused attention) = the naive windows one by one with
    the explicit softmax: values and gradients."""
    m = _attn(mask_padding)
    x = torch.randn(2, hw[0] * hw[1], 16, dtype=torch.float64, requires_grad=True)
    mask = _mask(m, hw, 2)
    assert_matches_naive(lambda x: window_attention(Path.reference(), x, hw, 4, m.attention, mask),
                         _naive(m, hw, mask), [x])


@pytest.mark.parametrize('mask_padding', [False, True])
@pytest.mark.parametrize('hw', [(9, 10), (8, 8), (3, 5), (13, 6)])
@pytest.mark.parametrize('piece', [1, 2 * 4 * 12 * 16])
@pytest.mark.parametrize('with_norm', [True, False])
def test_inference_pieces_match_naive(mask_padding, hw, piece, with_norm):
    """Pieces of one and of two window rows (13 rows: a partial last piece with padding), right / bottom
    padding with and without the mask, batch 2, the pre-norm inside the pieces."""
    m = _attn(mask_padding)
    norm = nn.LayerNorm(16).double() if with_norm else nn.Identity()
    mask = _mask(m, hw, 2)
    x = torch.randn(2, hw[0] * hw[1], 16, dtype=torch.float64)
    assert_matches_naive(lambda x: window_attention(Path(INFERENCE, piece), x, hw, 4, m.attention, mask, norm),
                         lambda x: _naive(m, hw, mask)(norm(x)), [x], grads=False)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('mask_padding', [False, True])
def test_inference_pieces_under_autocast(dtype, mask_padding):
    m = _attn(mask_padding).float().eval()
    x = torch.randn(2, 9 * 10, 16)
    with torch.no_grad():
        set_memory_policy(m, None)
        ref = m(x, (9, 10))
        set_memory_policy(m, MemoryPolicy(max_elems=1))
        with torch.autocast('cpu', dtype=dtype):
            low = m(x, (9, 10))
    torch.testing.assert_close(low.float(), ref, rtol=0, atol=8 * torch.finfo(dtype).eps * ref.abs().max().item())



@pytest.mark.parametrize('mask_padding', [False, True])
@pytest.mark.parametrize('hw', [(9, 10), (8, 8)])
def test_train_path_matches_naive(mask_padding, hw):
    """The train path (the reference with the attention kernel in the tokens' dtype or float32: float64 here) =
    the naive form: values and gradients."""
    m = _attn(mask_padding)
    x = torch.randn(2, hw[0] * hw[1], 16, dtype=torch.float64, requires_grad=True)
    mask = _mask(m, hw, 2)
    assert_matches_naive(lambda x: window_attention(Path(TRAIN), x, hw, 4, m.attention, mask), _naive(m, hw, mask), [x])


class _Functional(nn.Module):
    """`fn(layer, x)` with the layer's parameters passed in (`torch.func.functional_call`), so that the harness
    compares the gradients of the parameters too."""

    def __init__(self, layer, fn):
        super().__init__()
        self.layer, self.fn = layer, fn

    def forward(self, x):
        return self.fn(self.layer, x)

    def of(self):
        names = [f'layer.{n}' for n, _ in self.layer.named_parameters()]
        return lambda x, *ps: torch.func.functional_call(self, dict(zip(names, ps)), (x,))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
@pytest.mark.parametrize('mask_padding', [False, True])
@pytest.mark.parametrize('seed', [0, 1, 2])
def test_train_path_under_autocast_no_worse_than_the_reference(dtype, mask_padding, seed):
    """Under bf16 / fp16 autocast the train path (the attention kernel in fp32 on the half q, k, v) against the
    naive form in float64, output and the gradients of the tokens and of every parameter, is no worse than the
    reference (the kernel in the autocast dtype)."""
    torch.manual_seed(seed)
    hw = (9, 10)
    m = _attn(mask_padding, c=32, heads=2, ws=3)
    mask = _mask(m, hw, 2)
    x = torch.randn(2, hw[0] * hw[1], 32, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in m.parameters()]
    fast = _Functional(m, lambda layer, t: window_attention(Path(TRAIN), t, hw, 3, layer.attention, mask)).of()
    ref = _Functional(m, lambda layer, t: window_attention(Path.reference(), t, hw, 3, layer.attention, mask)).of()
    naive = _Functional(m, lambda layer, t: _naive(layer, hw, mask)(t)).of()
    assert_autocast_no_worse(fast, ref, naive, [x] + params, dtype, norm='l2')


# ---------------------------------------------------------------- the layer's dispatch
def _recording(monkeypatch):
    return record_calls(monkeypatch, wa_op, window_attention_in_pieces='inference')


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_training_under_autocast_takes_the_fp32_kernel_on_cpu(monkeypatch, dtype):
    """Training under autocast on CPU takes the train path: the kernel gets float32 q, k, v, and its output
    reaches the projection in the autocast dtype. Inference, `fast_train=False` and float32 training run the kernel
    in the dtype they compute in."""
    calls = _recording(monkeypatch)
    kernel = record_calls(monkeypatch, torch.nn.functional, scaled_dot_product_attention='sdpa')
    m = _attn().float()
    x = torch.randn(2, 9 * 10, 16, requires_grad=True)
    with torch.autocast('cpu', dtype=dtype):
        out = m.train()(x, (9, 10))
        assert out.dtype == dtype
        out.float().sum().backward()
        m.fast_train = False
        m(x, (9, 10))
        m.fast_train = True
        with torch.no_grad():
            m.eval()(x, (9, 10))
    m.train()(x, (9, 10))
    assert [q.dtype for _, (q, *_) in kernel] == [torch.float32, dtype, dtype, torch.float32]
    assert calls.names == [] and x.grad.abs().sum() > 0


def test_eval_with_grad_and_training_take_the_reference(monkeypatch):
    calls = _recording(monkeypatch)
    m = _attn()
    set_memory_policy(m, MemoryPolicy(max_elems=1))
    x = torch.randn(2, 9 * 10, 16, dtype=torch.float64, requires_grad=True)
    m.eval()(x, (9, 10)).sum().backward()
    with torch.no_grad():
        m.train()(x, (9, 10))
    m(x, (9, 10))
    assert calls.names == [] and x.grad.abs().sum() > 0


def test_state_dict_keys():
    assert sorted(WindowAttention(16, 2, 4).state_dict()) == ['proj.bias', 'proj.weight', 'qkv.bias', 'qkv.weight']


def test_window_partition_roundtrip():
    x = torch.randn(2, 14, 21, 3)
    win = window_partition(x, 7)
    assert win.shape == (2 * 2 * 3, 49, 3)
    assert torch.equal(win[1].view(7, 7, 3), x[0, :7, 7:14])  # second window of the first image
    assert torch.equal(window_reverse(win, 7, 14, 21), x)
