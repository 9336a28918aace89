"""Export the model a config describes to ONNX at a fixed input size, optionally verified in ONNX Runtime.

    python tools/deployment/pytorch2onnx.py CONFIG [CHECKPOINT] --out model.onnx [--shape H W] [--batch B]
        [--backbone-only] [--verify] [--cfg-options k=v ...]

What is exported (input: the image batch after the config's data preprocessor, i.e. normalised, NCHW float32):
* an mmpretrain classifier: backbone + neck + head, the logits (B, num_classes);
* an mmseg segmentor: `encode_decode`, the segmentation logits at the input size (B, classes, H, W);
* an mmdet detector: backbone + neck, the FPN maps (its RPN / RoI heads stay in PyTorch; see docs/deployment.md);
* `--backbone-only`: the backbone's pyramid maps.
The model runs in export mode (mmplugin_l2/models/layers/export.py): every layer's plain formulation, the same
function as eager inference. `--verify` runs ONNX Runtime on fresh random inputs of the export size and prints
the max abs / relative difference to PyTorch per output; it exits 1 if any relative difference exceeds 1e-4.
Dynamic height / width is not supported yet (docs/deployment.md): export one file per input size.
"""
import argparse
import sys

import numpy as np
import torch
import torch.nn as nn
from mmengine.config import Config, DictAction


class _Outputs(nn.Module):
    """The exported part of a model as a module whose forward takes only the image batch."""

    def __init__(self, model, kind, shape):
        super().__init__()
        self.model, self.kind, self.shape = model, kind, shape

    def forward(self, x):
        m = self.model
        if self.kind == 'backbone':
            return tuple(m.backbone(x))
        if self.kind == 'classifier':
            return m(x, mode='tensor')
        if self.kind == 'segmentor':
            h, w = self.shape
            metas = [dict(img_shape=(h, w), pad_shape=(h, w), ori_shape=(h, w))] * x.shape[0]
            return m.encode_decode(x, metas)
        return tuple(m.neck(m.backbone(x)))   # detector: backbone + neck


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


def export(module, x, out):
    from mmplugin_l2.models.layers.export import export_mode
    with torch.no_grad(), export_mode():
        ep = torch.export.export(module, (x,), strict=False)
        torch.onnx.export(ep, (x,), out, dynamo=True, verbose=False)


def verify(module, out, shape, batch, seeds=(1, 2)):
    """[(seed, output index, max abs diff, max rel diff)] of ONNX Runtime against PyTorch."""
    import onnxruntime as ort
    sess = ort.InferenceSession(out, providers=['CPUExecutionProvider'])
    rows = []
    for seed in seeds:
        x = torch.randn(batch, 3, *shape, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = module(x)
        ref = [ref] if torch.is_tensor(ref) else list(ref)
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
        if len(got) != len(ref):
            raise SystemExit(f'error: ONNX Runtime returned {len(got)} outputs, PyTorch {len(ref)}')
        for i, (g, r) in enumerate(zip(got, ref)):
            r = r.numpy()
            if g.shape != r.shape:
                raise SystemExit(f'error: output {i}: ONNX shape {g.shape} != PyTorch {r.shape}')
            diff = float(np.abs(g - r).max())
            rows.append((seed, i, diff, diff / max(float(np.abs(r).max()), 1e-30)))
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config')
    p.add_argument('checkpoint', nargs='?', help='weights (tools/train.py output); random weights if omitted')
    p.add_argument('--out', required=True, help='the .onnx file to write')
    p.add_argument('--shape', type=int, nargs=2, default=[224, 224], metavar=('H', 'W'))
    p.add_argument('--batch', type=int, default=1)
    p.add_argument('--backbone-only', action='store_true')
    p.add_argument('--dynamic', action='store_true', help='dynamic H / W (not supported yet)')
    p.add_argument('--verify', action='store_true')
    p.add_argument('--cfg-options', nargs='+', action=DictAction)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.dynamic:
        sys.exit('error: --dynamic is not supported yet: torch.export cannot solve the shape guards of these '
                 'backbones with symbolic H and W (docs/deployment.md); export one file per --shape')
    if min(args.shape) < 1 or args.batch < 1:
        sys.exit(f'error: --shape {args.shape} and --batch {args.batch} must be positive')
    cfg = Config.fromfile(args.config)
    if args.cfg_options:
        cfg.merge_from_dict(args.cfg_options)
    model = build_model(cfg, args.checkpoint)
    kind = model_kind(model, args.backbone_only)
    module = _Outputs(model, kind, tuple(args.shape)).eval()
    x = torch.randn(args.batch, 3, *args.shape)
    export(module, x, args.out)
    print(f'wrote {args.out}: {kind} of {type(model).__name__}, input {args.batch}x3x{args.shape[0]}x{args.shape[1]}')
    if args.verify:
        rows = verify(module, args.out, tuple(args.shape), args.batch)
        for seed, i, diff, rel in rows:
            print(f'  input seed {seed} output {i}: max |onnx - torch| {diff:.2e}, relative {rel:.2e}')
        worst = max(r[3] for r in rows)
        print(f'verify: worst relative difference {worst:.2e} ({"OK" if worst <= 1e-4 else "FAILED"}, bound 1e-4)')
        if worst > 1e-4:
            sys.exit(1)


if __name__ == '__main__':
    main()
