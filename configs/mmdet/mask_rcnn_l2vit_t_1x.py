# Mask R-CNN FPN with an L2ViT-T backbone on COCO, 1x schedule (12 epochs).
# Follows the authors' object_detection/configs/L2ViT/maskrcnn_1x_l2vit_v0_tiny_coco.py (ChuanyangZheng/L2ViT,
# mmdet 2.23) in mmdet 3.x form; see docs/l2vit.md (Recipes). The other Mask R-CNN L2ViT configs
# inherit this file.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    './_base_/datasets/coco_instance_ms_crop.py',  # the authors' multi-scale + crop, for 1x as well as 3x
    './_base_/schedules/l2vit_adamw_1x.py',  # AdamW 1e-4 on every parameter, fp32, eval at the end
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
        init_cfg=dict(
            type='Pretrained',
            checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/L2ViT-Tiny-checkpoint-best-ema.pth')),
    neck=dict(in_channels=[96, 192, 384, 768]))

# 2 images per GPU (the authors' base dataset file); 8 GPUs x 2 = 16 is assumed (not stated by the authors).
train_dataloader = dict(batch_size=2)
