"""The models the analysis tools know by name (benchmark, precision, parity with the authors' code): one
registry that `benchmark.py` and `authors.py` both import."""

#: benchmark name -> backbone config (mmdet scope, so mmdet's own backbones build too)
MODELS = {
    'hvit3_t': dict(type='HViT3', arch='tiny', drop_path_rate=0.),
    'hvit3_s': dict(type='HViT3', arch='small', drop_path_rate=0.),
    'hvit3_b': dict(type='HViT3', arch='base', drop_path_rate=0.),
    'l2vit_t': dict(type='L2ViT', arch='tiny', drop_path_rate=0.),
    'l2vit_s': dict(type='L2ViT', arch='small', drop_path_rate=0.),
    'rest_s': dict(type='ResT', arch='small', drop_path_rate=0.),
    'rest_b': dict(type='ResT', arch='base', drop_path_rate=0.),
    # what users would pick instead: mmdet's Swin-T and PVTv2-b2
    'swin_t': dict(type='mmdet.SwinTransformer', embed_dims=96, depths=(2, 2, 6, 2),
                   num_heads=(3, 6, 12, 24), window_size=7, drop_path_rate=0.),
    'pvtv2_b2': dict(type='mmdet.PyramidVisionTransformerV2', embed_dims=64, num_layers=[3, 4, 6, 3],
                     drop_path_rate=0.),
}


def build(name, extra_cfg=None):
    """The backbone `MODELS[name]` (with `extra_cfg` merged in), built through mmdet's registry."""
    import mmplugin_l2  # noqa: F401
    from mmdet.registry import MODELS as REG
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    cfg = dict(MODELS[name])
    cfg.update(extra_cfg or {})
    return REG.build(cfg)
