# RetinaNet FPN, L2ViT-S, 1x: the T config with the small arch and its checkpoint; drop path 0.1 as T.
_base_ = './retinanet_l2vit_t_1x.py'

model = dict(
    backbone=dict(arch='small',
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/L2ViT-Small-checkpoint-best-ema.pth')))
