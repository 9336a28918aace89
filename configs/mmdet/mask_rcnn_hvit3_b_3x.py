# Mask R-CNN FPN, H-ViT3-B, 3x: the T-3x config (itself the T-1x one with the 3x schedule) with the
# base arch, its checkpoint, wider stages and drop path 0.6.
_base_ = './mask_rcnn_hvit3_t_3x.py'

model = dict(
    backbone=dict(arch='base', drop_path_rate=0.6,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-B.pth')),
    neck=dict(in_channels=[96, 192, 448, 640]))
