# UperNet with an H-ViT3-T backbone on ADE20K, 512x512 crops, 160k iterations.
# Follows the authors' segmentation/configs/vittt/vittt_tiny.py (Liyining-ai/ViTTT, mmseg 1.2.2); see
# docs/hvit3.md (Recipes). The S/B configs inherit this file.
#
# The decode and auxiliary heads keep SyncBN from mmseg's upernet_swin base, as the authors and mmseg's own
# Swin ADE20K configs do. SyncBN needs a distributed run; for a single-process (e.g. CPU) run override it:
#   --cfg-options model.decode_head.norm_cfg.type=BN model.auxiliary_head.norm_cfg.type=BN
# (changing the top-level `norm_cfg` has no effect: its value was already copied into the heads).
_base_ = [
    'mmseg::_base_/models/upernet_swin.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    backbone=dict(
        _delete_=True,
        type='HViT3',
        arch='tiny',
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint='data/pretrained/H-ViTTT-T.pth')),
    decode_head=dict(in_channels=[64, 128, 320, 512], num_classes=150),
    auxiliary_head=dict(in_channels=320, in_index=2, num_classes=150))

# AdamW; only parameters whose name contains 'norm' skip weight decay (the authors' Swin leftovers
# 'absolute_pos_embed' / 'relative_position_bias_table' match nothing here and are left out).
# T trains with fp16 AMP (AmpOptimWrapper) while S and B use fp32 OptimWrapper, as the authors.
optim_wrapper = dict(
    _delete_=True,
    type='AmpOptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))

param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]

# 2 images per GPU; 8 GPUs x 2 = 16 per the authors' config comment.
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
