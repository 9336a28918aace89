"""tools/analysis: the FLOPs counter against hand-computed values; the benchmark, also against the authors'
code."""
import json
import math
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, analysis_tool

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
    """Paper / authors' fvcore count for H-ViT3-T at 224x224: 4.90 GMACs (4.903 without norms). get_flops.py's
    main in this process (the script itself runs above): its default input for the config, its JSON."""
    cli = analysis_tool('get_flops')
    out = tmp_path / 'f.json'
    cli.main([f'{ROOT}/configs/mmpretrain/hvit3_t_in1k.py', '--json', str(out)])
    res = json.loads(out.read_text())
    assert abs(res['model']['flops'] / 1e9 - 4.903) / 4.903 < 0.01
    assert res['model']['params'] == 28_703_560


# ---- the benchmark (tools/analysis/benchmark.py, mmplugin_l2/analysis/benchmark.py) ----------------------

def _cli():
    return analysis_tool('benchmark')


def _sdpa_calls(model, x):
    import torch
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, torch.no_grad():
        out = model(x)
    return sum(e.count for e in prof.key_averages() if e.key == 'aten::scaled_dot_product_attention'), out


def test_model_table_builds_every_entry():
    """Every entry of the one model table builds and runs at 32x32; the plain-attention DeiT-T computes DeiT-T's
    function (same weights) without PyTorch's fused attention, which DeiT-T calls once per block."""
    import torch
    from mmplugin_l2.analysis.models import LABELS, MODELS, build
    assert set(LABELS) == set(MODELS)
    assert {'hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s', 'deit_t', 'deit_t_plain', 'deit_s', 'vit_b', 'swin_t',
            'swin_s', 'pvtv2_b2'} <= set(MODELS)
    x = torch.randn(1, 3, 32, 32)
    for name in MODELS:
        m = build(name, size=(32, 32))
        m.eval()   # (mmdet's and mmpretrain's train() return None)
        with torch.no_grad():
            out = m(x)
        assert out and all(torch.isfinite(o).all() for o in out), name
    fused, plain = build('deit_t', size=(32, 32)), build('deit_t_plain', size=(32, 32))
    plain.load_state_dict(fused.state_dict())
    fused.eval()
    plain.eval()
    n_fused, a = _sdpa_calls(fused, x)
    n_plain, b = _sdpa_calls(plain, x)
    assert (n_fused, n_plain) == (12, 0)
    torch.testing.assert_close(a[0], b[0], rtol=1e-4, atol=1e-5)


def test_model_names_and_authors_entries_need_their_checkout(tmp_path, capsys, monkeypatch):
    from mmplugin_l2.analysis import authors
    from mmplugin_l2.analysis.models import check_name
    cli = _cli()
    with pytest.raises(ValueError, match="hvit3_t@authors needs the authors' checkout: pass --authors-code ViTTT="):
        check_name('hvit3_t@authors')
    with pytest.raises(ValueError, match="no authors' implementation of 'swin_t'"):
        check_name('swin_t@authors', {'ViTTT': '/x'})
    with pytest.raises(ValueError, match="unknown model 'deit_x'"):
        check_name('deit_x')
    for argv, msg in ((['--models', 'rest_s@authors'], 'pass --authors-code ResT=PATH'),
                      (['--sizes', '12a'], "size '12a' is not H or HxW"),
                      (['--rounds', '0'], '--rounds, --iters and --batches must be >= 1'),
                      (['--device', 'tpu'], "--device 'tpu': allowed cpu, cuda, cuda:N"),
                      (['--authors-code', f'ViTTT={tmp_path}/nowhere'], 'not a directory'),
                      (['--authors-code', 'Swin=/x'], 'FAMILY=PATH with FAMILY one of ViTTT, L2ViT, ResT')):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(['run', '--out', str(tmp_path / 'r.json'), *argv])
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
    monkeypatch.setattr(authors, 'require_timm', lambda: None)
    vittt = _fake_checkout(tmp_path / 'ViTTT', 'ViTTT')
    args = cli.parse_args(['run', '--out', str(tmp_path / 'r.json'), '--models', 'hvit3_t@authors', 'vit3_t',
                           '--authors-code', f'vittt={vittt}'])
    assert args.authors_roots == {'ViTTT': str(vittt)} and args.sizes == [(224, 224), (512, 512), (1248, 1248),
                                                                           (2048, 2048)]


def test_every_kind_runs_in_a_subprocess_and_lands_in_the_results_file(tmp_path, capsys):
    """`run` at 32x32, one round: infer and train of two models, each in a fresh process; maxbatch of one, its
    probes and its measurement at the batch found each through `run`'s runner (the fresh process above; here one
    that measures in this process and records its calls); then `render` writes the page section and the plot,
    and `render --check` agrees with it. The script's main runs in this process (the measurements in theirs; the
    script itself starts as a process in test_run_with_two_precisions_measures_and_renders_each)."""
    out = tmp_path / 'sub' / 'r.json'
    cli = _cli()
    assert cli.main(['run', '--models', 'vit3_t', 'deit_t', '--sizes', '32', '--kinds', 'infer', 'train', '--rounds',
                     '1', '--warmup', '0', '--iters', '1', '--smoke', '--out', str(out)]) == 0
    assert '[  4/4]' in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res['format'] == 'mmplugin_l2-benchmark/1' and res['smoke'] is True
    for key in ('torch', 'python', 'commit', 'device', 'threads', 'cpu'):
        assert key in res['env']
    got = {(s['model'], s['kind']): s for s in res['samples']}
    assert set(got) == {('vit3_t', 'infer'), ('deit_t', 'infer'), ('vit3_t', 'train'), ('deit_t', 'train')}
    for (m, kind), s in got.items():
        assert 'error' not in s and s['size'] == [32, 32] and s['batch'] == 1 and s['params'] > 0
        assert s['peak_mem_mb'] is None or s['peak_mem_mb'] > 0
        assert (s['latency_ms'] > 0 and s['throughput'] > 0) if kind == 'infer' else s['step_ms'] > 0
    from mmplugin_l2.analysis import benchmark as bm
    spec = dict(model='vit3_t', kind='maxbatch', size=[32, 32], round=0, batch=1, warmup=0, iters=1,
                device='cpu', budget_mb=1e6, max_batch=2)
    calls = []

    def runner(s, timeout=None):
        calls.append((s['kind'], s['batch'], s['warmup'], s['iters']))
        return bm.measure(s)
    mb = bm.run([spec], {}, str(tmp_path / 'm.json'), log=lambda s: None, runner=runner)['samples'][0]
    assert calls == [('infer', 1, 0, 1), ('infer', 2, 0, 1), ('infer', 2, 0, 1)]  # the probes, then the batch found
    assert mb['kind'] == 'maxbatch' and mb['batch'] == 2 and mb['throughput'] > 0
    assert set(mb['probes']) == {'1', '2'} and json.loads((tmp_path / 'm.json').read_text())['samples'] == [mb]
    doc = tmp_path / 'page.md'
    doc.write_text(f'# title\n\n{bm.BEGIN}\nold\n{bm.END}\n\nafter\n')
    png = tmp_path / 'p.png'
    cmd = ['render', str(out), '--doc', str(doc)]
    assert cli.main(cmd + ['--plot', str(png)]) == 0
    text = doc.read_text()
    assert text.startswith('# title\n\n' + bm.BEGIN + '\n') and text.endswith(bm.END + '\n\nafter\n')
    assert 'Smoke run, not a benchmark' in text and '| ViT3-T | 1 |' in text and 'old' not in text
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert cli.main(cmd + ['--check']) == 0 and 'up to date' in capsys.readouterr().out
    doc.write_text(text.replace('| ViT3-T | 1 |', '| ViT3-T | 2 |'))
    assert cli.main(cmd + ['--check']) == 1 and 'differs' in capsys.readouterr().out


def test_a_failed_measurement_is_a_sample_with_its_error():
    from mmplugin_l2.analysis import benchmark as bm
    s = bm.run_subprocess(dict(model='hvit3_t@authors', kind='infer', size=[32, 32], batch=1, warmup=0, iters=1,
                               device='cpu', round=2, authors_roots={'ViTTT': '/nowhere'}))
    assert s == dict(model='hvit3_t@authors', kind='infer', size=[32, 32], batch=1, round=2, error=s['error'])
    assert s['error'].startswith('FileNotFoundError: ViTTT:') and '/nowhere' in s['error'] and '\n' not in s['error']


def test_measuring_process_imports_the_package_the_run_records(tmp_path, monkeypatch):
    """Started from a folder that holds another `mmplugin_l2` (another checkout: here one that fails on import), a
    measurement's process still imports the package the tool runs (`PACKAGE_ROOT`, whose commit the run records),
    not the working folder's."""
    from mmplugin_l2.analysis import benchmark as bm
    (tmp_path / 'mmplugin_l2').mkdir()
    (tmp_path / 'mmplugin_l2' / '__init__.py').write_text('raise ImportError("the working folder\'s package")\n')
    monkeypatch.chdir(tmp_path)
    s = bm.run_subprocess(dict(model='vit3_t', kind='infer', size=[32, 32], batch=1, warmup=0, iters=1,
                               device='cpu', tiny=True))
    assert 'error' not in s and s['latency_ms'] > 0, s


def test_batch_search_respects_the_budget():
    """Against a fake peak-memory function (affine in the batch, out of memory above a limit): the batch found
    is the largest that fits, and no probe is repeated."""
    from mmplugin_l2.analysis.benchmark import largest_batch
    for per, fixed, budget, oom, cap in ((10., 5., 100., None, 1024), (3., 1., 1000., 40, 1024),
                                         (1., 0., 1e9, None, 50), (200., 0., 100., None, 1024),
                                         (7., 3., 7 * 37 + 3, None, 1024), (1., 0., 64., None, 64)):
        calls = []

        def peak(b):
            calls.append(b)
            return None if oom is not None and b > oom else fixed + per * b
        b, probes = largest_batch(peak, budget, cap)
        want = max([k for k in range(1, cap + 1) if (oom is None or k <= oom) and fixed + per * k <= budget],
                   default=0)
        assert b == want, (per, fixed, budget, oom, cap)
        assert max(probes) <= cap and len(calls) == len(set(calls)) == len(probes) <= 22
        assert all((v is not None and v <= budget) == (k <= want) for k, v in probes.items())


def _sample(model, kind, size, rnd, ms=None, mem=None, batch=1, error=None):
    s = dict(model=model, kind=kind, size=list(size), batch=batch, round=rnd)
    if error:
        return dict(s, error=error)
    key = 'latency_ms' if kind == 'infer' else 'step_ms'
    s.update({key: ms, 'peak_mem_mb': mem})
    if kind == 'infer':
        s['throughput'] = batch / ms * 1e3
    return s


def test_ratios_with_ranges_and_crossover():
    from mmplugin_l2.analysis import benchmark as bm
    ours, theirs = (10., 8., 12.), (30., 27., 40.)
    assert bm.ratio(ours, theirs) == pytest.approx((3., 27 / 12, 40 / 8))
    assert bm.memory_ratio((50., 40., 60.), (100., 80., 120.)) == pytest.approx((.5, 40 / 120, 60 / 80))
    assert bm.ratio(None, theirs) is None
    # speed-up 0.5 at 100 tokens, 2 at 10000: log-linear -> 1 at 1000 tokens
    assert bm.crossover([(10000, 2.), (100, .5)]) == pytest.approx(1000.)
    assert bm.crossover([(100, .5), (400, .8)]) is None
    assert bm.crossover([(100, 1.2), (400, 3.)]) == 100.
    # below 1 again in between: the last crossing counts
    assert bm.crossover([(1, .5), (10, 2.), (100, .5), (1000, 2.)]) == pytest.approx(10 ** 2.5)


def test_render_is_deterministic_and_computes_medians_ranges_ratios_and_crossover():
    from mmplugin_l2.analysis import benchmark as bm
    samples = []
    for rnd, jitter in enumerate((0., 1., -1.)):
        samples += [_sample('vit3_t', 'infer', (224, 224), rnd, 10 + jitter, 100),
                    _sample('deit_t', 'infer', (224, 224), rnd, 5 + jitter / 2, 90),
                    _sample('vit3_t', 'infer', (448, 448), rnd, 20 + jitter, 100),
                    _sample('deit_t', 'infer', (448, 448), rnd, 40 + jitter, 90),
                    _sample('vit3_t', 'train', (448, 448), rnd, 100., 50 + 10 * rnd),
                    _sample('deit_t', 'train', (448, 448), rnd, 300., 200.)]
    samples.append(_sample('swin_t', 'train', (448, 448), 0, error='killed by signal 9 (out of memory?)'))
    res = dict(format=bm.FORMAT, env=dict(device='cpu', torch='t'), config=dict(rounds=3), samples=samples)
    md = bm.render(res)
    assert md == bm.render(json.loads(json.dumps(res)))
    assert '| ViT3-T | 1 | 10 (9–11) | 20 (19–21) |' in md
    assert '| Swin-T (mmdet) | 1 | – | failed: killed by signal 9 (out of memory?) |' in md
    # at 448: speed 40 / 20 = 2 (39 / 21 .. 41 / 19), training 3, training memory 60 / 200 (50 / 200 .. 70 / 200)
    assert ('| ViT3-T vs DeiT-T (mmpretrain) | 1 | 448×448 | 2.00× (1.86–2.16) | 3.00× (3.00–3.00) '
            '| 0.30× (0.25–0.35) |') in md
    # crossover: speed-up 0.5 at 224^2 pixels, 2 at 448^2: 1 at their geometric mean
    assert f'| ViT3-T vs DeiT-T (mmpretrain) | ≈ {math.sqrt(224 * 448):.0f}² pixels | – |' in md
    assert 'Smoke run' not in md
    assert 'Smoke run, not a benchmark' in bm.render(dict(res, smoke=True, note='x'))
    with pytest.raises(ValueError, match='generated:begin'):
        bm.replace_section('no markers', md)


@pytest.mark.parametrize('page,results', [('benchmark.md', 'benchmark_results.json'),
                                          ('benchmark_steady.md', 'benchmark_steady.json')])
def test_committed_page_is_render_of_the_committed_results(page, results):
    """docs/benchmark.md's generated section is exactly `render` of docs/benchmark_results.json, and
    docs/benchmark_steady.md's that of docs/benchmark_steady.json."""
    from mmplugin_l2.analysis import benchmark as bm
    with open(f'{ROOT}/docs/{results}') as f:
        res = json.load(f)
    with open(f'{ROOT}/docs/{page}') as f:
        doc = f.read()
    assert bm.replace_section(doc, bm.render(res)) == doc


# ---- precisions of the benchmark (run --precision) ------------------------------------------------------------

def test_schedule_measures_every_precision_and_the_flag_is_checked(tmp_path, capsys):
    """Per round, per (kind, size, batch, precision) every model once, in the round's order; a spec names its
    precision unless fp32. `--precision` takes several names (repeats dropped) and refuses others by name."""
    from mmplugin_l2.analysis import benchmark as bm
    specs = bm.schedule(['a', 'b'], [(32, 32)], [1], ['infer', 'train'], 2, ['fp32', 'bf16'])
    assert len(specs) == 2 * 2 * 2 * 2
    got = [(s['round'], s['kind'], bm.sample_precision(s), s['model']) for s in specs]
    assert got[:8] == [(0, 'infer', 'fp32', 'a'), (0, 'infer', 'fp32', 'b'), (0, 'infer', 'bf16', 'a'),
                       (0, 'infer', 'bf16', 'b'), (0, 'train', 'fp32', 'a'), (0, 'train', 'fp32', 'b'),
                       (0, 'train', 'bf16', 'a'), (0, 'train', 'bf16', 'b')]
    assert [m for r, _, _, m in got if r == 1][:2] == ['b', 'a']           # the order rotates between rounds
    assert all('precision' not in s for s in specs if bm.sample_precision(s) == 'fp32')
    assert bm.schedule(['a'], [(32, 32)], [1], ['infer'], 1) == [dict(model='a', kind='infer', size=[32, 32],
                                                                      batch=1, round=0)]
    cli = _cli()
    out = str(tmp_path / 'r.json')
    assert cli.parse_args(['run', '--out', out]).precision == ['fp32']
    assert cli.parse_args(['run', '--out', out, '--precision', 'bf16', 'fp32', 'bf16']).precision == ['bf16', 'fp32']
    with pytest.raises(SystemExit) as e:
        cli.parse_args(['run', '--out', out, '--precision', 'fp32', 'fp8'])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--precision: invalid choice: 'fp8'" in err and "'tf32', 'bf16', 'fp16'" in err


def test_render_keeps_precisions_apart():
    """bf16 / fp16 samples never pool with fp32 ones (nor with each other): `summarize` keys them apart (a sample
    saying 'fp32' pools with those saying nothing), `render` makes one set of tables per precision, each with its
    own ratios; a results file of fp32 samples only renders as it always did."""
    from mmplugin_l2.analysis import benchmark as bm
    fp32 = []
    for rnd in range(3):
        fp32 += [_sample('vit3_t', 'infer', (224, 224), rnd, 10. + rnd, 100),
                 _sample('deit_t', 'infer', (224, 224), rnd, 20., 90),
                 _sample('vit3_t', 'train', (224, 224), rnd, 100., 50)]
    fp32[-1]['precision'] = 'fp32'
    half = [dict(_sample('vit3_t', 'infer', (224, 224), 0, 4., 60), precision='bf16'),
            dict(_sample('deit_t', 'infer', (224, 224), 0, 16., 60), precision='bf16'),
            dict(_sample('vit3_t', 'infer', (224, 224), 0, 7., 60), precision='fp16')]
    base = dict(format=bm.FORMAT, env=dict(device='cpu', torch='t'), config=dict(rounds=3))
    summ = bm.summarize(fp32 + half)
    assert summ[('vit3_t', 'infer', '224x224', 1, 'fp32', 'glibc')]['latency_ms'] == (11., 10., 12.)
    assert summ[('vit3_t', 'infer', '224x224', 1, 'bf16', 'glibc')]['latency_ms'] == (4., 4., 4.)
    assert summ[('vit3_t', 'infer', '224x224', 1, 'fp16', 'glibc')]['latency_ms'] == (7., 7., 7.)
    assert summ[('vit3_t', 'train', '224x224', 1, 'fp32', 'glibc')]['rounds'] == 3
    old = bm.render(dict(base, samples=fp32))
    assert '### Inference' in old and '### fp32' not in old and 'autocast' not in old
    md = bm.render(dict(base, samples=fp32 + half))
    assert md.index('### fp32\n') < md.index('### bf16 autocast\n') < md.index('### fp16 autocast\n')
    fp32_part = md[md.index('### fp32\n'):md.index('### bf16 autocast\n')]
    bf16_part = md[md.index('### bf16 autocast\n'):md.index('### fp16 autocast\n')]
    fp16_part = md[md.index('### fp16 autocast\n'):]
    assert fp32_part.replace('### fp32\n\n', '').replace('#### ', '### ').rstrip() in old      # the same tables
    assert '| ViT3-T | 1 | 11 (10–12) |' in fp32_part and '| ViT3-T | 1 | 4 |' in bf16_part
    assert '| ViT3-T | 1 | 7 |' in fp16_part and '| ViT3-T | 1 | 4 |' not in fp32_part + fp16_part
    assert '| ViT3-T vs DeiT-T (mmpretrain) | 1 | 224×224 | 1.82×' in fp32_part
    assert '| ViT3-T vs DeiT-T (mmpretrain) | 1 | 224×224 | 4.00×' in bf16_part
    assert 'vs' not in fp16_part and '**Step time' not in bf16_part   # nothing to compare / measured
    one = bm.render(dict(base, samples=half[:2]))
    assert 'Precision of every sample: bf16 autocast.' in one and '### Inference' in one
    assert bm.plot_precision(dict(samples=half)) == 'bf16' and bm.plot_precision(dict(samples=fp32 + half)) == 'fp32'
    assert bm.plot_title(dict(base, samples=half)).endswith(' - bf16 autocast')



def test_render_keeps_allocators_apart():
    """Samples of another allocator never pool with glibc's: `summarize` keys them apart (no `allocator`: glibc),
    `render` heads one set of tables per (precision, allocator), glibc's under the precision's own heading."""
    from mmplugin_l2.analysis import benchmark as bm
    glibc = [_sample('hvit3_t', 'train', (64, 64), r, 100. + r, 50) for r in range(3)]
    glibc += [_sample('swin_t', 'train', (64, 64), r, 50., 40) for r in range(3)]
    caching = [dict(_sample('hvit3_t', 'train', (64, 64), r, 80., 60), allocator='caching') for r in range(3)]
    caching += [dict(_sample('swin_t', 'train', (64, 64), r, 20., 45), allocator='caching') for r in range(3)]
    summ = bm.summarize(glibc + caching)
    assert summ[('hvit3_t', 'train', '64x64', 1, 'fp32', 'glibc')]['step_ms'] == (101., 100., 102.)
    assert summ[('hvit3_t', 'train', '64x64', 1, 'fp32', 'caching')]['step_ms'] == (80., 80., 80.)
    assert bm.variants_of(caching + glibc) == [('fp32', 'glibc'), ('fp32', 'caching')]
    base = dict(format=bm.FORMAT, env=dict(device='cpu', torch='t'), config=dict(rounds=3))
    md = bm.render(dict(base, samples=glibc + caching))
    assert md.index('### fp32\n') < md.index('### fp32, caching allocator\n')
    glibc_part, caching_part = md.split('### fp32, caching allocator\n')
    assert '| H-ViT3-T vs Swin-T (mmdet) | 1 | 64×64 | – | 0.50×' in glibc_part
    assert '| H-ViT3-T vs Swin-T (mmdet) | 1 | 64×64 | – | 0.25×' in caching_part
    assert 'Precision of every sample: fp32; allocator: caching.' in bm.render(dict(base, samples=caching))


def test_allocator_environments(tmp_path):
    """`allocator_env`: glibc's tunables for `caching` and `live`, a preloaded library for jemalloc / tcmalloc
    where one is found (else a one-line error naming the package), an unknown name refused; `check_allocator`
    refuses a process whose environment does not match, so a sample cannot claim an allocator it did not run
    under."""
    from mmplugin_l2.analysis import benchmark as bm
    from mmplugin_l2.analysis import measure
    assert measure.allocator_env('glibc', {'A': '1'}) == {'A': '1'}
    caching = measure.allocator_env('caching', {})
    assert caching['MALLOC_MMAP_MAX_'] == '0' and int(caching['MALLOC_TRIM_THRESHOLD_']) >= 2**32
    assert measure.allocator_env('live', {})['MALLOC_MMAP_THRESHOLD_'] == '65536'
    lib = tmp_path / 'libjemalloc.so.2'
    lib.write_bytes(b'')
    env = measure.allocator_env('jemalloc', {'LD_PRELOAD': 'other.so'}, dirs=(str(tmp_path),))
    assert env['LD_PRELOAD'] == f'{lib} other.so'
    with pytest.raises(ValueError, match='libtcmalloc.*not found.*libtcmalloc-minimal4'):
        measure.allocator_env('tcmalloc', {}, dirs=(str(tmp_path / 'none'),))
    with pytest.raises(ValueError, match="allocator 'mimalloc'; allowed: glibc, caching, live"):
        measure.allocator_env('mimalloc')
    bm.check_allocator('caching', caching)
    bm.check_allocator('jemalloc', env)
    bm.check_allocator('glibc', {})
    for name, wrong in (('caching', {}), ('glibc', caching), ('jemalloc', {})):
        with pytest.raises(RuntimeError, match=f"allocator '{name}'"):
            bm.check_allocator(name, wrong)


def test_run_under_the_caching_allocator_records_it(tmp_path):
    """`run --allocator glibc caching` (one model, 32x32, one training step after the default warm-up): each
    fresh process runs under its allocator (the measurement checks its environment), each sample says which, the
    default warm-up is the steady state's 2 steps."""
    out = tmp_path / 'a.json'
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/benchmark.py', 'run', '--models', 'vit3_t',
                        '--sizes', '32', '--kinds', 'train', '--allocator', 'glibc', 'caching', '--rounds', '1',
                        '--iters', '1', '--smoke', '--out', str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res['config']['allocators'] == ['glibc', 'caching'] and res['config']['warmup'] == 2
    assert [s.get('allocator') for s in res['samples']] == [None, 'caching']
    assert all('error' not in s and len(s['steps']) == 1 for s in res['samples']), res['samples']
    from mmplugin_l2.analysis import benchmark as bm
    spec = dict(model='vit3_t', kind='train', size=[32, 32], batch=1, warmup=0, iters=1, device='cpu')
    with pytest.raises(RuntimeError, match="allocator 'caching'"):
        bm.measure(dict(spec, allocator='caching'))     # in this process, which runs under glibc's default


def test_detector_iteration_under_bf16(tmp_path):
    """A whole detector's training iteration (`mask_rcnn_hvit3_t`, our config, 128x160, batch 1, at the tiny
    widths of `narrow_detector`): under bf16 autocast mmcv's RoIAlign has no bf16 kernel, so the iteration stops
    at the first RoI unless `mmcv_ops_in_fp32` runs it in fp32; with it the loss is finite, every trainable
    parameter that took part gets a gradient, and the benchmark measures it (its `train` kind, `tiny` honoured),
    the RoI features in bf16; overrides of the backbone's arguments reach the detector's backbone (here
    `fast_compile=False`: no compilation in this test)."""
    import torch
    from mmplugin_l2.analysis import benchmark as bm
    from mmplugin_l2.analysis.measure import model_loss, precision
    from mmplugin_l2.analysis.models import build_detector, is_detector, mmcv_ops_in_fp32
    from mmplugin_l2.analysis.table import TINY, TINY_DETECTOR_WIDTH
    assert is_detector('mask_rcnn_hvit3_t') and is_detector('mask_rcnn_hvit3_t@authors')
    assert not is_detector('hvit3_t') and not is_detector('hvit3_t@authors')
    model, data = build_detector('mask_rcnn_hvit3_t', (128, 160), 1, extra_cfg=dict(fast_compile=False), tiny=True)
    assert model.backbone.with_cp and type(model).__name__ == 'MaskRCNN'
    widths = TINY['HViT3']['arch']['embed_dims']
    assert model.backbone.arch_settings['embed_dims'] == widths and model.neck.in_channels == widths
    assert model.roi_head.bbox_head.fc_out_channels == 4 * TINY_DETECTOR_WIDTH
    assert model.roi_head.mask_head.conv_out_channels == TINY_DETECTOR_WIDTH
    arch = dict(TINY['HViT3']['arch'], embed_dims=[16, 32, 48, 64])  # overrides win over TINY, the neck follows
    other = build_detector('mask_rcnn_hvit3_t', (64, 96), 1, extra_cfg=dict(arch=arch), tiny=True)[0]
    assert other.backbone.arch_settings['embed_dims'] == other.neck.in_channels == [16, 32, 48, 64]
    swin = build_detector('mask_rcnn_swin_t', (64, 96), 1, tiny=True)[0]  # mmdet's backbone: its TINY widths too
    assert swin.neck.in_channels == [16, 32, 64, 128] and swin.neck.out_channels == TINY_DETECTOR_WIDTH
    assert not any(getattr(m, 'fast_compile', False) for m in model.backbone.modules())
    model.train()
    with pytest.raises((RuntimeError, NotImplementedError), match='BFloat16'):
        with precision('bf16', 'cpu'):
            model_loss(model, data)
    seen = []
    hook = model.roi_head.bbox_roi_extractor.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    with mmcv_ops_in_fp32(), precision('bf16', 'cpu'):
        loss = model_loss(model, data)
    hook.remove()
    loss.backward()
    assert torch.isfinite(loss) and seen == [torch.bfloat16]
    assert all(p.grad is not None for p in model.backbone.parameters() if p.requires_grad)
    import mmcv.ops.roi_align  # noqa: F401
    assert sys.modules['mmcv.ops.roi_align'].RoIAlign.forward.__qualname__ == 'RoIAlign.forward'   # restored
    s = bm.measure(dict(model='mask_rcnn_hvit3_t', kind='train', size=[128, 160], batch=1, warmup=0, iters=1,
                        device='cpu', precision='bf16', cfg=dict(fast_compile=False), tiny=True))
    assert s['step_ms'] > 0 and s['precision'] == 'bf16' and len(s['steps']) == 1
    assert s['params'] == sum(p.numel() for p in model.parameters())  # the tiny detector
    with pytest.raises(ValueError, match='only its training iteration'):
        bm.measure(dict(s, kind='infer', size=[128, 160], warmup=0, iters=1, device='cpu'))

def test_cfg_options_apply_to_our_models_only():
    """The benchmark's backbone overrides (`--cfg-options`, a spec's `cfg`) go to our backbones and detectors from
    our configs; the models we compare with (Swin-T here, which has no `fast_train`) are built as they are, and only
    the samples of ours record the overrides."""
    from mmplugin_l2.analysis import benchmark as bm
    from mmplugin_l2.analysis.models import is_ours
    assert all(is_ours(n) for n in ('hvit3_t', 'hvit3_t_cp', 'l2vit_t', 'rest_s', 'vit3_t', 'mask_rcnn_hvit3_t'))
    assert not any(is_ours(n) for n in ('swin_t', 'deit_t', 'swin_t_timm', 'deit_t_timm', 'mask_rcnn_swin_t',
                                        'hvit3_t@authors', 'mask_rcnn_hvit3_t@authors', 'no_such_model'))
    spec = dict(kind='infer', size=[32, 32], batch=1, warmup=0, iters=1, device='cpu', tiny=True,
                cfg=dict(fast_train=False))
    ours, swin = bm.measure(dict(spec, model='hvit3_t')), bm.measure(dict(spec, model='swin_t'))
    assert ours['cfg'] == dict(fast_train=False) and ours['latency_ms'] > 0
    assert 'cfg' not in swin and swin['latency_ms'] > 0


def test_committed_results_keep_fp32_and_bf16_apart():
    """docs/benchmark_results.json: the runs written before precisions existed (no `precision` in their samples)
    count as fp32, the bf16 runs as bf16; the plot shows fp32."""
    from mmplugin_l2.analysis import benchmark as bm
    with open(f'{ROOT}/docs/benchmark_results.json') as f:
        res = json.load(f)
    assert bm.precisions_of(res['samples']) == ['fp32', 'bf16'] and bm.plot_precision(res) == 'fp32'
    old = [s for s in res['samples'] if 'precision' not in s]
    bf16 = [s for s in res['samples'] if s.get('precision') == 'bf16']
    assert old and bf16 and len(old) + len(bf16) == len(res['samples'])
    keys = set(bm.summarize(res['samples']))
    assert keys == set(bm.summarize(old)) | set(bm.summarize(bf16))
    assert {k[4] for k in bm.summarize(old)} == {'fp32'} and {k[4] for k in bm.summarize(bf16)} == {'bf16'}
    assert {k[5] for k in keys} <= {'glibc', 'caching'}


def test_run_with_two_precisions_measures_and_renders_each(tmp_path):
    """`run --precision fp32 bf16` (one model, 32x32, inference, one round): a bf16 sample beside the fp32 one,
    and `render` heads a set of tables for each."""
    out = tmp_path / 'r.json'
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/benchmark.py', 'run', '--models', 'vit3_t',
                        '--sizes', '32', '--kinds', 'infer', '--precision', 'fp32', 'bf16', '--rounds', '1',
                        '--warmup', '0', '--iters', '1', '--smoke', '--out', str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res['config']['precisions'] == ['fp32', 'bf16']
    assert [(s['kind'], s.get('precision')) for s in res['samples']] == [('infer', None), ('infer', 'bf16')]
    assert all('error' not in s and s['latency_ms'] > 0 for s in res['samples'])
    from mmplugin_l2.analysis import benchmark as bm
    md = bm.render(res)
    assert '### fp32' in md and '### bf16 autocast' in md and md.count('| ViT3-T | 1 |') >= 4   # latency, throughput


# ---- benchmark against the authors' code (tools/analysis/benchmark.py --authors-code) --------------------
# Their checkouts are not available here: these tests cover the argument handling, the import glue (on a
# stand-in file of ours laid out like theirs), the parity arithmetic and the ratios.

def _fake_checkout(root, family, text=''):
    from mmplugin_l2.analysis import authors
    path = root / authors.FAMILIES[family][1]
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return root


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
    r = bm.measure(dict(model='hvit3_t@authors', kind='infer', size=[64, 64], batch=1, warmup=0, iters=1,
                        device='cpu', authors_roots={'ViTTT': str(root)}))
    assert r['model'] == 'hvit3_t@authors' and r['latency_ms'] > 0
    assert r['params'] == sum(p.numel() for p in bm.build('hvit3_t').parameters())
    with pytest.raises(ValueError, match='mod 32'):
        authors.check_size('rest_s', (224, 200))
    authors.check_size('rest_s', (800, 1343))
    authors.check_size('hvit3_t', (200, 201))


def test_profile_ops_profiles_the_authors_code(tmp_path, capsys):
    """`profile_ops.py --model <ours>@authors --authors-code FAMILY=PATH` (a stand-in checkout, laid out like theirs)
    profiles their backbone: rows of its layers, what it keeps for backward; the same model as the one the benchmark
    builds. Without the checkout, narrowed (`--tiny`: their code has no narrow widths) or with a whole detector it
    says what is wrong (exit status 2)."""
    root = _fake_checkout(tmp_path / 'ViTTT', 'ViTTT', FAKE_VITTT)
    cli = analysis_tool('profile_ops')
    res = cli.main(['--model', 'hvit3_t@authors', '--authors-code', f'ViTTT={root}', '--size', '64', '--warmup', '0'])
    assert res['model'] == 'hvit3_t@authors' and res['kept_bytes'] > 0
    assert any(r['op'].endswith('/ TTTBlock') or 'Attention' in r['op'] for r in res['rows']), res['rows']
    assert 'hvit3_t@authors 64x64, batch 1, train' in capsys.readouterr().out
    for args, message in ((['--model', 'hvit3_t@authors'], 'pass --authors-code ViTTT=PATH'),
                          (['--model', 'hvit3_t@authors', '--authors-code', f'ViTTT={root}', '--tiny'],
                           'the authors\' code has no narrow widths'),
                          (['--model', 'mask_rcnn_hvit3_t'], 'a whole detector')):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err


# ---- the measuring core (mmplugin_l2/analysis/measure.py) ----------------------------------------------------

def test_timer_counts_warmup_and_timed_calls_and_reports_milliseconds():
    from mmplugin_l2.analysis import measure
    calls = []
    times = measure.time_calls(lambda: (calls.append(1), time.sleep(0.02)), 'cpu', warmup=2, iters=3)
    assert len(calls) == 5 and len(times) == 3 and all(15 < t < 500 for t in times), times
    assert measure.stats([3., 1., 2.]) == dict(median=2., min=1., max=3.)


def test_peak_memory_sees_a_new_peak_and_nothing_below_an_earlier_one():
    """In a fresh process: an allocation that rises 256 MB above the process's earlier peak (the imports may have
    freed memory since, so it is sized from that gap) is measured as its size above the resident set at the
    start; a second, smaller one stays below the process's peak and is not measurable (None)."""
    code = ('import resource, torch\nfrom mmplugin_l2.analysis.measure import PeakMemory, rss_bytes\n'
            'z = torch.ones(128 * 2**20); del z\n'                   # an earlier peak 512 MB above the start
            'gap = max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_bytes())\n'
            'size = gap + 256 * 2**20\n'
            'with PeakMemory("cpu") as a:\n x = torch.ones(size // 4); del x\n'
            'with PeakMemory("cpu") as b:\n y = torch.ones(2**20); del y\nprint(a.mb, b.mb, size / 2**20)')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    first, second, expected = r.stdout.split()
    assert float(expected) > 700, r.stdout    # the earlier peak's gap counts: measured above the start, not it
    assert first != 'None' and abs(float(first) - float(expected)) < 40 and second == 'None', r.stdout + r.stderr


def test_steady_peak_memory_is_measured_below_an_earlier_peak():
    """`PeakMemory(reset=True)` (what `train_steps(..., steady_memory=True)` uses after its warm-up) resets the
    resident set's high-water mark: after an earlier 512 MB peak, a 64 MB allocation is measured as its size, where
    the plain `PeakMemory` cannot measure it (None)."""
    code = ('import torch\nfrom mmplugin_l2.analysis.measure import PeakMemory\n'
            'z = torch.ones(128 * 2**20); del z\n'
            'with PeakMemory("cpu", reset=True) as a:\n x = torch.ones(16 * 2**20); del x\n'
            'with PeakMemory("cpu") as b:\n y = torch.ones(16 * 2**20); del y\nprint(a.mb, b.mb)')
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    steady, plain = r.stdout.split()
    assert plain == 'None' and abs(float(steady) - 64) < 16, r.stdout + r.stderr


def test_precision_settings_and_their_restore():
    import torch
    from mmplugin_l2.analysis.measure import precision
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with precision('bf16', 'cpu'):
        assert lin(x).dtype == torch.bfloat16 and not torch.backends.cudnn.allow_tf32
    with precision('tf32', 'cpu'):
        assert lin(x).dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == saved
    with pytest.raises(ValueError, match='allowed: fp32, tf32, bf16, fp16'):
        with precision('fp8', 'cpu'):
            pass


def test_training_step_and_gradients_with_and_without_a_grad_scaler():
    """`train_steps` times `iters` full steps (the optimizer does move the weights); `gradients` under a
    GradScaler returns the unscaled gradients, equal to those without it."""
    import torch
    from mmplugin_l2.analysis import measure
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.GELU())
    x = torch.randn(2, 3, 8, 8)
    before = model[0].weight.detach().clone()
    steps, mem = measure.train_steps(model, x, warmup=1, iters=2, memory=False)
    assert len(steps) == 2 and mem is None and not torch.equal(before, model[0].weight)
    assert all(abs(s['total_ms'] - s['forward_ms'] - s['backward_ms'] - s['optimizer_ms']) < 1e-6 for s in steps)
    loss, plain = measure.gradients(model, x)
    loss_s, scaled = measure.gradients(model, x, scaler=torch.amp.GradScaler('cpu', init_scale=1024.))
    assert torch.equal(loss, loss_s) and set(plain) == {'0.weight', '0.bias'}
    for k in plain:
        assert torch.allclose(scaled[k], plain[k], rtol=1e-6, atol=0), k
    assert loss.item() == pytest.approx(sum(o.pow(2).mean() for o in [model(x)]).item())


def test_fresh_process_runner_keeps_results_printed_before_a_failure():
    """`run_fresh` keeps what a process printed (`emit`) before it failed or ran past its time limit. The hanging
    process prints its result line in emit's format (RESULT + JSON) without importing torch, so that it prints at
    once even on a loaded machine (a parallel test run) and a short limit ends it; it runs beside the other two."""
    from concurrent.futures import ThreadPoolExecutor

    from mmplugin_l2.analysis.measure import RESULT, failure_line, run_fresh
    code = ('from mmplugin_l2.analysis.measure import emit\nimport sys\nemit({"a": 1})\n'
            'if sys.argv[1] == "raise": raise KeyError("boom")\nemit({"b": 2})')
    hang_code = f'import json, time\nprint({RESULT!r} + json.dumps({{"a": 1}}), flush=True)\ntime.sleep(300)'
    with ThreadPoolExecutor(1) as pool:
        hang = pool.submit(run_fresh, ['-c', hang_code], timeout=5)
        assert run_fresh(['-c', code, 'ok']) == ([{'a': 1}, {'b': 2}], None)
        res, fail = run_fresh(['-c', code, 'raise'])
        assert res == [{'a': 1}] and fail.startswith('exit status 1\n') and 'Traceback' in fail
        assert failure_line(fail) == "KeyError: 'boom'"
        res, fail = hang.result()
    assert res == [{'a': 1}] and failure_line(fail) == 'timed out after 5 s'


# ---- roofline (tools/analysis/roofline.py) ------------------------------------------------------------

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


def test_peak_matmul_sizes_its_product_to_the_machine(monkeypatch):
    """The peak's product grows from 256 while a product of the doubled size would take at most `call_s`: to 2048
    where products are fast, only to 512 where a 256 product takes 20 ms (bf16 on a CPU without bf16 units); the
    rate is that of the last size."""
    from mmplugin_l2.analysis import roofline as rl
    for per_256_s, want in ((1e-4, 2048), (0.02, 512), (1.0, 256)):
        sizes = []

        def fake(fn, device, warmup, iters, per_256_s=per_256_s):
            m = fn().shape[0]       # the product really runs: its size is the one timed
            sizes.append(m)
            return [1e3 * per_256_s * (m / 256) ** 3] * iters
        monkeypatch.setattr(rl, 'time_calls', fake)
        rate = rl.peak_matmul(n=2048, iters=2, prec='fp32')
        assert max(sizes) == sizes[-1] == want, (per_256_s, sizes)
        assert rate == pytest.approx(256 ** 3 / per_256_s)
    sizes.clear()
    rl.peak_matmul(n=300, iters=1)      # never above n
    assert max(sizes) == 256


def test_half_precision_without_units_warns_once_and_the_benchmark_records_the_cpu(monkeypatch):
    """A half precision on a CPU without units for it (oneDNN has no kernels: torch's scalar fallback) warns the first
    time a process enters it; the benchmark's environment records the CPU's instruction set and units, and its
    rendered head line names them."""
    import warnings

    import torch
    from mmplugin_l2.analysis import benchmark as bm
    from mmplugin_l2.analysis import measure
    monkeypatch.setattr(measure, '_CHECKED', set())
    monkeypatch.setattr(torch.ops.mkldnn, '_is_mkldnn_bf16_supported', lambda: False)
    assert measure.half_units('fp32', 'cpu') and not measure.half_units('bf16', 'cpu')
    with pytest.warns(UserWarning, match='no bf16 units'):
        with measure.precision('bf16', 'cpu'):
            pass
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with measure.precision('bf16', 'cpu'):
            pass
        with measure.precision('fp32', 'cpu'):
            pass
    env = bm.environment('cpu')
    assert env['cpu_isa'] == torch.backends.cpu.get_cpu_capability() and 'bf16' not in env['cpu_half_units']
    md = bm.render(dict(format=bm.FORMAT, env=dict(env, cpu='Some CPU'), config={}, samples=[]))
    assert f'(Some CPU, {env["cpu_isa"]}, half-precision units: ' in md
    assert 'half-precision units: none' in bm.render(
        dict(format=bm.FORMAT, env=dict(env, cpu='X', cpu_half_units=[]), config={}, samples=[]))


def test_roofline_times_a_layer_run_inside_another_once():
    """With pieces forced, L2ViT's pre-norms run inside the attention / MLP pieces (passed as `norm=`):
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


def test_roofline_bf16_peak_and_a_model_under_autocast(tmp_path):
    """The bf16 matmul peak beside the fp32 one; `--precision bf16` runs the model under bf16 autocast (its
    layers' outputs in bf16) and reports its share of the bf16 peak. The tool's training step on ResT-S: H-ViT3's
    would compile its TTT cores under bf16 (tests/ops/test_ttt_compiled.py's subject), a minute of this test."""
    import torch
    from conftest import TINY_HVIT3
    from mmplugin_l2.analysis import roofline as rl
    from mmplugin_l2.models.backbones import HViT3
    assert rl.peak_matmul(n=256, iters=2, prec='bf16') > 1e6
    with pytest.raises(ValueError, match='allowed: fp32, tf32, bf16, fp16'):
        rl.peak_matmul(n=8, prec='int8')
    model, x = HViT3(arch=TINY_HVIT3), torch.randn(1, 3, 64, 64)
    fp32, bf16 = rl.profile_layers(model, x), rl.profile_layers(model, x, 'bf16')
    assert bf16['macs'] == fp32['macs'] and bf16['seconds'] > 0
    assert sum(s['bytes'] for s in bf16['layers'].values()) < sum(s['bytes'] for s in fp32['layers'].values())
    cli = analysis_tool('roofline')
    summary = cli.main(['--models', 'rest_s', '--size', '64', '--tiny', '--precision', 'bf16', '--train',
                        '--device', 'cpu', '--out-dir', str(tmp_path)])
    assert summary['precision'] == 'bf16' and set(summary['peaks_gmacs']) == {'fp32', 'bf16'}
    assert summary['peak_gmacs'] == summary['peaks_gmacs']['bf16'] and 'bf16 autocast' in summary['title']
    assert summary['models']['rest_s']['train_gmacs'] > 0 and (tmp_path / 'roofline.png').is_file()
    assert summary['cpu_isa'] == torch.backends.cpu.get_cpu_capability()


def test_run_records_uncommitted_changes_beside_the_commit(tmp_path):
    """The commit a run records says when the package's tracked files differ from it: the code measured is then
    not that commit's. Untracked files do not count; outside a checkout: None."""
    import subprocess
    from mmplugin_l2.analysis import benchmark as bm

    def git(*args):
        return subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@t', *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()
    git('init', '-q')
    (tmp_path / 'a.py').write_text('x = 1\n')
    git('add', 'a.py')
    git('commit', '-qm', 'a')
    head = git('rev-parse', '--short', 'HEAD')
    assert bm.package_commit(tmp_path) == head
    (tmp_path / 'b.py').write_text('untracked\n')
    assert bm.package_commit(tmp_path) == head
    (tmp_path / 'a.py').write_text('x = 2\n')
    assert bm.package_commit(tmp_path) == head + '+uncommitted'
    subprocess.run(['git', 'init', '-q', '--bare', str(tmp_path / 'bare')], check=True)
    assert bm.package_commit(tmp_path / 'bare') is None


def test_merge_pools_runs_and_render_names_each(tmp_path):
    from mmplugin_l2.analysis import benchmark as bm
    a = dict(format=bm.FORMAT, env=dict(device='cpu', commit='aaa'), config=dict(rounds=1),
             samples=[_sample('vit3_t', 'infer', (224, 224), 0, 10., 1.), _sample('deit_t', 'infer', (224, 224), 0, 20.,
                                                                               1.)])
    b = dict(format=bm.FORMAT, env=dict(device='cpu', commit='bbb'), config=dict(rounds=1), smoke=True, note='n',
             samples=[_sample('vit3_t', 'infer', (224, 224), 0, 30., 1.), _sample('vit3_t', 'train', (512, 512), 0, 5.,
                                                                               2.)])
    m = bm.merge([a, b])
    assert [s['run'] for s in m['samples']] == [0, 0, 1, 1] and m['smoke'] and m['note'] == 'n'
    assert [r['env']['commit'] for r in m['runs']] == ['aaa', 'bbb']
    assert bm.merge([m])['samples'] == m['samples']          # merging a merged file keeps its runs
    md = bm.render(m)
    assert 'Run 1: None, commit `aaa`' in md and 'Run 2: None, commit `bbb`' in md
    assert '| ViT3-T | 1 | 20 (10–30) | – |' in md          # the two runs' samples pooled
    assert bm.plot_title(m).startswith('SMOKE RUN') and 'cpu' in bm.plot_title(m)   # the first run's device
    assert 'cpu' in bm.plot_title(a) and 'None' not in bm.plot_title(dict(a, env=dict(a['env'], cpu='X', torch='2')))
    with pytest.raises(ValueError, match='run 1 is not a results file'):
        bm.merge([a, dict(samples=[])])
    for name, obj in (('a.json', a), ('b.json', b)):
        (tmp_path / name).write_text(json.dumps(obj))
    cli = _cli()
    assert cli.main(['merge', str(tmp_path / 'a.json'), str(tmp_path / 'b.json'),
                     '--out', str(tmp_path / 'm.json')]) == 0
    assert json.loads((tmp_path / 'm.json').read_text()) == m


def test_analysis_imports_form_no_circle():
    """The modules of mmplugin_l2/analysis import each other without a circle, counting imports inside
    functions too (a function-level import must not hide one)."""
    import ast
    import pathlib

    import mmplugin_l2.analysis as pkg
    folder = pathlib.Path(pkg.__file__).parent
    names = {p.stem for p in folder.glob('*.py')}
    graph = {}
    for path in folder.glob('*.py'):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = node.module or ''
                if node.level == 1:
                    deps |= {mod.split('.')[0]} if mod else {a.name for a in node.names}
                elif mod.startswith('mmplugin_l2.analysis.'):
                    deps.add(mod.split('.')[2])
                elif mod == 'mmplugin_l2.analysis':
                    deps |= {a.name for a in node.names}
        graph[path.stem] = deps & names - {path.stem, '__init__'}
    state = {}

    def visit(n, trail):
        if state.get(n) == 'done':
            return
        assert state.get(n) != 'open', f'import circle: {" -> ".join(trail + [n])}'
        state[n] = 'open'
        for m in sorted(graph[n]):
            visit(m, trail + [n])
        state[n] = 'done'
    for n in sorted(graph):
        visit(n, [])


def test_cfg_options_nest_and_reach_the_backbone():
    """`--cfg-options` of the benchmark: dotted keys nest, values are Python literals, and the built backbone
    takes them (a key it does not know fails)."""
    from mmplugin_l2.analysis import benchmark as bm
    from mmplugin_l2.analysis.models import build
    cfg = bm.nested(dict(bm.option_arg(o) for o in ('fast_train=False', 'memory_policy.max_elems=4096')))
    assert cfg == dict(fast_train=False, memory_policy=dict(max_elems=4096))
    m = build('rest_s', cfg, tiny=True)
    # BatchNorm2d's accurate pass and Conv2dCL's depth-wise pass are not the backbone's switch (class attributes)
    assert all(not mod.fast_train for mod in m.modules() if hasattr(mod, 'fast_train') and mod is not m
               and type(mod).__name__ not in ('BatchNorm2d', 'Conv2dCL'))
    assert {mod.memory_policy.max_elems for mod in m.modules() if hasattr(mod, 'memory_policy')} == {4096}
    with pytest.raises(TypeError):
        build('rest_s', dict(no_such_argument=1), tiny=True)


# ---- per-op profile (tools/analysis/profile_ops.py) ---------------------------------------------------------

def test_op_profile_names_each_ops_path_and_the_dtypes_its_products_ran_in():
    """A tiny H-ViT3 training step under bf16 autocast: every op that called `choose` is a row with the Path it
    got, forward and backward time land on the ops, autocast's matrix products show bf16 (fp32 ones where a layer
    picks fp32 itself); in fp32 every product is fp32; `choose` is restored afterwards."""
    import torch
    from mmplugin_l2.analysis import opprofile
    from mmplugin_l2.analysis.models import build
    from mmplugin_l2.models import ops
    from mmplugin_l2.models.layers import mlp
    orig = ops.dispatch.choose
    model, x = build('hvit3_t', tiny=True), torch.randn(1, 3, 64, 64)
    res = opprofile.profile_ops(model, x, 'train', 'bf16', warmup=0)
    assert ops.choose is orig and mlp.choose is orig
    rows = {r['op']: r for r in res['rows']}
    dispatched = [r for r in res['rows'] if r['paths']]
    assert dispatched and all(r['calls'] > 0 for r in dispatched)
    paths = {p.split(': ', 1)[1].split(' ×')[0] for r in dispatched for p in r['paths']}
    assert paths & {'train', 'checkpoint', 'reference'}, paths
    assert any('·' in k for k in rows) and ('other' not in rows or res['rows'][-1]['op'] == 'other')
    assert sum(r['backward_ms'] for r in res['rows'] if r['op'] != 'other') > 0
    assert res['instrumented']['forward_ms'] > 0 and res['plain']['backward_ms'] > 0
    dtypes = opprofile.product_dtypes(res)
    assert dtypes.get('bf16', 0) > 0, dtypes
    fwd_bf16 = [r for r in res['rows'] if any(k.endswith(' bf16') for k in r['products']['fwd'])]
    bwd_bf16 = [r for r in res['rows'] if any(k.endswith(' bf16') for k in r['products']['bwd'])]
    assert fwd_bf16 and bwd_bf16
    md = opprofile.table(res)
    assert md.count('\n| ') == len(res['rows']) + 1 and '| op | calls | path | forward ms | backward ms |' in md
    fp32 = opprofile.profile_ops(model, x, 'train', 'fp32', warmup=0)
    assert set(opprofile.product_dtypes(fp32)) == {'fp32'}
    infer = opprofile.profile_ops(model, x, 'infer', 'bf16', warmup=0, by='module')
    assert all(r['backward_ms'] == 0 and not r['products']['bwd'] for r in infer['rows'])
    assert any(': inference' in p or ': reference' in p for r in infer['rows'] for p in r['paths'])
    assert 'backward ms' not in opprofile.table(infer)


def test_op_profile_table_says_compiled_paths_ran_eagerly():
    """Under the profile's TorchDispatchMode torch.compile'd code runs op by op (checked here on a compiled
    function: the mode sees its aten operators), so the table says under it which rows took a compiled path and
    that they time the eager code; without such a row it says nothing."""
    import torch
    from mmplugin_l2.analysis import opprofile
    from ops.harness import RecordOps

    seen = []
    fn = torch.compile(lambda t: (t.sin() * 2).cos(), backend='aot_eager')
    x = torch.randn(4)
    fn(x)
    with RecordOps(lambda func, *rest: seen.append(func.overloadpacket.__name__)):
        fn(x)
    assert seen == ['sin', 'mul', 'cos'], seen
    row = dict(op='stage 1 / TTTAttention · TTT', calls=1, forward_ms=1., backward_ms=1., products={'fwd': {}},
               paths={'TTT: compiled': 1, 'TTT: compiled in backward': 1}, kept_bytes=0)
    res = dict(kind='train', precision='bf16', plain=dict(forward_ms=1., backward_ms=1.),
               instrumented=dict(forward_ms=1., backward_ms=1.), rows=[row], kept_bytes=0)
    md = opprofile.table(res)
    assert md.strip().splitlines()[-1].startswith('Compiled paths ran eagerly here') and \
        'the rows of stage 1 / TTTAttention · TTT time the eager code' in md
    row['paths'] = {'TTT: checkpoint': 1}
    assert 'Compiled paths' not in opprofile.table(res)


def test_op_profile_bounds_count_what_a_step_must_move_at_least():
    """`bounds=True` on a model of one Linear(8, 16) over (1, 3, 4, 8) inputs: its least bytes are counted by hand
    (training: 3 x inputs + 2 x outputs + 3 x parameters, bf16 outputs under bf16 autocast; inference: each once),
    its multiply-adds are 3 x 1*3*4*8*16 in training, and its bound is the longer of bytes at the measured copy
    bandwidth and multiply-adds at the measured matmul peak; the table shows the columns."""
    import torch
    import torch.nn as nn
    from mmplugin_l2.analysis import opprofile
    model, x = nn.Sequential(nn.Linear(8, 16)), torch.randn(1, 3, 4, 8)
    inp, params, macs = 96 * 4, (8 * 16 + 16) * 4, 1 * 3 * 4 * 8 * 16
    for prec, kind, out, want_bytes, want_macs in (
            ('fp32', 'train', 192 * 4, 3 * inp + 2 * 192 * 4 + 3 * params, 3 * macs),
            ('bf16', 'train', 192 * 2, 3 * inp + 2 * 192 * 2 + 3 * params, 3 * macs),
            ('fp32', 'infer', 192 * 4, inp + 192 * 4 + params, macs)):
        res = opprofile.profile_ops(model, x, kind, prec, warmup=0, by='module', bounds=True)
        row = next(r for r in res['rows'] if r['modules'] == ['0'])
        assert (row['bytes'], row['macs']) == (want_bytes, want_macs), (prec, kind, row)
        bw, peak = res['bandwidth_gbs'] * 1e9, res['peak_gmacs'] * 1e9
        assert bw > 1e8 and peak > 1e8
        assert row['bound_ms'] == pytest.approx(max(want_bytes / bw, want_macs / peak) * 1e3)
        md = opprofile.table(res)
        assert '| least MB | bound ms | × bound |' in md and 'GB/s copy bandwidth' in md.splitlines()[0]
        assert res['cpu_isa'] == torch.backends.cpu.get_cpu_capability() and f'this machine, {res["cpu_isa"]})' in md
    assert 'least MB' not in opprofile.table(opprofile.profile_ops(model, x, 'train', 'fp32', warmup=0))
    # a block that chooses its MLP branch's path (L2ViT's NORM_MLP) holds the branch's Mlp, a row of its own: no bound
    # (inside `with_cp` blocks the branch on half tokens runs the Mlp module's reference)
    from mmplugin_l2.analysis.models import build
    res = opprofile.profile_ops(build('l2vit_t', dict(with_cp=True), tiny=True), torch.randn(1, 3, 64, 64), 'train',
                                'bf16', warmup=0, bounds=True)
    rows = {r['op']: r for r in res['rows']}
    assert [k for k in rows if 'NORM_MLP' in k] and all(rows[k]['bound_ms'] is None for k in rows if 'NORM_MLP' in k)
    mlps = [k for k in rows if k.endswith('· MLP')]
    assert mlps and all(rows[k]['bound_ms'] > 0 for k in mlps)


def test_op_profile_counts_what_the_step_keeps_for_backward():
    """`kept_bytes` by hand on a Linear(8, 16) followed by a recomputed Linear(16, 16) -> GELU -> Linear(16, 4),
    fp32 inputs (1, 3, 4, 8): the first keeps its input (384 B); the recomputed layer keeps its own input (768 B)
    and, recomputed selectively (`keep_products`), its two products' outputs (768 B and 192 B) but not what it
    recomputes (the GELU's input and output); recomputed whole, only its input. The loss (`measure.output_loss`, the
    sum of the output means) keeps nothing. Parameters are not counted; the table shows the column and the total."""
    import torch
    import torch.nn as nn
    from mmplugin_l2.analysis import opprofile
    from mmplugin_l2.models.ops import checkpoint

    class Recomputed(nn.Sequential):
        keep_products = True

        def forward(self, x):
            return checkpoint.checkpointed(super().forward, x, keep_products=self.keep_products)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = Recomputed(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))

        def forward(self, x):
            return (self.b(self.a(x)),)

    model, x = Model(), torch.randn(1, 3, 4, 8)
    assert checkpoint._KEPT_THROUGH_HOOKS  # the pinned torch passes the kept products through the hooks
    for keep, want in ((True, {'a': 384, 'b': 768 + 768 + 192, 'other': 0}),
                       (False, {'a': 384, 'b': 768, 'other': 0})):
        model.b.keep_products = keep
        res = opprofile.profile_ops(model, x, 'train', 'fp32', warmup=0, by='module')
        kept = {r['modules'][0] if r['modules'] else r['op']: r['kept_bytes'] for r in res['rows']}
        assert kept == want and res['kept_bytes'] == sum(want.values()), (keep, kept)
        md = opprofile.table(res)
        assert '| share | kept MB |' in md and f'kept for backward {sum(want.values()) / 2**20:.1f} MB' in md
    assert 'kept' not in opprofile.table(opprofile.profile_ops(model, x, 'infer', 'fp32', warmup=0))


def test_profile_ops_tool_prints_the_table(tmp_path, capsys, monkeypatch):
    """The tool from a process under glibc's default allocator, asked for the caching one: the profile runs in a
    fresh process under it, and its head line and JSON say so; which allocator a process runs under is read from
    its environment."""
    out = tmp_path / 'p.json'
    env = {k: v for k, v in os.environ.items() if not k.startswith('MALLOC_')}
    r = subprocess.run([sys.executable, f'{ROOT}/tools/analysis/profile_ops.py', '--model', 'rest_s', '--tiny',
                        '--size', '64', '--precision', 'bf16', '--kind', 'train', '--warmup', '0', '--allocator',
                        'caching', '--out', str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 'rest_s (tiny) 64x64, batch 1, train, bf16 autocast, caching allocator' in r.stdout, r.stdout[:500]
    assert '| op | calls | path |' in r.stdout
    res = json.loads(out.read_text())
    assert res['precision'] == 'bf16' and res['rows'] and res['model'] == 'rest_s' and res['allocator'] == 'caching'
    cli = analysis_tool('profile_ops')
    with pytest.raises(SystemExit) as e:  # its argument check, in this process
        cli.parse_args(['--precision', 'fp8'])
    assert e.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
    from mmplugin_l2.analysis.benchmark import running_allocator, runs_under
    from mmplugin_l2.analysis.measure import allocator_env
    for name in ('caching', 'live', 'glibc'):
        for k in [k for k in os.environ if k.startswith('MALLOC_')]:
            monkeypatch.delenv(k)
        for k, v in allocator_env(name).items():
            if k.startswith('MALLOC_'):
                monkeypatch.setenv(k, v)
        assert running_allocator() == name
    monkeypatch.setenv('MALLOC_ARENA_MAX', '2')
    assert running_allocator() == 'other'
    # a preload on top of glibc's tunables: that allocator is the one asked for (the tool does not run it again)
    monkeypatch.setenv('LD_PRELOAD', '/usr/lib/libjemalloc.so.2')
    assert runs_under('jemalloc') and not runs_under('glibc')


def test_compile_check_times_compiled_and_eager_training_steps():
    """`compile_check.py --train`'s measurement (`check_train`): the first compiled step, then the steady-state
    steps of the compiled model and of an eager copy, each with the peak of its timed steps (measurable after the
    larger warm-up and compile: `steady_memory`); the compiled steps train the model itself."""
    import torch
    cli = analysis_tool('compile_check')
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GELU(), torch.nn.Conv2d(8, 4, 1))
    before = model[0].weight.detach().clone()
    r = cli.check_train(model, (16, 16), batch=2, iters=2, backend='aot_eager')
    assert r['size'] == (16, 16) and r['first_step_s'] > 0 and r['compiled_ms'] > 0 and r['eager_ms'] > 0, r
    assert r['compiled_mb'] is not None and r['eager_mb'] is not None, r
    assert not torch.equal(before, model[0].weight)
