# RetinaNet FPN, ResT-Lite, 3x: the Small 3x config with the lite arch. No paper result for the 3x schedule.
_base_ = './retinanet_rest_s_3x.py'

model = dict(
    backbone=dict(arch='lite', drop_path_rate=0.1,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_lite.pth')),
    neck=dict(in_channels=[128, 256, 512]))
