"""End to end through the real mmengine Runner: tools/train.py and tools/test.py on generated data for
mmdet (Mask R-CNN, COCO AP), mmseg (UperNet, mIoU) and mmpretrain (top-1), checkpoint save -> load with
torch's safe loader, --resume, --show-dir (det, seg, cls), a 2-process distributed run on CPU (gloo), and the
missing-data message."""
import glob
import json
import os
import os.path as osp
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_HVIT3

TINY = ("backbone=dict(arch=dict(_delete_=True, embed_dims=[16, 32, 64, 64], depths=[1, 1, 2, 1], "
        "num_heads=[1, 1, 2, 2]))")
assert str(TINY_HVIT3['embed_dims']) in TINY


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    """A folder holding data/demo (small generated datasets), used as the tools' working directory."""
    d = tmp_path_factory.mktemp('tools')
    r = subprocess.run([sys.executable, f'{ROOT}/tools/make_demo_data.py', '--out', str(d / 'data/demo'),
                        '--num-train', '8', '--num-val', '4', '--size', '64', '64'],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d


def write_cfg(workdir, name, base, extra=''):
    path = workdir / f'{name}.py'
    path.write_text(f"_base_ = '{ROOT}/configs/demo/{base}'\n{extra}")
    return str(path)


def run(workdir, *args, tool='train.py', check=True, env=None):
    cmd = [sys.executable, f'{ROOT}/tools/{tool}', *map(str, args)] if tool.endswith('.py') else \
        ['bash', f'{ROOT}/tools/{tool}', *map(str, args)]
    r = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env, timeout=900)
    if check:
        assert r.returncode == 0, f'{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}'
    return r


def assert_drawn(workdir, work_dir, img_dir):
    """--show-dir vis, one rule for det / seg / cls: a relative DIR is <work_dir>/<timestamp>/DIR, one drawn file
    per test image (the four under data/demo/`img_dir`), named like the image. Returns the image names."""
    images = sorted(osp.basename(p) for p in glob.glob(str(workdir / 'data/demo' / img_dir / '**/*'), recursive=True)
                    if p.lower().endswith(('.jpg', '.jpeg')))
    assert len(images) == 4
    wd = workdir / work_dir
    (stamp,) = [d for d in os.listdir(wd) if osp.isdir(wd / d)]
    assert sorted(os.listdir(wd / stamp / 'vis')) == images
    assert not osp.exists(workdir / 'vis')
    return images


def test_mmdet_train_then_test(workdir):
    cfg = write_cfg(workdir, 'det', 'mask_rcnn_hvit3_t_demo.py', (
        f"model = dict({TINY}, neck=dict(in_channels=[16, 32, 64, 64]))\n"
        "train_dataloader = dict(batch_size=4)\n"
        "train_cfg = dict(max_epochs=1, val_interval=1)\n"
        "default_hooks = dict(checkpoint=dict(interval=1))\n"))
    run(workdir, cfg, '--work-dir', 'wd_det')
    ckpt = workdir / 'wd_det' / 'epoch_1.pth'
    assert ckpt.is_file()
    r = run(workdir, cfg, ckpt, '--work-dir', 'wd_det_test', '--show-dir', 'vis', '--out', 'det.json',
            tool='test.py')
    metrics = json.loads((workdir / 'det.json').read_text())
    for key in ('coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP'):
        assert key in metrics and 0.0 <= metrics[key] <= 1.0, metrics
        assert key in r.stdout
    assert_drawn(workdir, 'wd_det_test', 'coco/val2017')


def test_mmseg_train_then_test(workdir):
    cfg = write_cfg(workdir, 'seg', 'upernet_hvit3_t_demo.py', (
        f"model = dict({TINY}, decode_head=dict(in_channels=[16, 32, 64, 64], channels=32),\n"
        "             auxiliary_head=dict(in_channels=64, channels=16))\n"
        "train_dataloader = dict(batch_size=2)\n"
        "train_cfg = dict(max_iters=2, val_interval=2)\n"
        "default_hooks = dict(checkpoint=dict(interval=2))\n"))
    run(workdir, cfg, '--work-dir', 'wd_seg')
    ckpt = workdir / 'wd_seg' / 'iter_2.pth'
    assert ckpt.is_file()
    r = run(workdir, cfg, ckpt, '--work-dir', 'wd_seg_test', '--show-dir', 'vis', '--out', 'seg.json',
            tool='test.py')
    metrics = json.loads((workdir / 'seg.json').read_text())
    assert 'mIoU' in metrics and 0.0 <= metrics['mIoU'] <= 100.0
    assert 'mIoU' in r.stdout
    assert_drawn(workdir, 'wd_seg_test', 'ade/ADEChallengeData2016/images/validation')


def cls_cfg(workdir, name='cls', extra=''):
    return write_cfg(workdir, name, 'hvit3_t_in1k_demo.py', (
        f"model = dict({TINY}, head=dict(in_channels=64))\n"
        "train_dataloader = dict(batch_size=4)\n"
        "train_cfg = dict(max_epochs=1, val_interval=1)\n"
        "default_hooks = dict(checkpoint=dict(interval=1))\n" + extra))


def test_mmpretrain_train_resume_test(workdir):
    cfg = cls_cfg(workdir)
    run(workdir, cfg, '--work-dir', 'wd_cls')
    assert (workdir / 'wd_cls' / 'epoch_1.pth').is_file()
    # resume reads the mmengine checkpoint (message hub, optimizer, numpy state) with torch's safe loader
    r = run(workdir, cfg, '--work-dir', 'wd_cls', '--resume', '--cfg-options', 'train_cfg.max_epochs=2')
    log = r.stdout + r.stderr
    assert 'resumed epoch: 1' in log, log[-3000:]
    assert (workdir / 'wd_cls' / 'epoch_2.pth').is_file()
    r = run(workdir, cfg, workdir / 'wd_cls' / 'epoch_2.pth', '--work-dir', 'wd_cls_test', '--show-dir', 'vis',
            '--out', 'cls.json', tool='test.py')
    metrics = json.loads((workdir / 'cls.json').read_text())
    assert 0.0 <= metrics['accuracy/top1'] <= 100.0
    assert 'accuracy/top1' in r.stdout
    images = assert_drawn(workdir, 'wd_cls_test', 'imagenet/val')
    # an absolute --show-dir is used as is
    run(workdir, cfg, workdir / 'wd_cls' / 'epoch_2.pth', '--work-dir', 'wd_cls_test', '--show-dir',
        workdir / 'abs_vis', tool='test.py')
    assert sorted(os.listdir(workdir / 'abs_vis')) == images


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_distributed_two_processes(workdir):
    cfg = cls_cfg(workdir, 'cls_dist', "train_dataloader = dict(batch_size=2)\n")
    env = dict(os.environ, PORT=str(free_port()), OMP_NUM_THREADS='1')
    r = run(workdir, cfg, 2, '--work-dir', 'wd_dist', tool='dist_train.sh', env=env)
    log = r.stdout + r.stderr
    assert 'world_size: 2' in log or "'world_size': 2" in log or 'Distributed training: True' in log, log[-3000:]
    # 8 images, 2 per process, 2 processes: 2 iterations in the epoch
    logs = glob.glob(str(workdir / 'wd_dist' / '*' / '*.log'))
    assert logs and 'Epoch(train) [1][2/2]' in open(logs[0]).read()
    assert (workdir / 'wd_dist' / 'epoch_1.pth').is_file()
    r = run(workdir, cfg, workdir / 'wd_dist' / 'epoch_1.pth', 2, '--out', 'dist.json', tool='dist_test.sh',
            env=dict(env, PORT=str(free_port())))
    assert 'accuracy/top1' in json.loads((workdir / 'dist.json').read_text())


def test_missing_dataset_is_explained(tmp_path):
    r = run(tmp_path, f'{ROOT}/configs/mmdet/mask_rcnn_hvit3_t_1x.py', check=False)
    assert r.returncode != 0
    assert "dataset path not found: 'data/coco/'" in r.stderr
    assert 'make_demo_data.py' in r.stderr and 'Traceback' not in r.stderr
    ckpt = tmp_path / 'x.pth'
    ckpt.write_bytes(b'')
    r = run(tmp_path, f'{ROOT}/configs/mmseg/upernet_hvit3_t_512x512_160k_ade20k.py', ckpt, tool='test.py',
            check=False)
    assert r.returncode != 0 and 'data/ade/ADEChallengeData2016' in r.stderr and 'Traceback' not in r.stderr


def test_missing_pretrained_weights_are_explained(workdir):
    cfg = write_cfg(workdir, 'det_pre', 'mask_rcnn_hvit3_t_demo.py', (
        "model = dict(backbone=dict(init_cfg=dict(_delete_=True, type='Pretrained', "
        "checkpoint='data/pretrained/nope.pth')))\n"))
    r = run(workdir, cfg, '--work-dir', 'wd_pre', check=False)
    assert r.returncode != 0 and 'Traceback' not in r.stderr
    assert "pretrained backbone weights not found: 'data/pretrained/nope.pth'" in r.stderr
    assert 'model.backbone.init_cfg=None' in r.stderr


def test_profile_iteration_splits_a_mask_rcnn_iteration(workdir):
    """tools/analysis/profile_iteration.py on the demo Mask R-CNN (narrow backbone): every part of the
    iteration is timed, the parts add up to the total, the backward is split at the backbone's outputs."""
    cfg = write_cfg(workdir, 'det_prof', 'mask_rcnn_hvit3_t_demo.py',
                    f"model = dict({TINY}, neck=dict(in_channels=[16, 32, 64, 64]))\n")
    run(workdir, cfg, '--iters', '2', '--warmup', '0', '--out', 'prof.json', tool='analysis/profile_iteration.py')
    rows = {r['part']: r for r in json.loads((workdir / 'prof.json').read_text())['rows']}
    for part in ('data loading', 'data preprocessor', 'forward, backbone', 'forward, neck', 'forward, rpn_head',
                 'forward, roi_head', 'forward, other', 'backward, heads + neck', 'backward, backbone',
                 'optimizer step'):
        assert rows[part]['median_s'] >= 0 and rows[part]['min_s'] <= rows[part]['max_s'], part
    for part in ('forward, backbone', 'forward, roi_head', 'backward, heads + neck', 'backward, backbone'):
        assert rows[part]['median_s'] > 0, part
    parts = sum(r['median_s'] for k, r in rows.items() if k != 'total')
    assert abs(parts - rows['total']['median_s']) < 0.2 * rows['total']['median_s']
    r = run(workdir, cfg, '--iters', '0', tool='analysis/profile_iteration.py', check=False)
    assert r.returncode != 0 and '--iters must be >= 1' in r.stderr


def test_profile_iteration_trains_the_whole_model(workdir, monkeypatch):
    """The split backward is the whole backward: after one profiled iteration every trainable parameter of
    the detector, backbone included, has been updated by the optimizer (AdamW skips parameters without a
    gradient), as after `model.train_step`."""
    import torch

    from mmplugin_l2.analysis import iteration
    from mmplugin_l2.apis.runner import build_runner, load_config
    monkeypatch.chdir(workdir)
    cfg = write_cfg(workdir, 'det_prof2', 'mask_rcnn_hvit3_t_demo.py',
                    f"model = dict({TINY}, neck=dict(in_channels=[16, 32, 64, 64]))\n")
    runner = build_runner(load_config(cfg, work_dir=str(workdir / 'wd_prof2')))
    model, optim, loader = iteration.prepare(runner)
    model.train()
    before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    parts = iteration.iteration(model, optim, next(iter(loader)))
    assert parts['backward, backbone'] > 0 and parts['backward, heads + neck'] > 0
    unchanged = [k for k, p in model.named_parameters() if k in before and torch.equal(p, before[k])]
    # parameters no loss reaches in a Mask R-CNN iteration would be a bug of the split, not of the model
    assert not [k for k in unchanged if k.startswith('backbone.')], unchanged


@pytest.mark.parametrize('content', [b'', b'not an image at all', 'truncated'])
def test_unreadable_image_is_one_line_naming_the_file(tmp_path, content):
    """The image reader of tools/analysis (vis_attention.py, erf.py): an empty, non-image or truncated file gives a
    one-line ValueError with the file's name, not PIL's traceback."""
    from PIL import Image
    from mmplugin_l2.analysis.inputs import load_image
    good = tmp_path / 'good.png'
    Image.new('RGB', (20, 10), (10, 200, 30)).save(good)
    x, img = load_image(str(good), (8, 12))
    assert x.shape == (1, 3, 8, 12) and img.shape == (8, 12, 3)
    bad = tmp_path / 'bad.jpg'
    if content == 'truncated':
        Image.new('RGB', (64, 64), (10, 200, 30)).save(tmp_path / 'full.jpg')
        content = (tmp_path / 'full.jpg').read_bytes()[:200]
    bad.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_image(str(bad), (8, 12))
    msg = str(info.value)
    assert str(bad) in msg and 'cannot be read' in msg and '\n' not in msg
    assert ('empty file' in msg) == (content == b'')
