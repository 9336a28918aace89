# RetinaNet FPN with a ResT-Small backbone on COCO, 1x schedule (12 epochs).
# The authors' detectron2 recipe (wofmanaf/ResT object_detection/configs/Base-RetinaNet.yaml +
# ResTv1/retinanet_rest_small_FPN_1x.yaml) in mmdet 3.x terms; see docs/rest.md (Recipes).
# Paper (Tab. 3): 40.3 AP, 23.4 M parameters. The other sizes and the 3x configs inherit this file.
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    'mmdet::_base_/datasets/coco_detection.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

model = dict(
    # ImageNet RGB mean/std of the pretrained weights. The authors' v1 yamls ran detectron2's default (BGR,
    # mean [103.53, 116.28, 123.675], std 1), later called "a mistake" by the author; see mask_rcnn_rest_s_1x.py.
    data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                           pad_size_divisor=32),
    backbone=dict(
        _delete_=True,
        type='ResT',
        arch='small',
        drop_path_rate=0.1,
        out_indices=(1, 2, 3),  # stages 2-4 (strides 8, 16, 32), as the authors' RetinaNet
        frozen_stages=-1,
        norm_eval=False,
        norm_in_path=False,  # side-branch output LNs; True = the authors' in-path placement
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint='data/pretrained/rest_small.pth')),
    # P3-P5 from stages 2-4, P6/P7 by stride-2 convs on stage 4 with a ReLU before P7 (detectron2's
    # LastLevelP6P7 on "stage4").
    neck=dict(in_channels=[128, 256, 512], start_level=0, add_extra_convs='on_input', relu_before_extra_convs=True,
              num_outs=5))

# Data: short side one of 640..800 (step 32, long side <= 1333), horizontal flip; no crop for RetinaNet.
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='RandomChoiceResize', scales=[(1333, s) for s in range(640, 801, 32)], keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
train_dataloader = dict(batch_size=2, dataset=dict(pipeline=train_pipeline))  # 8 GPUs x 2 = 16

# AdamW lr 1e-4, wd 0.05, no decay on norm parameters; no gradient clipping for RetinaNet. fp32.
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.))

# 90k iterations at batch 16 (12.3 epochs), steps at 60k / 80k, warm-up 1000 iterations from 0.001.
max_epochs = 12
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[8, 11], gamma=0.1),
]
auto_scale_lr = dict(enable=False, base_batch_size=16)
