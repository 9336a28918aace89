# Mask R-CNN FPN, ResT-Small, 3x (36 epochs): the 1x config with the paper's 480-800 multi-scale range
# (the crop stays) and mmdet's 3x steps at epochs 27 and 33. The other sizes' 3x configs inherit this.
_base_ = './mask_rcnn_rest_s_1x.py'

train_pipeline = [
    dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomCrop', crop_type='relative', crop_size=(0.9, 0.9), allow_negative_crop=True,
         recompute_bbox=True),
    dict(type='RandomChoiceResize', scales=[(1333, s) for s in range(480, 801, 32)], keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))

max_epochs = 36
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[27, 33], gamma=0.1),
]
