# H-ViT3-T on ImageNet-1k from scratch: the authors' recipe (Liyining-ai/ViTTT, vittt/config.py + the
# h_vittt_tiny yaml, Swin-style trainer, main_ema.py); see docs/hvit3.md (Recipes).
# Without MESA: the authors' released H-ViT3 weights are MESA runs (paper: 83.5 top-1 without, 84.0 with).
# The S/B configs and the ViT3 configs inherit this file.
_base_ = './_base_/imagenet_adamw_300e.py'  # Swin-T classifier, timm-style data, AdamW, 300 epochs

# ---- model ----------------------------------------------------------------------------------------
# Last stage through a BatchNorm (the authors' BatchNorm1d over the tokens equals BN2d on the map, and
# convert_state_dict maps their `norm.*` onto `norm3.*`), global average pooling, linear classifier.
# Inherited: LabelSmoothLoss 0.1, Mixup alpha 0.8 / CutMix alpha 1.0 (one of the two per batch, as timm's
# switch prob 0.5), TruncNormal(0.02) Linear / Constant LayerNorm init as the authors.
model = dict(
    backbone=dict(
        _delete_=True,
        type='HViT3',
        arch='tiny',
        drop_path_rate=0.2,
        out_indices=(3, ),
        out_norm_cfg=dict(type='BN')),
    head=dict(in_channels=512))

# ---- data -----------------------------------------------------------------------------------------
# Inherited train pipeline: RandomResizedCrop 224 bicubic, flip, RandAugment (timm 'rand-m9-mstd0.5-inc1'),
# RandomErasing 0.25 (per-pixel random fill). timm ignores color-jitter 0.4 when RandAugment is on, so
# none is added. Eval: resize short side 256 bicubic + center crop 224.
# 128 images per GPU (the authors' default); their README runs 8 GPUs (total 1024), the paper 4096.
train_dataloader = dict(batch_size=128)
val_dataloader = dict(batch_size=128)
test_dataloader = val_dataloader

# ---- schedule -------------------------------------------------------------------------------------
# AdamW lr 5e-4 per 512 images, scaled linearly with the total batch (always on, as the authors' code):
# 8 x 128 = 1024 -> 1e-3; the paper's 4096 -> 4e-3. No weight decay on 1-D parameters (norms, biases);
# the 4-D TTT weights w1/w2/w3 are decayed. Gradient-norm clip 5.0. For fp16 AMP (the authors' --amp)
# pass --amp to tools/train.py.
optim_wrapper = dict(
    optimizer=dict(lr=5e-4),
    clip_grad=dict(max_norm=5.0))
auto_scale_lr = dict(enable=True, base_batch_size=512)

# Linear warm-up over 20 epochs from 5e-7 (= 1e-3 x 5e-4), then cosine to 5e-6 (= 1e-2 x 5e-4) at
# epoch 300, both per iteration; as ratios of the lr they scale with it, like the authors' warm-up and
# minimum lr.
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=True, begin=0, end=20, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min_ratio=1e-2, by_epoch=True, begin=20, end=300,
         convert_to_iter_based=True),
]

# ---- runtime --------------------------------------------------------------------------------------
# Model EMA as the authors' main_ema.py (timm ModelEma, every iteration, buffers averaged too):
# decay 0.9996 ** (total_batch / 4096); set `_total_batch` to your GPUs x 128.
_total_batch = 8 * 128
custom_hooks = [
    dict(type='EMAHook', momentum=1 - 0.9996**(_total_batch / 4096), update_buffers=True,
         evaluate_on_ema=True, evaluate_on_origin=True, priority='ABOVE_NORMAL')
]
randomness = dict(seed=0, diff_rank_seed=True)  # seed 0 + rank, as the authors
