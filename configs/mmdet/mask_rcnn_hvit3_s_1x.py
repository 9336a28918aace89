# Mask R-CNN FPN, H-ViT3-S, 1x: as the T config, with the small arch and its checkpoint.
_base_ = './mask_rcnn_hvit3_t_1x.py'

model = dict(
    backbone=dict(arch='small',
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-S.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))
