# RetinaNet FPN with an H-ViT3-T backbone on COCO, 1x schedule (12 epochs).
# The H-ViT3 authors publish no RetinaNet recipe: these settings are OURS. They follow the closest published
# one, L2ViT's RetinaNet recipe (configs/mmdet/retinanet_l2vit_t_1x.py, inherited here: stages 2-4 into an
# FPN with P6/P7 on C5, multi-scale + crop augmentation, AdamW 1e-4 / wd 0.05, warm-up 500 iterations,
# 2 images x 8 GPUs, fp32), with the H-ViT3 backbone settings of its Mask R-CNN configs (drop path 0.1,
# activation checkpointing, the authors' ImageNet checkpoint). No result is reported for this model
# (docs/hvit3.md). The S/B and 3x configs inherit this file.
_base_ = './retinanet_l2vit_t_1x.py'

model = dict(
    backbone=dict(
        _delete_=True,
        type='HViT3',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(1, 2, 3),
        with_cp=True,
        init_cfg=dict(type='Pretrained', checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-T.pth')),
    neck=dict(in_channels=[128, 320, 512], start_level=0, add_extra_convs='on_input', num_outs=5))
