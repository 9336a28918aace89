# RetinaNet FPN with an L2ViT-T backbone on COCO, 1x schedule (12 epochs).
# Follows the authors' object_detection/configs/L2ViT/retinanet_1x_l2vit_v0_tiny_coco.py (ChuanyangZheng/L2ViT,
# mmdet 2.23) in mmdet 3.x form; see docs/l2vit.md (Recipes). The other RetinaNet L2ViT configs
# inherit this file.
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    'mmdet::_base_/datasets/coco_detection.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

# Stages 2-4 (strides 8, 16, 32) into an FPN starting at its first input, P6/P7 by extra convs on the input
# (C5). Only the returned stages get an output norm (the authors' stale comment about removing the first
# norm by hand does not apply).
model = dict(
    backbone=dict(
        _delete_=True,
        type='L2ViT',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='data/pretrained/L2ViT-Tiny-checkpoint-best-ema.pth')),
    neck=dict(in_channels=[192, 384, 768], start_level=0, add_extra_convs='on_input', num_outs=5))

# The authors' multi-scale + crop augmentation, used for 1x as well as 3x (as the Mask R-CNN configs).
_ms_scales = [(s, 1333) for s in range(480, 801, 32)]  # short side 480..800 step 32, long side <= 1333
_ms_crop = dict(
    type='RandomChoice',
    transforms=[
        [dict(type='RandomChoiceResize', scales=_ms_scales, keep_ratio=True)],
        [
            dict(type='RandomChoiceResize', scales=[(400, 1333), (500, 1333), (600, 1333)], keep_ratio=True),
            dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600), allow_negative_crop=True),
            dict(type='RandomChoiceResize', scales=_ms_scales, keep_ratio=True),
        ],
    ])
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='RandomFlip', prob=0.5),
    _ms_crop,
    dict(type='PackDetInputs'),
]
# 2 images per GPU; 8 GPUs x 2 = 16 assumed (not stated by the authors).
train_dataloader = dict(batch_size=2, dataset=dict(pipeline=train_pipeline))

# AdamW 1e-4, wd 0.05 on every parameter (no paramwise_cfg, as the authors), no gradient clipping, fp32.
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    clip_grad=None)

max_epochs = 12
train_cfg = dict(max_epochs=max_epochs, val_interval=max_epochs)  # evaluate at the last epoch only
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[8, 11], gamma=0.1),
]
default_hooks = dict(checkpoint=dict(interval=max_epochs))
# lr 1e-4 is for a total batch of 16; pass --auto-scale-lr to rescale it to yours.
auto_scale_lr = dict(enable=False, base_batch_size=16)
