# RetinaNet FPN, H-ViT3-B, 1x: the H-ViT3-T RetinaNet config (our settings, see there) with the base arch,
# its checkpoint and wider stages.
_base_ = './retinanet_hvit3_t_1x.py'

model = dict(
    backbone=dict(arch='base',
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-B.pth')),
    neck=dict(in_channels=[192, 448, 640]))
