# UperNet, H-ViT3-B, ADE20K 512x512 160k: the T config with the base arch, wider stages, drop path 0.5
# and fp32 training (plain OptimWrapper, as the authors' B config).
_base_ = './upernet_hvit3_t_512x512_160k_ade20k.py'

model = dict(
    backbone=dict(arch='base', drop_path_rate=0.5,
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-B.pth')),
    decode_head=dict(in_channels=[96, 192, 448, 640]),
    auxiliary_head=dict(in_channels=448))

optim_wrapper = dict(type='OptimWrapper')
