"""model-index.yml and configs/*/metafile.yml (OpenMMLab's format, read by `mim search` and mmengine's
`mmplugin_l2::` config lookup): every entry against its config file — the config exists, every config is listed
exactly once, its parameter count equals the model built from the config, the results are marked as the authors'
numbers — every entry has Parameters and FLOPs as `tools/analysis/get_flops.py --update-metafile` writes them (the
cheapest recounted here), the family pages' model-zoo tables show them, and the index is installed with the package
(mmplugin_l2/.mim)."""
import copy
import glob
import os.path as osp
import re

import pytest
import torch
import yaml

from config_helpers import load, registries
from conftest import analysis_tool

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


def test_every_entry_has_params_and_flops():
    """What `mim search mmplugin_l2` shows: every entry has a positive integer Parameters and FLOPs, and the 1x / 3x
    entries of one model carry the same numbers."""
    missing = [m['Name'] for _, m in ENTRIES
               if not all(type(m['Metadata'].get(k)) is int and m['Metadata'][k] > 0 for k in ('Parameters', 'FLOPs'))]
    assert not missing, f'no positive integer Parameters / FLOPs in the metafile: {missing}'
    numbers = {}
    for _, m in ENTRIES:
        numbers.setdefault(re.sub(r'_[13]x$', '', m['Name']), set()).add(
            (m['Metadata']['Parameters'], m['Metadata']['FLOPs']))
    assert all(len(v) == 1 for v in numbers.values()), {k: v for k, v in numbers.items() if len(v) > 1}


def test_numbers_are_in_the_form_get_flops_writes():
    """`get_flops.py --update-metafile` writes the FLOPs line right after Parameters: an entry whose FLOPs sit
    elsewhere was typed in (a paper's figure), not counted."""
    for p in INDEX['Import']:
        text = open(osp.join(ROOT, p)).read()
        for block in text.split('\nModels:\n', 1)[1].split('- Name: ')[1:]:
            name = block.split('\n', 1)[0]
            assert re.search(r'\n    Parameters: \d+\n    FLOPs: \d+\n', block), \
                f'{p}: {name}: Parameters / FLOPs not as get_flops.py --update-metafile writes them'


ZOO_ROW = re.compile(r'^\| \[(\w+)\]\(\.\./(configs/[^)]+)\) \| [^|]+ \| ([^|]+) \| ([^|]+) \|', re.M)


@pytest.mark.parametrize('meta_path', sorted(METAFILES))
def test_docs_zoo_table_shows_the_metafile_numbers(meta_path):
    """The family page's model-zoo table (config | task | params | FLOPs | result) lists every entry of the
    metafile once, with params as `Parameters / 1e6` to two decimals and `M`, FLOPs as `FLOPs / 1e9` to one decimal
    and `G`."""
    (col, ) = METAFILES[meta_path]['Collections']
    rows = ZOO_ROW.findall(open(osp.join(ROOT, col['README']), encoding='utf-8').read())
    entries = {m['Name']: m for m in METAFILES[meta_path]['Models']}
    assert sorted(r[0] for r in rows) == sorted(entries), f"{col['README']}: zoo table rows != {meta_path} entries"
    for name, cfg, params, flops in rows:
        md = entries[name]['Metadata']
        assert cfg == entries[name]['Config'], (col['README'], name, cfg)
        want = (f"{md['Parameters'] / 1e6:.2f} M", f"{md['FLOPs'] / 1e9:.1f} G")
        assert (params.strip(), flops.strip()) == want, f"{col['README']}: {name}: {params} | {flops}, metafile {want}"


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
    assert md['FLOPs'] > md['Parameters']
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
    return analysis_tool('get_flops')


#: one classifier per family (224x224) and the smallest detector (ResT-Lite RetinaNet, 800x1280, about 10 s); the
#: UperNets (512x2048) take half a minute each and are counted by `get_flops.py --update-metafile` only
CHEAP = ['hvit3_t_in1k', 'vit3_t_in1k', 'l2vit_t_in1k', 'rest_lite_in1k', 'retinanet_rest_lite_1x']


@pytest.mark.parametrize('name', CHEAP)
def test_cheap_entries_numbers_are_the_counters(name):
    """The Parameters / FLOPs of the cheapest entries equal what `get_flops.py --update-metafile` writes now: the
    whole model's count from mmplugin_l2.analysis.flops.model_complexity at the library's default input."""
    from mmplugin_l2.analysis.flops import DEFAULT_SHAPES, model_complexity
    from mmplugin_l2.apis import load_config
    (entry, ) = [m for _, m in ENTRIES if m['Name'] == name]
    res = model_complexity(load_config(osp.join(ROOT, entry['Config'])))
    assert tuple(res['shape']) == DEFAULT_SHAPES[entry['Metadata']['Framework']]
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
