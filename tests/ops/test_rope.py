"""`ops.rope`: 2-D RoPE (the complex rotation, the table, the rotation into heads and its transpose)."""
import pytest
import torch

from mmplugin_l2.models.ops.rope import (apply_rope, apply_rope_halves, halves_order, head_table, real_table,
                                         rope_heads, rope_heads_backward, rope_tables)


def test_rope_matches_complex_rotation():
    h, w, c = 5, 7, 16
    rot = rope_tables(h, w, c)
    x = torch.randn(2, h * w, c)
    k = c // 4
    theta = 10000 ** (-torch.arange(k, dtype=torch.float64) / k)
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing='ij')
    ang = torch.cat([ys.reshape(-1, 1) * theta, xs.reshape(-1, 1) * theta], 1)  # (N, C/2)
    z = torch.view_as_complex(x.double().reshape(2, h * w, c // 2, 2).contiguous())
    ref = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).reshape(2, h * w, c)
    torch.testing.assert_close(apply_rope(x, rot).double(), ref, rtol=0, atol=1e-5)
    # first half of the channels rotates with the row only, second half with the column only
    rows = apply_rope(torch.ones(1, h * w, c), rot).reshape(h, w, c)
    assert torch.allclose(rows[:, :1, :c // 2].expand(-1, w, -1), rows[:, :, :c // 2])
    assert torch.allclose(rows[:1, :, c // 2:].expand(h, -1, -1), rows[:, :, c // 2:])


@pytest.mark.parametrize('dim,heads', [(16, 2), (12, 4)])
def test_rope_heads_and_its_transpose(dim, heads):
    """rope_heads = apply_rope then the head split (exactly); rope_heads_backward is its transpose:
    <rope_heads(x), g> = <x, rope_heads_backward(g)>, also into a strided channel slice."""
    torch.manual_seed(0)
    rot = rope_tables(3, 4, dim)
    wide = torch.randn(2, 12, 3 * dim + 2, dtype=torch.float64)
    x = wide[..., dim + 2:2 * dim + 2]
    ref = apply_rope(x, rot).unflatten(-1, (heads, -1)).transpose(1, 2)
    got = rope_heads(x, rot, heads)
    assert got.is_contiguous() and torch.equal(got, ref)
    g = torch.randn_like(ref)
    out = torch.zeros_like(wide)
    rope_heads_backward(g, rot, out[..., 2:dim + 2])
    torch.testing.assert_close((got * g).sum(), (x * out[..., 2:dim + 2]).sum(), rtol=1e-14, atol=0)
    assert out[..., :2].abs().sum() == 0 and out[..., dim + 2:].abs().sum() == 0


def test_rope_tables_from_inference_mode_serve_training():
    with torch.inference_mode():
        rot = rope_tables(4, 4, 8)
    x = torch.randn(1, 16, 8, requires_grad=True)
    apply_rope(x, rot).sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16])
def test_real_table_rotates_as_the_complex_table(dtype):
    """`real_table` (the (cos, sin) views the compiled TTT core takes): `apply_rope` with it equals the complex
    rotation to fp32 rounding (fp64 for fp64 tokens), a strided channel slice of bf16 tokens included; a pair and
    None pass through."""
    rot = rope_tables(3, 5, 8)
    x = torch.randn(2, 15, 20, dtype=torch.float64).to(dtype)[..., 4:12]
    pair = real_table(rot)
    assert all(t.data_ptr() and t._base is not None for t in pair) and real_table(pair) is pair
    assert real_table(None) is None
    got, want = apply_rope(x, pair), apply_rope(x, rot)
    assert got.dtype == want.dtype
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, rtol=0, atol=4 * eps * want.abs().max().item())


@pytest.mark.parametrize('dim,heads', [(16, 2), (24, 3)])
def test_rope_halves_is_the_rotation_in_halves_order(dim, heads):
    """`apply_rope_halves` on tokens whose channels are in `halves_order`, with the `head_table` view of the table,
    = `apply_rope` followed by the head split and the same order (float64, to rounding); the order puts each head's
    pairs' first members before their second ones."""
    torch.manual_seed(0)
    rot = rope_tables(3, 5, dim)
    x = torch.randn(2, 15, dim, dtype=torch.float64)
    order = halves_order(dim, heads)
    d = dim // heads
    assert order[:d].tolist() == list(range(0, d, 2)) + list(range(1, d, 2))
    split = lambda t: t.unflatten(-1, (heads, d)).transpose(1, 2)   # noqa: E731
    table = head_table(rot, heads)
    assert table.shape == (heads, 15, d // 2, 2) and table._base is not None
    got = apply_rope_halves(split(x[..., order]), table)
    want = split(apply_rope(x, rot)[..., order])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
