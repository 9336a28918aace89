"""Visualisation (mmplugin_l2/analysis/vis.py, erf.py, cam.py; tools/analysis/vis_attention.py, erf.py): each
map against a hand computation, the tools on tiny models and 64x64 images (docs/visualization.md)."""
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import ROOT, TINY_HVIT3, TINY_L2VIT, TINY_REST, analysis_tool

from mmplugin_l2.analysis import erf, vis
from mmplugin_l2.models.backbones import HViT3, L2ViT, ResT
from mmplugin_l2.models.layers import LinearAttention, WindowAttention


def _randomize_norms(model):
    """Norms away from 1/0 and BN statistics away from 0/1, so that every term of a map matters."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)):
            m.weight.data = 1 + 0.3 * torch.randn(m.weight.shape, generator=g)
            m.bias.data = 0.3 * torch.randn(m.bias.shape, generator=g)
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean = 0.3 * torch.randn(m.running_mean.shape, generator=g)
            m.running_var = 0.5 + torch.rand(m.running_var.shape, generator=g)
    return model.eval()


_tool = analysis_tool


def _images(folder, n=2, size=64):
    from PIL import Image
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for k in range(n):
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f'img{k}.png')
    return sorted(str(p) for p in folder.iterdir())


# ---- the maps against hand computations -----------------------------------------------------------
def test_lwa_map_of_a_single_window_is_the_softmax_row_by_hand():
    attn = WindowAttention(8, 2, window_size=4).eval()
    x = torch.randn(1, 16, 8)                       # a 4x4 map: one window
    r = vis.lwa_map(attn, x, (4, 4), (1, 2))
    qkv = x[0].double() @ attn.qkv.weight.double().T + attn.qkv.bias.double()
    i = 1 * 4 + 2
    for h in range(2):
        q, k = qkv[:, h * 4:h * 4 + 4], qkv[:, 8 + h * 4:8 + h * 4 + 4]
        logits = torch.tensor([float((q[i] @ k[j]).detach()) * 4 ** -0.5 for j in range(16)], dtype=torch.float64)
        assert torch.allclose(r['map'][h].reshape(-1), logits.softmax(0), atol=1e-12)
    assert float(r['padding_mass'].abs().max()) == 0
    with torch.no_grad():
        assert torch.allclose(r['out'].float(), attn(x, (4, 4))[0, i], atol=1e-5)


def test_lwa_map_in_the_backbone_and_window_padding():
    """A 64x64 image on a window-4 L2ViT: stage 3 (index 2) is a 4x4 map, one window; stage 1 (16x16) has
    16 windows; a 5x5 map (80x80) pads its border windows, and `mask_padding` takes the padding out."""
    m = _randomize_norms(L2ViT(arch=dict(TINY_L2VIT, window_size=4), drop_path_rate=0.))
    res = vis.layer_maps(m, torch.randn(1, 3, 64, 64), ['stages.2.0', 'stages.0.0'], lambda n, hw: (1, 2))
    for r in res:
        amap = r['panels'][0][1]
        assert torch.allclose(r['out']['attn'], r['ref']['attn'], atol=1e-5)
        assert torch.allclose(amap.sum(dim=(1, 2)), torch.ones(amap.shape[0], dtype=torch.float64))
    assert res[1]['panels'][0][1][:, 4:].abs().max() == 0     # outside the query's window
    attn = WindowAttention(8, 2, window_size=4).eval()
    x = torch.randn(1, 25, 8)
    r = vis.lwa_map(attn, x, (5, 5), (4, 4))                   # corner window: 1 real token, 15 padded
    assert 0 < float(r['padding_mass'].min()) < 1
    assert torch.allclose(r['map'].sum(dim=(1, 2)) + r['padding_mass'], torch.ones(2, dtype=torch.float64))
    attn.mask_padding = True
    r = vis.lwa_map(attn, x, (5, 5), (4, 4))
    assert torch.allclose(r['map'][:, 4, 4], torch.ones(2, dtype=torch.float64))
    with torch.no_grad():
        assert torch.allclose(r['out'].float(), attn(x, (5, 5))[0, 24], atol=1e-5)


@pytest.mark.parametrize('clamp', [100., 1e-6])
def test_lga_row_equals_an_explicit_loop(clamp):
    attn = LinearAttention(8, 2, clamp_min=clamp).eval()
    attn.temperature.data = torch.tensor([0.7, 1.3]).view(2, 1, 1)
    x = 3 * torch.randn(1, 12, 8)
    r = vis.lga_map(attn, x, (3, 4), (2, 1))
    qkv = (x[0].double() @ attn.qkv.weight.double().T + attn.qkv.bias.double()).tolist()
    i = 2 * 4 + 1
    for h in range(2):
        def feat(j, part):
            return [max(v, 0.) for v in qkv[j][part * 8 + h * 4: part * 8 + h * 4 + 4]]
        dots = [sum(a * b for a, b in zip(feat(i, 0), feat(j, 1))) for j in range(12)]
        row = [float(attn.temperature[h].detach()) * s / max(sum(dots), clamp) for s in dots]
        assert np.allclose(r['map'][h].reshape(-1).numpy(), row, atol=1e-12, rtol=1e-10)
    with torch.no_grad():
        assert torch.allclose(r['out'].float(), attn(x)[0, i], atol=1e-5)


def _lga_block(hw=(6, 5)):
    m = _randomize_norms(L2ViT(arch=TINY_L2VIT, drop_path_rate=0.))
    blk = dict(m.named_modules())['stages.1.1']
    with torch.no_grad():   # an LCM that matters: the authors' init (std 0.02) leaves it near zero
        for conv in (blk.local_mp.conv1, blk.local_mp.conv2):
            conv.weight.normal_(0, 0.3)
    x = torch.randn(1, hw[0] * hw[1], 32)
    x_mid = torch.randn(1, hw[0] * hw[1], 32)
    return blk, x, x_mid


def test_lga_after_lcm_is_the_projected_value_jacobian():
    """r_h(j) = <du_i/dv^h_j, W^h> / ||W^h||^2 with the attention weights fixed, computed here by autograd
    through the whole branch; without LCM (zero conv) it is the row before LCM."""
    blk, x, x_mid = _lga_block()
    hw, (ty, tx) = (6, 5), (2, 3)
    i = ty * hw[1] + tx
    r = vis.lga_lcm_map(blk.attn, blk.norm3, blk.local_mp, x, x_mid, hw, (ty, tx))
    m = vis._f64(blk.attn)
    norm = vis._f64(blk.norm3)
    lm = vis._f64(blk.local_mp)

    def lcm(t, hw):   # LCM by hand: dwconv7 -> GELU -> BN (eval: per-channel affine) -> dwconv7
        y = t[0].T.reshape(1, 32, *hw)
        y = F.gelu(F.conv2d(y, lm.conv1.weight, lm.conv1.bias, padding=3, groups=32))
        bn = lm.bn
        y = (y - bn.running_mean[:, None, None]) / torch.sqrt(bn.running_var[:, None, None] + bn.eps) \
            * bn.weight[:, None, None] + bn.bias[:, None, None]
        y = F.conv2d(y, lm.conv2.weight, lm.conv2.bias, padding=3, groups=32)
        return y.flatten(2).transpose(1, 2)
    a, v = vis._lga_rows(m, x.double(), list(range(30)))              # (nh, N, N), (nh, N, d)
    v = v.detach().requires_grad_()
    o = torch.einsum('hpn,hnd->phd', a, v).reshape(30, 32)
    # x' as the model had it, as a function of v with A fixed: x_mid - proj(A v_actual) + proj(A v)
    xp = x_mid[0].double() + (o - o.detach()) @ m.proj.weight.T
    u = xp + lcm(norm(xp)[None], hw)[0]
    wp = m.proj.weight
    for h in range(2):
        wh = wp[:, h * 16:(h + 1) * 16]
        # sum_c,k W_ck du_ic / dv_jk: one backward pass per value channel k
        ref = sum(torch.autograd.grad(u[i] @ wh[:, k], v, retain_graph=True)[0][h, :, k] for k in range(16))
        ref = ref / wh.square().sum()
        assert torch.allclose(r['map'][h].reshape(-1), ref, atol=1e-12, rtol=1e-9)
    assert (r['map'] - r['before']).abs().max() > 1e-3 * r['before'].abs().max()
    generic = vis.lga_lcm_map(blk.attn, blk.norm3, blk.local_mp, x, x_mid, hw, (ty, tx), generic=True)
    assert torch.allclose(r['map'], generic['map'], atol=1e-14, rtol=1e-10)
    with torch.no_grad():
        blk.local_mp.conv2.weight.zero_()
        blk.local_mp.conv2.bias.zero_()
    r0 = vis.lga_lcm_map(blk.attn, blk.norm3, blk.local_mp, x, x_mid, hw, (ty, tx))
    assert torch.allclose(r0['map'], r0['before'], atol=1e-15)


def test_emsa_rows_single_head_softmax_and_instance_norm():
    m = _randomize_norms(ResT(arch=TINY_REST, drop_path_rate=0.))
    x = torch.randn(1, 3, 64, 64)
    names = ['layers.0.blocks.0', 'layers.1.blocks.0', 'layers.3.blocks.0']
    res = vis.layer_maps(m, x, names, lambda n, hw: (hw[0] - 1, 0))
    for r in res:
        assert torch.allclose(r['out']['attn'], r['ref']['attn'], atol=1e-5), r['layer']
    single, sr4 = res[0]['panels'][0][1], res[1]['panels'][0][1]
    assert single.shape == (1, 2, 2) and torch.allclose(single.sum(), torch.tensor(1., dtype=torch.float64))
    assert sr4.shape == (2, 2, 2) and res[1]['reduction'] == 4
    # against the whole map by hand: softmax of the mixed logits, then the real nn.InstanceNorm2d
    attn = vis._f64(dict(m.named_modules())['layers.1.blocks.0.attn'])
    seen = vis.capture(m, ['layers.1.blocks.0.attn'], x)
    xin = seen['layers.1.blocks.0.attn']['args'][0].double()
    q = (xin[0] @ attn.q.weight.T + attn.q.bias).view(64, 2, 16).transpose(0, 1)
    xr = attn.sr_norm(attn.sr(xin[0].T.reshape(1, 32, 8, 8)).flatten(2)[0].T)
    k = (xr @ attn.kv.weight[:32].T + attn.kv.bias[:32]).view(4, 2, 16).transpose(0, 1)
    s = torch.einsum('gh,hnm->gnm', attn.transform_conv.weight[:, :, 0, 0], q @ k.transpose(1, 2) * 16 ** -0.5)
    ref = attn.transform_norm((s + attn.transform_conv.bias[:, None, None]).softmax(-1)[None])[0]
    for query in (0, 37, 63):
        row = vis.emsa_map(dict(m.named_modules())['layers.1.blocks.0.attn'], xin.float(), (8, 8),
                           (query // 8, query % 8))['map']
        assert torch.allclose(row.reshape(2, 4), ref[:, query], atol=1e-9, rtol=1e-6)


def test_ttt_map_matches_the_layer_and_vanishes_without_inner_step():
    m = HViT3(arch=TINY_HVIT3, drop_path_rate=0.).eval()
    x = torch.randn(1, 3, 64, 64)
    res = vis.layer_maps(m, x, ['layers.0.blocks.0', 'layers.2.blocks.1'], lambda n, hw: (1, 2))
    for r in res:
        amap = r['panels'][0][1]
        heads = dict(m.named_modules())[r['layer']].num_heads
        assert amap.shape == (heads + 1, *r['hw']) and torch.isfinite(amap).all() and (amap >= 0).all()
        assert (amap > 0).float().mean() > 0.9          # every token's key / value enters the inner step
        assert torch.allclose(r['out']['attn'], r['ref']['attn'], atol=1e-5)
    for blk in m.modules():
        if type(blk).__name__ == 'TTTAttention':
            blk.lr = 0.
    r = vis.layer_maps(m, x, ['layers.0.blocks.0'], lambda n, hw: (1, 2))[0]
    assert float(r['panels'][0][1].abs().max()) == 0
    assert torch.allclose(r['out']['attn'], r['ref']['attn'], atol=1e-5)


def test_bad_layer_and_query_say_what_is_allowed():
    m = L2ViT(arch=TINY_L2VIT, drop_path_rate=0.).eval()
    with pytest.raises(KeyError, match=r'valid layers.*stages\.0\.0\.attn.*stages\.3\.1\.attn'):
        vis.resolve_layer(m, 'stages.9.0')
    assert vis.resolve_layer(m, 'stages.1.1')[0] == 'stages.1.1.attn'
    with pytest.raises(ValueError, match=r'allowed y in \[0, 3\], x in \[0, 3\]'):
        vis.layer_maps(m, torch.randn(1, 3, 64, 64), ['stages.2.0'], lambda n, hw: (4, 0))
    with pytest.raises(ValueError, match=r'allowed y in \[0, 63\], x in \[0, 63\]'):
        vis.pixel_to_token((64, 3), (64, 64), (16, 16))


# ---- tools on tiny configs ------------------------------------------------------------------------
def _tiny_config(tmp_path, family):
    arch = {'l2vit': TINY_L2VIT, 'rest': TINY_REST, 'hvit3': TINY_HVIT3}[family]
    cfg = tmp_path / f'{family}_tiny.py'
    cfg.write_text(f"_base_ = '{ROOT}/configs/mmpretrain/{family}_{'s' if family == 'rest' else 't'}_in1k.py'\n"
                   f"model = dict(backbone=dict(arch=dict(_delete_=True, **{arch!r}), drop_path_rate=0.),\n"
                   f"             head=dict(in_channels={arch['embed_dims'][-1]}))\n")
    return str(cfg)


def test_vis_attention_tool_writes_a_grid_per_image(tmp_path, capsys):
    imgs = _images(tmp_path / 'imgs')
    out = tmp_path / 'out'
    cfg = _tiny_config(tmp_path, 'l2vit')
    tool = _tool('vis_attention')
    written = tool.main([cfg, '--image', *imgs, '--layer', 'stages.2.0', 'stages.1.1', '--query', '40', '20',
                         '--size', '64', '--out', str(out)])
    assert len(written) == 2 and '[  2/2]' in capsys.readouterr().out
    for path in written:
        png = open(path, 'rb').read()
        assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 5000
    res = json.loads((out / 'img0_attention.json').read_text())
    assert [(r['kind'], r['query_token']) for r in res['layers']] == [('lwa', [2, 1]), ('lga', [5, 2])]
    assert res['layers'][1]['maps'] == {'LGA linear (before LCM)': [2, 8, 8], 'LGA linear + LCM': [2, 8, 8]}
    assert all(r['recompute_max_abs_err'] < 1e-4 for r in res['layers'])
    with pytest.raises(KeyError, match='valid layers'):
        tool.main([cfg, '--image', imgs[0], '--layer', 'stages.7', '--query', '0', '0', '--out', str(out)])


def test_erf_of_a_single_conv_is_its_kernel_footprint():
    class OneConv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 5, padding=2)

        def forward(self, x):
            return (self.conv(x),)
    model = OneConv()
    xs = [torch.randn(1, 3, 21, 17) for _ in range(2)]
    g, hw = erf.average_erf(model, xs, 0)
    assert hw == (21, 17)
    ref = np.zeros((21, 17))
    w = model.conv.weight.detach().double()
    for x in xs:   # the ReLU passes the output channels that are positive at the centre
        active = (model(x)[0][0, :, 10, 8] > 0).double()
        ref[8:13, 6:11] += (w * active[:, None, None, None]).sum(0).abs().sum(0).numpy() / len(xs)
    assert np.allclose(g, ref, atol=1e-7, rtol=1e-5)
    centre = erf.centre_pixel((21, 17), hw)
    assert centre == (10, 8)
    mass = erf.mass_within(g, centre, [0, 1, 2, 3])
    assert mass[2] == pytest.approx(1) and mass[3] == pytest.approx(1) and mass[1] < 1 and mass[0] < mass[1]


def test_erf_through_batchnorm_and_tokens_is_local():
    """conv -> BN -> tokens -> LayerNorm (L2ViT's stem): the gradient of one output token stays in the conv's
    3x3 footprint. Without `fix_batchnorm_grad_layout` torch 2.14's CPU BatchNorm backward spreads it over
    whole rows of the input (its output gradient comes back channels-last-strided, its input is NCHW)."""
    class StemLN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.ln = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.LayerNorm(8)

        def forward(self, x):
            y = self.bn(self.conv(x))
            t = self.ln(y.flatten(2).transpose(1, 2))
            return (t.transpose(1, 2).reshape(y.shape),)
    model = _randomize_norms(StemLN())
    g, hw = erf.average_erf(model, [torch.randn(1, 3, 16, 16)], 0)
    assert g.sum() > 0 and erf.mass_within(g, erf.centre_pixel((16, 16), hw), [1])[1] == pytest.approx(1)


def test_erf_tool_ours_and_mmdet_swin(tmp_path, capsys):
    _images(tmp_path / 'imgs', n=2)
    swin = tmp_path / 'swin_tiny.py'
    swin.write_text("_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'\n"
                    "model = dict(backbone=dict(embed_dims=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), "
                    "window_size=4))\n")
    out = tmp_path / 'erf'
    res = _tool('erf').main([_tiny_config(tmp_path, 'hvit3'), str(swin), '--images', str(tmp_path / 'imgs'),
                             '--size', '64', '--names', 'hvit3', 'swin', '--out', str(out)])
    assert '[  4/4]' in capsys.readouterr().out
    js = json.loads((out / 'erf.json').read_text())
    assert [r['name'] for r in js['results']] == ['hvit3', 'swin'] and js['radii'] == [8, 16, 32]
    for r, full in zip(js['results'], res):
        assert r['map_hw'] == [2, 2] and full['erf'].shape == (64, 64) and np.isfinite(full['erf']).all()
        shares = list(r['mass'].values())
        assert all(0 < s <= 1 + 1e-12 for s in shares) and shares == sorted(shares)
    png = (out / 'erf.png').read_bytes()
    assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 5000


# ---- Grad-CAM through pytorch_grad_cam ---------------------------------------------------------------
def test_grad_cam_with_our_reshape_transform(tmp_path):
    pytest.importorskip('pytorch_grad_cam')
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS

    from mmplugin_l2.analysis import cam
    init_default_scope('mmpretrain')
    cfg = Config.fromfile(_tiny_config(tmp_path, 'l2vit'))
    cfg.model.head.num_classes = 5
    model = MODELS.build(cfg.model).eval()
    _randomize_norms(model.backbone)
    x = torch.randn(1, 3, 64, 64)
    layer = cam.default_target_layer(model)
    assert layer == 'backbone.stages.3.1'
    # the transform gives NCHW: tokens of the last block, and the output of the LayerNorm norm3, whose
    # NCHW view is the backbone's output
    reshape = cam.TokenMapReshape().attach(model, [cam.get_layer(model, 'backbone.norm3')])
    got = {}
    hooks = [cam.get_layer(model, n).register_forward_hook(lambda m, a, o, n=n: got.__setitem__(n, o.clone()))
             for n in ('backbone.stages.3.1', 'backbone.norm3')]
    with torch.no_grad():
        feat = model.backbone(x)[-1]
    for h in hooks:
        h.remove()
    reshape.release()
    # the LayerNorm sees channels-last maps (B, h, w, C), which the stock tool would read as NCHW, or tokens
    assert got['backbone.norm3'].shape in ((1, 2, 2, 64), (1, 4, 64))
    assert torch.equal(reshape(got['backbone.norm3']), feat)
    tokens = got['backbone.stages.3.1']
    assert torch.equal(reshape(tokens), tokens.transpose(1, 2).reshape(1, 64, 2, 2))
    grey = cam.grad_cam(model, x, [cam.get_layer(model, layer)], target_category=3)
    assert grey.shape == (1, 64, 64) and np.isfinite(grey).all() and grey.min() >= 0 and grey.max() <= 1
    assert grey.max() > 0
    with pytest.raises(KeyError, match='backbone.stages.3.1'):
        cam.get_layer(model, 'backbone.stage.9')


def test_backbones_declare_no_extra_tokens():
    """mmpretrain's vis_cam.py --vit-like drops `backbone.num_extra_tokens` tokens (1 when the attribute is
    missing); ours have no class token."""
    from mmplugin_l2 import HViT3, L2ViT, ResT, ViT3
    assert all(cls.num_extra_tokens == 0 for cls in (HViT3, ViT3, L2ViT, ResT))
