# What the ResT detection configs share, Mask R-CNN (mask_rcnn_rest_s_1x.py) and RetinaNet (retinanet_rest_s_1x.py)
# alike: the authors' detectron2 solver (rest_adamw_1x.py), mmdet's runtime, the plugin import, and the pixel
# normalisation and ResT-Small backbone as `_rest_data_preprocessor` / `_rest_backbone`. A config puts the last two
# into its detector in place of mmdet's ResNet-50:
#     model = dict(data_preprocessor=_base_._rest_data_preprocessor,
#                  backbone=dict(_base_._rest_backbone, _delete_=True, ...))
_base_ = [
    './schedules/rest_adamw_1x.py',  # AdamW 1e-4, no decay on norms, 1x steps, warm-up 1000, fp32
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

# Pixel normalisation: the ImageNet RGB mean/std the pretrained weights were trained with. The authors' v1 yamls set
# none and so ran detectron2's default (BGR input, mean [103.53, 116.28, 123.675], std [1, 1, 1]), which the author
# later called "a mistake" (ResTv2 retinanet yaml). Their v1 numbers were most likely produced that way; to
# replicate it, set mean=[103.53, 116.28, 123.675], std=[1., 1., 1.], bgr_to_rgb=False. Padding to 32 as the
# detectron2 FPN.
_rest_data_preprocessor = dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                               pad_size_divisor=32)
_rest_backbone = dict(
    type='ResT',
    arch='small',
    drop_path_rate=0.1,  # the authors' detection value (0.1 lite/small, 0.2 base/large)
    out_indices=(0, 1, 2, 3),
    # As the authors: nothing frozen, BatchNorms (stem, patch embeddings) train in train mode.
    frozen_stages=-1,
    norm_eval=False,
    # Output LayerNorms on the side branch (the paper, mmdet): all stages see the pretrained features.
    # norm_in_path=True puts them in the main path as the authors' detectron2 backbone does.
    norm_in_path=False,
    with_cp=False,  # the attention maps are already chunked with recomputation (attn_chunk_elems)
    # The authors' ImageNet checkpoint ({'model': ...}), converted on load (`norm` -> norm3, head dropped).
    init_cfg=dict(type='Pretrained', checkpoint='{{$MMPLUGIN_L2_PRETRAINED:data/pretrained}}/rest_small.pth'))
