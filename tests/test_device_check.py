"""GPU readiness without a GPU: every backbone runs forward and backward on the meta device (no host
synchronisation: meta tensors raise on .item() / .tolist() / .cpu() and on Python branching on their
values); the device check's carry (pinned pure-Python wheels for Python 3.12) is fetched and checked, installs
and compiles under Python 3.12, and tools/analysis/device_check.sh runs end to end on the CPU in an
environment that has only the GPU machine's packages plus the carry (docs/device_check.md)."""
import glob
import importlib.metadata
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time
from pathlib import Path

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


# ---- the carry: tools/analysis/device_wheels.sh ------------------------------------------------------------

def _norm(name):
    return re.sub(r'[-_.]+', '-', name).lower()


def _pins():
    lines = Path(ROOT, 'tools/analysis/device_wheels.txt').read_text().splitlines()
    return {(_norm(n), v) for n, _, v in (ln.partition('==') for ln in lines if ln.strip() and ln[0] != '#')}


@pytest.fixture(scope='module')
def carry(tmp_path_factory):
    """`device_wheels.sh --dir DIR` (PyPI): the folder it fills and its output."""
    d = tmp_path_factory.mktemp('carry')
    r = subprocess.run(['bash', f'{ROOT}/tools/analysis/device_wheels.sh', '--dir', str(d)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    return d, r.stdout


def test_carry_is_the_pinned_pure_python_set(carry):
    d, out = carry
    wheels = sorted(os.listdir(d / 'wheels'))
    # file names read here independently of the script's own check: name-version-python-abi-platform.whl
    tags = [w[:-4].split('-') for w in wheels]
    assert {(_norm(t[0]), t[1]) for t in tags} == _pins() and len(wheels) == len(_pins())
    for w, t in zip(wheels, tags):
        py, abi, plat = t[-3:]
        pure = abi == 'none' and plat == 'any' and 'py3' in py.split('.')
        cp312 = py == 'cp312' and re.fullmatch(r'manylinux(2014|_2_\d+)_x86_64', plat)
        assert pure or cp312, w
    total = sum(os.path.getsize(d / 'wheels' / w) for w in wheels)
    assert 0 < total < 4 * 2**20, total
    assert f'{len(wheels)} wheels, {total / 2**20:.2f} MiB' in out


def test_carry_refuses_a_set_over_its_size_limit(tmp_path):
    r = subprocess.run(['bash', f'{ROOT}/tools/analysis/device_wheels.sh', '--dir', str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, MAX_MB='0.5'))
    assert r.returncode == 1 and 'more than MAX_MB=0.5' in r.stderr, r.stdout + r.stderr


def test_carry_copies_the_authors_backbone_files(tmp_path):
    from mmplugin_l2.analysis.authors import FAMILIES
    clone = tmp_path / 'clone'
    rel = FAMILIES['ResT'][1]
    (clone / rel).parent.mkdir(parents=True)
    (clone / rel).write_text('# their backbone file\n')
    env = dict(os.environ, PINS=str(tmp_path / 'pins.txt'))
    (tmp_path / 'pins.txt').write_text('addict==2.4.0\n')
    r = subprocess.run(['bash', f'{ROOT}/tools/analysis/device_wheels.sh', '--dir', str(tmp_path / 'c'),
                        '--authors-code', f'ResT={clone}'], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / 'c/authors/ResT' / rel).read_text() == '# their backbone file\n'
    r = subprocess.run(['bash', f'{ROOT}/tools/analysis/device_wheels.sh', '--dir', str(tmp_path / 'c'),
                        '--authors-code', f'ResT={tmp_path}'], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 1 and f'{rel} is missing' in r.stderr, r.stderr


def _python312():
    """A CPython 3.12 here: on PATH, or pyenv's (the CI machine has pyenv's 3.12)."""
    cands = ['python3.12'] + sorted(glob.glob(os.path.expanduser('~/.pyenv/versions/3.12*/bin/python3.12')))
    for c in cands:
        try:
            r = subprocess.run([c, '-c', 'import sys; print(sys.version_info[:2])'], capture_output=True, text=True)
        except FileNotFoundError:
            continue
        if r.returncode == 0 and r.stdout.strip() == '(3, 12)':
            return c
    raise AssertionError(f'no Python 3.12 found (looked for {cands}); docs/device_check.md says how to get one')


def test_carry_installs_and_compiles_under_python_312(carry, tmp_path):
    """The GPU machine's Python version: the carry installs with device_check.sh's pip command, and it and our
    sources compile; the carried packages that need no torch import (torch for 3.12 is not on this machine)."""
    py = _python312()
    d, _ = carry
    site_dir = tmp_path / 'site'
    r = subprocess.run([py, '-m', 'pip', 'install', '-q', '--no-index', '--no-deps', '--no-compile', '--no-cache-dir',
                        '--disable-pip-version-check', '--target', str(site_dir), *glob.glob(f'{d}/wheels/*.whl')],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert {'mmengine', 'mmcv', 'addict', 'yapf', 'termcolor', 'platformdirs'} <= set(os.listdir(site_dir))
    r = subprocess.run([py, '-m', 'compileall', '-q', '-x', 'site-packages', str(site_dir), f'{ROOT}/mmplugin_l2',
                        f'{ROOT}/tools/analysis/device_check.py'], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path / 'pyc')))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = subprocess.run([py, '-c', 'import addict, yapf, termcolor, platformdirs, importlib.metadata as m; '
                        'print(m.version("mmcv-lite"), m.version("mmengine"))'], capture_output=True, text=True,
                       timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(site_dir), PYTHONPYCACHEPREFIX=str(tmp_path / 'pyc')))
    assert r.returncode == 0 and r.stdout.split() == ['2.1.0', '0.10.7'], r.stderr


# ---- tools/analysis/device_check.sh on the CPU, with the GPU machine's packages only ------------------------

def image_packages():
    """The distributions of the GPU machine's image, as listed in docs/device_check.md."""
    text = Path(ROOT, 'docs/device_check.md').read_text()
    block = text.split('<!-- device-image-packages -->')[1].split('<!-- /device-image-packages -->')[0]
    return {_norm(n) for n in block.split()}


#: installed here -> its counterpart on the machine
STAND_INS = {'opencv-python': 'opencv-python-headless'}


def device_like_env(tmp_path):
    """(python, env): a virtual environment without the system site-packages whose PYTHONPATH is a folder of
    links to the installed distributions the GPU machine's image also has (docs/device_check.md) and to what
    they require, nothing else: mmengine, mmcv, mmdet and the like are not importable until the carry is
    installed."""
    from packaging.requirements import Requirement
    image = image_packages()
    dists = {_norm(d.metadata['Name']): d for d in importlib.metadata.distributions(path=site.getsitepackages())}
    # the image's distributions with their own requirements (pip installed them so), through stand-ins
    todo = [n for n in dists if STAND_INS.get(n, n) in image or n.startswith(('nvidia-', 'cuda-', 'triton'))]
    linked = set()
    while todo:
        name = todo.pop()
        if name in linked or name not in dists:
            continue
        linked.add(name)
        for req in dists[name].requires or []:
            req = Requirement(req)
            if req.marker is None or req.marker.evaluate({'extra': ''}):
                todo.append(_norm(req.name))
    link_dir = tmp_path / 'device_site'
    link_dir.mkdir()
    for name in linked:
        dist = dists[name]
        for f in dist.files or []:
            top = f.parts[0]
            src = Path(dist.locate_file(top))
            if top in ('..', '__pycache__') or top.endswith('.pth') or not src.exists():
                continue
            if not (link_dir / top).exists():
                (link_dir / top).symlink_to(src)
    assert not linked & {'mmengine', 'mmcv', 'mmcv-lite', 'mmdet', 'addict', 'yapf', 'termcolor'}, linked
    assert {'torch', 'numpy', 'pyyaml', 'rich', 'pillow', 'timm', 'pip'} <= linked, linked
    venv = tmp_path / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if not k.startswith(('PYTHON', 'VIRTUAL_ENV'))}
    env.update(PYTHONPATH=str(link_dir), OMP_NUM_THREADS='1', SITE=str(tmp_path / 'carried_site'))
    return str(venv / 'bin' / 'python'), env


def traveling_copy(dest):
    """A copy of what the device tool sends: the tracked and the untracked-not-ignored files (no installed
    .mim, egg-info or caches)."""
    files = subprocess.run(['git', 'ls-files', '-co', '--exclude-standard', '-z'], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split('\0')
    for f in filter(None, files):
        src, dst = Path(ROOT, f), dest / f
        if not src.exists() and not src.is_symlink():  # deleted in the work tree
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


def test_device_check_runs_as_on_the_gpu_machine(carry, tmp_path):
    """device_check.sh --carry on the CPU from a copy of what travels: every part finishes, from the machine's
    packages plus the carry."""
    py, env = device_like_env(tmp_path)
    repo = traveling_copy(tmp_path / 'repo')
    assert not (repo / 'mmplugin_l2/.mim').exists()
    r = subprocess.run([py, '-c', 'import torch, timm, cv2\ntry:\n import mmengine\nexcept ImportError: print("ok")'],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.stdout.strip() == 'ok', r.stdout + r.stderr  # the system's mmengine is out of sight
    out = tmp_path / 'dc'
    r = subprocess.run(['bash', 'tools/analysis/device_check.sh', '--carry', str(carry[0]), '--out-dir',
                        str(out), '--budget', '1800', '--device', 'cpu', '--tiny', '--parity-size', '64',
                        '--amp-size', '64x96', '--bench', '64/b1', '64x96/b2', '--warmup', '0', '--iters', '1'],
                       capture_output=True, text=True, cwd=repo, env=dict(env, PYTHON=py), timeout=2400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / 'device_check.json').read_text())
    assert res['complete'] and list(res['parts']) == ['env', 'parity', 'amp', 'sync', 'latency', 'train']
    assert not [p for p, v in res['parts'].items() if 'error' in v], res['parts']
    env_ = res['env']
    assert env_['mmengine_path'].startswith(env['SITE']) and env_['mmcv_path'].startswith(env['SITE'])
    assert env_['mmengine'] == '0.10.7' and env_['mmcv'] == '2.1.0' and env_['executable'] == py
    assert env_['mmplugin_l2_path'] == str(repo / 'mmplugin_l2')
    assert env_['backbones_import'] == []  # neither mmdet nor mmcv's compiled ops
    assert env_['mmdet'].startswith('unavailable') and env_['swin_source'].startswith('timm')
    models = ['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s']
    assert list(res['parts']['parity']) == models
    for n in models:
        p = res['parts']['parity'][n]
        assert len(p['fp32']) == (1 if n == 'vit3_t' else 4) and p['ok']
        assert max(p['fp32']) < 1e-4  # fp32 vs float64 on the same CPU
        for dt in ('fp16', 'bf16'):
            a = res['parts']['amp'][n][dt]
            assert a['finite'] and len(a['rel_l2']) == len(p['fp32']) and 0 < max(a['rel_l2']) < 0.1
    assert 'skipped' in res['parts']['sync']
    benched = ['hvit3_t', 'l2vit_t', 'rest_s']
    for spec in ('64/b1', '64x96/b2'):
        lat = res['parts']['latency'][spec]
        assert set(lat) == set(benched) | {'swin_t'} and all(v['median_ms'] > 0 for v in lat.values())
        tr = res['parts']['train'][spec]
        assert {'hvit3_t', 'hvit3_t[cp]', 'hvit3_t[norecompute]', 'l2vit_t[norecompute+cp]', 'rest_s[cp]',
                'swin_t'} <= set(tr)
        assert all('error' not in v and v['step_ms'] > 0 and v['peak_mem_mb'] is None for v in tr.values()), tr
    md = (out / 'device_check.md').read_text()
    assert md.index('## env') < md.index('## parity') < md.index('## amp') < md.index('## train')
    assert 'mmengine 0.10.7' in md and '**64x96/b2**' in md and '`hvit3_t[cp]`' in md and '`vit3_t`' in md


def test_device_check_sh_needs_the_carry(tmp_path):
    py, env = device_like_env(tmp_path)
    r = subprocess.run(['bash', f'{ROOT}/tools/analysis/device_check.sh', '--device', 'cpu', '--out-dir',
                        str(tmp_path)], capture_output=True, text=True, env=dict(env, PYTHON=py), timeout=300)
    assert r.returncode == 1 and 'cannot import mmengine, mmcv: pass --carry DIR' in r.stderr, r.stderr
    r = subprocess.run(['bash', f'{ROOT}/tools/analysis/device_check.sh', '--carry', str(tmp_path)],
                       capture_output=True, text=True, env=dict(env, PYTHON=py), timeout=300)
    assert r.returncode == 2 and 'no wheels in' in r.stderr, r.stderr


def test_device_check_refuses_cuda_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip('a CUDA device is present')
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/device_check.py', '--out-dir', str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and 'torch sees no CUDA device' in r.stderr and '--device cpu' in r.stderr


def _check(tmp_path, *args):
    return [sys.executable, f'{ROOT}/tools/analysis/device_check.py', '--device', 'cpu', '--tiny',
            '--out-dir', str(tmp_path), *args]


def test_device_check_part_time_limit(tmp_path):
    """A part that runs past its share of --budget is reported as timed out; the next one still runs, and a
    part with too little of the budget left is not started."""
    r = subprocess.run(_check(tmp_path, '--parts', 'env', 'parity', 'train', '--parity-size', '32',
                              '--bench', '1536/b2', '--budget', '150'),
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / 'device_check.json').read_text())
    assert 'error' not in res['parts']['parity'] and all(v['ok'] for v in res['parts']['parity'].values())
    assert res['parts']['train']['error'].startswith(('timed out after', 'not run: ')), res['parts']['train']


def test_device_check_keeps_finished_parts_when_stopped(tmp_path):
    """SIGTERM (device_check.sh's hard limit) during a later part: the earlier parts are on disk, JSON and
    Markdown, the part it was in says it was stopped, the rest say not run."""
    p = subprocess.Popen(_check(tmp_path, '--parts', 'env', 'parity', 'latency', 'train', '--models', 'rest_s',
                                '--parity-size', '32', '--bench', '2048/b4', '--budget', '900'),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS='1'))
    js = tmp_path / 'device_check.json'
    deadline = time.time() + 400
    while time.time() < deadline and p.poll() is None:
        if js.exists() and 'parity' in json.loads(js.read_text())['parts']:
            break
        time.sleep(1)
    assert p.poll() is None, p.communicate()
    part = json.loads(js.read_text())
    assert part['complete'] is False and list(part['parts']) == ['env', 'parity'], part['parts']
    assert '## parity' in (tmp_path / 'device_check.md').read_text()
    time.sleep(3)  # inside latency now
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    assert p.returncode == 0
    res = json.loads(js.read_text())
    assert res['complete'] is False and res['parts']['parity'] == part['parts']['parity']
    assert res['parts']['latency']['error'].startswith('stopped by signal 15'), res['parts']['latency']
    assert res['parts']['train']['error'].startswith('not run: stopped by signal 15')
    md = (tmp_path / 'device_check.md').read_text()
    assert '## parity' in md and '## latency' in md and 'FAILED: stopped by signal' in md and '(stopped)' in md
