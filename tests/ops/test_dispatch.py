"""`ops.dispatch.choose`: the one rule that picks an op's implementation."""
import torch
import torch.nn as nn

from mmplugin_l2.models.ops import INFERENCE, REFERENCE, TRAIN, choose
from mmplugin_l2.models.ops.export import export_mode
from mmplugin_l2.models.ops.memory import MemoryPolicy


def _layer(recompute=True, max_elems=4, devices=('cpu',)):
    m = nn.Linear(2, 2)
    m.recompute = recompute
    m.memory_policy = MemoryPolicy(max_elems=max_elems, devices=devices)
    return m


def test_inference_needs_eval_and_no_autograd():
    m, x = _layer(), torch.zeros(1, 16)
    m.eval()
    with torch.no_grad():
        assert choose(m, x, 16) == (INFERENCE, 4)
        assert choose(m, x, 8) == (INFERENCE, None)          # up to twice max_elems: whole map
    assert choose(m, x, 16) == (REFERENCE, None)            # eval with autograd (Grad-CAM): reference
    m.train()
    with torch.no_grad():
        assert choose(m, x, 16) == (REFERENCE, None)        # train under no_grad: reference (dropout, BN)


def test_train_needs_recompute_and_pieces_only_on_policy_devices():
    x = torch.zeros(1, 16)
    assert choose(_layer(), x, 16) == (TRAIN, 4)
    assert choose(_layer(devices=('cuda',)), x, 16) == (TRAIN, None)
    assert choose(_layer(recompute=False), x, 16) == (REFERENCE, None)
    assert choose(_layer(), x, 16, train=False) == (REFERENCE, None)
    assert choose(_layer(max_elems=None), x, 16) == (TRAIN, None)


def test_export_and_unsupported_half_take_the_reference():
    m = _layer().eval()
    with torch.no_grad():
        with export_mode():
            assert choose(m, torch.zeros(1, 16), 16) == (REFERENCE, None)
        assert choose(m, torch.zeros(1, 16, dtype=torch.bfloat16), 16, half=False) == (REFERENCE, None)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            assert choose(m, torch.zeros(1, 16), 16, half=False) == (REFERENCE, None)
            assert choose(m, torch.zeros(1, 16), 16) == (INFERENCE, 4)
