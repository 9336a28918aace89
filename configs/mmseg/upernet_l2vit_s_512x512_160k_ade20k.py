# UperNet, L2ViT-S, ADE20K 512x512 160k: the T config with the small arch and its checkpoint (drop path 0.3
# as T, widths as T).
_base_ = './upernet_l2vit_t_512x512_160k_ade20k.py'

model = dict(
    backbone=dict(arch='small',
                  init_cfg=dict(
                      type='Pretrained',
                      checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/L2ViT-Small-checkpoint-best-ema.pth')))
