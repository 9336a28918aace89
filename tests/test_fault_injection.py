"""Fault injection: each case of issue 11's table (a skeptical user's probes) as a test.

* a checkpoint of another model given to tools/test.py: refused (keys listed), --non-strict evaluates;
* unreadable checkpoint files (empty, text, truncated, a plain pickle, a directory): one clear line;
* a training run killed with SIGKILL after a mid-epoch checkpoint, then `--resume`: the remaining
  per-iteration losses equal the uninterrupted run's bit for bit (stock demo augmentations, seed 0,
  deterministic);
* `--resume` with nothing to resume: an error;
* out_indices given as (-5,), duplicated, unsorted or empty: rejected, quoting what was passed;
* a batch of 0 images: empty maps of the right shapes;
* a training batch of 1 small image through a BatchNorm: a message saying why and what works.

The tool runs use one thread per process (OMP_NUM_THREADS=1): on a shared 2-core machine tiny models
train 10x faster so, and the compared runs must use the same thread count anyway (CPU reductions are
split by thread).
"""
import os
import os.path as osp
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, TINY_HVIT3, TINY_L2VIT, TINY_REST, TINY_VIT3
from mmplugin_l2 import L2ViT, ResT, HViT3, ViT3

TINY = f"backbone=dict(arch=dict(_delete_=True, {', '.join(f'{k}={v}' for k, v in TINY_HVIT3.items())}))"

#: records the exact loss of every iteration (float repr) and, with PAUSE_AT=N, waits after iteration N
#: until it is killed
LOSS_HOOK = '''
import os, time
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module()
class LossLogHook(Hook):
    priority = 'VERY_LOW'

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        with open(os.environ['LOSS_LOG'], 'a') as f:
            f.write(f'{runner.iter + 1} {outputs["loss"].item()!r}\\n')
            f.flush()
            os.fsync(f.fileno())
        if runner.iter + 1 == int(os.environ.get('PAUSE_AT', '0')):
            time.sleep(600)
'''

#: 24 training images, batch 4: 6 iterations per epoch, 2 epochs; a checkpoint every 4 iterations
#: (iteration 4 and 8 are inside an epoch), the demo's stock RandomResizedCrop + RandomFlip pipeline
CLS_EXTRA = (
    "custom_imports = dict(imports=['mmplugin_l2', 'losslog'], allow_failed_imports=False)\n"
    f"model = dict({TINY}, head=dict(in_channels=64))\n"
    "train_dataloader = dict(batch_size=4)\n"
    "train_cfg = dict(max_epochs=2, val_interval=2)\n"
    "randomness = dict(seed=0, deterministic=True)\n"
    "custom_hooks = [dict(type='ExactResumeHook'), dict(type='LossLogHook')]\n"
    "default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=4, by_epoch=False))\n")


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp('faults')
    r = subprocess.run([sys.executable, f'{ROOT}/tools/make_demo_data.py', '--out', str(d / 'data/demo'),
                        '--task', 'imagenet', '--num-train', '24', '--num-val', '4', '--size', '64', '64'],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (d / 'losslog.py').write_text(LOSS_HOOK)
    (d / 'cls.py').write_text(f"_base_ = '{ROOT}/configs/demo/hvit3_t_in1k_demo.py'\n{CLS_EXTRA}")
    return d


def env_for(workdir, **extra):
    return dict(os.environ, PYTHONPATH=str(workdir), OMP_NUM_THREADS='1', MKL_NUM_THREADS='1', **extra)


def tool(workdir, name, *args, env=None):
    return subprocess.run([sys.executable, f'{ROOT}/tools/{name}', *map(str, args)], cwd=workdir,
                          capture_output=True, text=True, env=env or env_for(workdir), timeout=600)


def read_losses(path):
    return dict(line.split() for line in open(path).read().splitlines())


def error_lines(stderr):
    return [ln for ln in stderr.splitlines() if ln.startswith('error:')]


# ---- a checkpoint of another model -----------------------------------------------------------------
def l2vit_classifier_checkpoint(path):
    from mmpretrain.registry import MODELS
    import mmpretrain.models  # noqa: F401
    model = MODELS.build(dict(  # _scope_: an earlier test may have left another default scope
        _scope_='mmpretrain', type='ImageClassifier',
        backbone=dict(type='L2ViT', arch=TINY_L2VIT, out_indices=(3,), final_norm=True),
        neck=dict(type='GlobalAveragePooling'),
        head=dict(type='LinearClsHead', num_classes=5, in_channels=64)))
    torch.save({'meta': {}, 'state_dict': model.state_dict()}, path)


def test_test_tool_refuses_another_models_checkpoint(workdir):
    ckpt = workdir / 'l2vit_cls.pth'
    l2vit_classifier_checkpoint(ckpt)
    r = tool(workdir, 'test.py', 'cls.py', ckpt, '--work-dir', 'wd_wrong')
    assert r.returncode != 0, r.stdout[-2000:]
    assert 'accuracy/top1' not in r.stdout
    msg = r.stderr
    assert 'Traceback' not in msg, msg[-3000:]
    assert f'error: {ckpt} does not fit ImageClassifier' in msg, msg[-3000:]
    assert 'missing keys: backbone.' in msg and 'unexpected keys: backbone.' in msg
    assert 'more)' in msg  # first few keys, then the count of the others
    assert '--non-strict' in msg
    # the user who means it
    r = tool(workdir, 'test.py', 'cls.py', ckpt, '--work-dir', 'wd_wrong', '--non-strict')
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'accuracy/top1' in r.stdout and 'does not fit ImageClassifier' in r.stdout + r.stderr


# ---- unreadable files ------------------------------------------------------------------------------
def _truncated(path):
    torch.save({'state_dict': {'w': torch.zeros(1000)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


BAD_FILES = {
    'empty': (lambda p: p.write_bytes(b''), 'empty'),
    'text': (lambda p: p.write_text('version https://git-lfs.github.com/spec/v1\noid sha256:0\n'),
             'text file'),
    'truncated': (_truncated, 'truncated or corrupt'),
    'pickle': (lambda p: p.write_bytes(pickle.dumps({'weights': [1, 2, 3]})), 'plain Python pickle'),
    'directory': (lambda p: p.mkdir(), 'directory'),
}


@pytest.mark.parametrize('kind', sorted(BAD_FILES))
def test_unreadable_checkpoint_one_clear_line(kind, tmp_path):
    from mmplugin_l2.checkpoint import load_checkpoint_file
    make, what = BAD_FILES[kind]
    path = tmp_path / f'{kind}.pth'
    make(path)
    with pytest.raises(Exception) as info:
        load_checkpoint_file(path)
    err = info.value
    assert isinstance(err, ValueError) and type(err).__name__ == 'CheckpointError', repr(err)
    msg = str(err)
    assert '\n' not in msg and str(path) in msg and what in msg, msg
    assert 'expected a PyTorch checkpoint written by torch.save' in msg, msg


def test_test_tool_on_empty_checkpoint(workdir):
    (workdir / 'empty.pth').write_bytes(b'')
    r = tool(workdir, 'test.py', 'cls.py', 'empty.pth', '--work-dir', 'wd_empty')
    assert r.returncode != 0 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    assert error_lines(r.stderr) == ["error: cannot read checkpoint 'empty.pth': the file is empty (0 bytes; "
                                     "an interrupted copy or download?); expected a PyTorch checkpoint written "
                                     "by torch.save (e.g. a .pth file of tools/train.py)"], r.stderr[-2000:]


# ---- exact resume ----------------------------------------------------------------------------------
def test_resume_after_sigkill_is_bit_exact(workdir):
    # the uninterrupted run
    r = tool(workdir, 'train.py', 'cls.py', '--work-dir', 'wd_full', env=env_for(workdir, LOSS_LOG='full.txt'))
    assert r.returncode == 0, r.stderr[-3000:]
    full = read_losses(workdir / 'full.txt')
    assert list(full) == [str(i) for i in range(1, 13)]
    # the same run, killed (SIGKILL) at iteration 10: its last checkpoint is iteration 8, 2 batches into
    # the second epoch
    log = workdir / 'killed.txt'
    proc = subprocess.Popen([sys.executable, f'{ROOT}/tools/train.py', 'cls.py', '--work-dir', 'wd_kill'],
                            cwd=workdir, env=env_for(workdir, LOSS_LOG=str(log), PAUSE_AT='10'),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (log.is_file() and len(log.read_text().splitlines()) >= 10):
            assert proc.poll() is None and time.time() < deadline, 'the run to kill ended early'
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert (workdir / 'wd_kill' / 'last_checkpoint').read_text().strip().endswith('iter_8.pth')
    # the run before the kill equals the uninterrupted one (same process, same seed)
    assert read_losses(log) == {k: v for k, v in full.items() if int(k) <= 10}
    r = tool(workdir, 'train.py', 'cls.py', '--work-dir', 'wd_kill', '--resume',
             env=env_for(workdir, LOSS_LOG='resumed.txt'))
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = read_losses(workdir / 'resumed.txt')
    after = [k for k in full if int(k) > 8]
    same = [k for k in after if resumed.get(k) == full[k]]
    assert same == after, f'bit-identical: {len(same)} of {len(after)}\nresumed {resumed}\nfull {full}'
    assert list(resumed) == after
    assert 'skipped 2 batches already trained' in r.stdout + r.stderr


def test_resume_with_nothing_to_resume_is_an_error(workdir):
    r = tool(workdir, 'train.py', 'cls.py', '--work-dir', 'wd_nothing', '--resume')
    assert r.returncode != 0 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    (line,) = error_lines(r.stderr)
    assert "--resume: nothing to resume in work dir 'wd_nothing'" in line
    assert 'without --resume' in line
    assert not (workdir / 'wd_nothing' / 'epoch_1.pth').exists()


# ---- input validation ------------------------------------------------------------------------------
BACKBONES = {
    'HViT3': lambda **kw: HViT3(arch=TINY_HVIT3, **kw),
    'L2ViT': lambda **kw: L2ViT(arch=TINY_L2VIT, **kw),
    'ResT': lambda **kw: ResT(arch=TINY_REST, **kw),
}


@pytest.mark.parametrize('name', sorted(BACKBONES))
def test_out_indices_error_quotes_what_was_passed(name):
    with pytest.raises(ValueError) as info:
        BACKBONES[name](out_indices=(-5,))
    assert 'out_indices=(-5,)' in str(info.value) and '[-4, 4)' in str(info.value), str(info.value)


@pytest.mark.parametrize('name', sorted(BACKBONES))
@pytest.mark.parametrize('out_indices, why', [((0, 0), 'twice'), ((1, 0), 'increasing stage order'),
                                              ((), 'selects no stage'), ((3, -1), 'twice')])
def test_out_indices_duplicate_unsorted_empty_rejected(name, out_indices, why):
    with pytest.raises(ValueError) as info:
        BACKBONES[name](out_indices=out_indices)
    assert f'out_indices={out_indices!r}' in str(info.value) and why in str(info.value), str(info.value)


ALL = dict(BACKBONES, ViT3=lambda **kw: ViT3(arch=TINY_VIT3, **kw))


@pytest.mark.parametrize('name', sorted(ALL))
@pytest.mark.parametrize('train', [False, True])
def test_empty_batch_gives_empty_maps(name, train):
    model = ALL[name]().train(train)
    ref = [tuple(o.shape[1:]) for o in model.eval()(torch.randn(2, 3, 45, 61))]
    model.train(train)
    outs = model(torch.randn(0, 3, 45, 61))
    assert [tuple(o.shape) for o in outs] == [(0, *s) for s in ref]
    assert model.training == train


@pytest.mark.parametrize('name', ['HViT3', 'ResT'])
def test_batchnorm_batch_of_one_is_explained(name):
    model = BACKBONES[name](out_indices=(3,), out_norm_cfg=dict(type='BN')).train()
    with pytest.raises(ValueError) as info:
        model(torch.randn(1, 3, 31, 31))
    msg = str(info.value)
    assert msg.startswith(f'{name}: a BatchNorm in training mode got one value per channel'), msg
    assert 'batch of 1 image(s) of 31x31' in msg and 'stage 3 is 1x1' in msg
    assert 'at least 2 images' in msg and 'norm_eval=True' in msg
    # what the message says works does work
    model(torch.randn(2, 3, 31, 31))
    BACKBONES[name](out_indices=(3,), out_norm_cfg=dict(type='BN'), norm_eval=True).train()(
        torch.randn(1, 3, 31, 31))


def test_pretrained_non_strict_loads_what_fits(tmp_path):
    src = HViT3(arch=TINY_HVIT3)
    sd = dict(src.state_dict())
    sd['extra.weight'] = torch.zeros(3)
    path = tmp_path / 'w.pth'
    torch.save({'state_dict': sd}, path)
    with pytest.raises(ValueError, match='1 unexpected keys: extra.weight'):
        HViT3(arch=TINY_HVIT3, init_cfg=dict(type='Pretrained', checkpoint=str(path))).init_weights()
    dst = HViT3(arch=TINY_HVIT3, init_cfg=dict(type='Pretrained', checkpoint=str(path), strict=False))
    dst.init_weights()
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert osp.isfile(path)
