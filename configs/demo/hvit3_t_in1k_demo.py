# configs/mmpretrain/hvit3_t_in1k.py on the synthetic ImageNet-format data of
# `python tools/make_demo_data.py` (5 shape classes, 64x64 crops): only data paths, image scale, class count
# and schedule differ. Trained from scratch.
_base_ = '../mmpretrain/hvit3_t_in1k.py'

data_root = 'data/demo/imagenet'
metainfo = dict(classes=('circle', 'rectangle', 'triangle', 'cross', 'star'))

model = dict(backbone=dict(drop_path_rate=0.), head=dict(num_classes=5),
             train_cfg=dict(augments=None))
data_preprocessor = dict(num_classes=5)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=64, crop_ratio_range=(0.5, 1.0), backend='pillow'),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=73, edge='short', backend='pillow'),
    dict(type='CenterCrop', crop_size=64),
    dict(type='PackInputs'),
]
train_dataloader = dict(
    batch_size=16, num_workers=0, persistent_workers=False,
    dataset=dict(type='ImageNet', data_root=data_root, split='train', metainfo=metainfo,
                 pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=16, num_workers=0, persistent_workers=False,
    dataset=dict(type='ImageNet', data_root=data_root, split='val', metainfo=metainfo,
                 pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator

max_epochs = 10
train_cfg = dict(max_epochs=max_epochs, val_interval=max_epochs)
auto_scale_lr = dict(enable=False)
optim_wrapper = dict(optimizer=dict(lr=1e-3))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=20),
    dict(type='CosineAnnealingLR', eta_min_ratio=1e-2, by_epoch=True, begin=0, end=max_epochs),
]
# exact --resume: random states and data position in every checkpoint (docs/reliability.md)
custom_hooks = [dict(type='ExactResumeHook')]
default_hooks = dict(logger=dict(interval=10), checkpoint=dict(interval=max_epochs))
