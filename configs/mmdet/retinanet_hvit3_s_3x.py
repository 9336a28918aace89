# RetinaNet FPN, H-ViT3-S, 3x: the H-ViT3-T RetinaNet 3x config (our settings) with the small arch, its
# checkpoint and drop path 0.4 (as the H-ViT3-S Mask R-CNN 3x config).
_base_ = './retinanet_hvit3_t_3x.py'

model = dict(
    backbone=dict(arch='small', drop_path_rate=0.4,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-S.pth')),
    neck=dict(in_channels=[128, 320, 512]))
