# Mask R-CNN FPN, ResT-Base, 1x: the Small config with the base arch and drop path 0.2 (the authors' value).
# Paper (Tab. 4): 41.6 box AP / 38.7 mask AP, 49.8 M parameters.
_base_ = './mask_rcnn_rest_s_1x.py'

model = dict(
    backbone=dict(arch='base', drop_path_rate=0.2,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_base.pth')),
    neck=dict(in_channels=[96, 192, 384, 768]))
