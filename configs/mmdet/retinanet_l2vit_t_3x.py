# RetinaNet FPN, L2ViT-T, 3x (36 epochs): the T-1x config with drop path 0.2 and the 3x step schedule, as the
# authors' retinanet_3x_l2vit_v0_tiny_coco.py. The authors report no 3x results. The S/B 3x configs inherit
# this file.
_base_ = './retinanet_l2vit_t_1x.py'

model = dict(backbone=dict(drop_path_rate=0.2))

max_epochs = 36
train_cfg = dict(max_epochs=max_epochs, val_interval=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[27, 33], gamma=0.1),
]
default_hooks = dict(checkpoint=dict(interval=max_epochs))
