# UperNet, ResT-Large, ADE20K 512x512 160k: the Small config with the large arch and drop path 0.2.
_base_ = './upernet_rest_s_512x512_160k_ade20k.py'

model = dict(
    backbone=dict(arch='large', drop_path_rate=0.2,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_large.pth')),
    decode_head=dict(in_channels=[96, 192, 384, 768]),
    auxiliary_head=dict(in_channels=384))
