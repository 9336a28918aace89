"""tools/analysis: the FLOPs counter against hand-computed values."""
import json
import subprocess
import sys

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
