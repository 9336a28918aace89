# RetinaNet FPN, ResT-Large, 1x: the Small 1x config with the large arch.
# Paper (Tab. 3): 44.8 AP, 61.8 M parameters; the authors ship no config for it.
_base_ = './retinanet_rest_s_1x.py'

model = dict(
    backbone=dict(arch='large', drop_path_rate=0.2,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_large.pth')),
    neck=dict(in_channels=[192, 384, 768]))
