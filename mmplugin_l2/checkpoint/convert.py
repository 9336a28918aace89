"""Offline conversion of the authors' release checkpoints (used by tools/convert_checkpoint.py).

Targets:
* 'backbone'   -> {'state_dict': backbone weights}, for `init_cfg=dict(type='Pretrained', checkpoint=...)`;
* 'mmpretrain' -> {'state_dict': {'backbone.*', 'head.fc.*'}}, the whole ImageClassifier of
  configs/mmpretrain, for `tools/test.py CONFIG FILE` or `load_from`.
Every converted key is checked against a freshly built model of the given type and arch: keys or shapes
that do not fit raise, listing them.
"""
import torch
from mmengine.registry import MODELS

from .io import check_state_dict_fits, extract_state_dict, load_checkpoint_file

#: the backbone settings of the mmpretrain classifiers (see configs/mmpretrain)
CLASSIFIER_BACKBONE = {
    'HViT3': dict(out_indices=(3,), out_norm_cfg=dict(type='BN')),
    'ViT3': dict(),
    'L2ViT': dict(out_indices=(3,), final_norm=True),
    'ResT': dict(out_indices=(3,)),  # norm3 (LayerNorm) takes the authors' final `norm`
}

EMA_KEYS = ('state_dict_ema', 'model_ema')


def build_backbone(model_type, arch, target):
    import mmplugin_l2  # noqa: F401
    kw = CLASSIFIER_BACKBONE.get(model_type, {}) if target == 'mmpretrain' else {}
    return MODELS.build(dict(type=model_type, arch=arch, **kw))


def convert_checkpoint(src, model_type, arch, target='backbone', ema=False):
    """Convert the authors' file `src` and return the dict to save."""
    if target not in ('backbone', 'mmpretrain'):
        raise ValueError(f"target must be 'backbone' or 'mmpretrain', got {target!r}")
    ckpt = load_checkpoint_file(src)
    raw = extract_state_dict(ckpt, keys=EMA_KEYS if ema else ('state_dict', 'model'))
    model = build_backbone(model_type, arch, target)
    sd = model.convert_state_dict(raw)
    check_state_dict_fits(model, sd, src)
    sd = {k: v.detach().clone().contiguous() for k, v in sd.items()}
    if target == 'backbone':
        return {'state_dict': sd, 'meta': dict(source=str(src), model=model_type, arch=arch)}
    out = {f'backbone.{k}': v for k, v in sd.items()}
    for name in ('weight', 'bias'):
        key = f'head.{name}'
        if key not in raw:
            raise ValueError(f'{src}: no classifier {key!r}; the mmpretrain target needs the authors\' '
                             f'classification checkpoint')
        out[f'head.fc.{name}'] = raw[key].detach().clone()
    return {'state_dict': out, 'meta': dict(source=str(src), model=model_type, arch=arch)}


def save_checkpoint(obj, dst):
    torch.save(obj, dst)
