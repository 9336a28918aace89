# RetinaNet FPN with a ResT-Small backbone on COCO, 1x schedule (12 epochs).
# The authors' detectron2 recipe (wofmanaf/ResT object_detection/configs/Base-RetinaNet.yaml +
# ResTv1/retinanet_rest_small_FPN_1x.yaml) in mmdet 3.x terms; see docs/rest.md (Recipes).
# Paper (Tab. 3): 40.3 AP, 23.4 M parameters. The other sizes and the 3x configs inherit this file.
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    './_base_/datasets/coco_detection.py',
    './_base_/rest_detection.py',  # the solver (AdamW 1e-4, 1x steps, warm-up 1000, fp32), runtime, plugin import
]

# The ResT-Small backbone and pixel normalisation of rest_detection.py in place of ResNet-50's (ImageNet RGB
# mean/std; the authors' v1 BGR default is described there), returning stages 2-4 (strides 8, 16, 32) as the
# authors' RetinaNet.
model = dict(
    data_preprocessor=_base_._rest_data_preprocessor,
    backbone=dict(_base_._rest_backbone, _delete_=True, out_indices=(1, 2, 3)),
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
# The solver of rest_adamw_1x.py, with no gradient clipping for RetinaNet.
