"""H-ViT3 / ViT3 backbones: shapes, freezing, checkpointing, registries, weights (the TTT layer, its inner
gradients and RoPE: tests/ops/test_ttt.py, tests/ops/test_rope.py)."""

import functools

import pytest
import torch

from conftest import (assert_pyramid_shapes, assert_same_grads, assert_with_cp_matches,
                      assert_with_cp_recomputes_chains, TINY_HVIT3, TINY_VIT3)
from mmplugin_l2 import HViT3, ViT3


def n_params(m):
    return sum(p.numel() for p in m.parameters())


# ---------------------------------------------------------------- shapes
@pytest.mark.parametrize('size', [(64, 64), (63, 97), (250, 333), (33, 31), (8, 8)])
def test_shapes_and_strides(size):
    m = HViT3(arch=TINY_HVIT3).eval()
    with torch.no_grad():
        outs = m(torch.randn(2, 3, *size))
    assert_pyramid_shapes(outs, size, TINY_HVIT3['embed_dims'])


def test_real_tiny_width_shapes_at_odd_size():
    m = HViT3('tiny').eval()
    with torch.no_grad():
        outs = m(torch.randn(1, 3, 250, 333))
    assert [tuple(o.shape[1:]) for o in outs] == [(64, 63, 84), (128, 32, 42), (320, 16, 21), (512, 8, 11)]


def test_out_indices_and_out_channels():
    m = HViT3(arch=TINY_HVIT3, out_indices=(1, 3)).eval()
    outs = m(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [32, 64] == m.out_channels
    assert hasattr(m, 'norm1') and hasattr(m, 'norm3') and not hasattr(m, 'norm0')


def test_vit3_shapes_any_size():
    m = ViT3(arch=TINY_VIT3, out_indices=(0, 1)).eval()
    outs = m(torch.randn(2, 3, 50, 70))
    assert [tuple(o.shape) for o in outs] == [(2, 32, 4, 5), (2, 32, 4, 5)]


# ---------------------------------------------------------------- parameter counts
@pytest.mark.parametrize('arch,expected', [('tiny', 28_191_584), ('small', 53_850_080),
                                           ('base', 93_729_776)])
def test_param_counts_detection_backbone(arch, expected):
    assert n_params(HViT3(arch=arch)) == expected


@pytest.mark.parametrize('arch,expected', [('tiny', 28_703_560), ('small', 54_362_056),
                                           ('base', 94_369_304)])
def test_param_counts_classifier(arch, expected):
    """Backbone with the authors' BN on stage 4 + a 1000-way linear head = their classifier."""
    m = HViT3(arch=arch, out_indices=(3,), out_norm_cfg=dict(type='BN'))
    c = m.out_channels[0]
    assert n_params(m) + c * 1000 + 1000 == expected


@pytest.mark.parametrize('arch,expected', [('tiny', 6_149_416), ('small', 23_799_400),
                                           ('base', 90_055_912)])
def test_param_counts_vit3(arch, expected):
    m = ViT3(arch=arch)
    c = m.norm.weight.numel()
    assert n_params(m) + c * 1000 + 1000 == expected


def test_scale_is_constant_across_calls():
    """No first-call special case: the same input gives the same output on every call."""
    m = HViT3(arch=TINY_HVIT3).eval()
    x = torch.randn(1, 3, 64, 64)
    a, b = m(x), m(x)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert all(blk.attn.scale == pytest.approx(1 / 3) for s in m.layers for blk in s.blocks)





# ---------------------------------------------------------------- freezing, norm_eval, with_cp
def test_frozen_stages():
    m = HViT3(arch=TINY_HVIT3, frozen_stages=2)
    m.train()
    frozen = [m.patch_embed, m.layers[0], m.layers[1], m.norm0, m.norm1]
    for mod in frozen:
        assert not mod.training
        assert all(not p.requires_grad for p in mod.parameters())
    for mod in (m.layers[2], m.layers[3], m.norm2, m.norm3):
        assert mod.training and all(p.requires_grad for p in mod.parameters())
    bn = m.patch_embed.conv[0].norm
    before = bn.running_mean.clone()
    sum(o.sum() for o in m(torch.randn(2, 3, 64, 64))).backward()
    assert torch.equal(bn.running_mean, before)
    assert all(p.grad is None for mod in frozen for p in mod.parameters())
    assert m.layers[2].blocks[0].attn.w1.grad is not None


def test_frozen_stages_out_of_range():
    with pytest.raises(ValueError, match='frozen_stages'):
        HViT3(arch=TINY_HVIT3, frozen_stages=7)


def test_norm_eval_keeps_batchnorm_statistics():
    m = HViT3(arch=TINY_HVIT3, norm_eval=True)
    m.train()
    bns = [x for x in m.modules() if isinstance(x, torch.nn.BatchNorm2d)]
    assert bns and all(not bn.training for bn in bns)
    before = [bn.running_var.clone() for bn in bns]
    m(torch.randn(2, 3, 64, 64))
    assert all(torch.equal(a, bn.running_var) for a, bn in zip(before, bns))
    # and without norm_eval they do move
    m2 = HViT3(arch=TINY_HVIT3).train()
    before = m2.patch_embed.conv[0].norm.running_var.clone()
    m2(torch.randn(2, 3, 64, 64))
    assert not torch.equal(before, m2.patch_embed.conv[0].norm.running_var)


@pytest.mark.parametrize('backbone', ['hvit3', 'vit3'])
def test_with_cp_same_output_and_grads(backbone):
    if backbone == 'hvit3':
        kw = dict(arch=TINY_HVIT3, drop_path_rate=0.)
        build = HViT3
    else:
        kw = dict(arch=TINY_VIT3)
        build = ViT3
    assert_with_cp_matches(lambda **extra: build(**kw, **extra))


@pytest.mark.parametrize('backbone', ['hvit3', 'vit3'])
def test_with_cp_recomputes_each_block_part_by_part(backbone):
    """With `with_cp` a TTT block is recomputed part by part (`TTTBlock.recomputed_parts`): in backward its MLP
    part is recomputed and back-propagated before its attention part is recomputed, so that the attention's
    recomputed tensors are not alive during the MLP's backward (a whole-block recomputation runs the attention
    first). Outputs and gradients equal the plain step's, stochastic depth active (each part replays its own
    drop-path draws)."""
    if backbone == 'hvit3':
        build = functools.partial(HViT3, arch=TINY_HVIT3, drop_path_rate=0.5)
    else:
        build = functools.partial(ViT3, arch=TINY_VIT3, drop_path_rate=0.5)
    plain, cp = build().train(), build(with_cp=True).train()
    cp.load_state_dict(plain.state_dict())
    block = cp.layers[0].blocks[0] if backbone == 'hvit3' else cp.blocks[0]
    events = []
    block.attn.register_forward_pre_hook(lambda *a: events.append('attention'))
    block.mlp.register_forward_pre_hook(lambda *a: events.append('mlp'))
    block.norm2.register_full_backward_pre_hook(lambda *a: events.append('mlp backward done'))
    x = torch.randn(2, 3, 64, 64)
    outs = []
    for m in (plain, cp):
        torch.manual_seed(1)
        outs.append(m(x))
    for u, v in zip(*outs):
        torch.testing.assert_close(u, v, rtol=0, atol=1e-6)
    assert events == ['attention', 'mlp']
    events.clear()
    for out in outs:
        sum(o.square().sum() for o in out).backward()
    assert events == ['mlp', 'mlp backward done', 'attention'], events
    assert_same_grads(plain, cp)


@pytest.mark.parametrize('frozen_stages', [-1, 1])
def test_with_cp_recomputes_the_stem_and_downsamplings(frozen_stages):
    """No full-resolution map of the stem (its first conv's output, (B, C/2, H/2, W/2)) and no downsampling's
    expanded map ((B, 4C', h, w), before its stride-2 conv) is kept for backward with `with_cp`. A frozen stem and
    stage (`frozen_stages=1`) need no gradient: nothing of them is kept either way."""
    dims = TINY_HVIT3['embed_dims']
    stem = (2, dims[0] // 2, 32, 32)
    expanded = [(2, 4 * dims[i + 1], 16 // 2 ** i, 16 // 2 ** i) for i in range(3)]
    trained = [stem] + expanded if frozen_stages < 0 else expanded[frozen_stages:]
    assert_with_cp_recomputes_chains(
        lambda **kw: HViT3(arch=TINY_HVIT3, drop_path_rate=0., frozen_stages=frozen_stages, **kw),
        kept=trained, dropped=[stem] + expanded)


# ---------------------------------------------------------------- registries and errors
@pytest.mark.parametrize('scope', ['mmdet', 'mmseg', 'mmpretrain'])
def test_build_from_each_registry(scope):
    import importlib
    registry = importlib.import_module(f'{scope}.registry').MODELS
    m = registry.build(dict(type='HViT3', arch=TINY_HVIT3, out_indices=(2, 3)))
    assert isinstance(m, HViT3)
    v = registry.build(dict(type='ViT3', arch=dict(TINY_VIT3, num_layers=1)))
    assert isinstance(v, ViT3)


def test_unknown_arch_error():
    with pytest.raises(ValueError, match=r"unknown arch 'huge'.*'base'"):
        HViT3(arch='huge')
    with pytest.raises(ValueError, match='missing'):
        HViT3(arch=dict(embed_dims=[8, 16, 32, 64]))


def test_wrong_channel_count_error():
    m = HViT3(arch=TINY_HVIT3)
    with pytest.raises(ValueError, match=r'expects images \(B, 3, H, W\).*\(1, 4, 32, 32\)'):
        m(torch.randn(1, 4, 32, 32))


def test_vit3_state_dict_has_the_authors_layout():
    keys = ViT3(arch=TINY_VIT3).state_dict().keys()
    assert {k.split('.')[0] for k in keys} == {'patch_embed', 'blocks', 'norm'}
    assert 'blocks.1.attn.w3' in keys and 'blocks.1.mlp.fc2.weight' in keys


def test_hvit3_state_dict_has_the_authors_layout():
    keys = set(HViT3(arch=TINY_HVIT3).state_dict())
    assert {k.split('.')[0] for k in keys} == {'patch_embed', 'layers', 'norm0', 'norm1', 'norm2', 'norm3'}
    for k in ('patch_embed.conv.4.norm.running_var', 'layers.0.blocks.0.cpe.weight',
              'layers.2.blocks.1.attn.qkv.weight', 'layers.1.downsample.conv.2.norm.weight',
              'layers.3.blocks.0.mlp.dwc.weight'):
        assert k in keys
