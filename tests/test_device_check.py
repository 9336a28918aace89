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
from conftest import ROOT, TINY_HVIT3, TINY_L2VIT, TINY_REST, analysis_tool

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
    return {} if label.startswith('rest') else dict(fast_train=False)


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
    env = dict(os.environ, PINS=str(tmp_path / 'pins.txt'), PYTHON=sys.executable)  # its python imports torch
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


#: the parts' rows the rehearsal below checks
OURS = ['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s']
PRECISIONS = ['fp32', 'tf32', 'bf16']


def _rehearsal_args(out):
    return ['--out-dir', str(out), '--device', 'cpu', '--tiny', '--parity-size', '64', '--amp-size', '64x96',
            '--headline', '64/b1', '--detection', '64x96/b2', '--warmup', '0', '--iters', '1']


@pytest.fixture(scope='module')
def device_env(tmp_path_factory):
    """device_like_env, built once for the tests below: (python, env); the image's torch, timm and cv2 are found
    there, the system's mmengine and mmcv are out of sight (looked up without importing anything)."""
    py, env = device_like_env(tmp_path_factory.mktemp('device_env'))
    r = subprocess.run([py, '-c', 'import importlib.util as u\nfor m in ("torch", "timm", "cv2", "mmengine", "mmcv"): '
                        'print(m, u.find_spec(m) is not None)'], capture_output=True, text=True, env=env, timeout=300)
    assert r.stdout.split() == ['torch', 'True', 'timm', 'True', 'cv2', 'True', 'mmengine', 'False', 'mmcv',
                                'False'], r.stdout + r.stderr
    return py, env


def test_device_check_runs_as_on_the_gpu_machine(carry, device_env, tmp_path):
    """device_check.sh --carry on the CPU (--tiny) from a copy of what travels, with the machine's packages plus
    the carry: every part's row of every model (preflight forwards, eval parity and gradients of both training
    paths against float64, bf16 and fp16 AMP steps, speed of ViT3-T vs DeiT-T and the pyramids vs Swin-T in
    each precision, in the benchmark's format)."""
    py, env = device_env
    repo = traveling_copy(tmp_path / 'repo')
    assert not (repo / 'mmplugin_l2/.mim').exists()
    out = tmp_path / 'dc'
    t = time.time()
    r = subprocess.run(['bash', 'tools/analysis/device_check.sh', '--carry', str(carry[0]), '--budget', '1800',
                        '--preflight-s', '120', *_rehearsal_args(out)],
                       capture_output=True, text=True, cwd=repo, env=dict(env, PYTHON=py), timeout=2400)
    print(f'rehearsal: {time.time() - t:.0f} s')
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / 'device_check.json').read_text())
    assert res['complete'] and list(res['parts']) == ['preflight', 'parity', 'amp', 'sync', 'speed']
    failed = [(p, k) for p, v in res['parts'].items() for k, row in v['rows'].items() if 'error' in row]
    assert not failed and not os.path.exists(out / 'errors'), failed
    env_ = res['env']
    assert env_['mmengine_path'].startswith(env['SITE']) and env_['mmcv_path'].startswith(env['SITE'])
    assert env_['mmengine'] == '0.10.7' and env_['mmcv'] == '2.1.0' and env_['executable'] == py
    assert env_['mmplugin_l2_path'] == str(repo / 'mmplugin_l2')
    assert env_['backbones_import'] == []  # neither mmdet nor mmcv's compiled ops
    assert env_['mmdet'].startswith('unavailable') and env_['mmpretrain'].startswith('unavailable')
    forward = res['parts']['preflight']['rows']['all']['forward']
    assert forward['swin_t'].startswith('not tried: mmdet') and forward['deit_t'].startswith('not tried: mmpretrain')
    assert all(forward[m] is True for m in OURS + ['swin_t_timm', 'deit_t_timm']), forward
    parity, amp = res['parts']['parity']['rows'], res['parts']['amp']['rows']
    assert list(parity) == OURS and list(amp) == OURS
    for n in OURS:
        p = parity[n]
        assert len(p['eval']['fp32']) == (1 if n == 'vit3_t' else 4) and p['eval']['ok']
        assert 0 < max(p['eval']['fp32']) < 1e-4  # fp32 vs float64 on the same CPU
        assert 0 < p['grad_cpu_fp32']['rel_l2'] < 1e-5, p
        for path in ('fast', 'plain'):
            g = p[f'grad_{path}']
            assert g['ok'] and 0 < g['max_rel_max'] < 1e-2 and 0 < g['rel_l2'] < 1e-5 and g['loss'] < 1e-5, g
            assert g['worst'].endswith(('weight', 'bias')) or '.' in g['worst'], g
        for prec in ('bf16', 'fp16'):
            a = amp[n][prec]
            assert a['loss_finite'] and a['grads_finite'] and a['params_finite'], (n, prec, a)
            assert 0 < a['rel_l2'] < 0.5 and a['worst'], (n, prec, a)  # autocast did change the arithmetic
        assert amp[n]['fp16']['scale'] > 0 and amp[n]['fp16']['skipped_steps'] < 16
    assert 'skipped' in res['parts']['sync'] and not res['parts']['sync']['rows']
    speed = res['parts']['speed']['rows']
    assert list(speed) == ['vit3_t 64/b1', 'deit_t_timm 64/b1', 'hvit3_t 64x96/b2', 'l2vit_t 64x96/b2',
                           'rest_s 64x96/b2', 'swin_t_timm 64x96/b2']
    for job, row in speed.items():
        got = {(s['precision'], s['kind']) for s in row['samples']}
        assert got == {(p, k) for p in PRECISIONS for k in ('infer', 'train')}, (job, got)
        for s in row['samples']:
            assert 'error' not in s and s['model'] == job.split()[0], s
            assert (s['latency_ms'] > 0 and s['throughput'] > 0) if s['kind'] == 'infer' else s['step_ms'] > 0
            # without --compiled (the CPU's default) the TTT models run as on a GPU: not compiled
            assert s.get('cfg') == (dict(fast_compile=False) if s['model'] in ('vit3_t', 'hvit3_t') else None), s
    from mmplugin_l2.analysis import benchmark as bm
    for prec in PRECISIONS:
        b = json.loads((out / f'speed_{prec}.json').read_text())
        assert b['format'] == bm.FORMAT and b['smoke'] and len(b['samples']) == 12
        page = bm.render(b)
        assert '| ViT3-T vs DeiT-T (timm) | 1 | 64×64 |' in page and '| ResT-S vs Swin-T (timm) | 2 | 64×96 |' in page
    md = (out / 'device_check.md').read_text()
    assert md.index('## preflight') < md.index('## parity') < md.index('## amp') < md.index('## speed')
    assert 'mmengine 0.10.7' in md and '### Speed: bf16 autocast' in md and '| DeiT-T (timm) | 1 |' in md


def test_device_check_sh_needs_the_carry(device_env, tmp_path):
    py, env = device_env
    r = subprocess.run(['bash', f'{ROOT}/tools/analysis/device_check.sh', '--device', 'cpu', '--out-dir',
                        str(tmp_path)], capture_output=True, text=True, env=dict(env, PYTHON=py), timeout=300)
    assert r.returncode == 1 and 'cannot import mmengine, mmcv: pass --carry DIR' in r.stderr, r.stderr
    r = subprocess.run(['bash', f'{ROOT}/tools/analysis/device_check.sh', '--carry', str(tmp_path)],
                       capture_output=True, text=True, env=dict(env, PYTHON=py), timeout=300)
    assert r.returncode == 2 and 'no wheels in' in r.stderr, r.stderr


def _check(tmp_path, *args):
    return [sys.executable, f'{ROOT}/tools/analysis/device_check.py', '--device', 'cpu', '--tiny',
            '--out-dir', str(tmp_path), *args]


def _device_check_cli():
    return analysis_tool('device_check')


@pytest.mark.parametrize('args, message', [
    ([], 'torch sees no CUDA device'),
    (['--device', 'tpu'], "--device 'tpu': allowed cuda, cuda:N, cpu"),
    (['--device', 'cpu', '--detection', '800x1344/b0'], "expected HxW/bBATCH such as 800x1344/b2, got '800x1344/b0'"),
    (['--device', 'cpu', '--precisions', 'fp8'], "invalid choice: 'fp8'"),
    (['--device', 'cpu', '--budget', '0'], 'expected positive seconds'),
    (['--device', 'cpu', '--authors-code', 'ResT=/nowhere'], '--authors-code: ResT: checkout'),
])
def test_device_check_bad_arguments_say_what_is_allowed(tmp_path, capsys, args, message):
    """The argument checks (device_check.py's parse_args, which its main calls first; the runs below go through
    the script itself): exit status 2 and a message that says what is allowed."""
    if not args and torch.cuda.is_available():
        pytest.skip('a CUDA device is present')
    with pytest.raises(SystemExit) as e:
        _device_check_cli().parse_args(['--out-dir', str(tmp_path), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err


def test_device_check_measures_the_compiled_ttt_path_where_asked(tmp_path):
    """--compiled (auto: on CUDA only; on the CPU the compiled path is the declared one, so both models are the
    same there) adds H-ViT3-T with_cp with the compiled TTT path on its declared devices and on every device to the
    amp part and to the speed part (with the authors' recipe where their ViTTT is carried), only where H-ViT3 is
    checked; the model of the second builds with fast_compile on CUDA too. Without --compiled (the CPU's default)
    H-ViT3-T and ViT3-T are built with fast_compile=False, as a GPU runs them; with it as configured."""
    dc = _device_check_cli()
    base = ['--out-dir', str(tmp_path), '--device', 'cpu', '--detection', '64x96/b2', '--headline']
    forward = {}
    args = dc.parse_args(base)
    assert not args.compiled and dc.part_jobs('amp', args, forward) == ['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s']
    args = dc.parse_args(base + ['--compiled', 'on'])
    assert dc.part_jobs('amp', args, forward) == ['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s', 'hvit3_t_cp',
                                                  'hvit3_t_cp_compiled']
    assert dc.part_jobs('parity', args, forward) == ['hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s']
    assert dc.speed_jobs(args, forward) == [f'{m} 64x96/b2' for m in ('hvit3_t', 'l2vit_t', 'rest_s', 'hvit3_t_cp',
                                                                      'hvit3_t_cp_compiled', 'swin_t_timm')]
    args.authors_code = {'ViTTT': str(tmp_path)}
    assert 'hvit3_t_cp@authors 64x96/b2' in dc.speed_jobs(args, forward)
    args = dc.parse_args(base + ['--compiled', 'on', '--models', 'l2vit_t'])
    assert dc.part_jobs('amp', args, forward) == ['l2vit_t']
    from mmplugin_l2.analysis.models import build
    assert {m.attn.fast_compile for m in build('hvit3_t_cp_compiled', tiny=True).modules()
            if hasattr(m, 'attn')} == {('cpu', 'cuda')}
    for compiled, want in ((['--compiled', 'off'], {False}), (['--compiled', 'on'], {True})):
        args = dc.parse_args(base + compiled + ['--tiny'])
        for name in ('hvit3_t', 'vit3_t'):
            assert {m.attn.fast_compile for m in dc.build_model(args, name).modules() if hasattr(m, 'attn')} == want


#: a file laid out like the authors' ViTTT backbone (narrow widths): our H-ViT3 under their names
FAKE_VITTT = """
from mmdet.registry import MODELS
from mmplugin_l2.models.backbones.hvit3 import HViT3


@MODELS.register_module()
def vittt_tiny(**kwargs):
    return HViT3(arch=dict(embed_dims=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_heads=[1, 1, 2, 2]), **kwargs)
"""

#: the speed jobs of the `faults` run below, in order
FAULTS_64 = ['hvit3_t 64/b1', 'hvit3_t@authors 64/b1', 'l2vit_t 64/b1', 'rest_s 64/b1', 'swin_t 64/b1']
FAULTS_2048 = ['hvit3_t 2048/b4', 'hvit3_t@authors 2048/b4', 'l2vit_t 2048/b4', 'rest_s 2048/b4', 'swin_t 2048/b4']


def _read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet
        return None


def _wait_for(path, ready, proc, deadline):
    """Poll the results file `path` until ready(results) holds; False if `proc` ended or the deadline passed."""
    while time.time() < deadline and proc.poll() is None:
        res = _read_json(path)
        if res is not None and ready(res):
            return True
        time.sleep(0.25)
    return False


def _start(cmd, out):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / 'stdout.txt', 'w') as so, open(out / 'stderr.txt', 'w') as se:
        return subprocess.Popen(cmd, stdout=so, stderr=se, text=True, cwd=ROOT, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS='1'))


@pytest.fixture(scope='module')
def fault_runs(tmp_path_factory):
    """Two runs of device_check.py (--tiny, CPU) with planted faults, side by side: `hang` sleeps through most of
    its run (its planted hang), and `faults` computes meanwhile, so the pair takes little more than `hang` alone.

    * hang: parity then speed of vit3_t and rest_s within a budget of 100 s; rest_s hangs in parity (planted), so
      its time limit (the rest of the parity part) ends it; the speed part comes after it.
    * faults: parity then speed of hvit3_t, l2vit_t and rest_s, with a stand-in checkout of the authors' ViTTT;
      building l2vit_t raises (planted); SIGTERM (device_check.sh's hard limit) arrives inside the first job of
      the second speed entry (2048/b4), after a snapshot of the results written so far.

    Returns: {'hang': dict(out, rc, res, log), 'faults': dict(out, rc, res, log, running, snapshot, snapshot_md)}.
    """
    base = tmp_path_factory.mktemp('fault_runs')
    runs = dict(hang=dict(out=base / 'hang'), faults=dict(out=base / 'faults'))
    vittt = base / 'ViTTT' / _authors_file('ViTTT')
    vittt.parent.mkdir(parents=True)
    vittt.write_text(FAKE_VITTT)
    hang = _start(_check(runs['hang']['out'], '--parts', 'parity', 'speed', '--models', 'vit3_t', 'rest_s',
                         '--parity-size', '32', '--headline', '--detection', '64/b1', '--precisions', 'fp32',
                         '--warmup', '0', '--iters', '1', '--budget', '100', '--preflight-s', '20',
                         '--plant-hang', 'parity:rest_s'), runs['hang']['out'])
    procs = dict(hang=hang)
    try:
        # the second run starts once the first's preflight is done (it has 20 s, not to be shared)
        _wait_for(runs['hang']['out'] / 'device_check.json',
                  lambda r: 'all' in r['parts'].get('preflight', {}).get('rows', {}), hang, time.time() + 300)
        f = runs['faults']
        js = f['out'] / 'device_check.json'
        p = procs['faults'] = _start(_check(
            f['out'], '--parts', 'parity', 'speed', '--models', 'hvit3_t', 'l2vit_t', 'rest_s', '--parity-size', '32',
            '--headline', '--detection', '64/b1', '2048/b4', '--precisions', 'fp32', '--warmup', '0', '--iters', '1',
            '--budget', '900', '--preflight-s', '120', '--authors-code', f'ViTTT={base / "ViTTT"}',
            '--plant-fault', 'l2vit_t'), f['out'])
        if _wait_for(js, lambda r: 'swin_t 64/b1' in r['parts'].get('speed', {}).get('rows', {}), p,
                     time.time() + 600):
            f['snapshot'], f['snapshot_md'] = _read_json(js), (f['out'] / 'device_check.md').read_text()
            time.sleep(3)  # inside hvit3_t 2048/b4 now (seconds of work at that size)
            f['running'] = p.poll() is None
            p.send_signal(signal.SIGTERM)
        deadline = time.time() + 300
        for name, proc in procs.items():
            try:
                runs[name]['rc'] = proc.wait(timeout=max(1., deadline - time.time()))
            except subprocess.TimeoutExpired:
                runs[name]['rc'] = 'still running after 300 s'
    finally:  # a run still going (a test failing): it and the model process it waits for
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for r in runs.values():
        r['res'] = _read_json(r['out'] / 'device_check.json')
        r['log'] = (r['out'] / 'stderr.txt').read_text()[-3000:]
    return runs


def _authors_file(family):
    from mmplugin_l2.analysis.authors import FAMILIES
    return FAMILIES[family][1]


def test_device_check_failing_model_keeps_its_traceback_and_the_others_rows(fault_runs):
    """A model that fails (planted: building it raises) has its whole traceback saved under errors/ and linked
    from the JSON and the Markdown, in every part; the other models' rows are all there, the authors' code
    (a stand-in checkout) beside ours in the speed part."""
    run = fault_runs['faults']
    out, res = run['out'], run['res']
    assert run['rc'] == 0 and res is not None, run['log']
    md = (out / 'device_check.md').read_text()
    rows = [res['parts']['preflight']['rows']['all']['forward']['l2vit_t'], res['parts']['parity']['rows']['l2vit_t'],
            res['parts']['speed']['rows']['l2vit_t 64/b1']]
    for row in rows:
        assert row['error'] == 'RuntimeError: planted fault in l2vit_t (--plant-fault)', row
        text = (out / row['error_file']).read_text()
        assert text.count('Traceback (most recent call last)') == 1 and text.count('device_check.py", line') >= 2, text
        assert text.rstrip().endswith('RuntimeError: planted fault in l2vit_t (--plant-fault)'), text
        assert f'([full text]({row["error_file"]}))' in md
    speed = res['parts']['speed']['rows']
    assert [j for j in speed if j.endswith(' 64/b1')] == FAULTS_64, speed
    for m in ('hvit3_t', 'rest_s'):
        assert res['parts']['parity']['rows'][m]['grad_fast']['ok']
    for job in ('hvit3_t 64/b1', 'hvit3_t@authors 64/b1', 'rest_s 64/b1', 'swin_t 64/b1'):
        assert 'error' not in speed[job] and {s['kind'] for s in speed[job]['samples']} == {'infer', 'train'}, job
        assert not [s for s in speed[job]['samples'] if 'error' in s], speed[job]
    assert "| H-ViT3-T vs H-ViT3-T (authors' code) | 1 | 64×64 |" in md


def test_device_check_model_time_limit(fault_runs):
    """A model that runs past its time limit (planted: it hangs in parity) loses its own row only: the model
    before it, the next part and that model's row there are all kept; the timeout's text is saved."""
    run = fault_runs['hang']
    out, res = run['out'], run['res']
    assert run['rc'] == 0 and res is not None, run['log']
    parity, speed = res['parts']['parity']['rows'], res['parts']['speed']['rows']
    assert parity['vit3_t']['grad_plain']['ok'], parity
    assert parity['rest_s']['error'].startswith('timed out after'), parity['rest_s']
    assert (out / parity['rest_s']['error_file']).read_text().startswith('timed out after')
    assert res['wall_s'] < 100 and parity['rest_s']['wall_s'] <= res['parts']['parity']['planned_end_s']
    assert res['complete'] and list(speed) == ['rest_s 64/b1', 'swin_t 64/b1'], speed
    for job, row in speed.items():
        assert 'error' not in row and {s['kind'] for s in row['samples']} == {'infer', 'train'}, (job, row)
        assert not [s for s in row['samples'] if 'error' in s], row


def test_device_check_keeps_finished_models_when_stopped(fault_runs):
    """SIGTERM (device_check.sh's hard limit) during the speed part: the rows of the models finished before,
    in earlier parts and in the speed part itself, are on disk (JSON and Markdown, written after each model),
    the model it was in says it was stopped, the rest say not run."""
    run = fault_runs['faults']
    part, res = run.get('snapshot'), run['res']
    assert part is not None and run['running'], run['log']  # still running when the signal was sent
    assert part['complete'] is False and list(part['parts']) == ['preflight', 'parity', 'speed'], part['parts']
    assert list(part['parts']['speed']['rows']) == FAULTS_64, part['parts']['speed']
    assert '| ResT-S | 1 |' in run['snapshot_md']
    assert run['rc'] == 0, run['log']
    assert res['complete'] is False and res['parts']['parity'] == part['parts']['parity']
    speed = res['parts']['speed']['rows']
    assert list(speed) == FAULTS_64 + FAULTS_2048, speed
    assert all(speed[k] == part['parts']['speed']['rows'][k] for k in FAULTS_64)
    assert speed['hvit3_t 2048/b4']['error'].startswith('stopped by signal 15'), speed
    for job in FAULTS_2048[1:]:
        assert speed[job]['error'].startswith('not run: stopped by signal 15'), speed
    md = (run['out'] / 'device_check.md').read_text()
    assert '## parity' in md and '| ResT-S | 1 |' in md and 'failed: stopped by signal' in md
    assert '(not complete)' in md
