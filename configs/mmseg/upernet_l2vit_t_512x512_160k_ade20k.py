# UperNet with an L2ViT-T backbone on ADE20K, 512x512 crops, 160k iterations.
# Follows the authors' semantic_segmentation/configs/novel/upernet_l2vit_tiny_512x512_160k_ade20k.py
# (ChuanyangZheng/L2ViT, mmseg 0.26) in mmseg 1.x form; see docs/l2vit.md (Recipes). The S/B
# configs inherit this file.
_base_ = './_base_/upernet_adamw_160k.py'  # AdamW 6e-5, warm-up 1500 + poly, 8 GPUs x 2 (the authors')

# The heads use plain BN, as the authors' code (their comment says "SyncBN" but the type is 'BN'). For
# multi-GPU runs SyncBN is the usual choice: --cfg-options model.decode_head.norm_cfg.type=SyncBN
# model.auxiliary_head.norm_cfg.type=SyncBN
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    backbone=dict(
        _delete_=True,
        type='L2ViT',
        arch='tiny',
        drop_path_rate=0.3,  # 0.3 for T, S and B (the authors' configs)
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(
            type='Pretrained',
            checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/L2ViT-Tiny-checkpoint-best-ema.pth')),
    decode_head=dict(in_channels=[96, 192, 384, 768], norm_cfg=norm_cfg),
    auxiliary_head=dict(in_channels=384, norm_cfg=norm_cfg))

# wd 0.01 on every parameter: the authors' norm decay_mult=0 paramwise setting is commented out in their
# config. No gradient clipping, fp32.
optim_wrapper = dict(clip_grad=None)
default_hooks = dict(checkpoint=dict(interval=160000))  # the authors keep the final checkpoint only
