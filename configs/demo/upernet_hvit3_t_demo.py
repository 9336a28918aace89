# configs/mmseg/upernet_hvit3_t_512x512_160k_ade20k.py on the synthetic ADE20K-format data of
# `python tools/make_demo_data.py` (3 shape classes + background, 128x128 images): only data paths,
# image scale, schedule and the single-process BN override differ. Trained from scratch.
_base_ = '../mmseg/upernet_hvit3_t_512x512_160k_ade20k.py'

data_root = 'data/demo/ade/ADEChallengeData2016'
metainfo = dict(classes=('circle', 'rectangle', 'triangle'),
                palette=[[220, 20, 60], [0, 128, 255], [255, 200, 0]])  # declared for mmseg's browse_dataset
crop_size = (128, 128)

model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(init_cfg=None, drop_path_rate=0.),
    decode_head=dict(num_classes=3, norm_cfg=dict(type='BN', requires_grad=True)),
    auxiliary_head=dict(num_classes=3, norm_cfg=dict(type='BN', requires_grad=True)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomResize', scale=(256, 128), ratio_range=(0.75, 1.25), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size, cat_max_ratio=0.75),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(256, 128), keep_ratio=True),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
_dataset = dict(type='BaseSegDataset', data_root=data_root, metainfo=metainfo, img_suffix='.jpg',
                seg_map_suffix='.png', reduce_zero_label=True)
train_dataloader = dict(
    batch_size=4, num_workers=0, persistent_workers=False,
    dataset=dict(_dataset, data_prefix=dict(img_path='images/training', seg_map_path='annotations/training'),
                 pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(_dataset, data_prefix=dict(img_path='images/validation',
                                            seg_map_path='annotations/validation'),
                 pipeline=test_pipeline))
test_dataloader = val_dataloader

max_iters = 400
# fp32 OptimWrapper instead of the full config's AmpOptimWrapper, so that the stock tools (mmdet/mmseg
# tools/train.py, `mim train`) run the demo on a CPU with no extra flag; on a GPU pass --amp for AMP.
optim_wrapper = dict(type='OptimWrapper', optimizer=dict(lr=2e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=20),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=20, end=max_iters, by_epoch=False),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
default_hooks = dict(logger=dict(interval=20), checkpoint=dict(interval=max_iters))
# exact --resume: random states and data position in every checkpoint (docs/reliability.md)
custom_hooks = [dict(type='ExactResumeHook')]
