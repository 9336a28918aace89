# ResT-Large on ImageNet-1k: the Small recipe with the large arch and drop path 0.3.
# Paper (Tab. 2): 83.6 top-1, 51.63 M parameters (51,676,156 measured).
_base_ = './rest_s_in1k.py'

model = dict(backbone=dict(arch='large', drop_path_rate=0.3), head=dict(in_channels=768))
