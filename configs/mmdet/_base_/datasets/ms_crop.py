# The multi-scale + crop ("DETR / Sparse R-CNN") augmentation of the H-ViT3 and L2ViT authors, for 1x as well
# as 3x: either resize the short side to one of 480..800 (step 32, long side <= 1333), or resize to one of
# 400/500/600, crop an absolute 384..600 window and then resize as in the first branch.
# Used by coco_instance_ms_crop.py / coco_detection_ms_crop.py as `{{_base_._ms_crop}}`.
_ms_scales = [(s, 1333) for s in range(480, 801, 32)]
_ms_crop = dict(
    type='RandomChoice',
    transforms=[
        [dict(type='RandomChoiceResize', scales=_ms_scales, keep_ratio=True)],
        [
            dict(type='RandomChoiceResize', scales=[(400, 1333), (500, 1333), (600, 1333)], keep_ratio=True),
            dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600), allow_negative_crop=True),
            dict(type='RandomChoiceResize', scales=_ms_scales, keep_ratio=True),
        ],
    ])
