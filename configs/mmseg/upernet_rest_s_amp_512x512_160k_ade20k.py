# UperNet with a ResT-Small backbone on ADE20K, 512x512 crops, 160k iterations, trained under automatic mixed
# precision: upernet_rest_s_512x512_160k_ade20k.py with mmengine's AmpOptimWrapper (autocast around the forward and a
# dynamic loss scale; fp16 by default, `--cfg-options optim_wrapper.dtype=bfloat16` for bf16), as mmdet's Swin `_amp`
# configs. Everything else is inherited; see docs/mixed_precision.md.
_base_ = './upernet_rest_s_512x512_160k_ade20k.py'

optim_wrapper = dict(type='AmpOptimWrapper', loss_scale='dynamic')
