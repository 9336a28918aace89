"""Effective receptive field (ERF) of a backbone stage (tools/analysis/erf.py, docs/visualization.md).

For an input image x (1, 3, H, W) and the stage's output map y (1, C, h, w), the ERF of the centre token
(h // 2, w // 2) is

    G(p) = sum over the 3 input channels of | d (sum_c relu(y[c, h // 2, w // 2])) / d x[:, p] |      (H, W)

averaged over the images (the method of Luo et al. 2016 with RepLKNet's ReLU, as in the linear-attention
backbone papers' ERF figures). The ReLU matters: the sum over channels of a LayerNorm output with unit
weight and zero bias (the output norms at initialisation) is constant, its gradient zero. The centre token sits at the pixel (cy, cx) = ((h // 2 + 0.5) s - 0.5, (w // 2 + 0.5) s
- 0.5), s the stage stride. `mass_within(G, r)` is the share of sum(G) inside the square |py - cy| <= r,
|px - cx| <= r (pixels). For a model that is a single k x k convolution (stride 1, padding k // 2), G is
sum_in |sum over the active (y > 0) output channels of the kernel| on the k x k footprint around the centre and zero elsewhere (tests/test_vis.py).
"""
import math

import numpy as np
import torch

from .inputs import fix_batchnorm_grad_layout


def stage_output(backbone, x, index=-1):
    """The map a backbone returns at position `index` of its outputs (a tensor output is taken as is)."""
    out = backbone(x)
    if torch.is_tensor(out):
        return out
    return out[index]


def erf_gradient(model, x, index=-1):
    """G (H, W) float64 for one input (1, 3, H, W), and the output map size (h, w).

    The BatchNorms' backward is fixed for the run (`inputs.fix_batchnorm_grad_layout`: torch 2.14's CPU
    BatchNorm2d backward is wrong when the output gradient's memory format differs from the input's)."""
    x = x.detach().clone().requires_grad_(True)
    hooks = fix_batchnorm_grad_layout(model)
    try:
        y = stage_output(model, x, index)
        if y.ndim != 4:
            raise ValueError(f'the chosen output is {tuple(y.shape)}, not a (B, C, h, w) map')
        h, w = y.shape[-2:]
        (g,) = torch.autograd.grad(y[0, :, h // 2, w // 2].relu().sum(), x)
    finally:
        for hk in hooks:
            hk.remove()
    return g[0].abs().sum(0).double(), (h, w)


def centre_pixel(image_hw, map_hw):
    """(cy, cx) in input pixels of the centre token of a (h, w) map (stride = nearest power of two)."""
    out = []
    for n, m in zip(image_hw, map_hw):
        s = 2 ** round(math.log2(n / m))
        out.append((m // 2 + 0.5) * s - 0.5)
    return tuple(out)


def mass_within(g, centre, radii):
    """{r: share of sum(g) within the square of half-side r (pixels) around `centre`}."""
    g = np.asarray(g, dtype=np.float64)
    yy, xx = np.mgrid[:g.shape[0], :g.shape[1]]
    dist = np.maximum(np.abs(yy - centre[0]), np.abs(xx - centre[1]))
    total = g.sum()
    return {int(r): float(g[dist <= r].sum() / total) if total > 0 else float('nan') for r in radii}


def average_erf(model, inputs, index=-1, progress=None):
    """Mean G over `inputs` (an iterable of (1, 3, H, W) tensors); returns (G (H, W) numpy, map (h, w)).
    `progress(k, n)` is called after each image."""
    inputs = list(inputs)
    acc, hw = None, None
    for k, x in enumerate(inputs):
        g, hw = erf_gradient(model, x, index)
        acc = g if acc is None else acc + g
        if progress is not None:
            progress(k + 1, len(inputs))
    return (acc / len(inputs)).cpu().numpy(), hw


def display_scale(g):
    """The heat map drawn: log10(1 + 1000 G / max G) / 3, in [0, 1] (small contributions stay visible)."""
    g = np.asarray(g, dtype=np.float64)
    m = g.max()
    return np.log10(1 + 1000 * g / m) / 3 if m > 0 else g


def draw_erfs(results, out_path, title=None):
    """results: list of dict(name, erf (H, W), mass {r: share}); one heat map per model, side by side."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 3.6), squeeze=False)
    for ax, res in zip(axes[0], results):
        ax.imshow(display_scale(res['erf']), cmap='viridis', vmin=0, vmax=1)
        shares = ', '.join(f'{r}:{v:.2f}' for r, v in list(res['mass'].items())[:4])
        ax.set_title(f'{res["name"]}\nmass within r px  {shares}', fontsize=7)
        ax.axis('off')
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path
