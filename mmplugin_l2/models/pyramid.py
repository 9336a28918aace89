"""What every hierarchical backbone of this plugin shares.

A `PyramidBackbone` has a stem `patch_embed` and a ModuleList `layers` of stages (each may end in its own
`downsample`). This base class owns the mechanics around them:

* `out_indices` and one output norm `norm{i}` per returned stage (LayerNorm by default, mmdet's side-branch
  convention; any mmcv norm config, e.g. BN for classification heads);
* `frozen_stages` (-1: none, 0: the stem, i: the stem and stages 0..i-1 with their output norms) and
  `norm_eval` (BatchNorms stay in eval mode while training), honoured by `train()`;
* `with_cp`: activation checkpointing of each block (`run_block`);
* `init_cfg=dict(type='Pretrained', checkpoint=...)`: the authors' checkpoints are converted by the
  subclass's `convert_state_dict` and loaded strictly, with a clear error on keys that do not fit.
"""
import torch.nn as nn
from mmcv.cnn import build_norm_layer
from mmengine.logging import MMLogger, print_log
from mmengine.model import BaseModule
from torch.nn.modules.batchnorm import _BatchNorm

from ..checkpoint import load_pretrained
from .layers.recompute import checkpointed


def resolve_arch(arch, arch_zoo, required_keys, name):
    """An `arch` is a key of `arch_zoo` (or an alias) or a dict with `required_keys`."""
    if isinstance(arch, str):
        key = arch.lower()
        if key not in arch_zoo:
            raise ValueError(f'{name}: unknown arch {arch!r}; choose one of {sorted(arch_zoo)} '
                             f'or pass a dict with keys {sorted(required_keys)}')
        return dict(arch_zoo[key])
    if not isinstance(arch, dict):
        raise TypeError(f'{name}: arch must be a str or a dict, got {type(arch).__name__}')
    missing = set(required_keys) - set(arch)
    if missing:
        raise ValueError(f'{name}: a custom arch dict needs the keys {sorted(required_keys)}; '
                         f'missing {sorted(missing)}')
    return dict(arch)


class PyramidBackbone(BaseModule):
    """Base of the 4-stage backbones. Subclasses build `patch_embed` and `layers` then call
    `_init_pyramid`; their `forward` uses `run_block` and `stage_output`."""

    #: the name used in error messages and checkpoint conversion
    arch_name = 'backbone'

    def _init_pyramid(self, in_channels, stage_channels, out_indices, frozen_stages, norm_eval, with_cp,
                      out_norm_cfg):
        self.in_channels = in_channels
        self.num_stages = len(stage_channels)
        self.stage_channels = list(stage_channels)
        if isinstance(out_indices, int):
            out_indices = [out_indices]
        out_indices = [i + self.num_stages if i < 0 else i for i in out_indices]
        for i in out_indices:
            if not 0 <= i < self.num_stages:
                raise ValueError(f'{type(self).__name__}: out_indices {out_indices} must lie in '
                                 f'[0, {self.num_stages})')
        if not -1 <= frozen_stages <= self.num_stages:
            raise ValueError(f'{type(self).__name__}: frozen_stages={frozen_stages} must lie in '
                             f'[-1, {self.num_stages}]')
        self.out_indices = tuple(out_indices)
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        self.out_norm_cfg = out_norm_cfg
        for i in self.out_indices:
            if out_norm_cfg is None:
                self.add_module(f'norm{i}', nn.Identity())
            else:
                self.add_module(f'norm{i}', build_norm_layer(out_norm_cfg, self.stage_channels[i])[1])
        self._freeze_stages()

    @property
    def out_channels(self):
        return [self.stage_channels[i] for i in self.out_indices]

    def check_input(self, x):
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f'{type(self).__name__} expects images (B, {self.in_channels}, H, W), '
                             f'got a tensor of shape {tuple(x.shape)}')

    def run_block(self, block, x, *args):
        """Run one block, through activation checkpointing when `with_cp` and gradients are needed."""
        return checkpointed(block, x, *args, enabled=self.with_cp and x.requires_grad)

    def stage_output(self, i, x_map):
        """Apply output norm `norm{i}` to a stage map (B, C, H, W); LayerNorms act over channels."""
        norm = getattr(self, f'norm{i}')
        if isinstance(norm, nn.LayerNorm):
            return norm(x_map.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous()
        return norm(x_map)

    # ---- freezing -------------------------------------------------------------------------
    def _frozen_modules(self):
        if self.frozen_stages < 0:
            return []
        mods = [self.patch_embed]
        for i in range(self.frozen_stages):
            mods.append(self.layers[i])
            if i in self.out_indices:
                mods.append(getattr(self, f'norm{i}'))
        return mods

    def _freeze_stages(self):
        for m in self._frozen_modules():
            m.eval()
            for p in m.parameters():
                p.requires_grad = False

    def train(self, mode=True):
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, _BatchNorm):
                    m.eval()
        return self

    # ---- weights ---------------------------------------------------------------------------
    def init_weights(self):
        cfg = self.init_cfg
        if isinstance(cfg, dict) and cfg.get('type') == 'Pretrained':
            if 'checkpoint' not in cfg:
                raise ValueError(f'{type(self).__name__}: init_cfg of type Pretrained needs a '
                                 f'`checkpoint` path')
            logger = MMLogger.get_current_instance()
            load_pretrained(self, cfg['checkpoint'], self.convert_state_dict,
                            prefix=cfg.get('prefix'), logger=logger)
            print_log(f'{type(self).__name__}: loaded pretrained weights from {cfg["checkpoint"]}',
                      logger=logger)
            self._is_init = True
            return
        if cfg is not None:
            super().init_weights()
        # With no init_cfg the constructor's initialisation (the authors' scheme) stands.

    def convert_state_dict(self, state_dict):
        """Map an authors' checkpoint onto this module's keys (identity by default)."""
        return state_dict
