# UperNet with a ResT-Small backbone on ADE20K, 512x512 crops, 160k iterations.
# The authors publish no ResT v1 segmentation config or result: this follows mmseg 1.x's Swin UperNet 160k
# recipe (swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py); see
# docs/rest.md (Recipes). The B/L configs inherit this file.
#
# The decode and auxiliary heads keep SyncBN from mmseg's upernet_swin base. SyncBN needs a distributed run;
# for a single-process (e.g. CPU) run override it:
#   --cfg-options model.decode_head.norm_cfg.type=BN model.auxiliary_head.norm_cfg.type=BN
_base_ = [
    'mmseg::_base_/models/upernet_swin.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

crop_size = (512, 512)
# Test images are padded to a multiple of 32 (and the logits cropped back), as the detectron2 FPN pads. The
# backbone does not need it (any size works), but on multiples of 32 every stage sees whole reduction windows.
data_preprocessor = dict(size=crop_size, test_cfg=dict(size_divisor=32))
model = dict(
    data_preprocessor=data_preprocessor,
    backbone=dict(
        _delete_=True,
        type='ResT',
        arch='small',
        drop_path_rate=0.1,  # the authors' detection values: 0.1 lite/small, 0.2 base/large
        out_indices=(0, 1, 2, 3),
        norm_in_path=False,  # side-branch output LNs (mmseg convention); True = the authors' d2 placement
        init_cfg=dict(type='Pretrained', checkpoint='data/pretrained/rest_small.pth')),
    decode_head=dict(in_channels=[64, 128, 256, 512], num_classes=150),
    auxiliary_head=dict(in_channels=256, in_index=2, num_classes=150))

# AdamW lr 6e-5, wd 0.01; parameters whose name contains 'norm' (the blocks' norm1/norm2, the EMSA sr_norm,
# the output norms norm0-3 and the BatchNorms `.norm` of the stem and patch embeddings) skip weight decay.
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))

param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]

# 8 GPUs x 2 images
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
