# L2ViT-S on ImageNet-1k: the T recipe with the small arch and drop path 0.3 (paper Table 9).
_base_ = './l2vit_t_in1k.py'

model = dict(backbone=dict(arch='small', drop_path_rate=0.3))
