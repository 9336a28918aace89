# Mask R-CNN FPN, ResT-Large, 3x: the Small 3x config with the large arch.
_base_ = './mask_rcnn_rest_s_3x.py'

model = dict(
    backbone=dict(arch='large', drop_path_rate=0.2,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_large.pth')),
    neck=dict(in_channels=[96, 192, 384, 768]))
