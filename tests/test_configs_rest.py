"""The ResT configs under configs/: their settings against the authors' recipes (docs/rest.md, Recipes),
model builds (pretrained init disabled) with parameter counts, a forward of the small configs,
optimiser parameter groups, the detection train pipeline, and one real training iteration through
tools/train.py on generated data for Mask R-CNN, UperNet and the ImageNet classifier."""
import copy
import functools
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
import torch.nn as nn
from mmengine.dataset import Compose
from mmengine.optim import build_optim_wrapper

from config_helpers import CFG_ROOT, load, registries
from conftest import ROOT, TINY_REST

SIZES = ('lite', 's', 'b', 'l')
ARCH = {'lite': 'lite', 's': 'small', 'b': 'base', 'l': 'large'}
DIMS = {'lite': [64, 128, 256, 512], 's': [64, 128, 256, 512], 'b': [96, 192, 384, 768], 'l': [96, 192, 384, 768]}
# the authors' classification models, measured on their code (docs/rest.md, Architecture)
CLS_PARAMS = {'lite': 10_508_300, 's': 13_679_708, 'b': 30_327_052, 'l': 51_676_156}
DET_DROP_PATH = {'lite': 0.1, 's': 0.1, 'b': 0.2, 'l': 0.2}   # the authors' detection backbone
CLS_DROP_PATH = {'lite': 0.1, 's': 0.1, 'b': 0.2, 'l': 0.3}   # the paper's classification values
# full detectors, paper Tab. 3 / 4 (M parameters)
PAPER_PARAMS = {('mask_rcnn', 's'): 33.3, ('mask_rcnn', 'b'): 49.8, ('retinanet', 's'): 23.4,
                ('retinanet', 'b'): 40.5, ('retinanet', 'l'): 61.8}
IMAGENET_NORM = dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375])

DET = {f'mmdet/{kind}_rest_{s}_{sch}.py': (kind, s, sch)
       for kind in ('mask_rcnn', 'retinanet') for s in SIZES for sch in ('1x', '3x')}
SEG = {f'mmseg/upernet_rest_{s}_512x512_160k_ade20k.py': s for s in ('s', 'b', 'l')}
CLS = {f'mmpretrain/rest_{s}_in1k.py': s for s in SIZES}
ALL = [*DET, *SEG, *CLS]
# configs whose models run a forward (real widths, small input); the others are built on the meta device
FORWARD = ['mmdet/mask_rcnn_rest_lite_1x.py', 'mmdet/retinanet_rest_lite_1x.py',
           'mmseg/upernet_rest_s_512x512_160k_ade20k.py', 'mmpretrain/rest_lite_in1k.py']

SEG_BN = {'model.decode_head.norm_cfg': dict(type='BN', requires_grad=True),
          'model.auxiliary_head.norm_cfg': dict(type='BN', requires_grad=True)}


def size_of(rel):
    return DET[rel][1] if rel in DET else SEG[rel] if rel in SEG else CLS[rel]


@functools.lru_cache(maxsize=None)
def build_model(rel):
    cfg = load(rel, SEG_BN if rel in SEG else {'model.test_cfg.rpn.max_per_img': 8}
               if rel in DET and DET[rel][0] == 'mask_rcnn' else None)
    MODELS, _ = registries(cfg)
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None
    if cfg.get('data_preprocessor') is not None:
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with torch.device('cpu' if rel in FORWARD else 'meta'):
        model = MODELS.build(model_cfg)
    return cfg, model


def n_params(module):
    return sum(p.numel() for p in module.parameters())


# ---------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('rel', ALL)
def test_common(rel):
    cfg = load(rel)
    assert cfg.custom_imports == dict(imports=['mmplugin_l2'], allow_failed_imports=False)
    assert cfg.default_scope == rel.split('/')[0]
    bb = cfg.model.backbone
    assert bb.type == 'ResT' and bb.arch == ARCH[size_of(rel)]
    assert 'depth' not in bb and 'window_size' not in bb and 'img_size' not in bb, 'base keys leaked'


@pytest.mark.parametrize('rel', list(DET))
def test_det_settings(rel):
    kind, size, sched = DET[rel]
    cfg = load(rel)
    m = cfg.model
    assert m.type == {'mask_rcnn': 'MaskRCNN', 'retinanet': 'RetinaNet'}[kind]
    bb = m.backbone
    assert bb.drop_path_rate == pytest.approx(DET_DROP_PATH[size])
    assert bb.frozen_stages == -1 and bb.norm_eval is False and bb.norm_in_path is False
    assert bb.init_cfg == dict(type='Pretrained', checkpoint=f'data/pretrained/rest_{ARCH[size]}.pth')
    pre = m.data_preprocessor
    assert pre.mean == IMAGENET_NORM['mean'] and pre.std == IMAGENET_NORM['std'] and pre.bgr_to_rgb
    assert pre.pad_size_divisor == 32
    if kind == 'mask_rcnn':
        assert tuple(bb.out_indices) == (0, 1, 2, 3)
        assert list(m.neck.in_channels) == DIMS[size] and m.neck.num_outs == 5
        assert 'add_extra_convs' not in m.neck  # P6 by max pooling
    else:
        assert tuple(bb.out_indices) == (1, 2, 3)
        assert list(m.neck.in_channels) == DIMS[size][1:]
        assert m.neck.start_level == 0 and m.neck.add_extra_convs == 'on_input'
        assert m.neck.relu_before_extra_convs is True and m.neck.num_outs == 5

    ow = cfg.optim_wrapper
    assert ow.type == 'OptimWrapper'  # fp32, as the authors
    assert ow.optimizer == dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05)
    assert ow.paramwise_cfg == dict(norm_decay_mult=0.)
    if kind == 'mask_rcnn':
        assert ow.clip_grad == dict(max_norm=0.01, norm_type=2)
    else:
        assert ow.get('clip_grad') is None
    epochs, milestones = (12, [8, 11]) if sched == '1x' else (36, [27, 33])
    assert cfg.train_cfg.max_epochs == epochs
    warm, step = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.start_factor == 1e-3 and warm.by_epoch is False
    assert (warm.begin, warm.end) == (0, 1000)
    assert step.type == 'MultiStepLR' and step.by_epoch and step.gamma == 0.1
    assert list(step.milestones) == milestones and step.end == epochs
    assert cfg.train_dataloader.batch_size == 2
    assert cfg.auto_scale_lr == dict(enable=False, base_batch_size=16)

    types = [t['type'] for t in cfg.train_dataloader.dataset.pipeline]
    crop = ['RandomCrop'] if kind == 'mask_rcnn' else []
    assert types == ['LoadImageFromFile', 'LoadAnnotations', *crop, 'RandomChoiceResize', 'RandomFlip',
                     'PackDetInputs']
    pipe = {t['type']: t for t in cfg.train_dataloader.dataset.pipeline}
    lo = 640 if sched == '1x' else 480
    assert [tuple(s) for s in pipe['RandomChoiceResize']['scales']] == [(1333, s) for s in range(lo, 801, 32)]
    assert pipe['RandomChoiceResize']['keep_ratio'] and pipe['RandomFlip']['prob'] == 0.5
    if kind == 'mask_rcnn':
        c = pipe['RandomCrop']
        assert c['crop_type'] == 'relative' and tuple(c['crop_size']) == (0.9, 0.9)
        assert c['allow_negative_crop'] and c['recompute_bbox']
        assert pipe['LoadAnnotations']['with_mask']
    resize = [t for t in cfg.test_dataloader.dataset.pipeline if t['type'] == 'Resize']
    assert len(resize) == 1 and tuple(resize[0]['scale']) == (1333, 800) and resize[0]['keep_ratio']


@pytest.mark.parametrize('rel', list(SEG))
def test_seg_settings(rel):
    size = SEG[rel]
    cfg = load(rel)
    m = cfg.model
    assert m.type == 'EncoderDecoder'
    bb = m.backbone
    assert bb.drop_path_rate == pytest.approx(DET_DROP_PATH[size])
    assert tuple(bb.out_indices) == (0, 1, 2, 3) and bb.norm_in_path is False
    assert bb.init_cfg == dict(type='Pretrained', checkpoint=f'data/pretrained/rest_{ARCH[size]}.pth')
    pre = m.data_preprocessor
    assert tuple(pre.size) == (512, 512) and pre.test_cfg == dict(size_divisor=32)
    assert pre.mean == IMAGENET_NORM['mean'] and pre.std == IMAGENET_NORM['std'] and pre.bgr_to_rgb
    dh, ah = m.decode_head, m.auxiliary_head
    assert dh.type == 'UPerHead' and list(dh.in_channels) == DIMS[size] and dh.num_classes == 150
    assert dh.channels == 512 and tuple(dh.pool_scales) == (1, 2, 3, 6) and dh.dropout_ratio == 0.1
    assert ah.type == 'FCNHead' and ah.in_index == 2 and ah.in_channels == DIMS[size][2]
    assert ah.channels == 256 and ah.num_convs == 1 and ah.loss_decode.loss_weight == 0.4
    assert ah.num_classes == 150 and dh.norm_cfg.type == 'SyncBN'
    ow = cfg.optim_wrapper
    assert ow.type == 'OptimWrapper'
    assert ow.optimizer == dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01)
    assert ow.paramwise_cfg == dict(custom_keys={'norm': dict(decay_mult=0.)})
    warm, poly = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.start_factor == 1e-6 and (warm.begin, warm.end) == (0, 1500)
    assert poly.type == 'PolyLR' and poly.power == 1.0 and poly.eta_min == 0
    assert (poly.begin, poly.end) == (1500, 160000) and not poly.by_epoch
    assert cfg.train_cfg.max_iters == 160000 and cfg.train_dataloader.batch_size == 2
    types = [t['type'] for t in cfg.train_dataloader.dataset.pipeline]
    assert types == ['LoadImageFromFile', 'LoadAnnotations', 'RandomResize', 'RandomCrop', 'RandomFlip',
                     'PhotoMetricDistortion', 'PackSegInputs']


@pytest.mark.parametrize('rel', list(CLS))
def test_cls_settings(rel):
    size = CLS[rel]
    cfg = load(rel)
    m = cfg.model
    assert m.type == 'ImageClassifier'
    bb = m.backbone
    assert tuple(bb.out_indices) == (3, ) and bb.get('init_cfg') is None and 'out_norm_cfg' not in bb
    assert bb.drop_path_rate == pytest.approx(CLS_DROP_PATH[size])
    assert m.neck.type == 'GlobalAveragePooling'
    assert m.head.type == 'LinearClsHead' and m.head.num_classes == 1000 and m.head.in_channels == DIMS[size][3]
    assert m.head.loss == dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original')
    assert m.train_cfg.augments == [dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]
    ow = cfg.optim_wrapper
    opt = ow.optimizer
    assert opt.type == 'AdamW' and opt.lr == pytest.approx(2e-3) and opt.weight_decay == 0.05
    assert ow.paramwise_cfg == dict(norm_decay_mult=0., bias_decay_mult=0., flat_decay_mult=0.)
    assert ow.clip_grad == dict(max_norm=5.0)
    assert cfg.auto_scale_lr.base_batch_size == 2048 == 8 * cfg.train_dataloader.batch_size
    warm, cos = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.end == 5 and warm.by_epoch and warm.convert_to_iter_based
    assert cos.type == 'CosineAnnealingLR' and (cos.begin, cos.end) == (5, 300) and cos.eta_min == 1e-5
    assert cfg.train_cfg.max_epochs == 300
    tr = {t['type']: t for t in cfg.train_dataloader.dataset.pipeline}
    ra = tr['RandAugment']
    assert ra['magnitude_level'] == 9 and ra['magnitude_std'] == 0.5 and ra['policies'] == 'timm_increasing'
    assert tr['RandomErasing']['erase_prob'] == 0.25
    assert tr['RandomResizedCrop']['scale'] == 224 and tr['RandomResizedCrop']['interpolation'] == 'bicubic'
    te = {t['type']: t for t in cfg.val_dataloader.dataset.pipeline}
    assert te['ResizeEdge']['scale'] == 256 and te['CenterCrop']['crop_size'] == 224


# ---------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('rel', ALL)
def test_build_params_and_forward(rel):
    cfg, model = build_model(rel)
    bb = model.backbone
    size = size_of(rel)
    head = DIMS[size][3] * 1000 + 1000
    extra_norms = 2 * sum(DIMS[size][i] for i in bb.out_indices if i < 3)
    if rel in DET:
        kind = DET[rel][0]
        assert bb.out_channels == list(model.neck.in_channels)
        assert n_params(bb) == CLS_PARAMS[size] - head + extra_norms
        if (kind, size) in PAPER_PARAMS:
            assert round(n_params(model) / 1e6, 1) == PAPER_PARAMS[(kind, size)]
    elif rel in SEG:
        assert bb.out_channels == list(model.decode_head.in_channels)
        assert model.auxiliary_head.in_channels == bb.out_channels[2]
        assert n_params(bb) == CLS_PARAMS[size] - head + extra_norms
    else:
        assert n_params(model) == CLS_PARAMS[size]
        assert isinstance(bb.norm3, nn.LayerNorm) and bb.norm3.eps == 1e-5
    last = [m for m in bb.modules() if type(m).__name__ == 'DropPath'][-1]
    assert last.drop_prob == pytest.approx(cfg.model.backbone.drop_path_rate)
    if rel not in FORWARD:
        return
    model.eval()
    with torch.no_grad():
        if rel in DET:
            from mmdet.testing import demo_mm_inputs
            data = model.data_preprocessor(demo_mm_inputs(1, (3, 70, 90), with_mask=True), False)
            feats = model.extract_feat(data['inputs'])  # padded to 96 x 96
            strides = (4, 8, 16, 32, 64) if DET[rel][0] == 'mask_rcnn' else (8, 16, 32, 64, 128)
            assert [tuple(f.shape) for f in feats] == [(1, 256, -(-96 // s), -(-96 // s)) for s in strides]
            out = model(**data, mode='tensor')
            assert all(torch.isfinite(t).all() for t in torch.utils._pytree.tree_leaves(out))
        elif rel in SEG:
            out = model(torch.rand(1, 3, 64, 96) * 255, mode='tensor')
            assert tuple(out.shape) == (1, 150, 16, 24) and torch.isfinite(out).all()
        else:
            out = model(torch.rand(1, 3, 64, 64), mode='tensor')
            assert tuple(out.shape) == (1, 1000) and torch.isfinite(out).all()


def _is_norm(mod):
    return isinstance(mod, (nn.LayerNorm, nn.modules.batchnorm._BatchNorm, nn.GroupNorm))


@pytest.mark.parametrize('rel', ['mmdet/mask_rcnn_rest_lite_1x.py', 'mmseg/upernet_rest_s_512x512_160k_ade20k.py',
                                 'mmpretrain/rest_lite_in1k.py'])
def test_weight_decay_groups(rel):
    cfg, model = build_model(rel)
    ow = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    base_wd = cfg.optim_wrapper.optimizer.weight_decay
    wd = {id(p): g['weight_decay'] for g in ow.optimizer.param_groups for p in g['params']}
    named = dict(model.named_parameters())
    assert len(wd) == len(named)
    owner = {f'{mn}.{pn}' if mn else pn: mod for mn, mod in model.named_modules()
             for pn, _ in mod.named_parameters(recurse=False)}
    for name, p in named.items():
        if rel.startswith('mmpretrain'):
            want = 0. if p.ndim == 1 else base_wd
        elif rel.startswith('mmdet'):
            want = 0. if _is_norm(owner[name]) else base_wd  # every LN / BN, nothing else (biases decay)
        else:
            want = 0. if 'norm' in name else base_wd
        assert wd[id(p)] == pytest.approx(want), name
    bb = [n for n in named if n.startswith('backbone.')]
    assert any('sr_norm' in n for n in bb) and any('.norm.' in n for n in bb)  # LN after sr, patch-embed BNs
    assert all(wd[id(named[n])] == 0 for n in bb if 'sr_norm' in n or n.startswith('backbone.norm'))


# ---------------------------------------------------------------------------------------------------
# the detection train pipeline on a synthetic image
# ---------------------------------------------------------------------------------------------------
def test_mask_rcnn_train_pipeline_crops_then_resizes(tmp_path):
    img = np.random.RandomState(0).randint(0, 255, (480, 640, 3), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / 'img.jpg'), img)
    cfg = load('mmdet/mask_rcnn_rest_s_1x.py')
    registries(cfg)
    train = Compose(cfg.train_dataloader.dataset.pipeline)
    inst = [dict(bbox=[100, 100, 400, 300], bbox_label=3, ignore_flag=0,
                 mask=[[100, 100, 400, 100, 400, 300, 100, 300]])]
    np.random.seed(0)
    shorts, ratios = set(), set()
    for i in range(12):
        out = train(dict(img_path=str(tmp_path / 'img.jpg'), img_id=i, instances=copy.deepcopy(inst)))
        h, w = out['inputs'].shape[-2:]
        assert max(h, w) <= 1333
        shorts.add(min(h, w))
        ratios.add(round(w / h, 3))
        assert abs(w / h - 576 / 432) < 0.01  # a 0.9 x 0.9 crop of 480 x 640 keeps the 4:3 ratio
    assert shorts <= set(range(640, 801, 32)) and len(shorts) > 2, shorts


# ---------------------------------------------------------------------------------------------------
# one training iteration through tools/train.py on generated data
# ---------------------------------------------------------------------------------------------------
TINY_ARCH = f"arch=dict(_delete_=True, embed_dims={TINY_REST['embed_dims']}, depths=[1, 1, 1, 1], " \
            f"num_heads={TINY_REST['num_heads']})"
NO_EVAL = ('val_dataloader = None\nval_cfg = None\nval_evaluator = None\n'
           'test_dataloader = None\ntest_cfg = None\ntest_evaluator = None\n')

TRAIN_CASES = {
    'det': ('mmdet/mask_rcnn_rest_s_1x.py', f"""
data_root = 'data/demo/coco/'
metainfo = dict(classes=('circle', 'rectangle', 'triangle'))
model = dict(backbone=dict({TINY_ARCH}, init_cfg=None), neck=dict(in_channels={TINY_REST['embed_dims']}),
             roi_head=dict(bbox_head=dict(num_classes=3), mask_head=dict(num_classes=3)),
             train_cfg=dict(rcnn=dict(sampler=dict(num=32))))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomCrop', crop_type='relative', crop_size=(0.9, 0.9), allow_negative_crop=True,
         recompute_bbox=True),
    dict(type='RandomChoiceResize', scales=[(1333, 96), (1333, 128)], keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, metainfo=metainfo,
                                     ann_file='annotations/instances_train2017.json',
                                     data_prefix=dict(img='train2017/'), pipeline=train_pipeline))
train_cfg = dict(max_epochs=1)
"""),
    'seg': ('mmseg/upernet_rest_s_512x512_160k_ade20k.py', f"""
crop_size = (64, 64)
model = dict(data_preprocessor=dict(size=crop_size), backbone=dict({TINY_ARCH}, init_cfg=None),
             decode_head=dict(in_channels={TINY_REST['embed_dims']}, channels=32, num_classes=3,
                              norm_cfg=dict(type='BN', requires_grad=True)),
             auxiliary_head=dict(in_channels={TINY_REST['embed_dims'][2]}, channels=16, num_classes=3,
                                 norm_cfg=dict(type='BN', requires_grad=True)))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(128, 64), ratio_range=(0.75, 1.5), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PhotoMetricDistortion'),
    dict(type='PackSegInputs'),
]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(type='BaseSegDataset', data_root='data/demo/ade/ADEChallengeData2016',
                                     metainfo=dict(classes=('circle', 'rectangle', 'triangle')),
                                     img_suffix='.jpg', seg_map_suffix='.png', reduce_zero_label=True,
                                     data_prefix=dict(img_path='images/training',
                                                      seg_map_path='annotations/training'),
                                     pipeline=train_pipeline))
train_cfg = dict(max_iters=1)
"""),
    'cls': ('mmpretrain/rest_s_in1k.py', f"""
model = dict(backbone=dict({TINY_ARCH}), head=dict(in_channels={TINY_REST['embed_dims'][3]}, num_classes=5))
data_preprocessor = dict(num_classes=5)
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root='data/demo/imagenet',
                                     metainfo=dict(classes=('circle', 'rectangle', 'triangle', 'cross', 'star'))))
train_cfg = dict(max_epochs=1)
"""),
}


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp('rest_tools')
    r = subprocess.run([sys.executable, f'{ROOT}/tools/make_demo_data.py', '--out', str(d / 'data/demo'),
                        '--num-train', '2', '--num-val', '1', '--size', '64', '64'],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d


@pytest.mark.parametrize('case', list(TRAIN_CASES))
def test_one_training_iteration_with_tools_train(workdir, case):
    base, extra = TRAIN_CASES[case]
    cfg = workdir / f'{case}.py'
    cfg.write_text(f"_base_ = '{CFG_ROOT}/{base}'\n{extra}{NO_EVAL}"
                   "default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=1))\n")
    r = subprocess.run([sys.executable, f'{ROOT}/tools/train.py', str(cfg), '--work-dir', f'wd_{case}'],
                       cwd=workdir, capture_output=True, text=True, timeout=600)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-5000:]
    assert 'Iter(train) [1/1]' in log or 'Epoch(train) [1][1/1]' in log, log[-3000:]
    assert 'loss' in log and 'nan' not in log.split('Iter(train)' if case == 'seg' else 'Epoch(train)')[-1]
    ckpt = workdir / f'wd_{case}' / ('iter_1.pth' if case == 'seg' else 'epoch_1.pth')
    assert ckpt.is_file()
    sd = torch.load(ckpt, map_location='cpu', weights_only=True)['state_dict']
    assert 'backbone.layers.1.blocks.0.attn.transform_conv.weight' in sd
