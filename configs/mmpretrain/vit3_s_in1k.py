# ViT3-S on ImageNet-1k: the ViT3-T recipe with the small arch and drop path 0.1.
_base_ = './vit3_t_in1k.py'

model = dict(backbone=dict(arch='small', drop_path_rate=0.1), head=dict(in_channels=384))
