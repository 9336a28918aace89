# RetinaNet FPN, ResT-Base, 1x: the Small 1x config with the base arch. Paper (Tab. 3): 42.0 AP, 40.5 M parameters.
_base_ = './retinanet_rest_s_1x.py'

model = dict(
    backbone=dict(arch='base', drop_path_rate=0.2,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_base.pth')),
    neck=dict(in_channels=[192, 384, 768]))
