# Mask R-CNN FPN, ResT-Large, 1x: the Small config with the large arch and drop path 0.2 (the authors'
# detection value for large). No paper result for this pairing.
_base_ = './mask_rcnn_rest_s_1x.py'

model = dict(
    backbone=dict(arch='large', drop_path_rate=0.2,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_large.pth')),
    neck=dict(in_channels=[96, 192, 384, 768]))
