"""Export the model a config describes to ONNX, optionally verified in ONNX Runtime.

    python tools/deployment/pytorch2onnx.py CONFIG [CHECKPOINT] --out model.onnx [--shape H W] [--batch B]
        [--dynamic] [--backbone-only] [--verify] [--cfg-options k=v ...]

What is exported (input: the image batch after the config's data preprocessor, i.e. normalised, NCHW float32):
* an mmpretrain classifier: backbone + neck + head, the logits (B, num_classes);
* an mmseg segmentor: `encode_decode`, the segmentation logits at the input size (B, classes, H, W);
* an mmdet detector: backbone + neck, the FPN maps (its RPN / RoI heads stay in PyTorch; see docs/deployment.md);
* `--backbone-only`: the backbone's pyramid maps.
The model runs in export mode (mmplugin_l2/models/ops/export.py): every layer's plain formulation, the same
function as eager inference. `--dynamic`: one graph for every batch size, height and width (the TorchScript-based
exporter, `export_onnx`); without it the graph is fixed to --batch x --shape (the dynamo exporter).
`--verify` runs ONNX Runtime on fresh random inputs (the export size; with --dynamic also three other sizes, odd
ones, one of batch 2) and prints the max abs / relative difference to PyTorch per output; it exits 1 if any
relative difference exceeds 1e-4.
"""
import argparse
import copy
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn as nn
from mmengine.config import Config, DictAction


class _Outputs(nn.Module):
    """The exported part of a model as a module whose forward takes only the image batch."""

    def __init__(self, model, kind):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x):
        m = self.model
        if self.kind == 'backbone':
            return tuple(m.backbone(x))
        if self.kind == 'classifier':
            return m(x, mode='tensor')
        if self.kind == 'segmentor':
            hw = x.shape[2:]   # symbolic while tracing: the logits follow the input size
            metas = [dict(img_shape=hw, pad_shape=hw, ori_shape=hw)] * x.shape[0]
            return m.encode_decode(x, metas)
        return tuple(m.neck(m.backbone(x)))   # detector: backbone + neck


def _pool_matrix(n, s, x):
    """(s, n) averaging matrix of adaptive average pooling of n positions into s bins: bin i averages
    positions floor(i n / s) .. ceil((i + 1) n / s) - 1, as torch does. `n` may be a traced size."""
    i = torch.arange(s, device=x.device)
    start = torch.div(i * n, s, rounding_mode='floor')
    end = torch.div((i + 1) * n + s - 1, s, rounding_mode='floor')
    pos = torch.arange(n, device=x.device)
    m = ((pos >= start[:, None]) & (pos < end[:, None])).to(x.dtype)
    return m / m.sum(dim=-1, keepdim=True)


class AdaptiveAvgPool2dExport(nn.Module):
    """nn.AdaptiveAvgPool2d as two averaging matmuls whose matrices follow the input size. The ONNX exporter
    writes adaptive pooling only for a known input size (`adaptive_avg_pool2d, input size not accessible` with
    a dynamic one); mmseg's PPM (UperNet) pools into 1, 2, 3, 6 bins."""

    def __init__(self, output_size):
        super().__init__()
        self.output_size = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
        if None in self.output_size:
            raise SystemExit(f'error: --dynamic: AdaptiveAvgPool2d({output_size}) is not supported')

    def forward(self, x):
        (sh, sw), (h, w) = self.output_size, x.shape[-2:]
        return _pool_matrix(h, sh, x) @ x @ _pool_matrix(w, sw, x).transpose(0, 1)


def dynamic_pooling(module):
    """Replace every nn.AdaptiveAvgPool2d with more than one output bin by AdaptiveAvgPool2dExport (in place);
    a global pooling (1 x 1) exports as ONNX GlobalAveragePool and stays. Returns the number replaced."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.AdaptiveAvgPool2d) and child.output_size not in (1, (1, 1)):
                setattr(parent, name, AdaptiveAvgPool2dExport(child.output_size))
                count += 1
    return count


def model_kind(model, backbone_only):
    if backbone_only:
        return 'backbone'
    names = {c.__name__ for c in type(model).__mro__}
    if 'ImageClassifier' in names:
        return 'classifier'
    if 'BaseSegmentor' in names:
        return 'segmentor'
    if 'BaseDetector' in names and getattr(model, 'neck', None) is not None:
        return 'detector'
    raise SystemExit(f'error: cannot export a {type(model).__name__}: pass --backbone-only to export its backbone')


def build_model(cfg, checkpoint):
    import mmplugin_l2  # noqa: F401  (registers the backbones)
    from mmengine.registry import MODELS, init_default_scope

    from mmplugin_l2.apis import check_checkpoint_fits, read_checkpoint
    init_default_scope(cfg.get('default_scope', 'mmengine'))
    if cfg.model.get('backbone', {}).get('init_cfg') is not None:
        cfg.model.backbone.init_cfg = None   # the weights come from CHECKPOINT (or stay random)
    model = MODELS.build(cfg.model)
    if checkpoint:
        ckpt = read_checkpoint(checkpoint)
        check_checkpoint_fits(model, ckpt, checkpoint)
        from mmplugin_l2.checkpoint import model_state_dict
        model.load_state_dict(model_state_dict(ckpt, checkpoint), strict=True)
    return model.eval()


def export(module, x, out, dynamic=False):
    from mmplugin_l2.models.ops.export import export_onnx
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', torch.jit.TracerWarning)   # sizes taken as traced values, on purpose
        export_onnx(module, x, out, dynamic=dynamic)


def _odd(v, avoid):
    v |= 1
    return v + 2 if v == avoid else v


def verify_sizes(shape, batch, dynamic):
    """[(batch, H, W)] that --verify runs: the export size; with --dynamic also three other sizes, all odd (no
    multiple of 32), one of them with another batch size."""
    h, w = shape
    sizes = [(batch, h, w)]
    if dynamic:
        sizes += [(batch + 1, _odd(h + 17, h), _odd(w + 9, w)),
                  (batch, _odd(max(33, h // 2 + 3), h), _odd(w + 31, w)),
                  (batch, _odd(h + 45, h), _odd(max(33, w - 15), w))]
    return sizes


def verify(module, out, sizes, seed=1):
    """[(size, output index, max abs diff, max rel diff)] of ONNX Runtime against PyTorch, one fresh random
    input per (batch, H, W) in `sizes`."""
    import onnxruntime as ort
    sess = ort.InferenceSession(out, providers=['CPUExecutionProvider'])
    rows = []
    for j, size in enumerate(sizes):
        x = torch.randn(size[0], 3, *size[1:], generator=torch.Generator().manual_seed(seed + j))
        with torch.no_grad():
            ref = module(x)
        ref = [ref] if torch.is_tensor(ref) else list(ref)
        try:
            got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
        except Exception as err:  # onnxruntime raises its own exception types
            raise SystemExit(f'error: ONNX Runtime failed on a {size[0]}x3x{size[1]}x{size[2]} input: the graph has '
                             f'a size of the export input baked in (a layer computes with Python numbers from '
                             f'the input size); export with a fixed --shape instead. ONNX Runtime said: '
                             f'{str(err)[:300]}') from None
        if len(got) != len(ref):
            raise SystemExit(f'error: ONNX Runtime returned {len(got)} outputs, PyTorch {len(ref)}')
        for i, (g, r) in enumerate(zip(got, ref)):
            r = r.numpy()
            if g.shape != r.shape:
                raise SystemExit(f'error: output {i} at input {size}: ONNX shape {g.shape} != PyTorch {r.shape}')
            diff = float(np.abs(g - r).max())
            rows.append((size, i, diff, diff / max(float(np.abs(r).max()), 1e-30)))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config')
    p.add_argument('checkpoint', nargs='?', help='weights (tools/train.py output); random weights if omitted')
    p.add_argument('--out', required=True, help='the .onnx file to write')
    p.add_argument('--shape', type=int, nargs=2, default=[224, 224], metavar=('H', 'W'))
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--backbone-only', action='store_true')
    p.add_argument('--dynamic', action='store_true', help='dynamic batch, height and width')
    p.add_argument('--verify', action='store_true')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    return p.parse_args(argv)


def prepare_out(out):
    """Create the folder of the .onnx file to write before any work; exit with a one-line error when it cannot.

    Args:
        out (str): path of the .onnx file to write (--out).
    """
    if os.path.isdir(out):
        sys.exit(f'error: --out {out} is a folder; give the path of the .onnx file to write')
    folder = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        sys.exit(f'error: --out {out}: cannot create its folder {folder} ({e.strerror})')
    if not os.access(folder, os.W_OK):
        sys.exit(f'error: --out {out}: its folder {folder} is not writable')


def main(argv=None):
    args = parse_args(argv)
    if min(args.shape) < 1 or args.batch < 1:
        sys.exit(f'error: --shape {args.shape} and --batch {args.batch} must be positive')
    prepare_out(args.out)
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    model = build_model(cfg, args.checkpoint)
    kind = model_kind(model, args.backbone_only)
    module = _Outputs(model, kind).eval()
    exported = module
    if args.dynamic:   # --verify compares against the untouched model
        exported = copy.deepcopy(module)
        dynamic_pooling(exported)
    x = torch.randn(args.batch, 3, *args.shape)
    export(exported, x, args.out, args.dynamic)
    what = 'dynamic batch, height and width' if args.dynamic else 'fixed size'
    print(f'wrote {args.out}: {kind} of {type(model).__name__}, input {args.batch}x3x{args.shape[0]}x{args.shape[1]}'
          f' ({what})')
    if args.verify:
        rows = verify(module, args.out, verify_sizes(tuple(args.shape), args.batch, args.dynamic))
        for (b, h, w), i, diff, rel in rows:
            print(f'  input {b}x3x{h}x{w} output {i}: max |onnx - torch| {diff:.2e}, relative {rel:.2e}')
        worst = max(r[3] for r in rows)
        print(f'verify: worst relative difference {worst:.2e} ({"OK" if worst <= 1e-4 else "FAILED"}, bound 1e-4)')
        if worst > 1e-4:
            sys.exit(1)

if __name__ == '__main__':
    main()
