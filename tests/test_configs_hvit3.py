"""The H-ViT3 / ViT3 configs under configs/: their settings against the authors' recipes
(docs/hvit3.md (Recipes)), model builds (pretrained init disabled), one tensor-mode forward
per T config, optimiser parameter groups, the ImageNet lr curve and the train/test pipelines."""
import copy
import functools

import cv2
import numpy as np
import pytest
import torch
import torch.nn as nn
from mmengine.dataset import Compose
from mmengine.optim import build_optim_wrapper
from mmengine.registry import PARAM_SCHEDULERS, init_default_scope

import os.path as osp

from config_helpers import CFG_ROOT, load, registries

HVIT3_DIMS = {'t': [64, 128, 320, 512], 's': [64, 128, 320, 512], 'b': [96, 192, 448, 640]}
ARCH = {'t': 'tiny', 's': 'small', 'b': 'base'}
# exact parameter counts measured on the authors' code (docs/hvit3.md, Architecture): dense-prediction backbone
# (with the four output LayerNorms) and the full classifiers
DET_BACKBONE_PARAMS = {'t': 28_191_584, 's': 53_850_080, 'b': 93_729_776}
HVIT3_CLS_PARAMS = {'t': 28_703_560, 's': 54_362_056, 'b': 94_369_304}
VIT3_CLS_PARAMS = {'t': 6_149_416, 's': 23_799_400, 'b': 90_055_912}
VIT3_DIM = {'t': 192, 's': 384, 'b': 768}

DET = {f'mmdet/mask_rcnn_hvit3_{s}_{k}.py': (s, k) for k in ('1x', '3x') for s in 'tsb'}
# RetinaNet: our settings (the authors publish none), L2ViT's RetinaNet recipe (docs/hvit3.md, Recipes)
RETINA = {f'mmdet/retinanet_hvit3_{s}_{k}.py': (s, k) for k in ('1x', '3x') for s in 'tsb'}
SEG = {f'mmseg/upernet_hvit3_{s}_512x512_160k_ade20k.py': s for s in 'tsb'}
CLS = {f'mmpretrain/{net}_{s}_in1k.py': (net, s) for net in ('hvit3', 'vit3') for s in 'tsb'}
ALL = [*DET, *SEG, *CLS]  # RETINA has its own tests below

# SyncBN (kept in the seg configs, as the authors) cannot run in a single CPU process
SEG_BN = {'model.decode_head.norm_cfg': dict(type='BN', requires_grad=True),
          'model.auxiliary_head.norm_cfg': dict(type='BN', requires_grad=True)}


def size_of(rel):
    if rel in RETINA:
        return RETINA[rel][0]
    return SEG[rel] if rel in SEG else (DET[rel][0] if rel in DET else CLS[rel][1])


# few RPN proposals in the Mask R-CNN forward test (the mask head runs on up to 100 RoIs otherwise)
DET_FAST = {'model.test_cfg.rpn.max_per_img': 8}


@functools.lru_cache(maxsize=None)
def build_model(rel):
    """The config's model with the backbone's Pretrained init disabled (seg heads on BN, not SyncBN).
    T models are built for real (they run forwards); S/B models on the meta device: the same
    construction code, without allocating and initialising ~100M weights on a busy 2-core CPU."""
    cfg = load(rel, SEG_BN if rel in SEG else DET_FAST if rel in DET else None)
    MODELS, _ = registries(cfg)
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None
    if cfg.get('data_preprocessor') is not None:  # as mmengine's Runner.build_model
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with torch.device('cpu' if size_of(rel) == 't' else 'meta'):
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
    assert cfg.model.backbone.type in ('HViT3', 'ViT3')


@pytest.mark.parametrize('rel', list(DET))
def test_det_settings(rel):
    size, sched = DET[rel]
    cfg = load(rel)
    m = cfg.model
    assert m.type == 'MaskRCNN'
    bb = m.backbone
    assert bb.type == 'HViT3' and bb.arch == ARCH[size]
    assert 'depth' not in bb and 'norm_eval' not in bb, 'ResNet keys leaked: missing _delete_'
    assert bb.with_cp is True
    assert tuple(bb.out_indices) == (0, 1, 2, 3)
    assert bb.drop_path_rate == pytest.approx(0.1 if sched == '1x' else {'t': .3, 's': .4, 'b': .6}[size])
    assert bb.init_cfg == dict(type='Pretrained',
                               checkpoint=f'data/pretrained/H-ViTTT-{size.upper()}.pth')
    assert m.neck.type == 'FPN' and list(m.neck.in_channels) == HVIT3_DIMS[size]

    ow = cfg.optim_wrapper
    assert ow.type == 'AmpOptimWrapper' and 'clip_grad' not in ow
    assert ow.optimizer == dict(type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.05)
    assert ow.paramwise_cfg == dict(custom_keys={'norm': dict(decay_mult=0.)})

    epochs, milestones = (12, [8, 11]) if sched == '1x' else (36, [27, 33])
    assert cfg.train_cfg.max_epochs == epochs
    warm, step = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.start_factor == 1e-3 and warm.by_epoch is False
    assert (warm.begin, warm.end) == (0, 1000)
    assert step.type == 'MultiStepLR' and step.by_epoch and step.gamma == 0.1
    assert list(step.milestones) == milestones and step.end == epochs

    assert cfg.train_dataloader.batch_size == 4
    assert cfg.auto_scale_lr == dict(enable=False, base_batch_size=32)

    # multi-scale + crop augmentation for 1x and 3x alike
    types = [t['type'] for t in cfg.train_pipeline]
    assert types == ['LoadImageFromFile', 'LoadAnnotations', 'RandomFlip', 'RandomChoice', 'PackDetInputs']
    assert cfg.train_dataloader.dataset.pipeline == cfg.train_pipeline
    ms = [(s, 1333) for s in range(480, 801, 32)]
    plain, crop = cfg.train_pipeline[3]['transforms']
    assert [t['type'] for t in plain] == ['RandomChoiceResize']
    assert [tuple(s) for s in plain[0]['scales']] == ms and plain[0]['keep_ratio']
    assert [t['type'] for t in crop] == ['RandomChoiceResize', 'RandomCrop', 'RandomChoiceResize']
    assert [tuple(s) for s in crop[0]['scales']] == [(400, 1333), (500, 1333), (600, 1333)]
    assert crop[1]['crop_type'] == 'absolute_range' and tuple(crop[1]['crop_size']) == (384, 600)
    assert crop[1]['allow_negative_crop'] is True
    assert [tuple(s) for s in crop[2]['scales']] == ms
    resize = [t for t in cfg.test_dataloader.dataset.pipeline if t['type'] == 'Resize']
    assert len(resize) == 1 and tuple(resize[0]['scale']) == (1333, 800) and resize[0]['keep_ratio']


@pytest.mark.parametrize('rel', list(SEG))
def test_seg_settings(rel):
    size = SEG[rel]
    cfg = load(rel)
    m = cfg.model
    assert m.type == 'EncoderDecoder'
    bb = m.backbone
    assert bb.type == 'HViT3' and bb.arch == ARCH[size]
    assert 'window_size' not in bb, 'Swin keys leaked: missing _delete_'
    assert not bb.get('with_cp', False)
    assert bb.drop_path_rate == pytest.approx({'t': .2, 's': .4, 'b': .5}[size])
    assert bb.init_cfg == dict(type='Pretrained',
                               checkpoint=f'data/pretrained/H-ViTTT-{size.upper()}.pth')
    assert tuple(m.data_preprocessor.size) == (512, 512) and tuple(cfg.crop_size) == (512, 512)
    dh, ah = m.decode_head, m.auxiliary_head
    assert dh.type == 'UPerHead' and list(dh.in_channels) == HVIT3_DIMS[size] and dh.num_classes == 150
    assert ah.type == 'FCNHead' and ah.in_index == 2 and ah.num_classes == 150
    assert ah.in_channels == {'t': 320, 's': 320, 'b': 448}[size] == HVIT3_DIMS[size][2]
    # SyncBN kept as the authors (the model tests override it)
    assert dh.norm_cfg.type == 'SyncBN' and ah.norm_cfg.type == 'SyncBN'

    ow = cfg.optim_wrapper
    assert ow.type == ('AmpOptimWrapper' if size == 't' else 'OptimWrapper')
    assert ow.optimizer == dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01)
    assert ow.paramwise_cfg == dict(custom_keys={'norm': dict(decay_mult=0.)})
    assert 'momentum' not in ow.optimizer, 'SGD keys leaked'
    warm, poly = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.start_factor == 1e-6 and (warm.begin, warm.end) == (0, 1500)
    assert poly.type == 'PolyLR' and poly.power == 1.0 and poly.eta_min == 0
    assert (poly.begin, poly.end) == (1500, 160000) and not poly.by_epoch
    assert cfg.train_cfg.max_iters == 160000
    assert cfg.train_dataloader.batch_size == 2


@pytest.mark.parametrize('rel', list(CLS))
def test_cls_settings(rel):
    net, size = CLS[rel]
    cfg = load(rel)
    m = cfg.model
    assert m.type == 'ImageClassifier'
    bb = m.backbone
    assert 'embed_dims' not in bb and 'img_size' not in bb, 'Swin keys leaked: missing _delete_'
    assert bb.get('init_cfg') is None
    assert m.neck.type == 'GlobalAveragePooling'
    assert m.head.type == 'LinearClsHead' and m.head.num_classes == 1000
    assert m.head.loss == dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original')
    assert m.train_cfg.augments == [dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]
    if net == 'hvit3':
        assert bb.type == 'HViT3' and bb.arch == ARCH[size]
        assert tuple(bb.out_indices) == (3, ) and bb.out_norm_cfg == dict(type='BN')
        assert bb.drop_path_rate == pytest.approx({'t': .2, 's': .4, 'b': .6}[size])
        assert m.head.in_channels == HVIT3_DIMS[size][-1]
        ema = [h for h in cfg.custom_hooks if h['type'] == 'EMAHook']
        assert len(ema) == 1
        total_batch = 8 * cfg.train_dataloader.batch_size  # the authors' README: 8 GPUs
        assert 1 - ema[0]['momentum'] == pytest.approx(0.9996**(total_batch / 4096))
    else:
        assert bb.type == 'ViT3' and bb.arch == ARCH[size]
        assert bb.drop_path_rate == pytest.approx({'t': 0., 's': .1, 'b': .4}[size])
        assert m.head.in_channels == VIT3_DIM[size]
        assert not any(h['type'] == 'EMAHook' for h in cfg.get('custom_hooks', []))

    ow = cfg.optim_wrapper
    assert ow.get('type', 'OptimWrapper') == 'OptimWrapper'
    opt = ow.optimizer
    assert opt.type == 'AdamW' and opt.lr == pytest.approx(5e-4) and opt.weight_decay == 0.05
    assert opt.eps == 1e-8 and tuple(opt.betas) == (0.9, 0.999)
    assert ow.paramwise_cfg == dict(norm_decay_mult=0., bias_decay_mult=0., flat_decay_mult=0.)
    assert ow.clip_grad == dict(max_norm=5.0)
    assert cfg.auto_scale_lr == dict(enable=True, base_batch_size=512)
    assert cfg.train_cfg.max_epochs == 300

    tr = {t['type']: t for t in cfg.train_dataloader.dataset.pipeline}
    ra = tr['RandAugment']
    assert ra['magnitude_level'] == 9 and ra['magnitude_std'] == 0.5 and ra['num_policies'] == 2
    assert ra['policies'] == 'timm_increasing'
    assert tr['RandomErasing']['erase_prob'] == 0.25
    assert tr['RandomResizedCrop']['interpolation'] == 'bicubic' and tr['RandomResizedCrop']['scale'] == 224
    te = {t['type']: t for t in cfg.val_dataloader.dataset.pipeline}
    assert te['ResizeEdge']['scale'] == 256 and te['ResizeEdge']['interpolation'] == 'bicubic'
    assert te['CenterCrop']['crop_size'] == 224


# ---------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('rel', ALL)
def test_build_and_forward(rel):
    cfg, model = build_model(rel)
    bb = model.backbone
    assert type(bb).__name__ == cfg.model.backbone.type
    size = size_of(rel)
    if rel in DET:
        assert bb.out_channels == list(model.neck.in_channels) == HVIT3_DIMS[size]
        assert n_params(bb) == DET_BACKBONE_PARAMS[size]
        assert bb.with_cp
    elif rel in SEG:
        assert bb.out_channels == list(model.decode_head.in_channels) == HVIT3_DIMS[size]
        ah = model.auxiliary_head
        assert ah.in_channels == bb.out_channels[ah.in_index]
        assert n_params(bb) == DET_BACKBONE_PARAMS[size]
        assert not bb.with_cp
    else:
        net = CLS[rel][0]
        assert bb.out_channels[-1] == model.head.fc.in_features
        assert isinstance(getattr(bb, f'norm{bb.out_indices[-1]}', nn.LayerNorm(1)),
                          nn.BatchNorm2d) == (net == 'hvit3')
        assert n_params(model) == (HVIT3_CLS_PARAMS if net == 'hvit3' else VIT3_CLS_PARAMS)[size]
    dpr = cfg.model.backbone.drop_path_rate
    last_dp = [m for m in bb.modules() if type(m).__name__ == 'DropPath']
    if dpr > 0:
        assert last_dp and last_dp[-1].drop_prob == pytest.approx(dpr)
    else:
        assert not last_dp

    if size != 't':
        return
    model.eval()
    x = torch.rand(1, 3, 64, 64) * 255
    with torch.no_grad():
        if rel in DET:
            from mmdet.testing import demo_mm_inputs
            data = model.data_preprocessor(demo_mm_inputs(1, (3, 64, 64), with_mask=True), False)
            feats = model.extract_feat(data['inputs'])
            assert [tuple(f.shape) for f in feats] == [(1, 256, 64 // s, 64 // s) for s in (4, 8, 16, 32, 64)]
            (cls_score, bbox_pred, mask_pred), = model(**data, mode='tensor')  # ((roi_head outputs), )
            n = cls_score.shape[0]
            assert n > 0 and cls_score.shape[1] == 81 and bbox_pred.shape == (n, 320)
            assert tuple(mask_pred.shape) == (min(n, 100), 80, 28, 28)  # masks for the first 100 rois
            assert torch.isfinite(cls_score).all() and torch.isfinite(mask_pred).all()
        elif rel in SEG:
            out = model(x, mode='tensor')
            assert tuple(out.shape) == (1, 150, 16, 16) and torch.isfinite(out).all()
        else:
            out = model(x, mode='tensor')
            assert tuple(out.shape) == (1, 1000) and torch.isfinite(out).all()


@pytest.mark.parametrize('rel', list(RETINA))
def test_retinanet_settings(rel):
    """Our H-ViT3 RetinaNet: L2ViT's RetinaNet recipe (stages 2-4, P6/P7 on C5, AdamW 1e-4 on every parameter,
    fp32, warm-up 500, multi-scale + crop) with the H-ViT3 Mask R-CNN backbone settings."""
    size, sched = RETINA[rel]
    cfg = load(rel)
    assert cfg.custom_imports == dict(imports=['mmplugin_l2'], allow_failed_imports=False)
    assert cfg.default_scope == 'mmdet'
    m = cfg.model
    assert m.type == 'RetinaNet'
    bb = m.backbone
    assert bb.type == 'HViT3' and bb.arch == ARCH[size] and 'depth' not in bb, 'ResNet/L2ViT keys leaked'
    assert tuple(bb.out_indices) == (1, 2, 3) and bb.with_cp is True
    assert bb.drop_path_rate == pytest.approx(0.1 if sched == '1x' else {'t': .3, 's': .4, 'b': .6}[size])
    assert bb.init_cfg == dict(type='Pretrained', checkpoint=f'data/pretrained/H-ViTTT-{size.upper()}.pth')
    n = m.neck
    assert list(n.in_channels) == HVIT3_DIMS[size][1:]
    assert (n.start_level, n.add_extra_convs, n.num_outs) == (0, 'on_input', 5)
    ref = load(f'mmdet/retinanet_l2vit_t_{sched}.py')  # the recipe followed
    for key in ('optim_wrapper', 'param_scheduler', 'train_pipeline', 'auto_scale_lr'):
        assert cfg[key] == ref[key], key
    assert cfg.optim_wrapper.type == 'OptimWrapper' and cfg.optim_wrapper.optimizer.lr == 1e-4
    assert cfg.train_cfg.max_epochs == (12 if sched == '1x' else 36)
    assert cfg.train_dataloader.batch_size == 2
    text = open(osp.join(CFG_ROOT, rel)).read()
    assert 'our' in text.lower(), 'the config must say that its settings are ours'


@pytest.mark.parametrize('rel', list(RETINA))
def test_retinanet_build(rel):
    cfg, model = build_model(rel)
    size = RETINA[rel][0]
    bb = model.backbone
    assert bb.out_channels == list(model.neck.in_channels) == HVIT3_DIMS[size][1:]
    # the dense-prediction backbone without norm0 (LayerNorm of width dims[0]: 2 x dims[0] parameters)
    assert n_params(bb) == DET_BACKBONE_PARAMS[size] - 2 * HVIT3_DIMS[size][0]
    if size != 't':
        return
    model.eval()
    with torch.no_grad():
        x = torch.rand(1, 3, 128, 128)
        feats = model.extract_feat(x)
        assert [tuple(f.shape) for f in feats] == [(1, 256, 128 // s, 128 // s) for s in (8, 16, 32, 64, 128)]
        cls_scores, bbox_preds = model(x, mode='tensor')
        assert cls_scores[0].shape == (1, 9 * 80, 16, 16) and bbox_preds[0].shape == (1, 36, 16, 16)
        assert all(torch.isfinite(c).all() for c in cls_scores)


OPTIM_CASES = ['mmdet/mask_rcnn_hvit3_t_1x.py', 'mmseg/upernet_hvit3_t_512x512_160k_ade20k.py',
               'mmseg/upernet_hvit3_s_512x512_160k_ade20k.py', 'mmpretrain/hvit3_t_in1k.py',
               'mmpretrain/vit3_t_in1k.py']


@pytest.mark.parametrize('rel', OPTIM_CASES)
def test_weight_decay_groups(rel):
    cfg, model = build_model(rel)
    ow_cfg = copy.deepcopy(cfg.optim_wrapper)
    if ow_cfg.get('type') == 'AmpOptimWrapper':
        ow_cfg.type = 'OptimWrapper'  # AmpOptimWrapper needs a GPU; the parameter groups are the same
    ow = build_optim_wrapper(model, ow_cfg)
    base_wd, base_lr = cfg.optim_wrapper.optimizer.weight_decay, cfg.optim_wrapper.optimizer.lr
    wd = {}
    for g in ow.optimizer.param_groups:
        assert g['lr'] == pytest.approx(base_lr)
        for p in g['params']:
            wd[id(p)] = g['weight_decay']
    named = list(model.named_parameters())
    assert len(wd) == len(named)
    for name, p in named:
        if rel.startswith('mmpretrain'):
            # no decay on 1-D parameters (norms, biases), decay on everything else incl. w1/w2/w3
            want = 0. if p.ndim == 1 else base_wd
        else:
            # only names containing 'norm' skip decay; biases and w1/w2/w3 keep it (as the authors)
            want = 0. if 'norm' in name else base_wd
        assert wd[id(p)] == pytest.approx(want), name
    ttt = [n for n, _ in named if n.endswith(('attn.w1', 'attn.w2', 'attn.w3'))]
    assert ttt and all(wd[id(dict(named)[n])] == pytest.approx(base_wd) for n in ttt)
    if not rel.startswith('mmpretrain'):
        norms = [n for n, _ in named if n.startswith('backbone.norm') or '.norm1.' in n]
        assert norms and all(wd[id(dict(named)[n])] == 0 for n in norms)
        assert any(n.endswith('.bias') and wd[id(p)] == base_wd for n, p in named)


@pytest.mark.parametrize('rel', ['mmpretrain/hvit3_t_in1k.py', 'mmpretrain/vit3_b_in1k.py'])
@pytest.mark.parametrize('total_batch', [512, 1024])
def test_cls_lr_curve(rel, total_batch):
    """Warm-up 20 epochs from 1e-3 x lr, cosine to 1e-2 x lr at epoch 300, per iteration; lr (and with it
    the warm-up and minimum lr) scaled by total_batch / 512 as mmengine's auto_scale_lr does."""
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
# pipelines (run on a synthetic image)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def sample_files(tmp_path_factory):
    d = tmp_path_factory.mktemp('hvit3_data')
    rng = np.random.RandomState(0)
    img = rng.randint(0, 255, (480, 640, 3), dtype=np.uint8)
    seg = rng.randint(0, 151, (480, 640), dtype=np.uint8)
    cv2.imwrite(str(d / 'img.jpg'), img)
    cv2.imwrite(str(d / 'seg.png'), seg)
    return str(d / 'img.jpg'), str(d / 'seg.png')


def test_det_pipelines(sample_files):
    cfg = load('mmdet/mask_rcnn_hvit3_t_1x.py')
    MODELS, _ = registries(cfg)
    train = Compose(cfg.train_dataloader.dataset.pipeline)
    test = Compose(cfg.test_dataloader.dataset.pipeline)
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
    assert shorts <= set(range(480, 801, 32)), shorts
    assert len(ratios) > 1, 'the crop branch never ran'
    out = test(dict(img_path=sample_files[0], img_id=0, instances=copy.deepcopy(inst)))
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
