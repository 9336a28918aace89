# H-ViT3-S on ImageNet-1k: the T recipe with the small arch and drop path 0.4.
_base_ = './hvit3_t_in1k.py'

model = dict(backbone=dict(arch='small', drop_path_rate=0.4), head=dict(in_channels=512))
