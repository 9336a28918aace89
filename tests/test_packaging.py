"""What a user outside the repository relies on: configs inherited as `mmplugin_l2::PATH`, the version in one
place, the demo configs runnable by the libraries' stock tools on a CPU, and the Slurm scripts."""
import os
import os.path as osp
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
