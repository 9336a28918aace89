# ResT-Base on ImageNet-1k: the Small recipe with the base arch and drop path 0.2.
# Paper (Tab. 2): 81.6 top-1, 30.28 M parameters (30,327,052 measured).
_base_ = './rest_s_in1k.py'

model = dict(backbone=dict(arch='base', drop_path_rate=0.2), head=dict(in_channels=768))
