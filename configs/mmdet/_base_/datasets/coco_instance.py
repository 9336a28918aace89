# mmdet's COCO 2017 instance-segmentation data (boxes + masks) with its root settable once:
# MMPLUGIN_L2_COCO=/path/to/coco (default data/coco; docs/get_started.md, "Data layout").
_base_ = 'mmdet::_base_/datasets/coco_instance.py'

data_root = '{{$MMPLUGIN_L2_COCO:data/coco}}/'
train_dataloader = dict(dataset=dict(data_root=data_root))
val_dataloader = dict(dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file='{{$MMPLUGIN_L2_COCO:data/coco}}/annotations/instances_val2017.json')
test_evaluator = val_evaluator
