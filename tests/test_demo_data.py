"""Checks tools/make_demo_data.py output with the real readers (pycocotools, mmdet, mmseg,
mmpretrain), not by re-parsing files by hand."""
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / 'tools' / 'make_demo_data.py'

_spec = importlib.util.spec_from_file_location('make_demo_data', TOOL)
mdd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mdd)

H, W = 96, 112          # non-square on purpose: catches height/width mix-ups
NUM_TRAIN, NUM_VAL, SEED = 6, 3, 7
ARGS = ['--num-train', str(NUM_TRAIN), '--num-val', str(NUM_VAL),
        '--size', str(H), str(W), '--seed', str(SEED)]
SAT_THR = 60            # objects are saturated colours, the background is near-grey


@pytest.fixture(scope='module')
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp('demo')
    mdd.main(['--out', str(out)] + ARGS)
    return out


def _tree(root):
    """{relative path: sha1} of every file under root."""
    return {p.relative_to(root).as_posix(): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob('*')) if p.is_file()}


def _iou(a, b):
    a, b = a.astype(bool), b.astype(bool)
    return (a & b).sum() / max((a | b).sum(), 1)


def _drawn(img):
    """Pixels painted with an object colour, recovered from the saved image itself."""
    img = np.asarray(img, dtype=np.int16)
    return (img.max(-1) - img.min(-1)) > SAT_THR


def _color_label(mean_rgb, names):
    """Index of the class whose base colour is nearest to ``mean_rgb``."""
    cols = np.array([mdd.CLASS_COLORS[n] for n in names], float)
    return int(np.argmin(((cols - mean_rgb) ** 2).sum(1)))


# --------------------------------------------------------------------------- COCO
@pytest.mark.parametrize('split,num', [('train', NUM_TRAIN), ('val', NUM_VAL)])
def test_coco_json_masks_match_drawn_pixels(demo, split, num):
    from pycocotools.coco import COCO
    root = demo / 'coco'
    coco = COCO(str(root / 'annotations' / f'instances_{split}2017.json'))
    cats = coco.loadCats(coco.getCatIds())
    assert [(c['id'], c['name']) for c in cats] == [(1, 'circle'), (2, 'rectangle'),
                                                    (3, 'triangle')]
    imgs = coco.loadImgs(sorted(coco.getImgIds()))
    assert len(imgs) == num
    side = min(H, W)
    for k, info in enumerate(imgs):
        path = root / f'{split}2017' / info['file_name']
        pil = Image.open(path)
        assert pil.format == 'JPEG' and pil.size == (info['width'], info['height']) == (W, H)
        anns = coco.loadAnns(coco.getAnnIds(imgIds=info['id']))
        assert 1 <= len(anns) <= 4
        drawn = _drawn(pil.convert('RGB'))
        # the generator's own masks for this image (exactly the painted pixels)
        _, objs = mdd.render_scene(mdd.image_rng(SEED, 'coco', split, k), H, W)
        assert len(objs) == len(anns)
        union = np.zeros((H, W), bool)
        for ann, obj in zip(anns, objs):
            assert ann['iscrowd'] == 0 and ann['category_id'] == obj['label'] + 1
            poly = ann['segmentation']
            assert isinstance(poly, list) and len(poly) == 1
            assert len(poly[0]) >= 6 and len(poly[0]) % 2 == 0
            m = coco.annToMask(ann).astype(bool)
            assert m.shape == (H, W)
            assert _iou(m, obj['mask']) > 0.9
            assert not (m & union).any(), 'objects overlap'
            union |= m
            # bbox is xywh, inside the image and tight around the decoded mask
            x, y, bw, bh = ann['bbox']
            assert 0 <= x and 0 <= y and x + bw <= W and y + bh <= H
            ys, xs = np.nonzero(m)
            assert abs(xs.min() - x) <= 1 and abs(xs.max() + 1 - (x + bw)) <= 1
            assert abs(ys.min() - y) <= 1 and abs(ys.max() + 1 - (y + bh)) <= 1
            assert 0.2 * side - 1 <= max(bw, bh) <= 0.5 * side + 1
            assert abs(ann['area'] - m.sum()) <= 0.1 * m.sum()
            # the decoded mask covers what is actually visible in the JPEG ...
            x0, y0 = max(int(x) - 2, 0), max(int(y) - 2, 0)
            region = np.zeros((H, W), bool)
            region[y0:int(y + bh) + 3, x0:int(x + bw) + 3] = True
            assert _iou(m, drawn & region) > 0.9
            # ... and the colour there belongs to the annotated class
            mean = np.asarray(pil.convert('RGB'))[m].mean(0)
            assert _color_label(mean, mdd.CLASSES) == ann['category_id'] - 1
        # no painted object is left without an annotation
        assert (drawn & ~union).sum() <= 0.02 * drawn.sum()


def test_mmdet_coco_dataset_and_metric(demo):
    import torch
    from mmcv.transforms import LoadImageFromFile
    from mmdet.datasets import CocoDataset
    from mmdet.datasets.transforms import LoadAnnotations, PackDetInputs
    from mmdet.evaluation import CocoMetric
    from pycocotools.coco import COCO

    root = demo / 'coco'
    metainfo = dict(classes=mdd.CLASSES)
    pipeline = [LoadImageFromFile(), LoadAnnotations(with_bbox=True, with_mask=True),
                PackDetInputs()]
    for split, num in (('train', NUM_TRAIN), ('val', NUM_VAL)):
        ann_file = f'annotations/instances_{split}2017.json'
        ds = CocoDataset(data_root=str(root), ann_file=ann_file, metainfo=metainfo,
                         data_prefix=dict(img=f'{split}2017/'), pipeline=pipeline,
                         test_mode=(split == 'val'))
        assert len(ds) == num and ds.metainfo['classes'] == mdd.CLASSES
        coco = COCO(str(root / ann_file))
        metric = CocoMetric(ann_file=str(root / ann_file), metric=['bbox', 'segm'])
        metric.dataset_meta = ds.metainfo
        for i in range(len(ds)):
            item = ds[i]
            assert tuple(item['inputs'].shape) == (3, H, W)
            sample = item['data_samples']
            gt = sample.gt_instances
            anns = coco.loadAnns(coco.getAnnIds(imgIds=sample.img_id))
            assert len(gt) == len(anns) >= 1
            assert gt.labels.tolist() == [a['category_id'] - 1 for a in anns]
            masks = gt.masks.to_ndarray()
            assert masks.shape == (len(anns), H, W)
            for m, a in zip(masks, anns):
                assert _iou(m, coco.annToMask(a)) == 1.0
            boxes = gt.bboxes.tensor.numpy()
            assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
            # feed the ground truth back as a "perfect" prediction
            pred = dict(bboxes=gt.bboxes.tensor.clone(), labels=gt.labels.clone(),
                        scores=torch.ones(len(gt)), masks=torch.from_numpy(masks).bool())
            metric.process({}, [dict(pred_instances=pred, img_id=sample.img_id,
                                     ori_shape=sample.ori_shape)])
        res = metric.evaluate(len(ds))
        assert res['coco/bbox_mAP'] == pytest.approx(1.0)
        assert res['coco/segm_mAP'] == pytest.approx(1.0)


# --------------------------------------------------------------------------- ADE20K
def test_ade_label_pngs(demo):
    root = demo / 'ade' / 'ADEChallengeData2016'
    for sub, prefix, num in (('training', 'ADE_train', NUM_TRAIN),
                             ('validation', 'ADE_val', NUM_VAL)):
        imgs = sorted((root / 'images' / sub).glob('*.jpg'))
        anns = sorted((root / 'annotations' / sub).glob('*.png'))
        assert [p.name for p in imgs] == [f'{prefix}_{i:08d}.jpg' for i in range(1, num + 1)]
        assert [p.stem for p in anns] == [p.stem for p in imgs]
        for ip, ap in zip(imgs, anns):
            lab = Image.open(ap)
            assert lab.mode == 'L' and lab.size == (W, H)
            lab = np.asarray(lab)
            assert set(np.unique(lab)) <= {0, 1, 2, 3} and (lab > 0).any()
            img = np.asarray(Image.open(ip).convert('RGB'))
            assert _iou(lab > 0, _drawn(img)) > 0.9
            for c in np.unique(lab[lab > 0]):
                mean = img[lab == c].mean(0)
                assert _color_label(mean, mdd.CLASSES) == c - 1


def test_mmseg_ade20k_dataset(demo):
    from mmcv.transforms import LoadImageFromFile
    from mmseg.datasets import ADE20KDataset, BaseSegDataset
    from mmseg.datasets.transforms import LoadAnnotations, PackSegInputs

    root = demo / 'ade' / 'ADEChallengeData2016'
    pipeline = [LoadImageFromFile(), LoadAnnotations(), PackSegInputs()]
    variants = [
        (ADE20KDataset, dict()),                                          # stock 150 cls
        (ADE20KDataset, dict(metainfo=dict(classes=mdd.ADE_CLASS_ALIASES))),
        (BaseSegDataset, dict(img_suffix='.jpg', seg_map_suffix='.png',
                              reduce_zero_label=True,
                              metainfo=dict(classes=mdd.CLASSES))),
    ]
    for sub, num in (('training', NUM_TRAIN), ('validation', NUM_VAL)):
        for cls, kw in variants:
            ds = cls(data_root=str(root), pipeline=pipeline,
                     data_prefix=dict(img_path=f'images/{sub}',
                                      seg_map_path=f'annotations/{sub}'), **kw)
            assert len(ds) == num and ds.reduce_zero_label
            if 'metainfo' in kw:
                assert len(ds.metainfo['classes']) == 3
            for i in (0, num - 1):
                item = ds[i]
                assert tuple(item['inputs'].shape) == (3, H, W)
                seg = item['data_samples'].gt_sem_seg.data.numpy()[0]
                raw = np.asarray(Image.open(ds.get_data_info(i)['seg_map_path']))
                expected = np.where(raw == 0, 255, raw.astype(np.int64) - 1)
                assert seg.shape == (H, W) and (seg == expected).all()
                assert set(np.unique(seg)) <= {0, 1, 2, 255} and (seg != 255).any()


# --------------------------------------------------------------------------- ImageNet
def _samples(ds):
    infos = [ds.get_data_info(i) for i in range(len(ds))]
    return [(d['img_path'], int(d['gt_label'])) for d in infos]


def test_mmpretrain_imagenet_and_custom_dataset(demo):
    from mmcv.transforms import LoadImageFromFile
    from mmpretrain.datasets import CustomDataset, ImageNet
    from mmpretrain.datasets.transforms import PackInputs

    root = demo / 'imagenet'
    pipeline = [LoadImageFromFile(), PackInputs()]
    meta = dict(classes=mdd.CLS_CLASSES)
    for split, num in (('train', NUM_TRAIN), ('val', NUM_VAL)):
        by_ann = ImageNet(data_root=str(root), split=split, metainfo=meta, pipeline=pipeline)
        assert by_ann.ann_file.endswith(f'meta/{split}.txt')
        # folder mode, two ways: ImageNet without the meta file, CustomDataset (wnid names)
        by_dir = ImageNet(data_root=str(root), data_prefix=split, metainfo=meta,
                          pipeline=pipeline)
        custom = CustomDataset(data_root=str(root), data_prefix=split, pipeline=pipeline)
        assert not by_dir.ann_file and not custom.ann_file
        assert custom.metainfo['classes'] == mdd.WNIDS
        assert by_ann.metainfo['classes'] == mdd.CLS_CLASSES
        samples = _samples(by_ann)
        assert len(samples) == num
        assert samples == _samples(by_dir) == _samples(custom)
        counts = np.bincount([s[1] for s in samples], minlength=len(mdd.WNIDS))
        assert counts.max() - counts.min() <= 1
        for i in range(num):
            path, label = samples[i]
            assert Path(path).parent.name == mdd.WNIDS[label]
            assert Path(path).suffix == '.JPEG'
            item = by_ann[i]
            assert tuple(item['inputs'].shape) == (3, H, W)
            assert item['data_samples'].gt_label.tolist() == [label]
            img = np.asarray(Image.open(path).convert('RGB'))
            drawn = _drawn(img)
            assert drawn.sum() > 0.05 * H * W
            assert _color_label(img[drawn].mean(0), mdd.CLS_CLASSES) == label


# --------------------------------------------------------------------------- CLI
def test_cli_is_deterministic_and_seed_dependent(demo, tmp_path):
    out = tmp_path / 'again'
    r = subprocess.run([sys.executable, str(TOOL), '--out', str(out)] + ARGS,
                       capture_output=True, text=True, check=True, cwd=str(tmp_path))
    lines = r.stdout.strip().splitlines()
    assert [ln.split(':')[0] for ln in lines] == ['coco', 'ade', 'imagenet']
    assert f'train {NUM_TRAIN}' in lines[0] and str(out / 'coco') in lines[0]
    first, second = _tree(demo), _tree(out)
    assert first == second and len(first) > 3 * (NUM_TRAIN + NUM_VAL)

    other = tmp_path / 'seed'
    mdd.main(['--out', str(other), '--task', 'coco', '--seed', str(SEED + 1)] + ARGS[:-2])
    diff = _tree(other)
    imgs = [k for k in diff if k.endswith('.jpg')]
    assert imgs and all(diff[k] != first[k] for k in imgs)


def test_rerun_replaces_own_output_but_not_foreign_data(tmp_path):
    out = tmp_path / 'd'
    base = ['--out', str(out), '--task', 'ade', '--size', '48', '48', '--num-val', '1']
    mdd.main(base + ['--num-train', '4'])
    mdd.main(base + ['--num-train', '2'])  # no stale images from the first run
    train = out / 'ade' / 'ADEChallengeData2016' / 'images' / 'training'
    assert sorted(p.name for p in train.iterdir()) == ['ADE_train_00000001.jpg',
                                                       'ADE_train_00000002.jpg']
    foreign = out / 'coco' / 'precious.txt'
    foreign.parent.mkdir(parents=True)
    foreign.write_text('real data')
    with pytest.raises(SystemExit):
        mdd.main(['--out', str(out), '--task', 'coco', '--size', '48', '48'])
    assert foreign.read_text() == 'real data' and os.listdir(foreign.parent) == ['precious.txt']
