"""tools/analysis: the FLOPs counter against hand-computed values; the benchmark, also against the authors'
code."""
import json
import subprocess
import sys

import pytest
from conftest import ROOT

LENET_CFG = """
default_scope = 'mmpretrain'
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)
model = dict(type='ImageClassifier', backbone=dict(type='LeNet5', num_classes=10))
"""


def get_flops(*args):
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/get_flops.py', *map(str, args)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_flops_of_a_small_conv_model_equal_hand_count(tmp_path):
    cfg = tmp_path / 'lenet.py'
    cfg.write_text(LENET_CFG)
    out = tmp_path / 'flops.json'
    r = get_flops(cfg, '--shape', 32, 32, '--in-channels', 1, '--json', out)
    # LeNet-5 on 1x32x32, multiply-adds of convs and linears (pooling and tanh are not counted):
    hand = (6 * 1 * 5 * 5 * 28 * 28      # conv1 -> 6x28x28
            + 16 * 6 * 5 * 5 * 10 * 10   # conv2 -> 16x10x10
            + 120 * 16 * 5 * 5           # conv3 -> 120x1x1
            + 120 * 84 + 84 * 10)        # fc1, fc2
    params = (6 * 25 + 6) + (16 * 6 * 25 + 16) + (120 * 16 * 25 + 120) + (120 * 84 + 84) + (84 * 10 + 10)
    res = json.loads(out.read_text())
    assert res['model']['flops'] == hand == 416_520
    assert res['model']['params'] == params
    assert res['backbone']['flops'] == hand
    assert '416,520 multiply-adds' in r.stdout


def test_flops_count_the_model_not_its_row_bands():
    """The FLOPs counter traces whole maps: a policy that forces one-row bands (whose halo rows are
    recomputed) gives the same count as no pieces, and the policies are back in place afterwards."""
    from conftest import TINY_HVIT3, TINY_L2VIT
    from mmplugin_l2.analysis.flops import count_flops
    from mmplugin_l2.models.backbones import HViT3, L2ViT
    from mmplugin_l2.models.layers import MemoryPolicy, set_memory_policy
    import torch
    x = torch.randn(1, 3, 64, 96)
    for model in (HViT3(arch=TINY_HVIT3).eval(), L2ViT(arch=TINY_L2VIT).eval()):
        counts = []
        for policy in (MemoryPolicy(max_elems=1), None):
            policy = set_memory_policy(model, policy)
            with torch.no_grad():
                counts.append(count_flops(model, (x,)))
            assert all(m.memory_policy is policy for m in model.modules() if hasattr(m, 'memory_policy'))
        assert counts[0] == counts[1] > 0


def test_hvit3_t_classifier_flops_match_the_paper(tmp_path):
    """Paper / authors' fvcore count for H-ViT3-T at 224x224: 4.90 GMACs (4.903 without norms)."""
    out = tmp_path / 'f.json'
    get_flops(f'{ROOT}/configs/mmpretrain/hvit3_t_in1k.py', '--json', out)
    res = json.loads(out.read_text())
    assert abs(res['model']['flops'] / 1e9 - 4.903) / 4.903 < 0.01
    assert res['model']['params'] == 28_703_560


def test_benchmark_writes_every_field(tmp_path):
    out = tmp_path / 'bm'
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/benchmark.py', '--models', 'hvit3_t', 'swin_t',
                        '--sizes', '64', '72x96', '128', '--warmup', '0', '--iters', '1', '--out-dir', str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert '[ 12/12]' in r.stdout  # progress: 2 models x 3 sizes x (latency, memory)
    res = json.loads((out / 'benchmark.json').read_text())
    for key in ('device', 'machine', 'torch', 'batch', 'sizes', 'by_model', 'scaling_exponent', 'raw'):
        assert key in res
    assert set(res['by_model']) == {'hvit3_t', 'swin_t'}
    for rows in res['by_model'].values():
        assert [row['size'] for row in rows] == [[64, 64], [72, 96], [128, 128]]
        for row in rows:
            assert row['tokens'] == -(-row['size'][0] // 4) * -(-row['size'][1] // 4)
            assert row['latency_ms'] > 0 and row['throughput'] > 0 and row['train_peak_mem_mb'] > 0
            assert row['params'] > 0 and 'errors' not in row
    for exps in res['scaling_exponent'].values():
        assert set(exps) == {'64x64->72x96', '72x96->128x128', '64x64->128x128'}
    png = (out / 'benchmark.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 10_000


# ---- benchmark against the authors' code (tools/analysis/benchmark.py --authors-code) --------------------
# Their checkouts are not available here: these tests cover the argument handling, the import glue (on a
# stand-in file of ours laid out like theirs), the parity arithmetic and the ratios.

def _benchmark_cli():
    import importlib.util
    spec = importlib.util.spec_from_file_location('_benchmark_cli', f'{ROOT}/tools/analysis/benchmark.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fake_checkout(root, family, text=''):
    from mmplugin_l2.analysis import authors
    path = root / authors.FAMILIES[family][1]
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return root


def test_authors_code_arguments(tmp_path):
    cli = _benchmark_cli()
    vittt = _fake_checkout(tmp_path / 'ViTTT', 'ViTTT')
    rest = _fake_checkout(tmp_path / 'ResT', 'ResT')
    args = cli.parse_args(['--models', 'hvit3_t', 'l2vit_t', 'rest_s', 'swin_t',
                           '--authors-code', f'vittt={vittt}', f'ResT={rest}'])
    assert args.authors_code == {'ViTTT': str(vittt), 'ResT': str(rest)}
    assert cli.compared_models(args.models, args.authors_code) == {'hvit3_t': str(vittt), 'rest_s': str(rest)}
    assert cli.parse_args([]).authors_code == {}


def test_authors_code_errors_are_clear(tmp_path, capsys):
    cli = _benchmark_cli()

    def error(*argv):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(['--authors-code', *argv])
        assert e.value.code == 2
        return capsys.readouterr().err

    err = error(f'ViTTT={tmp_path}/nowhere')
    assert f'{tmp_path}/nowhere' in err and 'not a directory' in err and 'github.com/Liyining-ai/ViTTT' in err
    (tmp_path / 'L2ViT').mkdir()
    err = error(f'L2ViT={tmp_path}/L2ViT')
    assert f'{tmp_path}/L2ViT/object_detection/mmdet/models/backbones/l2vit.py is missing' in err
    assert 'github.com/ChuanyangZheng/L2ViT' in err
    assert 'FAMILY=PATH with FAMILY one of ViTTT, L2ViT, ResT' in error('ResT')
    assert "got 'Swin=/x'" in error('Swin=/x')
    rest = _fake_checkout(tmp_path / 'ResT', 'ResT')
    assert 'ResT given twice' in error(f'ResT={rest}', f'rest={rest}')


def test_authors_code_needs_timm(monkeypatch):
    from mmplugin_l2.analysis import authors
    monkeypatch.setitem(sys.modules, 'timm', None)  # makes `import timm` fail
    with pytest.raises(ImportError, match='pip install timm'):
        authors.require_timm()


FAKE_VITTT = '''
import torch.nn as nn
from ..builder import BACKBONES
from ...utils import get_root_logger
from mmdet.registry import MODELS
from mmplugin_l2.models.backbones.hvit3 import HViT3


@MODELS.register_module()
class ViTTT(HViT3):
    """Ours, with 0.25 added to the last stage: the parity check must see exactly that."""

    def forward(self, x):
        outs = super().forward(x)
        return list(outs[:-1]) + [outs[-1] + 0.25]


@MODELS.register_module()
def vittt_tiny(**kwargs):
    return ViTTT(arch='tiny', **kwargs)
'''


def test_authors_import_glue_parity_and_worker(tmp_path, monkeypatch):
    """A file laid out like the authors' ViTTT one (relative `..builder` / `...utils` imports, mmdet's
    registry decorator) is imported through the stand-ins, which are removed again afterwards; the parity
    check loads its weights into ours and reports the per-stage difference; the worker times it."""
    import mmdet.registry
    from mmplugin_l2.analysis import authors
    from mmplugin_l2.analysis import benchmark as bm
    monkeypatch.setattr(authors, 'require_timm', lambda: None)
    root = _fake_checkout(tmp_path / 'ViTTT', 'ViTTT', FAKE_VITTT)
    res = authors.parity('hvit3_t', str(root), (64, 96))
    assert sys.modules['mmdet.registry'] is mmdet.registry and 'ViTTT' not in mmdet.registry.MODELS.module_dict
    assert [s['shape'] for s in res['stages']] == [[2, 64, 16, 24], [2, 128, 8, 12], [2, 320, 4, 6],
                                                   [2, 512, 2, 3]]
    assert [s['max_abs_diff'] for s in res['stages'][:3]] == [0, 0, 0]
    assert abs(res['stages'][3]['max_abs_diff'] - 0.25) < 1e-5
    assert res['max_abs_diff'] == res['stages'][3]['max_abs_diff']
    assert res['family'] == 'ViTTT' and res['size'] == [64, 96] and res['ours_cfg'] == {}
    r = bm.worker('hvit3_t@authors', (64, 64), 'latency', 1, 0, 1, 'cpu', authors_root=str(root))
    assert r['model'] == 'hvit3_t@authors' and r['latency_ms'] > 0
    assert r['params'] == sum(p.numel() for p in bm.build('hvit3_t').parameters())
    with pytest.raises(ValueError, match='mod 32'):
        authors.check_size('rest_s', (224, 200))
    authors.check_size('rest_s', (800, 1343))
    authors.check_size('hvit3_t', (200, 201))


def test_vs_authors_ratios_and_report(tmp_path):
    from mmplugin_l2.analysis import benchmark as bm

    def row(size, lat, mem):
        return dict(size=size, tokens=bm.tokens(size), latency_ms=lat, throughput=None, train_peak_mem_mb=mem)
    by_model = {'hvit3_t': [row([224, 224], 10., 52.), row([800, 1344], 100., None)],
                'hvit3_t@authors': [row([224, 224], 13.1, 100.), row([800, 1344], 150., 80.)],
                'swin_t': [row([224, 224], 5., 20.)]}
    res = bm.vs_authors(by_model, {'hvit3_t': dict(max_abs_diff=3e-7)})
    assert list(res) == ['hvit3_t'] and list(res['hvit3_t']) == ['224x224', '800x1344']
    r = res['hvit3_t']['224x224']
    assert r['speedup'] == pytest.approx(1.31) and r['mem_ratio'] == pytest.approx(0.52) and r['max_abs_diff'] == 3e-7
    assert res['hvit3_t']['800x1344'] == dict(speedup=1.5, mem_ratio=None, max_abs_diff=3e-7)
    assert (bm.format_vs_authors('hvit3_t', '224x224', r)
            == 'hvit3_t vs authors at 224x224: forward 1.31x faster, train memory 0.52x, max |diff| 3.0e-07')
    assert bm.format_vs_authors('hvit3_t', '800x1344', res['hvit3_t']['800x1344']).endswith('train memory -x, '
                                                                                            'max |diff| 3.0e-07')
    assert bm.vs_authors(by_model)['hvit3_t']['224x224']['max_abs_diff'] is None
    summary = dict(by_model=by_model, device='cpu', batch=1, torch='x')
    bm.plot(summary, tmp_path / 'p.png')  # the authors' lines dashed, in their model's colour
    assert (tmp_path / 'p.png').read_bytes()[:4] == b'\x89PNG'


# ---- training-step benchmark (tools/analysis/train_benchmark.py) and roofline (tools/analysis/roofline.py) ----

def _train_cli():
    import importlib.util
    spec = importlib.util.spec_from_file_location('_train_cli', f'{ROOT}/tools/analysis/train_benchmark.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_benchmark_runs_variants_and_rounds(tmp_path):
    out = tmp_path / 'tb'
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/train_benchmark.py', '--models', 'hvit3_t',
                        '--sizes', '64', '--batches', '2', '--variants', 'cp', '--warmup', '0', '--iters', '2',
                        '--rounds', '2', '--out-dir', str(out)], capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert '[  6/6]' in r.stdout  # 2 rounds x (default train, default inference, cp train)
    res = json.loads((out / 'train_benchmark.json').read_text())
    rows = res['table']['64x64/b2']
    assert set(rows) == {'hvit3_t', 'hvit3_t[cp]'}
    assert rows['hvit3_t[cp]']['extra_cfg'] == {'with_cp': True} and 'infer_ms' not in rows['hvit3_t[cp]']
    for row in rows.values():
        st = row['step_ms']
        assert st['n'] == 4 and st['min'] <= st['median'] <= st['max']  # 2 rounds x 2 iterations
        assert row['train_peak_mem_mb']['median'] > 0 and row['params'] > 0
        parts = sum(row[k]['median'] for k in ('forward_ms', 'backward_ms', 'optimizer_ms'))
        assert parts == pytest.approx(st['median'], rel=0.5)
    assert rows['hvit3_t']['infer_ms']['n'] == 4
    assert res['best_variants']['64x64/b2']['hvit3_t']['fastest'] in rows
    md = (out / 'train_benchmark.md').read_text()
    assert '**64×64, batch 2**' in md and '`hvit3_t[cp]`' in md


def test_train_benchmark_tables_and_ratios():
    cli = _train_cli()

    def train(label, rnd, step, mem, size=(800, 1344)):
        return dict(label=label, round=rnd, size=list(size), batch=2, mode='train', params=10, extra_cfg={},
                    step_ms=step, forward_ms=step / 4, backward_ms=step / 2, optimizer_ms=step / 4,
                    train_peak_mem_mb=mem, steps=[dict(total_ms=step * .9), dict(total_ms=step * 1.1)])

    def infer(label, rnd, ms):
        return dict(label=label, round=rnd, size=[800, 1344], batch=2, mode='latency', latency_ms=ms,
                    times_ms=[ms, ms])
    raw = [train('hvit3_t', 0, 100., 40.), infer('hvit3_t', 0, 10.), train('hvit3_t[cp]', 0, 150., 30.),
           train('hvit3_t@authors', 0, 200., 100.), infer('hvit3_t@authors', 0, 20.),
           train('hvit3_t', 1, 120., 42.), infer('hvit3_t', 1, 14.), train('hvit3_t[cp]', 1, 130., 30.),
           train('hvit3_t@authors', 1, 180., 100.), infer('hvit3_t@authors', 1, 20.),
           dict(label='swin_t', round=0, size=[800, 1344], batch=2, mode='train', error='boom')]
    table = cli.summarize(raw)
    rows = table['800x1344/b2']
    assert rows['hvit3_t']['step_ms'] == dict(median=110., min=90., max=132., n=4)
    assert rows['hvit3_t']['infer_ms'] == dict(median=12., min=10., max=14., n=4)
    assert rows['swin_t']['errors'] == ['train: boom']
    vs = cli.vs_authors(table)['800x1344/b2']
    assert vs['hvit3_t'] == pytest.approx(dict(train_speedup=190 / 110, mem_ratio=41 / 100, infer_speedup=20 / 12))
    assert vs['hvit3_t[cp]']['train_speedup'] == pytest.approx(190 / 140)
    assert vs['hvit3_t[cp]']['infer_speedup'] == pytest.approx(20 / 12)  # inference does not depend on with_cp
    assert cli.best_variants(table)['800x1344/b2']['hvit3_t'] == dict(fastest='hvit3_t',
                                                                       smallest_memory='hvit3_t[cp]')
    md = cli.markdown(dict(table=table, vs_authors=cli.vs_authors(table), rounds=2, iters=2, warmup=1))
    assert '| `hvit3_t` | 0.11 (0.09–0.13) |' in md and '1.73, 0.41, 1.67' in md and 'failed: train: boom' in md


def test_roofline_layers_partition_the_model_and_account_for_its_macs():
    from conftest import TINY_HVIT3, TINY_L2VIT, TINY_REST
    from mmplugin_l2.analysis import roofline as rl
    from mmplugin_l2.models.backbones import HViT3, L2ViT, ResT
    import torch
    for model in (HViT3(arch=TINY_HVIT3), L2ViT(arch=TINY_L2VIT), ResT(arch=TINY_REST)):
        named = rl.layers(model)
        owners = {}
        for name, mod in named:
            for p in mod.parameters():
                assert id(p) not in owners, f'{name} shares a parameter with {owners[id(p)]}'
                owners[id(p)] = name
        assert len(owners) == len(list(model.parameters()))  # every parameter in exactly one layer
        prof = rl.profile_layers(model, torch.randn(1, 3, 64, 96))
        layer_macs = sum(s['macs'] for g, s in prof['layers'].items() if g != 'other')
        assert 0 < layer_macs <= prof['macs'] and prof['layers']['other']['macs'] >= 0
        assert prof['layers']['other']['macs'] < 0.05 * prof['macs']  # the layers hold the work
        assert all(s['calls'] > 0 and s['seconds'] > 0 and s['bytes'] > 0
                   for g, s in prof['layers'].items() if g != 'other')
        assert sum(s['seconds'] for s in prof['layers'].values()) == pytest.approx(prof['seconds'], rel=0.05)
    assert rl.peak_matmul(n=256, iters=2) > 1e6 and rl.peak_bandwidth(mbytes=8, iters=2) > 1e6
    assert rl.layer_group('layers.2.blocks.0.attn', torch.nn.Linear(1, 1)) == 'stage 3 / Linear'
    assert rl.layer_group('patch_embed', torch.nn.Linear(1, 1)) == '- / Linear'


def test_roofline_times_a_layer_run_inside_another_once():
    """With pieces forced, L2ViT's pre-norms run inside the attention / MLP pieces (`ops.memory.pre_norm`):
    their time is counted as the outer layer's, never twice, so the layers' seconds stay within the forward's."""
    from conftest import TINY_L2VIT
    from mmplugin_l2.analysis import roofline as rl
    from mmplugin_l2.models.backbones import L2ViT
    import torch
    model = L2ViT(arch=TINY_L2VIT, memory_policy=dict(max_elems=64))
    prof = rl.profile_layers(model, torch.randn(1, 3, 64, 96))
    in_layers = sum(s['seconds'] for g, s in prof['layers'].items() if g != 'other')
    assert in_layers <= prof['seconds']
    norms = [s for g, s in prof['layers'].items() if g.endswith('/ LayerNorm')]
    assert norms and all(s['calls'] > 0 for s in norms)
