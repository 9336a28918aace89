"""L2ViT: the blocks against the ops' naive forms, the window padding and the clamp the blocks use; shapes at odd
sizes; AMP; freezing, norm_eval, with_cp; parameter counts; registries; the authors' checkpoint layout, loading
and conversion. The layers' ops: tests/ops/."""
import argparse
import copy
import os.path as osp
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_pyramid_shapes, assert_same_grads, assert_with_cp_recomputes_chains, ROOT, TINY_L2VIT
from mmplugin_l2 import L2ViT
from mmplugin_l2.models.backbones.l2vit import LGABlock, LWABlock
from mmplugin_l2.models.layers import WindowAttention
from mmplugin_l2.models.ops.window_attention import padding_key_mask
from mmplugin_l2.models.ops.window_attention.naive import window_attention_naive, window_msa_naive
from ops.test_linear_attention import explicit_linear_attention

TINY = TINY_L2VIT


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def randomize_norms(model, seed=0):
    """Non-trivial LN / BN affine and BN statistics (defaults 1/0 would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
    return model


# ---------------------------------------------------------------- shapes
@pytest.mark.parametrize('size', [(64, 64), (63, 97), (250, 333), (33, 31), (8, 8), (1, 5)])
def test_shapes_and_strides(size):
    m = L2ViT(arch=TINY).eval()
    with torch.no_grad():
        outs = m(torch.randn(2, 3, *size))
    assert_pyramid_shapes(outs, size, TINY['embed_dims'])


@pytest.fixture(scope='module')
def real_tiny():
    """L2ViT-T at the real widths, built once (tests that change it take a copy)."""
    torch.manual_seed(0)
    return L2ViT('tiny', drop_path_rate=0.)


def test_real_tiny_width_shapes_at_odd_size(real_tiny):
    """The authors' measured map sizes for DET-T at 250 x 330 (docs/l2vit.md, Arguments)."""
    m = real_tiny.eval()
    with torch.no_grad():
        outs = m(torch.randn(1, 3, 250, 330))
    assert [tuple(o.shape[1:]) for o in outs] == [(96, 63, 83), (192, 32, 42), (384, 16, 21), (768, 8, 11)]


def test_out_indices_and_out_channels():
    m = L2ViT(arch=TINY, out_indices=(1, 2, 3)).eval()
    outs = m(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [32, 64, 64] == m.out_channels
    assert all(hasattr(m, f'norm{i}') for i in (1, 2, 3)) and not hasattr(m, 'norm0')
    assert isinstance(m.norm1, nn.LayerNorm) and m.norm1.eps == 1e-5


def test_block_layout_and_window_size():
    with torch.device('meta'):  # the real widths, without allocating them
        m = L2ViT('small')
        b384 = L2ViT('base-384')
        rates = [b.drop_path.drop_prob if not isinstance(b.drop_path, nn.Identity) else 0.
                 for s in L2ViT('small', drop_path_rate=0.3).stages for b in s]
    kinds = [['W' if isinstance(b, LWABlock) else 'G' for b in stage] for stage in m.stages]
    assert [''.join(k) for k in kinds] == ['WG', 'WG', 'WG' * 9, 'WG']
    assert all(b.attn.window_size == 7 for s in m.stages for b in s if isinstance(b, LWABlock))
    assert b384.window_size == 12 and b384.stages[2][4].attn.window_size == 12
    assert L2ViT(arch=TINY, window_size=5).stages[0][0].attn.window_size == 5
    # drop path: linspace over all 24 single blocks
    assert len(rates) == 24 and rates[0] == 0 and rates[-1] == pytest.approx(0.3)
    assert rates[1] == pytest.approx(0.3 / 23)


def test_state_dict_has_the_authors_layout(real_tiny):
    """Keys and shapes of the authors' L2ViT-T (classification file: 284 keys; here with norm0-3 instead of
    norm + head)."""
    sd = real_tiny.state_dict()
    assert len(sd) == 284 - 4 + 8
    shapes = {
        'downsample_layers.0.proj.proj.0.weight': (48, 3, 3, 3), 'downsample_layers.0.proj.proj.0.bias': (48,),
        'downsample_layers.0.proj.proj.1.running_var': (48,), 'downsample_layers.0.proj.proj.3.weight': (96, 48, 3, 3),
        'downsample_layers.0.proj.proj.4.num_batches_tracked': (), 'downsample_layers.0.norm.weight': (96,),
        'downsample_layers.1.norm.weight': (96,), 'downsample_layers.1.proj.weight': (192, 96, 2, 2),
        'stages.0.0.cpe.0.proj.weight': (96, 1, 3, 3), 'stages.0.0.cpe.1.proj.bias': (96,),
        'stages.0.0.attn.qkv.weight': (288, 96), 'stages.0.0.attn.qkv.bias': (288,),
        'stages.0.0.attn.proj.weight': (96, 96), 'stages.0.0.mlp.fc1.weight': (384, 96),
        'stages.2.5.attn.temperature': (12, 1, 1), 'stages.2.5.local_mp.conv1.weight': (384, 1, 7, 7),
        'stages.2.5.local_mp.bn.running_mean': (384,), 'stages.2.5.local_mp.conv2.bias': (384,),
        'stages.2.5.norm3.weight': (384,), 'stages.3.1.mlp.fc2.weight': (768, 3072), 'norm3.bias': (768,),
    }
    for k, s in shapes.items():
        assert tuple(sd[k].shape) == s, k
    assert 'stages.2.5.cpe.1.proj.weight' not in sd and 'stages.2.4.local_mp.conv1.weight' not in sd
    assert {k.split('.')[0] for k in sd} == {'downsample_layers', 'stages', 'norm0', 'norm1', 'norm2', 'norm3'}
    temps = [v for k, v in sd.items() if k.endswith('temperature')]
    assert sum(t.numel() for t in temps) == 69
    assert all(torch.allclose(t, torch.full_like(t, 32 ** -0.5)) for t in temps)


# ---------------------------------------------------------------- parameter counts (real widths)
@pytest.mark.parametrize('arch,det,cls', [('tiny', 27_829_125, 28_596_781), ('small', 49_431_501, 50_199_157),
                                          ('base', 87_553_980, 88_577_188), ('base-384', 87_553_980, 88_577_188)])
def test_param_counts(arch, det, cls):
    """Official counts (docs/l2vit.md, Architecture): dense-prediction backbone with norm0-3; classifier = backbone
    with the final norm on stage 3 + 1000-way linear head."""
    with torch.device('meta'):
        assert n_params(L2ViT(arch=arch)) == det
        m = L2ViT(arch=arch, out_indices=(3,), final_norm=True)
    c = m.out_channels[0]
    assert n_params(m) + c * 1000 + 1000 == cls


# ---------------------------------------------------------------- window attention
def naive_window_attention(attn, x, hw, ws, mask_padding=False):
    """The layer `attn` as the naive op computes it: window by window, the explicit softmax
    (ops/window_attention/naive.py), with the padding key mask the layer builds when `mask_padding`."""
    padded = (-(-hw[0] // ws) * ws, -(-hw[1] // ws) * ws)
    mask = (padding_key_mask(hw, padded, ws, 'cpu').repeat(x.shape[0], 1)
            if mask_padding and padded != tuple(hw) else None)
    return window_attention_naive(x, hw, ws, partial(window_msa_naive, attn), mask)


def test_window_padding_is_unmasked_by_default():
    """The authors' padding lets padded tokens into border windows: default and masked differ exactly when
    the map is not a multiple of the window."""
    a = WindowAttention(16, 2, 7)
    b = WindowAttention(16, 2, 7, mask_padding=True)
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        a.qkv.bias.normal_()
        b.qkv.bias.copy_(a.qkv.bias)
    x = torch.randn(1, 14 * 7, 16)
    assert torch.equal(a(x, (14, 7)), b(x, (14, 7)))
    x = torch.randn(1, 10 * 9, 16)
    assert not torch.allclose(a(x, (10, 9)), b(x, (10, 9)), atol=1e-4)
    m = L2ViT(arch=TINY, mask_window_padding=True)
    assert all(blk.attn.mask_padding for s in m.stages for blk in s if isinstance(blk, LWABlock))
    assert not L2ViT(arch=TINY).stages[0][0].attn.mask_padding


def test_lga_blocks_use_the_authors_clamp():
    """Every LGA block's linear attention bounds its denominator at the authors' 100 (the clamp itself:
    tests/ops/test_linear_attention.py)."""
    assert all(b.attn.clamp_min == 100. for s in L2ViT(arch=TINY).stages for b in s if isinstance(b, LGABlock))


# ---------------------------------------------------------------- linear attention and the clamp


def test_backbone_bf16_autocast_finite():
    m = L2ViT(arch=TINY).eval()
    x = torch.randn(1, 3, 320, 352) * 3
    with torch.no_grad():
        ref = m(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            outs = m(x)
    for o, r in zip(outs, ref):
        assert torch.isfinite(o).all()
        assert (o.float() - r).abs().mean() < 0.1 * r.abs().mean()


# ---------------------------------------------------------------- the blocks against the paper's equations
def test_blocks_compose_as_the_authors():
    torch.manual_seed(0)
    hw = (9, 10)
    x = torch.randn(2, 90, 16, dtype=torch.float64)

    def cpe(mod, t):
        return t + F.conv2d(t.transpose(1, 2).reshape(2, 16, *hw), mod.proj.weight, mod.proj.bias,
                            padding=1, groups=16).flatten(2).transpose(1, 2)

    lwa = randomize_norms(LWABlock(16, 2, window_size=4)).double().eval()
    s = cpe(lwa.cpe[0], x)
    y = s + naive_window_attention(lwa.attn, lwa.norm1(s), hw, 4)
    y = cpe(lwa.cpe[1], y)
    y = y + lwa.mlp.fc2(F.gelu(lwa.mlp.fc1(lwa.norm2(y))))
    torch.testing.assert_close(lwa(x, hw), y, rtol=0, atol=1e-12)

    lga = randomize_norms(LGABlock(16, 2)).double().eval()
    y = cpe(lga.cpe[0], x)
    y = y + explicit_linear_attention(lga.attn, lga.norm1(y))[0]
    y = y + lga.local_mp(lga.norm3(y), hw)                           # LCM residual after the attention one
    y = y + lga.mlp.fc2(F.gelu(lga.mlp.fc1(lga.norm2(y))))
    torch.testing.assert_close(lga(x, hw), y, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the official code's outputs
def test_outputs_equal_the_official_code(tmp_path):
    """tests/data/l2vit_official_tiny.pt: outputs of the authors' unmodified classification model and
    detection backbone (narrow arch) for the deterministic weights of l2vit_golden.py, at 64 x 64 and at
    50 x 75 (window and downsampling padding). Loaded here as a release file through init_cfg."""
    import l2vit_golden as G
    gold = torch.load(osp.join(ROOT, 'tests/data/l2vit_official_tiny.pt'), weights_only=True)
    shapes = {k: v.shape for k, v in L2ViT(arch=G.ARCH, out_indices=(3,), final_norm=True).state_dict().items()}
    shapes['norm.weight'] = shapes['norm.bias'] = shapes.pop('norm3.weight')
    del shapes['norm3.bias']
    shapes['head.weight'], shapes['head.bias'] = (G.NUM_CLASSES, G.ARCH['embed_dims'][-1]), (G.NUM_CLASSES,)
    assert sorted(shapes) == gold['keys']
    sd = G.state_dict(shapes)
    path = tmp_path / 'golden.pth'
    torch.save({'model': sd}, path)
    pre = dict(type='Pretrained', checkpoint=str(path))
    det = L2ViT(arch=G.ARCH, init_cfg=pre)
    cls = L2ViT(arch=G.ARCH, out_indices=(3,), final_norm=True, init_cfg=pre)
    det.init_weights(), cls.init_weights()
    with torch.no_grad():
        for s, x in G.inputs().items():
            for o, r in zip(det.eval()(x), gold['det'][s]):
                torch.testing.assert_close(o, r, rtol=0, atol=1e-5)
            feat = cls.eval()(x)[0].mean((2, 3))
            torch.testing.assert_close(feat, gold['features'][s], rtol=0, atol=1e-5)
            logits = feat @ sd['head.weight'].T + sd['head.bias']
            torch.testing.assert_close(logits, gold['logits'][s], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- freezing, norm_eval, with_cp
def bns(m):
    return [x for x in m.modules() if isinstance(x, nn.BatchNorm2d)]


def test_frozen_stages():
    m = L2ViT(arch=TINY, frozen_stages=2)
    m.train()
    frozen = [m.downsample_layers[0], m.stages[0], m.downsample_layers[1], m.stages[1], m.norm0, m.norm1]
    for mod in frozen:
        assert not mod.training
        assert all(not p.requires_grad for p in mod.parameters())
    for mod in (m.downsample_layers[2], m.stages[2], m.stages[3], m.norm2, m.norm3):
        assert mod.training and all(p.requires_grad for p in mod.parameters())
    stem_bn, lcm_bn0, lcm_bn2 = m.downsample_layers[0].proj.proj[1], m.stages[0][1].local_mp.bn, \
        m.stages[2][1].local_mp.bn
    before = [b.running_mean.clone() for b in (stem_bn, lcm_bn0, lcm_bn2)]
    sum(o.sum() for o in m(torch.randn(2, 3, 64, 64))).backward()
    assert torch.equal(stem_bn.running_mean, before[0]) and torch.equal(lcm_bn0.running_mean, before[1])
    assert not torch.equal(lcm_bn2.running_mean, before[2])
    assert all(p.grad is None for mod in frozen for p in mod.parameters())
    assert m.stages[2][1].attn.temperature.grad is not None


def test_frozen_stem_only_and_range():
    m = L2ViT(arch=TINY, frozen_stages=0).train()
    assert not m.downsample_layers[0].training and m.stages[0].training and m.downsample_layers[1].training
    with pytest.raises(ValueError, match='frozen_stages'):
        L2ViT(arch=TINY, frozen_stages=5)


def test_norm_eval_keeps_batchnorm_statistics():
    m = L2ViT(arch=TINY, norm_eval=True)
    m.train()
    assert len(bns(m)) == 2 + 4 and all(not bn.training for bn in bns(m))  # stem x2 + one LCM per stage
    before = [bn.running_var.clone() for bn in bns(m)]
    m(torch.randn(2, 3, 64, 64))
    assert all(torch.equal(a, bn.running_var) for a, bn in zip(before, bns(m)))
    m2 = L2ViT(arch=TINY).train()  # the authors: the BNs train
    before = [bn.running_var.clone() for bn in bns(m2)]
    m2(torch.randn(2, 3, 64, 64))
    assert all(not torch.equal(a, bn.running_var) for a, bn in zip(before, bns(m2)))


def test_recompute_same_outputs_and_gradients_float64():
    """fast_train=True (whole attention / LCM branches recomputed, MLP branches as NormMlpFunction keeping
    the fc1 output) against plain autograd (fast_train=False): same outputs and gradients, with drop path."""
    torch.manual_seed(0)
    a = L2ViT(arch=TINY, drop_path_rate=0.2, fast_train=False).double().train()
    b = L2ViT(arch=TINY, drop_path_rate=0.2).double().train()
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 64, 72, dtype=torch.float64)
    outs = []
    for m in (a, b):
        torch.manual_seed(1)
        o = m(x)
        sum((t * t.flatten().sin().view_as(t)).sum() for t in o).backward()
        outs.append(o)
    for u, v in zip(*outs):
        torch.testing.assert_close(u, v, rtol=0, atol=1e-12)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10 * max(1., p.grad.abs().max().item()), msg=n)


def test_mlp_branch_keeps_the_fc1_output_not_the_gelu_output():
    """The recomputing block's MLP branch saves its input and fc1's output (plus LayerNorm statistics and
    the weights), not the LayerNorm output or the GELU output; gradients as autograd's."""
    from conftest import nbytes, saved_for_backward
    from mmplugin_l2.models.layers.mlp import norm_mlp_branch
    torch.manual_seed(0)
    blk = LGABlock(8, 2).double().train()
    with torch.no_grad():
        blk.norm2.weight.normal_(), blk.norm2.bias.normal_()
    x = torch.randn(2, 30, 8, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 30, 8, dtype=torch.float64)
    params = [x] + list(blk.norm2.parameters()) + list(blk.mlp.parameters())
    y, saved = saved_for_backward(lambda: norm_mlp_branch(blk, blk.norm2, blk.mlp, x))
    ref, saved_ref = saved_for_backward(lambda: blk.mlp(blk.norm2(x)))
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    for u, v in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(u, v, rtol=0, atol=1e-13)
    weights = nbytes(list(blk.norm2.parameters()) + list(blk.mlp.parameters()))
    tokens = 2 * 30 * 8
    assert nbytes(saved) - weights <= 8 * (tokens + 4 * tokens + 2 * 60)    # x, fc1 output, LN mean / rstd
    assert nbytes(saved_ref) - weights >= 8 * (tokens + 8 * tokens)      # + LN output and GELU output


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_window_attention_branch_keeps_its_products_not_the_projection_output(dtype):
    """The recomputing LWA block's attention branch (selective: `keep_products`) keeps its input, the qkv output and
    the attention kernel's output (and its softmax statistics), not the output projection's output, which no
    backward reads (`ops.checkpoint.output_product`); its backward recomputes neither product (the recomputation
    stops before the projection) and gives autograd's gradients."""
    from conftest import nbytes
    from ops.harness import RecordOps
    from mmplugin_l2.models.ops.checkpoint import recomputed_branch
    torch.manual_seed(0)
    c, heads, ws, (h, w) = 16, 2, 4, (8, 10)
    blk = LWABlock(c, heads, window_size=ws).to(dtype).train()
    x = torch.randn(2, h * w, c, dtype=dtype, requires_grad=True)
    g = torch.randn(2, h * w, c, dtype=dtype)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = recomputed_branch(blk, blk.norm1, blk.attn, x, (h, w), keep_products=True)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    windows, padded = 2 * 2 * 3, 2 * 8 * 12   # (8, 10) padded to (8, 12): 2 x 3 windows of 16 tokens per image
    # x, the qkv output, the attention output, the kernel's logsumexp (one per query and head)
    want = x.element_size() * (x.numel() + padded * 3 * c + padded * c + windows * heads * ws * ws)
    assert sum(storages.values()) == want, sorted(storages.values())
    ops = []
    with RecordOps(lambda func, *rest: ops.append(func.overloadpacket.__name__)):
        grads = torch.autograd.grad(y, [x, *blk.attn.parameters(), *blk.norm1.parameters()], g)
    assert 'addmm' not in ops and ops.count('mm') == 4, ops   # the two products' input and weight gradients only
    ref = blk.attn(blk.norm1(x), (h, w))
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    for u, v in zip(grads, torch.autograd.grad(ref, [x, *blk.attn.parameters(), *blk.norm1.parameters()], g)):
        torch.testing.assert_close(u, v, rtol=tol, atol=tol)


def test_with_cp_recomputes_the_stem():
    """With `with_cp` the stem's first map (its first conv's output, (B, C/2, H/2, W/2)) is not kept for
    backward."""
    stem = (2, TINY['embed_dims'][0] // 2, 32, 32)
    assert_with_cp_recomputes_chains(lambda **kw: L2ViT(arch=TINY, drop_path_rate=0., **kw), [stem], [])


def test_with_cp_same_outputs_grads_and_bn_statistics():
    """Also with drop path (the recomputation replays the same masks) and BatchNorms in train mode (their
    running statistics move once, not twice)."""
    torch.manual_seed(0)
    a = L2ViT(arch=TINY, drop_path_rate=0.2)
    b = L2ViT(arch=TINY, drop_path_rate=0.2, with_cp=True)
    b.load_state_dict(a.state_dict())
    a.train(), b.train()
    x = torch.randn(2, 3, 64, 64)
    torch.manual_seed(1)
    oa = a(x)
    sum(o.square().sum() for o in oa).backward()
    torch.manual_seed(1)
    ob = b(x)
    sum(o.square().sum() for o in ob).backward()
    for u, v in zip(oa, ob):
        torch.testing.assert_close(u, v, rtol=0, atol=1e-6)
    assert_same_grads(a, b)
    for (n, t), u in zip(a.state_dict().items(), b.state_dict().values()):
        if 'running' in n or 'num_batches' in n:
            torch.testing.assert_close(t, u, rtol=0, atol=1e-7, msg=n)
    assert b.stages[1][1].local_mp.bn.num_batches_tracked.item() == 1


# ---------------------------------------------------------------- registries and errors
@pytest.mark.parametrize('scope', ['mmdet', 'mmseg', 'mmpretrain'])
def test_build_from_each_registry(scope):
    import importlib
    registry = importlib.import_module(f'{scope}.registry').MODELS
    m = registry.build(dict(type='L2ViT', arch=TINY, out_indices=(1, 2, 3)))
    assert isinstance(m, L2ViT) and m.out_indices == (1, 2, 3)


def test_errors():
    with pytest.raises(ValueError, match=r"unknown arch 'huge'.*'base-384'"):
        L2ViT(arch='huge')
    with pytest.raises(ValueError, match='missing'):
        L2ViT(arch=dict(embed_dims=[8, 16, 32, 64]))
    with pytest.raises(ValueError, match='final_norm=True needs the last stage'):
        L2ViT(arch=TINY, out_indices=(0, 1), final_norm=True)
    with pytest.raises(ValueError, match=r'expects images \(B, 3, H, W\)'):
        L2ViT(arch=TINY)(torch.randn(1, 1, 32, 32))


# ---------------------------------------------------------------- the authors' checkpoints
def authors_file(tmp_path, model, name='authors.pth'):
    """A release file as the authors' main.py writes it: `model` (their keys: ours minus norm{i}, plus the
    final `norm` and the `head`), `model_ema`, optimizer, epoch, scaler and an argparse Namespace."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    c = model.stage_channels[-1]
    sd = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith('norm')}
    sd.update({'norm.weight': torch.rand(c) + 0.5, 'norm.bias': torch.randn(c),
               'head.weight': torch.randn(1000, c) * 0.02, 'head.bias': torch.randn(1000) * 0.02})
    path = tmp_path / name
    torch.save({'model': sd, 'model_ema': {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()},
                'optimizer': {'state': {}}, 'epoch': 299, 'scaler': {},
                'args': argparse.Namespace(model='L2ViT_Tiny')}, path)
    return sd, path


def load(model):
    with pytest.warns(UserWarning, match='beyond tensors'):  # the pickled argparse.Namespace
        model.init_weights()
    return model


def test_pretrained_loads_authors_release_file(tmp_path):
    sd, path = authors_file(tmp_path, L2ViT(arch=TINY))
    m = load(L2ViT(arch=TINY, init_cfg=dict(type='Pretrained', checkpoint=str(path))))
    own = m.state_dict()
    for k, v in sd.items():
        if not k.startswith(('norm.', 'head.')):
            assert torch.equal(own[k], v), k
    # dense prediction: the output norms start fresh, their final norm is not used
    assert torch.equal(own['norm3.weight'], torch.ones(64)) and torch.equal(own['norm0.bias'], torch.zeros(16))
    cls = load(L2ViT(arch=TINY, out_indices=(3,), final_norm=True,
                     init_cfg=dict(type='Pretrained', checkpoint=str(path))))
    assert torch.equal(cls.norm3.weight, sd['norm.weight']) and torch.equal(cls.norm3.bias, sd['norm.bias'])


def test_pretrained_wrong_size_and_foreign_keys(tmp_path):
    sd, _ = authors_file(tmp_path, L2ViT(arch=TINY))
    path = tmp_path / 'clean.pth'
    torch.save({'model': sd}, path)
    m = L2ViT(arch=dict(TINY, depths=[2, 2, 4, 2]), init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.raises(ValueError, match=r'does not fit L2ViT[\s\S]*missing keys: stages\.2\.2\.'):
        m.init_weights()
    m = L2ViT(arch=dict(TINY, embed_dims=[16, 32, 64, 128]), init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.raises(ValueError, match=r'shape mismatches: .*stages\.3'):
        m.init_weights()
    bad = dict(sd, **{'last_proj.weight': torch.zeros(1280, 64)})
    torch.save({'model': bad}, path)
    with pytest.raises(ValueError, match=r'unexpected keys: last_proj\.weight'):
        L2ViT(arch=TINY, init_cfg=dict(type='Pretrained', checkpoint=str(path))).init_weights()


def test_raw_model_file_does_not_load_silently(tmp_path):
    """mmengine's own loader would read nothing from a {'model': ...} file; ours reads `model`, and a file
    with no weights at all is an error."""
    path = tmp_path / 'empty.pth'
    torch.save({'optimizer': {}, 'epoch': 3}, path)
    with pytest.raises(ValueError, match='no state dict found|none of the entries'):
        L2ViT(arch=TINY, init_cfg=dict(type='Pretrained', checkpoint=str(path))).init_weights()


def run_convert(*args):
    return subprocess.run([sys.executable, f'{ROOT}/tools/convert_checkpoint.py', *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


def test_convert_tool_and_classifier_logits(tmp_path, real_tiny):
    """The real T: release file -> tools/convert_checkpoint.py --target mmpretrain -> the classifier of
    configs/mmpretrain/l2vit_t_in1k.py gives the authors' logits (LN per token -> mean -> Linear, computed
    here by hand from their tensors); --ema takes model_ema; a wrong arch is refused."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.runner import load_checkpoint
    from mmpretrain.registry import MODELS

    src = randomize_norms(copy.deepcopy(real_tiny))
    sd, path = authors_file(tmp_path, src, 'L2ViT-Tiny-checkpoint-best-ema.pth')
    dst = tmp_path / 'cls.pth'
    r = run_convert(path, dst, '--model', 'L2ViT', '--arch', 'tiny', '--target', 'mmpretrain')
    assert r.returncode == 0, r.stderr
    out = torch.load(dst, weights_only=True)['state_dict']
    assert torch.equal(out['head.fc.weight'], sd['head.weight'])
    assert torch.equal(out['backbone.norm3.bias'], sd['norm.bias'])
    assert not any(k.startswith('backbone.norm0') for k in out)

    init_default_scope('mmpretrain')
    model = MODELS.build(Config.fromfile(f'{ROOT}/configs/mmpretrain/l2vit_t_in1k.py').model)
    load_checkpoint(model, str(dst), map_location='cpu', strict=True, logger='silent')
    model.eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        logits = model(x, mode='tensor')
        # the raw stage-4 tokens (no output norm), then the authors' LN + mean + head by hand
        src.norm3 = nn.Identity()
        t = src.eval()(x)[3].flatten(2).transpose(1, 2)
        t = (t - t.mean(-1, keepdim=True)) / torch.sqrt(t.var(-1, unbiased=False, keepdim=True) + 1e-5)
        t = t * sd['norm.weight'] + sd['norm.bias']
        ref = t.mean(1) @ sd['head.weight'].T + sd['head.bias']
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)

    # --ema and a wrong arch, in process (the keys and shapes are checked against a model on the meta device)
    from mmplugin_l2.checkpoint.convert import convert_checkpoint
    with torch.device('meta'), pytest.warns(UserWarning, match='beyond tensors'):
        ema = convert_checkpoint(path, 'L2ViT', 'tiny', 'backbone', ema=True)['state_dict']
    k = 'stages.2.5.attn.temperature'
    assert torch.equal(ema[k], sd[k] + 1) and 'norm.weight' not in ema and 'head.bias' not in ema
    with torch.device('meta'), pytest.warns(UserWarning), \
            pytest.raises(ValueError, match=r'does not fit L2ViT \(arch small\)[\s\S]*missing keys: stages\.2\.1'):
        convert_checkpoint(path, 'L2ViT', 'small')
