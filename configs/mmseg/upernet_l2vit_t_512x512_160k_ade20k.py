# UperNet with an L2ViT-T backbone on ADE20K, 512x512 crops, 160k iterations.
# Follows the authors' semantic_segmentation/configs/novel/upernet_l2vit_tiny_512x512_160k_ade20k.py
# (ChuanyangZheng/L2ViT, mmseg 0.26) in mmseg 1.x form; see docs/l2vit.md (Recipes). The S/B
# configs inherit this file.
_base_ = [
    'mmseg::_base_/models/upernet_swin.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
# The heads use plain BN, as the authors' code (their comment says "SyncBN" but the type is 'BN'). For
# multi-GPU runs SyncBN is the usual choice: --cfg-options model.decode_head.norm_cfg.type=SyncBN
# model.auxiliary_head.norm_cfg.type=SyncBN
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    data_preprocessor=data_preprocessor,
    backbone=dict(
        _delete_=True,
        type='L2ViT',
        arch='tiny',
        drop_path_rate=0.3,  # 0.3 for T, S and B (the authors' configs)
        out_indices=(0, 1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='data/pretrained/L2ViT-Tiny-checkpoint-best-ema.pth')),
    decode_head=dict(in_channels=[96, 192, 384, 768], num_classes=150, norm_cfg=norm_cfg),
    auxiliary_head=dict(in_channels=384, in_index=2, num_classes=150, norm_cfg=norm_cfg))

# AdamW 6e-5, wd 0.01 on every parameter: the authors' norm decay_mult=0 paramwise setting is commented out
# in their config. No gradient clipping, fp32.
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    clip_grad=None)

# linear warm-up over 1500 iterations from 1e-6 x lr, then poly (power 1) to 0 at 160k
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]
default_hooks = dict(checkpoint=dict(interval=160000))  # the authors keep the final checkpoint only

# 2 images per GPU; 8 GPUs x 2 = 16 (the authors' config comment).
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
