# The L2ViT authors' detection recipe (Mask R-CNN and RetinaNet alike; the H-ViT3 RetinaNet configs reuse it):
# AdamW 1e-4, wd 0.05 on every parameter (the authors set no paramwise_cfg: norms, biases and the linear
# attention temperatures are decayed too), no gradient clipping, fp32 (their config: "do not use mmdet
# version fp16"; `tools/train.py --amp` works, the linear attention reduces in fp32). mmdet's 1x steps with
# its 500-iteration warm-up; evaluated and checkpointed at the last epoch only. lr 1e-4 is for a total batch
# of 16 (8 GPUs x 2 assumed, not stated by the authors); pass --auto-scale-lr to rescale it to yours.
_base_ = ['mmdet::_base_/schedules/schedule_1x.py', 'mmdet::_base_/default_runtime.py']

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    clip_grad=None)

max_epochs = 12
train_cfg = dict(max_epochs=max_epochs, val_interval=max_epochs)
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-3, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=max_epochs, by_epoch=True, milestones=[8, 11], gamma=0.1),
]
default_hooks = dict(checkpoint=dict(interval=max_epochs))
auto_scale_lr = dict(enable=False, base_batch_size=16)
