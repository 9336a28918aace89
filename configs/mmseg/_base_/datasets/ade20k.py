# mmseg's ADE20K (150 classes) with its root settable once: MMPLUGIN_L2_ADE=/path/to/ADEChallengeData2016
# (default data/ade/ADEChallengeData2016; docs/get_started.md, "Data layout").
_base_ = 'mmseg::_base_/datasets/ade20k.py'

data_root = '{{$MMPLUGIN_L2_ADE:data/ade/ADEChallengeData2016}}'
train_dataloader = dict(dataset=dict(data_root=data_root))
val_dataloader = dict(dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
