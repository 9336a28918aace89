"""model-index.yml and configs/*/metafile.yml (OpenMMLab's format, read by `mim search` and mmengine's
`mmplugin_l2::` config lookup): every entry against its config file — the config exists, every config is listed
exactly once, its parameter count equals the model built from the config, the results are marked as the authors'
numbers — and the index is installed with the package (mmplugin_l2/.mim)."""
import copy
import glob
import os.path as osp

import pytest
import torch
import yaml

from config_helpers import load, registries

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
INDEX = yaml.safe_load(open(osp.join(ROOT, 'model-index.yml')))
METAFILES = {p: yaml.safe_load(open(osp.join(ROOT, p))) for p in INDEX['Import']}
ENTRIES = [(p, m) for p, meta in METAFILES.items() for m in meta['Models']]
CONFIGS = sorted(osp.relpath(p, ROOT) for p in glob.glob(osp.join(ROOT, 'configs', 'mm*', '*.py')))


def test_index_lists_one_metafile_per_family():
    assert sorted(INDEX['Import']) == ['configs/hvit3/metafile.yml', 'configs/l2vit/metafile.yml',
                                       'configs/rest/metafile.yml']
    for p, meta in METAFILES.items():
        (col, ) = meta['Collections']
        assert col['Paper']['URL'].startswith('https://arxiv.org/abs/') and col['Paper']['Title']
        assert col['Code']['URL'].startswith('https://github.com/')
        assert osp.isfile(osp.join(ROOT, col['README']))


def test_every_config_listed_once():
    listed = [m['Config'] for _, m in ENTRIES]
    assert len(listed) == len(set(listed)), 'a config is listed twice'
    assert sorted(listed) == CONFIGS, (f'not in a metafile: {sorted(set(CONFIGS) - set(listed))}; '
                                       f'no such config: {sorted(set(listed) - set(CONFIGS))}')


@pytest.mark.parametrize('meta_path,entry', ENTRIES, ids=[m['Name'] for _, m in ENTRIES])
def test_entry_matches_config(meta_path, entry):
    cfg_path = entry['Config']
    assert osp.isfile(osp.join(ROOT, cfg_path)), cfg_path
    assert entry['Name'] == osp.basename(cfg_path)[:-3]
    (col, ) = METAFILES[meta_path]['Collections']
    assert entry['In Collection'] == col['Name']
    md = entry['Metadata']
    lib = cfg_path.split('/')[1]
    assert md['Framework'] == lib
    assert md['Training Data'] == {'mmdet': 'COCO', 'mmseg': 'ADE20K', 'mmpretrain': 'ImageNet-1k'}[lib]
    if 'FLOPs' in md:
        assert isinstance(md['FLOPs'], int) and md['FLOPs'] > md['Parameters']
    if 'Results' in entry:
        assert 'the authors' in md['Results Reported By']
        for r in entry['Results']:
            assert r['Dataset'] == md['Training Data'] and all(0 < v < 100 for v in r['Metrics'].values())
    if 'Weights' in entry:
        assert entry['Weights'].startswith('https://') and entry['Converted From']['Weights'] == entry['Weights']

    cfg = load(cfg_path[len('configs/'):])
    bb = cfg.model.backbone
    assert entry['In Collection'] == {'HViT3': 'HViT3', 'ViT3': 'HViT3', 'L2ViT': 'L2ViT', 'ResT': 'ResT'}[bb.type]
    epochs = cfg.train_cfg.get('max_epochs')
    assert md.get('Epochs', md.get('Iterations')) == (epochs if epochs else cfg.train_cfg.max_iters)
    MODELS, _ = registries(cfg)
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None
    if cfg.get('data_preprocessor') is not None:
        model_cfg.setdefault('data_preprocessor', cfg.data_preprocessor)
    with torch.device('meta'):  # the construction code, without allocating the weights
        model = MODELS.build(model_cfg)
    assert sum(p.numel() for p in model.parameters()) == md['Parameters'], cfg_path


def test_installed_with_the_package():
    """setup.py puts model-index.yml, configs/ and tools/ under mmplugin_l2/.mim (tools/install.sh)."""
    import mmplugin_l2.config as pc
    mim = pc.mim_dir()
    assert osp.isfile(osp.join(mim, 'model-index.yml')), f'{mim} is missing: run bash tools/install.sh'
    assert yaml.safe_load(open(osp.join(mim, 'model-index.yml'))) == INDEX
    for p in INDEX['Import']:
        assert osp.isfile(osp.join(mim, p))
    for c in CONFIGS:
        assert osp.isfile(osp.join(mim, c)), c
    assert osp.isfile(osp.join(mim, 'tools', 'train.py'))  # what `mim train mmplugin_l2` runs


def _get_flops():
    import importlib.util
    spec = importlib.util.spec_from_file_location('get_flops', osp.join(ROOT, 'tools', 'analysis', 'get_flops.py'))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CHEAP = ['hvit3_t_in1k', 'vit3_t_in1k', 'l2vit_t_in1k', 'rest_lite_in1k']


@pytest.mark.parametrize('name', CHEAP)
def test_cheap_entries_numbers_are_the_counters(name):
    """The Parameters / FLOPs of the tiny classifiers (224x224, the metafile's input) equal what
    `get_flops.py --update-metafile` writes: the whole model's count from mmplugin_l2.analysis.flops."""
    from mmplugin_l2.analysis.flops import model_complexity
    from mmplugin_l2.apis import load_config
    (entry, ) = [m for _, m in ENTRIES if m['Name'] == name]
    res = model_complexity(load_config(osp.join(ROOT, entry['Config'])))
    assert res['shape'] == (224, 224) or tuple(res['shape']) == (224, 224)
    assert entry['Metadata']['Parameters'] == res['model']['params']
    assert entry['Metadata']['FLOPs'] == res['model']['flops'], (name, entry['Metadata']['FLOPs'], res['model'])


def test_update_mode_rewrites_only_the_numbers_of_the_entry():
    text = ('# head\nModels:\n- Name: a\n  Metadata:\n    Parameters: 1\n    Framework: x\n    FLOPs: 7\n'
            '- Name: b\n  Metadata:\n    Parameters: 2\n    Epochs: 3\n')
    out = _get_flops().set_entry_numbers(text, 'b', 20, 300)
    assert out == text.replace('    Parameters: 2\n', '    Parameters: 20\n    FLOPs: 300\n')
    out = _get_flops().set_entry_numbers(out, 'a', 10, 70)
    assert yaml.safe_load(out)['Models'] == [
        {'Name': 'a', 'Metadata': {'Parameters': 10, 'FLOPs': 70, 'Framework': 'x'}},
        {'Name': 'b', 'Metadata': {'Parameters': 20, 'FLOPs': 300, 'Epochs': 3}}]
    assert out.startswith('# head\n')
