# ViT3-T (plain, 16x16 patches, no class token / position embedding) on ImageNet-1k: the H-ViT3 recipe
# (hvit3_t_in1k.py) with the ViT3 backbone and no model EMA (the authors train ViT3 with main.py).
# The backbone returns the last block through the final LayerNorm; pooling it gives their feature.
_base_ = './hvit3_t_in1k.py'

model = dict(
    backbone=dict(_delete_=True, type='ViT3', arch='tiny', drop_path_rate=0.0, out_indices=(-1, )),
    head=dict(in_channels=192))

custom_hooks = []
