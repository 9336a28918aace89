"""tools/deployment/pytorch2onnx.py on real configs (narrowed through a small inheriting config): an mmpretrain
classifier (logits) and an mmseg UperNet segmentor (encode_decode) with --dynamic (one graph, verified in ONNX
Runtime at the export size and three other, odd sizes), a bare backbone at a fixed size; a checkpoint that does not
fit is refused, a graph with the export size baked in is reported as such."""
import os.path as osp
import sys

import onnx
import pytest
import torch

from conftest import ROOT, TINY_HVIT3, TINY_L2VIT, TINY_REST

sys.path.insert(0, osp.join(ROOT, 'tools', 'deployment'))
import pytorch2onnx  # noqa: E402


def small_config(tmp_path, base, text):
    path = tmp_path / 'cfg.py'
    path.write_text(f"_base_ = {osp.join(ROOT, base)!r}\n{text}\n")
    return str(path)


def run(capsys, *argv):
    pytorch2onnx.main([str(a) for a in argv])
    return capsys.readouterr().out


def worst(out):
    line = [ln for ln in out.splitlines() if ln.startswith('verify: worst relative difference')][-1]
    return float(line.split()[4])


def dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


def verified_sizes(out):
    return list(dict.fromkeys(ln.split()[1] for ln in out.splitlines() if ln.startswith('  input ')))


def test_classifier_logits(tmp_path, capsys):
    cfg = small_config(tmp_path, 'configs/demo/hvit3_t_in1k_demo.py',
                       f"model = dict(backbone=dict(arch=dict(_delete_=True, **{TINY_HVIT3!r})), head=dict(in_channels=64))")
    onnx_file = tmp_path / 'cls.onnx'
    out = run(capsys, cfg, '--out', onnx_file, '--shape', 45, 61, '--dynamic', '--verify')
    assert 'classifier of ImageClassifier' in out and worst(out) < 1e-5
    assert verified_sizes(out) == ['1x3x45x61', '2x3x63x71', '1x3x33x93', '1x3x91x47']
    graph = onnx.load(str(onnx_file)).graph
    assert dims(graph.input[0]) == ['batch', 3, 'height', 'width']
    assert dims(graph.output[0]) == ['batch', 5]  # 5 demo classes


def test_segmentor_encode_decode(tmp_path, capsys):
    cfg = small_config(tmp_path, 'configs/mmseg/upernet_rest_s_512x512_160k_ade20k.py',
                       f"model = dict(backbone=dict(arch=dict(_delete_=True, **{TINY_REST!r}), init_cfg=None), "
                       f"decode_head=dict(in_channels=[16, 32, 48, 64], channels=32), "
                       f"auxiliary_head=dict(in_channels=48, channels=16))")
    onnx_file = tmp_path / 'seg.onnx'
    out = run(capsys, cfg, '--out', onnx_file, '--shape', 64, 96, '--dynamic', '--verify')
    assert 'segmentor of EncoderDecoder' in out and worst(out) < 1e-5
    assert len(verified_sizes(out)) == 4   # logits at each input size (the shapes are checked by --verify)
    graph = onnx.load(str(onnx_file)).graph
    batch, _, h, w = dims(graph.output[0])   # (B, 150, H, W): ONNX Runtime's shapes are checked by --verify
    assert batch == 'batch' and isinstance(h, str) and isinstance(w, str)


def test_backbone_only_and_bad_checkpoint(tmp_path, capsys):
    cfg = small_config(tmp_path, 'configs/mmpretrain/l2vit_t_in1k.py',
                       f"model = dict(backbone=dict(arch=dict(_delete_=True, **{TINY_L2VIT!r}), out_indices=(0, 1, 2, 3)), "
                       f"head=dict(in_channels=64))")
    bb = tmp_path / 'not' / 'yet' / 'bb.onnx'   # --out in folders that do not exist: created before the export
    out = run(capsys, cfg, '--out', bb, '--shape', 50, 70, '--backbone-only', '--verify')
    assert 'backbone of ImageClassifier' in out and worst(out) < 1e-5
    assert len(onnx.load(str(bb)).graph.output) == 4
    wrong = tmp_path / 'wrong.pth'
    torch.save({'state_dict': {'backbone.foo': torch.zeros(3)}}, wrong)
    with pytest.raises(Exception, match='does not fit'):
        run(capsys, cfg, wrong, '--out', tmp_path / 'x.onnx')
    graph = onnx.load(str(bb)).graph
    assert dims(graph.input[0]) == [1, 3, 50, 70]   # without --dynamic: fixed size


def test_unusable_out_is_refused_before_the_work(tmp_path, capsys):
    """An --out under a file, or naming a folder, stops with one line before the config is read (the config
    given does not exist, so any later failure would name it instead)."""
    (tmp_path / 'afile').write_text('')
    missing_cfg = tmp_path / 'no_such_config.py'
    with pytest.raises(SystemExit, match=r'^error: --out .*afile.*cannot create its folder'):
        run(capsys, missing_cfg, '--out', tmp_path / 'afile' / 'm.onnx')
    with pytest.raises(SystemExit, match=r'^error: --out .* is a folder'):
        run(capsys, missing_cfg, '--out', tmp_path)


class _BakesWidth(torch.nn.Module):
    def forward(self, x):
        return x.reshape(x.shape[0], -1, int(x.shape[3]))   # int(): the export width becomes a constant


def test_baked_size_is_reported(tmp_path):
    path = str(tmp_path / 'baked.onnx')
    pytorch2onnx.export(_BakesWidth(), torch.randn(1, 3, 8, 8), path, dynamic=True)
    assert pytorch2onnx.verify(_BakesWidth(), path, [(1, 8, 8)])[0][3] == 0
    with pytest.raises(SystemExit, match='has a size of the export input baked in'):
        pytorch2onnx.verify(_BakesWidth(), path, pytorch2onnx.verify_sizes((8, 8), 1, True))


@pytest.mark.parametrize('bins', [2, 3, 6, (2, 5)])
def test_dynamic_adaptive_pooling(bins):
    """The export-time stand-in for nn.AdaptiveAvgPool2d (mmseg's PPM) equals it, also for sizes that the bins
    do not divide (overlapping bins)."""
    pool = pytorch2onnx.AdaptiveAvgPool2dExport(bins)
    for shape in [(2, 4, 13, 7), (1, 3, 6, 6), (1, 2, 31, 17)]:
        x = torch.randn(*shape, dtype=torch.float64)
        torch.testing.assert_close(pool(x), torch.nn.functional.adaptive_avg_pool2d(x, bins))
