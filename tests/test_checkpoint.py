"""Loading the authors' checkpoints (init_cfg=Pretrained, tools/convert_checkpoint.py) and the weights_only
allow-list for mmengine's own checkpoints."""
import logging
import subprocess
import sys
import types

import pytest
import torch

from conftest import ROOT, TINY_HVIT3
from mmplugin_l2 import HViT3, ViT3


def authors_state_dict(model, with_cls=True):
    """A state dict in the authors' classification layout: our shared keys, RoPE buffers, BN1d + head."""
    sd = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith('norm')}
    for i, stage in enumerate(model.layers):
        for j, _ in enumerate(stage.blocks):
            sd[f'layers.{i}.blocks.{j}.rope.rotations'] = torch.randn(4, 4, 8, 2)
    c = model.stage_channels[-1]
    if with_cls:
        sd.update({'norm.weight': torch.rand(c), 'norm.bias': torch.randn(c),
                   'norm.running_mean': torch.randn(c), 'norm.running_var': torch.rand(c) + .5,
                   'norm.num_batches_tracked': torch.tensor(7),
                   'head.weight': torch.randn(1000, c), 'head.bias': torch.randn(1000)})
    return sd


def save_with_foreign_object(obj, path):
    """Save like the authors' trainer: the dict also holds an object whose class is not importable
    at load time (their yacs CfgNode)."""
    mod = types.ModuleType('yacs_like_config')

    class CfgNode(dict):
        pass
    CfgNode.__module__ = 'yacs_like_config'
    CfgNode.__qualname__ = 'CfgNode'
    mod.CfgNode = CfgNode
    sys.modules['yacs_like_config'] = mod
    try:
        obj = dict(obj, config=CfgNode(MODEL='h_vittt'))
        torch.save(obj, path)
    finally:
        del sys.modules['yacs_like_config']


@pytest.fixture
def authors_file(tmp_path):
    src = HViT3(arch=TINY_HVIT3)
    with torch.no_grad():
        for p in src.parameters():
            p.normal_()
    sd = authors_state_dict(src)
    path = tmp_path / 'authors.pth'
    save_with_foreign_object({'model': sd, 'state_dict_ema': {k: v + 1 for k, v in sd.items()},
                              'epoch': 3, 'max_accuracy': 0.5}, path)
    return src, sd, path


def test_pretrained_loads_authors_file(authors_file):
    src, sd, path = authors_file
    m = HViT3(arch=TINY_HVIT3, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.warns(UserWarning, match='beyond tensors'):
        m.init_weights()
    own = m.state_dict()
    for k, v in src.state_dict().items():
        if not k.startswith('norm'):
            assert torch.equal(own[k], v), k
    # new output LayerNorms keep their 1/0 init
    assert torch.equal(own['norm0.weight'], torch.ones(16)) and torch.equal(own['norm3.bias'], torch.zeros(64))


def test_pretrained_classifier_norm_goes_to_norm3(authors_file):
    _, sd, path = authors_file
    m = HViT3(arch=TINY_HVIT3, out_indices=(3,), out_norm_cfg=dict(type='BN'),
              init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.warns(UserWarning):
        m.init_weights()
    for name in ('weight', 'bias', 'running_mean', 'running_var'):
        assert torch.equal(getattr(m.norm3, name), sd[f'norm.{name}'])


def test_pretrained_wrong_size_lists_keys(authors_file, tmp_path):
    _, sd, _ = authors_file
    path = tmp_path / 'clean.pth'
    torch.save({'model': sd}, path)
    m = HViT3(arch=dict(TINY_HVIT3, depths=[1, 1, 3, 1]),
              init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.raises(ValueError, match=r'does not fit HViT3[\s\S]*missing keys: layers\.2\.blocks\.2'):
        m.init_weights()
    bad = dict(sd)
    bad['layers.0.blocks.0.attn.w1'] = torch.zeros(1, 1, 8, 8)
    bad['something.else'] = torch.zeros(1)
    torch.save({'model': bad}, path)
    m = HViT3(arch=TINY_HVIT3, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    with pytest.raises(ValueError, match=r'unexpected keys: something\.else[\s\S]*shape mismatches: '
                                         r'layers\.0\.blocks\.0\.attn\.w1'):
        m.init_weights()


class _Records(logging.Handler):
    """Collects the messages of MMEngine's current logger (what init_weights reports)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_pretrained_non_strict_skips_a_wrong_size_tensor(authors_file, tmp_path):
    """strict=False with a tensor of the wrong size and a key the model lacks: the wrong-size tensor is not
    loaded (the model keeps its own value), everything else that fits is, and one warning names both."""
    from mmengine.logging import MMLogger
    src, sd, _ = authors_file
    wrong = 'layers.0.blocks.0.attn.qkv.weight'
    assert wrong in sd, sorted(sd)[:20]
    bad = dict(sd)
    bad[wrong] = torch.randn(sd[wrong].shape[0] + 3, sd[wrong].shape[1])
    bad['extra.weight'] = torch.zeros(3)
    path = tmp_path / 'wrong_size.pth'
    torch.save({'model': bad}, path)
    m = HViT3(arch=TINY_HVIT3, init_cfg=dict(type='Pretrained', checkpoint=str(path), strict=False))
    before = m.state_dict()[wrong].clone()
    logger, handler = MMLogger.get_current_instance(), _Records()
    logger.addHandler(handler)
    try:
        m.init_weights()
    finally:
        logger.removeHandler(handler)
    own = m.state_dict()
    assert torch.equal(own[wrong], before) and not torch.equal(own[wrong][:before.shape[0]], bad[wrong][:before.shape[0]])
    for k, v in src.state_dict().items():
        if k != wrong and not k.startswith('norm'):
            assert torch.equal(own[k], v), k
    warnings_ = [r.getMessage() for r in handler.records if r.levelno == logging.WARNING]
    assert len(warnings_) == 1, [r.getMessage() for r in handler.records]
    msg = warnings_[0]
    shape = tuple(bad[wrong].shape), tuple(before.shape)
    assert f'1 shape mismatches: {wrong}: checkpoint {shape[0]} vs model {shape[1]}' in msg, msg
    assert '1 unexpected keys: extra.weight' in msg and 'missing keys' not in msg, msg
    assert 'strict=False: loading the keys that fit, the others keep their initialisation.' in msg, msg


def test_pretrained_missing_file():
    m = HViT3(arch=TINY_HVIT3, init_cfg=dict(type='Pretrained', checkpoint='/nonexistent/x.pth'))
    with pytest.raises(FileNotFoundError, match='/nonexistent/x.pth'):
        m.init_weights()


def test_pretrained_accepts_mmdet_checkpoint(tmp_path):
    src = HViT3(arch=TINY_HVIT3)
    with torch.no_grad():
        for p in src.parameters():
            p.uniform_()
    path = tmp_path / 'det.pth'
    torch.save({'state_dict': {f'backbone.{k}': v for k, v in src.state_dict().items()} |
                {'neck.conv.weight': torch.zeros(1)}, 'meta': {}}, path)
    m = HViT3(arch=TINY_HVIT3, init_cfg=dict(type='Pretrained', checkpoint=str(path), prefix='backbone.'))
    m.init_weights()
    for k, v in src.state_dict().items():
        assert torch.equal(m.state_dict()[k], v)


def run_tool(*args):
    return subprocess.run([sys.executable, f'{ROOT}/tools/convert_checkpoint.py', *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT)


def test_convert_tool_backbone_and_mmpretrain(authors_file, tmp_path):
    src, sd, path = authors_file
    dst = tmp_path / 'bb.pth'
    # a custom arch is not a named one: convert against tiny must fail and list the keys
    r = run_tool(path, dst, '--model', 'HViT3', '--arch', 'tiny')
    assert r.returncode != 0 and 'does not fit HViT3' in r.stderr and not dst.exists()
    from mmplugin_l2.checkpoint.convert import convert_checkpoint
    import mmplugin_l2.checkpoint.convert as conv
    orig = conv.build_backbone
    conv.build_backbone = lambda t, a, target: HViT3(
        arch=TINY_HVIT3, **conv.CLASSIFIER_BACKBONE[t] if target == 'mmpretrain' else {})
    try:
        with pytest.warns(UserWarning):
            out = convert_checkpoint(path, 'HViT3', 'custom', 'mmpretrain')
        with pytest.warns(UserWarning):
            ema = convert_checkpoint(path, 'HViT3', 'custom', 'backbone', ema=True)
    finally:
        conv.build_backbone = orig
    assert torch.equal(out['state_dict']['head.fc.weight'], sd['head.weight'])
    assert torch.equal(out['state_dict']['backbone.norm3.running_mean'], sd['norm.running_mean'])
    assert not any('rope' in k for k in out['state_dict'])
    k = 'layers.0.blocks.0.attn.w3'
    assert torch.equal(ema['state_dict'][k], sd[k] + 1)
    torch.save(out, dst)
    # the converted file loads with torch's safe loader
    assert 'head.fc.bias' in torch.load(dst, weights_only=True)['state_dict']


def test_convert_tool_real_arch(tmp_path):
    src = ViT3(arch='tiny')
    sd = {k: v for k, v in src.state_dict().items()}
    sd.update({'head.weight': torch.randn(1000, 192), 'head.bias': torch.randn(1000)})
    path = tmp_path / 'vit3_t.pth'
    torch.save({'model': sd}, path)
    dst = tmp_path / 'cls.pth'
    r = run_tool(path, dst, '--model', 'ViT3', '--arch', 'tiny', '--target', 'mmpretrain')
    assert r.returncode == 0, r.stderr
    out = torch.load(dst, weights_only=True)['state_dict']
    assert torch.equal(out['head.fc.weight'], sd['head.weight'])
    assert torch.equal(out['backbone.blocks.11.attn.w1'], sd['blocks.11.attn.w1'])
    r = run_tool(path, dst, '--model', 'ViT3', '--arch', 'small')
    assert r.returncode != 0 and 'shape mismatches' in r.stderr


def test_mmengine_types_are_allow_listed(tmp_path):
    """What mmengine pickles into a checkpoint's meta loads with weights_only=True."""
    import numpy as np
    from mmengine.logging import HistoryBuffer, MessageHub
    hub = MessageHub.get_instance('test_allow_list')
    hub.update_scalar('train/loss', np.float64(0.5))
    hub.update_scalar('train/lr', 1e-3)
    hub.update_info('iter', 3)
    obj = {'meta': {'message_hub': hub.state_dict(), 'seed': np.int64(3),
                    'arr': np.arange(3, dtype=np.float32)}, 'state_dict': {}}
    path = tmp_path / 'mm.pth'
    torch.save(obj, path)
    out = torch.load(path, weights_only=True)
    assert isinstance(out['meta']['message_hub']['log_scalars']['train/loss'], HistoryBuffer)


class _Escalate:
    """Pickles as getattr(numpy.ndarray, 'tofile'): what a malicious file could use getattr for."""

    def __reduce__(self):
        import numpy as np
        return getattr, (np.ndarray, 'tofile')


def test_getattr_stays_restricted(tmp_path):
    path = tmp_path / 'evil.pth'
    torch.save({'x': _Escalate()}, path)
    with pytest.raises(Exception, match='not allowed'):
        torch.load(path, weights_only=True)


def test_mmpretrain_classifier_reproduces_authors_logits(tmp_path):
    """configs/mmpretrain/hvit3_t_in1k.py + a converted authors' classification checkpoint gives the
    authors' classifier: BatchNorm1d over tokens -> mean over tokens -> linear head, computed here by hand
    from their tensors."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    from mmengine.runner import load_checkpoint
    from mmpretrain.registry import MODELS
    from mmplugin_l2.checkpoint.convert import convert_checkpoint

    torch.manual_seed(0)
    src = HViT3('tiny')
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    sd = authors_state_dict(src)
    path = tmp_path / 'authors_t.pth'
    torch.save({'model': sd, 'epoch': 299}, path)
    out = tmp_path / 'cls.pth'
    torch.save(convert_checkpoint(path, 'HViT3', 'tiny', 'mmpretrain'), out)

    init_default_scope('mmpretrain')
    cfg = Config.fromfile(f'{ROOT}/configs/mmpretrain/hvit3_t_in1k.py')
    model = MODELS.build(cfg.model)
    load_checkpoint(model, str(out), map_location='cpu', strict=True)
    model.eval()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        logits = model(x, mode='tensor')
        # independent head: the authors' BN1d on (B, C, N) tokens, mean over N, Linear
        src.load_state_dict({k: v for k, v in sd.items() if k in src.state_dict()}, strict=False)
        feats = HViT3('tiny', out_indices=(3,), out_norm_cfg=None)
        feats.load_state_dict(src.state_dict(), strict=False)
        tokens = feats.eval()(x)[0].flatten(2)                        # (B, C, N)
        bn = (tokens - sd['norm.running_mean'][:, None]) / torch.sqrt(sd['norm.running_var'][:, None] + 1e-5)
        bn = bn * sd['norm.weight'][:, None] + sd['norm.bias'][:, None]
        ref = bn.mean(-1) @ sd['head.weight'].T + sd['head.bias']
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    assert logits.shape == (2, 1000)
