"""H-ViT3 / ViT3 backbones: shapes, inner gradients, RoPE, freezing, checkpointing, registries, weights."""

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_pyramid_shapes, assert_with_cp_matches, TINY_HVIT3, nbytes, saved_for_backward
from mmplugin_l2 import HViT3, ViT3
from mmplugin_l2.models.layers import TTTAttention, apply_rope, rope_tables


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
    m = ViT3(arch=dict(embed_dims=32, num_layers=2, num_heads=2), out_indices=(0, 1)).eval()
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


def test_ttt_layer_against_explicit_inner_training():
    """The whole TTT layer against a slow path that trains each inner model with autograd."""
    torch.manual_seed(1)
    c, nh, hh, ww, b = 16, 2, 5, 6, 2
    layer = TTTAttention(c, nh).double()
    with torch.no_grad():
        for p in (layer.w1, layer.w2, layer.w3):
            p.normal_(0, 0.3)
    x = torch.randn(b, hh * ww, c, dtype=torch.float64)
    rope = rope_tables(hh, ww, c).to(torch.complex128)
    got = layer(x, (hh, ww), rope)

    d = c // nh
    n = hh * ww
    q1, k1, v1, q2, k2, v2 = layer.qkv(x).split([c, c, c, d, d, d], -1)
    q1, k1 = apply_rope(q1, rope), apply_rope(k1, rope)
    outs = []
    for i in range(b):
        heads = []
        for hd in range(nh):
            sl = slice(hd * d, (hd + 1) * d)
            W1 = layer.w1[0, hd].detach().clone().requires_grad_()
            W2 = layer.w2[0, hd].detach().clone().requires_grad_()
            loss = -((k1[i, :, sl] @ W1) * F.silu(k1[i, :, sl] @ W2) * v1[i, :, sl]).sum() / n / 3
            g1, g2 = torch.autograd.grad(loss, (W1, W2))
            W1 = W1 - g1 / (g1.norm(dim=0, keepdim=True) + 1)
            W2 = W2 - g2 / (g2.norm(dim=0, keepdim=True) + 1)
            heads.append((q1[i, :, sl] @ W1) * F.silu(q1[i, :, sl] @ W2))
        kk = k2[i].T.reshape(1, d, hh, ww)
        vv = v2[i].T.reshape(1, d, hh, ww)
        W3 = layer.w3.detach().clone().requires_grad_()
        loss = -(F.conv2d(kk, W3, padding=1, groups=d) * vv).sum() / n / 3
        (g3,) = torch.autograd.grad(loss, W3)
        W3 = W3 - g3 / (g3.norm(dim=(-2, -1), keepdim=True) + 1)
        conv = F.conv2d(q2[i].T.reshape(1, d, hh, ww), W3, padding=1, groups=d).reshape(d, n).T
        outs.append(torch.cat(heads + [conv], -1))
    ref = layer.proj(torch.stack(outs))
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)


def _ttt_layer_and_input(fast_train, dtype=torch.float64, dim=16, heads=2):
    torch.manual_seed(3)
    layer = TTTAttention(dim, heads, fast_train=fast_train).to(dtype)
    with torch.no_grad():
        for p in (layer.w1, layer.w2, layer.w3):
            p.normal_(0, 0.3)
    x = torch.randn(2, 5 * 6, dim, dtype=dtype, requires_grad=True)
    return layer, x


def test_ttt_recompute_keeps_fewer_tensors_for_backward():
    """What autograd keeps for backward, in bytes: the recomputing layer keeps only x (for qkv), the qkv
    tokens and the proj input, far below the plain graph (which keeps every inner-model temporary)."""
    kept = {}
    for fast_train in (True, False):
        layer, x = _ttt_layer_and_input(fast_train, torch.float32)
        _, saved = saved_for_backward(lambda: layer(x, (5, 6), rope_tables(5, 6, 16)))
        kept[fast_train] = nbytes(saved)
    n, c, d = 2 * 30, 16, 8
    assert kept[True] <= 4 * (n * c + n * (3 * c + 3 * d) + n * (c + d)) + 4 * (16 * 54 + 24 * 16) + 8 * 4 * 1024
    assert kept[True] < 0.5 * kept[False]


def test_scale_is_constant_across_calls():
    """No first-call special case: the same input gives the same output on every call."""
    m = HViT3(arch=TINY_HVIT3).eval()
    x = torch.randn(1, 3, 64, 64)
    a, b = m(x), m(x)
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    assert all(blk.attn.scale == pytest.approx(1 / 3) for s in m.layers for blk in s.blocks)


# ---------------------------------------------------------------- RoPE
def test_rope_matches_complex_rotation():
    h, w, c = 5, 7, 16
    rot = rope_tables(h, w, c)
    x = torch.randn(2, h * w, c)
    k = c // 4
    theta = 10000 ** (-torch.arange(k, dtype=torch.float64) / k)
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing='ij')
    ang = torch.cat([ys.reshape(-1, 1) * theta, xs.reshape(-1, 1) * theta], 1)  # (N, C/2)
    z = torch.view_as_complex(x.double().reshape(2, h * w, c // 2, 2).contiguous())
    ref = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).reshape(2, h * w, c)
    torch.testing.assert_close(apply_rope(x, rot).double(), ref, rtol=0, atol=1e-5)
    # first half of the channels rotates with the row only, second half with the column only
    rows = apply_rope(torch.ones(1, h * w, c), rot).reshape(h, w, c)
    assert torch.allclose(rows[:, :1, :c // 2].expand(-1, w, -1), rows[:, :, :c // 2])
    assert torch.allclose(rows[:1, :, c // 2:].expand(h, -1, -1), rows[:, :, c // 2:])


@pytest.mark.parametrize('dim,heads', [(16, 2), (12, 4)])
def test_rope_heads_and_its_transpose(dim, heads):
    """rope_heads = apply_rope then the head split (exactly); rope_heads_backward is its transpose:
    <rope_heads(x), g> = <x, rope_heads_backward(g)>, also into a strided channel slice."""
    from mmplugin_l2.models.ops.rope import rope_heads, rope_heads_backward
    torch.manual_seed(0)
    rot = rope_tables(3, 4, dim)
    wide = torch.randn(2, 12, 3 * dim + 2, dtype=torch.float64)
    x = wide[..., dim + 2:2 * dim + 2]
    ref = apply_rope(x, rot).unflatten(-1, (heads, -1)).transpose(1, 2)
    got = rope_heads(x, rot, heads)
    assert got.is_contiguous() and torch.equal(got, ref)
    g = torch.randn_like(ref)
    out = torch.zeros_like(wide)
    rope_heads_backward(g, rot, out[..., 2:dim + 2])
    torch.testing.assert_close((got * g).sum(), (x * out[..., 2:dim + 2]).sum(), rtol=1e-14, atol=0)
    assert out[..., :2].abs().sum() == 0 and out[..., dim + 2:].abs().sum() == 0


def test_rope_tables_from_inference_mode_serve_training():
    with torch.inference_mode():
        rot = rope_tables(4, 4, 8)
    x = torch.randn(1, 16, 8, requires_grad=True)
    apply_rope(x, rot).sum().backward()
    assert x.grad is not None


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
        kw = dict(arch=dict(embed_dims=32, num_layers=2, num_heads=2))
        build = ViT3
    assert_with_cp_matches(lambda **extra: build(**kw, **extra))


# ---------------------------------------------------------------- registries and errors
@pytest.mark.parametrize('scope', ['mmdet', 'mmseg', 'mmpretrain'])
def test_build_from_each_registry(scope):
    import importlib
    registry = importlib.import_module(f'{scope}.registry').MODELS
    m = registry.build(dict(type='HViT3', arch=TINY_HVIT3, out_indices=(2, 3)))
    assert isinstance(m, HViT3)
    v = registry.build(dict(type='ViT3', arch=dict(embed_dims=32, num_layers=1, num_heads=2)))
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
    keys = ViT3(arch=dict(embed_dims=32, num_layers=2, num_heads=2)).state_dict().keys()
    assert {k.split('.')[0] for k in keys} == {'patch_embed', 'blocks', 'norm'}
    assert 'blocks.1.attn.w3' in keys and 'blocks.1.mlp.fc2.weight' in keys


def test_hvit3_state_dict_has_the_authors_layout():
    keys = set(HViT3(arch=TINY_HVIT3).state_dict())
    assert {k.split('.')[0] for k in keys} == {'patch_embed', 'layers', 'norm0', 'norm1', 'norm2', 'norm3'}
    for k in ('patch_embed.conv.4.norm.running_var', 'layers.0.blocks.0.cpe.weight',
              'layers.2.blocks.1.attn.qkv.weight', 'layers.1.downsample.conv.2.norm.weight',
              'layers.3.blocks.0.mlp.dwc.weight'):
        assert k in keys
