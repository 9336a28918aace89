# The ResT authors' detectron2 solver in mmdet terms (Mask R-CNN and RetinaNet alike): AdamW lr 1e-4, wd 0.05,
# no weight decay on norm parameters (detectron2 WEIGHT_DECAY_NORM=0; LN, BN). Biases keep wd 0.05 as in
# current detectron2 (older detectron2 versions used 1e-4: bias_decay_mult=0.002). fp32, as the authors
# (detectron2 leaves AMP off). 90k iterations at batch 16 = 12.3 epochs; steps at 60k / 80k = epochs 8.2 / 10.9;
# linear warm-up over 1000 iterations from 0.001 (step_1x_warmup1000.py). For the exact iteration schedule use
# an IterBasedTrainLoop(max_iters=90000) with milestones [60000, 80000]. 16 images per iteration: 8 GPUs x 2.
_base_ = './step_1x_warmup1000.py'

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.))
auto_scale_lr = dict(enable=False, base_batch_size=16)
