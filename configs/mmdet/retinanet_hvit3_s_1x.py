# RetinaNet FPN, H-ViT3-S, 1x: the H-ViT3-T RetinaNet config (our settings, see there) with the small arch
# and its checkpoint; the stage widths are those of T.
_base_ = './retinanet_hvit3_t_1x.py'

model = dict(
    backbone=dict(arch='small',
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-S.pth')),
    neck=dict(in_channels=[128, 320, 512]))
