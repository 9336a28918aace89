"""Export mode (mmplugin_l2/models/ops/export.py, docs/deployment.md): while exporting every layer takes
its plain formulation (whole maps, out-of-place ops, real-valued RoPE, branch-free padding). It computes
the same function as the eager inference fast paths (checked here with those paths forced on by tiny
chunk / band sizes, odd sizes so that padding and partial chunks occur), and it leaves PyTorch: torch.export
and the ONNX exporter trace it, and ONNX Runtime reproduces the outputs: fixed-size graphs (dynamo exporter) and
one graph for every batch size, height and width (`export_onnx`, TorchScript exporter) run at sizes other than
the export size."""
import numpy as np
import pytest
import torch

from conftest import TINY_HVIT3, TINY_L2VIT, TINY_REST, TINY_VIT3
from mmplugin_l2 import HViT3, L2ViT, ResT, ViT3
from mmplugin_l2.analysis import authors
from mmplugin_l2.models.layers import set_memory_policy
from mmplugin_l2.models.ops.export import export_mode, export_onnx, exporting

BUILD = {
    'hvit3': lambda: HViT3(arch=TINY_HVIT3, drop_path_rate=0.),
    'vit3': lambda: ViT3(arch=TINY_VIT3, drop_path_rate=0.),
    'l2vit': lambda: L2ViT(arch=TINY_L2VIT, drop_path_rate=0.),
    'l2vit_masked': lambda: L2ViT(arch=TINY_L2VIT, drop_path_rate=0., mask_window_padding=True),
    'rest': lambda: ResT(arch=TINY_REST, drop_path_rate=0.),
}


def model(name):
    torch.manual_seed(0)
    return authors.randomize_(BUILD[name](), seed=1).eval()


def force_fast_paths(m):
    """Tiny chunk / band budgets: every eager inference fast path (token chunks, row bands, window-row bands,
    chunked MLPs) is taken, with partial last pieces."""
    set_memory_policy(m, dict(max_elems=61))
    return m


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_export_mode_switch():
    assert not exporting()
    with torch.no_grad():
        with export_mode():
            assert exporting()
            with export_mode():
                assert exporting()
            assert exporting()
    assert not exporting()


@pytest.mark.parametrize('name', sorted(BUILD))
def test_export_mode_equals_eager_fast_paths(name):
    m = force_fast_paths(model(name))
    x = torch.randn(2, 3, 75, 97)
    with torch.no_grad():
        eager = m(x)
        with export_mode():
            plain = m(x)
    assert len(eager) == len(plain)
    for a, b in zip(plain, eager):
        assert a.shape == b.shape and rel(a, b) < 1e-5


@pytest.mark.parametrize('name', ['hvit3', 'vit3', 'l2vit', 'rest'])
def test_onnx_export_and_onnxruntime(name, tmp_path):
    """Static-shape export (dynamo exporter) at an odd size; ONNX Runtime against eager PyTorch. Before
    export mode H-ViT3 could not be exported (complex RoPE) and ResT's ONNX outputs were 2-10 % off."""
    import onnxruntime as ort
    m = model(name)
    x = torch.randn(1, 3, 70, 90)
    path = str(tmp_path / f'{name}.onnx')
    with torch.no_grad():
        ref = m(x)
        with export_mode():
            ep = torch.export.export(m, (x,), strict=False)
        torch.onnx.export(ep, (x,), path, dynamo=True, verbose=False)
    sess = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    outs = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    assert len(outs) == len(ref)
    for o, r in zip(outs, ref):
        r = r.numpy()
        assert o.shape == r.shape and np.abs(o - r).max() / np.abs(r).max() < 1e-5


@pytest.mark.parametrize('name', sorted(BUILD))
def test_dynamic_onnx_export_at_other_sizes(name, tmp_path):
    """One graph exported at 64x64, run by ONNX Runtime at two other sizes (odd, another batch size): the graph
    has symbolic batch / height / width, and nothing of the export size is baked in (a Python float of the
    token count, a loop over the batch or an `unflatten` read back in the TTT layers was, 1e-4 to 0.7 off)."""
    import onnx
    import onnxruntime as ort
    m = model(name)
    path = str(tmp_path / f'{name}.onnx')
    export_onnx(m, torch.randn(1, 3, 64, 64), path)
    dims = [d.dim_param or d.dim_value for d in onnx.load(path).graph.input[0].type.tensor_type.shape.dim]
    assert dims == ['batch', 3, 'height', 'width']
    sess = ort.InferenceSession(path, providers=['CPUExecutionProvider'])
    for shape in [(2, 3, 75, 97), (1, 3, 33, 129)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            ref = m(x)
        outs = sess.run(None, {'input': x.numpy()})
        assert len(outs) == len(ref)
        for o, r in zip(outs, ref):
            r = r.numpy()
            assert o.shape == r.shape and np.abs(o - r).max() / np.abs(r).max() < 1e-5, (shape, o.shape)


def test_onnx_expm1_symbolic_is_accurate(tmp_path):
    """ONNX has no Expm1 (ResT's EMSA uses it): `export_onnx` writes tanh(x/2) (exp(x) + 1), accurate where
    exp(x) - 1 cancels (at x = 1e-7 that is 19 % off in fp32)."""
    import onnxruntime as ort

    class Expm1(torch.nn.Module):
        def forward(self, x):
            return torch.expm1(x)

    x = torch.tensor([-30., -1., -1e-3, -1e-7, 0., 1e-7, 1e-4, 0.5, 20.]).reshape(1, 1, 1, -1)
    path = str(tmp_path / 'expm1.onnx')
    export_onnx(Expm1(), x, path)
    got = ort.InferenceSession(path, providers=['CPUExecutionProvider']).run(None, {'input': x.numpy()})[0]
    ref = torch.expm1(x.double()).numpy()
    assert np.all(np.abs(got - ref) <= 1e-6 * np.abs(ref))
