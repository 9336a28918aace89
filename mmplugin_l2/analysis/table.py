"""The model table's data (names, configs, narrow widths, labels) and how ours are built, apart from the builders
of the other libraries' models and of the authors' code (`models`, `authors`), so that both can use it."""
from ..models import backbones

#: name -> backbone config (mmdet scope; `mmpretrain.` types build through mmpretrain's registry)
MODELS = {
    'hvit3_t': dict(type='HViT3', arch='tiny', drop_path_rate=0.),
    # as the H-ViT3 detection configs build it: blocks recomputed in backward
    'hvit3_t_cp': dict(type='HViT3', arch='tiny', drop_path_rate=0., with_cp=True),
    # the same with the compiled TTT path on every device (declared for the CPU only: the device check measures it)
    'hvit3_t_cp_compiled': dict(type='HViT3', arch='tiny', drop_path_rate=0., with_cp=True,
                                fast_compile=('cpu', 'cuda')),
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
#: the channels of a tiny detector's neck and heads (`build_detector(..., tiny=True)`); its box head's
#: fully connected layers are four times as wide
TINY_DETECTOR_WIDTH = 16

#: whole detectors of the benchmark's `train` kind (one training iteration of the config's model, data loading
#: excluded): name -> (config, how the tables name it). `<name>@authors` (where DETECTOR_AUTHORS names a backbone)
#: is the same detector with the authors' backbone of that analysis.authors.AUTHORS entry.
DETECTORS = {
    'mask_rcnn_hvit3_t': ('mmplugin_l2::mmdet/mask_rcnn_hvit3_t_1x.py', 'Mask R-CNN H-ViT3-T (our config)'),
    'mask_rcnn_swin_t': ('mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py', 'Mask R-CNN Swin-T (mmdet config)'),
}
#: detector -> the authors' backbone of `<detector>@authors`: their detection recipe (`use_checkpoint=True`)
DETECTOR_AUTHORS = {'mask_rcnn_hvit3_t': 'hvit3_t_cp'}

#: name -> how the docs' tables name it
LABELS = {
    'hvit3_t': 'H-ViT3-T', 'hvit3_t_cp': 'H-ViT3-T with_cp', 'hvit3_s': 'H-ViT3-S', 'hvit3_b': 'H-ViT3-B',
    'hvit3_t_cp_compiled': 'H-ViT3-T with_cp, TTT compiled on every device',
    'vit3_t': 'ViT3-T', 'vit3_s': 'ViT3-S',
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


def authors_base(name):
    """The model `<name>@authors` is the authors' counterpart of, None for a name without the tag."""
    return name[:-len(AUTHORS_TAG)] if name.endswith(AUTHORS_TAG) else None


def label(name):
    """The docs' name of `name` (`<name>@authors` -> '<label> (authors' code)')."""
    base = authors_base(name)
    if base is not None:
        if base in DETECTOR_AUTHORS:
            return f'{label(base).split(" (")[0]} (the authors\' backbone, their recipe)'
        return f'{label(base)} (authors\' code)'
    return DETECTORS[name][1] if name in DETECTORS else LABELS.get(name, name)


def is_ours(name):
    """Whether `name` is one of our backbones (a MODELS entry of type HViT3 / ViT3 / L2ViT / ResT) or a detector
    from our config (DETECTORS): what the tools' backbone overrides (`--cfg-options`) apply to. Not `<name>@authors`,
    not the other libraries' models (mmdet's, mmpretrain's, timm's)."""
    if name in DETECTORS:
        return DETECTORS[name][0].startswith('mmplugin_l2::')
    return name in MODELS and '.' not in MODELS[name]['type'] and MODELS[name]['type'] != 'timm'


def configure(cfg, extra_cfg=None, tiny=False):
    """A backbone config `cfg` (dict-like, updated in place and returned) as the analysis tools build it: TINY's
    narrow widths for its type where `tiny` (a type named without its scope, as mmdet's configs name Swin, found
    under `mmdet.`), then `extra_cfg`, whose keys win."""
    if tiny:
        kind = cfg['type']
        cfg.update(TINY.get(kind, TINY.get(f'mmdet.{kind}', {})))
    cfg.update(extra_cfg or {})
    return cfg


def build_ours(name, extra_cfg=None, tiny=False):
    """One of our backbones (a MODELS key of type HViT3 / ViT3 / L2ViT / ResT), without mmdet's registry."""
    cfg = configure(dict(MODELS[name]), extra_cfg, tiny)
    return getattr(backbones, cfg.pop('type'))(**cfg)
