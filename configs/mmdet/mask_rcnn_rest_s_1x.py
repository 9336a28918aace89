# Mask R-CNN FPN with a ResT-Small backbone on COCO, 1x schedule (12 epochs).
# The authors' detectron2 recipe (wofmanaf/ResT object_detection/configs/Base-RCNN-FPN.yaml +
# ResTv1/mask_rcnn_rest_small_FPN_1x.yaml) in mmdet 3.x terms; see docs/rest.md (Recipes).
# Paper (Tab. 4): 39.6 box AP / 37.2 mask AP, 33.3 M parameters. The other sizes and the 3x configs inherit this.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    './_base_/datasets/coco_instance.py',
    './_base_/rest_detection.py',  # the solver (AdamW 1e-4, 1x steps, warm-up 1000, fp32), runtime, plugin import
]

# The ResT-Small backbone (all four stages) and pixel normalisation of rest_detection.py in place of ResNet-50's.
model = dict(
    data_preprocessor=_base_._rest_data_preprocessor,
    backbone=dict(_base_._rest_backbone, _delete_=True),
    neck=dict(in_channels=[64, 128, 256, 512]))

# Data: the detectron2 Mask R-CNN base crops a relative 0.9 x 0.9 window before the resize (boxes recomputed
# from the masks, crops without objects kept), then resizes the short side to one of 640..800 (step 32,
# long side <= 1333) and flips. The paper says 480-800; the configs use 640-800 (the 3x configs use 480-800).
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomCrop', crop_type='relative', crop_size=(0.9, 0.9), allow_negative_crop=True,
         recompute_bbox=True),
    dict(type='RandomChoiceResize', scales=[(1333, s) for s in range(640, 801, 32)], keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
# 16 images per iteration as the authors: 8 GPUs x 2.
train_dataloader = dict(batch_size=2, dataset=dict(pipeline=train_pipeline))

# The solver of rest_adamw_1x.py; Mask R-CNN also clips the gradient norm of the whole model at 0.01 every
# step (CLIP_TYPE full_model).
optim_wrapper = dict(clip_grad=dict(max_norm=0.01, norm_type=2))
