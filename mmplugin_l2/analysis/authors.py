"""The authors' official backbones, imported from a checkout the user gives, for side-by-side benchmarks
(tools/analysis/benchmark.py --authors-code) and an output-parity check against ours.

Nothing of the authors' code is copied here. Their dense-prediction backbone file is executed from the
checkout under a private module name; the packages it imports but the model does not need (registries,
loggers, checkpoint loaders of mmdet 2.x / mmcv 1.x / detectron2, their relative `..builder` imports) are
replaced by small stand-in modules in `sys.modules` while it is imported, then restored. timm is imported
for real (`pip install timm`).

Families (clone the repository, pass its root):

* ViTTT (github.com/Liyining-ai/ViTTT): detection/mmdet/models/backbones/vittt.py, `vittt_{tiny,small,base}`
  -> our HViT3. Their TTT attention uses another inner-loss scale on the first call of each module
  instance, so their model is always called once before outputs are compared.
* L2ViT (github.com/ChuanyangZheng/L2ViT): object_detection/mmdet/models/backbones/l2vit.py, `L2ViT` with
  their detection config (`block_type='mix_local_enhanced_vit'`, `conv_stem=True`) -> our L2ViT.
* ResT (github.com/wofmanaf/ResT): object_detection/restv2/rest.py, the detectron2 backbone `ResT` (v1)
  with all four stages returned and nothing frozen -> our ResT with `norm_in_path=True`: their output norms
  of stages 1-3 sit in the main path. Their model needs H, W mod 32 in {0, 29, 30, 31}.

All variants are built with drop path 0, as the benchmark's entries.
"""
import contextlib
import importlib
import importlib.util
import logging
import os.path as osp
import sys
import types
import warnings
from functools import partial

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from .table import build_ours

#: family -> (repository, backbone file relative to the checkout root)
FAMILIES = {
    'ViTTT': ('https://github.com/Liyining-ai/ViTTT', 'detection/mmdet/models/backbones/vittt.py'),
    'L2ViT': ('https://github.com/ChuanyangZheng/L2ViT', 'object_detection/mmdet/models/backbones/l2vit.py'),
    'ResT': ('https://github.com/wofmanaf/ResT', 'object_detection/restv2/rest.py'),
}
_PKG = '_mmplugin_l2_authors'
_loaded = {}


def check_root(family, root):
    """The backbone file of `family` in the checkout `root`; a clear error when it is not there."""
    if family not in FAMILIES:
        raise KeyError(f'unknown authors\' code family {family!r}; choose one of {sorted(FAMILIES)}')
    repo, rel = FAMILIES[family]
    if not root or not osp.isdir(root):
        raise FileNotFoundError(f'{family}: checkout {root!r} is not a directory; pass the root of a clone of '
                                f'{repo}')
    path = osp.join(root, rel)
    if not osp.isfile(path):
        raise FileNotFoundError(f'{family}: {path} is missing; pass the root of a clone of {repo} '
                                f'(the directory that holds {rel.split("/")[0]}/)')
    return path


def family_path(s):
    """argparse type of `--authors-code FAMILY=PATH`: -> (family, path), family matched case-insensitively."""
    import argparse
    fam, sep, path = s.partition('=')
    match = [f for f in FAMILIES if f.lower() == fam.strip().lower()]
    if not sep or not path or not match:
        raise argparse.ArgumentTypeError(f'expected FAMILY=PATH with FAMILY one of '
                                         f'{", ".join(FAMILIES)}, got {s!r}')
    return match[0], path


def checked_roots(pairs, error):
    """`--authors-code FAMILY=PATH ...` pairs -> {family: absolute path}, each root checked (`check_root`);
    `error(message)` reports a family given twice or a root that is not a checkout of that family."""
    roots = {}
    for fam, path in pairs:
        if fam in roots:
            error(f'--authors-code: {fam} given twice')
        try:
            check_root(fam, path)
        except FileNotFoundError as e:
            error(f'--authors-code: {e}')
        roots[fam] = osp.abspath(path)
    return roots


def require_timm():
    try:
        importlib.import_module('timm')
    except ImportError as e:
        raise ImportError('the authors\' backbones import timm: pip install timm') from e


def _module(name, package=False, **attrs):
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    if package:
        m.__path__ = []
    return m


class _Registry:
    """Stand-in for the registries their files decorate their classes with."""

    def register_module(self, *args, **kwargs):
        return (lambda obj: obj) if not args or not callable(args[0]) else args[0]

    def register(self, *args, **kwargs):
        return self.register_module(*args, **kwargs)


def _unused(name):
    def fn(*args, **kwargs):
        raise NotImplementedError(f'{name} is a stand-in: not needed to build the backbone')
    return fn


def _stand_ins(family, pkg):
    """Modules their file imports that do not take part in the model."""
    logger = partial(logging.getLogger, 'authors')
    own = {pkg: _module(pkg, True), f'{pkg}.models': _module(f'{pkg}.models', True),
           f'{pkg}.models.backbones': _module(f'{pkg}.models.backbones', True),
           # their relative `..builder` / `...builder` / `...utils` imports
           f'{pkg}.builder': _module(f'{pkg}.builder', BACKBONES=_Registry()),
           f'{pkg}.models.builder': _module(f'{pkg}.models.builder', BACKBONES=_Registry()),
           f'{pkg}.utils': _module(f'{pkg}.utils', get_root_logger=logger)}
    if family == 'ViTTT':
        return own, {'mmdet.registry': _module('mmdet.registry', MODELS=_Registry())}
    if family == 'L2ViT':
        from mmengine.model.weight_init import constant_init, kaiming_init
        return own, {'mmcv_custom': _module('mmcv_custom', load_checkpoint=_unused('mmcv_custom.load_checkpoint')),
                     'mmdet.utils': _module('mmdet.utils', get_root_logger=logger),
                     'mmcv.cnn': _module('mmcv.cnn', constant_init=constant_init, kaiming_init=kaiming_init)}
    if family == 'ResT':
        backbone = type('Backbone', (nn.Module,), {'__module__': 'detectron2.modeling.backbone'})
        return own, {
            'detectron2': _module('detectron2', True),
            'detectron2.modeling': _module('detectron2.modeling', True),
            'detectron2.modeling.backbone': _module('detectron2.modeling.backbone', True, Backbone=backbone),
            'detectron2.modeling.backbone.build': _module('detectron2.modeling.backbone.build',
                                                          BACKBONE_REGISTRY=_Registry()),
            'detectron2.modeling.backbone.fpn': _module(
                'detectron2.modeling.backbone.fpn', FPN=_unused('FPN'), LastLevelP6P7=_unused('LastLevelP6P7'),
                LastLevelMaxPool=_unused('LastLevelMaxPool')),
            'detectron2.layers': _module('detectron2.layers', ShapeSpec=_unused('ShapeSpec'))}
    raise KeyError(family)


@contextlib.contextmanager
def _swapped_modules(modules):
    missing = object()
    saved = {n: sys.modules.get(n, missing) for n in modules}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for n, old in saved.items():
            if old is missing:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = old


def load_module(family, root):
    """Import the authors' backbone file of `family` from the checkout `root` (once per process)."""
    path = osp.realpath(check_root(family, root))
    if path in _loaded:
        return _loaded[path]
    require_timm()
    pkg = f'{_PKG}{len(_loaded)}_{family.lower()}'
    own, third_party = _stand_ins(family, pkg)
    name = f'{pkg}.models.backbones.{osp.splitext(osp.basename(path))[0]}'
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.update(own)
    sys.modules[name] = mod
    with _swapped_modules(third_party), warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # timm.models.layers is deprecated
        try:
            spec.loader.exec_module(mod)
        except Exception:
            sys.modules.pop(name, None)
            raise
    _loaded[path] = mod
    return mod


def _vittt(variant, root, **kwargs):
    return getattr(load_module('ViTTT', root), variant)(drop_path_rate=0., **kwargs)


def _l2vit(depths, dims, num_heads, root):
    return load_module('L2ViT', root).L2ViT(depths=depths, dims=dims, num_heads=num_heads,
                                            block_type='mix_local_enhanced_vit', conv_stem=True,
                                            drop_path_rate=0., out_indices=[0, 1, 2, 3])


def _rest(embed_dims, depths, root):
    cfg = types.SimpleNamespace(MODEL=types.SimpleNamespace(BACKBONE=types.SimpleNamespace(FREEZE_AT=0)))
    return load_module('ResT', root).ResT(cfg, in_ch=3, embed_dims=embed_dims, depths=depths, qkv_bias=True,
                                          drop_path_rate=0., apply_transform=True,
                                          out_features=['stage1', 'stage2', 'stage3', 'stage4'])


#: benchmark model name (mmplugin_l2.analysis.models.MODELS) -> (family, builder(root))
AUTHORS = {
    'hvit3_t': ('ViTTT', partial(_vittt, 'vittt_tiny')),
    # their detection recipe: blocks recomputed in backward
    'hvit3_t_cp': ('ViTTT', partial(_vittt, 'vittt_tiny', use_checkpoint=True)),
    'hvit3_s': ('ViTTT', partial(_vittt, 'vittt_small')),
    'hvit3_b': ('ViTTT', partial(_vittt, 'vittt_base')),
    'l2vit_t': ('L2ViT', partial(_l2vit, [2, 2, 6, 2], [96, 192, 384, 768], [3, 6, 12, 24])),
    'l2vit_s': ('L2ViT', partial(_l2vit, [2, 2, 18, 2], [96, 192, 384, 768], [3, 6, 12, 24])),
    'rest_s': ('ResT', partial(_rest, [64, 128, 256, 512], [2, 2, 6, 2])),
    'rest_b': ('ResT', partial(_rest, [96, 192, 384, 768], [2, 2, 6, 2])),
}
#: config overrides that make our model compute the authors' function (the parity check uses them)
OURS_MATCHING_CFG = {'rest_s': dict(norm_in_path=True), 'rest_b': dict(norm_in_path=True)}


class TupleOutputs(nn.Module):
    """The authors' model with its outputs as a tuple of maps (ResT's detectron2 dict in stage order)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        return tuple(out.values()) if isinstance(out, dict) else tuple(out)


def check_size(name, size):
    """The authors' ResT computes each stage's size as floor(H / 2) and crashes unless H, W mod 32 are in
    {0, 29, 30, 31}: say so before it does."""
    if AUTHORS[name][0] == 'ResT' and any(s % 32 not in (0, 29, 30, 31) for s in size):
        raise ValueError(f'the authors\' ResT needs H and W mod 32 in {{0, 29, 30, 31}}, got {size[0]}x{size[1]}')


def build(name, root):
    """The authors' counterpart of our benchmark model `name`, from their checkout `root`, as a
    TupleOutputs module."""
    if name not in AUTHORS:
        raise KeyError(f'no authors\' counterpart for {name!r}; known: {sorted(AUTHORS)}')
    return TupleOutputs(AUTHORS[name][1](root))


@torch.no_grad()
def randomize_(model, seed=0):
    """Make every constant-initialised tensor non-trivial: norm affine parameters, zero biases,
    temperatures (relative noise 0.2, absolute 0.02 around 0) and BatchNorm running statistics."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        flat = p.flatten()
        if flat.numel() and bool((flat == flat[0]).all()):
            base = flat[0].item()
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * (abs(base) or 0.1))
    for m in model.modules():
        if isinstance(m, _BatchNorm) and m.running_mean is not None:
            m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.1)
            m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
    return model


def parity(name, root, size, batch=2, seed=0, device='cpu'):
    """Max |ours - theirs| per output stage: their model with random weights (see `randomize_`), its
    state_dict loaded strictly into ours through our `convert_state_dict`, both in eval mode on the same
    input, theirs called once first (ViTTT's first-call inner-loss scale)."""
    check_size(name, size)
    torch.manual_seed(seed)
    theirs = randomize_(build(name, root), seed + 1).to(device).eval()
    ours = build_ours(name, OURS_MATCHING_CFG.get(name))
    ours.load_state_dict(ours.convert_state_dict(theirs.model.state_dict()), strict=True)
    ours.to(device).eval()
    x = torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed + 2)).to(device)
    with torch.no_grad():
        theirs(x)  # warm-up
        ref, out = theirs(x), ours(x)
    if len(ref) != len(out):
        raise RuntimeError(f'{name}: the authors\' model returns {len(ref)} maps, ours {len(out)}')
    stages = []
    for a, b in zip(out, ref):
        if a.shape != b.shape:
            raise RuntimeError(f'{name}: output shapes differ, ours {tuple(a.shape)} vs theirs {tuple(b.shape)}')
        stages.append(dict(shape=list(a.shape), max_abs_diff=(a.double() - b.double()).abs().max().item(),
                           ref_max_abs=b.abs().max().item()))
    return dict(family=AUTHORS[name][0], size=list(size), batch=batch, seed=seed,
                ours_cfg=OURS_MATCHING_CFG.get(name, {}), stages=stages,
                max_abs_diff=max(s['max_abs_diff'] for s in stages))
