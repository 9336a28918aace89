# mmpretrain's ImageNet-1k with the Swin/timm-style pipelines (RandAugment m9 mstd0.5, random erasing 0.25)
# and its root settable once: MMPLUGIN_L2_IMAGENET=/path/to/imagenet (default data/imagenet;
# docs/get_started.md, "Data layout").
_base_ = 'mmpretrain::_base_/datasets/imagenet_bs64_swin_224.py'

train_dataloader = dict(dataset=dict(data_root='{{$MMPLUGIN_L2_IMAGENET:data/imagenet}}'))
val_dataloader = dict(dataset=dict(data_root='{{$MMPLUGIN_L2_IMAGENET:data/imagenet}}'))
test_dataloader = val_dataloader
