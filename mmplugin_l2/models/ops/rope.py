"""2-D rotary position embedding (RoPE) of H-ViT3, applied to the full channel width before the head split.

For a map of H x W tokens with C channels, k_max = C/4 and theta_k = base^(-k/k_max), k = 0..k_max-1.
The token at integer grid position (y, x) gets the C/2 angles [y*theta_0 .. y*theta_{k_max-1},
x*theta_0 .. x*theta_{k_max-1}]; channel pairs (2j, 2j+1) are rotated as complex numbers by angle j
(interleaved convention), so channels [0, C/2) encode rows and [C/2, C) encode columns.

`rope_tables(h, w, c)` computes the (H*W, C/2) complex rotation table cos + i sin once per stage and size;
`apply_rope(x, rot)` rotates tokens (B, N, C) with one complex multiply (no cos/sin temporaries, no stack)
and returns fp32 for fp32/fp16/bf16 input, as the authors' code does. Bit-identical to the authors'
real-valued form re*cos - im*sin, im*cos + re*sin. Without autograd (H-ViT3's TTT training function),
`rope_heads` rotates and splits into contiguous (B, H, N, d) heads in one pass and `rope_heads_backward`
applies the transpose (rotation by the conjugate table) into a gradient's channel slice. For compiled code (the TTT
core's compiled path), `apply_rope_halves` rotates heads whose channels are in `halves_order` (each head's pairs as
[first members | second members]: contiguous halves instead of interleaved pairs) with the `head_table` view.
"""
import torch

from .dtypes import compute_dtype
from .export import exporting


def _angles(n, theta):
    return torch.arange(n, device=theta.device, dtype=theta.dtype).unsqueeze(-1) * theta


def rope_tables(h, w, c, device=None, base=10000):
    """Complex rotation table cos + i*sin of shape (h*w, c/2), complex64, never requiring grad. While
    exporting (`ops/export.py`) the real pair (cos, sin), each (h*w, c/2) fp32: ONNX has no complex
    tensors."""
    if c % 4:
        raise ValueError(f'2-D RoPE needs a channel count divisible by 4, got {c}')
    k_max = c // 4
    if exporting():
        theta = 1 / (base ** (torch.arange(k_max, device=device, dtype=torch.float32) / k_max))
        rows, cols = _angles(h, theta), _angles(w, theta)        # (h, k_max), (w, k_max)
        ang = torch.cat([rows.unsqueeze(1).expand(h, w, k_max), cols.unsqueeze(0).expand(h, w, k_max)],
                        dim=-1).reshape(h * w, c // 2)
        return ang.cos(), ang.sin()
    # Built outside inference mode so the table can also serve a later training forward.
    with torch.inference_mode(False), torch.no_grad():
        theta = 1 / (base ** (torch.arange(k_max, device=device) / k_max))
        # cos / sin of the h row angles and the w column angles only, then broadcast over the grid
        rows, cols = (torch.arange(n, device=device).unsqueeze(-1) * theta for n in (h, w))
        rows, cols = (torch.complex(torch.cos(a), torch.sin(a)) for a in (rows, cols))
        return torch.cat([rows.unsqueeze(1).expand(h, w, k_max), cols.unsqueeze(0).expand(h, w, k_max)],
                         dim=-1).reshape(h * w, c // 2)


def apply_rope(x, rot):
    """Rotate interleaved channel pairs of tokens x (B, N, C) by the table `rot` (N, C/2).

    Returns fp32 (fp64 for fp64 input). `x` may be a strided channel slice (e.g. of a fused qkv output)
    as long as its last dimension is contiguous. `rot` may also be the real (cos, sin) pair of
    `rope_tables` in export mode: the real-valued form re*cos - im*sin, im*cos + re*sin."""
    if isinstance(rot, tuple):
        cos, sin = rot
        x = x.float() if x.dtype != torch.float64 else x
        pairs = x.unflatten(-1, (-1, 2))
        re, im = pairs[..., 0], pairs[..., 1]
        return torch.stack([re * cos - im * sin, im * cos + re * sin], dim=-1).flatten(-2)
    x, rot = _real_and_table(x, rot)
    return torch.view_as_real(_complex(x) * rot).flatten(-2)


def real_table(rot):
    """The real pair (cos, sin) of a complex table of `rope_tables` (views, no copy), which `apply_rope` takes as
    it takes the export form; a pair or None is returned as it is. For code compiled by inductor, which has no
    complex kernels: the table is converted outside the compiled function, which then sees no complex tensor."""
    if rot is None or isinstance(rot, tuple):
        return rot
    return tuple(torch.view_as_real(rot).unbind(-1))


def halves_order(c, num_heads):
    """The channel order that lays each head's RoPE pairs out as halves: head by head, the first members of the
    head's pairs (channels 0, 2, .., d-2 of the head), then the second (1, 3, .., d-1); d = c / num_heads even.
    Index tensor (c,) into the interleaved channels."""
    d = c // num_heads
    return torch.arange(c).view(num_heads, d // 2, 2).transpose(1, 2).reshape(c)


def head_table(rot, num_heads):
    """The table (N, C/2) of `rope_tables` as each head's (cos, sin), a real view (H, N, d/2, 2) (no copy): pair j
    of head h is pair h d/2 + j of the table."""
    t = torch.view_as_real(rot)
    return t.reshape(t.shape[0], num_heads, -1, 2).transpose(0, 1)


def apply_rope_halves(x, table):
    """RoPE on per-head tokens x (B, H, N, d) whose channels are in `halves_order` ([a | b], the pairs' first and
    second members): [a cos - b sin | b cos + a sin], the rotation of `apply_rope` in that order. table: the
    `head_table` (H, N, d/2, 2). Returns fp32 (fp64 for fp64 input)."""
    x = x.float() if x.dtype != torch.float64 else x
    cos, sin = table.to(x.dtype).unbind(-1)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rope_heads(x, rot, num_heads):
    """`apply_rope` followed by the head split, written straight into a contiguous (B, H, N, d) tensor
    (the layout its matrix products take without copies); no autograd (an `out=` kernel). x: (B, N, C)."""
    x, rot = _real_and_table(x, rot)
    b, n, c = x.shape
    if (c // num_heads) % 2:   # channel pairs across heads: rotate, then split
        return torch.view_as_real(_complex(x) * rot).flatten(-2).unflatten(-1, (num_heads, -1)).transpose(1, 2) \
            .contiguous()
    out = x.new_empty(b, num_heads, n, c // num_heads)
    torch.mul(_complex(x.unflatten(-1, (num_heads, -1))), rot.view(n, num_heads, -1),
              out=_complex(out).transpose(1, 2))
    return out


def rope_heads_backward(g, rot, out):
    """The transpose of `rope_heads`, written into `out` (B, N, C) (e.g. a channel slice of a larger
    gradient): the rotation is orthogonal, so its transpose rotates back by the conjugate table.
    g: (B, H, N, d) gradient of the rotated heads. Half g (the closed-form backward under autocast) is rotated
    in fp32 and rounded once into `out`."""
    b, h, n, d = g.shape
    rot = (rot.to(torch.complex128) if g.dtype == torch.float64 else rot).conj()
    g = g.to(compute_dtype(g))
    if d % 2 or not _pairs_viewable(out) or out.dtype != g.dtype:   # pairs across heads, odd strides or a
        g = g.transpose(1, 2).reshape(b, n, h * d)                   # half out: rotate whole tokens, copy
        return out.copy_(torch.view_as_real(_complex(g) * rot).flatten(-2))
    torch.mul(_complex(g).transpose(1, 2), rot.view(n, h, -1), out=_complex(out.unflatten(-1, (h, d))))
    return out


def _real_and_table(x, rot):
    """fp32 (fp64 for fp64) tokens whose channel pairs can be viewed as complex numbers, and the table in
    the matching complex dtype."""
    if x.dtype != torch.float64:
        x = x.float()
    else:
        rot = rot.to(torch.complex128)
    return (x if _pairs_viewable(x) else x.contiguous()), rot


def _pairs_viewable(x):
    return x.stride(-1) == 1 and not x.storage_offset() % 2 and not any(s % 2 for s in x.stride()[:-1])


def _complex(x):
    """Channel pairs (..., 2j, 2j + 1) of x as complex numbers (..., j): a view."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))
