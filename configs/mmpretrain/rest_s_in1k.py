# ResT-Small on ImageNet-1k from scratch; see docs/rest.md (Recipes). The Lite/Base/Large configs
# inherit this file. Paper (Tab. 2): 79.6 top-1, 13.66 M parameters (13,679,708 measured on their code).
#
# The paper's recipe, DeiT-style: AdamW, 300 epochs, cosine with 5 warm-up epochs, batch 2048 (8 GPUs x 256),
# wd 0.05, gradient clip 5.0, RandAugment + Mixup + CutMix + random erasing, drop path 0.1/0.1/0.2/0.3
# (Lite/S/B/L); test: resize the short side to 256, centre-crop 224. The paper's "initial lr 5e-4" is read
# the DeiT way, 5e-4 per 512 images: 2e-3 at 2048 (our choice; the authors' main.py defaults are v2's).
_base_ = './_base_/imagenet_adamw_300e.py'  # Swin-T classifier, timm-style data, AdamW, 300 epochs

# ---- model ----------------------------------------------------------------------------------------
# Stage 4 through `norm3`, a LayerNorm that takes the authors' final `norm` (convert_state_dict), then global
# average pooling and the linear classifier: the authors' head. Inherited: LabelSmoothLoss 0.1, Mixup alpha
# 0.8 / CutMix alpha 1.0 (one of the two per batch, timm's switch prob 0.5), TruncNormal(0.02) Linear /
# Constant LayerNorm init, as the authors.
model = dict(
    backbone=dict(
        _delete_=True,
        type='ResT',
        arch='small',
        drop_path_rate=0.1,
        out_indices=(3, )),
    head=dict(in_channels=512))

# ---- data -----------------------------------------------------------------------------------------
# Inherited train pipeline: RandomResizedCrop 224 bicubic, flip, RandAugment (timm 'rand-m9-mstd0.5-inc1'),
# RandomErasing 0.25 (per-pixel random fill). Eval: resize short side 256 bicubic + center crop 224 (the
# paper's 0.875 crop; main.py's default crop_pct 1.0 would resize to 224 without a margin).
train_dataloader = dict(batch_size=256)  # 8 GPUs x 256 = 2048, the paper's batch
val_dataloader = dict(batch_size=256)
test_dataloader = val_dataloader

# ---- schedule -------------------------------------------------------------------------------------
# AdamW lr 2e-3 for a total batch of 2048 (5e-4 x 2048 / 512); --auto-scale-lr rescales it linearly for
# another total batch. No weight decay on norms, biases and other 1-D parameters. Gradient-norm clip 5.0.
optim_wrapper = dict(
    optimizer=dict(lr=5e-4 * 2048 / 512),
    clip_grad=dict(max_norm=5.0))
auto_scale_lr = dict(enable=False, base_batch_size=2048)

# Linear warm-up over 5 epochs from 1e-3 x lr, then cosine to 1e-5 (DeiT's min_lr) at epoch 300, per iteration.
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, begin=0, end=5, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-5, by_epoch=True, begin=5, end=300, convert_to_iter_based=True),
]
