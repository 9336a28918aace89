# RetinaNet FPN with an L2ViT-T backbone on COCO, 1x schedule, trained under automatic mixed precision:
# retinanet_l2vit_t_1x.py with mmengine's AmpOptimWrapper (autocast around the forward and a dynamic loss scale; fp16
# by default, `--cfg-options optim_wrapper.dtype=bfloat16` for bf16), as mmdet's Swin `_amp` configs. Everything else
# is inherited; see docs/mixed_precision.md.
_base_ = './retinanet_l2vit_t_1x.py'

optim_wrapper = dict(type='AmpOptimWrapper', loss_scale='dynamic')
