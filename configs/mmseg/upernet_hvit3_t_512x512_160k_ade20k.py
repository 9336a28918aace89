# UperNet with an H-ViT3-T backbone on ADE20K, 512x512 crops, 160k iterations.
# Follows the authors' segmentation/configs/vittt/vittt_tiny.py (Liyining-ai/ViTTT, mmseg 1.2.2); see
# docs/hvit3.md (Recipes). The S/B configs inherit this file.
#
# The decode and auxiliary heads keep SyncBN from mmseg's upernet_swin base, as the authors and mmseg's own
# Swin ADE20K configs do. SyncBN needs a distributed run; for a single-process (e.g. CPU) run override it:
#   --cfg-options model.decode_head.norm_cfg.type=BN model.auxiliary_head.norm_cfg.type=BN
# (changing the top-level `norm_cfg` has no effect: its value was already copied into the heads).
_base_ = './_base_/upernet_adamw_160k.py'  # AdamW 6e-5, warm-up 1500 + poly, 8 GPUs x 2 (the authors')

model = dict(
    backbone=dict(
        _delete_=True,
        type='HViT3',
        arch='tiny',
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        with_cp=False,
        init_cfg=dict(type='Pretrained', checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-T.pth')),
    decode_head=dict(in_channels=[64, 128, 320, 512]),
    auxiliary_head=dict(in_channels=320))

# Only parameters whose name contains 'norm' skip weight decay (the authors' Swin leftovers
# 'absolute_pos_embed' / 'relative_position_bias_table' match nothing here and are left out).
# T trains with fp16 AMP (AmpOptimWrapper) while S and B use fp32 OptimWrapper, as the authors.
optim_wrapper = dict(type='AmpOptimWrapper', paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
