# What the ImageNet-1k configs share: mmpretrain's Swin-T classifier (label smoothing 0.1, Mixup alpha 0.8 /
# CutMix alpha 1.0, one of the two per batch as timm's switch prob 0.5), a global-average-pooling neck and a
# linear 1000-class head; the timm-style ImageNet pipelines; AdamW (wd 0.05, eps 1e-8) with no weight decay on
# norms, biases and other 1-D parameters, 300 epochs, validation every epoch; full batches only. Each family's
# T config sets the backbone, the head's input width, lr, batch, clipping, the lr curve and EMA.
_base_ = [
    'mmpretrain::_base_/models/swin_transformer/tiny_224.py',
    './datasets/imagenet.py',
    'mmpretrain::_base_/schedules/imagenet_bs1024_adamw_swin.py',
    'mmpretrain::_base_/default_runtime.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

model = dict(neck=dict(type='GlobalAveragePooling'), head=dict(type='LinearClsHead', num_classes=1000))
train_dataloader = dict(drop_last=True)
optim_wrapper = dict(
    optimizer=dict(type='AdamW', weight_decay=0.05, eps=1e-8, betas=(0.9, 0.999)),
    paramwise_cfg=dict(_delete_=True, norm_decay_mult=0.0, bias_decay_mult=0.0, flat_decay_mult=0.0))
train_cfg = dict(by_epoch=True, max_epochs=300, val_interval=1)
