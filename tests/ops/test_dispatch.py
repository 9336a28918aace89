"""`ops.dispatch.choose`: the one rule that picks an op's implementation."""
import torch
import torch.nn as nn

from mmplugin_l2.models.ops import (CHECKPOINT, INFERENCE, INFERENCE_ONLY, REFERENCE, TRAIN, Fast, Supports,
                                    choose)
from mmplugin_l2.models.ops.export import export_mode
from mmplugin_l2.models.ops.memory import MemoryPolicy


def _layer(fast_train=True, max_elems=4, devices=('cpu',)):
    m = nn.Linear(2, 2)
    m.fast_train = fast_train
    m.memory_policy = MemoryPolicy(max_elems=max_elems, devices=devices)
    return m


def _grad_input():
    return torch.zeros(1, 16, requires_grad=True)


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


def test_train_needs_fast_train_and_pieces_only_on_policy_devices():
    x = _grad_input()
    assert choose(_layer(), x, 16) == (TRAIN, 4)
    assert choose(_layer(devices=('cuda',)), x, 16) == (TRAIN, None)
    assert choose(_layer(fast_train=False), x, 16) == (REFERENCE, None)
    assert choose(_layer(), x, 16, INFERENCE_ONLY) == (REFERENCE, None)
    assert choose(_layer(max_elems=None), x, 16) == (TRAIN, None)


def test_export_and_unsupported_half_take_the_reference():
    m = _layer().eval()
    no_half = Supports(inference=Fast(half=False))
    with torch.no_grad():
        with export_mode():
            assert choose(m, torch.zeros(1, 16), 16) == (REFERENCE, None)
        assert choose(m, torch.zeros(1, 16, dtype=torch.bfloat16), 16, no_half) == (REFERENCE, None)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            assert choose(m, torch.zeros(1, 16), 16, no_half) == (REFERENCE, None)
            assert choose(m, torch.zeros(1, 16), 16) == (INFERENCE, 4)


def test_declared_support_decides_and_checkpoint_is_the_fallback():
    """Dropout, train-mode norms, activations, pieces-only paths and input gradients are read from the op's
    declaration; outside the train path an op that checkpoints gets CHECKPOINT, not the train path."""
    drop, bn, gelu, relu = nn.Dropout(0.1), nn.BatchNorm2d(2), nn.GELU(), nn.ReLU()
    strict = Supports(train=Fast(half=False, dropout=False, act=lambda a: isinstance(a, nn.GELU),
                                 input_grad=True), checkpoint=True)
    m, x = _layer(), _grad_input()
    assert choose(m, x, 16, strict, modules=(drop.eval(),), acts=(gelu,)) == (TRAIN, 4)
    assert choose(m, x, 16, strict, modules=(drop.train(),), acts=(gelu,)) == (CHECKPOINT, None)
    assert choose(m, x, 16, strict, acts=(relu,)) == (CHECKPOINT, None)
    assert choose(m, x.half(), 16, strict) == (CHECKPOINT, None)                 # half precision
    assert choose(m, x.detach(), 16, strict) == (REFERENCE, None)                # nothing to checkpoint for
    assert choose(m, x.detach(), 16, Supports(train=Fast(input_grad=True))) == (REFERENCE, None)
    norms = Supports(inference=Fast(train_norm=False))
    m.eval()
    with torch.no_grad():
        assert choose(m, x, 16, norms, modules=(bn.eval(),)) == (INFERENCE, 4)
        assert choose(m, x, 16, norms, modules=(bn.train(),)) == (REFERENCE, None)
        pieces_only = Supports(inference=Fast(pieces_only=True))
        assert choose(m, x, 16, pieces_only) == (INFERENCE, 4)
        assert choose(m, x, 8, pieces_only) == (REFERENCE, None)
