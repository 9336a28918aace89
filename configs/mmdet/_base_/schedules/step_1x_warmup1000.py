# mmdet's 1x step schedule (12 epochs, lr x 0.1 at epochs 8 and 11) with a linear warm-up over 1000 iterations
# from 0.001 x lr (detectron2's default; mmdet's own is 500). The H-ViT3 Mask R-CNN and the ResT detection
# configs train on it; their 3x configs override max_epochs, train_cfg and param_scheduler.
_base_ = 'mmdet::_base_/schedules/schedule_1x.py'

max_epochs = 12
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[8, 11], gamma=0.1),
]
