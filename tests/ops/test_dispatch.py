"""`ops.dispatch.choose`: the one rule that picks an op's implementation."""
import contextlib

import pytest
import torch
import torch.nn as nn

from mmplugin_l2.models.layers import EMSA, LinearAttention, TTTAttention, WindowAttention
from mmplugin_l2.models.ops import dispatch
from mmplugin_l2.models.ops.memory import set_memory_policy
from mmplugin_l2.models.ops import (CHECKPOINT, COMPILED, INFERENCE, INFERENCE_ONLY, REFERENCE, TRAIN, Fast, Supports,
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
    no_half = Supports(inference=Fast(half=False, autocast=False))
    with torch.no_grad():
        with export_mode():
            assert choose(m, torch.zeros(1, 16), 16) == (REFERENCE, None)
        assert choose(m, torch.zeros(1, 16, dtype=torch.bfloat16), 16, no_half) == (REFERENCE, None)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            assert choose(m, torch.zeros(1, 16), 16, no_half) == (REFERENCE, None)
            assert choose(m, torch.zeros(1, 16), 16) == (INFERENCE, 4)
            assert choose(m, torch.zeros(1, 16), 16, Supports(inference=Fast(half=False))) == (INFERENCE, 4)
            assert choose(m, torch.zeros(1, 16), 16, Supports(inference=Fast(autocast=False))) == (REFERENCE, None)


def test_declared_support_decides_and_checkpoint_is_the_fallback():
    """Dropout, train-mode norms, activations, pieces-only paths and input gradients are read from the op's
    declaration; outside the train path an op that checkpoints gets CHECKPOINT, not the train path."""
    drop, bn, gelu, relu = nn.Dropout(0.1), nn.BatchNorm2d(2), nn.GELU(), nn.ReLU()
    strict = Supports(train=Fast(half=False, autocast=False, dropout=False, act=lambda a: isinstance(a, nn.GELU),
                                 input_grad=True), checkpoint=True)
    m, x = _layer(), _grad_input()
    assert choose(m, x, 16, strict, modules=(drop.eval(),), acts=(gelu,)) == (TRAIN, 4)
    assert choose(m, x, 16, strict, modules=(drop.train(),), acts=(gelu,)) == (CHECKPOINT, None)
    assert choose(m, x, 16, strict, acts=(relu,)) == (CHECKPOINT, None)
    assert choose(m, x.half(), 16, strict) == (CHECKPOINT, None)                 # half precision
    assert choose(m, x.detach(), 16, strict) == (CHECKPOINT, None)               # no input gradient
    assert choose(m, x.detach(), 16, Supports(train=Fast(input_grad=True))) == (REFERENCE, None)
    norms = Supports(inference=Fast(train_norm=False))
    m.eval()
    with torch.no_grad():
        assert choose(m, x, 16, norms, modules=(bn.eval(),)) == (INFERENCE, 4)
        assert choose(m, x, 16, norms, modules=(bn.train(),)) == (REFERENCE, None)
        cpu_fp32_cl = Supports(inference=Fast(devices=('cpu',), dtypes=(torch.float32,), channels_last=True))
        cl = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
        assert choose(m, cl, 16, cpu_fp32_cl) == (INFERENCE, 4)
        assert choose(m, cl.contiguous(), 16, cpu_fp32_cl) == (REFERENCE, None)
        assert choose(m, cl.double(), 16, cpu_fp32_cl) == (REFERENCE, None)
        assert choose(m, cl, 16, cpu_fp32_cl._replace(inference=Fast(devices=('cuda',)))) == (REFERENCE, None)
        pieces_only = Supports(inference=Fast(pieces_only=True))
        assert choose(m, x, 16, pieces_only) == (INFERENCE, 4)
        assert choose(m, x, 8, pieces_only) == (REFERENCE, None)



def test_recomputed_regions_do_not_nest():
    """Inside a recomputed region (`checkpointed`: a block under `with_cp`), in its forward and in its
    recomputation, an op that would checkpoint gets the reference and a nested `checkpointed` runs plainly: the
    inner function runs twice per step (forward, the region's recomputation), not three times; a train path
    still applies there, and the compiled reference where the op declares it and the module's `fast_compile` is
    on; the count is back to zero afterwards, also after an exception."""
    from mmplugin_l2.models.ops.checkpoint import checkpointed
    ckpt = Supports(train=Fast(input_grad=True), checkpoint=True)
    m, x = _layer(), _grad_input()
    assert choose(m, x.detach(), 16, ckpt) == (CHECKPOINT, None) and not dispatch.recomputing()
    seen, calls = [], []

    def inner(t):
        calls.append(torch.is_grad_enabled())
        return t * t

    def outer(t):
        seen.append((choose(m, t.detach(), 16, ckpt), choose(m, t, 16, ckpt), dispatch.recomputing()))
        return checkpointed(inner, t).sin()
    y = checkpointed(outer, x)
    y.sum().backward()
    assert seen == [((REFERENCE, None), (TRAIN, 4), True)] * 2     # its forward, its recomputation
    assert len(calls) == 2 and not dispatch.recomputing()
    assert torch.equal(x.grad, torch.cos(x.detach() ** 2) * 2 * x.detach())
    compiled = ckpt._replace(compiled=Fast(compute_dtypes=(torch.bfloat16,)))
    m.fast_compile, got = True, []
    with dispatch.recomputed_region(), torch.autocast('cpu', torch.bfloat16):
        got.append(choose(m, x.detach(), 16, compiled))
        m.fast_compile = False
        got.append(choose(m, x.detach(), 16, compiled))
    with dispatch.recomputed_region():
        m.fast_compile = True
        got.append(choose(m, x.detach(), 16, compiled))           # fp32: not declared there
    with torch.autocast('cpu', torch.bfloat16):
        got.append(choose(m, x.detach(), 16, compiled))           # outside a recomputed region too (it recomputes)
        m.fast_compile = False
        got.append(choose(m, x.detach(), 16, compiled))           # switched off there: its checkpoint
    assert got == [(COMPILED, None), (REFERENCE, None), (REFERENCE, None), (COMPILED, None), (CHECKPOINT, None)]
    # a list of device types replaces the declared devices: ('cuda',) is off on the CPU, ('cpu', 'cuda') on
    cpu_only = ckpt._replace(compiled=Fast(compute_dtypes=(torch.bfloat16,), devices=('cpu',)))
    got = []
    with dispatch.recomputed_region(), torch.autocast('cpu', torch.bfloat16):
        for switch in (('cuda',), ('cpu', 'cuda'), True):
            m.fast_compile = switch
            got.append(choose(m, x.detach(), 16, cpu_only))
        m.fast_compile = True
        got.append(choose(m, x.detach(), 16, ckpt._replace(compiled=Fast(devices=('cuda',)))))
    assert got == [(REFERENCE, None), (COMPILED, None), (COMPILED, None), (REFERENCE, None)]
    with pytest.raises(ZeroDivisionError):
        checkpointed(lambda t: 1 / 0, x)
    assert not dispatch.recomputing()
    calls.clear()
    checkpointed(inner, x).sum().backward()      # not nested: recomputed in backward
    assert len(calls) == 2

def test_half_inputs_under_autocast_only_and_half_pieces():
    """`Fast(half='autocast')` takes half inputs under autocast (fp32 parameters) but not half inputs outside it (half
    weights); `half_pieces=False` gives whole maps wherever the path computes in half precision, pieces elsewhere."""
    m, x = _layer(), _grad_input()
    autocast_only = Supports(train=Fast(half='autocast'), checkpoint=True)
    assert choose(m, x.half(), 16, autocast_only) == (CHECKPOINT, None)
    assert choose(m, x, 16, autocast_only) == (TRAIN, 4)
    whole_in_half = Supports(train=Fast(half_pieces=False))
    assert choose(m, x.bfloat16(), 16, whole_in_half) == (TRAIN, None)
    assert choose(m, x, 16, whole_in_half) == (TRAIN, 4)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast('cpu', dtype=dtype):
            assert choose(m, x.to(dtype), 16, autocast_only) == (TRAIN, 4)
            assert choose(m, x, 16, whole_in_half) == (TRAIN, None)
            assert choose(m, x.to(dtype), 16, whole_in_half) == (TRAIN, None)


def test_half_recomputed():
    """`half_recomputed=False`: where the path computes in half precision it does not run inside a recomputed region
    (the reference there, which the region's recomputation keeps only while its backward runs); in fp32 there, and
    in half precision outside one, it does; the region does not checkpoint again."""
    m, x = _layer(), _grad_input()
    outside = Supports(train=Fast(half='autocast', half_pieces=False, half_recomputed=False), checkpoint=True)
    got = []
    for region in (contextlib.nullcontext, dispatch.recomputed_region):
        with region():
            got.append(choose(m, x, 16, outside))
            for dtype in (torch.bfloat16, torch.float16):
                with torch.autocast('cpu', dtype=dtype):
                    got += [choose(m, x, 16, outside), choose(m, x.to(dtype), 16, outside)]
    assert got == [(TRAIN, 4)] + [(TRAIN, None)] * 4 + [(TRAIN, 4)] + [(REFERENCE, None)] * 4, got
    with dispatch.recomputed_region():
        assert choose(m, x, 16, Supports(train=Fast(half='autocast'))) == (TRAIN, 4)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            assert choose(m, x, 16, Supports(train=Fast(half='autocast'))) == (TRAIN, 4)


@contextlib.contextmanager
def _pieces_given():
    """The pieces `choose` gave while inside (every layer's one dispatch)."""
    given, saved = [], dispatch._policy_piece
    dispatch._policy_piece = lambda *a: given.append(saved(*a)) or given[-1]
    try:
        yield given
    finally:
        dispatch._policy_piece = saved


_LAYERS = {  # a layer and its forward on a (B, 8 x 6, C) float64 map
    'ttt': (lambda: TTTAttention(8, 2), lambda m, x: m(x, (8, 6))),
    'emsa': (lambda: EMSA(8, 2, 2, qkv_bias=True), lambda m, x: m(x, (8, 6))),
    'linear_attention': (lambda: LinearAttention(8, 2), lambda m, x: m(x)),
    'window_attention': (lambda: WindowAttention(8, 2, 4), lambda m, x: m(x, (8, 6))),
}


@pytest.mark.parametrize('name', sorted(_LAYERS))
@pytest.mark.parametrize('training', [False, True])
def test_layers_take_pieces_only_on_the_policys_devices(name, training):
    """Every layer hands its memory policy to `choose`: pieces for a CPU map on devices=('cpu',), whole maps
    with devices=('cuda',) (as a CUDA map by default), the same values as whole maps either way."""
    build, forward = _LAYERS[name]
    torch.manual_seed(0)
    whole = build().double().train(training)
    set_memory_policy(whole, None)
    x = torch.randn(2, 48, 8, dtype=torch.float64, requires_grad=training)
    with torch.set_grad_enabled(training):
        ref = forward(whole, x)
        for devices, pieces in ((('cpu',), True), (('cuda',), False)):
            m = build().double().train(training)
            m.load_state_dict(whole.state_dict())
            set_memory_policy(m, MemoryPolicy(max_elems=16, devices=devices))
            with _pieces_given() as given:
                out = forward(m, x)
            if training and name == 'window_attention':      # no train path: never asks for pieces
                pieces = False
            assert any(p is not None for p in given) == pieces, (devices, given)
            torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('value', [None, 'cuda', [], ['gpu'], [1], ('cpu', 'cuda:0')])
def test_fast_compile_switch_rejects_what_is_not_a_bool_or_device_types(value):
    """`fast_compile`: True, False or device types (kept as a tuple); anything else raises, naming the layer, the
    value and what is allowed."""
    from mmplugin_l2.models.layers import TTTAttention
    from mmplugin_l2.models.ops.dispatch import fast_compile_switch
    assert fast_compile_switch(['cpu', 'cuda'], 'x') == ('cpu', 'cuda') and fast_compile_switch(False, 'x') is False
    with pytest.raises(ValueError, match=r"TTTAttention: fast_compile=.*allowed: True .*False, or a list of device "
                                         r"types such as \['cpu', 'cuda'\]"):
        TTTAttention(8, 2, fast_compile=value)


def test_torch_compile_traces_the_declared_paths_on_whole_maps(monkeypatch):
    """While torch.compile traces a model in training (`export.compiling`), an op gets the first of its `traced`
    paths that applies, on whole maps (no memory-policy pieces: sizes are symbolic): the compiled form where the
    module's `fast_compile` is on (whatever devices the compiled `Fast` names: the enclosing compile compiles it),
    the train path where its `Fast` takes the input, the checkpoint; paths it does not declare traced, and every
    path in export (ONNX, torch.export) or inference, give the reference."""
    all_paths = (COMPILED, TRAIN, CHECKPOINT)
    ops = Supports(train=Fast(input_grad=True), checkpoint=True, compiled=Fast(devices=('cuda',)), traced=all_paths)
    m, x = _layer(), _grad_input()
    assert choose(m, x, 16, ops) == (TRAIN, 4)                       # eager: the train path in pieces
    monkeypatch.setattr(dispatch, 'compiling', lambda: True)
    monkeypatch.setattr(dispatch, 'exporting', lambda: True)        # tracing is also exporting
    m.fast_compile = True
    assert choose(m, x, 16, ops) == (COMPILED, None)
    m.fast_compile = False
    assert choose(m, x, 16, ops) == (TRAIN, None)
    assert choose(m, x.detach(), 16, ops) == (CHECKPOINT, None)   # the train Fast needs an input gradient
    assert choose(m, x, 16, ops._replace(traced=(CHECKPOINT,))) == (CHECKPOINT, None)
    assert choose(m, x, 16, ops._replace(traced=())) == (REFERENCE, None)
    assert choose(m, x, 16, ops._replace(train=Fast(pieces_only=True), traced=(TRAIN,))) == (REFERENCE, None)
    assert choose(_layer(fast_train=False), x, 16, ops) == (REFERENCE, None)
    m.eval()
    with torch.no_grad():
        assert choose(m, x, 16, ops) == (REFERENCE, None)          # compiled inference: the reference
    monkeypatch.setattr(dispatch, 'compiling', lambda: False)      # exported (ONNX, torch.export)
    m.train()
    assert choose(m, x, 16, ops) == (REFERENCE, None)
