# L2ViT-T on ImageNet-1k from scratch: the authors' recipe (ChuanyangZheng/L2ViT, ConvNeXt-style trainer
# classification/main.py + readme command + paper Table 9); see docs/l2vit.md (Recipes).
# The S/B configs inherit this file.
_base_ = './_base_/imagenet_adamw_300e.py'  # Swin-T classifier, timm-style data, AdamW, 300 epochs

# ---- model ----------------------------------------------------------------------------------------
# The authors' classifier: LayerNorm over the last stage's tokens -> mean over tokens -> Linear. Here the
# last stage's output LayerNorm `norm3` (final_norm=True: their `norm.*` loads into it) -> global average
# pooling -> linear head (their `head.*` = head.fc.*; tools/convert_checkpoint.py --target mmpretrain).
# Inherited: LabelSmoothLoss 0.1 (with Mixup's soft targets, as timm's SoftTargetCrossEntropy on smoothed
# mixup targets), Mixup alpha 0.8 / CutMix alpha 1.0 (one of the two per batch, timm's switch prob 0.5),
# TruncNormal(0.02) Linear / Constant LayerNorm init.
model = dict(
    backbone=dict(
        _delete_=True,
        type='L2ViT',
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(3, ),
        final_norm=True),
    head=dict(in_channels=768))

# ---- data -----------------------------------------------------------------------------------------
# Inherited train pipeline: RandomResizedCrop 224 bicubic, flip, RandAugment (timm 'rand-m9-mstd0.5-inc1'),
# RandomErasing 0.25 (per-pixel random fill, one box). timm ignores color-jitter 0.4 when RandAugment is on,
# so none is added. Eval: resize short side 256 bicubic (crop_pct 0.875) + center crop 224.
# 128 images per GPU x 8 GPUs x 4 accumulated steps = 4096, the authors' total batch (--update_freq 4).
train_dataloader = dict(batch_size=128)
val_dataloader = dict(batch_size=128)
test_dataloader = val_dataloader

# ---- schedule -------------------------------------------------------------------------------------
# AdamW lr 4e-3 for the total batch of 4096, absolute (the authors do not scale it; auto_scale_lr stays
# off: it would count 8 x 128 and ignore the accumulation). wd 0.05 held constant, none on 1-D parameters
# and biases (norms, biases); the 3-D linear attention temperatures are decayed. No gradient clipping, fp32.
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(lr=4e-3),
    accumulative_counts=4,
    clip_grad=None)
auto_scale_lr = dict(enable=False, base_batch_size=4096)

# Per-iteration linear warm-up over 20 epochs from ~0 (the authors start at exactly 0; mmengine's chained
# LinearLR needs a positive start), then cosine to min_lr 1e-6 at epoch 300.
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=True, begin=0, end=20, convert_to_iter_based=True),
    dict(type='CosineAnnealingLR', eta_min=1e-6, by_epoch=True, begin=20, end=300,
         convert_to_iter_based=True),
]

# ---- runtime --------------------------------------------------------------------------------------
# Model EMA 0.9999 per optimizer step (timm ModelEma: buffers averaged too), evaluated next to the model;
# the released "best-ema" files are saved when the EMA accuracy peaks. The hook runs every iteration:
# interval = the 4 accumulated iterations of one optimizer step.
custom_hooks = [
    dict(type='EMAHook', momentum=1e-4, interval=4, update_buffers=True, evaluate_on_ema=True,
         evaluate_on_origin=True, priority='ABOVE_NORMAL')
]
