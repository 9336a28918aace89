# ViT3-B on ImageNet-1k: the ViT3-T recipe with the base arch and drop path 0.4.
_base_ = './vit3_t_in1k.py'

model = dict(backbone=dict(arch='base', drop_path_rate=0.4), head=dict(in_channels=768))
