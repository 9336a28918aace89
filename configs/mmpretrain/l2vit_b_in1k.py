# L2ViT-B on ImageNet-1k: the T recipe with the base arch (1024-d last stage). Drop path 0.3 as the authors'
# readme training command for L2ViT_Base (`--drop_path 0.3`); the paper's Table 9 says 0.4 (code wins).
_base_ = './l2vit_t_in1k.py'

model = dict(backbone=dict(arch='base', drop_path_rate=0.3), head=dict(in_channels=1024))
