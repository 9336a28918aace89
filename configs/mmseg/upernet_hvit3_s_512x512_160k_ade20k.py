# UperNet, H-ViT3-S, ADE20K 512x512 160k: the T config with the small arch, drop path 0.4 and
# fp32 training (plain OptimWrapper, as the authors' S config).
_base_ = './upernet_hvit3_t_512x512_160k_ade20k.py'

model = dict(
    backbone=dict(arch='small', drop_path_rate=0.4,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-S.pth')),
    decode_head=dict(in_channels=[64, 128, 320, 512]),
    auxiliary_head=dict(in_channels=320))

optim_wrapper = dict(type='OptimWrapper')
