#!/usr/bin/env python
"""Deterministic synthetic demo data for smoke-training mmplugin_l2 configs on CPU.

Every image is a plain, mildly noisy grey background with solid-coloured shapes on it;
each class has its own shape *and* its own colour range, so a detector / segmentor /
classifier trained from scratch should pick it up in a few CPU minutes. Shapes never
overlap (boxes are disjoint), so every instance is fully visible and its polygon
traces exactly the pixels that were painted (masks are rasterised from the very
polygons written to the annotations, with the pixel-centre convention pycocotools uses).
The same arguments give byte-identical files. Each image has its own RNG stream keyed on
(seed, task, split, index), so its content does not depend on the counts or on which
other tasks are generated in the same run.

Usage::

    python tools/make_demo_data.py [--out data/demo] [--task coco|ade|imagenet|all]
        [--num-train 200] [--num-val 40] [--size 128 128] [--seed 0]

Layout and how a config points at it (paths relative to the repo root, default ``--out``):

1. COCO instance segmentation, ``data/demo/coco/``::

       train2017/000000000001.jpg ...   val2017/000000000201.jpg ...
       annotations/instances_train2017.json   annotations/instances_val2017.json

   Standard COCO json (``images``, ``annotations`` with polygon ``segmentation``, xywh
   ``bbox``, ``area``, ``iscrowd=0``, ``categories`` 1..3). 1-4 objects per image,
   sizes 20-50 % of the image side. Classes: ``('circle', 'rectangle', 'triangle')``::

       metainfo = dict(classes=('circle', 'rectangle', 'triangle'))
       dataset = dict(type='CocoDataset', data_root='data/demo/coco/', metainfo=metainfo,
                      ann_file='annotations/instances_train2017.json',
                      data_prefix=dict(img='train2017/'))
       val_evaluator = dict(type='CocoMetric', metric=['bbox', 'segm'],
                            ann_file='data/demo/coco/annotations/instances_val2017.json')
       # and num_classes=3 in roi_head.bbox_head / roi_head.mask_head

2. ADE20K-style semantic segmentation, ``data/demo/ade/ADEChallengeData2016/``::

       images/training/ADE_train_00000001.jpg    annotations/training/ADE_train_00000001.png
       images/validation/ADE_val_00000001.jpg    annotations/validation/ADE_val_00000001.png

   Label PNGs are 8-bit greyscale: 0 = background/"other" (ignored with
   ``reduce_zero_label=True``), 1 = circle, 2 = rectangle, 3 = triangle, i.e. train ids
   0..2 after the zero label is reduced. ``ADE20KDataset`` only accepts class names that
   are a subset of the 150 ADE names, so with that dataset type the three classes carry
   the ADE names of ids 0..2, ``('wall', 'building', 'sky')``::

       dataset = dict(type='ADE20KDataset', data_root='data/demo/ade/ADEChallengeData2016',
                      data_prefix=dict(img_path='images/training',
                                       seg_map_path='annotations/training'),
                      metainfo=dict(classes=('wall', 'building', 'sky')))  # num_classes=3
       # (without metainfo the stock 150-class setup also works, only ids 0..2 occur), or,
       # to get the shape names:
       dataset = dict(type='BaseSegDataset', img_suffix='.jpg', seg_map_suffix='.png',
                      reduce_zero_label=True,
                      metainfo=dict(classes=('circle', 'rectangle', 'triangle')), ...)

3. ImageNet-style classification, ``data/demo/imagenet/``::

       train/n00000001/n00000001_00000000.JPEG ...   (one folder per class)
       val/n00000001/ILSVRC2012_val_00000001.JPEG ...
       meta/train.txt   meta/val.txt               ("n00000001/xxx.JPEG 0" per line)

   One object per image, classes ``('circle', 'rectangle', 'triangle', 'cross', 'star')``
   for folders ``n00000001``..``n00000005`` (labels 0..4, balanced)::

       dataset = dict(type='ImageNet', data_root='data/demo/imagenet', split='train',
                      metainfo=dict(classes=('circle', 'rectangle', 'triangle',
                                             'cross', 'star')))  # uses meta/train.txt
       # or folder mode: dict(type='CustomDataset', data_root='data/demo/imagenet',
       #                      data_prefix='train')  -> classes = the wnid folder names

Each task directory gets a ``DEMO_DATA.txt`` stamp; a rerun wipes and rewrites a task
directory only if it carries that stamp (it refuses to touch anything else).
"""
import argparse
import json
import os
import os.path as osp
import shutil

import numpy as np
from PIL import Image

# Shape classes. Detection / segmentation use the first three, classification all five.
CLASSES = ('circle', 'rectangle', 'triangle')
CLS_CLASSES = ('circle', 'rectangle', 'triangle', 'cross', 'star')
WNIDS = tuple(f'n{i:08d}' for i in range(1, len(CLS_CLASSES) + 1))
# Names ADE20KDataset gives to train ids 0..2 (= label values 1..3 in the PNGs).
ADE_CLASS_ALIASES = ('wall', 'building', 'sky')

# Per-class base colour (RGB); every object jitters it by up to +-COLOR_JITTER per channel.
CLASS_COLORS = {
    'circle': (220, 50, 50),       # red
    'rectangle': (50, 190, 60),    # green
    'triangle': (50, 80, 220),     # blue
    'cross': (225, 205, 40),       # yellow
    'star': (200, 60, 200),        # magenta
}
COLOR_JITTER = 20
BG_GREY = (110, 160)  # background grey level range
BG_TINT = 6           # per-channel tint of the background
NOISE_SIGMA = 3.0     # pixel noise over the whole image
JPEG_KW = dict(quality=95, subsampling=0, optimize=False)

TASKS = ('coco', 'ade', 'imagenet')
_TASK_IDS = {'coco': 1, 'ade': 2, 'imagenet': 3}
STAMP = 'DEMO_DATA.txt'


# ----------------------------------------------------------------------------- geometry
def _unit_shape(name, rng):
    """Polygon (N, 2) of a shape centred at the origin, before scaling."""
    if name == 'circle':
        t = np.arange(24) * (2 * np.pi / 24)
        return np.stack([np.cos(t), np.sin(t)], 1)
    if name == 'rectangle':
        a = rng.uniform(0.55, 1.0)
        return np.array([[-1, -a], [1, -a], [1, a], [-1, a]], dtype=float)
    if name == 'triangle':
        t = np.deg2rad(-90 + np.arange(3) * 120)
        return np.stack([np.cos(t), np.sin(t)], 1)
    if name == 'cross':
        w = 0.33
        return np.array([[-w, -1], [w, -1], [w, -w], [1, -w], [1, w], [w, w], [w, 1],
                         [-w, 1], [-w, w], [-1, w], [-1, -w], [-w, -w]], dtype=float)
    if name == 'star':
        t = np.deg2rad(-90 + np.arange(10) * 36)
        r = np.where(np.arange(10) % 2 == 0, 1.0, 0.45)
        return np.stack([r * np.cos(t), r * np.sin(t)], 1)
    raise ValueError(name)


def _make_polygon(name, extent, rng):
    """Randomly rotated polygon whose larger bbox side is ``extent`` px, centred at 0."""
    poly = _unit_shape(name, rng)
    if name != 'circle':
        max_rot = {'rectangle': 30, 'triangle': 25, 'cross': 20, 'star': 36}[name]
        ang = np.deg2rad(rng.uniform(-max_rot, max_rot))
        rot = np.array([[np.cos(ang), -np.sin(ang)], [np.sin(ang), np.cos(ang)]])
        poly = poly @ rot.T
    poly = poly - (poly.min(0) + poly.max(0)) / 2
    return poly * (extent / (poly.max(0) - poly.min(0)).max())


def rasterize(poly, h, w):
    """Boolean (h, w) mask of the pixels whose centres (x + .5, y + .5) lie in ``poly``.

    This is the convention pycocotools uses when it decodes polygon segmentations, so
    ``COCO.annToMask`` reproduces these masks up to a few boundary pixels.
    """
    poly = np.asarray(poly, dtype=float)
    mask = np.zeros((h, w), dtype=bool)
    x0, y0 = np.floor(poly.min(0)).astype(int)
    x1, y1 = np.ceil(poly.max(0)).astype(int)
    x0, y0, x1, y1 = max(x0, 0), max(y0, 0), min(x1, w), min(y1, h)
    if x1 <= x0 or y1 <= y0:
        return mask
    py, px = np.mgrid[y0:y1, x0:x1].astype(float) + 0.5
    inside = np.zeros(py.shape, dtype=bool)
    for (xa, ya), (xb, yb) in zip(poly, np.roll(poly, -1, axis=0)):
        if ya == yb:
            continue  # horizontal edges never cross a horizontal ray
        crosses = (ya > py) != (yb > py)
        xint = xa + (py - ya) * (xb - xa) / (yb - ya)
        inside ^= crosses & (px < xint)
    mask[y0:y1, x0:x1] = inside
    return mask


# ----------------------------------------------------------------------------- scenes
def _background(rng, h, w):
    grey = rng.uniform(*BG_GREY)
    tint = rng.uniform(-BG_TINT, BG_TINT, size=3)
    return np.broadcast_to(grey + tint, (h, w, 3)).astype(np.float32)


def _finish(canvas, rng):
    canvas = canvas + rng.normal(0.0, NOISE_SIGMA, size=canvas.shape)
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


def _paint(canvas, mask, name, rng):
    color = np.clip(np.array(CLASS_COLORS[name], float)
                    + rng.uniform(-COLOR_JITTER, COLOR_JITTER, size=3), 0, 255)
    canvas[mask] = color


def render_scene(rng, h, w, classes=CLASSES, num_objects=(1, 4), size_range=(0.2, 0.5),
                 gap=2.0, max_tries=60):
    """Draw 1-4 non-overlapping shapes of random classes.

    Returns ``(img, objects)``: ``img`` is a (h, w, 3) uint8 RGB array, ``objects`` a list
    of dicts with ``label`` (0-based index into ``classes``), ``name``, ``polygon`` ((N, 2)
    float array, rounded to 0.01 px, exactly what is written to the annotation) and
    ``mask`` ((h, w) bool, exactly the painted pixels).
    """
    canvas = _background(rng, h, w).copy()
    side = min(h, w)
    smin, smax = size_range[0] * side, size_range[1] * side
    n = int(rng.integers(num_objects[0], num_objects[1] + 1))
    boxes, objects = [], []
    for _ in range(n):
        label = int(rng.integers(len(classes)))
        name = classes[label]
        for k in range(max_tries):
            # shrink the size range as placements fail so crowded images still fit
            hi = smax - (smax - smin) * k / max_tries
            poly = _make_polygon(name, rng.uniform(smin, hi), rng)
            ext = poly.max(0) - poly.min(0)
            if ext[0] > w - 2 or ext[1] > h - 2:
                continue
            cx = rng.uniform(1 - poly.min(0)[0], w - 1 - poly.max(0)[0])
            cy = rng.uniform(1 - poly.min(0)[1], h - 1 - poly.max(0)[1])
            cand = np.round(poly + (cx, cy), 2)
            box = np.concatenate([cand.min(0), cand.max(0)])
            if all(box[0] > b[2] + gap or box[2] < b[0] - gap or box[1] > b[3] + gap
                   or box[3] < b[1] - gap for b in boxes):
                break
        else:
            continue  # no room left for this one
        mask = rasterize(cand, h, w)
        if not mask.any():
            continue
        boxes.append(box)
        _paint(canvas, mask, name, rng)
        objects.append(dict(label=label, name=name, polygon=cand, mask=mask))
    return _finish(canvas, rng), objects


def render_single(rng, h, w, label, classes=CLS_CLASSES, size_range=(0.35, 0.7)):
    """One object of class ``label`` at a random position (classification images)."""
    canvas = _background(rng, h, w).copy()
    name = classes[label]
    side = min(h, w)
    poly = _make_polygon(name, rng.uniform(size_range[0] * side, size_range[1] * side), rng)
    cx = rng.uniform(1 - poly.min(0)[0], w - 1 - poly.max(0)[0])
    cy = rng.uniform(1 - poly.min(0)[1], h - 1 - poly.max(0)[1])
    poly = np.round(poly + (cx, cy), 2)
    _paint(canvas, rasterize(poly, h, w), name, rng)
    return _finish(canvas, rng)


def image_rng(seed, task, split, index):
    """Independent RNG stream per (seed, task, split, image index)."""
    return np.random.default_rng([seed, _TASK_IDS[task], 0 if split == 'train' else 1, index])


# ----------------------------------------------------------------------------- writers
def _save_jpg(arr, path):
    Image.fromarray(arr, 'RGB').save(path, format='JPEG', **JPEG_KW)


def _prepare_root(root, params):
    """Create ``root``; wipe it first if it holds a previous run (our stamp file)."""
    if osp.isdir(root) and os.listdir(root):
        if not osp.isfile(osp.join(root, STAMP)):
            raise SystemExit(f'{root} exists, is not empty and was not written by '
                             f'{osp.basename(__file__)} (no {STAMP}); refusing to overwrite.')
        shutil.rmtree(root)
    os.makedirs(root, exist_ok=True)
    with open(osp.join(root, STAMP), 'w') as f:
        f.write('Synthetic demo data written by tools/make_demo_data.py; this directory '
                'is wiped on the next run.\n')
        f.write(json.dumps(params, sort_keys=True) + '\n')


def make_coco(out, num_train, num_val, size, seed):
    h, w = size
    root = osp.join(out, 'coco')
    _prepare_root(root, dict(task='coco', num_train=num_train, num_val=num_val,
                             size=[h, w], seed=seed))
    os.makedirs(osp.join(root, 'annotations'))
    categories = [dict(id=i + 1, name=c, supercategory='shape') for i, c in enumerate(CLASSES)]
    stats, image_id, ann_id = {}, 0, 0
    for split, num in (('train', num_train), ('val', num_val)):
        img_dir = osp.join(root, f'{split}2017')
        os.makedirs(img_dir)
        images, anns = [], []
        for idx in range(num):
            image_id += 1
            img, objects = render_scene(image_rng(seed, 'coco', split, idx), h, w)
            file_name = f'{image_id:012d}.jpg'
            _save_jpg(img, osp.join(img_dir, file_name))
            images.append(dict(id=image_id, file_name=file_name, height=h, width=w))
            for obj in objects:
                ann_id += 1
                poly = obj['polygon']
                x0, y0 = np.clip(poly.min(0), 0, (w, h))
                x1, y1 = np.clip(poly.max(0), 0, (w, h))
                anns.append(dict(
                    id=ann_id, image_id=image_id, category_id=obj['label'] + 1,
                    segmentation=[[round(float(v), 2) for v in poly.ravel()]],
                    area=float(obj['mask'].sum()),
                    bbox=[round(float(v), 2) for v in (x0, y0, x1 - x0, y1 - y0)],
                    iscrowd=0))
        coco = dict(
            info=dict(description='mmplugin_l2 synthetic demo data (make_demo_data.py)',
                      version='1.0', year=2024, contributor='mmplugin_l2',
                      date_created='1970-01-01'),
            licenses=[dict(id=1, name='CC0', url='')],
            images=images, annotations=anns, categories=categories)
        with open(osp.join(root, 'annotations', f'instances_{split}2017.json'), 'w') as f:
            json.dump(coco, f)
        stats[split] = (len(images), len(anns))
    print(f"coco: train {stats['train'][0]} images / {stats['train'][1]} instances, "
          f"val {stats['val'][0]} images / {stats['val'][1]} instances, "
          f"{len(CLASSES)} classes {CLASSES} -> {root}/{{train2017,val2017}}, "
          f"{root}/annotations/instances_{{train,val}}2017.json")
    return root


def make_ade(out, num_train, num_val, size, seed):
    h, w = size
    task_root = osp.join(out, 'ade')
    _prepare_root(task_root, dict(task='ade', num_train=num_train, num_val=num_val,
                                  size=[h, w], seed=seed))
    root = osp.join(task_root, 'ADEChallengeData2016')
    counts = {}
    for split, num, sub, prefix in (('train', num_train, 'training', 'ADE_train'),
                                    ('val', num_val, 'validation', 'ADE_val')):
        img_dir = osp.join(root, 'images', sub)
        ann_dir = osp.join(root, 'annotations', sub)
        os.makedirs(img_dir)
        os.makedirs(ann_dir)
        pix = np.zeros(len(CLASSES) + 1, dtype=np.int64)
        for idx in range(num):
            img, objects = render_scene(image_rng(seed, 'ade', split, idx), h, w)
            seg = np.zeros((h, w), dtype=np.uint8)  # 0 = background / "other"
            for obj in objects:
                seg[obj['mask']] = obj['label'] + 1
            name = f'{prefix}_{idx + 1:08d}'
            _save_jpg(img, osp.join(img_dir, name + '.jpg'))
            Image.fromarray(seg, 'L').save(osp.join(ann_dir, name + '.png'), format='PNG')
            pix += np.bincount(seg.ravel(), minlength=len(CLASSES) + 1)
        counts[split] = (num, pix)
    frac = counts['train'][1] / max(counts['train'][1].sum(), 1)
    print(f"ade: train {counts['train'][0]} / val {counts['val'][0]} image+label pairs, "
          f"labels 0=background(ignored) " + ' '.join(
              f'{i + 1}={c}' for i, c in enumerate(CLASSES))
          + f" (train pixel share {', '.join(f'{v:.2f}' for v in frac)}) -> "
          f"{root}/{{images,annotations}}/{{training,validation}}")
    return root


def make_imagenet(out, num_train, num_val, size, seed):
    h, w = size
    root = osp.join(out, 'imagenet')
    _prepare_root(root, dict(task='imagenet', num_train=num_train, num_val=num_val,
                             size=[h, w], seed=seed))
    os.makedirs(osp.join(root, 'meta'))
    for split, num in (('train', num_train), ('val', num_val)):
        for wnid in WNIDS:
            os.makedirs(osp.join(root, split, wnid))
        lines, per_class = [], [0] * len(WNIDS)
        for idx in range(num):
            label = idx % len(WNIDS)  # balanced classes
            wnid = WNIDS[label]
            img = render_single(image_rng(seed, 'imagenet', split, idx), h, w, label)
            if split == 'train':
                rel = f'{wnid}/{wnid}_{per_class[label]:08d}.JPEG'
            else:
                rel = f'{wnid}/ILSVRC2012_val_{idx + 1:08d}.JPEG'
            per_class[label] += 1
            _save_jpg(img, osp.join(root, split, rel))
            lines.append(f'{rel} {label}')
        with open(osp.join(root, 'meta', f'{split}.txt'), 'w') as f:
            f.write(''.join(line + '\n' for line in sorted(lines)))
    print(f'imagenet: train {num_train} / val {num_val} images, {len(WNIDS)} classes '
          + ' '.join(f'{n}={c}' for n, c in zip(WNIDS, CLS_CLASSES))
          + f' -> {root}/{{train,val}}/<wnid>/*.JPEG, {root}/meta/{{train,val}}.txt')
    return root


MAKERS = dict(coco=make_coco, ade=make_ade, imagenet=make_imagenet)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--out', default='data/demo', help='output root (default: data/demo)')
    p.add_argument('--task', default='all', choices=TASKS + ('all',))
    p.add_argument('--num-train', type=int, default=200, help='train images per task')
    p.add_argument('--num-val', type=int, default=40, help='val images per task')
    p.add_argument('--size', type=int, nargs=2, default=(128, 128), metavar=('H', 'W'))
    p.add_argument('--seed', type=int, default=0)
    args = p.parse_args(argv)
    if args.num_train < 1 or args.num_val < 1:
        p.error('--num-train and --num-val must be >= 1')
    if min(args.size) < 32:
        p.error('--size must be at least 32 x 32')
    if args.seed < 0:
        p.error('--seed must be >= 0')
    return args


def main(argv=None):
    args = parse_args(argv)
    tasks = TASKS if args.task == 'all' else (args.task,)
    roots = {}
    for task in tasks:
        roots[task] = MAKERS[task](args.out, args.num_train, args.num_val,
                                   tuple(args.size), args.seed)
    return roots


if __name__ == '__main__':
    main()
