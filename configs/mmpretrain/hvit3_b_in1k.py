# H-ViT3-B on ImageNet-1k: the T recipe with the base arch (640-d last stage) and drop path 0.6.
_base_ = './hvit3_t_in1k.py'

model = dict(backbone=dict(arch='base', drop_path_rate=0.6), head=dict(in_channels=640))
