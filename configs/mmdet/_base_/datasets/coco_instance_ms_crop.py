# COCO instance segmentation (coco_instance.py) trained with the multi-scale + crop augmentation (ms_crop.py).
_base_ = ['./coco_instance.py', './ms_crop.py']

train_pipeline = [
    dict(type='LoadImageFromFile', backend_args={{_base_.backend_args}}),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='RandomFlip', prob=0.5),
    {{_base_._ms_crop}},
    dict(type='PackDetInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
