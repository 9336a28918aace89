"""ResT backbones: "ResT: An Efficient Transformer for Visual Recognition" (Zhang & Yang, NeurIPS 2021,
arXiv 2105.13677), official code wofmanaf/ResT (v1: models/rest.py, object_detection/restv2/rest.py).

ResTStem (stride 4, PA gate) -> stage 1 blocks -> [ResTPatchEmbed (stride 2, BN, PA) -> blocks] x 3 ->
per-stage output norms -> NCHW maps at strides 4, 8, 16, 32.

  block:  x = x + DropPath(EMSA(LN(x)));  x = x + DropPath(Mlp(LN(x)))       (LayerNorm eps 1e-5)
  EMSA:   K/V from a strided depth-wise-conv reduction + LN; 1x1 conv mixing the heads before the softmax and
          instance norm after it, both skipped in single-head stages (stage 1 of every variant).

Differences from the authors' code, each one documented here:
* Any input size. Each stage's (H, W) is read from the output of its convolution. The authors use
  floor(H / 2) after each stride-2 patch embedding, so their model crashes unless H and W mod 32 are in
  {0, 29, 30, 31}. On multiples of 32 the two agree exactly. Stage i of an H x W input is
  ceil(H / 2^(i+2)) x ceil(W / 2^(i+2)).
* Output norms. By default they sit on a side branch, mmdet's convention and the paper's description: stage i
  returns norm{i}(x_i) and the next stage sees the un-normalised x_i. The authors' detectron2 backbone puts
  them in the main path, so the normalised map also feeds the next stage, and a stage's features then depend
  on which earlier stages are returned (Mask R-CNN and RetinaNet differ). `norm_in_path=True` reproduces it.
  Either way the stage-4 norm `norm3` takes the pretrained final `norm`.
* Training memory (`fast_train`). Large attention maps are processed in pieces of queries on the memory
  policy's devices, recomputed in backward, with exact full-map instance-norm statistics (`ops/emsa`);
  the MLP branch keeps its input and fc1 output and recomputes LayerNorm and GELU (`mlp.NormMlpFunction`).
* `frozen_stages`, `norm_eval`, `with_cp` follow OpenMMLab conventions. The authors' FREEZE_AT >= 1 raises.
"""
import re

import torch.nn as nn
from mmcv.cnn.bricks import DropPath
from mmengine.model.weight_init import trunc_normal_
from mmengine.registry import MODELS

from ..layers import EMSA, Mlp, ResTPatchEmbed, ResTStem, add_residual, map_to_tokens, tokens_to_map
from ..ops.export import stage_boundary
from ..layers.mlp import norm_mlp_branch
from ...deprecation import renamed_argument
from ..pyramid import PyramidBackbone, drop_path_rates


def _init_rest_weights(m):
    """The authors' init: every Conv2d and Linear weight trunc_normal(0.02) (cut at +-2), Linear biases 0,
    conv biases left at PyTorch's default, LayerNorm / BatchNorm weight 1 and bias 0."""
    if isinstance(m, (nn.Conv2d, nn.Linear)):
        trunc_normal_(m.weight, std=.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


class ResTBlock(nn.Module):
    """Pre-norm ResT block on tokens (B, N, C) of an (H, W) map: EMSA and MLP (hidden 4C, exact GELU)."""

    def __init__(self, dim, num_heads, sr_ratio, mlp_ratio=4., qkv_bias=True, drop=0., attn_drop=0.,
                 drop_path=0., fast_train=True):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = EMSA(dim, num_heads, sr_ratio, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=drop,
                         fast_train=fast_train)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)
        self.fast_train = fast_train

    def forward(self, x, hw_shape):
        # add_residual: into the branch output at inference, out of place in training
        x = add_residual(self.drop_path(self.attn(self.norm1(x), hw_shape)), x)
        # with `fast_train`, the MLP branch keeps x and the fc1 output and recomputes LN and GELU in
        # backward (`mlp.NormMlpFunction`, in cache-sized pieces on CPU); at inference LN runs in the pieces
        mlp = norm_mlp_branch(self, self.norm2, self.mlp, x, checkpoint=False)
        return add_residual(self.drop_path(mlp), x)


class ResTStage(nn.Module):
    """A stage: the patch embedding that opens it (stages 2-4; None for stage 1, served by the stem),
    then `depth` blocks."""

    def __init__(self, in_dim, dim, depth, num_heads, sr_ratio, drop_paths=(), **block_kw):
        super().__init__()
        self.patch_embed = ResTPatchEmbed(in_dim, dim) if in_dim is not None else None
        self.blocks = nn.ModuleList([ResTBlock(dim, num_heads, sr_ratio, drop_path=drop_paths[j], **block_kw)
                                     for j in range(depth)])


@MODELS.register_module()
class ResT(PyramidBackbone):
    """ResT backbone (v1).

    Args:
        arch (str | dict): 'lite', 'small', 'base', 'large' (aliases 's', 'b', 'l') or a dict with
            `embed_dims`, `depths`, `num_heads` and optionally `sr_ratios` (4 entries each; default
            sr_ratios [8, 4, 2, 1]). Default: 'small'.
        in_channels (int): image channels. Default: 3.
        mlp_ratio (float): MLP expansion. Default: 4.
        qkv_bias (bool): biases of q and kv (True in all the authors' variants). Default: True.
        drop_rate (float): dropout after `proj` and in the MLP. Default: 0.
        attn_drop_rate (float): dropout on the attention maps. Default: 0.
        drop_path_rate (float): stochastic depth, linear from 0 (first block) to this (last block).
            The authors' detection values are 0.1 (lite, small) and 0.2 (base, large). Default: 0.1.
        out_indices (Sequence[int]): stages to return. Default: (0, 1, 2, 3).
        frozen_stages (int): -1 none, 0 the stem, i the stem and stages 0..i-1 (each with its patch
            embedding and output norm). Default: -1.
        norm_eval (bool): keep the BatchNorms of the stem and patch embeddings in eval mode. Default: False.
        with_cp (bool): activation checkpointing of every block, the stem and the patch embeddings (only
            their inputs kept for backward, the rest recomputed there). Default: False.
        out_norm_cfg (dict | None): norm `norm{i}` of each returned stage. `norm3` receives the pretrained
            final `norm`. Default: dict(type='LN') (eps 1e-5, as the authors).
        norm_in_path (bool): False (default), the output norms form a side branch (mmdet, the paper);
            True, the normalised map of a returned stage also feeds the next stage, as in the authors'
            detectron2 backbone. Use True to reproduce their detectors exactly, e.g. with their d2 weights.
        fast_train (bool): in training, attention maps of more than twice the memory policy's `max_elems`
            entries are computed in pieces of queries of that size, recomputed in backward (same values, far
            less memory), and the MLP branches recompute LayerNorm and GELU in backward. False: dense maps,
            plain autograd. Default: True.
        memory_policy (dict | None): how large a map a layer builds at once: dict(max_elems, devices), see
            `ops/memory.py` (pieces of about `max_elems` elements at inference on the `devices` once a
            map has twice that; None: whole maps). Default: dict(max_elems=2**20, devices=('cpu',)).
        init_cfg (dict | None): dict(type='Pretrained', checkpoint=PATH) loads the authors' classification
            checkpoints ({'model': ...}), their detectron2 checkpoints, or files converted by
            tools/convert_checkpoint.py; see `convert_state_dict`.
        recompute (bool | None): the old name of `fast_train`, deprecated (a DeprecationWarning); removed
            in the next release. Default: None.
    """
    arch_zoo = {
        'lite': dict(embed_dims=[64, 128, 256, 512], depths=[2, 2, 2, 2], num_heads=[1, 2, 4, 8]),
        **dict.fromkeys(['s', 'small'], dict(embed_dims=[64, 128, 256, 512], depths=[2, 2, 6, 2],
                                             num_heads=[1, 2, 4, 8])),
        **dict.fromkeys(['b', 'base'], dict(embed_dims=[96, 192, 384, 768], depths=[2, 2, 6, 2],
                                            num_heads=[1, 2, 4, 8])),
        **dict.fromkeys(['l', 'large'], dict(embed_dims=[96, 192, 384, 768], depths=[2, 2, 18, 2],
                                             num_heads=[1, 2, 4, 8])),
    }
    default_sr_ratios = [8, 4, 2, 1]
    #: the LayerNorm-ed maps are the tokens' (B, C, H, W) view, as in the authors' code: the same memory
    #: layout feeds the next stage (in-path norms) or the classifier's pooling (bit-identical to theirs)
    contiguous_outputs = False

    def __init__(self, arch='small', in_channels=3, mlp_ratio=4., qkv_bias=True, drop_rate=0., attn_drop_rate=0.,
                 drop_path_rate=0.1, out_indices=(0, 1, 2, 3), frozen_stages=-1, norm_eval=False, with_cp=False,
                 out_norm_cfg=dict(type='LN'), norm_in_path=False, fast_train=True,
                 memory_policy=dict(max_elems=2 ** 20, devices=('cpu',)), init_cfg=None,
                 recompute=None):
        super().__init__(init_cfg=init_cfg)
        fast_train = renamed_argument(type(self).__name__, 'recompute', 'fast_train', recompute, fast_train)
        dims, depths, heads, srs = self._init_arch(arch, ('embed_dims', 'depths', 'num_heads', 'sr_ratios'),
                                                   defaults=dict(sr_ratios=self.default_sr_ratios))
        self.norm_in_path = norm_in_path
        self.patch_embed = ResTStem(in_channels, dims[0])
        self.layers = nn.ModuleList()
        for i, (dim, depth, nh, sr, rates) in enumerate(
                zip(dims, depths, heads, srs, drop_path_rates(drop_path_rate, depths))):
            self.layers.append(ResTStage(
                dims[i - 1] if i > 0 else None, dim, depth, nh, sr, drop_paths=rates, mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias, drop=drop_rate, attn_drop=attn_drop_rate, fast_train=fast_train))
        self._init_pyramid(in_channels, dims, out_indices, frozen_stages, norm_eval, with_cp, out_norm_cfg,
                           memory_policy, weight_init=_init_rest_weights)

    def forward(self, x):
        x = self.run_chain(self.patch_embed, x)
        outs = []
        for i, stage in enumerate(self.layers):
            if stage.patch_embed is not None:
                x = self._patch_embed(stage, x)
            x = self._forward_stage(i, stage, x, outs)
        return tuple(outs)

    def _patch_embed(self, stage, x):
        """A stage's patch embedding (stages 1-3) on the map x."""
        stage_boundary()
        return self.run_chain(stage.patch_embed, x)

    def _forward_stage(self, i, stage, x, outs):
        """Stage i's blocks on the map x (B, C, H, W), `stage_output` appended to `outs` when i is an output
        index; returns the stage's output map."""
        stage_boundary()
        hw = tuple(x.shape[-2:])  # from the conv output: any input size works
        t = map_to_tokens(x)
        for block in stage.blocks:
            t = self.run_block(block, t, hw)
        x = tokens_to_map(t, hw)
        if i in self.out_indices:
            y = self.stage_output(i, t, hw)
            outs.append(y)
            if self.norm_in_path:
                x = y
        return x

    # ---- weights ---------------------------------------------------------------------------
    def _last_norm(self):
        """Name of the output norm that takes the authors' final `norm`, or None when it has no weights."""
        last = self.num_stages - 1
        norm = getattr(self, f'norm{last}', None)
        if last in self.out_indices and norm is not None and any(True for _ in norm.parameters()):
            return f'norm{last}'
        return None

    def keys_not_in_pretrained(self):
        """The output norms of stages 1-3: new in a classification checkpoint (1/0 init)."""
        names = {f'norm{i}' for i in self.out_indices if i != self.num_stages - 1}
        return [k for k in self.state_dict() if k.split('.')[0] in names]

    def convert_state_dict(self, state_dict):
        """The authors' ResT v1 layouts -> ours.

        * Classification checkpoint ({'model': ...}, also `model_ema`): `stem.conv{1,2}.weight` /
          `stem.norm{1,2}.*` -> `patch_embed.conv{1,2}.{conv,norm}.*`, `stem.{conv3,pos}.*` ->
          `patch_embed.*`, `patch_embed_{k}.*` -> `layers.{k-1}.patch_embed.*`, `stage{s}.{j}.*` ->
          `layers.{s-1}.blocks.{j}.*`, the final `norm.*` -> `norm3.*`, and `head.*` is dropped.
        * detectron2 checkpoint (a trained detector, or `convert_to_d2.py` output): keys under
          `backbone.bottom_up.` only, mapped as above, and their output norms `norm{1,2,3}` (1-based) ->
          `norm{0,1,2}`. Detectors trained by their code have in-path norms: see `norm_in_path`.
        * A file of ours (e.g. tools/convert_checkpoint.py output) is taken as it is.
        Output norms of stages this model does not return are dropped. Any other key is kept, so that
        `check_state_dict_fits` reports it as unexpected.
        """
        for d2_prefix in ('backbone.bottom_up.', 'bottom_up.'):  # (`backbone.` may be stripped on reading)
            if any(k.startswith(d2_prefix) for k in state_dict):
                state_dict = {k[len(d2_prefix):]: v for k, v in state_dict.items() if k.startswith(d2_prefix)}
                break
        authors = any(k.startswith(('stem.', 'stage1.')) for k in state_dict)
        last_norm = self._last_norm()
        out = {}
        for k, v in state_dict.items():
            if not authors:
                m = re.fullmatch(r'norm(\d+)\.(.+)', k)
                if m and not hasattr(self, f'norm{m.group(1)}'):
                    continue
                out[k] = v
                continue
            if k.startswith('head.'):
                continue
            m = re.fullmatch(r'stem\.(conv|norm)([12])\.(.+)', k)
            if m:
                out[f'patch_embed.conv{m.group(2)}.{"conv" if m.group(1) == "conv" else "norm"}.{m.group(3)}'] = v
                continue
            if k.startswith('stem.'):
                out['patch_embed.' + k[len('stem.'):]] = v
                continue
            m = re.fullmatch(r'patch_embed_(\d+)\.(.+)', k)
            if m:
                out[f'layers.{int(m.group(1)) - 1}.patch_embed.{m.group(2)}'] = v
                continue
            m = re.fullmatch(r'stage(\d+)\.(\d+)\.(.+)', k)
            if m:
                out[f'layers.{int(m.group(1)) - 1}.blocks.{m.group(2)}.{m.group(3)}'] = v
                continue
            if k.startswith('norm.'):
                if last_norm is not None:
                    out[f'{last_norm}.{k[len("norm."):]}'] = v
                continue
            m = re.fullmatch(r'norm(\d+)\.(.+)', k)  # detectron2 output norms, 1-based
            if m:
                i = int(m.group(1)) - 1
                if hasattr(self, f'norm{i}'):
                    out[f'norm{i}.{m.group(2)}'] = v
                continue
            out[k] = v
        return out
