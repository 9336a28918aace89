# Mask R-CNN FPN with an H-ViT3-T backbone on COCO, 1x schedule (12 epochs).
# Follows the authors' detection/configs/vittt/vittt_t_mrcnn_1x.py (Liyining-ai/ViTTT, mmdet 3.3.0);
# see docs/hvit3.md (Recipes). The S/B and 3x configs inherit this file.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    './_base_/datasets/coco_instance_ms_crop.py',  # the authors' multi-scale + crop, for 1x as well as 3x
    './_base_/schedules/step_1x_warmup1000.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        _delete_=True,
        type='HViT3',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(0, 1, 2, 3),
        with_cp=True,
        # The authors' ImageNet checkpoint, converted on load (RoPE buffers, BN1d norm and head dropped).
        init_cfg=dict(type='Pretrained', checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/H-ViTTT-T.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))

# 4 images per GPU as the authors' coco_instance base. 8 GPUs x 4 = 32 is an assumption: the authors do
# not state their GPU count. Validation/test batch 2 as theirs.
train_dataloader = dict(batch_size=4, num_workers=4)
val_dataloader = dict(batch_size=2)
test_dataloader = val_dataloader

# fp16 AMP + AdamW, no gradient clipping. Only parameters whose name contains 'norm' (the output LNs
# norm0-3, the blocks' norm1/norm2 and the stem/downsample BNs) skip weight decay. The authors also list
# 'absolute_pos_embed' and 'relative_position_bias_table', Swin leftovers that match nothing here, so
# they are left out. lr 2e-4 is for a total batch of 32 (assumed 8 GPUs x 4); --auto-scale-lr rescales it.
optim_wrapper = dict(
    type='AmpOptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=2e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
auto_scale_lr = dict(enable=False, base_batch_size=32)
