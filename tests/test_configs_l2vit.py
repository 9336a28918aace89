"""The L2ViT configs under configs/: settings against the authors' recipes (docs/l2vit.md, Recipes),
builds (pretrained init disabled; the T-1x ones for real with a forward, the others on the meta device),
parameter counts, weight-decay groups, and real training iterations through tools/train.py (RetinaNet, UperNet,
classifier) plus tools/test.py (RetinaNet, UperNet) on generated data."""
import copy
import functools
import json
import subprocess
import sys

import pytest
import torch
from mmengine.optim import build_optim_wrapper

from config_helpers import CFG_ROOT, load, registries  # noqa: E402
from conftest import ROOT, TINY_L2VIT  # noqa: E402

DIMS = {'t': [96, 192, 384, 768], 's': [96, 192, 384, 768], 'b': [128, 256, 512, 1024]}
ARCH = {'t': 'tiny', 's': 'small', 'b': 'base'}
FILE = {'t': 'Tiny', 's': 'Small', 'b': 'Base'}
# official counts (docs/l2vit.md, Architecture): dense-prediction backbone with norm0-3; classifiers
DET_BACKBONE_PARAMS = {'t': 27_829_125, 's': 49_431_501, 'b': 87_553_980}
CLS_PARAMS = {'t': 28_596_781, 's': 50_199_157, 'b': 88_577_188}
# the norm{i} of the returned stages only: RetinaNet drops norm0 (dims[0] weights + biases)
RETINA_BACKBONE_PARAMS = {s: DET_BACKBONE_PARAMS[s] - 2 * DIMS[s][0] for s in 'tsb'}

MASK = {f'mmdet/mask_rcnn_l2vit_{s}_{k}.py': (s, k) for k in ('1x', '3x') for s in 'tsb'}
RETINA = {f'mmdet/retinanet_l2vit_{s}_{k}.py': (s, k) for k in ('1x', '3x') for s in 'tsb'}
DET = {**MASK, **RETINA}
SEG = {f'mmseg/upernet_l2vit_{s}_512x512_160k_ade20k.py': s for s in 'tsb'}
CLS = {f'mmpretrain/l2vit_{s}_in1k.py': s for s in 'tsb'}
ALL = [*DET, *SEG, *CLS]
# built for real and run once (T, 1x); the others are built on the meta device: the same construction code
# without allocating and initialising up to 100M weights on a busy 2-core CPU
FORWARD = {'mmdet/mask_rcnn_l2vit_t_1x.py', 'mmdet/retinanet_l2vit_t_1x.py',
           'mmseg/upernet_l2vit_t_512x512_160k_ade20k.py', 'mmpretrain/l2vit_t_in1k.py'}


def size_of(rel):
    return DET[rel][0] if rel in DET else SEG.get(rel) or CLS[rel]


@functools.lru_cache(maxsize=None)
def build_model(rel):
    cfg = load(rel)
    MODELS, _ = registries(cfg)
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None
    if rel in MASK:
        model_cfg.test_cfg.rpn.max_per_img = 8  # few RoIs in the forward test
    if cfg.get('data_preprocessor') is not None:
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with torch.device('cpu' if rel in FORWARD else 'meta'):
        model = MODELS.build(model_cfg)
    return cfg, model


def n_params(m):
    return sum(p.numel() for p in m.parameters())


# ---------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('rel', ALL)
def test_common(rel):
    cfg = load(rel)
    assert cfg.custom_imports == dict(imports=['mmplugin_l2'], allow_failed_imports=False)
    assert cfg.default_scope == rel.split('/')[0]
    bb = cfg.model.backbone
    assert bb.type == 'L2ViT' and bb.arch == ARCH[size_of(rel)]
    assert not ({'depth', 'embed_dims', 'img_size', 'norm_eval', 'window_size'} & set(bb)), \
        'keys of the base backbone leaked: missing _delete_'
    assert not bb.get('with_cp', False) and bb.get('frozen_stages', -1) == -1  # none in the authors' code
    if rel in CLS:
        assert bb.get('init_cfg') is None
    else:
        assert bb.init_cfg == dict(type='Pretrained',
                                   checkpoint=f'data/pretrained/L2ViT-{FILE[size_of(rel)]}-checkpoint-best-ema.pth')


@pytest.mark.parametrize('rel', list(DET))
def test_det_settings(rel):
    size, sched = DET[rel]
    cfg = load(rel)
    m = cfg.model
    bb = m.backbone
    assert bb.drop_path_rate == pytest.approx({'1x': {'t': .1, 's': .1, 'b': .2},
                                               '3x': {'t': .2, 's': .2, 'b': .3}}[sched][size])
    if rel in MASK:
        assert m.type == 'MaskRCNN' and tuple(bb.out_indices) == (0, 1, 2, 3)
        assert list(m.neck.in_channels) == DIMS[size] and m.neck.num_outs == 5
        assert m.data_preprocessor.pad_mask and m.data_preprocessor.pad_size_divisor == 32
    else:
        assert m.type == 'RetinaNet' and tuple(bb.out_indices) == (1, 2, 3)
        assert list(m.neck.in_channels) == DIMS[size][1:]
        assert m.neck.start_level == 0 and m.neck.add_extra_convs == 'on_input' and m.neck.num_outs == 5
        assert m.data_preprocessor.pad_size_divisor == 32

    ow = cfg.optim_wrapper
    assert ow.type == 'OptimWrapper' and ow.get('clip_grad') is None and 'paramwise_cfg' not in ow
    assert ow.optimizer == dict(type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05)

    epochs, milestones = (12, [8, 11]) if sched == '1x' else (36, [27, 33])
    assert cfg.train_cfg.max_epochs == epochs and cfg.train_cfg.val_interval == epochs
    assert cfg.default_hooks.checkpoint.interval == epochs
    warm, step = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.start_factor == 1e-3 and not warm.by_epoch
    assert (warm.begin, warm.end) == (0, 500)
    assert step.type == 'MultiStepLR' and step.by_epoch and step.gamma == 0.1
    assert list(step.milestones) == milestones and step.end == epochs
    assert cfg.train_dataloader.batch_size == 2 and cfg.auto_scale_lr.base_batch_size == 16

    # the multi-scale + crop augmentation, 1x and 3x alike
    pipe = cfg.train_dataloader.dataset.pipeline
    assert [t['type'] for t in pipe] == ['LoadImageFromFile', 'LoadAnnotations', 'RandomFlip', 'RandomChoice',
                                         'PackDetInputs']
    assert pipe[1].get('with_mask', False) == (rel in MASK)
    ms = [(s, 1333) for s in range(480, 801, 32)]
    plain, crop = pipe[3]['transforms']
    assert [t['type'] for t in plain] == ['RandomChoiceResize'] and [tuple(s) for s in plain[0]['scales']] == ms
    assert [t['type'] for t in crop] == ['RandomChoiceResize', 'RandomCrop', 'RandomChoiceResize']
    assert [tuple(s) for s in crop[0]['scales']] == [(400, 1333), (500, 1333), (600, 1333)]
    assert crop[1]['crop_type'] == 'absolute_range' and tuple(crop[1]['crop_size']) == (384, 600)
    assert crop[1]['allow_negative_crop'] is True and [tuple(s) for s in crop[2]['scales']] == ms
    resize = [t for t in cfg.test_dataloader.dataset.pipeline if t['type'] == 'Resize']
    assert len(resize) == 1 and tuple(resize[0]['scale']) == (1333, 800) and resize[0]['keep_ratio']


@pytest.mark.parametrize('rel', list(SEG))
def test_seg_settings(rel):
    size = SEG[rel]
    cfg = load(rel)
    m = cfg.model
    assert m.type == 'EncoderDecoder'
    assert m.backbone.drop_path_rate == pytest.approx(0.3) and tuple(m.backbone.out_indices) == (0, 1, 2, 3)
    assert tuple(m.data_preprocessor.size) == (512, 512)
    dh, ah = m.decode_head, m.auxiliary_head
    assert dh.type == 'UPerHead' and list(dh.in_channels) == DIMS[size] and dh.num_classes == 150
    assert dh.channels == 512 and tuple(dh.pool_scales) == (1, 2, 3, 6) and dh.dropout_ratio == 0.1
    assert ah.type == 'FCNHead' and ah.in_index == 2 and ah.in_channels == DIMS[size][2]
    assert ah.channels == 256 and ah.num_convs == 1 and ah.loss_decode.loss_weight == 0.4
    assert dh.norm_cfg == ah.norm_cfg == dict(type='BN', requires_grad=True)  # the authors' plain BN
    assert m.test_cfg.mode == 'whole'

    ow = cfg.optim_wrapper
    assert ow.type == 'OptimWrapper' and 'paramwise_cfg' not in ow and ow.get('clip_grad') is None
    assert ow.optimizer == dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01)
    warm, poly = cfg.param_scheduler
    assert warm.type == 'LinearLR' and warm.start_factor == 1e-6 and (warm.begin, warm.end) == (0, 1500)
    assert poly.type == 'PolyLR' and poly.power == 1.0 and poly.eta_min == 0
    assert (poly.begin, poly.end) == (1500, 160000) and not poly.by_epoch
    assert cfg.train_cfg.max_iters == 160000 and cfg.train_cfg.val_interval == 16000
    assert cfg.train_dataloader.batch_size == 2


@pytest.mark.parametrize('rel', list(CLS))
def test_cls_settings(rel):
    size = CLS[rel]
    cfg = load(rel)
    m = cfg.model
    assert m.type == 'ImageClassifier'
    assert tuple(m.backbone.out_indices) == (3,) and m.backbone.final_norm is True
    assert m.backbone.drop_path_rate == pytest.approx({'t': .1, 's': .3, 'b': .3}[size])  # B: readme (code)
    assert m.neck.type == 'GlobalAveragePooling'
    assert m.head.type == 'LinearClsHead' and m.head.num_classes == 1000 and m.head.in_channels == DIMS[size][-1]
    assert m.head.loss == dict(type='LabelSmoothLoss', label_smooth_val=0.1, mode='original')
    assert m.train_cfg.augments == [dict(type='Mixup', alpha=0.8), dict(type='CutMix', alpha=1.0)]

    ow = cfg.optim_wrapper
    assert {k: v for k, v in ow.optimizer.items() if k != '_scope_'} == dict(
        type='AdamW', lr=4e-3, weight_decay=0.05, eps=1e-8, betas=(0.9, 0.999))
    assert ow.paramwise_cfg == dict(norm_decay_mult=0., bias_decay_mult=0., flat_decay_mult=0.)
    assert ow.accumulative_counts == 4 and ow.get('clip_grad') is None
    assert cfg.train_dataloader.batch_size * 8 * ow.accumulative_counts == 4096
    assert cfg.auto_scale_lr == dict(enable=False, base_batch_size=4096)
    warm, cos = cfg.param_scheduler
    assert warm.type == 'LinearLR' and (warm.begin, warm.end) == (0, 20) and warm.start_factor <= 1e-6
    assert cos.type == 'CosineAnnealingLR' and cos.eta_min == 1e-6 and (cos.begin, cos.end) == (20, 300)
    assert warm.convert_to_iter_based and cos.convert_to_iter_based
    assert cfg.train_cfg.max_epochs == 300
    ema, = [h for h in cfg.custom_hooks if h['type'] == 'EMAHook']
    assert ema.momentum == pytest.approx(1e-4) and ema.interval == 4 and ema.update_buffers

    tr = {t['type']: t for t in cfg.train_dataloader.dataset.pipeline}
    assert tr['RandAugment']['magnitude_level'] == 9 and tr['RandAugment']['magnitude_std'] == 0.5
    assert tr['RandomErasing']['erase_prob'] == 0.25 and tr['RandomResizedCrop']['interpolation'] == 'bicubic'
    te = {t['type']: t for t in cfg.val_dataloader.dataset.pipeline}
    assert te['ResizeEdge']['scale'] == 256 and te['CenterCrop']['crop_size'] == 224


# ---------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('rel', ALL)
def test_build_and_forward(rel):
    cfg, model = build_model(rel)
    bb = model.backbone
    size = size_of(rel)
    if rel in MASK:
        assert bb.out_channels == list(model.neck.in_channels) == DIMS[size]
        assert n_params(bb) == DET_BACKBONE_PARAMS[size]
    elif rel in RETINA:
        assert bb.out_channels == list(model.neck.in_channels) == DIMS[size][1:]
        assert n_params(bb) == RETINA_BACKBONE_PARAMS[size]
    elif rel in SEG:
        assert bb.out_channels == list(model.decode_head.in_channels) == DIMS[size]
        assert model.auxiliary_head.in_channels == bb.out_channels[2]
        assert n_params(bb) == DET_BACKBONE_PARAMS[size]
    else:
        assert bb.out_channels == [model.head.fc.in_features] and bb.final_norm
        assert n_params(model) == CLS_PARAMS[size]
    drops = [m.drop_prob for m in bb.modules() if type(m).__name__ == 'DropPath']
    assert drops[-1] == pytest.approx(cfg.model.backbone.drop_path_rate)
    if rel not in FORWARD:
        return
    model.eval()
    with torch.no_grad():
        if rel in DET:
            from mmdet.testing import demo_mm_inputs
            data = model.data_preprocessor(demo_mm_inputs(1, (3, 72, 88), with_mask=rel in MASK), False)
            feats = model.extract_feat(data['inputs'])
            h, w = data['inputs'].shape[-2:]
            assert [tuple(f.shape[-2:]) for f in feats][:3] == [
                (-(-h // s), -(-w // s)) for s in ((4, 8, 16) if rel in MASK else (8, 16, 32))]
            results = model(**data, mode='predict')
            assert len(results) == 1 and torch.isfinite(results[0].pred_instances.scores).all()
        else:
            x = torch.rand(1, 3, 72, 88) * 255
            out = model(x, mode='tensor')
            assert tuple(out.shape) == ((1, 150, 18, 22) if rel in SEG else (1, 1000))
            assert torch.isfinite(out).all()


@pytest.mark.parametrize('rel', ['mmdet/retinanet_l2vit_t_1x.py', 'mmseg/upernet_l2vit_t_512x512_160k_ade20k.py',
                                 'mmpretrain/l2vit_t_in1k.py'])
def test_weight_decay_groups(rel):
    """Detection / segmentation: every parameter decayed (the authors have no paramwise_cfg).
    Classification: 1-D parameters (norms, biases) not decayed, the 3-D temperatures decayed."""
    cfg, model = build_model(rel)
    ow = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    base_wd = cfg.optim_wrapper.optimizer.weight_decay
    wd = {id(p): g['weight_decay'] for g in ow.optimizer.param_groups for p in g['params']}
    named = list(model.named_parameters())
    assert len(wd) == len(named)
    for name, p in named:
        want = 0. if rel.startswith('mmpretrain') and p.ndim == 1 else base_wd
        assert wd[id(p)] == pytest.approx(want), name
    temps = [p for n, p in named if n.endswith('attn.temperature')]
    assert len(temps) == 6 and all(wd[id(p)] == pytest.approx(base_wd) for p in temps)


# ---------------------------------------------------------------------------------------------------
# tools/train.py and tools/test.py on generated data
# ---------------------------------------------------------------------------------------------------
TINY_BB = (f"backbone=dict(arch=dict(_delete_=True, embed_dims={TINY_L2VIT['embed_dims']}, "
           f"depths={TINY_L2VIT['depths']}, num_heads={TINY_L2VIT['num_heads']}), init_cfg=None, "
           "drop_path_rate=0.1)")
RUN_CFG = ("train_cfg = dict(max_epochs=1, val_interval=1)\n"
           "default_hooks = dict(checkpoint=dict(interval=1), logger=dict(interval=1))\n")

DET_DATA = """
data_root = 'data/demo/coco/'
metainfo = dict(classes=('circle', 'rectangle', 'triangle'))
_train = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True, with_mask={mask}),
          dict(type='RandomFlip', prob=0.5), dict(type='Resize', scale=(64, 64), keep_ratio=True),
          dict(type='PackDetInputs')]
_test = [dict(type='LoadImageFromFile'), dict(type='Resize', scale=(64, 64), keep_ratio=True),
         dict(type='LoadAnnotations', with_bbox=True, with_mask={mask}),
         dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, metainfo=metainfo,
                                     ann_file='annotations/instances_train2017.json',
                                     data_prefix=dict(img='train2017/'), pipeline=_train))
val_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                      dataset=dict(data_root=data_root, metainfo=metainfo,
                                   ann_file='annotations/instances_val2017.json',
                                   data_prefix=dict(img='val2017/'), pipeline=_test))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator
"""

SEG_DATA = """
data_root = 'data/demo/ade/ADEChallengeData2016'
metainfo = dict(classes=('circle', 'rectangle', 'triangle'))
_ds = dict(type='BaseSegDataset', data_root=data_root, metainfo=metainfo, img_suffix='.jpg',
           seg_map_suffix='.png', reduce_zero_label=True)
_train = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', reduce_zero_label=True),
          dict(type='RandomFlip', prob=0.5), dict(type='PackSegInputs')]
_test = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', reduce_zero_label=True),
         dict(type='PackSegInputs')]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(_ds, data_prefix=dict(img_path='images/training',
                                                           seg_map_path='annotations/training'), pipeline=_train))
val_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      dataset=dict(_ds, data_prefix=dict(img_path='images/validation',
                                                         seg_map_path='annotations/validation'), pipeline=_test))
test_dataloader = val_dataloader
train_cfg = dict(type='IterBasedTrainLoop', max_iters=1, val_interval=1)
default_hooks = dict(checkpoint=dict(interval=1), logger=dict(interval=1))
"""

CLS_DATA = """
data_root = 'data/demo/imagenet'
metainfo = dict(classes=('circle', 'rectangle', 'triangle', 'cross', 'star'))
data_preprocessor = dict(num_classes=5)
_train = [dict(type='LoadImageFromFile'), dict(type='RandomResizedCrop', scale=64, backend='pillow'),
          dict(type='PackInputs')]
_test = [dict(type='LoadImageFromFile'), dict(type='CenterCrop', crop_size=64), dict(type='PackInputs')]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(type='ImageNet', data_root=data_root, split='train', metainfo=metainfo,
                                     pipeline=_train))
val_dataloader = dict(batch_size=4, num_workers=0, persistent_workers=False,
                      dataset=dict(type='ImageNet', data_root=data_root, split='val', metainfo=metainfo,
                                   pipeline=_test))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator
"""


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    """A working directory holding data/demo (2 train / 2 val images per task, 64 x 64)."""
    d = tmp_path_factory.mktemp('l2vit_tools')
    r = subprocess.run([sys.executable, f'{ROOT}/tools/make_demo_data.py', '--out', str(d / 'data/demo'),
                        '--num-train', '2', '--num-val', '2', '--size', '64', '64'], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d


def write_cfg(workdir, name, base, body):
    path = workdir / f'{name}.py'
    path.write_text(f"_base_ = '{CFG_ROOT}/{base}'\n{body}")
    return str(path)


def run(workdir, tool, *args):
    cmd = [sys.executable, f'{ROOT}/tools/{tool}', *map(str, args)]
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f'{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}'
    return r


def test_retinanet_train_then_test(workdir):
    cfg = write_cfg(workdir, 'retina', 'mmdet/retinanet_l2vit_t_1x.py', (
        f"model = dict({TINY_BB}, neck=dict(in_channels=[32, 64, 64]), bbox_head=dict(num_classes=3),\n"
        "             test_cfg=dict(score_thr=0.))  # an untrained detector: keep its boxes for the COCO metric\n"
        + DET_DATA.format(mask=False) + RUN_CFG))
    r = run(workdir, 'train.py', cfg, '--work-dir', 'wd_retina')
    assert 'Epoch(train) [1][1/1]' in r.stdout + r.stderr
    ckpt = workdir / 'wd_retina' / 'epoch_1.pth'
    assert ckpt.is_file()
    r = run(workdir, 'test.py', cfg, ckpt, '--work-dir', 'wd_retina_test', '--out', 'retina.json')
    metrics = json.loads((workdir / 'retina.json').read_text())
    assert 0.0 <= metrics['coco/bbox_mAP'] <= 1.0 and 'coco/bbox_mAP' in r.stdout


def test_upernet_train_then_test(workdir):
    cfg = write_cfg(workdir, 'seg', 'mmseg/upernet_l2vit_t_512x512_160k_ade20k.py', (
        f"model = dict(data_preprocessor=dict(size=(64, 64)), {TINY_BB},\n"
        f"             decode_head=dict(in_channels={TINY_L2VIT['embed_dims']}, channels=32, num_classes=3),\n"
        "             auxiliary_head=dict(in_channels=64, channels=16, num_classes=3))\n" + SEG_DATA))
    r = run(workdir, 'train.py', cfg, '--work-dir', 'wd_seg')
    assert 'Iter(train) [1/1]' in r.stdout + r.stderr
    ckpt = workdir / 'wd_seg' / 'iter_1.pth'
    assert ckpt.is_file()
    r = run(workdir, 'test.py', cfg, ckpt, '--work-dir', 'wd_seg_test', '--out', 'seg.json')
    metrics = json.loads((workdir / 'seg.json').read_text())
    assert 0.0 <= metrics['mIoU'] <= 100.0 and 'mIoU' in r.stdout


def test_classifier_train(workdir):
    """One accumulation cycle of the recipe (accumulative_counts=4 steps at the last iteration), with EMA."""
    cfg = write_cfg(workdir, 'cls', 'mmpretrain/l2vit_t_in1k.py', (
        f"model = dict({TINY_BB}, head=dict(num_classes=5, in_channels=64), train_cfg=dict(augments=None))\n"
        + CLS_DATA + "train_cfg = dict(max_epochs=1, val_interval=1)\n"
        "default_hooks = dict(checkpoint=dict(interval=1), logger=dict(interval=1))\n"))
    r = run(workdir, 'train.py', cfg, '--work-dir', 'wd_cls')
    log = r.stdout + r.stderr
    assert 'Epoch(train) [1][' in log and 'accuracy/top1' in log
    ckpt = torch.load(workdir / 'wd_cls' / 'epoch_1.pth', weights_only=True, map_location='cpu')
    assert 'ema_state_dict' in ckpt, sorted(ckpt)
