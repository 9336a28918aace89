# RetinaNet FPN, ResT-Large, 3x: the Small 3x config with the large arch. No paper result for the 3x schedule.
_base_ = './retinanet_rest_s_3x.py'

model = dict(
    backbone=dict(arch='large', drop_path_rate=0.2,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_large.pth')),
    neck=dict(in_channels=[192, 384, 768]))
