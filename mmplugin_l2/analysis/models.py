"""The one model table of the analysis tools (benchmark, precision, device check, parity with the authors'
code): every backbone they know by name, ours and what users pick instead, with how to build it.

Names: ours (`hvit3_*`, `vit3_*` plain ViT3, `l2vit_*`, `rest_*`), mmpretrain's `VisionTransformer` (`deit_t`,
`deit_s`, `vit_b`, and `deit_t_plain`: DeiT-T whose attention is the written-out softmax(QK^T)V instead of
PyTorch's fused `scaled_dot_product_attention`), mmdet's `swin_t`, `swin_s`, `pvtv2_b2`; and `<name>@authors`
for the authors' implementation of one of ours (mmplugin_l2/analysis/authors.py, from a checkout the user
names); `swin_t_timm` and `deit_t_timm`, timm's Swin-T and DeiT-T, where mmdet / mmpretrain are not
installed (the device check's machine). Ours build without mmdet (straight from mmplugin_l2.models.backbones).
Whole detectors (`DETECTORS`: `mask_rcnn_hvit3_t` from our config, `mask_rcnn_swin_t` from mmdet's, and
`mask_rcnn_hvit3_t@authors`, ours with the authors' backbone on their recipe) build with `build_detector`.
"""
import contextlib
import sys

import torch
import torch.nn as nn

from . import authors
from .table import (AUTHORS_TAG, DETECTOR_AUTHORS, DETECTORS, LABELS, MODELS, PLAIN_ATTENTION,  # noqa: F401
                    TINY, TINY_DETECTOR_WIDTH, authors_base, build_ours, configure, is_ours, label)


def check_name(name, authors_roots=None):
    """Raise ValueError (one line) unless `name` is a known model; `<name>@authors` also needs the checkout of
    its family in `authors_roots` ({family: path})."""
    base = authors_base(name)
    if base in DETECTOR_AUTHORS:
        return check_name(DETECTOR_AUTHORS[base] + AUTHORS_TAG, authors_roots)
    if base is not None:
        if base not in authors.AUTHORS:
            raise ValueError(f'no authors\' implementation of {base!r}; known: '
                             f'{", ".join(k + AUTHORS_TAG for k in sorted(authors.AUTHORS))}')
        fam = authors.AUTHORS[base][0]
        if fam not in (authors_roots or {}):
            raise ValueError(f'{name} needs the authors\' checkout: pass --authors-code {fam}=PATH')
    elif name not in MODELS and name not in DETECTORS:
        raise ValueError(f'unknown model {name!r}; known: {", ".join([*MODELS, *DETECTORS])} (and '
                         f'<ours>{AUTHORS_TAG})')


def checked_names(names, authors_code, error):
    """The tools' check of model names (`--models` / `--model`) and `--authors-code FAMILY=PATH` pairs: returns the
    checkouts' roots ({family: absolute path}, `authors.checked_roots`); `error(message)` reports a root that is not
    a checkout, an unknown name, a `<name>@authors` without its family's checkout, or one without timm."""
    roots = authors.checked_roots(authors_code, error)
    for name in names:
        try:
            check_name(name, roots)
        except ValueError as e:
            error(str(e))
    if any(authors_base(name) is not None for name in names):
        try:
            authors.require_timm()
        except ImportError as e:
            error(str(e))
    return roots


def is_detector(name):
    """Whether `name` is a whole detector (DETECTORS, or one with the authors' backbone)."""
    return name in DETECTORS or authors_base(name) in DETECTOR_AUTHORS


@contextlib.contextmanager
def mmcv_ops_in_fp32():
    """mmcv's RoIAlign and NMS run in fp32 on half inputs while the body runs: their kernels (CPU; RoIAlign's on
    CUDA too) have no bf16, so under bf16 autocast a two-stage detector stops at its first RoI. Inside, they compute
    in fp32 on the inputs cast to fp32 (autocast off); RoIAlign returns its features in the input's dtype, as its
    fp16 kernel does (mmdet's RoI extractor writes them into a map of that dtype)."""
    import mmcv.ops  # noqa: F401
    roi_align, nms = sys.modules['mmcv.ops.roi_align'], sys.modules['mmcv.ops.nms']
    roi_forward, nms_forward = roi_align.RoIAlign.forward, nms.NMSop.forward

    def roi(self, input, rois):
        if input.dtype in (torch.float16, torch.bfloat16):
            with torch.autocast(input.device.type, enabled=False):
                return roi_forward(self, input.float(), rois.float()).to(input.dtype)
        return roi_forward(self, input, rois)

    def nms_(ctx, bboxes, scores, *args, **kwargs):
        return nms_forward(ctx, bboxes.float(), scores.float(), *args, **kwargs)
    roi_align.RoIAlign.forward, nms.NMSop.forward = roi, staticmethod(nms_)
    try:
        yield
    finally:
        roi_align.RoIAlign.forward, nms.NMSop.forward = roi_forward, staticmethod(nms_forward)


def build_detector(name, size, batch, authors_roots=None, device='cpu', extra_cfg=None, tiny=False):
    """The whole detector `name` (`is_detector`) built from its config with random weights (no pretrained
    backbone), and one training batch for it: `batch` random (3, H, W) images with random boxes and masks
    (mmdet.testing.demo_mm_inputs, 80 classes, 5 objects each), run through the config's data preprocessor (which
    moves it to `device`, where the model goes). `extra_cfg`: overrides of the config's backbone arguments (ours,
    not the authors' backbone of `<name>@authors`). `tiny`: a smoke test's detector, the same parts at narrow
    widths (`narrow_detector`).

    Returns:
        tuple: (model, the preprocessed batch as `model(**batch, mode='loss')` takes it).
    """
    check_name(name, authors_roots)
    base = authors_base(name) or name
    from mmdet.registry import MODELS as REG
    from mmdet.testing import demo_mm_inputs
    from mmengine.registry import init_default_scope

    from .inputs import load_config
    cfg = load_config(DETECTORS[base][0])
    init_default_scope('mmdet')
    cfg.model.backbone.init_cfg = None
    if base == name:
        configure(cfg.model.backbone, extra_cfg, tiny)
    if tiny:
        narrow_detector(cfg.model, follow_backbone=base == name)
    model = REG.build(cfg.model)
    if base != name:
        model.backbone = build(DETECTOR_AUTHORS[base] + AUTHORS_TAG, size=size, authors_roots=authors_roots)
    model.to(device)
    raw = demo_mm_inputs(batch, [(3, *size)] * batch, num_items=[5] * batch, num_classes=80, with_mask=True)
    return model, model.data_preprocessor(raw, True)


def narrow_detector(model_cfg, follow_backbone=True):
    """Narrow a two-stage detector's config (`model_cfg`, Mask R-CNN's keys) in place: the neck and every head
    TINY_DETECTOR_WIDTH channels wide (the box head's fully connected layers 4x), the same layer types, losses,
    samplers and RoI counts. With `follow_backbone` the neck's inputs are the widths of the config's backbone
    (built once to see them; `build_detector` narrows ours and mmdet's to their TINY widths), else they stay (the
    authors' backbone, put in afterwards, keeps its widths)."""
    from mmdet.registry import MODELS as REG
    w = TINY_DETECTOR_WIDTH
    if follow_backbone:
        probe = REG.build(model_cfg.backbone)
        probe.eval()  # (mmdet's Swin's train() returns None)
        with torch.no_grad():
            model_cfg.neck.in_channels = [o.shape[1] for o in probe(torch.zeros(1, 3, 64, 64))]
    model_cfg.neck.out_channels = w
    model_cfg.rpn_head.update(in_channels=w, feat_channels=w)
    roi = model_cfg.roi_head
    roi.bbox_roi_extractor.out_channels = roi.bbox_head.in_channels = w
    roi.bbox_head.fc_out_channels = 4 * w
    if 'mask_head' in roi:
        roi.mask_roi_extractor.out_channels = roi.mask_head.in_channels = w
        roi.mask_head.conv_out_channels = w


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
    base = authors_base(name)
    if base is not None:
        if size is not None:
            authors.check_size(base, size)
        return authors.build(base, authors_roots[authors.AUTHORS[base][0]])
    if is_ours(name):
        return build_ours(name, extra_cfg, tiny)
    cfg = configure(dict(MODELS[name]), extra_cfg, tiny)
    if cfg['type'] == 'timm':
        return _build_timm(cfg, size, tiny)
    import mmplugin_l2  # noqa: F401
    from mmdet.registry import MODELS as REG
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    if size is not None and cfg['type'] == 'mmpretrain.VisionTransformer':
        cfg['img_size'] = tuple(size)
    model = REG.build(cfg)
    return _plain_attention_(model) if name in PLAIN_ATTENTION else model
