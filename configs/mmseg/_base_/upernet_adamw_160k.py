# What the UperNet ADE20K configs share: mmseg's Swin UperNet model, ADE20K at 512x512 crops, 150 classes,
# AdamW lr 6e-5 / wd 0.01 (no gradient clipping), a linear warm-up over 1500 iterations from 1e-6 x lr then
# poly (power 1) to 0 at 160k iterations, 2 images per GPU (8 GPUs x 2 = 16), batch 1 in validation.
# Each family's T config sets the backbone, the heads' input widths and its optimizer details.
_base_ = [
    'mmseg::_base_/models/upernet_swin.py',
    './datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
]
custom_imports = dict(imports=['mmplugin_l2'], allow_failed_imports=False)

crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    decode_head=dict(num_classes=150),
    auxiliary_head=dict(in_index=2, num_classes=150))

optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01))
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]

train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
