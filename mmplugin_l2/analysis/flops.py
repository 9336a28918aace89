"""Parameters and FLOPs of a config's model and of its backbone alone.

FLOPs are counted as multiply-adds (one multiply-accumulate = 1 FLOP), the convention of fvcore, which the
H-ViT3, L2ViT and ResT papers use, with mmengine's port of fvcore's jit-trace counter
(`mmengine.analysis.get_model_complexity_info`): matmuls, linears, convolutions, norms and upsampling are
counted; element-wise operations (activations, additions, RoPE rotations, softmax) are not. The model is
traced on whole maps (`memory.whole_maps`): the count is the model's, not that of the row bands' halo rows.
"""
import torch
import torch.nn as nn
from mmengine.analysis import FlopAnalyzer

from ..models.ops.memory import whole_maps

DEFAULT_SHAPES = {'mmdet': (800, 1280), 'mmseg': (512, 2048), 'mmpretrain': (224, 224)}


class _TensorForward(nn.Module):
    """The whole model in `mode='tensor'` as a module of one tensor input (what the tracer needs)."""

    def __init__(self, model, scope, shape):
        super().__init__()
        self.model = model
        self.scope = scope
        self.shape = shape

    def forward(self, x):
        if self.scope == 'mmdet':
            from mmdet.structures import DetDataSample
            h, w = self.shape
            meta = dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w), batch_input_shape=(h, w),
                        scale_factor=(1.0, 1.0))
            return self.model(x, [DetDataSample(metainfo=meta)], mode='tensor')
        return self.model(x, mode='tensor')


def flops_by_module(module, inputs):
    """(multiply-adds of `module(*inputs)`, {submodule name: its multiply-adds, descendants included}), one trace on
    whole maps (quiet: unsupported element-wise ops are skipped)."""
    with whole_maps(module):
        analyzer = FlopAnalyzer(module, inputs)
        analyzer.unsupported_ops_warnings(False)
        analyzer.uncalled_modules_warnings(False)
        return analyzer.total(), dict(analyzer.by_module())


def count_flops(module, inputs):
    """Multiply-adds of `module(*inputs)` on whole maps (`flops_by_module`)."""
    return flops_by_module(module, inputs)[0]


def n_params(module):
    return sum(p.numel() for p in module.parameters())


def build_model(cfg):
    from mmengine.registry import init_default_scope
    import importlib
    init_default_scope(cfg.default_scope)
    registry = importlib.import_module(f'{cfg.default_scope}.registry').MODELS
    model_cfg = cfg.model.copy()
    if model_cfg.get('backbone', {}).get('init_cfg') is not None:
        model_cfg.backbone.init_cfg = None
    return registry.build(model_cfg)


@torch.no_grad()
def model_complexity(cfg, shape=None, in_channels=3):
    """{'model': {'params', 'flops'}, 'backbone': {...}, 'shape': (H, W)} for the config's model."""
    shape = tuple(shape or DEFAULT_SHAPES[cfg.default_scope])
    model = build_model(cfg).eval()
    x = torch.randn(1, in_channels, *shape)
    out = dict(shape=shape,
               model=dict(params=n_params(model), flops=count_flops(_TensorForward(model, cfg.default_scope,
                                                                                   shape), (x,))))
    if hasattr(model, 'backbone'):
        out['backbone'] = dict(params=n_params(model.backbone), flops=count_flops(model.backbone, (x,)))
    return out
