# ResT-Lite on ImageNet-1k: the Small recipe with the lite arch and drop path 0.1.
# Paper (Tab. 2): 77.2 top-1, 10.49 M parameters (10,508,300 measured).
_base_ = './rest_s_in1k.py'

model = dict(backbone=dict(arch='lite', drop_path_rate=0.1), head=dict(in_channels=512))
