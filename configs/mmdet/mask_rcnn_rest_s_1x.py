# Mask R-CNN FPN with a ResT-Small backbone on COCO, 1x schedule (12 epochs).
# The authors' detectron2 recipe (wofmanaf/ResT object_detection/configs/Base-RCNN-FPN.yaml +
# ResTv1/mask_rcnn_rest_small_FPN_1x.yaml) in mmdet 3.x terms; see docs/rest.md (Recipes).
# Paper (Tab. 4): 39.6 box AP / 37.2 mask AP, 33.3 M parameters. The other sizes and the 3x configs inherit this.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    './_base_/datasets/coco_instance.py',
    './_base_/schedules/rest_adamw_1x.py',  # AdamW 1e-4, no decay on norms, 1x steps, warm-up 1000, fp32
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

model = dict(
    # Pixel normalisation: the ImageNet RGB mean/std the pretrained weights were trained with. The authors'
    # v1 yamls set none and so ran detectron2's default (BGR input, mean [103.53, 116.28, 123.675],
    # std [1, 1, 1]), which the author later called "a mistake" (ResTv2 retinanet yaml). Their v1 numbers
    # were most likely produced that way; to replicate it, set mean=[103.53, 116.28, 123.675],
    # std=[1., 1., 1.], bgr_to_rgb=False. Padding to 32 as the detectron2 FPN.
    data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                           pad_size_divisor=32),
    backbone=dict(
        _delete_=True,
        type='ResT',
        arch='small',
        drop_path_rate=0.1,  # the authors' detection value (0.1 lite/small, 0.2 base/large)
        out_indices=(0, 1, 2, 3),
        # As the authors: nothing frozen, BatchNorms (stem, patch embeddings) train in train mode.
        frozen_stages=-1,
        norm_eval=False,
        # Output LayerNorms on the side branch (the paper, mmdet): all stages see the pretrained features.
        # norm_in_path=True puts them in the main path as the authors' detectron2 backbone does.
        norm_in_path=False,
        with_cp=False,  # the attention maps are already chunked with recomputation (attn_chunk_elems)
        # The authors' ImageNet checkpoint ({'model': ...}), converted on load (`norm` -> norm3, head dropped).
        init_cfg=dict(type='Pretrained', checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_small.pth')),
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
