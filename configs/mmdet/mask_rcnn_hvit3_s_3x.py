# Mask R-CNN FPN, H-ViT3-S, 3x: the T-3x config (itself the T-1x one with the 3x schedule) with the
# small arch, its checkpoint and drop path 0.4.
_base_ = './mask_rcnn_hvit3_t_3x.py'

model = dict(
    backbone=dict(arch='small', drop_path_rate=0.4,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-S.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))
