"""Backbones and images for the visualisation tools (tools/analysis/vis_attention.py, erf.py, docs/visualization.md).

`build_backbone(config)` builds `model.backbone` of any mmdet / mmseg / mmpretrain config (ours, or the libraries'
own such as mmdet's Swin-T), in eval mode, with random weights or a checkpoint; `load_image` reads an image
file into the (1, 3, H, W) tensor the backbone sees (resized, normalised with the config's mean / std).
"""
import os.path as osp

import numpy as np
import torch

#: ImageNet mean / std in RGB order (0-255), when a config names none
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


def load_config(config, cfg_options=None):
    import mmplugin_l2  # noqa: F401  (registers the backbones, resolves `mmplugin_l2::` configs)
    from mmengine.config import Config
    if not config.startswith(('mmdet::', 'mmseg::', 'mmpretrain::', 'mmplugin_l2::')) and not osp.isfile(config):
        raise FileNotFoundError(f'config {config!r} not found (a path, or e.g. mmdet::swin/...py)')
    if '::' in config:   # a library's own config, e.g. mmdet::swin/...py
        from mmengine.hub import get_config
        cfg = get_config(config)
    else:
        cfg = Config.fromfile(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def _state_dict_keys(path):
    from mmengine.runner.checkpoint import CheckpointLoader
    ckpt = CheckpointLoader.load_checkpoint(path, map_location='cpu')
    for key in ('state_dict', 'model'):
        if isinstance(ckpt, dict) and isinstance(ckpt.get(key), dict):
            return list(ckpt[key])
    return list(ckpt) if isinstance(ckpt, dict) else []


def build_backbone(config, checkpoint=None, cfg_options=None, device='cpu'):
    """`model.backbone` of `config` (a path or an mmengine config object), in eval mode.

    checkpoint: None keeps the random initialisation (any `init_cfg` of the config, e.g. a URL, is dropped);
    a path is loaded through the backbone's own `init_cfg=Pretrained` loader, so the authors' release files
    (converted on the fly by our backbones, by mmdet's Swin / PVT for theirs) and whole-model checkpoints of
    tools/train.py (keys under `backbone.`) both work."""
    from mmengine.config import Config
    from mmengine.registry import MODELS, init_default_scope
    cfg = config if isinstance(config, Config) else load_config(config, cfg_options)
    init_default_scope(cfg.get('default_scope', 'mmdet'))
    bb = cfg.model.backbone.to_dict() if hasattr(cfg.model.backbone, 'to_dict') else dict(cfg.model.backbone)
    bb.pop('init_cfg', None)
    bb.pop('pretrained', None)
    if checkpoint is not None:
        if not osp.isfile(checkpoint):
            raise FileNotFoundError(f'checkpoint {checkpoint!r} not found')
        init = dict(type='Pretrained', checkpoint=checkpoint)
        if any(k.startswith('backbone.') for k in _state_dict_keys(checkpoint)):
            init['prefix'] = 'backbone.'
        bb['init_cfg'] = init
    model = MODELS.build(bb)
    if checkpoint is not None:
        model.init_weights()
    model.to(device)
    model.eval()   # not chained: some backbones' train() (mmdet's Swin) return None
    return model


def norm_stats(cfg):
    """(mean, std, to_rgb) of the config's data preprocessor (ImageNet's when it names none)."""
    pre = cfg.get('data_preprocessor') or cfg.model.get('data_preprocessor') or {}
    mean = pre.get('mean', IMAGENET_MEAN)
    std = pre.get('std', IMAGENET_STD)
    to_rgb = pre.get('to_rgb', pre.get('bgr_to_rgb', True))
    return tuple(mean), tuple(std), to_rgb


def parse_size(size):
    """'224' / 224 / (224, 320) / '224x320' -> (H, W)."""
    if isinstance(size, (tuple, list)):
        h, w = (size * 2)[:2] if len(size) == 1 else size
        return int(h), int(w)
    h, _, w = str(size).partition('x')
    return int(h), int(w or h)


def load_image(path, size, mean=IMAGENET_MEAN, std=IMAGENET_STD, to_rgb=True):
    """Image file -> (tensor (1, 3, H, W) float32 normalised, RGB uint8 array (H, W, 3) for drawing),
    resized (bilinear) to `size` = (H, W). A missing file raises FileNotFoundError, an empty, truncated or
    non-image file a one-line ValueError naming it."""
    from PIL import Image
    if not osp.isfile(path):
        raise FileNotFoundError(f'image {path!r} not found')
    h, w = parse_size(size)
    try:
        with Image.open(path) as im:
            img = np.asarray(im.convert('RGB').resize((w, h), Image.BILINEAR))
    except OSError as e:   # PIL's UnidentifiedImageError (empty / not an image) and truncated files are OSErrors
        empty = ' (empty file, 0 bytes)' if osp.getsize(path) == 0 else ''
        raise ValueError(f'image {path!r} cannot be read{empty}: {type(e).__name__}: {str(e).splitlines()[0]}; '
                         'give a JPEG / PNG / BMP / WebP file') from None
    x = img if to_rgb else img[..., ::-1]
    x = (torch.from_numpy(np.ascontiguousarray(x)).float() - torch.tensor(mean)) / torch.tensor(std)
    return x.permute(2, 0, 1)[None].contiguous(), img


def list_images(folder, limit=None):
    exts = ('.jpg', '.jpeg', '.png', '.bmp', '.webp')
    if not osp.isdir(folder):
        raise FileNotFoundError(f'image folder {folder!r} not found')
    import os
    files = sorted(osp.join(r, f) for r, _, fs in os.walk(folder) for f in fs if f.lower().endswith(exts))
    if not files:
        raise FileNotFoundError(f'no image ({", ".join(exts)}) under {folder!r}')
    return files[:limit] if limit else files


def fix_batchnorm_grad_layout(model):
    """Work around a torch 2.14 CPU bug: BatchNorm2d's backward returns wrong input gradients when the output
    gradient's memory format differs from the input's (e.g. a contiguous input whose output goes through
    map_to_tokens + LayerNorm, which hands back a channels-last-strided gradient; tests/test_vis.py). Hooks
    on every BatchNorm give the gradient the input's layout; returns the hook handles."""
    handles = []

    def fwd(m, args, out):
        x = args[0]
        if not (torch.is_tensor(out) and out.requires_grad and out.dim() == 4):
            return
        fmt = torch.channels_last if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last) \
            else torch.contiguous_format
        # a tensor hook (not a module backward hook: blocks apply in-place ReLUs to BN outputs)
        out.register_hook(lambda g: g.contiguous(memory_format=fmt))
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            handles.append(m.register_forward_hook(fwd))
    return handles
