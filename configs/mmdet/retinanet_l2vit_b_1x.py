# RetinaNet FPN, L2ViT-B, 1x: the T config with the base arch, its checkpoint, wider stages and drop path 0.2.
_base_ = './retinanet_l2vit_t_1x.py'

model = dict(
    backbone=dict(arch='base', drop_path_rate=0.2,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/L2ViT-Base-checkpoint-best-ema.pth')),
    neck=dict(in_channels=[256, 512, 1024]))
