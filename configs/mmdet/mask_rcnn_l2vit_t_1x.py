# Mask R-CNN FPN with an L2ViT-T backbone on COCO, 1x schedule (12 epochs).
# Follows the authors' object_detection/configs/L2ViT/maskrcnn_1x_l2vit_v0_tiny_coco.py (ChuanyangZheng/L2ViT,
# mmdet 2.23) in mmdet 3.x form; see docs/l2vit.md (Recipes). The other Mask R-CNN L2ViT configs
# inherit this file.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='L2ViT',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        # The authors' ImageNet-1k release file, read directly (weights under `model`; `head` and the final
        # `norm` are dropped, the output norms norm0-3 start fresh as in the authors' runs). Their configs
        # set no path at all; the readme says to load this checkpoint.
        init_cfg=dict(type='Pretrained', checkpoint='data/pretrained/L2ViT-Tiny-checkpoint-best-ema.pth')),
    neck=dict(in_channels=[96, 192, 384, 768]))

# The authors' multi-scale + crop ("DETR / Sparse R-CNN") augmentation, used for 1x as well as 3x.
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
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5),
    _ms_crop,
    dict(type='PackDetInputs'),
]
# 2 images per GPU (the authors' base dataset file); 8 GPUs x 2 = 16 is assumed (not stated by the authors).
train_dataloader = dict(batch_size=2, dataset=dict(pipeline=train_pipeline))

# AdamW 1e-4, wd 0.05 on every parameter (the authors set no paramwise_cfg: norms, biases and the linear
# attention temperatures are decayed too), no gradient clipping, fp32 (their config: "do not use mmdet
# version fp16"; `tools/train.py --amp` works, the linear attention reduces in fp32).
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
