"""The one model table of the analysis tools (benchmark, precision, device check, parity with the authors'
code): every backbone they know by name, ours and what users pick instead, with how to build it.

Names: ours (`hvit3_*`, `vit3_*` plain ViT3, `l2vit_*`, `rest_*`), mmpretrain's `VisionTransformer` (`deit_t`,
`deit_s`, `vit_b`, and `deit_t_plain`: DeiT-T whose attention is the written-out softmax(QK^T)V instead of
PyTorch's fused `scaled_dot_product_attention`), mmdet's `swin_t`, `swin_s`, `pvtv2_b2`; and `<name>@authors`
for the authors' implementation of one of ours (mmplugin_l2/analysis/authors.py, from a checkout the user
names); `swin_t_timm` and `deit_t_timm`, timm's Swin-T and DeiT-T, where mmdet / mmpretrain are not
installed (the device check's machine). Ours build without mmdet (straight from mmplugin_l2.models.backbones).
"""
import torch.nn as nn

#: name -> backbone config (mmdet scope; `mmpretrain.` types build through mmpretrain's registry)
MODELS = {
    'hvit3_t': dict(type='HViT3', arch='tiny', drop_path_rate=0.),
    'hvit3_s': dict(type='HViT3', arch='small', drop_path_rate=0.),
    'hvit3_b': dict(type='HViT3', arch='base', drop_path_rate=0.),
    'vit3_t': dict(type='ViT3', arch='tiny', drop_path_rate=0.),
    'vit3_s': dict(type='ViT3', arch='small', drop_path_rate=0.),
    'vit3_b': dict(type='ViT3', arch='base', drop_path_rate=0.),
    'l2vit_t': dict(type='L2ViT', arch='tiny', drop_path_rate=0.),
    'l2vit_s': dict(type='L2ViT', arch='small', drop_path_rate=0.),
    'rest_s': dict(type='ResT', arch='small', drop_path_rate=0.),
    'rest_b': dict(type='ResT', arch='base', drop_path_rate=0.),
    # what users would pick instead: mmdet's pyramids ...
    'swin_t': dict(type='mmdet.SwinTransformer', embed_dims=96, depths=(2, 2, 6, 2),
                   num_heads=(3, 6, 12, 24), window_size=7, drop_path_rate=0.),
    'swin_s': dict(type='mmdet.SwinTransformer', embed_dims=96, depths=(2, 2, 18, 2),
                   num_heads=(3, 6, 12, 24), window_size=7, drop_path_rate=0.),
    'pvtv2_b2': dict(type='mmdet.PyramidVisionTransformerV2', embed_dims=64, num_layers=[3, 4, 6, 3],
                     drop_path_rate=0.),
    # ... and mmpretrain's plain ViTs (patch 16; img_size is set to the input size when built for one)
    'deit_t': dict(type='mmpretrain.VisionTransformer', arch='deit-tiny', patch_size=16, drop_path_rate=0.),
    'deit_t_plain': dict(type='mmpretrain.VisionTransformer', arch='deit-tiny', patch_size=16, drop_path_rate=0.),
    'deit_s': dict(type='mmpretrain.VisionTransformer', arch='deit-small', patch_size=16, drop_path_rate=0.),
    'vit_b': dict(type='mmpretrain.VisionTransformer', arch='b', patch_size=16, drop_path_rate=0.),
    # the same two from timm (any input size; feature maps as NCHW tuples)
    'swin_t_timm': dict(type='timm', name='swin_tiny_patch4_window7_224', features_only=True,
                        strict_img_size=False),
    'deit_t_timm': dict(type='timm', name='deit_tiny_patch16_224', num_classes=0, dynamic_img_size=True),
}

#: narrow widths of `build(..., tiny=True)` (smoke tests of the tools), per type
TINY = {
    'HViT3': dict(arch=dict(embed_dims=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_heads=[1, 1, 2, 2])),
    'L2ViT': dict(arch=dict(embed_dims=[16, 32, 64, 64], depths=[2, 2, 2, 2], num_heads=[1, 2, 2, 2])),
    'ResT': dict(arch=dict(embed_dims=[16, 32, 48, 64], depths=[1, 1, 2, 1], num_heads=[1, 2, 3, 4])),
    'ViT3': dict(arch=dict(embed_dims=32, num_layers=2, num_heads=2)),
    'mmdet.SwinTransformer': dict(embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2)),
    'mmpretrain.VisionTransformer': dict(arch=dict(embed_dims=32, num_layers=2, num_heads=2,
                                                   feedforward_channels=64)),
    'timm:swin_tiny_patch4_window7_224': dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2)),
    'timm:deit_tiny_patch16_224': dict(embed_dim=32, depth=2, num_heads=2),
}

#: name -> how the docs' tables name it
LABELS = {
    'hvit3_t': 'H-ViT3-T', 'hvit3_s': 'H-ViT3-S', 'hvit3_b': 'H-ViT3-B', 'vit3_t': 'ViT3-T', 'vit3_s': 'ViT3-S',
    'vit3_b': 'ViT3-B', 'l2vit_t': 'L2ViT-T', 'l2vit_s': 'L2ViT-S', 'rest_s': 'ResT-S', 'rest_b': 'ResT-B',
    'swin_t': 'Swin-T (mmdet)', 'swin_s': 'Swin-S (mmdet)', 'pvtv2_b2': 'PVTv2-b2 (mmdet)',
    'deit_t': 'DeiT-T (mmpretrain)', 'deit_t_plain': 'DeiT-T plain attention (mmpretrain, no fused SDPA)',
    'deit_s': 'DeiT-S (mmpretrain)', 'vit_b': 'ViT-B/16 (mmpretrain)',
    'swin_t_timm': 'Swin-T (timm)', 'deit_t_timm': 'DeiT-T (timm)',
}

#: models whose attention is switched from PyTorch's fused SDPA to the written-out formula
PLAIN_ATTENTION = ('deit_t_plain',)
#: suffix of the authors' implementation of one of ours
AUTHORS_TAG = '@authors'


def label(name):
    """The docs' name of `name` (`<name>@authors` -> '<label> (authors' code)')."""
    if name.endswith(AUTHORS_TAG):
        return f'{label(name[:-len(AUTHORS_TAG)])} (authors\' code)'
    return LABELS.get(name, name)


def check_name(name, authors_roots=None):
    """Raise ValueError (one line) unless `name` is a known model; `<name>@authors` also needs the checkout of
    its family in `authors_roots` ({family: path})."""
    if name.endswith(AUTHORS_TAG):
        from . import authors
        base = name[:-len(AUTHORS_TAG)]
        if base not in authors.AUTHORS:
            raise ValueError(f'no authors\' implementation of {base!r}; known: '
                             f'{", ".join(k + AUTHORS_TAG for k in sorted(authors.AUTHORS))}')
        fam = authors.AUTHORS[base][0]
        if fam not in (authors_roots or {}):
            raise ValueError(f'{name} needs the authors\' checkout: pass --authors-code {fam}=PATH')
    elif name not in MODELS:
        raise ValueError(f'unknown model {name!r}; known: {", ".join(MODELS)} (and <ours>{AUTHORS_TAG})')


def _plain_attention_(model):
    """Make every mmpretrain MultiheadAttention in `model` compute softmax(QK^T / sqrt(d)) V written out."""
    from functools import partial

    from mmpretrain.models.utils import attention as att
    n = 0
    for m in model.modules():
        if hasattr(m, 'scaled_dot_product_attention'):
            m.scaled_dot_product_attention = partial(att.scaled_dot_product_attention_pyimpl)
            n += 1
    if not n:
        raise RuntimeError('no attention module with scaled_dot_product_attention found to make plain')
    return model


class TimmFeatures(nn.Module):
    """A timm model's feature maps as a tuple of NCHW maps: Swin's `features_only` maps (NHWC), or a plain
    ViT's tokens after its last block (`forward_features`, class token included)."""

    def __init__(self, model, features_only):
        super().__init__()
        self.model, self.features_only = model, features_only

    def forward(self, x):
        if self.features_only:
            return tuple(o.permute(0, 3, 1, 2) for o in self.model(x))
        return (self.model.forward_features(x),)


def _build_timm(cfg, size, tiny):
    import timm
    cfg = dict(cfg)
    cfg.pop('type')
    name = cfg.pop('name')
    kw = dict(TINY[f'timm:{name}']) if tiny else {}
    # a ViT's position embedding is made for the input size; Swin pads any size to its windows
    img_size = tuple(size) if size is not None and cfg.get('dynamic_img_size') else (224, 224)
    return TimmFeatures(timm.create_model(name, pretrained=False, img_size=img_size, **cfg, **kw),
                        cfg.get('features_only', False))


def build(name, extra_cfg=None, size=None, authors_roots=None, tiny=False):
    """The backbone `name`.

    Args:
        name (str): a MODELS key or `<key>@authors`.
        extra_cfg (dict, optional): config overrides merged into MODELS[name].
        size (tuple[int, int], optional): (H, W) the model will see; sets mmpretrain's and timm's ViTs'
            `img_size`, so their position embedding is not resized at every call.
        authors_roots (dict, optional): {family: checkout path} for `<key>@authors`.
        tiny (bool): narrow widths (TINY; not for `<key>@authors`).
    """
    check_name(name, authors_roots)
    if name.endswith(AUTHORS_TAG):
        from . import authors
        base = name[:-len(AUTHORS_TAG)]
        if size is not None:
            authors.check_size(base, size)
        return authors.build(base, authors_roots[authors.AUTHORS[base][0]])
    cfg = dict(MODELS[name])
    if tiny:
        cfg.update(TINY.get(cfg['type'], {}))
    cfg.update(extra_cfg or {})
    if cfg['type'] == 'timm':
        return _build_timm(cfg, size, tiny)
    if '.' not in cfg['type']:  # ours, without mmdet's registry
        from mmplugin_l2.models import backbones
        return getattr(backbones, cfg.pop('type'))(**cfg)
    import mmplugin_l2  # noqa: F401
    from mmdet.registry import MODELS as REG
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    if size is not None and cfg['type'] == 'mmpretrain.VisionTransformer':
        cfg['img_size'] = tuple(size)
    model = REG.build(cfg)
    return _plain_attention_(model) if name in PLAIN_ATTENTION else model
