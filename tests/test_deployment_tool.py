"""tools/deployment/pytorch2onnx.py on real configs (narrowed through a small inheriting config): an mmpretrain
classifier (logits), an mmseg UperNet segmentor (encode_decode) and a bare backbone, each exported and verified
in ONNX Runtime; a checkpoint that does not fit and --dynamic are refused."""
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


def test_classifier_logits(tmp_path, capsys):
    cfg = small_config(tmp_path, 'configs/demo/hvit3_t_in1k_demo.py',
                       f"model = dict(backbone=dict(arch=dict(_delete_=True, **{TINY_HVIT3!r})), head=dict(in_channels=64))")
    onnx_file = tmp_path / 'cls.onnx'
    out = run(capsys, cfg, '--out', onnx_file, '--shape', 45, 61, '--verify')
    assert 'classifier of ImageClassifier' in out and worst(out) < 1e-5
    graph = onnx.load(str(onnx_file)).graph
    assert [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim] == [1, 5]  # 5 demo classes


def test_segmentor_encode_decode(tmp_path, capsys):
    cfg = small_config(tmp_path, 'configs/mmseg/upernet_rest_s_512x512_160k_ade20k.py',
                       f"model = dict(backbone=dict(arch=dict(_delete_=True, **{TINY_REST!r}), init_cfg=None), "
                       f"decode_head=dict(in_channels=[16, 32, 48, 64], channels=32), "
                       f"auxiliary_head=dict(in_channels=48, channels=16))")
    onnx_file = tmp_path / 'seg.onnx'
    out = run(capsys, cfg, '--out', onnx_file, '--shape', 64, 96, '--verify')
    assert 'segmentor of EncoderDecoder' in out and worst(out) < 1e-5
    graph = onnx.load(str(onnx_file)).graph
    assert [d.dim_value for d in graph.output[0].type.tensor_type.shape.dim] == [1, 150, 64, 96]


def test_backbone_only_and_bad_checkpoint(tmp_path, capsys):
    cfg = small_config(tmp_path, 'configs/mmpretrain/l2vit_t_in1k.py',
                       f"model = dict(backbone=dict(arch=dict(_delete_=True, **{TINY_L2VIT!r}), out_indices=(0, 1, 2, 3)), "
                       f"head=dict(in_channels=64))")
    out = run(capsys, cfg, '--out', tmp_path / 'bb.onnx', '--shape', 50, 70, '--backbone-only', '--verify')
    assert 'backbone of ImageClassifier' in out and worst(out) < 1e-5
    assert len(onnx.load(str(tmp_path / 'bb.onnx')).graph.output) == 4
    wrong = tmp_path / 'wrong.pth'
    torch.save({'state_dict': {'backbone.foo': torch.zeros(3)}}, wrong)
    with pytest.raises(Exception, match='does not fit'):
        run(capsys, cfg, wrong, '--out', tmp_path / 'x.onnx')
    with pytest.raises(SystemExit, match='--dynamic is not supported yet'):
        run(capsys, cfg, '--out', tmp_path / 'x.onnx', '--dynamic')
