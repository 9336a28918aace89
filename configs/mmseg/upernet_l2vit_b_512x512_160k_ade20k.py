# UperNet, L2ViT-B, ADE20K 512x512 160k: the T config with the base arch, its checkpoint and wider stages
# (drop path 0.3 as T).
_base_ = './upernet_l2vit_t_512x512_160k_ade20k.py'

model = dict(
    backbone=dict(arch='base',
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/L2ViT-Base-checkpoint-best-ema.pth')),
    decode_head=dict(in_channels=[128, 256, 512, 1024]),
    auxiliary_head=dict(in_channels=512))
