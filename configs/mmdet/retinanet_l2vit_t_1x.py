# RetinaNet FPN with an L2ViT-T backbone on COCO, 1x schedule (12 epochs).
# Follows the authors' object_detection/configs/L2ViT/retinanet_1x_l2vit_v0_tiny_coco.py (ChuanyangZheng/L2ViT,
# mmdet 2.23) in mmdet 3.x form; see docs/l2vit.md (Recipes). The other RetinaNet L2ViT configs
# inherit this file.
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    './_base_/datasets/coco_detection_ms_crop.py',  # multi-scale + crop, as the Mask R-CNN configs
    './_base_/schedules/l2vit_adamw_1x.py',  # AdamW 1e-4 on every parameter, fp32, eval at the end
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
        init_cfg=dict(
            type='Pretrained',
            checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/L2ViT-Tiny-checkpoint-best-ema.pth')),
    neck=dict(in_channels=[192, 384, 768], start_level=0, add_extra_convs='on_input', num_outs=5))

# 2 images per GPU; 8 GPUs x 2 = 16 assumed (not stated by the authors).
train_dataloader = dict(batch_size=2)
