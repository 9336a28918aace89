"""Every config under configs/mm{det,seg,pretrain} of the three families (H-ViT3 / ViT3, L2ViT, ResT): settings
against the authors' recipes (docs/hvit3.md, docs/l2vit.md, docs/rest.md: Recipes), model builds (pretrained init
disabled; a few for real with a forward, the others on the meta device: the same construction code without
allocating up to 100M weights) with the parameter counts measured on the authors' code, weight-decay groups, the
ImageNet lr curve, the train/test pipelines on a synthetic image, and real training (and testing) runs through
tools/train.py / tools/test.py on generated data."""
import copy
import functools
import json
import os.path as osp
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch
import torch.nn as nn
from mmengine.dataset import Compose
from mmengine.optim import build_optim_wrapper
from mmengine.registry import PARAM_SCHEDULERS, init_default_scope

from config_helpers import CFG_ROOT, load, registries
from conftest import ROOT, TINY_L2VIT, TINY_REST

ARCH = {'t': 'tiny', 's': 'small', 'b': 'base', 'lite': 'lite', 'l': 'large'}
DIMS = {
    'hvit3': {'t': [64, 128, 320, 512], 's': [64, 128, 320, 512], 'b': [96, 192, 448, 640]},
    'l2vit': {'t': [96, 192, 384, 768], 's': [96, 192, 384, 768], 'b': [128, 256, 512, 1024]},
    'rest': {'lite': [64, 128, 256, 512], 's': [64, 128, 256, 512], 'b': [96, 192, 384, 768],
             'l': [96, 192, 384, 768]},
}
SIZES = {'hvit3': 'tsb', 'l2vit': 'tsb', 'rest': ('lite', 's', 'b', 'l')}
BACKBONE = {'hvit3': 'HViT3', 'vit3': 'ViT3', 'l2vit': 'L2ViT', 'rest': 'ResT'}
CKPT = {'hvit3': 'H-ViTTT-{S}.pth', 'l2vit': 'L2ViT-{Arch}-checkpoint-best-ema.pth', 'rest': 'rest_{arch}.pth'}
# exact parameter counts measured on the authors' code (docs/*.md, Architecture): the classifiers, and the
# dense-prediction backbones with the four output norms (ResT's: the classifier without its head, plus norm0-2)
CLS_PARAMS = {'hvit3': {'t': 28_703_560, 's': 54_362_056, 'b': 94_369_304},
              'vit3': {'t': 6_149_416, 's': 23_799_400, 'b': 90_055_912},
              'l2vit': {'t': 28_596_781, 's': 50_199_157, 'b': 88_577_188},
              'rest': {'lite': 10_508_300, 's': 13_679_708, 'b': 30_327_052, 'l': 51_676_156}}
DENSE_PARAMS = {'hvit3': {'t': 28_191_584, 's': 53_850_080, 'b': 93_729_776},
                'l2vit': {'t': 27_829_125, 's': 49_431_501, 'b': 87_553_980},
                'rest': {s: CLS_PARAMS['rest'][s] - (d[3] * 1000 + 1000) + 2 * sum(d[:3])
                         for s, d in DIMS['rest'].items()}}
VIT3_DIM = {'t': 192, 's': 384, 'b': 768}
# ResT's full detectors, paper Tab. 3 / 4 (M parameters)
REST_PAPER = {('mask', 's'): 33.3, ('mask', 'b'): 49.8, ('retina', 's'): 23.4, ('retina', 'b'): 40.5,
              ('retina', 'l'): 61.8}
DROP_PATH = {  # (family, kind, schedule) -> size -> drop path rate
    ('hvit3', 'det', '1x'): dict(t=.1, s=.1, b=.1), ('hvit3', 'det', '3x'): dict(t=.3, s=.4, b=.6),
    ('hvit3', 'seg', ''): dict(t=.2, s=.4, b=.5), ('hvit3', 'cls', ''): dict(t=.2, s=.4, b=.6),
    ('vit3', 'cls', ''): dict(t=0., s=.1, b=.4),
    ('l2vit', 'det', '1x'): dict(t=.1, s=.1, b=.2), ('l2vit', 'det', '3x'): dict(t=.2, s=.2, b=.3),
    ('l2vit', 'seg', ''): dict(t=.3, s=.3, b=.3), ('l2vit', 'cls', ''): dict(t=.1, s=.3, b=.3),
    **{('rest', k, sch): dict(lite=.1, s=.1, b=.2, l=.2) for k, sch in (('det', '1x'), ('det', '3x'), ('seg', ''))},
    ('rest', 'cls', ''): dict(lite=.1, s=.1, b=.2, l=.3),
}
IMAGENET_NORM = dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375])
ADAMW = dict(type='AdamW', betas=(0.9, 0.999))
L2VIT_DET_OPTIM = dict(type='OptimWrapper', optimizer=dict(ADAMW, lr=1e-4, weight_decay=0.05), clip_grad=None)
REST_DET_OPTIM = dict(type='OptimWrapper', optimizer=dict(ADAMW, lr=1e-4, eps=1e-8, weight_decay=0.05),
                      paramwise_cfg=dict(norm_decay_mult=0.))
NORM_NO_DECAY = dict(custom_keys={'norm': dict(decay_mult=0.)})
DET_RECIPE = {  # optim_wrapper, warm-up iterations, evaluated only at the end, batch per GPU, base batch
    ('hvit3', 'mask'): (dict(type='AmpOptimWrapper', optimizer=dict(ADAMW, lr=2e-4, weight_decay=0.05),
                             paramwise_cfg=NORM_NO_DECAY), 1000, False, 4, 32),
    ('hvit3', 'retina'): (L2VIT_DET_OPTIM, 500, True, 2, 16),  # our settings: L2ViT's RetinaNet recipe
    ('l2vit', 'mask'): (L2VIT_DET_OPTIM, 500, True, 2, 16),
    ('l2vit', 'retina'): (L2VIT_DET_OPTIM, 500, True, 2, 16),
    ('rest', 'mask'): (dict(REST_DET_OPTIM, clip_grad=dict(max_norm=0.01, norm_type=2)), 1000, False, 2, 16),
    ('rest', 'retina'): (REST_DET_OPTIM, 1000, False, 2, 16),
}
SEG_OPTIM = dict(type='OptimWrapper', optimizer=dict(ADAMW, lr=6e-5, weight_decay=0.01))
CLS_RECIPE = {  # lr, batch per GPU, accumulation, clip, auto_scale_lr, (warm-up end, start factor), cosine min
    'hvit3': (5e-4, 128, 1, dict(max_norm=5.0), dict(enable=True, base_batch_size=512), (20, 1e-3),
              ('eta_min_ratio', 1e-2)),
    'l2vit': (4e-3, 128, 4, None, dict(enable=False, base_batch_size=4096), (20, 1e-6), ('eta_min', 1e-6)),
    'rest': (2e-3, 256, 1, dict(max_norm=5.0), dict(enable=False, base_batch_size=2048), (5, 1e-3),
             ('eta_min', 1e-5)),
}
MS = [(s, 1333) for s in range(480, 801, 32)]


def _specs():
    specs = {}
    for fam, sizes in SIZES.items():
        for s in sizes:
            for sch in ('1x', '3x'):
                for kind, name in (('mask', 'mask_rcnn'), ('retina', 'retinanet')):
                    specs[f'mmdet/{name}_{fam}_{s}_{sch}.py'] = (fam, fam, kind, s, sch)
            if s != 'lite':
                specs[f'mmseg/upernet_{fam}_{s}_512x512_160k_ade20k.py'] = (fam, fam, 'seg', s, '')
            for net in (fam, 'vit3') if fam == 'hvit3' else (fam, ):
                specs[f'mmpretrain/{net}_{s}_in1k.py'] = (fam, net, 'cls', s, '')
    return specs


SPECS = _specs()  # config -> (family, network, kind, size, schedule)
ALL = list(SPECS)
DET = [r for r in ALL if SPECS[r][2] in ('mask', 'retina')]
# built for real and run once; the others are built on the meta device
FORWARD = {r for r in ALL if SPECS[r][0] == 'hvit3' and SPECS[r][3] == 't'} | {
    'mmdet/mask_rcnn_l2vit_t_1x.py', 'mmdet/retinanet_l2vit_t_1x.py', 'mmseg/upernet_l2vit_t_512x512_160k_ade20k.py',
    'mmpretrain/l2vit_t_in1k.py', 'mmdet/mask_rcnn_rest_lite_1x.py', 'mmdet/retinanet_rest_lite_1x.py',
    'mmseg/upernet_rest_s_512x512_160k_ade20k.py', 'mmpretrain/rest_lite_in1k.py'}
# SyncBN (kept in some seg configs, as the authors) cannot run in a single CPU process
SEG_BN = {'model.decode_head.norm_cfg': dict(type='BN', requires_grad=True),
          'model.auxiliary_head.norm_cfg': dict(type='BN', requires_grad=True)}


#: the AMP variants (as mmdet's Swin `_amp` configs) -> the config they inherit
AMP = {f'{lib}/{name.format(amp="_amp")}': f'{lib}/{name.format(amp="")}'
       for fam, size in (('l2vit', 't'), ('rest', 's'))
       for lib, name in (('mmdet', f'mask_rcnn_{fam}_{size}{{amp}}_1x.py'),
                         ('mmdet', f'retinanet_{fam}_{size}{{amp}}_1x.py'),
                         ('mmseg', f'upernet_{fam}_{size}{{amp}}_512x512_160k_ade20k.py'))}


def test_every_config_is_covered():
    import glob
    found = {osp.relpath(p, CFG_ROOT) for d in ('mmdet', 'mmseg', 'mmpretrain')
             for p in glob.glob(f'{CFG_ROOT}/{d}/*.py')}
    assert found == set(ALL) | set(AMP), sorted(found ^ (set(ALL) | set(AMP)))


@pytest.mark.parametrize('rel', sorted(AMP))
def test_amp_config_is_its_base_under_amp(rel):
    """An `_amp` config is the config it inherits with mmengine's AmpOptimWrapper (dynamic loss scale, the
    autocast dtype left to mmengine: fp16 on CUDA) and nothing else changed."""
    amp, base = load(rel).to_dict(), load(AMP[rel]).to_dict()
    optim, base_optim = amp.pop('optim_wrapper'), base.pop('optim_wrapper')
    assert amp == base
    assert optim == dict(base_optim, type='AmpOptimWrapper', loss_scale='dynamic'), optim


ENV = dict(MMPLUGIN_L2_COCO='/d/coco', MMPLUGIN_L2_ADE='/d/ade', MMPLUGIN_L2_IMAGENET='/d/in',
           MMPLUGIN_L2_PRETRAINED='/w')


@pytest.mark.parametrize('env', [ENV, {}], ids=['set', 'unset'])
def test_paths_from_environment(env, monkeypatch, tmp_path):
    """MMPLUGIN_L2_{COCO,ADE,IMAGENET,PRETRAINED} set the data roots and the checkpoint folder (mmengine's
    `{{$NAME:default}}`), also through `mmplugin_l2::` inheritance; unset, the defaults data/coco, ...; the
    missing-data message names the variable."""
    from mmengine.config import Config

    from mmplugin_l2.apis.checks import DatasetNotFoundError, check_data, check_pretrained
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    coco, ade, imagenet, ckpt = (env.get(k, d) for k, d in zip(ENV, (
        'data/coco', 'data/ade/ADEChallengeData2016', 'data/imagenet', 'data/pretrained')))
    (tmp_path / 'mine.py').write_text("_base_ = 'mmplugin_l2::mmdet/mask_rcnn_rest_b_3x.py'\n")
    det = Config.fromfile(str(tmp_path / 'mine.py'))
    seg = Config.fromfile(osp.join(CFG_ROOT, 'mmseg/upernet_l2vit_s_512x512_160k_ade20k.py'))
    cls = Config.fromfile(osp.join(CFG_ROOT, 'mmpretrain/vit3_s_in1k.py'))
    for cfg, root in ((det, coco + '/'), (seg, ade), (cls, imagenet)):
        assert [cfg[n].dataset.data_root for n in ('train_dataloader', 'val_dataloader', 'test_dataloader')] == [
            root] * 3
    assert det.val_evaluator.ann_file == det.test_evaluator.ann_file == f'{coco}/annotations/instances_val2017.json'
    assert det.model.backbone.init_cfg.checkpoint == f'{ckpt}/rest_base.pth'
    assert seg.model.backbone.init_cfg.checkpoint == f'{ckpt}/L2ViT-Small-checkpoint-best-ema.pth'
    monkeypatch.chdir(tmp_path)  # no data/ here
    with pytest.raises(DatasetNotFoundError, match='MMPLUGIN_L2_COCO=/path/to/coco'):
        check_data(det, ['train_dataloader'])
    with pytest.raises(FileNotFoundError, match='MMPLUGIN_L2_PRETRAINED=/path/to/folder'):
        check_pretrained(seg)


@functools.lru_cache(maxsize=None)
def build_model(rel):
    kind = SPECS[rel][2]
    cfg = load(rel, SEG_BN if kind == 'seg' else {'model.test_cfg.rpn.max_per_img': 8} if kind == 'mask' else None)
    MODELS, _ = registries(cfg)
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None
    if cfg.get('data_preprocessor') is not None:  # as mmengine's Runner.build_model
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with torch.device('cpu' if rel in FORWARD else 'meta'):
        model = MODELS.build(model_cfg)
    return cfg, model


def n_params(module):
    return sum(p.numel() for p in module.parameters())


def plain(d):
    """A config dict without the `_scope_` keys mmengine adds to what comes from a `PACKAGE::` base."""
    return {k: plain(v) if isinstance(v, dict) else v for k, v in d.items() if k != '_scope_'}


def check_step_schedule(cfg, warm_end, epochs, milestones):
    warm, step = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.start_factor == 1e-3 and warm.by_epoch is False
    assert (warm.begin, warm.end) == (0, warm_end)
    assert step.type == 'MultiStepLR' and step.by_epoch and step.gamma == 0.1
    assert list(step.milestones) == milestones and step.end == epochs


# ---------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('rel', ALL)
def test_common(rel):
    fam, net, kind, size, sched = SPECS[rel]
    cfg = load(rel)
    assert cfg.custom_imports == dict(imports=['mmplugin_l2'], allow_failed_imports=False)
    assert cfg.default_scope == rel.split('/')[0]
    bb = cfg.model.backbone
    assert bb.type == BACKBONE[net] and bb.arch == ARCH[size]
    leaked = {'depth', 'embed_dims', 'img_size', 'window_size'} | ({'norm_eval'} if fam != 'rest' else set())
    assert not (leaked & set(bb)), 'keys of the base backbone leaked: missing _delete_'
    assert bool(bb.get('with_cp', False)) == (fam == 'hvit3' and kind in ('mask', 'retina'))
    assert bb.get('frozen_stages', -1) == -1
    group = 'det' if kind in ('mask', 'retina') else kind
    assert bb.drop_path_rate == pytest.approx(DROP_PATH[(net, group, sched)][size])
    assert tuple(bb.out_indices) == {'mask': (0, 1, 2, 3), 'seg': (0, 1, 2, 3), 'retina': (1, 2, 3),
                                     'cls': (-1, ) if net == 'vit3' else (3, )}[kind]
    if kind == 'cls':
        assert bb.get('init_cfg') is None
    else:
        ckpt = CKPT[fam].format(S=size.upper(), Arch=ARCH[size].capitalize(), arch=ARCH[size])
        assert bb.init_cfg == dict(type='Pretrained', checkpoint=f'data/pretrained/{ckpt}')


@pytest.mark.parametrize('rel', DET)
def test_det_settings(rel):
    fam, _, kind, size, sched = SPECS[rel]
    cfg = load(rel)
    m = cfg.model
    dims = DIMS[fam][size]
    assert m.type == {'mask': 'MaskRCNN', 'retina': 'RetinaNet'}[kind]
    pre = m.data_preprocessor
    assert pre.mean == IMAGENET_NORM['mean'] and pre.std == IMAGENET_NORM['std'] and pre.bgr_to_rgb
    assert pre.pad_size_divisor == 32 and pre.get('pad_mask', False) == (kind == 'mask')
    n = m.neck
    assert n.type == 'FPN' and n.num_outs == 5
    if kind == 'mask':
        assert list(n.in_channels) == dims and 'add_extra_convs' not in n  # P6 by max pooling
    else:  # stages 2-4, P6/P7 by convs on C5 (ResT: a ReLU before P7, as detectron2)
        assert list(n.in_channels) == dims[1:] and (n.start_level, n.add_extra_convs) == (0, 'on_input')
        assert n.get('relu_before_extra_convs', False) == (fam == 'rest')
    if fam == 'rest':
        bb = m.backbone
        assert bb.norm_eval is False and bb.norm_in_path is False

    optim, warm_end, eval_at_end, batch, base_batch = DET_RECIPE[(fam, kind)]
    assert plain(cfg.optim_wrapper) == optim
    epochs, milestones = (12, [8, 11]) if sched == '1x' else (36, [27, 33])
    assert cfg.train_cfg.max_epochs == epochs
    assert cfg.train_cfg.val_interval == (epochs if eval_at_end else 1)
    assert cfg.default_hooks.checkpoint.interval == (epochs if eval_at_end else 1)
    check_step_schedule(cfg, warm_end, epochs, milestones)
    assert cfg.train_dataloader.batch_size == batch
    assert cfg.auto_scale_lr == dict(enable=False, base_batch_size=base_batch)

    pipe = cfg.train_dataloader.dataset.pipeline
    assert pipe == cfg.train_pipeline
    assert pipe[1].type == 'LoadAnnotations' and pipe[1].get('with_mask', False) == (kind == 'mask')
    types = [t['type'] for t in pipe]
    if fam == 'rest':  # detectron2's: (Mask R-CNN: a relative 0.9 crop), short side 640..800 (3x: 480..800), flip
        crop = ['RandomCrop'] if kind == 'mask' else []
        assert types == ['LoadImageFromFile', 'LoadAnnotations', *crop, 'RandomChoiceResize', 'RandomFlip',
                         'PackDetInputs']
        t = {t['type']: t for t in pipe}
        lo = 640 if sched == '1x' else 480
        assert [tuple(s) for s in t['RandomChoiceResize']['scales']] == [(1333, s) for s in range(lo, 801, 32)]
        assert t['RandomChoiceResize']['keep_ratio'] and t['RandomFlip']['prob'] == 0.5
        if kind == 'mask':
            c = t['RandomCrop']
            assert c['crop_type'] == 'relative' and tuple(c['crop_size']) == (0.9, 0.9)
            assert c['allow_negative_crop'] and c['recompute_bbox']
    else:  # the multi-scale + crop augmentation, 1x and 3x alike
        assert types == ['LoadImageFromFile', 'LoadAnnotations', 'RandomFlip', 'RandomChoice', 'PackDetInputs']
        resize, crop = pipe[3]['transforms']
        assert [t['type'] for t in resize] == ['RandomChoiceResize'] and [tuple(s) for s in resize[0]['scales']] == MS
        assert resize[0]['keep_ratio']
        assert [t['type'] for t in crop] == ['RandomChoiceResize', 'RandomCrop', 'RandomChoiceResize']
        assert [tuple(s) for s in crop[0]['scales']] == [(400, 1333), (500, 1333), (600, 1333)]
        assert crop[1]['crop_type'] == 'absolute_range' and tuple(crop[1]['crop_size']) == (384, 600)
        assert crop[1]['allow_negative_crop'] is True and [tuple(s) for s in crop[2]['scales']] == MS
    resize = [t for t in cfg.test_dataloader.dataset.pipeline if t['type'] == 'Resize']
    assert len(resize) == 1 and tuple(resize[0]['scale']) == (1333, 800) and resize[0]['keep_ratio']
    if (fam, kind) == ('hvit3', 'retina'):  # our settings: the L2ViT RetinaNet recipe, and the config says so
        ref = load(f'mmdet/retinanet_l2vit_t_{sched}.py')
        for key in ('optim_wrapper', 'param_scheduler', 'train_pipeline', 'auto_scale_lr'):
            assert cfg[key] == ref[key], key  # both from the same bases
        assert 'our' in open(osp.join(CFG_ROOT, rel)).read().lower(), 'the config must say its settings are ours'


@pytest.mark.parametrize('rel', [r for r in ALL if SPECS[r][2] == 'seg'])
def test_seg_settings(rel):
    fam, _, _, size, _ = SPECS[rel]
    cfg = load(rel)
    m = cfg.model
    dims = DIMS[fam][size]
    assert m.type == 'EncoderDecoder' and m.test_cfg.mode == 'whole'
    pre = m.data_preprocessor
    assert tuple(pre.size) == (512, 512) and tuple(cfg.crop_size) == (512, 512)
    assert pre.mean == IMAGENET_NORM['mean'] and pre.std == IMAGENET_NORM['std'] and pre.bgr_to_rgb
    assert pre.get('test_cfg') == (dict(size_divisor=32) if fam == 'rest' else None)
    if fam == 'rest':
        assert m.backbone.norm_in_path is False
    dh, ah = m.decode_head, m.auxiliary_head
    assert dh.type == 'UPerHead' and list(dh.in_channels) == dims and dh.num_classes == 150
    assert dh.channels == 512 and tuple(dh.pool_scales) == (1, 2, 3, 6) and dh.dropout_ratio == 0.1
    assert ah.type == 'FCNHead' and ah.in_index == 2 and ah.in_channels == dims[2] and ah.num_classes == 150
    assert ah.channels == 256 and ah.num_convs == 1 and ah.loss_decode.loss_weight == 0.4
    # L2ViT: the authors' plain BN; the others keep SyncBN as the authors / mmseg's Swin (the model tests use BN)
    norm = dict(type='BN', requires_grad=True) if fam == 'l2vit' else dict(type='SyncBN', requires_grad=True)
    assert dh.norm_cfg == ah.norm_cfg == norm

    optim = {'hvit3': dict(SEG_OPTIM, paramwise_cfg=NORM_NO_DECAY), 'l2vit': dict(SEG_OPTIM, clip_grad=None),
             'rest': dict(SEG_OPTIM, paramwise_cfg=NORM_NO_DECAY)}[fam]
    if (fam, size) == ('hvit3', 't'):
        optim['type'] = 'AmpOptimWrapper'  # as the authors: fp16 for T only
    assert plain(cfg.optim_wrapper) == optim
    warm, poly = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.start_factor == 1e-6 and (warm.begin, warm.end) == (0, 1500)
    assert poly.type == 'PolyLR' and poly.power == 1.0 and poly.eta_min == 0
    assert (poly.begin, poly.end) == (1500, 160000) and not poly.by_epoch
    assert cfg.train_cfg.max_iters == 160000 and cfg.train_cfg.val_interval == 16000
    assert cfg.default_hooks.checkpoint.interval == (160000 if fam == 'l2vit' else 16000)
    assert cfg.train_dataloader.batch_size == 2 and cfg.val_dataloader.batch_size == 1
    assert [t['type'] for t in cfg.train_dataloader.dataset.pipeline] == [
        'LoadImageFromFile', 'LoadAnnotations', 'RandomResize', 'RandomCrop', 'RandomFlip', 'PhotoMetricDistortion',
        'PackSegInputs']


@pytest.mark.parametrize('rel', [r for r in ALL if SPECS[r][2] == 'cls'])
def test_cls_settings(rel):
    fam, net, _, size, _ = SPECS[rel]
    cfg = load(rel)
    m = cfg.model
    bb = m.backbone
    assert m.type == 'ImageClassifier' and m.neck.type == 'GlobalAveragePooling'
    assert m.head.type == 'LinearClsHead' and m.head.num_classes == 1000
    assert m.head.in_channels == (VIT3_DIM[size] if net == 'vit3' else DIMS[fam][size][-1])
    assert m.head.loss == dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original')
    assert m.train_cfg.augments == [dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]
    assert bb.get('out_norm_cfg') == (dict(type='BN') if net == 'hvit3' else None)
    assert bb.get('final_norm') == (True if fam == 'l2vit' else None)

    lr, batch, acc, clip, scale, (warm_end, warm_start), eta = CLS_RECIPE[fam]
    ow = cfg.optim_wrapper
    assert ow.get('type', 'OptimWrapper') == 'OptimWrapper'
    assert plain(ow.optimizer) == dict(
        ADAMW, lr=pytest.approx(lr), weight_decay=0.05, eps=1e-8)
    assert ow.paramwise_cfg == dict(norm_decay_mult=0., bias_decay_mult=0., flat_decay_mult=0.)
    assert ow.get('accumulative_counts', 1) == acc and ow.get('clip_grad') == clip
    assert cfg.train_dataloader.batch_size == batch and cfg.train_dataloader.drop_last
    assert cfg.auto_scale_lr == scale
    if not scale['enable']:  # the recipe's total batch: 8 GPUs x batch x accumulation
        assert scale['base_batch_size'] == 8 * batch * acc
    warm, cos = cfg.param_scheduler
    assert warm.type == 'LinearLR' and (warm.begin, warm.end) == (0, warm_end) and warm.by_epoch
    assert warm.start_factor == pytest.approx(warm_start)
    assert cos.type == 'CosineAnnealingLR' and (cos.begin, cos.end) == (warm_end, 300) and cos[eta[0]] == eta[1]
    assert warm.convert_to_iter_based and cos.convert_to_iter_based
    assert cfg.train_cfg.max_epochs == 300 and cfg.train_cfg.val_interval == 1
    ema = [h for h in cfg.get('custom_hooks', []) if h['type'] == 'EMAHook']
    if net == 'hvit3':  # the authors' main_ema.py: 0.9996 ** (total batch / 4096), 8 GPUs
        assert len(ema) == 1 and 1 - ema[0].momentum == pytest.approx(0.9996**(8 * batch / 4096))
    elif fam == 'l2vit':  # 0.9999 per optimizer step = every 4 accumulated iterations
        assert len(ema) == 1 and ema[0].momentum == pytest.approx(1e-4) and ema[0].interval == 4
        assert ema[0].update_buffers
    else:
        assert not ema

    tr = {t['type']: t for t in cfg.train_dataloader.dataset.pipeline}
    ra = tr['RandAugment']
    assert ra['magnitude_level'] == 9 and ra['magnitude_std'] == 0.5 and ra['num_policies'] == 2
    assert ra['policies'] == 'timm_increasing' and tr['RandomErasing']['erase_prob'] == 0.25
    assert tr['RandomResizedCrop']['interpolation'] == 'bicubic' and tr['RandomResizedCrop']['scale'] == 224
    te = {t['type']: t for t in cfg.val_dataloader.dataset.pipeline}
    assert te['ResizeEdge']['scale'] == 256 and te['ResizeEdge']['interpolation'] == 'bicubic'
    assert te['CenterCrop']['crop_size'] == 224


# ---------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('rel', ALL)
def test_build_and_forward(rel):
    fam, net, kind, size, _ = SPECS[rel]
    cfg, model = build_model(rel)
    bb = model.backbone
    assert type(bb).__name__ == cfg.model.backbone.type
    if kind == 'cls':
        assert bb.out_channels[-1] == model.head.fc.in_features
        assert n_params(model) == CLS_PARAMS[net][size]
        last = getattr(bb, f'norm{bb.out_indices[-1]}', None)
        assert isinstance(last, nn.BatchNorm2d) == (net == 'hvit3')
        if fam == 'rest':
            assert isinstance(bb.norm3, nn.LayerNorm) and bb.norm3.eps == 1e-5
        if fam == 'l2vit':
            assert bb.out_channels == [model.head.fc.in_features] and bb.final_norm
    else:
        assert bb.out_channels == list(model.decode_head.in_channels if kind == 'seg' else model.neck.in_channels)
        if kind == 'seg':
            assert model.auxiliary_head.in_channels == bb.out_channels[2]
        # RetinaNet has no norm0 (a LayerNorm of width dims[0]: 2 x dims[0] parameters)
        assert n_params(bb) == DENSE_PARAMS[fam][size] - (2 * DIMS[fam][size][0] if kind == 'retina' else 0)
        if fam == 'rest' and (kind, size) in REST_PAPER:
            assert round(n_params(model) / 1e6, 1) == REST_PAPER[(kind, size)]
    assert bb.with_cp == (fam == 'hvit3' and kind in ('mask', 'retina'))
    drops = [m.drop_prob for m in bb.modules() if type(m).__name__ == 'DropPath']
    dpr = cfg.model.backbone.drop_path_rate
    assert drops[-1] == pytest.approx(dpr) if dpr > 0 else not drops

    if rel not in FORWARD:
        return
    model.eval()
    with torch.no_grad():
        if kind in ('mask', 'retina'):
            from mmdet.testing import demo_mm_inputs
            data = model.data_preprocessor(demo_mm_inputs(1, (3, 70, 90), with_mask=kind == 'mask'), False)
            assert tuple(data['inputs'].shape[-2:]) == (96, 96)  # padded to 32
            strides = (4, 8, 16, 32, 64) if kind == 'mask' else (8, 16, 32, 64, 128)
            feats = model.extract_feat(data['inputs'])
            assert [tuple(f.shape) for f in feats] == [(1, 256, -(-96 // s), -(-96 // s)) for s in strides]
            out = model(**data, mode='tensor')
            if kind == 'mask':
                (cls_score, bbox_pred, mask_pred), = out  # ((roi_head outputs), )
                n = cls_score.shape[0]
                assert n > 0 and cls_score.shape[1] == 81 and bbox_pred.shape == (n, 320)
                assert tuple(mask_pred.shape) == (min(n, 100), 80, 28, 28)  # masks for the first 100 rois
            else:
                cls_scores, bbox_preds = out
                assert cls_scores[0].shape == (1, 9 * 80, 12, 12) and bbox_preds[0].shape == (1, 36, 12, 12)
            assert all(torch.isfinite(t).all() for t in torch.utils._pytree.tree_leaves(out))
            results = model(**data, mode='predict')
            assert len(results) == 1 and torch.isfinite(results[0].pred_instances.scores).all()
        elif kind == 'seg':
            out = model(torch.rand(1, 3, 64, 96) * 255, mode='tensor')
            assert tuple(out.shape) == (1, 150, 16, 24) and torch.isfinite(out).all()
        else:
            out = model(torch.rand(1, 3, 64, 64) * 255, mode='tensor')
            assert tuple(out.shape) == (1, 1000) and torch.isfinite(out).all()


def _is_norm(mod):
    return isinstance(mod, (nn.LayerNorm, nn.modules.batchnorm._BatchNorm, nn.GroupNorm))


@pytest.mark.parametrize('rel', [
    'mmdet/mask_rcnn_hvit3_t_1x.py', 'mmseg/upernet_hvit3_t_512x512_160k_ade20k.py',
    'mmseg/upernet_hvit3_s_512x512_160k_ade20k.py', 'mmpretrain/hvit3_t_in1k.py', 'mmpretrain/vit3_t_in1k.py',
    'mmdet/retinanet_l2vit_t_1x.py', 'mmseg/upernet_l2vit_t_512x512_160k_ade20k.py', 'mmpretrain/l2vit_t_in1k.py',
    'mmdet/mask_rcnn_rest_lite_1x.py', 'mmseg/upernet_rest_s_512x512_160k_ade20k.py', 'mmpretrain/rest_lite_in1k.py'])
def test_weight_decay_groups(rel):
    """Classifiers: no decay on 1-D parameters (norms, biases), decay on the rest (TTT w1/w2/w3, L2ViT's 3-D
    temperatures). Dense prediction: L2ViT decays everything (the authors have no paramwise_cfg); H-ViT3 and
    the ResT UperNet skip names containing 'norm'; ResT detection skips every LN / BN parameter."""
    fam, _, kind, _, _ = SPECS[rel]
    cfg, model = build_model(rel)
    ow_cfg = copy.deepcopy(cfg.optim_wrapper)
    if ow_cfg.get('type') == 'AmpOptimWrapper':
        ow_cfg.type = 'OptimWrapper'  # AmpOptimWrapper needs a GPU; the parameter groups are the same
    ow = build_optim_wrapper(model, ow_cfg)
    base_wd, base_lr = cfg.optim_wrapper.optimizer.weight_decay, cfg.optim_wrapper.optimizer.lr
    assert all(g['lr'] == pytest.approx(base_lr) for g in ow.optimizer.param_groups)
    wd = {id(p): g['weight_decay'] for g in ow.optimizer.param_groups for p in g['params']}
    named = dict(model.named_parameters())
    assert len(wd) == len(named)
    owner = {f'{mn}.{pn}' if mn else pn: mod for mn, mod in model.named_modules()
             for pn, _ in mod.named_parameters(recurse=False)}
    for name, p in named.items():
        if kind == 'cls':
            no_decay = p.ndim == 1
        elif fam == 'l2vit':
            no_decay = False
        elif fam == 'rest' and kind != 'seg':
            no_decay = _is_norm(owner[name])  # biases decay
        else:
            no_decay = 'norm' in name  # biases and w1/w2/w3 keep decay, as the authors
        assert wd[id(p)] == pytest.approx(0. if no_decay else base_wd), name
    decayed = {'hvit3': ('attn.w1', 'attn.w2', 'attn.w3'), 'l2vit': ('attn.temperature', ), 'rest': ()}[fam]
    ones = [n for n in named if n.endswith(decayed)] if decayed else []
    assert all(wd[id(named[n])] == pytest.approx(base_wd) for n in ones) and bool(ones) == bool(decayed)
    if fam == 'l2vit':
        assert len(ones) == 6
    if fam == 'rest':
        bb = [n for n in named if n.startswith('backbone.')]
        assert any('sr_norm' in n for n in bb) and any('.norm.' in n for n in bb)  # LN after sr, patch-embed BNs
        assert all(wd[id(named[n])] == 0 for n in bb if 'sr_norm' in n or n.startswith('backbone.norm'))
    if fam == 'hvit3' and kind != 'cls':
        norms = [n for n in named if n.startswith('backbone.norm') or '.norm1.' in n]
        assert norms and all(wd[id(named[n])] == 0 for n in norms)
        assert any(n.endswith('.bias') and wd[id(p)] == base_wd for n, p in named.items())


@pytest.mark.parametrize('rel', ['mmpretrain/hvit3_t_in1k.py', 'mmpretrain/vit3_b_in1k.py'])
@pytest.mark.parametrize('total_batch', [512, 1024])
def test_cls_lr_curve(rel, total_batch):
    """H-ViT3 / ViT3: warm-up 20 epochs from 1e-3 x lr, cosine to 1e-2 x lr at epoch 300, per iteration; lr (and
    with it the warm-up and minimum lr) scaled by total_batch / 512 as mmengine's auto_scale_lr does."""
    cfg = load(rel)
    init_default_scope(cfg.default_scope)
    ow_cfg = copy.deepcopy(cfg.optim_wrapper)
    ow_cfg.optimizer.lr *= total_batch / cfg.auto_scale_lr.base_batch_size  # Runner.scale_lr
    ow = build_optim_wrapper(nn.Linear(2, 2), ow_cfg)
    ep_len = 4
    scheds = [PARAM_SCHEDULERS.build(copy.deepcopy(s), default_args=dict(optimizer=ow, epoch_length=ep_len))
              for s in cfg.param_scheduler]
    lrs = []
    for _ in range(300 * ep_len):
        lrs.append(ow.get_lr()['lr'][0])
        for s in scheds:
            s.step()
    lrs.append(ow.get_lr()['lr'][0])
    lr = 5e-4 * total_batch / 512
    assert lrs[0] == pytest.approx(lr * 1e-3)
    # linear warm-up (mmengine's LinearLR reaches the lr one iteration before `end`: rel tolerance)
    assert lrs[10 * ep_len] == pytest.approx(lr * (1e-3 + (1 - 1e-3) * 0.5), rel=2e-2)
    assert lrs[20 * ep_len] == pytest.approx(lr)
    assert lrs[160 * ep_len] == pytest.approx(lr * 1e-2 + (lr - lr * 1e-2) * 0.5, rel=1e-6)  # mid-cosine
    assert lrs[-1] == pytest.approx(lr * 1e-2, rel=1e-3)  # last iteration, just above the minimum
    assert all(a <= b + 1e-15 for a, b in zip(lrs[:20 * ep_len], lrs[1:20 * ep_len + 1]))
    assert all(a >= b - 1e-15 for a, b in zip(lrs[20 * ep_len:-1], lrs[20 * ep_len + 1:]))


# ---------------------------------------------------------------------------------------------------
# pipelines (run on a synthetic 640 x 480 image)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def sample_files(tmp_path_factory):
    d = tmp_path_factory.mktemp('config_data')
    rng = np.random.RandomState(0)
    cv2.imwrite(str(d / 'img.jpg'), rng.randint(0, 255, (480, 640, 3), dtype=np.uint8))
    cv2.imwrite(str(d / 'seg.png'), rng.randint(0, 151, (480, 640), dtype=np.uint8))
    return str(d / 'img.jpg'), str(d / 'seg.png')


@pytest.mark.parametrize('rel', ['mmdet/mask_rcnn_hvit3_t_1x.py', 'mmdet/retinanet_l2vit_t_1x.py',
                                 'mmdet/mask_rcnn_rest_s_1x.py'])
def test_det_pipelines(rel, sample_files):
    """Multi-scale + crop: short sides 480..800 and crops of other aspect ratios. ResT: a 0.9 x 0.9 crop (the
    4:3 ratio kept), then short sides 640..800. Test: 800 x 1067, padded to 800 x 1088."""
    cfg = load(rel)
    MODELS, _ = registries(cfg)
    train = Compose(cfg.train_dataloader.dataset.pipeline)
    inst = [dict(bbox=[100, 100, 400, 300], bbox_label=3, ignore_flag=0,
                 mask=[[100, 100, 400, 100, 400, 300, 100, 300]])]
    np.random.seed(0)
    shorts, ratios = set(), set()
    for i in range(16):
        out = train(dict(img_path=sample_files[0], img_id=i, instances=copy.deepcopy(inst)))
        h, w = out['inputs'].shape[-2:]
        assert max(h, w) <= 1333
        shorts.add(min(h, w))
        ratios.add(round(w / h, 2))
    if SPECS[rel][0] == 'rest':
        assert shorts <= set(range(640, 801, 32)) and len(shorts) > 2, shorts
        assert ratios == {round(576 / 432, 2)}, ratios
    else:
        assert shorts <= set(range(480, 801, 32)), shorts
        assert len(ratios) > 1, 'the crop branch never ran'
    out = Compose(cfg.test_dataloader.dataset.pipeline)(
        dict(img_path=sample_files[0], img_id=0, instances=copy.deepcopy(inst)))
    assert tuple(out['inputs'].shape[-2:]) == (800, 1067)
    pre = MODELS.build(cfg.model.data_preprocessor)
    batch = pre(dict(inputs=[out['inputs']], data_samples=[out['data_samples']]), False)
    assert tuple(batch['inputs'].shape) == (1, 3, 800, 1088)


def test_seg_pipeline(sample_files):
    cfg = load('mmseg/upernet_hvit3_t_512x512_160k_ade20k.py')
    MODELS, _ = registries(cfg)
    train = Compose(cfg.train_dataloader.dataset.pipeline)
    np.random.seed(0)
    out = train(dict(img_path=sample_files[0], seg_map_path=sample_files[1], reduce_zero_label=True,
                     seg_fields=[]))
    h, w = out['inputs'].shape[-2:]
    assert h <= 512 and w <= 512
    seg = out['data_samples'].gt_sem_seg.data
    assert seg.max() <= 255 and ((seg < 150) | (seg == 255)).all()  # reduce_zero_label
    pre = MODELS.build(cfg.model.data_preprocessor)
    batch = pre(dict(inputs=[out['inputs']], data_samples=[out['data_samples']]), True)
    assert tuple(batch['inputs'].shape) == (1, 3, 512, 512)


@pytest.mark.parametrize('rel', ['mmpretrain/hvit3_t_in1k.py', 'mmpretrain/vit3_t_in1k.py'])
def test_cls_pipelines(rel, sample_files):
    cfg = load(rel)
    MODELS, _ = registries(cfg)
    train = Compose(cfg.train_dataloader.dataset.pipeline)
    test = Compose(cfg.val_dataloader.dataset.pipeline)
    np.random.seed(0)
    outs = [train(dict(img_path=sample_files[0], gt_label=k)) for k in (1, 7)]
    assert all(tuple(o['inputs'].shape) == (3, 224, 224) for o in outs)
    assert tuple(test(dict(img_path=sample_files[0], gt_label=1))['inputs'].shape) == (3, 224, 224)
    # data preprocessor with Mixup/CutMix: soft targets over 1000 classes, label smoothing done in the loss
    pre_cfg = copy.deepcopy(cfg.data_preprocessor)
    pre_cfg.setdefault('type', 'ClsDataPreprocessor')
    pre_cfg['batch_augments'] = cfg.model.train_cfg
    pre = MODELS.build(pre_cfg)
    torch.manual_seed(0)
    batch = pre(dict(inputs=[o['inputs'] for o in outs], data_samples=[o['data_samples'] for o in outs]),
                True)
    assert tuple(batch['inputs'].shape) == (2, 3, 224, 224)
    score = batch['data_samples'][0].gt_score
    assert tuple(score.shape) == (1000, ) and score.sum() == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------
# tools/train.py (and tools/test.py) on generated data, narrow backbones
# ---------------------------------------------------------------------------------------------------
def tiny(arch, depths=None):
    depths = arch['depths'] if depths is None else depths
    return (f"backbone=dict(arch=dict(_delete_=True, embed_dims={arch['embed_dims']}, depths={depths}, "
            f"num_heads={arch['num_heads']}), init_cfg=None, drop_path_rate=0.1)")


L2_BB, REST_BB, REST_DIMS = tiny(TINY_L2VIT), tiny(TINY_REST, [1, 1, 1, 1]), TINY_REST['embed_dims']
LOADER = "dict(batch_size={b}, num_workers=0, persistent_workers=False, dataset=dict({ds}))"
COCO = ("data_root = 'data/demo/coco/'\nmetainfo = dict(classes=('circle', 'rectangle', 'triangle'))\n"
        "train_dataloader = " + LOADER.format(b=2, ds="data_root=data_root, metainfo=metainfo, pipeline=_train, "
                                              "ann_file='annotations/instances_train2017.json', "
                                              "data_prefix=dict(img='train2017/')") + "\n"
        "val_dataloader = " + LOADER.format(b=2, ds="data_root=data_root, metainfo=metainfo, pipeline=_test, "
                                            "ann_file='annotations/instances_val2017.json', "
                                            "data_prefix=dict(img='val2017/')") + "\n"
        "val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')\n"
        "test_dataloader = val_dataloader\ntest_evaluator = val_evaluator\n")
COCO_TEST = ("_test = [dict(type='LoadImageFromFile'), dict(type='Resize', scale=(64, 64), keep_ratio=True),\n"
             "         dict(type='LoadAnnotations', with_bbox=True), dict(type='PackDetInputs',\n"
             "         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]\n")
ADE = ("_ds = dict(type='BaseSegDataset', data_root='data/demo/ade/ADEChallengeData2016', img_suffix='.jpg',\n"
       "           seg_map_suffix='.png', reduce_zero_label=True,\n"
       "           metainfo=dict(classes=('circle', 'rectangle', 'triangle')))\n"
       "train_dataloader = " + LOADER.format(b=2, ds="_ds, pipeline=_train, data_prefix=dict("
                                             "img_path='images/training', seg_map_path='annotations/training')") + "\n"
       "val_dataloader = " + LOADER.format(b=1, ds="_ds, pipeline=_test, data_prefix=dict("
                                           "img_path='images/validation', seg_map_path='annotations/validation')")
       + "\ntest_dataloader = val_dataloader\n"
       "train_cfg = dict(type='IterBasedTrainLoop', max_iters=1, val_interval=1)\n")
SEG_TEST = ("_test = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', reduce_zero_label=True),\n"
            "         dict(type='PackSegInputs')]\n")
IN1K = ("data_preprocessor = dict(num_classes=5)\n"
        "_test = [dict(type='LoadImageFromFile'), dict(type='CenterCrop', crop_size=64), dict(type='PackInputs')]\n"
        "_ds = dict(data_root='data/demo/imagenet', metainfo=dict(classes=('circle', 'rectangle', 'triangle', "
        "'cross', 'star')))\n"
        "train_dataloader = " + LOADER.format(b=2, ds="_ds, split='train', pipeline=_train") + "\n"
        "val_dataloader = " + LOADER.format(b=4, ds="_ds, split='val', pipeline=_test") + "\n"
        "val_evaluator = dict(type='Accuracy', topk=(1, ))\ntest_dataloader = val_dataloader\n"
        "test_evaluator = val_evaluator\ntrain_cfg = dict(max_epochs=1, val_interval=1)\n")
NO_EVAL = ('val_dataloader = None\nval_cfg = None\nval_evaluator = None\n'
           'test_dataloader = None\ntest_cfg = None\ntest_evaluator = None\n')
EPOCH_1 = "train_cfg = dict(max_epochs=1, val_interval=1)\n"
# case -> (base config, config body, tested too, the log line of the first iteration)
TOOL_CASES = {
    'l2vit-retinanet': ('mmdet/retinanet_l2vit_t_1x.py', (
        f"model = dict({L2_BB}, neck=dict(in_channels=[32, 64, 64]), bbox_head=dict(num_classes=3),\n"
        "             test_cfg=dict(score_thr=0.))  # an untrained detector: keep its boxes for the COCO metric\n"
        "_train = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True),\n"
        "          dict(type='RandomFlip', prob=0.5), dict(type='Resize', scale=(64, 64), keep_ratio=True),\n"
        "          dict(type='PackDetInputs')]\n" + COCO_TEST + COCO + EPOCH_1), 'coco/bbox_mAP'),
    'l2vit-upernet': ('mmseg/upernet_l2vit_t_512x512_160k_ade20k.py', (
        f"model = dict(data_preprocessor=dict(size=(64, 64)), {L2_BB},\n"
        f"             decode_head=dict(in_channels={TINY_L2VIT['embed_dims']}, channels=32, num_classes=3),\n"
        "             auxiliary_head=dict(in_channels=64, channels=16, num_classes=3))\n"
        "_train = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', reduce_zero_label=True),\n"
        "          dict(type='RandomFlip', prob=0.5), dict(type='PackSegInputs')]\n" + SEG_TEST + ADE), 'mIoU'),
    # one accumulation cycle of the recipe (accumulative_counts=4 steps at the last iteration), with EMA
    'l2vit-classifier': ('mmpretrain/l2vit_t_in1k.py', (
        f"model = dict({L2_BB}, head=dict(num_classes=5, in_channels=64), train_cfg=dict(augments=None))\n"
        "_train = [dict(type='LoadImageFromFile'), dict(type='RandomResizedCrop', scale=64, backend='pillow'),\n"
        "          dict(type='PackInputs')]\n" + IN1K), None),
    # the recipe's own train pipelines (crop + resize; photometric distortion; RandAugment), no evaluation
    'rest-mask-rcnn': ('mmdet/mask_rcnn_rest_s_1x.py', (
        f"model = dict({REST_BB}, neck=dict(in_channels={REST_DIMS}),\n"
        "             roi_head=dict(bbox_head=dict(num_classes=3), mask_head=dict(num_classes=3)),\n"
        "             train_cfg=dict(rcnn=dict(sampler=dict(num=32))))\n"
        "_train = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True, with_mask=True),\n"
        "          dict(type='RandomCrop', crop_type='relative', crop_size=(0.9, 0.9), allow_negative_crop=True,\n"
        "               recompute_bbox=True),\n"
        "          dict(type='RandomChoiceResize', scales=[(1333, 96), (1333, 128)], keep_ratio=True),\n"
        "          dict(type='RandomFlip', prob=0.5), dict(type='PackDetInputs')]\n_test = None\n"
        + COCO + EPOCH_1 + NO_EVAL), None),
    'rest-upernet': ('mmseg/upernet_rest_s_512x512_160k_ade20k.py', (
        "crop_size = (64, 64)\n"
        f"model = dict(data_preprocessor=dict(size=crop_size), {REST_BB},\n"
        f"             decode_head=dict(in_channels={REST_DIMS}, channels=32, num_classes=3,\n"
        "                              norm_cfg=dict(type='BN', requires_grad=True)),\n"
        f"             auxiliary_head=dict(in_channels={REST_DIMS[2]}, channels=16, num_classes=3,\n"
        "                                 norm_cfg=dict(type='BN', requires_grad=True)))\n"
        "_train = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', reduce_zero_label=True),\n"
        "          dict(type='RandomResize', scale=(128, 64), ratio_range=(0.75, 1.5), keep_ratio=True),\n"
        "          dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),\n"
        "          dict(type='RandomFlip', prob=0.5),\n"
        "          dict(type='PhotoMetricDistortion'), dict(type='PackSegInputs')]\n_test = None\n"
        + ADE + NO_EVAL), None),
    'rest-classifier': ('mmpretrain/rest_s_in1k.py', (
        f"model = dict({REST_BB}, head=dict(in_channels={REST_DIMS[3]}, num_classes=5))\n"
        "_train = {{_base_.train_pipeline}}  # the recipe's RandAugment pipeline\n"
        + IN1K + NO_EVAL), None),
}


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    """A working directory holding data/demo (2 train / 2 val images per task, 64 x 64)."""
    d = tmp_path_factory.mktemp('config_tools')
    r = subprocess.run([sys.executable, f'{ROOT}/tools/make_demo_data.py', '--out', str(d / 'data/demo'),
                        '--num-train', '2', '--num-val', '2', '--size', '64', '64'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d


def run_tool(workdir, tool, *args):
    cmd = [sys.executable, f'{ROOT}/tools/{tool}', *map(str, args)]
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f'{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}'
    return r.stdout + r.stderr


@pytest.mark.parametrize('case', list(TOOL_CASES))
def test_tools_train(workdir, case):
    base, body, metric = TOOL_CASES[case]
    cfg = workdir / f'{case}.py'
    cfg.write_text(f"_base_ = '{CFG_ROOT}/{base}'\n{body}"
                   "default_hooks = dict(checkpoint=dict(interval=1), logger=dict(interval=1))\n")
    log = run_tool(workdir, 'train.py', cfg, '--work-dir', f'wd_{case}')
    seg = 'upernet' in case
    assert ('Iter(train) [1/1]' if seg else 'Epoch(train) [1][1/') in log, log[-3000:]
    assert 'loss' in log
    if case.startswith('rest'):  # no evaluation: nothing after the last training line may read nan
        assert 'nan' not in log.split('Iter(train)' if seg else 'Epoch(train)')[-1]
    ckpt = workdir / f'wd_{case}' / ('iter_1.pth' if seg else 'epoch_1.pth')
    sd = torch.load(ckpt, map_location='cpu', weights_only=True)
    if case == 'l2vit-classifier':
        assert 'ema_state_dict' in sd and 'accuracy/top1' in log, sorted(sd)
    if case.startswith('rest'):
        assert 'backbone.layers.1.blocks.0.attn.transform_conv.weight' in sd['state_dict']
    if metric:
        log = run_tool(workdir, 'test.py', cfg, ckpt, '--work-dir', f'wd_{case}_test', '--out', f'{case}.json')
        value = json.loads((workdir / f'{case}.json').read_text())[metric]
        assert 0.0 <= value <= (100.0 if metric == 'mIoU' else 1.0) and metric in log
