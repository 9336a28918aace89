# UperNet with a ResT-Small backbone on ADE20K, 512x512 crops, 160k iterations.
# The authors publish no ResT v1 segmentation config or result: this follows mmseg 1.x's Swin UperNet 160k
# recipe (swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py); see
# docs/rest.md (Recipes). The B/L configs inherit this file.
#
# The decode and auxiliary heads keep SyncBN from mmseg's upernet_swin base. SyncBN needs a distributed run;
# for a single-process (e.g. CPU) run override it:
#   --cfg-options model.decode_head.norm_cfg.type=BN model.auxiliary_head.norm_cfg.type=BN
_base_ = './_base_/upernet_adamw_160k.py'  # AdamW 6e-5, warm-up 1500 + poly, 8 GPUs x 2

# Test images are padded to a multiple of 32 (and the logits cropped back), as the detectron2 FPN pads. The
# backbone does not need it (any size works), but on multiples of 32 every stage sees whole reduction windows.
data_preprocessor = dict(test_cfg=dict(size_divisor=32))
model = dict(
    data_preprocessor=data_preprocessor,
    backbone=dict(
        _delete_=True,
        type='ResT',
        arch='small',
        drop_path_rate=0.1,  # the authors' detection values: 0.1 lite/small, 0.2 base/large
        out_indices=(0, 1, 2, 3),
        norm_in_path=False,  # side-branch output LNs (mmseg convention); True = the authors' d2 placement
        init_cfg=dict(type='Pretrained', checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_small.pth')),
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256))

# Parameters whose name contains 'norm' (the blocks' norm1/norm2, the EMSA sr_norm, the output norms norm0-3
# and the BatchNorms `.norm` of the stem and patch embeddings) skip weight decay.
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={'norm': dict(decay_mult=0.)}))
