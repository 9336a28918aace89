# Mask R-CNN FPN, H-ViT3-T, 3x (36 epochs): the T-1x config (same multi-scale + crop pipeline, AdamW,
# AMP) with drop path 0.3 and the 3x step schedule. The S/B 3x configs inherit this file.
_base_ = './mask_rcnn_hvit3_t_1x.py'

model = dict(backbone=dict(drop_path_rate=0.3))

max_epochs = 36
train_cfg = dict(max_epochs=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[27, 33], gamma=0.1),
]
