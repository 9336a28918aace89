"""2-D rotary position embedding (RoPE) of H-ViT3, applied to the full channel width before the head split.

For a map of H x W tokens with C channels, k_max = C/4 and theta_k = base^(-k/k_max), k = 0..k_max-1.
The token at integer grid position (y, x) gets the C/2 angles [y*theta_0 .. y*theta_{k_max-1},
x*theta_0 .. x*theta_{k_max-1}]; channel pairs (2j, 2j+1) are rotated as complex numbers by angle j
(interleaved convention), so channels [0, C/2) encode rows and [C/2, C) encode columns.

`rope_tables(h, w, c)` computes the (H*W, C/2) cos/sin tables once per stage and size;
`apply_rope(x, cos, sin)` rotates tokens (B, N, C) and returns fp32, as the authors' code does.
"""
import torch


def rope_tables(h, w, c, device=None, base=10000):
    """cos and sin tables of shape (h*w, c/2), fp32, never requiring grad."""
    if c % 4:
        raise ValueError(f'2-D RoPE needs a channel count divisible by 4, got {c}')
    k_max = c // 4
    # Built outside inference mode so the tables can also serve a later training forward.
    with torch.inference_mode(False), torch.no_grad():
        theta = 1 / (base ** (torch.arange(k_max, device=device) / k_max))
        ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                indexing='ij')
        angles = torch.cat([ys.unsqueeze(-1) * theta, xs.unsqueeze(-1) * theta], dim=-1)
        angles = angles.reshape(h * w, c // 2)
        return torch.cos(angles), torch.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate interleaved channel pairs of tokens x (B, N, C) by the tables (N, C/2); returns fp32."""
    x = x.float().unflatten(-1, (-1, 2))
    re, im = x[..., 0], x[..., 1]
    return torch.stack([re * cos - im * sin, im * cos + re * sin], dim=-1).flatten(-2)
