"""`ops.window_attention`: attention inside windows, its inference in pieces of window rows against the
reference (the whole padded map, with or without the padding mask), and the dispatch of `WindowAttention`."""
import pytest
import torch
import torch.nn as nn

import mmplugin_l2.models.ops.window_attention as wa_op
from mmplugin_l2.models.layers import WindowAttention
from mmplugin_l2.models.ops import INFERENCE, Path
from mmplugin_l2.models.ops.memory import MemoryPolicy, set_memory_policy
from mmplugin_l2.models.ops.window_attention import padding_key_mask, window_attention
from ops.harness import assert_matches_reference


def explicit_windows(attn, x, hw, ws, mask_padding):
    """Every window of the zero-padded map written out as a loop: softmax(q k^T * scale) v per head, padded
    keys dropped with `mask_padding`; an independent reference for the op."""
    b, _, c = x.shape
    h, w = hw
    hp, wp = -(-h // ws) * ws, -(-w // ws) * ws
    xp = x.new_zeros(b, hp, wp, c)
    xp[:, :h, :w] = x.view(b, h, w, c)
    real = torch.zeros(hp, wp, dtype=torch.bool)
    real[:h, :w] = True
    out = torch.zeros_like(xp)
    nh = attn.num_heads
    for i in range(0, hp, ws):
        for j in range(0, wp, ws):
            t = xp[:, i:i + ws, j:j + ws].reshape(b, ws * ws, c)
            keep = real[i:i + ws, j:j + ws].reshape(-1) if mask_padding else torch.ones(ws * ws, dtype=torch.bool)
            q, k, v = attn.qkv(t).view(b, ws * ws, 3, nh, c // nh).permute(2, 0, 3, 1, 4)
            s = (q @ k.transpose(-2, -1)) * attn.scale
            y = s.masked_fill(~keep, float('-inf')).softmax(-1) @ v
            out[:, i:i + ws, j:j + ws] = attn.proj(y.transpose(1, 2).reshape(b, ws * ws, c)).view(b, ws, ws, c)
    return out[:, :h, :w].reshape(b, h * w, c)


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
def test_reference_is_the_explicit_windows(mask_padding, hw):
    m = _attn(mask_padding)
    x = torch.randn(2, hw[0] * hw[1], 16, dtype=torch.float64, requires_grad=True)
    assert_matches_reference(lambda x: window_attention(Path.reference(), x, hw, 4, m.attention, _mask(m, hw, 2)),
                             lambda x: explicit_windows(m, x, hw, 4, mask_padding), [x])


@pytest.mark.parametrize('mask_padding', [False, True])
@pytest.mark.parametrize('hw', [(9, 10), (8, 8), (3, 5), (13, 6)])
@pytest.mark.parametrize('piece', [1, 2 * 4 * 12 * 16])
@pytest.mark.parametrize('with_norm', [True, False])
def test_inference_pieces_match_reference(mask_padding, hw, piece, with_norm):
    """Pieces of one and of two window rows (13 rows: a partial last piece with padding), right / bottom
    padding with and without the mask, batch 2, the pre-norm inside the pieces."""
    m = _attn(mask_padding)
    norm = nn.LayerNorm(16).double() if with_norm else None
    mask = _mask(m, hw, 2)

    def run(path):
        return lambda x: window_attention(path, x, hw, 4, m.attention, mask, norm)
    x = torch.randn(2, hw[0] * hw[1], 16, dtype=torch.float64)
    assert_matches_reference(run(Path(INFERENCE, piece)), run(Path.reference()), [x], grads=False)


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


# ---------------------------------------------------------------- the layer's dispatch
def _recording(monkeypatch):
    names = []
    inner = wa_op.window_attention_in_pieces
    monkeypatch.setattr(wa_op, 'window_attention_in_pieces', lambda *a: names.append('inference') or inner(*a))
    return names


@pytest.mark.parametrize('devices,pieces', [(('cpu',), True), (('cuda',), False)])
def test_pieces_only_on_the_policys_devices(monkeypatch, devices, pieces):
    names = _recording(monkeypatch)
    m = _attn(True).eval()
    set_memory_policy(m, MemoryPolicy(max_elems=1, devices=devices))
    x = torch.randn(2, 9 * 10, 16, dtype=torch.float64)
    with torch.no_grad():
        out = m(x, (9, 10))
    torch.testing.assert_close(out, explicit_windows(m, x, (9, 10), 4, True).detach(), rtol=1e-10, atol=1e-12)
    assert names == (['inference'] if pieces else [])


def test_eval_with_grad_and_training_take_the_reference(monkeypatch):
    names = _recording(monkeypatch)
    m = _attn()
    set_memory_policy(m, MemoryPolicy(max_elems=1))
    x = torch.randn(2, 9 * 10, 16, dtype=torch.float64, requires_grad=True)
    m.eval()(x, (9, 10)).sum().backward()
    with torch.no_grad():
        m.train()(x, (9, 10))
    m(x, (9, 10))
    assert names == [] and x.grad.abs().sum() > 0


def test_state_dict_keys():
    assert sorted(WindowAttention(16, 2, 4).state_dict()) == ['proj.bias', 'proj.weight', 'qkv.bias', 'qkv.weight']
