"""ResT backbone: shapes at any size, the single-head stage's layout, the backbone with and without the
memory-saving attention (the EMSA layer and its op: tests/ops/test_emsa.py), freezing, norm_eval, with_cp, output-norm placement,
parameter counts, registries, and the authors' checkpoint layouts (classification and detectron2) through
init_cfg and the convert tool."""
import math
import re
import subprocess
import sys

import pytest
import torch

from conftest import assert_pyramid_shapes, assert_with_cp_matches, assert_with_cp_recomputes_chains, ROOT, TINY_REST
from mmplugin_l2 import ResT
from mmplugin_l2.models.layers import EMSA
from mmplugin_l2.models.ops.emsa.naive import emsa_attention_naive

# the authors' classification models (docs/rest.md, Architecture): total parameters incl. the 1000-way head
CLS_PARAMS = {'lite': 10_508_300, 'small': 13_679_708, 'base': 30_327_052, 'large': 51_676_156}
C4 = {'lite': 512, 'small': 512, 'base': 768, 'large': 768}
DIMS = {'lite': [64, 128, 256, 512], 'small': [64, 128, 256, 512], 'base': [96, 192, 384, 768],
        'large': [96, 192, 384, 768]}


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def tiny(**kw):
    kw.setdefault('drop_path_rate', 0.)
    return ResT(arch=TINY_REST, **kw)


# ---------------------------------------------------------------- shapes at any size
@pytest.mark.parametrize('size', [(250, 330), (224, 225), (64, 64), (33, 31), (7, 9)])
def test_shapes_and_strides_any_size(size):
    """The authors' code crashes unless H, W mod 32 are in {0, 29, 30, 31} (250x330, 224x225 fail there)."""
    m = tiny().eval()
    with torch.no_grad():
        outs = m(torch.randn(2, 3, *size))
    assert_pyramid_shapes(outs, size, TINY_REST['embed_dims'])


def test_real_small_at_sizes_the_authors_reject():
    m = ResT('small').eval()
    with torch.no_grad():
        outs = m(torch.randn(1, 3, 250, 330))
        assert [tuple(o.shape[1:]) for o in outs] == [(64, 63, 83), (128, 32, 42), (256, 16, 21), (512, 8, 11)]
        outs = m(torch.randn(1, 3, 224, 225))
        assert [tuple(o.shape[1:]) for o in outs] == [(64, 56, 57), (128, 28, 29), (256, 14, 15), (512, 7, 8)]


def test_key_count_per_stage_follows_ceil():
    """N' = ceil(H / sr) * ceil(W / sr) keys in every stage (sr 8, 4, 2, 1)."""
    m = tiny().eval()
    seen = []
    for stage in m.layers:
        stage.blocks[0].attn.kv.register_forward_hook(lambda mod, inp, out: seen.append(out.shape[1]))
    with torch.no_grad():
        m(torch.randn(1, 3, 250, 330))
    hw = [(63, 83), (32, 42), (16, 21), (8, 11)]
    assert seen == [math.ceil(h / s) * math.ceil(w / s) for (h, w), s in zip(hw, (8, 4, 2, 1))]


def test_out_indices_and_out_channels():
    m = tiny(out_indices=(1, 3)).eval()
    outs = m(torch.randn(1, 3, 64, 64))
    assert [o.shape[1] for o in outs] == [32, 64] == m.out_channels
    assert hasattr(m, 'norm1') and hasattr(m, 'norm3') and not hasattr(m, 'norm0')


# ---------------------------------------------------------------- EMSA


def test_single_head_stage_skips_conv_and_instance_norm(monkeypatch):
    m = tiny()
    assert all(not hasattr(b.attn, 'transform_conv') and not b.attn.apply_transform for b in m.layers[0].blocks)
    assert all(b.attn.apply_transform for s in m.layers[1:] for b in s.blocks)
    keys = m.state_dict().keys()
    assert not any(k.startswith('layers.0.') and 'transform_conv' in k for k in keys)
    assert 'layers.1.blocks.0.attn.transform_conv.weight' in keys
    assert 'layers.3.blocks.0.attn.sr.weight' not in keys and 'layers.2.blocks.0.attn.sr_norm.weight' in keys
    # the multi-head form is IN(softmax(conv(S))), the single-head form softmax(S): float64 references
    torch.manual_seed(0)
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    for m in (EMSA(16, 1, 2, qkv_bias=True).double(), EMSA(16, 2, 2, qkv_bias=True).double()):
        seen = []
        m.proj.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
        m(x, (4, 4))
        q = m.q(x).reshape(2, 16, m.num_heads, -1).transpose(1, 2)
        t = m.sr_norm(m.sr(x.transpose(1, 2).reshape(2, 16, 4, 4)).flatten(2).transpose(1, 2))
        k, v = m.kv(t).reshape(2, 4, 2, m.num_heads, -1).permute(2, 0, 3, 1, 4)
        ref = emsa_attention_naive(q, k, v, m.scale, m.transform_conv if m.num_heads > 1 else None)
        torch.testing.assert_close(seen[0], ref.transpose(1, 2).reshape(2, 16, 16), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the memory-saving path (ops: tests/ops/test_emsa.py)
@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_backbone_pieces_equal_whole_maps_values_and_grads(dtype, tol):
    """Whole backbone, train mode: outputs and every parameter gradient. Tolerances are relative to the
    largest output / gradient: some gradients are zero up to rounding (a conv bias before a BatchNorm, the
    head-mixing conv bias under the softmax), so a per-tensor relative check would compare rounding noise."""
    torch.manual_seed(0)
    dense = tiny(fast_train=False).to(dtype).train()
    pieces = tiny(memory_policy=dict(max_elems=97)).to(dtype)
    pieces.load_state_dict(dense.state_dict())
    pieces.train()
    x = torch.randn(2, 3, 70, 90, dtype=dtype)
    od, oc = dense(x), pieces(x)
    for a, b in zip(od, oc):
        torch.testing.assert_close(b, a, rtol=0, atol=tol * a.abs().max().item() * 10)
    sum(o.square().sum() for o in od).backward()
    sum(o.square().sum() for o in oc).backward()
    scale = max(p.grad.abs().max().item() for p in dense.parameters())
    for (name, p), q in zip(dense.named_parameters(), pieces.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=tol * scale, msg=name)


# ---------------------------------------------------------------- output norm placement
def test_norm_in_path_feeds_normalised_maps_forward():
    side = tiny().eval()
    inpath = tiny(norm_in_path=True).eval()
    inpath.load_state_dict(side.state_dict())
    with torch.no_grad():
        for i in range(3):
            getattr(side, f'norm{i}').weight.uniform_(0.5, 1.5)
            getattr(side, f'norm{i}').bias.uniform_(-1, 1)
        inpath.load_state_dict(side.state_dict())
        x = torch.randn(1, 3, 64, 96)
        a, b = side(x), inpath(x)
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)   # stage 1 is the same
        assert (a[1] - b[1]).abs().max() > 1e-2                    # later stages see normalised inputs
        # the in-path stage 2 = side-branch stage 2 run on norm0(stage 1)
        y = side.layers[1].patch_embed(b[0])
        hw = y.shape[-2:]
        t = y.flatten(2).transpose(1, 2)
        for blk in side.layers[1].blocks:
            t = blk(t, hw)
        ref = side.norm1(t).transpose(1, 2).reshape(b[1].shape)
        torch.testing.assert_close(b[1], ref, rtol=1e-5, atol=1e-5)
        # with only the last stage returned both placements agree (the classification features)
        s4 = tiny(out_indices=(3,)).eval()
        i4 = tiny(out_indices=(3,), norm_in_path=True).eval()
        sd = {k: v for k, v in side.state_dict().items() if not re.match(r'norm[012]\.', k)}
        s4.load_state_dict(sd)
        i4.load_state_dict(sd)
        torch.testing.assert_close(s4(x)[0], i4(x)[0], rtol=0, atol=0)
        torch.testing.assert_close(s4(x)[0], a[3], rtol=0, atol=0)


# ---------------------------------------------------------------- freezing, norm_eval, with_cp
def bn_stats(mod):
    return [b.running_mean.clone() for b in mod.modules() if isinstance(b, torch.nn.BatchNorm2d)]


def test_frozen_stages_really_freeze():
    m = tiny(frozen_stages=2)
    m.train()
    frozen = [m.patch_embed, m.layers[0], m.layers[1], m.norm0, m.norm1]
    live = [m.layers[2], m.layers[3], m.norm2, m.norm3]
    for mod in frozen:
        assert not mod.training and all(not p.requires_grad for p in mod.parameters())
    for mod in live:
        assert mod.training and all(p.requires_grad for p in mod.parameters())
    before_frozen = bn_stats(m.patch_embed) + bn_stats(m.layers[1])
    before_live = bn_stats(m.layers[2])
    assert len(before_frozen) == 3 and len(before_live) == 1  # stem BN x2, patch-embed BN of stage 2; stage 3
    sum(o.sum() for o in m(torch.randn(2, 3, 64, 64))).backward()
    after = bn_stats(m.patch_embed) + bn_stats(m.layers[1])
    assert all(torch.equal(a, b) for a, b in zip(before_frozen, after))
    assert not all(torch.equal(a, b) for a, b in zip(before_live, bn_stats(m.layers[2])))
    assert all(p.grad is None for mod in frozen for p in mod.parameters())
    assert m.layers[2].patch_embed.conv.weight.grad is not None
    assert m.layers[2].blocks[0].attn.q.weight.grad is not None
    # train() again (as the runner does) keeps them frozen
    m.train()
    assert not m.layers[1].patch_embed.norm.training


@pytest.mark.parametrize('frozen', [0, 4])
def test_frozen_stem_and_all(frozen):
    m = tiny(frozen_stages=frozen).train()
    assert all(not p.requires_grad for p in m.patch_embed.parameters())
    assert all(p.requires_grad for p in m.layers[0].parameters()) == (frozen == 0)
    with pytest.raises(ValueError, match='frozen_stages'):
        tiny(frozen_stages=5)


def test_norm_eval_keeps_batchnorm_statistics():
    m = tiny(norm_eval=True).train()
    bns = [x for x in m.modules() if isinstance(x, torch.nn.BatchNorm2d)]
    assert len(bns) == 5 and all(not bn.training for bn in bns)
    before = [bn.running_var.clone() for bn in bns]
    m(torch.randn(2, 3, 64, 64))
    assert all(torch.equal(a, bn.running_var) for a, bn in zip(before, bns))
    assert m.layers[1].blocks[0].training  # only the BNs
    m2 = tiny().train()
    before = m2.patch_embed.conv1.norm.running_var.clone()
    m2(torch.randn(2, 3, 64, 64))
    assert not torch.equal(before, m2.patch_embed.conv1.norm.running_var)


@pytest.mark.parametrize('piece', [None, 97])
def test_with_cp_same_output_and_grads(piece):
    kw = dict(fast_train=False) if piece is None else dict(memory_policy=dict(max_elems=piece))
    assert_with_cp_matches(lambda **extra: tiny(**kw, **extra))


def test_with_cp_recomputes_the_stem():
    """With `with_cp` the stem's first map (its first conv's output, (B, C/2, H/2, W/2)) is not kept for
    backward."""
    assert_with_cp_recomputes_chains(tiny, [(2, TINY_REST['embed_dims'][0] // 2, 32, 32)], [])


def test_drop_path_schedule():
    m = ResT('small', drop_path_rate=0.1)
    probs = [getattr(blk.drop_path, 'drop_prob', 0.) for s in m.layers for blk in s.blocks]
    assert len(probs) == 12 and probs[0] == 0 and probs[-1] == pytest.approx(0.1)
    assert probs == pytest.approx([0.1 * i / 11 for i in range(12)])


# ---------------------------------------------------------------- parameter counts, registries, errors
@pytest.mark.parametrize('arch', ['lite', 'small', 'base', 'large'])
def test_param_counts(arch):
    """The authors' classification model minus its 1000-way head; + LN(C_i) per extra output stage."""
    with torch.device('meta'):
        m = ResT(arch, out_indices=(3,))
        m4 = ResT(arch)
    head = C4[arch] * 1000 + 1000
    assert n_params(m) == CLS_PARAMS[arch] - head
    assert n_params(m4) == CLS_PARAMS[arch] - head + 2 * sum(DIMS[arch][:3])


def test_det_param_count_small_matches_reference():
    with torch.device('meta'):
        assert n_params(ResT('small')) == 13_167_604  # reference: det Small 13.168 M with 4 outputs
        assert n_params(ResT('small', out_indices=(1, 2, 3))) == 13_167_476  # 3 outputs: 13.167 M


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg', 'mmpretrain'])
def test_build_from_each_registry(scope):
    import importlib
    registry = importlib.import_module(f'{scope}.registry').MODELS
    m = registry.build(dict(type='ResT', arch=TINY_REST, out_indices=(1, 2, 3)))
    assert isinstance(m, ResT) and m.out_channels == [32, 48, 64]


def test_arch_errors():
    with pytest.raises(ValueError, match=r"unknown arch 'huge'.*'large'"):
        ResT(arch='huge')
    with pytest.raises(ValueError, match='missing'):
        ResT(arch=dict(embed_dims=[8, 16, 32, 64]))
    with pytest.raises(ValueError, match='one entry per stage'):
        ResT(arch=dict(TINY_REST, sr_ratios=[8, 4, 2]))
    with pytest.raises(ValueError, match=r'expects images \(B, 3, H, W\)'):
        tiny()(torch.randn(1, 4, 32, 32))


# ---------------------------------------------------------------- the authors' checkpoints
def authors_layout(sd, c4, head=True):
    """Our state dict -> the authors' classification keys (docs/rest.md), written independently of
    ResT.convert_state_dict."""
    out = {}
    for k, v in sd.items():
        if re.match(r'norm[012]\.', k):
            continue
        k2 = re.sub(r'^patch_embed\.conv([12])\.conv\.', r'stem.conv\1.', k)
        k2 = re.sub(r'^patch_embed\.conv([12])\.norm\.', r'stem.norm\1.', k2)
        k2 = re.sub(r'^patch_embed\.', 'stem.', k2)
        k2 = re.sub(r'^layers\.(\d)\.patch_embed\.', lambda m: f'patch_embed_{int(m.group(1)) + 1}.', k2)
        k2 = re.sub(r'^layers\.(\d)\.blocks\.', lambda m: f'stage{int(m.group(1)) + 1}.', k2)
        k2 = re.sub(r'^norm3\.', 'norm.', k2)
        out[k2] = v.clone()
    if head:
        out['head.weight'] = torch.randn(1000, c4)
        out['head.bias'] = torch.randn(1000)
    return out


def randomised(m):
    with torch.no_grad():
        for t in m.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5)
    return m


def test_authors_layout_key_names_and_counts():
    """Key names and counts of the authors' checkpoints (docs/rest.md, Architecture: Small 274, Lite 194,
    Large 514 keys), produced from our layout."""
    for arch, count in (('small', 274), ('lite', 194), ('large', 514)):
        with torch.device('meta'):
            sd = authors_layout(ResT(arch).state_dict(), C4[arch], head=False)
        assert len(sd) + 2 == count, arch
    with torch.device('meta'):
        sd = authors_layout(ResT('small').state_dict(), 512, head=False)
    for k in ('stem.conv1.weight', 'stem.norm1.running_mean', 'stem.conv3.weight', 'stem.pos.pa_conv.bias',
              'patch_embed_2.conv.bias', 'patch_embed_4.norm.num_batches_tracked', 'patch_embed_3.pos.pa_conv.weight',
              'stage1.1.attn.sr_norm.weight', 'stage3.5.mlp.fc2.bias', 'stage4.1.attn.kv.weight', 'norm.weight'):
        assert k in sd, k
    assert tuple(sd['stage1.0.attn.sr.weight'].shape) == (64, 1, 9, 9)
    assert tuple(sd['stage2.0.attn.kv.weight'].shape) == (256, 128)
    assert tuple(sd['stage3.0.attn.transform_conv.weight'].shape) == (4, 4, 1, 1)
    assert not any(k.startswith('stage4.') and '.sr' in k for k in sd)
    assert not any(k.startswith('stage1.') and 'transform_conv' in k for k in sd)
    assert 'stem.conv1.bias' not in sd and 'stem.norm3.weight' not in sd


@pytest.fixture
def authors_file(tmp_path):
    src = randomised(tiny())
    sd = authors_layout(src.state_dict(), 64)
    path = tmp_path / 'rest_tiny.pth'
    torch.save({'model': sd, 'optimizer': {'state': {}}, 'epoch': 299, 'max_accuracy': 79.6}, path)
    return src, sd, path


def test_pretrained_loads_authors_classification_file(authors_file):
    src, sd, path = authors_file
    m = tiny(init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    m.init_weights()
    own = m.state_dict()
    for k, v in src.state_dict().items():
        if not re.match(r'norm[012]\.', k):
            assert torch.equal(own[k], v), k
    assert torch.equal(own['norm3.weight'], sd['norm.weight'])
    for i, c in enumerate(TINY_REST['embed_dims'][:3]):  # new output norms keep their 1/0 init
        assert torch.equal(own[f'norm{i}.weight'], torch.ones(c)) and torch.equal(own[f'norm{i}.bias'],
                                                                                  torch.zeros(c))
    # RetinaNet-style outputs: no norm0 to fill, still strict on everything else
    r = tiny(out_indices=(1, 2, 3), init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    r.init_weights()
    assert torch.equal(r.norm3.bias, sd['norm.bias'])


def test_pretrained_loads_detectron2_files(authors_file, tmp_path):
    _, sd, _ = authors_file
    d2 = {f'backbone.bottom_up.{k}': v for k, v in sd.items() if not k.startswith('head.')}
    d2.update({f'backbone.bottom_up.norm{i}.weight': torch.full((c,), float(i)) for i, c in
               ((1, 16), (2, 32), (3, 48))})
    d2.update({f'backbone.bottom_up.norm{i}.bias': torch.zeros(c) for i, c in ((1, 16), (2, 32), (3, 48))})
    d2['roi_heads.box_head.fc1.weight'] = torch.zeros(4, 4)
    path = tmp_path / 'model_final.pth'
    torch.save({'model': d2, 'iteration': 90000}, path)
    m = tiny(norm_in_path=True, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    m.init_weights()
    assert torch.equal(m.norm0.weight, torch.full((16,), 1.)) and torch.equal(m.norm2.weight, torch.full((48,), 3.))
    assert torch.equal(m.norm3.weight, sd['norm.weight'])
    # convert_to_d2.py output: a flat dict, every key under backbone.bottom_up. (no norm1-3)
    flat = tmp_path / 'd2_pretrain.pth'
    torch.save({f'backbone.bottom_up.{k}': v for k, v in sd.items()}, flat)
    m = tiny(init_cfg=dict(type='Pretrained', checkpoint=str(flat)))
    m.init_weights()
    assert torch.equal(m.layers[2].blocks[1].attn.kv.weight, sd['stage3.1.attn.kv.weight'])


def test_pretrained_wrong_size_fails_loudly(authors_file, tmp_path):
    _, sd, path = authors_file
    m = ResT(arch=dict(TINY_REST, depths=[1, 1, 3, 1]), init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.raises(ValueError, match=r'does not fit ResT[\s\S]*missing keys: layers\.2\.blocks\.2'):
        m.init_weights()
    m = ResT(arch=dict(TINY_REST, embed_dims=[16, 32, 48, 72]),
             init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.raises(ValueError, match=r'shape mismatches: .*layers\.3'):
        m.init_weights()
    bad = dict(sd, **{'stage5.0.attn.q.weight': torch.zeros(1), 'pos_embed': torch.zeros(1)})
    torch.save({'model': bad}, tmp_path / 'bad.pth')
    m = tiny(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'bad.pth')))
    with pytest.raises(ValueError, match=r'2 unexpected keys: layers\.4\.blocks\.0\.attn\.q\.weight, pos_embed'):
        m.init_weights()


def run_tool(*args):
    return subprocess.run([sys.executable, f'{ROOT}/tools/convert_checkpoint.py', *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


def test_convert_tool_real_lite(tmp_path):
    src = ResT('lite')
    sd = authors_layout(src.state_dict(), 512)
    path = tmp_path / 'rest_lite.pth'
    torch.save({'model': sd, 'epoch': 299}, path)
    dst = tmp_path / 'cls.pth'
    r = run_tool(path, dst, '--model', 'ResT', '--arch', 'lite', '--target', 'mmpretrain')
    assert r.returncode == 0, r.stderr
    out = torch.load(dst, weights_only=True)['state_dict']
    assert torch.equal(out['head.fc.weight'], sd['head.weight'])
    assert torch.equal(out['backbone.norm3.weight'], sd['norm.weight'])
    assert torch.equal(out['backbone.patch_embed.conv1.norm.running_var'], sd['stem.norm1.running_var'])
    assert torch.equal(out['backbone.layers.3.blocks.1.attn.kv.bias'], sd['stage4.1.attn.kv.bias'])
    assert len(out) == len(sd)  # every key has a place: 192 backbone + 2 head
    bb = tmp_path / 'bb.pth'
    r = run_tool(path, bb, '--model', 'ResT', '--arch', 'lite')
    assert r.returncode == 0, r.stderr
    m = ResT('lite', init_cfg=dict(type='Pretrained', checkpoint=str(bb)))
    m.init_weights()
    assert torch.equal(m.layers[2].blocks[0].attn.transform_conv.weight, sd['stage3.0.attn.transform_conv.weight'])
    r = run_tool(path, dst, '--model', 'ResT', '--arch', 'small')
    assert r.returncode != 0 and 'missing keys: layers.2.blocks.2' in r.stderr
