"""Grad-CAM of the mmpretrain classifiers with our backbones, through the `grad-cam` package
(`pytorch_grad_cam`) set up the way mmpretrain's tools/visualization/vis_cam.py sets it up; what differs is
the reshape transform (docs/visualization.md#grad-cam).

Our blocks return tokens (B, N, C) of an (h, w) map, and the LayerNorm output norms of L2ViT / ResT /
H-ViT3 (LN) act on channels-last maps (B, h, w, C). The stock tool's reshape transform assumes a square
token map behind a class token (`--vit-like`), or NCHW for 4-D tensors: a channels-last LN output is then
read with the wrong axes, without an error. `TokenMapReshape` records the real layout at the forward and
returns NCHW for each of the three.
"""
import inspect

import torch
import torch.nn as nn

from .vis import ATTENTION_KINDS


class TokenMapReshape:
    """reshape_transform for `ActivationsAndGradients`: tokens (B, N, C) -> (B, C, h, w) with the (h, w)
    seen by the blocks in the same forward; channels-last LayerNorm outputs (B, h, w, C) -> (B, C, h, w);
    NCHW tensors are returned as they are.

    `attach(model, target_layers)` registers the hooks that record the layouts (call it once)."""

    def __init__(self):
        self.hw_of_tokens = {}     # N -> (h, w), from blocks called as block(x, (h, w), ...)
        self.channels_last = set()  # output shapes of target LayerNorms applied to (B, h, w, C) maps
        self.handles = []

    def attach(self, model, target_layers):
        def record_hw(m, args):
            if len(args) > 1 and torch.is_tensor(args[0]) and args[0].ndim == 3:
                hw = args[1]
                if isinstance(hw, (tuple, list)) and len(hw) == 2 and hw[0] * hw[1] == args[0].shape[1]:
                    self.hw_of_tokens[args[0].shape[1]] = (int(hw[0]), int(hw[1]))

        def record_layout(m, args, out):
            if isinstance(m, nn.LayerNorm) and torch.is_tensor(out) and out.ndim == 4:
                self.channels_last.add(tuple(out.shape))
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(record_hw))
        for m in target_layers:
            self.handles.append(m.register_forward_hook(record_layout))
        return self

    def release(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def __call__(self, t):
        if t.ndim == 4:
            return t.permute(0, 3, 1, 2) if tuple(t.shape) in self.channels_last else t
        if t.ndim == 3:
            n = t.shape[1]
            if n not in self.hw_of_tokens:
                raise ValueError(f'{n} tokens: no block of the forward ran on an {n}-token map '
                                 f'(seen: {self.hw_of_tokens})')
            h, w = self.hw_of_tokens[n]
            return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], h, w)
        raise ValueError(f'unsupported activation shape {tuple(t.shape)}')


def get_layer(model, name):
    """Module `name` of the model; KeyError listing the block names of the backbone otherwise."""
    mods = dict(model.named_modules())
    if name in mods:
        return mods[name]
    raise KeyError(f'no layer {name!r}; e.g. the last block {default_target_layer(model)!r}')


def default_target_layer(model):
    """Name of the last block of the backbone (the parent of its last attention layer), e.g.
    backbone.stages.3.1 (L2ViT), backbone.layers.3.blocks.3 (H-ViT3-T), backbone.layers.3.blocks.1 (ResT-S),
    backbone.blocks.11 (ViT3)."""
    names = [n for n, m in model.named_modules() if type(m).__name__ in ATTENTION_KINDS]
    if not names:
        raise ValueError('the model has no attention layer of ' + '/'.join(ATTENTION_KINDS))
    return names[-1].rsplit('.', 1)[0]


def build_cam(model, target_layers, method='GradCAM'):
    """A pytorch_grad_cam CAM object as vis_cam.py's `init_cam` builds it (its own activation hooks
    replaced by ActivationsAndGradients with our reshape transform); returns (cam, reshape)."""
    import pytorch_grad_cam as gc
    from pytorch_grad_cam.activations_and_gradients import ActivationsAndGradients
    methods = {'gradcam++': gc.GradCAMPlusPlus}
    methods.update({c.__name__.lower(): c for c in gc.base_cam.BaseCAM.__subclasses__()})
    if method.lower() not in methods:
        raise ValueError(f'unknown CAM method {method!r}; choose from {", ".join(sorted(methods))}')
    cls = methods[method.lower()]
    kw = {'use_cuda': False} if 'use_cuda' in inspect.signature(cls.__init__).parameters else {}  # grad-cam < 1.5
    cam = cls(model=model, target_layers=target_layers, **kw)
    reshape = TokenMapReshape().attach(model, target_layers)
    cam.activations_and_grads.release()
    cam.activations_and_grads = ActivationsAndGradients(cam.model, cam.target_layers, reshape)
    return cam, reshape


def grad_cam(model, inputs, target_layers, target_category=None, method='GradCAM'):
    """CAM (B, H, W) in [0, 1] of an ImageClassifier for `inputs` (B, 3, H, W); target_category None:
    the predicted class."""
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
    cam, reshape = build_cam(model, target_layers, method)
    try:
        targets = None if target_category is None else [ClassifierOutputTarget(target_category)] * len(inputs)
        return cam(inputs, targets)
    finally:
        reshape.release()
        cam.activations_and_grads.release()
