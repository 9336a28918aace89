"""What a user outside the repository relies on: configs inherited as `mmplugin_l2::PATH`, the version in one
place, the demo configs runnable by the libraries' stock tools on a CPU, and the Slurm scripts."""
import os
import os.path as osp
import site
import subprocess
import sys

import pytest
import yaml
from mmengine.config import Config

import mmplugin_l2
from config_helpers import load

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def test_base_from_installed_package(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing of the repository is reachable by a relative path from here
    (tmp_path / 'my_retinanet.py').write_text(
        "_base_ = 'mmplugin_l2::mmdet/retinanet_l2vit_t_1x.py'\n"
        "model = dict(backbone=dict(arch='small', init_cfg=None))\n"
        "train_dataloader = dict(batch_size=1)\n")
    cfg = Config.fromfile(str(tmp_path / 'my_retinanet.py'))
    assert cfg.model.type == 'RetinaNet' and cfg.model.backbone.type == 'L2ViT'
    assert cfg.model.backbone.arch == 'small' and cfg.model.backbone.init_cfg is None
    assert tuple(cfg.model.backbone.out_indices) == (1, 2, 3)  # from our config
    assert cfg.train_dataloader.batch_size == 1 and cfg.train_cfg.max_epochs == 12
    assert cfg.custom_imports == dict(imports=['mmplugin_l2'], allow_failed_imports=False)
    # a config that is not installed fails with mmengine's own message
    (tmp_path / 'bad.py').write_text("_base_ = 'mmplugin_l2::mmdet/no_such_config.py'\n")
    with pytest.raises(FileNotFoundError):
        Config.fromfile(str(tmp_path / 'bad.py'))


def test_config_path_helper():
    p = mmplugin_l2.config.config_path('mmseg/upernet_rest_s_512x512_160k_ade20k.py')
    assert osp.isfile(p) and osp.sep + '.mim' + osp.sep in p
    with pytest.raises(FileNotFoundError, match='not among the configs installed'):
        mmplugin_l2.config.config_path('mmdet/nothing.py')


def test_version_in_one_place():
    from mmplugin_l2.version import __version__
    out = subprocess.run([sys.executable, 'setup.py', '--version'], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[-1] == __version__ == mmplugin_l2.__version__
    cff = yaml.safe_load(open(osp.join(ROOT, 'CITATION.cff')))
    assert str(cff['version']) == __version__
    assert len(cff['references']) == 3
    assert open(osp.join(ROOT, 'CHANGELOG.md')).read().count(f'## {__version__}') == 1
    assert 'Apache License' in open(osp.join(ROOT, 'LICENSE')).read()


@pytest.mark.parametrize('rel', ['demo/mask_rcnn_hvit3_t_demo.py', 'demo/upernet_hvit3_t_demo.py',
                                 'demo/hvit3_t_in1k_demo.py'])
def test_demo_configs_run_on_cpu_with_stock_tools(rel):
    """No AmpOptimWrapper (the stock tools refuse it without a GPU), classes declared in the dataset."""
    cfg = load(rel)
    assert cfg.optim_wrapper.get('type', 'OptimWrapper') == 'OptimWrapper'
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        classes = cfg[loader].dataset.metainfo['classes']
        assert len(classes) >= 3
    if 'upernet' in rel:
        meta = cfg.train_dataloader.dataset.metainfo
        assert len(meta['palette']) == len(meta['classes'])


@pytest.mark.parametrize('script', ['slurm_train.sh', 'slurm_test.sh'])
def test_slurm_scripts(script, tmp_path):
    """The scripts call srun with one task per GPU and our train/test.py with --launcher slurm (a stand-in srun
    on PATH records the command line)."""
    fake = tmp_path / 'srun'
    fake.write_text('#!/bin/sh\necho "$@" > "$SRUN_LOG"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f'{tmp_path}:{os.environ["PATH"]}', SRUN_LOG=str(tmp_path / 'log'), GPUS='16')
    args = ['part', 'job', 'configs/demo/hvit3_t_in1k_demo.py', 'work_dirs/x' if 'train' in script else 'x.pth']
    subprocess.run(['bash', osp.join(ROOT, 'tools', script), *args, '--seed', '1'], env=env, check=True,
                   capture_output=True)
    line = (tmp_path / 'log').read_text()
    assert '-p part' in line and '--ntasks=16' in line and '--ntasks-per-node=8' in line
    assert f'tools/{script.replace("slurm_", "").replace(".sh", ".py")}' in line
    assert '--launcher=slurm' in line and line.rstrip().endswith('--seed 1')


def test_mim_search_lists_every_config():
    """`mim search mmplugin_l2` (openmim, installed by tools/install.sh) reads the installed model index."""
    import glob
    r = subprocess.run([sys.executable, '-m', 'mim', 'search', 'mmplugin_l2', '--field', 'config'],
                       capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    listed = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith('config ') and ln.split()[1] != 'id:'}
    configs = {osp.relpath(p, ROOT) for fw in ('mmdet', 'mmseg', 'mmpretrain')
               for p in glob.glob(osp.join(ROOT, 'configs', fw, '*.py'))}
    assert configs and listed == configs, sorted(listed ^ configs)


def _copy_tracked_files(dst):
    """The repository as a fresh clone has it (git's tracked files), copied to `dst`."""
    import shutil
    files = subprocess.run(['git', 'ls-files', '-z'], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in files.decode().split('\0'):
        if rel and osp.isfile(osp.join(ROOT, rel)) and not osp.islink(osp.join(ROOT, rel)):
            os.makedirs(osp.dirname(osp.join(dst, rel)) or dst, exist_ok=True)
            shutil.copy2(osp.join(ROOT, rel), osp.join(dst, rel))


def venv_over_this_environment(venv):
    """A scratch venv (python, env) that sees this environment's packages after its own, as `--system-site-packages`
    would, also when this python is itself a venv (whose `--system-site-packages` child would see the base
    interpreter's site, not this environment's): a .pth adds each of our site folders with site.addsitedir, so
    their own .pth files (our development install) apply too, after the venv's own (.pth files run in name order)."""
    subprocess.run([sys.executable, '-m', 'venv', str(venv)], check=True)
    py = str(venv / 'bin' / 'python')
    own = subprocess.run([py, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'], check=True,
                         capture_output=True, text=True).stdout.strip()
    with open(osp.join(own, 'zz_outer_environment.pth'), 'w') as f:
        f.write(''.join(f'import site; site.addsitedir({d!r})\n' for d in site.getsitepackages()))
    env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'VIRTUAL_ENV')}
    env['PATH'] = f'{venv / "bin"}:{env["PATH"]}'
    return py, env


@pytest.fixture(scope='module')
def two_clones_installed(tmp_path_factory):
    """tools/install.sh twice into one scratch venv (the stack from this environment, so only our install step is
    new), each time on a fresh copy of the repository as a clone has it: `first` with --force and its pip steps
    skipped (a python whose `-m pip` does nothing: what they install is in this environment already; the rest of
    the script, our development install, runs), then `second` without --force (the check whether the stack is
    installed runs first and finds `first`), all of it, starting from the newest setuptools (>= 82, without
    pkg_resources, which mim and mmengine need; also what a plain `pip install -U setuptools` resolves to).

    Returns: dict(first, second, user (an empty folder outside both), py, env, runs ({name: CompletedProcess}))."""
    tmp = tmp_path_factory.mktemp('two_clones')
    py, env = venv_over_this_environment(tmp / 'venv')
    subprocess.run([py, '-m', 'pip', 'install', '-q', '-U', 'setuptools>=82'], check=True, env=env, timeout=300)
    no_pip = tmp / 'python_without_pip'
    no_pip.write_text(f'#!/bin/sh\n[ "$1" = -m ] && [ "$2" = pip ] && exit 0\nexec {py} "$@"\n')
    no_pip.chmod(0o755)
    runs = {}
    for name, python, args in (('first', no_pip, ['--force']), ('second', py, [])):
        _copy_tracked_files(tmp / name)
        runs[name] = subprocess.run(['bash', str(tmp / name / 'tools' / 'install.sh'), *args],
                                    env=dict(env, PYTHON=str(python)), capture_output=True, text=True, timeout=900)
        if runs[name].returncode:
            break
    (tmp / 'user').mkdir()
    return dict(first=tmp / 'first', second=tmp / 'second', user=tmp / 'user', py=py, env=env, runs=runs)


def _installs_ok(inst):
    for name in ('first', 'second'):
        r = inst['runs'].get(name)
        assert r is not None and r.returncode == 0, (name, r and r.stdout[-3000:] + r.stderr[-3000:])


def test_install_script_gives_mim_and_base_configs(two_clones_installed):
    """tools/install.sh (the second install, from the newest setuptools): afterwards the venv's own setuptools is
    below 82 again (with pkg_resources), and `mim search`, `_base_ = 'mmplugin_l2::...'` from a user folder and
    `mim train mmplugin_l2 CONFIG` all find the installed copy's configs and tools."""
    inst = two_clones_installed
    _installs_ok(inst)
    repo, user, py, env = inst['second'], inst['user'], inst['py'], inst['env']
    r = subprocess.run([py, '-m', 'mim', 'search', 'mmplugin_l2', '--field', 'config'], cwd=str(user), env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    listed = {ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith('config ') and ln.split()[1] != 'id:'}
    assert len(listed) == len(list((repo / 'configs').glob('mm*/*.py'))) > 0

    (user / 'my_config.py').write_text("_base_ = 'mmplugin_l2::mmdet/mask_rcnn_l2vit_t_1x.py'\n")
    code = ("import mmplugin_l2, os.path as osp, sys, importlib.metadata as m, pkg_resources; "
            "from mmengine.config import Config; c = Config.fromfile('my_config.py'); "
            "print(m.version('setuptools'), osp.relpath(pkg_resources.__file__, sys.prefix), c.model.backbone.type, "
            "osp.dirname(mmplugin_l2.__file__))")
    r = subprocess.run([py, '-W', 'ignore', '-c', code], cwd=str(user), env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    setuptools, pkg_resources, btype, pkg = r.stdout.split()[-4:]
    # the venv's own setuptools is back below 82, with its pkg_resources (this environment's, on the venv's path
    # after its own, would hide a missing one)
    assert int(setuptools.split('.')[0]) < 82 and not pkg_resources.startswith('..'), (setuptools, pkg_resources)
    assert btype == 'L2ViT' and osp.samefile(pkg, repo / 'mmplugin_l2')

    # mim runs <location>/mmplugin_l2/.mim/tools/train.py, i.e. the copy's tools/train.py (its --help, no training)
    r = subprocess.run([py, '-m', 'mim', 'train', 'mmplugin_l2', 'configs/demo/mask_rcnn_hvit3_t_demo.py',
                        '--gpus', '0', '-y', '--', '--help'], cwd=str(user), env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and '--cfg-options' in r.stdout and '--resume' in r.stdout, r.stdout[-2000:] + r.stderr


def test_install_script_moves_the_install_to_another_clone(two_clones_installed):
    """A second clone installed into the same environment takes over: its line replaces the first clone's in
    easy-install.pth (pip leaves a development install outside the environment's prefix alone), so both
    `import mmplugin_l2` and mim find the second one."""
    inst = two_clones_installed
    _installs_ok(inst)
    code = ("import mmplugin_l2, pkg_resources; "
            "print(mmplugin_l2.__file__, pkg_resources.get_distribution('mmplugin_l2').location)")
    r = subprocess.run([inst['py'], '-W', 'ignore', '-c', code], cwd=str(inst['user']), env=inst['env'],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    module, location = r.stdout.split()
    assert osp.samefile(osp.dirname(module), inst['second'] / 'mmplugin_l2')
    assert osp.samefile(location, inst['second'])
