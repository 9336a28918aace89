"""GPU readiness without a GPU: every backbone runs forward and backward on the meta device (no host
synchronisation: meta tensors raise on .item() / .tolist() / .cpu() and on Python branching on their
values), and tools/analysis/device_check.py runs end to end on the CPU without mmdet."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from conftest import ROOT, TINY_HVIT3, TINY_L2VIT, TINY_REST

from mmplugin_l2.models.backbones import HViT3, L2ViT, ResT, ViT3

#: label -> builder; tiny widths, plus one real architecture per family (free on the meta device)
BACKBONES = {
    'hvit3_tiny_widths': lambda **kw: HViT3(arch=TINY_HVIT3, **kw),
    'hvit3_t': lambda **kw: HViT3(arch='tiny', **kw),
    'vit3_t': lambda **kw: ViT3(arch='tiny', **kw),
    'l2vit_tiny_widths': lambda **kw: L2ViT(arch=TINY_L2VIT, **kw),
    'l2vit_t': lambda **kw: L2ViT(arch='tiny', **kw),
    'rest_tiny_widths': lambda **kw: ResT(arch=TINY_REST, **kw),
    'rest_s': lambda **kw: ResT(arch='small', **kw),
}
#: label -> (constructor overrides, train mode, autograd on)
MODES = {
    'train': ({}, True, True),                               # default recompute paths
    'train_with_cp': (dict(with_cp=True), True, True),       # + activation checkpointing per block
    'train_no_recompute': (None, True, True),                # the plain autograd path (see _no_recompute)
    'eval_grad': ({}, False, True),                          # eval mode, autograd recording
    'eval_no_grad': ({}, False, False),                      # inference
}


def _no_recompute(label):
    return {} if label.startswith('rest') else dict(recompute=False)


def meta_step(model, train, grad, size=(800, 1344), batch=2):
    """Forward (+ backward of the summed output means when `grad`) of `model` moved to the meta device."""
    model = model.to('meta').train(train)
    x = torch.randn(batch, 3, *size, device='meta', requires_grad=grad)
    with torch.set_grad_enabled(grad):
        outs = model(x)
        if grad:
            sum(o.float().mean() for o in outs).backward()
    return outs, x


@pytest.mark.parametrize('mode', list(MODES))
@pytest.mark.parametrize('backbone', list(BACKBONES))
def test_forward_backward_on_meta_device(backbone, mode):
    """Built on, and run on, the meta device: device-agnostic and free of host synchronisation in forward
    and backward (every mode)."""
    overrides, train, grad = MODES[mode]
    overrides = _no_recompute(backbone) if overrides is None else overrides
    size = (224, 224) if backbone.startswith('vit3') else (800, 1344)
    with torch.device('meta'):
        model = BACKBONES[backbone](drop_path_rate=0.1, **overrides)
    outs, x = meta_step(model, train, grad, size)
    assert all(o.device.type == 'meta' for o in outs)
    if backbone.startswith('vit3'):
        assert [tuple(o.shape) for o in outs] == [(2, 192, 14, 14)]
    else:
        assert [tuple(o.shape[2:]) for o in outs] == [(200, 336), (100, 168), (50, 84), (25, 42)]
    if grad:
        assert x.grad is not None and x.grad.shape == x.shape


class _Syncs(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x.movedim(1, -1))
        if self.how == 'item':
            return y * y.abs().max().item()
        if self.how == 'tolist':
            return y[..., :int(y.shape[-1])] * len(y.flatten()[:2].tolist())
        if self.how == 'cpu':
            return y.cpu()
        if self.how == 'branch':
            return y if bool((y > 0).any()) else -y
        return y


@pytest.mark.parametrize('how', ['item', 'tolist', 'cpu', 'branch'])
def test_meta_step_catches_host_synchronisation(how):
    """The check above can fail: each kind of host synchronisation raises on the meta device."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        meta_step(_Syncs(how), True, True, size=(4, 4))
    meta_step(_Syncs('none'), True, True, size=(4, 4))


# ---- tools/analysis/device_check.py on the CPU ------------------------------------------------------------

def _no_mmdet(tmp_path):
    """A folder that, first on PYTHONPATH, makes `import mmdet` fail as on a machine without it."""
    pkg = tmp_path / 'shadow' / 'mmdet'
    pkg.mkdir(parents=True)
    (pkg / '__init__.py').write_text("raise ImportError('mmdet is not installed here (test shadow)')\n")
    return str(tmp_path / 'shadow')


def test_device_check_runs_on_cpu_without_mmdet(tmp_path):
    out = tmp_path / 'dc'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_no_mmdet(tmp_path), ROOT]))
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/device_check.py', '--device', 'cpu', '--tiny',
                        '--parity-size', '64', '--amp-size', '64x96', '--bench', '64/b1', '64x96/b2',
                        '--warmup', '0', '--iters', '1', '--budget', '1800', '--out-dir', str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=2400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((out / 'device_check.json').read_text())
    assert set(res['parts']) == {'parity', 'sync', 'amp', 'latency', 'train'}
    assert not [p for p, v in res['parts'].items() if 'error' in v], res['parts']
    env_ = res['env']
    assert env_['backbones_import'] == []  # neither mmdet nor mmcv's compiled ops
    assert env_['mmdet'].startswith('unavailable') and env_['swin_source'].startswith('timm')
    models = ['hvit3_t', 'l2vit_t', 'rest_s']
    for n in models:
        assert len(res['parts']['parity'][n]['rel_max']) == 4
        assert max(res['parts']['parity'][n]['rel_max']) < 1e-4  # fp32 vs float64 on the same CPU
        for dt in ('fp16', 'bf16'):
            a = res['parts']['amp'][n][dt]
            assert a['finite'] and len(a['rel_l2']) == 4 and 0 < max(a['rel_l2']) < 0.1
    assert 'skipped' in res['parts']['sync']
    for spec in ('64/b1', '64x96/b2'):
        lat = res['parts']['latency'][spec]
        assert set(lat) == set(models) | {'swin_t'} and all(v['median_ms'] > 0 for v in lat.values())
        tr = res['parts']['train'][spec]
        assert {'hvit3_t', 'hvit3_t[cp]', 'hvit3_t[norecompute]', 'l2vit_t[norecompute+cp]', 'rest_s[cp]',
                'swin_t'} <= set(tr)
        assert all('error' not in v and v['step_ms'] > 0 and v['peak_mem_mb'] is None for v in tr.values()), tr
    md = (out / 'device_check.md').read_text()
    assert '## parity' in md and '**64x96/b2**' in md and '`hvit3_t[cp]`' in md


def test_device_check_refuses_cuda_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip('a CUDA device is present')
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/device_check.py', '--out-dir', str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and 'torch sees no CUDA device' in r.stderr and '--device cpu' in r.stderr


def test_device_check_part_time_limit(tmp_path):
    """A part that runs past its share of --budget is reported as timed out; the others still run."""
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/device_check.py', '--device', 'cpu', '--tiny',
                        '--parts', 'env', 'train', 'amp', '--amp-size', '32', '--bench', '1024/b2',
                        '--budget', '150', '--out-dir', str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / 'device_check.json').read_text())
    assert res['parts']['train']['error'].startswith('timed out after')
    assert 'error' not in res['parts']['amp']
