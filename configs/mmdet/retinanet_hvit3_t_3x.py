# RetinaNet FPN, H-ViT3-T, 3x (36 epochs): the H-ViT3-T RetinaNet 1x config (our settings, see there) with
# the 3x step schedule of L2ViT's RetinaNet 3x config and the drop path of the H-ViT3-T Mask R-CNN 3x config
# (0.3). The S/B 3x configs inherit this file.
_base_ = './retinanet_hvit3_t_1x.py'

model = dict(backbone=dict(drop_path_rate=0.3))

max_epochs = 36
train_cfg = dict(max_epochs=max_epochs, val_interval=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[27, 33], gamma=0.1),
]
default_hooks = dict(checkpoint=dict(interval=max_epochs))
