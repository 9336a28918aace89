# Mask R-CNN FPN, L2ViT-B, 3x: the T-3x config with the base arch, its checkpoint, wider stages and drop
# path 0.3.
_base_ = './mask_rcnn_l2vit_t_3x.py'

model = dict(
    backbone=dict(arch='base', drop_path_rate=0.3,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/L2ViT-Base-checkpoint-best-ema.pth')),
    neck=dict(in_channels=[128, 256, 512, 1024]))
