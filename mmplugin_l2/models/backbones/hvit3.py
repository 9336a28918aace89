"""H-ViT3 (hierarchical) and ViT3 (plain) backbones: ViT3, "Unlocking Test-Time Training in Vision"
(Han et al., CVPR 2026, arXiv 2512.01643), official code Liyining-ai/ViTTT.

H-ViT3: ConvStem (stride 4) -> 4 stages of H-ViT3 blocks, a ConvDownsample closing stages 1-3 ->
per-stage output norms -> NCHW maps at strides 4, 8, 16, 32.

  block:  x = x + CPE(x);  x = x + DropPath(TTT(LN(x), RoPE));  x = x + DropPath(ConvMlp(LN(x)))

Differences from the authors' dense-prediction code, all documented here:
* the TTT inner-loss scale is 1/3 on every call (theirs uses 1/sqrt(32) for the SwiGLU inner model on the
  first call of each module instance, 1/3 afterwards: parity holds from their second call on);
* RoPE tables are computed once per stage and input size, not stored as buffers (their unused
  `attn.rope.rotations` / classification `rope.rotations` buffers are dropped when loading);
* `frozen_stages`, `norm_eval` and `with_cp` follow OpenMMLab conventions.
Padding is theirs: the stem pads right/bottom to a multiple of 4, each downsample pads an odd side by one,
so stage i of an H x W input is ceil(H / 2^(i+2)) x ceil(W / 2^(i+2)).
"""
import torch.nn as nn
from mmcv.cnn.bricks import DropPath
from mmengine.model.weight_init import trunc_normal_
from mmengine.registry import MODELS

from ..layers import (CPE, ConvDownsample, ConvMlp, ConvStem, Mlp, TTTAttention, add_residual, map_to_tokens,
                      pad_to_multiple, rope_tables, tokens_to_map)
from ..ops.checkpoint import recomputed_output
from ..ops.export import stage_boundary
from ...deprecation import renamed_argument
from ..pyramid import PyramidBackbone, drop_path_rates


def _init_linear_and_ln(m):
    """The authors' init: Linear trunc_normal(0.02) with zero bias, LayerNorm 1/0; convs keep torch's."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


class TTTBlock(nn.Module):
    """ViT3 / H-ViT3 block on tokens (B, N, C) of an (H, W) map: CPE, TTT attention (with RoPE when the
    caller passes tables), MLP (ConvMlp in H-ViT3, plain Mlp in ViT3)."""

    def __init__(self, dim, num_heads, mlp_ratio=4., qkv_bias=True, drop=0., drop_path=0., norm_eps=1e-5,
                 conv_mlp=True, fast_train=True, fast_compile=True):
        super().__init__()
        self.fast_train = fast_train
        self.cpe = CPE(dim)
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = TTTAttention(dim, num_heads, qkv_bias=qkv_bias, fast_train=fast_train, fast_compile=fast_compile)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = (ConvMlp if conv_mlp else Mlp)(dim, int(dim * mlp_ratio), drop=drop, fast_train=fast_train)

    def forward(self, x, hw_shape, rope=None):
        return self.mlp_part(self.attention_part(x, hw_shape, rope), hw_shape)

    # add_residual: into the branch output at inference, out of place in training
    def attention_part(self, x, hw_shape, rope=None):
        """x + CPE(x), then its TTT attention branch added: (B, N, C) -> (B, N, C)."""
        # the LayerNorm's input, x + CPE(x), is recomputed where it keeps it (`recomputed_output`)
        with recomputed_output(self, self.residual_cpe, x, hw_shape) as x:
            return add_residual(self.drop_path(self.attn(self.norm1(x), hw_shape, rope)), x)

    def residual_cpe(self, x, hw_shape):
        """x + CPE(x): (B, N, C) -> (B, N, C)."""
        return add_residual(self.cpe(x, hw_shape), x)

    def mlp_part(self, x, hw_shape, rope=None):
        """x + its MLP branch: (B, N, C) -> (B, N, C) (`rope` unused: the parts take the same arguments)."""
        return add_residual(self.drop_path(self.mlp(self.norm2(x), hw_shape)), x)

    def recomputed_parts(self):
        """The parts `with_cp` recomputes one by one (`PyramidBackbone.run_block`): under `with_cp` the MLP's
        recomputation and backward run without the attention's recomputed tensors alive."""
        return self.attention_part, self.mlp_part


class HViT3Stage(nn.Module):
    """`depth` TTT blocks, then (stages 1-3) a ConvDownsample to the next width."""

    def __init__(self, dim, depth, num_heads, out_dim=None, drop_paths=(), **block_kw):
        super().__init__()
        self.blocks = nn.ModuleList(
            [TTTBlock(dim, num_heads, drop_path=drop_paths[j], **block_kw) for j in range(depth)])
        self.downsample = ConvDownsample(dim, out_dim) if out_dim is not None else None


@MODELS.register_module()
class HViT3(PyramidBackbone):
    """H-ViT3 backbone.

    Args:
        arch (str | dict): 'tiny', 'small', 'base' (aliases 't', 's', 'b') or a dict with
            `embed_dims`, `depths`, `num_heads` (4 entries each). Default: 'tiny'.
        in_channels (int): image channels. Default: 3.
        mlp_ratio (float): MLP expansion. Default: 4.
        qkv_bias (bool): Default: True.
        drop_rate (float): dropout after the stem and in the MLPs. Default: 0.
        drop_path_rate (float): stochastic depth, linearly increasing over all blocks. Default: 0.1.
        out_indices (Sequence[int]): stages to return. Default: (0, 1, 2, 3).
        frozen_stages (int): -1 none, 0 the stem, i the stem and stages 0..i-1. Default: -1.
        norm_eval (bool): keep BatchNorms (stem, downsamples) in eval mode during training. Default: False.
        with_cp (bool): activation checkpointing of every block (its attention part and its MLP part each on
            its own: `PyramidBackbone.run_block`), the stem and the downsamplings (only their inputs kept for
            backward, the rest recomputed there). Default: False.
        fast_train (bool): in training, keep only the inputs of the TTT inner models (`TTTCore`) and the
            MLP's input and fc1 output (`ConvMlpFunction`) for backward and recompute the rest there: same
            gradients, about half the memory of a step, at about the speed of `fast_train=False` on CPU.
            Default: True.
        fast_compile (bool | Sequence[str]): in training under bf16 autocast on CPU, the TTT layers' SwiGLU
            inner models run compiled by inductor (their forward and backward fused; recomputed in backward by the
            layer's own checkpoint, or by the block's with `with_cp`; the first training step compiles, later
            processes load the compiled code from torch's cache; where it cannot compile, one warning and the
            eager code). A list of device types runs it there instead of on
            the CPU only, e.g. ['cpu', 'cuda'] (not measured on a GPU yet). Default: True.
        out_norm_cfg (dict | None): norm of each returned stage (`norm{i}`); dict(type='LN') is mmdet's
            side-branch convention, dict(type='BN') on stage 3 reproduces the authors' classification
            BatchNorm1d over tokens. Default: dict(type='LN').
        memory_policy (dict | None): how large a map a layer builds at once: dict(max_elems, devices), see
            `ops/memory.py` (pieces of about `max_elems` elements at inference on the `devices` once a
            map has twice that; None: whole maps). Default: dict(max_elems=2**20, devices=('cpu',)).
        init_cfg (dict | None): dict(type='Pretrained', checkpoint=PATH) loads the authors'
            classification (or dense-prediction) checkpoints, see `convert_state_dict`.
        recompute (bool | None): the old name of `fast_train`, deprecated (a DeprecationWarning); removed
            in the next release. Default: None.
    """
    arch_zoo = {
        **dict.fromkeys(['t', 'tiny'], dict(embed_dims=[64, 128, 320, 512], depths=[1, 3, 9, 4],
                                            num_heads=[2, 4, 10, 16])),
        **dict.fromkeys(['s', 'small'], dict(embed_dims=[64, 128, 320, 512], depths=[2, 6, 18, 8],
                                             num_heads=[2, 4, 10, 16])),
        **dict.fromkeys(['b', 'base'], dict(embed_dims=[96, 192, 448, 640], depths=[2, 6, 18, 8],
                                            num_heads=[3, 6, 14, 20])),
    }

    def __init__(self, arch='tiny', in_channels=3, mlp_ratio=4., qkv_bias=True, drop_rate=0.,
                 drop_path_rate=0.1, out_indices=(0, 1, 2, 3), frozen_stages=-1, norm_eval=False,
                 with_cp=False, fast_train=True, out_norm_cfg=dict(type='LN'),
                 memory_policy=dict(max_elems=2 ** 20, devices=('cpu',)), init_cfg=None,
                 recompute=None, fast_compile=True):
        super().__init__(init_cfg=init_cfg)
        fast_train = renamed_argument(type(self).__name__, 'recompute', 'fast_train', recompute, fast_train)
        dims, depths, heads = self._init_arch(arch)
        self.patch_embed = ConvStem(in_channels, dims[0])
        self.pos_drop = nn.Dropout(drop_rate)
        self.layers = nn.ModuleList()
        for i, (dim, depth, nh, rates) in enumerate(zip(dims, depths, heads, drop_path_rates(drop_path_rate, depths))):
            self.layers.append(HViT3Stage(
                dim, depth, nh, out_dim=dims[i + 1] if i + 1 < len(dims) else None, drop_paths=rates,
                mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop=drop_rate, fast_train=fast_train,
                fast_compile=fast_compile))
        self._init_pyramid(in_channels, dims, out_indices, frozen_stages, norm_eval, with_cp, out_norm_cfg,
                           memory_policy, weight_init=_init_linear_and_ln)

    def forward(self, x):
        x = self.run_chain(self.patch_embed, x)
        outs = []
        for i, stage in enumerate(self.layers):
            x = self._forward_stage(i, stage, x, outs)
        return tuple(outs)

    def _forward_stage(self, i, stage, x, outs):
        """Stage i on the map x (B, C, H, W): its blocks on the tokens, `stage_output` appended to `outs` when i
        is an output index; returns the downsampled map (B, C', ceil(H / 2), ceil(W / 2)), or None after the
        last stage.

        A stage starts from a map, not from tokens and a separate (H, W): under torch.compile(dynamic=True) H
        and W are then the map's sizes and the token count is H * W. With (H, W) as separate integers inductor
        (torch 2.14) fails to order the strides of the token map's views ("cannot determine truth value of
        Relational"), docs/deployment.md."""
        stage_boundary()
        hw = tuple(x.shape[-2:])
        x = map_to_tokens(x)
        if i == 0:
            x = self.pos_drop(x)
        rope = rope_tables(*hw, x.shape[-1], device=x.device)
        for block in stage.blocks:
            x = self.run_block(block, x, hw, rope)
        if i in self.out_indices:
            outs.append(self.stage_output(i, x, hw))
        if stage.downsample is None:
            return None
        return self.run_chain(stage.downsample, tokens_to_map(x, hw))

    def keys_not_in_pretrained(self):
        return [k for k in self.state_dict() if k.split('.')[0] in {f'norm{i}' for i in self.out_indices}]

    def convert_state_dict(self, state_dict):
        """The authors' H-ViT3 checkpoints -> ours: keys are shared unchanged; RoPE buffers
        (`*.rope.rotations`) and the classifier `head.*` are dropped; the final BatchNorm1d `norm.*`
        becomes `norm3.*` when stage 3 is returned through a BatchNorm (classification), else dropped."""
        final_bn = 3 in self.out_indices and isinstance(getattr(self, 'norm3', None), nn.modules.batchnorm._BatchNorm)
        out = {}
        for k, v in state_dict.items():
            if k.endswith('rope.rotations') or k.startswith('head.'):
                continue
            if k.startswith('norm.'):
                if final_bn:
                    out['norm3.' + k[5:]] = v
                continue
            out[k] = v
        return out


@MODELS.register_module()
class ViT3(PyramidBackbone):
    """Plain (non-hierarchical) ViT3: 16x16 patch embedding -> 12 TTT blocks (CPE, TTT without RoPE, plain
    MLP, LayerNorm eps 1e-6) -> final LayerNorm `norm`. No class token and no position embedding.

    Returns the maps (B, C, ceil(H/p), ceil(W/p)) after the blocks in `out_indices` (the last one through
    the final norm); mean-pooling the last map gives the authors' classification feature. Unlike the
    authors' code, non-square and non-multiple-of-p inputs work (right/bottom zero padding).

    Args:
        arch (str | dict): 'tiny', 'small', 'base' or a dict with `embed_dims`, `num_layers`, `num_heads`.
        patch_size (int): Default: 16. out_indices (Sequence[int]): block indices. Default: (-1,).
        frozen_stages (int): -1 none, 0 the patch embedding, i also blocks 0..i-1.
        Other arguments as for `HViT3`.
    """
    arch_zoo = {
        **dict.fromkeys(['t', 'tiny'], dict(embed_dims=192, num_layers=12, num_heads=6)),
        **dict.fromkeys(['s', 'small'], dict(embed_dims=384, num_layers=12, num_heads=6)),
        **dict.fromkeys(['b', 'base'], dict(embed_dims=768, num_layers=12, num_heads=12)),
    }

    def __init__(self, arch='tiny', patch_size=16, in_channels=3, mlp_ratio=4., qkv_bias=True, drop_rate=0.,
                 drop_path_rate=0., out_indices=(-1,), frozen_stages=-1, norm_eval=False, with_cp=False,
                 fast_train=True, memory_policy=dict(max_elems=2 ** 20, devices=('cpu',)), init_cfg=None,
                 recompute=None, fast_compile=True):
        super().__init__(init_cfg=init_cfg)
        fast_train = renamed_argument(type(self).__name__, 'recompute', 'fast_train', recompute, fast_train)
        dim, depth, heads = self._init_arch(arch, ('embed_dims', 'num_layers', 'num_heads'), per_stage=False)
        self.patch_size = patch_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.pos_drop = nn.Dropout(drop_rate)
        dpr = drop_path_rates(drop_path_rate, [depth])[0]
        self.blocks = nn.ModuleList([
            TTTBlock(dim, heads, mlp_ratio, qkv_bias, drop_rate, dpr[j], norm_eps=1e-6, conv_mlp=False,
                     fast_train=fast_train, fast_compile=fast_compile)
            for j in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self._init_pyramid(in_channels, [dim] * depth, out_indices, frozen_stages, norm_eval, with_cp, None,
                           memory_policy, weight_init=_init_linear_and_ln)

    @property
    def layers(self):
        """The blocks, seen as stages by `frozen_stages`. A property, not a second registration of the
        ModuleList: an alias attribute would duplicate every block key as `layers.*` in `state_dict()`,
        and the authors' checkpoints (only `blocks.*`) would no longer fit."""
        return self.blocks

    def forward(self, x):
        x = self.patch_embed.proj(pad_to_multiple(x, self.patch_size))
        hw = tuple(x.shape[-2:])
        x = self.pos_drop(map_to_tokens(x))
        outs = []
        last = len(self.blocks) - 1
        for j, block in enumerate(self.blocks):
            x = self.run_block(block, x, hw)
            if j in self.out_indices:
                outs.append(tokens_to_map(self.norm(x) if j == last else x, hw))
        return tuple(outs)

    def convert_state_dict(self, state_dict):
        """The authors' ViT3 checkpoints share our keys; the classifier `head.*` is dropped."""
        return {k: v for k, v in state_dict.items() if not k.startswith('head.')}
