"""What every hierarchical backbone of this plugin shares.

A `PyramidBackbone` has a stem `patch_embed` and a ModuleList `layers` of stages (each may end in its own
`downsample`). This base class owns the mechanics around them:

* `arch`: a name in the subclass's `arch_zoo` or a dict of settings, resolved and checked by `_init_arch`;
* `out_indices` and one output norm `norm{i}` per returned stage (LayerNorm by default, mmdet's side-branch
  convention; any mmcv norm config, e.g. BN for classification heads);
* `frozen_stages` (-1: none, 0: the stem, i: the stem and stages 0..i-1 with their output norms) and
  `norm_eval` (BatchNorms stay in eval mode while training), honoured by `train()`;
* `with_cp`: activation checkpointing of each block (`run_block`; part by part where the block lists its residual
  parts) and of the convolution chains between them, the stem and the downsamplings (`run_chain`);
* `memory_policy`: the one memory policy every large-map layer follows (`ops/memory.py`);
* `stage_output(i, tokens, hw_shape)`: a stage's tokens through `norm{i}` to an NCHW map;
* `init_cfg=dict(type='Pretrained', checkpoint=...)`: the authors' checkpoints are converted by the
  subclass's `convert_state_dict` and loaded strictly, with a clear error on keys that do not fit
  (`strict=False` in the init_cfg loads the keys that fit and warns about the others);
* input validation around every subclass's `forward` (wrapped once, in `__init_subclass__`): images of
  shape (B, in_channels, H, W); an empty batch (B=0) returns empty maps of the shapes a batch of that
  image size would get; a training batch that a BatchNorm cannot normalise (one value per channel)
  stops with a message saying why and what works.
"""
import functools
import operator

import torch
import torch.nn as nn
from mmcv.cnn import build_norm_layer
from mmengine.logging import MMLogger, print_log
from mmengine.model import BaseModule
from torch.nn.modules.batchnorm import _BatchNorm

from ..checkpoint import load_pretrained
from .ops.checkpoint import checkpointed
from .ops.export import exporting
from .ops.memory import set_memory_policy
from .ops.tokens import tokens_to_map


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


def drop_path_rates(drop_path_rate, depths):
    """Stochastic-depth rates rising linearly from 0 (first block) to `drop_path_rate` (last block) over all
    `sum(depths)` blocks, split into one list per stage."""
    n_blocks = sum(depths)
    rates = [drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]
    return [rates[sum(depths[:i]):sum(depths[:i + 1])] for i in range(len(depths))]


def normalize_out_indices(out_indices, num_stages, name):
    """`out_indices` as a tuple of non-negative stage indices (negative ones count from the end).

    Rejects, quoting what was passed: non-integers, indices outside [-num_stages, num_stages), an empty
    selection, duplicates (also -1 and num_stages - 1) and a non-increasing order (the outputs come in
    stage order; necks pair them with their `in_channels` in that order)."""
    given = out_indices
    if isinstance(out_indices, int) and not isinstance(out_indices, bool):
        out_indices = [out_indices]
    try:
        out_indices = [operator.index(i) for i in out_indices]
    except TypeError:
        raise TypeError(f'{name}: out_indices must be an int or a sequence of ints, got {given!r}') from None
    allowed = f'each index in [{-num_stages}, {num_stages}) (negative ones count from the end)'
    if not out_indices:
        raise ValueError(f'{name}: out_indices={given!r} selects no stage; give at least one, '
                         f'{allowed}, e.g. ({num_stages - 1},)')
    bad = [i for i in out_indices if not -num_stages <= i < num_stages]
    if bad:
        raise ValueError(f'{name}: out_indices={given!r}: {bad} out of range; the model has {num_stages} '
                         f'stages, so {allowed}')
    pos = [i + num_stages if i < 0 else i for i in out_indices]
    if len(set(pos)) != len(pos):
        raise ValueError(f'{name}: out_indices={given!r} names a stage twice (as stages {pos}); each stage '
                         f'can be returned once')
    if pos != sorted(pos):
        raise ValueError(f'{name}: out_indices={given!r} is not in increasing stage order (stages {pos}); '
                         f'the outputs come in stage order: pass {tuple(sorted(pos))}')
    return pos


def _is_bn_one_value_error(err):
    return isinstance(err, ValueError) and 'Expected more than 1 value per channel' in str(err)


def _guard_forward(forward):
    """Wrap a backbone's `forward(x)`: input check, empty batches, BatchNorm batch-size message."""

    @functools.wraps(forward)
    def wrapped(self, x, *args, **kwargs):
        self.check_input(x)  # the one input check of every backbone (their forwards do not repeat it)
        if exporting():  # tracing / export / compile: no data-size branches or exception rewriting
            return forward(self, x, *args, **kwargs)
        if x.shape[0] == 0:
            return self.empty_outputs(x)
        try:
            return forward(self, x, *args, **kwargs)
        except ValueError as err:
            if not _is_bn_one_value_error(err):
                raise
            raise ValueError(self._bn_batch_message(x)) from err

    wrapped._pyramid_guarded = True
    return wrapped


class PyramidBackbone(BaseModule):
    """Base of the 4-stage backbones. Subclasses resolve their arch with `_init_arch`, build `patch_embed`
    and `layers` then call `_init_pyramid`; their `forward` uses `run_block` and `stage_output`."""

    #: `stage_output` makes LayerNorm-ed maps NCHW-contiguous (False: the channels-last view of the tokens)
    contiguous_outputs = True
    #: no class token: mmpretrain's `vis_cam.py --vit-like` reads this to know how many tokens to drop
    num_extra_tokens = 0

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        fwd = cls.__dict__.get('forward')
        if fwd is not None and not getattr(fwd, '_pyramid_guarded', False):
            cls.forward = _guard_forward(fwd)

    def _init_arch(self, arch, keys=('embed_dims', 'depths', 'num_heads'), defaults=None, per_stage=True):
        """Resolve `arch` (a name or alias in the class's `arch_zoo`, or a dict; see `resolve_arch`) into
        `arch_settings` and `arch_desc` (the name, or 'custom' for a dict) and return the values of `keys`, in
        that order.

        An arch must give every key but those in `defaults`, whose values stand for the keys it leaves out.
        With `per_stage`, the values are lists with one entry per stage: lists of different lengths are
        rejected, quoting them."""
        name = type(self).__name__
        defaults = defaults or {}
        self.arch_settings = resolve_arch(arch, self.arch_zoo, [k for k in keys if k not in defaults], name)
        self.arch_desc = arch if isinstance(arch, str) else 'custom'
        values = tuple(self.arch_settings[k] if k in self.arch_settings else defaults[k] for k in keys)
        if per_stage and len({len(v) for v in values}) > 1:
            raise ValueError(f'{name}: {", ".join(keys[:-1])} and {keys[-1]} need one entry per stage, got '
                             f'{", ".join(str(v) for v in values)}')
        return values

    def _init_pyramid(self, in_channels, stage_channels, out_indices, frozen_stages, norm_eval, with_cp,
                      out_norm_cfg, memory_policy=None, weight_init=None):
        """Finish a subclass's construction once its stem and stages are built: `weight_init` (the authors'
        initialisation, a function of one module) over every module built so far, then the output norms of
        `out_indices`, the memory policy and the frozen stages."""
        if weight_init is not None:
            self.apply(weight_init)
        self.in_channels = in_channels
        self.num_stages = len(stage_channels)
        self.stage_channels = list(stage_channels)
        out_indices = normalize_out_indices(out_indices, self.num_stages, type(self).__name__)
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
        self.memory_policy = set_memory_policy(self, memory_policy)
        self._freeze_stages()

    @property
    def out_channels(self):
        return [self.stage_channels[i] for i in self.out_indices]

    def check_input(self, x):
        if not torch.is_tensor(x) or x.dim() != 4 or x.shape[1] != self.in_channels:
            got = f'a tensor of shape {tuple(x.shape)}' if torch.is_tensor(x) else f'a {type(x).__name__}'
            raise ValueError(f'{type(self).__name__} expects images (B, {self.in_channels}, H, W), got {got}')
        if x.shape[0] and (x.shape[2] == 0 or x.shape[3] == 0):
            raise ValueError(f'{type(self).__name__}: images of size {x.shape[2]}x{x.shape[3]} have no '
                             f'pixels; H and W must be at least 1')

    @torch.no_grad()
    def output_shapes(self, x):
        """The (C, h, w) of each returned map for images the size of `x`, found by running one blank
        image in eval mode (running statistics are not touched; the train/eval state is restored)."""
        was_training = self.training
        try:
            self.eval()
            outs = self.forward(x.new_zeros((1, *x.shape[1:])))
        finally:
            self.train(was_training)
        return [tuple(o.shape[1:]) for o in outs]

    def empty_outputs(self, x):
        """Empty maps (0, C, h, w) of the shapes a batch of images the size of `x` would get."""
        return tuple(x.new_empty((0, *shape)) for shape in self.output_shapes(x))

    def _bn_batch_message(self, x):
        """Why a training batch failed in a BatchNorm, which maps were too small, and what works."""
        b, _, h, w = x.shape
        try:
            shapes = self.output_shapes(x[:1])
            small = [str(i) for i, s in zip(self.out_indices, shapes) if s[1] * s[2] == 1]
        except Exception:  # noqa: BLE001  (the message must not fail)
            small = []
        where = f' (the map of stage {", ".join(small)} is 1x1)' if small else ''
        return (f'{type(self).__name__}: a BatchNorm in training mode got one value per channel from a batch '
                f'of {b} image(s) of {h}x{w}{where}; BatchNorm needs more than one value per channel to '
                f'compute batch statistics. What works: a batch of at least 2 images per GPU, larger '
                f'images, or norm_eval=True (BatchNorms use their running statistics, e.g. when '
                f'fine-tuning).')

    def run_block(self, block, x, *args):
        """Run one block, through activation checkpointing when `with_cp` and gradients are needed
        (BatchNorm running statistics updated once per step, not again in the recomputation).

        A block that lists its residual parts in `recomputed_parts()` (each `part(x, *args) -> x`, run in that
        order, together the block's forward) is recomputed part by part: each part keeps its input and is
        recomputed when its own backward comes, so one part's recomputed tensors are gone before the part before
        it is recomputed (the peak of the block's backward is its largest part's, not the parts' sum), for one
        more residual-stream tensor kept per part boundary. Other blocks are recomputed whole."""
        enabled = self.with_cp and x.requires_grad
        parts = getattr(block, 'recomputed_parts', None)
        if not enabled or parts is None:
            return checkpointed(block, x, *args, enabled=enabled, module=block)
        for part in parts():
            x = checkpointed(part, x, *args, module=block)
        return x

    def run_chain(self, module, x, *args):
        """Run `module(x, *args)`, a convolution chain between the blocks (a stem, a downsampling), through
        activation checkpointing when `with_cp` and it trains (x or its parameters need gradients): only its
        input is kept, its intermediates (the stem's are full-resolution maps) are recomputed in backward
        (BatchNorm running statistics updated once)."""
        enabled = self.with_cp and (x.requires_grad or any(p.requires_grad for p in module.parameters()))
        return checkpointed(module, x, *args, enabled=enabled, module=module)

    def stage_output(self, i, tokens, hw_shape):
        """Stage i's tokens (B, N, C) of an (H, W) map through the output norm `norm{i}`, as an NCHW map
        (B, C, H, W). A LayerNorm acts on the tokens (over channels); other norms (BN) on the map."""
        norm = getattr(self, f'norm{i}')
        if isinstance(norm, nn.LayerNorm):
            out = tokens_to_map(norm(tokens), hw_shape)
            return out.contiguous() if self.contiguous_outputs else out
        return norm(tokens_to_map(tokens, hw_shape))

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
                            prefix=cfg.get('prefix'), logger=logger, strict=cfg.get('strict', True))
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
