# RetinaNet FPN, H-ViT3-B, 3x: the H-ViT3-T RetinaNet 3x config (our settings) with the base arch, its
# checkpoint, wider stages and drop path 0.6 (as the H-ViT3-B Mask R-CNN 3x config).
_base_ = './retinanet_hvit3_t_3x.py'

model = dict(
    backbone=dict(arch='base', drop_path_rate=0.6,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-B.pth')),
    neck=dict(in_channels=[192, 448, 640]))
