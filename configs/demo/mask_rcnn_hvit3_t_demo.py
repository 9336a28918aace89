# The demo: configs/mmdet/mask_rcnn_hvit3_t_1x.py unchanged but for data paths, image scale and schedule,
# on the synthetic COCO-format data of `python tools/make_demo_data.py` (3 shape classes, 128x128 images).
# Trained from scratch (no ImageNet weights are available offline). Run it with `bash tools/demo.sh`.
_base_ = '../mmdet/mask_rcnn_hvit3_t_1x.py'

data_root = 'data/demo/coco/'
metainfo = dict(classes=('circle', 'rectangle', 'triangle'))
img_scale = (128, 128)

model = dict(
    backbone=dict(init_cfg=None, with_cp=False, drop_path_rate=0.),
    roi_head=dict(bbox_head=dict(num_classes=3), mask_head=dict(num_classes=3)),
    # CPU budget: 64 sampled RoIs per image instead of 512 (a 128x128 image holds <= 4 objects); the
    # mask head and mmcv's CPU RoIAlign backward otherwise dominate the step time.
    train_cfg=dict(rpn_proposal=dict(max_per_img=300), rcnn=dict(sampler=dict(num=64))))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=img_scale, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=4, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo, ann_file='annotations/instances_train2017.json',
                 data_prefix=dict(img='train2017/'), pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=4, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo, ann_file='annotations/instances_val2017.json',
                 data_prefix=dict(img='val2017/'), pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val2017.json')
test_evaluator = val_evaluator

# schedule: a few epochs of 50 iterations, short warm-up, fp32 on CPU
max_epochs = 4
train_cfg = dict(max_epochs=max_epochs, val_interval=max_epochs)
# fp32 OptimWrapper instead of the full config's AmpOptimWrapper, so that the stock tools (mmdet/mmseg
# tools/train.py, `mim train`) run the demo on a CPU with no extra flag; on a GPU pass --amp for AMP.
optim_wrapper = dict(type='OptimWrapper', optimizer=dict(lr=4e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[3], gamma=0.1),
]
default_hooks = dict(logger=dict(interval=10), checkpoint=dict(interval=max_epochs))
# exact --resume: random states and data position in every checkpoint (docs/reliability.md)
custom_hooks = [dict(type='ExactResumeHook')]
