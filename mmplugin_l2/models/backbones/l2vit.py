"""L2ViT backbone: "The Linear Attention Resurrection in Vision Transformer", official code
ChuanyangZheng/L2ViT (classification/models/l2vit.py, object_detection/mmdet/models/backbones/l2vit.py).

ConvStem2L (stride 4) + LayerNorm -> 4 stages; stage i > 0 opens with a downsampling (LayerNorm -> 2x2 s2
conv); inside a stage the blocks alternate, starting with a local one:

  LWA (even j):  s = x + CPE(x);  x = s + DropPath(WindowAttention(LN(s)))
                 x = x + CPE'(x); x = x + DropPath(Mlp(LN(x)))
  LGA (odd j):   x = x + CPE(x);  x = x + DropPath(LinearAttention(LN(x)))
                 x = x + DropPath(LCM(LN(x)));  x = x + DropPath(Mlp(LN(x)))

-> per-stage output LayerNorms `norm{i}` on the side branch -> NCHW maps at strides 4, 8, 16, 32.

The state dict has the authors' keys (`downsample_layers.{i}`, `stages.{i}.{j}`), so their classification
release files load without renaming; `convert_state_dict` drops their `head` and maps / drops their
final `norm`. Numerics are the authors' (their weights give their stage outputs to float rounding, ~1e-6;
convolutions run channels-last and the window attention through F.scaled_dot_product_attention, which
sum in another order than their NCHW convs and explicit softmax), with these documented differences:

* `window_size` is honoured (default 7; 12 for arch 'base-384'). The authors' dense-prediction backbone
  ignores the argument and always uses 7.
* Window padding is theirs by default (zero-pad after the LayerNorm, no mask); `mask_window_padding=True`
  masks the padded keys instead (not the authors' numbers at sizes that are not multiples of 7 * stride).
* The linear attention's K^T V / denominator run in float32 under autocast (finite fp16 / bf16 at
  detection sizes); identical in fp32.
* `frozen_stages`, `norm_eval` and `with_cp` are ours (theirs has none). With `with_cp`, the BatchNorms (the
  stem's, the LCMs') update their running statistics once per step (not again in the recomputation).
* Initialisation is the authors' classification one (trunc_normal(0.02) on every Linear and Conv2d, zero
  biases, LN/BN 1/0); their dense-prediction code uses kaiming for convs, which a pretrained checkpoint
  overwrites anyway.

Padding as theirs: the stem pads right/bottom to a multiple of 4 and each downsampling pads an odd side by
one, so stage i of an H x W input is ceil(H / 2^(i+2)) x ceil(W / 2^(i+2)).
"""
import torch
import torch.nn as nn
from mmcv.cnn.bricks import DropPath
from mmengine.model.weight_init import trunc_normal_
from mmengine.registry import MODELS

from ..layers import (LCM, L2ViTDownsample, L2ViTStem, LinearAttention, Mlp, ResidualCPE, WindowAttention,
                      add_residual)
from ..ops.export import stage_boundary
from ..layers.mlp import norm_mlp_branch
from ..ops.checkpoint import recomputed_branch as _branch
from ..ops.checkpoint import recomputed_output
from ...deprecation import renamed_argument
from ..pyramid import PyramidBackbone


def _init_authors(m):
    """The authors' classification init: trunc_normal(0.02) on Linear and Conv2d weights, zero biases."""
    if isinstance(m, (nn.Linear, nn.Conv2d)):
        trunc_normal_(m.weight, std=.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)


class LWABlock(nn.Module):
    """Local Window Attention block: two CPEs (before attention and before the MLP)."""

    def __init__(self, dim, num_heads, window_size=7, mlp_ratio=4., qkv_bias=True, drop_path=0.,
                 mask_window_padding=False, fast_train=True):
        super().__init__()
        self.fast_train = fast_train
        self.cpe = nn.ModuleList([ResidualCPE(dim), ResidualCPE(dim)])
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, num_heads, window_size, qkv_bias=qkv_bias,
                                    mask_padding=mask_window_padding)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x, hw_shape):
        # add_residual: into the branch output at inference, out of place in training; a CPE's output is
        # recomputed where the branch after it would keep it (`recomputed_output`)
        with recomputed_output(self, self.cpe[0], x, hw_shape) as x:
            x = add_residual(self.drop_path(_branch(self, self.norm1, self.attn, x, hw_shape, keep_products=True)), x)
        with recomputed_output(self, self.cpe[1], x, hw_shape) as x:
            return add_residual(self.drop_path(norm_mlp_branch(self, self.norm2, self.mlp, x)), x)


class LGABlock(nn.Module):
    """Linear Global Attention block: CPE, linear attention, LCM (its own residual branch), MLP."""

    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=True, drop_path=0., lcm_kernel=7, fast_train=True):
        super().__init__()
        self.fast_train = fast_train
        self.cpe = nn.ModuleList([ResidualCPE(dim)])
        self.norm1 = nn.LayerNorm(dim)
        self.attn = LinearAttention(dim, num_heads, qkv_bias=qkv_bias)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.norm3 = nn.LayerNorm(dim)
        self.local_mp = LCM(dim, lcm_kernel)

    def forward(self, x, hw_shape):
        # the linear attention keeps its q, k, v for backward (LinearAttentionCore), not recomputed; its
        # LayerNorm's input, the CPE's output, is (`recomputed_output`)
        with recomputed_output(self, self.cpe[0], x, hw_shape) as x:
            x = add_residual(self.drop_path(self.attn(x, norm=self.norm1)), x)
        x = add_residual(self.drop_path(_branch(self, self.norm3, self.local_mp, x, hw_shape)), x)
        return add_residual(self.drop_path(norm_mlp_branch(self, self.norm2, self.mlp, x)), x)


@MODELS.register_module()
class L2ViT(PyramidBackbone):
    """L2ViT backbone.

    Args:
        arch (str | dict): 'tiny', 'small', 'base', 'base-384' (aliases 't', 's', 'b', 'b-384') or a dict
            with `embed_dims`, `depths` (blocks per stage, LWA and LGA alternating, LWA first), `num_heads`
            (4 entries each) and optionally `window_size`. Default: 'tiny'.
        in_channels (int): image channels. Default: 3.
        window_size (int | None): LWA window; None takes the arch's (7; 12 for 'base-384'). Default: None.
        mask_window_padding (bool): mask the window padding out of the LWA softmax. Off by default: the
            authors zero-pad after the LayerNorm without a mask (padded tokens carry the qkv bias into the
            border windows); their weights reproduce their numbers only that way. Default: False.
        mlp_ratio (float): Default: 4. qkv_bias (bool): Default: True.
        drop_path_rate (float): stochastic depth, linear over all blocks (each LWA and LGA block its own
            rate, as the authors). Default: 0.1.
        out_indices (Sequence[int]): stages to return. Default: (0, 1, 2, 3).
        final_norm (bool): the output LayerNorm of the last stage is the authors' final classification
            norm: their `norm.*` loads into `norm{last}` (LN per token then global average pooling equals
            their classifier's LN -> mean). False (dense prediction, as the authors): fresh output norms,
            their `norm.*` is dropped. Default: False.
        frozen_stages (int): -1 none, 0 the stem, i the stem and stages 0..i-1 (each with its opening
            downsampling and its output norm). Default: -1.
        norm_eval (bool): keep the BatchNorms (stem, LCMs) in eval mode while training. Default: False
            (the authors fine-tune them in train mode).
        with_cp (bool): activation checkpointing of every block, the stem and the downsamplings (only their
            inputs kept for backward, the rest recomputed there). Default: False.
        fast_train (bool): in training, recompute in backward what is cheap to recompute and keep what is
            not: the window-attention branches keep their qkv product's and attention kernel's outputs (not
            the output projection's, which no backward reads) and recompute the LayerNorm and window
            partitions (`checkpoint.checkpointed(keep_products=True)`),
            the LCM branches are recomputed whole (depth-wise convs, GELU, BatchNorm), the MLP branches
            keep their fc1 output and recompute LayerNorm and GELU (`mlp.NormMlpFunction`); the linear
            attention keeps only q, k, v in any case (`LinearAttentionCore`). Same gradients; about half
            the memory of a step without it for about the same time. False: plain autograd. Default: True.
        memory_policy (dict | None): how large a map a layer builds at once: dict(max_elems, devices), see
            `ops/memory.py` (pieces of about `max_elems` elements at inference on the `devices` once a
            map has twice that; None: whole maps). Default: dict(max_elems=2**20, devices=('cpu',)).
        init_cfg (dict | None): dict(type='Pretrained', checkpoint=PATH) loads the authors' release files
            (`L2ViT-{Tiny,Small,Base}-checkpoint-best-ema.pth`, weights under `model`) or converted ones.
        recompute (bool | None): the old name of `fast_train`, deprecated (a DeprecationWarning); removed
            in the next release. Default: None.
    """
    arch_zoo = {
        **dict.fromkeys(['t', 'tiny'], dict(embed_dims=[96, 192, 384, 768], depths=[2, 2, 6, 2],
                                            num_heads=[3, 6, 12, 24], window_size=7)),
        **dict.fromkeys(['s', 'small'], dict(embed_dims=[96, 192, 384, 768], depths=[2, 2, 18, 2],
                                             num_heads=[3, 6, 12, 24], window_size=7)),
        **dict.fromkeys(['b', 'base'], dict(embed_dims=[128, 256, 512, 1024], depths=[2, 2, 18, 2],
                                            num_heads=[4, 8, 16, 32], window_size=7)),
        **dict.fromkeys(['b-384', 'base-384'], dict(embed_dims=[128, 256, 512, 1024], depths=[2, 2, 18, 2],
                                                    num_heads=[4, 8, 16, 32], window_size=12)),
    }

    def __init__(self, arch='tiny', in_channels=3, window_size=None, mask_window_padding=False,
                 mlp_ratio=4., qkv_bias=True, drop_path_rate=0.1, out_indices=(0, 1, 2, 3), final_norm=False,
                 frozen_stages=-1, norm_eval=False, with_cp=False, fast_train=True,
                 memory_policy=dict(max_elems=2 ** 20, devices=('cpu',)), init_cfg=None,
                 recompute=None):
        super().__init__(init_cfg=init_cfg)
        fast_train = renamed_argument(type(self).__name__, 'recompute', 'fast_train', recompute, fast_train)
        dims, depths, heads = self._init_arch(arch)
        self.window_size = window_size if window_size is not None else self.arch_settings.get('window_size', 7)
        self.mask_window_padding = mask_window_padding
        self.final_norm = final_norm
        dpr = [r.item() for r in torch.linspace(0, drop_path_rate, sum(depths), device='cpu')]

        self.downsample_layers = nn.ModuleList([L2ViTStem(in_channels, dims[0])])
        self.downsample_layers.extend(L2ViTDownsample(dims[i - 1], dims[i]) for i in range(1, len(dims)))
        self.stages = nn.ModuleList()
        for i, (dim, depth, nh) in enumerate(zip(dims, depths, heads)):
            rates = dpr[sum(depths[:i]):sum(depths[:i + 1])]
            self.stages.append(nn.ModuleList([
                LWABlock(dim, nh, self.window_size, mlp_ratio, qkv_bias, rates[j], mask_window_padding, fast_train)
                if j % 2 == 0 else LGABlock(dim, nh, mlp_ratio, qkv_bias, rates[j], fast_train=fast_train)
                for j in range(depth)]))
        self._init_pyramid(in_channels, dims, out_indices, frozen_stages, norm_eval, with_cp,
                           dict(type='LN'), memory_policy, weight_init=_init_authors)
        if final_norm and len(dims) - 1 not in self.out_indices:
            raise ValueError(f'L2ViT: final_norm=True needs the last stage ({len(dims) - 1}) in out_indices, '
                             f'got {self.out_indices}')

    # The stem and stage i (with its opening downsampling), as PyramidBackbone sees them for freezing.
    # Properties, not second registrations: aliases would duplicate the keys in `state_dict()`.
    @property
    def patch_embed(self):
        return self.downsample_layers[0]

    @property
    def layers(self):
        return [nn.ModuleList([self.stages[0]])] + [
            nn.ModuleList([self.downsample_layers[i], self.stages[i]]) for i in range(1, self.num_stages)]

    def forward(self, x):
        outs, hw = [], None
        for i in range(self.num_stages):
            x, hw = self._downsample(i, x, hw)
            x = self._forward_blocks(i, x, hw, outs)
        return tuple(outs)

    def _downsample(self, i, x, hw):
        """Stage i's downsampling: the stem on the image x for i = 0, else the layer on the tokens x of the map
        hw. Returns the tokens and their (H, W)."""
        stage_boundary()
        return self.run_chain(self.downsample_layers[i], x, *(() if i == 0 else (hw,)))

    def _forward_blocks(self, i, x, hw, outs):
        """Stage i's blocks on the tokens x of the map hw, `stage_output` appended to `outs` when i is an output
        index; returns the tokens."""
        stage_boundary()
        for block in self.stages[i]:
            x = self.run_block(block, x, hw)
        if i in self.out_indices:
            outs.append(self.stage_output(i, x, hw))
        return x

    # ---- checkpoints --------------------------------------------------------------------------
    def _final_norm_name(self):
        return f'norm{self.num_stages - 1}' if self.final_norm else None

    def keys_not_in_pretrained(self):
        """The output norms start fresh from a classification checkpoint (but `final_norm`'s)."""
        fresh = {f'norm{i}' for i in self.out_indices} - {self._final_norm_name()}
        return [k for k in self.state_dict() if k.split('.')[0] in fresh]

    def convert_state_dict(self, state_dict):
        """The authors' checkpoints -> ours. Keys are shared unchanged; their classifier `head.*` is
        dropped; their final LayerNorm `norm.*` goes to `norm{last}` with `final_norm`, else it is dropped
        (their dense-prediction models start with fresh output norms). Anything else that does not fit
        is reported by the loader."""
        final = self._final_norm_name()
        out = {}
        for k, v in state_dict.items():
            if k.startswith('head.'):
                continue
            if k.startswith('norm.'):
                if final is not None:
                    out[f'{final}.{k[5:]}'] = v
                continue
            out[k] = v
        return out
