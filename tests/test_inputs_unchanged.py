"""Inputs are never written: every layer, every path of every op and every backbone leaves the tensors it is
given as they were.

The fast paths work in place (`ops.tokens.add_residual` adds into the branch output, GELU and the PA gate run
in place, pieces write into buffers), which is correct only while the tensor written is the op's own. A write
into an argument changes no output of the call itself (the values are the same), but the caller's tensor: a
residual stream, a cached feature map, an image that is used again. So each case below runs a call and
compares every tensor argument with a copy taken before (`torch.equal`) and checks its version counter
(`_version`: any in-place write bumps it, even one that writes the same values):

* **modes**: eval + `torch.no_grad()`, eval + `torch.inference_mode()`, and train mode forward + backward with
  arguments that are leaves requiring a gradient (after backward only their `.grad` may have changed), non-leaf
  tensors requiring one (the residual stream inside a network: autograd allows an in-place write into them),
  and tensors requiring none (an image). Parameters are checked too, and in eval modes the buffers.
* **layers** (`LAYER_CASES`): every `nn.Module` defined in `models/layers` and every block of
  `models/backbones`, found by walking the packages (`test_every_layer_has_a_case` fails for one without a
  case), on whole maps and in pieces (a tiny memory policy; each pieces case asserts that `ops.dispatch.choose`
  really gave pieces, via a recording `Path`), with `fast_train` on (train / checkpoint paths) and off
  (reference) in training.
* **ops** (`OP_CASES`): each op's entry point called with every `Path` its `Supports` declaration allows
  (reference, inference whole / pieces, train whole / pieces, checkpoint; `test_every_op_path_has_a_case`), its
  inner arguments (q, k, v; the fused qkv tokens) exposed, which no layer case can see; every
  `torch.autograd.Function` of `models/ops` is asserted to run (`test_every_autograd_function_has_a_case`).
* **functions** (`FUNCTION_CASES`): every function of `models.layers.__all__`, the naive form (the oracle) of
  every op (`*_naive` in `ops/*/naive.py`).
* **backbones** (`BACKBONES`): HViT3, ViT3, L2ViT, ResT (tiny archs), whole maps and pieces, `fast_train` on /
  off, `with_cp` off / on.

Tiny sizes throughout (2 images, 8 channels, 6 x 5 token maps, 30 x 26 images), float32.
"""
import contextlib
import importlib
import inspect
import pkgutil
from typing import Callable, NamedTuple

import pytest
import torch
import torch.nn as nn

from conftest import TINY_HVIT3, TINY_L2VIT, TINY_REST
from mmplugin_l2 import HViT3, L2ViT, ResT, ViT3
import mmplugin_l2.models.backbones as backbones_pkg
import mmplugin_l2.models.layers as layers_pkg
import mmplugin_l2.models.ops as ops_pkg
from mmplugin_l2.models.backbones.hvit3 import TTTBlock
from mmplugin_l2.models.backbones.l2vit import LGABlock, LWABlock
from mmplugin_l2.models.backbones.rest import ResTBlock
from mmplugin_l2.models.layers import (CPE, LCM, PA, Conv2dCL, ConvDownsample, ConvLayer, ConvMlp, ConvStem,
                                      ConvStem2L, EMSA, L2ViTDownsample, L2ViTStem, LinearAttention, Mlp,
                                      ResidualCPE, ResTPatchEmbed, ResTStem, TTTAttention, WindowAttention)
from mmplugin_l2.models.layers import add_residual, apply_rope, emsa_attention, emsa_attention_reference
from mmplugin_l2.models.layers import (dwconv_inner_grad, map_to_tokens, normalize_inner_grad, pad_to_multiple,
                                      rope_tables, swiglu_inner_grads, tokens_conv, tokens_to_map,
                                      window_partition, window_reverse)
from mmplugin_l2.models.layers.conv import BatchNorm2d
from mmplugin_l2.models.layers.mlp import norm_mlp_branch
from mmplugin_l2.models.ops import CHECKPOINT, INFERENCE, REFERENCE, TRAIN, Path, Supports, dispatch
from mmplugin_l2.models.ops import conv as conv_op
from mmplugin_l2.models.ops import emsa as emsa_op
from mmplugin_l2.models.ops import linear_attention as la_op
from mmplugin_l2.models.ops import mlp as mlp_op
from mmplugin_l2.models.ops import ttt as ttt_op
from mmplugin_l2.models.ops import window_attention as wa_op
from mmplugin_l2.models.ops.checkpoint import recomputed_branch
from mmplugin_l2.models.ops.conv.naive import conv_chain_naive, lcm_naive
from mmplugin_l2.models.ops.emsa.naive import emsa_attention_naive
from mmplugin_l2.models.ops.linear_attention.naive import linear_attention_naive
from mmplugin_l2.models.ops.memory import MemoryPolicy, set_memory_policy
from mmplugin_l2.models.ops.mlp.naive import conv_mlp_naive, mlp_naive
from mmplugin_l2.models.ops.ttt.naive import ttt_core_naive
from mmplugin_l2.models.ops.window_attention.naive import window_attention_naive, window_msa_naive
from mmplugin_l2.models.pyramid import PyramidBackbone

B, C, HW = 2, 8, (6, 5)
N = HW[0] * HW[1]
#: elements per piece of the tiny memory policy: every map below exceeds twice this, so pieces are taken
PIECE = 40
IMAGE = (30, 26)

EVAL_MODES = ('no_grad', 'inference_mode')
#: training: the tensor arguments are leaves that require a gradient, non-leaf tensors that require one, or
#: tensors that require none
TRAIN_MODES = ('train_leaf', 'train_nonleaf', 'train_nograd')
GRAD_MODES = ('train_leaf', 'train_nonleaf')


@pytest.fixture(autouse=True, scope='module')
def _one_thread():
    """One thread for these tiny tensors: on a shared 2-core machine an OpenMP region of two threads waits for
    the busy core, and a case then takes 100x its work (as tests/test_fault_injection.py finds for its tools)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ---- inputs --------------------------------------------------------------------------------------
def tokens(c=C, hw=HW):
    return torch.randn(B, hw[0] * hw[1], c)


def fmap(c=C, hw=HW, cl=False):
    x = torch.randn(B, c, *hw)
    return x.contiguous(memory_format=torch.channels_last) if cl else x


def image(hw=IMAGE):
    return torch.randn(B, 3, *hw)


def rope(c=C, hw=HW):
    return rope_tables(*hw, c)


def heads_qkv(h=2, n=N, n_keys=N, d=4):
    return torch.randn(B, h, n, d), torch.randn(B, h, n_keys, d), torch.randn(B, h, n_keys, d)


def with_modules(module, **extra):
    """`module` with the modules `extra` registered on it (so that train / eval and the checks reach them)."""
    for k, v in extra.items():
        setattr(module, k, v)
    return module


# ---- running and checking one call ---------------------------------------------------------------
class _RecordingPath(Path):
    """`ops.dispatch.Path` while a case runs: every Path that `choose` returns is appended to `given`."""
    __slots__ = ()
    given = None

    def __new__(cls, impl, piece=None):
        p = super().__new__(cls, impl, piece)
        if _RecordingPath.given is not None:
            _RecordingPath.given.append((impl, piece))
        return p


def _walk(pkg):
    """The modules of package `pkg` and of its subpackages, imported."""
    mods = [pkg]
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):
        mods.append(importlib.import_module(info.name))
    return mods


def _classes(pkg, base):
    """Subclasses of `base` defined in the modules of `pkg`, in a stable order."""
    found = {}
    for mod in _walk(pkg):
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, base) and cls.__module__ == mod.__name__:
                found[f'{cls.__module__}.{cls.__qualname__}'] = cls
    return [found[k] for k in sorted(found)]


AUTOGRAD_FUNCTIONS = _classes(ops_pkg, torch.autograd.Function)


@contextlib.contextmanager
def _recording():
    """Record the Paths `choose` gives and the names of the autograd Functions of `models/ops` that run."""
    given, ran, saved_path = [], set(), dispatch.Path
    patched = []
    for cls in AUTOGRAD_FUNCTIONS:
        orig = cls.apply

        def apply(c, *a, _orig=orig, **k):
            ran.add(c.__name__)
            return _orig(*a, **k)
        patched.append((cls, 'apply' in cls.__dict__, cls.__dict__.get('apply')))
        cls.apply = classmethod(apply)
    dispatch.Path = _RecordingPath
    _RecordingPath.given = given
    try:
        yield given, ran
    finally:
        _RecordingPath.given = None
        dispatch.Path = saved_path
        for cls, own, attr in patched:
            if own:
                cls.apply = attr
            else:
                del cls.apply


def _tensors(out):
    if torch.is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _prepare(args, mode):
    """The arguments of a call in `mode` and the tensors to check: (label, tensor, is a leaf to get a grad)."""
    prepared, checked = [], []
    for i, a in enumerate(args):
        if torch.is_tensor(a) and a.is_floating_point() and mode in GRAD_MODES:
            leaf = a.detach().clone().requires_grad_()
            if mode == 'train_leaf':
                a = leaf
            else:
                a = leaf.clone()                    # a non-leaf that requires a gradient
                checked.append((f'leaf of argument {i}', leaf, True))
        if torch.is_tensor(a):
            checked.append((f'argument {i}', a, a.is_leaf and a.requires_grad))
        prepared.append(a)
    return prepared, checked


def _module_state(modules, buffers):
    seen, state = set(), []
    for m in modules:
        named = list(m.named_parameters()) + (list(m.named_buffers()) if buffers else [])
        for name, t in named:
            if id(t) not in seen:
                seen.add(id(t))
                state.append((f'{type(m).__name__}.{name}', t))
    return state


def run_case(call, args, mode, modules=(), writes=()):
    """call(*args) in `mode` (see the module docstring) with `modules` in its train / eval state; asserts that
    no tensor argument (but those at the indices `writes`, documented outputs), no parameter and, in eval
    modes, no buffer was written. Returns (the Paths `choose` gave, the autograd Functions that ran)."""
    training = mode in TRAIN_MODES
    for m in modules:
        m.train(training)
    args, checked = _prepare(args, mode)
    checked = [c for c in checked if not any(c[0] == f'argument {i}' for i in writes)]
    state = [(label, t, False) for label, t in _module_state(modules, buffers=not training)]
    before = [(t.detach().clone(), t._version, t.requires_grad) for _, t, _ in checked + state]
    ctx = {'no_grad': torch.no_grad, 'inference_mode': torch.inference_mode}.get(mode, contextlib.nullcontext)
    with _recording() as (given, ran):
        with ctx():
            out = call(*args)
        outs = [o for o in _tensors(out) if o.requires_grad] if training else []
        if outs:
            g = torch.Generator().manual_seed(0)
            sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs).backward()
    written = []
    for (label, t, leaf), (value, version, requires_grad) in zip(checked + state, before):
        if not torch.equal(t.detach(), value):
            written.append(f'{label}: values changed')
        elif t._version != version:
            written.append(f'{label}: written in place (version {version} -> {t._version}), same values')
        if leaf:   # a leaf that requires a gradient: only its .grad may change
            if not (t.is_leaf and t.requires_grad == requires_grad and t.grad_fn is None):
                written.append(f'{label}: no longer the same leaf')
            if t.grad is not None and t.grad.shape != t.shape:
                written.append(f'{label}: .grad of shape {tuple(t.grad.shape)}')
    assert not written, f'{mode}: ' + '; '.join(written)
    if outs:
        leaves = [t for _, t, leaf in checked if leaf]
        assert not leaves or any(t.grad is not None for t in leaves), 'backward reached no input'
    return given, ran


def _set_fast_train(model, on):
    if on is not None:
        for m in model.modules():
            if hasattr(m, 'fast_train'):
                m.fast_train = on


def _set_policy(model, policy):
    set_memory_policy(model, MemoryPolicy(max_elems=PIECE) if policy == 'pieces' else None)


# ---- layers --------------------------------------------------------------------------------------
class LayerCase(NamedTuple):
    """A layer: `build()` -> the module, `inputs()` -> its arguments, `call(module, *args)` (default
    module(*args)); `eval_pieces` / `train_pieces`: with the tiny policy `choose` gives inference pieces in eval
    modes / train pieces in training with `fast_train` (asserted)."""
    cls: type
    build: Callable
    inputs: Callable
    call: Callable = None
    eval_pieces: bool = False
    train_pieces: bool = False


LAYER_CASES = {
    'Conv2dCL': LayerCase(Conv2dCL, lambda: Conv2dCL(C, C, 3, padding=1, groups=C), lambda: (fmap(cl=True),)),
    'BatchNorm2d': LayerCase(BatchNorm2d, lambda: BatchNorm2d(C), lambda: (fmap(cl=True),), train_pieces=True),
    'BatchNorm2d-nchw': LayerCase(BatchNorm2d, lambda: BatchNorm2d(C), lambda: (fmap(),)),
    'ConvLayer': LayerCase(ConvLayer, lambda: ConvLayer(C, 16, 3, padding=1), lambda: (fmap(cl=True),),
                           train_pieces=True),
    'ConvLayer-nchw': LayerCase(ConvLayer, lambda: ConvLayer(C, 16, 3, stride=2, padding=1, channels_last=False),
                                lambda: (fmap(),)),
    'CPE': LayerCase(CPE, lambda: CPE(C), lambda: (tokens(), HW)),
    'ResidualCPE': LayerCase(ResidualCPE, lambda: ResidualCPE(C), lambda: (tokens(), HW)),
    'EMSA': LayerCase(EMSA, lambda: EMSA(C, 2, 2, qkv_bias=True), lambda: (tokens(), HW), eval_pieces=True,
                      train_pieces=True),
    'EMSA-1head': LayerCase(EMSA, lambda: EMSA(C, 1, 1, qkv_bias=True), lambda: (tokens(), HW), eval_pieces=True,
                            train_pieces=True),
    'LCM': LayerCase(LCM, lambda: LCM(C, 3), lambda: (tokens(), HW), eval_pieces=True, train_pieces=True),
    'LCM-norm': LayerCase(LCM, lambda: with_modules(LCM(C, 3), pre=nn.LayerNorm(C)), lambda: (tokens(), HW),
                          lambda m, x, hw: m(x, hw, norm=m.pre), eval_pieces=True, train_pieces=True),
    'LinearAttention': LayerCase(LinearAttention, lambda: LinearAttention(C, 2), lambda: (tokens(),),
                                 eval_pieces=True, train_pieces=True),
    'LinearAttention-norm': LayerCase(LinearAttention, lambda: with_modules(LinearAttention(C, 2),
                                                                            pre=nn.LayerNorm(C)),
                                      lambda: (tokens(),), lambda m, x: m(x, norm=m.pre), eval_pieces=True,
                                      train_pieces=True),
    'LinearAttention-half-sums': LayerCase(LinearAttention, lambda: LinearAttention(C, 2, fp32_reduce=False),
                                           lambda: (tokens(),), eval_pieces=True, train_pieces=True),
    'Mlp': LayerCase(Mlp, lambda: Mlp(C, 16), lambda: (tokens(),), eval_pieces=True),
    'Mlp-norm': LayerCase(Mlp, lambda: with_modules(Mlp(C, 16), pre=nn.LayerNorm(C)), lambda: (tokens(),),
                          lambda m, x: m(x, norm=m.pre), eval_pieces=True),
    'ConvMlp': LayerCase(ConvMlp, lambda: ConvMlp(C, 16), lambda: (tokens(), HW), eval_pieces=True,
                         train_pieces=True),
    'PA': LayerCase(PA, lambda: PA(C), lambda: (fmap(),)),
    'ConvStem': LayerCase(ConvStem, lambda: ConvStem(3, C), lambda: (image(),), eval_pieces=True,
                          train_pieces=True),
    # a channels-last image of a multiple of 4: the stem's pad and layout change return the input itself
    'ConvStem-channels_last': LayerCase(ConvStem, lambda: ConvStem(3, C),
                                        lambda: (image((32, 28)).contiguous(memory_format=torch.channels_last),),
                                        eval_pieces=True, train_pieces=True),
    'ConvDownsample': LayerCase(ConvDownsample, lambda: ConvDownsample(C, 16), lambda: (fmap(),),
                                eval_pieces=True, train_pieces=True),
    'ConvStem2L': LayerCase(ConvStem2L, lambda: ConvStem2L(3, C), lambda: (image(),), eval_pieces=True),
    'L2ViTStem': LayerCase(L2ViTStem, lambda: L2ViTStem(3, C), lambda: (image(),), eval_pieces=True),
    'L2ViTDownsample': LayerCase(L2ViTDownsample, lambda: L2ViTDownsample(C, 16), lambda: (tokens(), HW)),
    'ResTStem': LayerCase(ResTStem, lambda: ResTStem(3, C), lambda: (image(),)),
    'ResTPatchEmbed': LayerCase(ResTPatchEmbed, lambda: ResTPatchEmbed(C, 16), lambda: (fmap(),),
                                train_pieces=True),
    'TTTAttention': LayerCase(TTTAttention, lambda: TTTAttention(C, 2), lambda: (tokens(), HW), eval_pieces=True,
                              train_pieces=True),
    'TTTAttention-rope': LayerCase(TTTAttention, lambda: TTTAttention(C, 2), lambda: (tokens(), HW, rope()),
                                   eval_pieces=True, train_pieces=True),
    'WindowAttention': LayerCase(WindowAttention, lambda: WindowAttention(C, 2, 4), lambda: (tokens(), HW),
                                 eval_pieces=True),
    'WindowAttention-masked': LayerCase(WindowAttention, lambda: WindowAttention(C, 2, 4, mask_padding=True),
                                        lambda: (tokens(), HW), eval_pieces=True),
    'WindowAttention-norm': LayerCase(WindowAttention, lambda: with_modules(WindowAttention(C, 2, 4),
                                                                            pre=nn.LayerNorm(C)),
                                      lambda: (tokens(), HW), lambda m, x, hw: m(x, hw, norm=m.pre),
                                      eval_pieces=True),
    # the blocks of the backbones (the residual stream is their input)
    'TTTBlock': LayerCase(TTTBlock, lambda: TTTBlock(C, 2), lambda: (tokens(), HW, rope()), eval_pieces=True,
                          train_pieces=True),
    'TTTBlock-mlp': LayerCase(TTTBlock, lambda: TTTBlock(C, 2, norm_eps=1e-6, conv_mlp=False),
                              lambda: (tokens(), HW), eval_pieces=True, train_pieces=True),
    'LWABlock': LayerCase(LWABlock, lambda: LWABlock(C, 2, window_size=4), lambda: (tokens(), HW),
                          eval_pieces=True, train_pieces=True),
    'LGABlock': LayerCase(LGABlock, lambda: LGABlock(C, 2, lcm_kernel=3), lambda: (tokens(), HW),
                          eval_pieces=True, train_pieces=True),
    'ResTBlock': LayerCase(ResTBlock, lambda: ResTBlock(C, 2, 2), lambda: (tokens(), HW), eval_pieces=True,
                           train_pieces=True),
    'ResTBlock-1head': LayerCase(ResTBlock, lambda: ResTBlock(C, 1, 1), lambda: (tokens(), HW),
                                 eval_pieces=True, train_pieces=True),
}


def _layer_variants():
    """(case name, mode, policy, fast_train) of every layer case: eval modes on whole maps and (where the layer
    takes pieces) in pieces; training with `fast_train` off and on (where a module of the layer has the switch),
    on whole maps and in pieces (pieces in training need `fast_train`)."""
    out = []
    for name, case in LAYER_CASES.items():
        has_switch = any(hasattr(m, 'fast_train') for m in case.build().modules())
        pieces = case.eval_pieces or case.train_pieces
        policies = ('whole', 'pieces') if pieces else ('whole',)
        for mode in EVAL_MODES:
            out += [(name, mode, p, None) for p in policies]
        train = ([('whole', False), ('whole', True)] + ([('pieces', True)] if pieces else [])
                 if has_switch else [('whole', None)])
        for mode in TRAIN_MODES:
            out += [(name, mode, p, ft) for p, ft in train]
    return out


def _ft_id(ft):
    return '' if ft is None else ('-fast_train' if ft else '-plain')


@pytest.mark.parametrize('name,mode,policy,fast_train', [
    pytest.param(*v, id=f'{v[0]}-{v[1]}-{v[2]}{_ft_id(v[3])}') for v in _layer_variants()])
def test_layer_leaves_its_inputs_unchanged(name, mode, policy, fast_train):
    case = LAYER_CASES[name]
    m = case.build()
    _set_policy(m, policy)
    _set_fast_train(m, fast_train)
    call = case.call or (lambda module, *a: module(*a))
    given, _ = run_case(lambda *a: call(m, *a), case.inputs(), mode, (m,))
    if policy == 'pieces':
        if mode in EVAL_MODES and case.eval_pieces:
            assert any(impl == INFERENCE and piece for impl, piece in given), given
        if mode in GRAD_MODES and fast_train and case.train_pieces:
            assert any(impl == TRAIN and piece for impl, piece in given), given


def _layer_classes():
    """Every nn.Module of `models/layers` and every block of `models/backbones` (a module with its own
    `forward` that is not a backbone; the stages are containers without one)."""
    classes = _classes(layers_pkg, nn.Module)
    classes += [c for c in _classes(backbones_pkg, nn.Module)
                if not issubclass(c, PyramidBackbone) and 'forward' in c.__dict__]
    return classes


def test_every_layer_has_a_case():
    covered = {case.cls for case in LAYER_CASES.values()}
    missing = [f'{c.__module__}.{c.__qualname__}' for c in _layer_classes() if c not in covered]
    assert not missing, f'layers without a case in LAYER_CASES: {missing}'
    exported = [n for n in layers_pkg.__all__ if inspect.isclass(getattr(layers_pkg, n))
                and issubclass(getattr(layers_pkg, n), nn.Module)]
    assert exported and all(getattr(layers_pkg, n) in covered for n in exported)


# ---- ops: every declared path --------------------------------------------------------------------
class OpCase(NamedTuple):
    """An op called with an explicit Path. `build()` -> (run(path, *args), args, modules); `paths` restricts the
    implementations to those the entry point has (None: every path the Supports declaration allows);
    `expect(path)` the autograd Function that must run, or None."""
    op: str                 # the Supports constant, 'module.NAME' under models/ops
    build: Callable
    paths: tuple = None
    expect: Callable = lambda path: None


def _fn(name):
    return lambda path: name if path.impl in (TRAIN, CHECKPOINT) else None


def _conv_chain():
    layers = nn.ModuleList([ConvLayer(4, C, 3, padding=1), ConvLayer(C, C, 3, stride=2, padding=1, act=None)])
    return (lambda path, x: conv_op.conv_chain(path, layers, x)), (fmap(4, (7, 6)),), (layers,)


def _batch_norm():
    bn = BatchNorm2d(C)

    def run(path, x):
        if path.impl == TRAIN:
            return bn._accurate_train_forward(x, path.piece)
        return nn.BatchNorm2d.forward(bn, x)
    return run, (fmap(cl=True),), (bn,)


def _depthwise_conv():
    conv = Conv2dCL(C, C, 7, padding=3, groups=C)

    def run(path, x):
        if path.impl == TRAIN:
            return conv_op.DepthwiseConvFunction.apply(x, conv.weight, conv.bias, conv.stride, conv.padding,
                                                       conv.dilation)
        return nn.Conv2d.forward(conv, x)
    return run, (fmap(cl=True),), (conv,)


def _emsa(heads):
    conv = nn.Conv2d(heads, heads, 1) if heads > 1 else None
    mods = (conv,) if conv is not None else ()
    return ((lambda path, q, k, v: emsa_op.emsa_attention(path, q, k, v, 0.5, conv, 1e-5)),
            heads_qkv(heads, n_keys=9), mods)


def _linear_attention(fp32_reduce=True, norm=False):
    la = LinearAttention(C, 2, fp32_reduce=fp32_reduce)
    pre = nn.LayerNorm(C) if norm else None

    def run(path, x):
        return la_op.linear_attention(path, x, la.qkv, la.proj, la.temperature, la.num_heads, la.clamp_min,
                                      la.fp32_reduce, pre)
    return run, (tokens(),), (la,) + ((pre,) if norm else ())


def _linear_attention_core():
    t = nn.Parameter(torch.full((2, 1, 1), 0.5))
    holder = with_modules(nn.Module(), t=nn.ParameterList([t]))

    def run(path, q, k, v):
        if path.impl == TRAIN:
            return la_op.LinearAttentionCore.apply(q, k, v, t, 1.)
        return la_op.linear_attention_reference(q, k, v, t, 1.)
    return run, heads_qkv(), (holder,)


def _mlp(norm):
    m = Mlp(C, 16)
    pre = nn.LayerNorm(C) if norm else None
    return ((lambda path, x: mlp_op.mlp(path, x, m.fc1, m.fc2, m.act, m.drop, pre)), (tokens(),),
            (m,) + ((pre,) if norm else ()))


def _conv_mlp(keep_fc1):
    m = ConvMlp(C, 16)
    return ((lambda path, x, hw: mlp_op.conv_mlp(path, x, hw, m.fc1, m.dwc, m.fc2, m.act, m.drop, keep_fc1)),
            (tokens(), HW), (m,))


def _norm_mlp():
    """The pre-norm MLP branch of L2ViT's / ResT's blocks (`layers.mlp.norm_mlp_branch`) on each path."""
    block = with_modules(nn.Module(), norm=nn.LayerNorm(C), mlp=Mlp(C, 16))
    block.fast_train = True

    def run(path, x):
        if path.impl == TRAIN:
            return mlp_op.norm_mlp_train(x, block.norm, block.mlp.fc1, block.mlp.fc2, path.piece)
        if path.impl == CHECKPOINT:
            return recomputed_branch(block, block.norm, block.mlp, x)
        return block.mlp(x, norm=block.norm)
    return run, (tokens(),), (block,)


def _window_attention(masked=False, norm=False):
    wa = WindowAttention(C, 2, 4)
    pre = nn.LayerNorm(C) if norm else None
    args = (tokens(),)
    if masked:
        args += (wa_op.padding_key_mask(HW, (8, 8), 4, 'cpu').repeat(B, 1),)

    def run(path, x, key_mask=None):
        return wa_op.window_attention(path, x, HW, 4, wa.attention, key_mask, pre)
    return run, args, (wa,) + ((pre,) if norm else ())


def _ttt(rot):
    t = TTTAttention(C, 2)

    def run(path, x, *r):
        return ttt_op.ttt_attention(x, t.qkv, t.proj, r[0] if r else None, t.w1, t.w2, t.w3, HW, 2, t.scale,
                                    t.lr, path)
    return run, (tokens(),) + ((rope(),) if rot else ()), (t,)


def _ttt_core(rot):
    t = TTTAttention(C, 2)

    def run(path, qkv, *r):
        args = (qkv, r[0] if r else None, t.w1, t.w2, t.w3, HW, 2, t.scale, t.lr)
        if path.impl == INFERENCE:
            return ttt_op.ttt_core_pieces(*args, path.piece)
        if path.impl in (TRAIN, CHECKPOINT):
            return ttt_op.TTTCore.apply(*args, path.piece, path.impl == TRAIN)
        return ttt_op.ttt_core(*args)
    return run, (torch.randn(B, N, 3 * C + 3 * 4),) + ((rope(),) if rot else ()), (t,)


OP_CASES = {
    'conv_chain': OpCase('conv.CONV_CHAIN', _conv_chain),
    'batch_norm': OpCase('conv.BATCH_NORM', _batch_norm, expect=_fn('BatchNormCLFunction')),
    'depthwise_conv': OpCase('conv.DEPTHWISE_CONV', _depthwise_conv, expect=_fn('DepthwiseConvFunction')),
    'emsa': OpCase('emsa.EMSA_ATTENTION', lambda: _emsa(2), expect=_fn('EMSAPiecesFunction')),
    'emsa-1head': OpCase('emsa.EMSA_ATTENTION', lambda: _emsa(1), expect=_fn('EMSAPiecesFunction')),
    'linear_attention': OpCase('linear_attention.LINEAR_ATTENTION', _linear_attention,
                               expect=_fn('LinearAttentionCore')),
    'linear_attention-norm': OpCase('linear_attention.LINEAR_ATTENTION', lambda: _linear_attention(norm=True),
                                    expect=_fn('LinearAttentionCore')),
    'linear_attention-core': OpCase('linear_attention.LINEAR_ATTENTION', _linear_attention_core,
                                    paths=(REFERENCE, TRAIN), expect=_fn('LinearAttentionCore')),
    'linear_attention-half-sums': OpCase('linear_attention.LINEAR_ATTENTION_HALF_SUMS',
                                         lambda: _linear_attention(False), expect=_fn('LinearAttentionCore')),
    'mlp': OpCase('mlp.MLP', lambda: _mlp(False)),
    'mlp-norm': OpCase('mlp.MLP', lambda: _mlp(True)),
    'conv_mlp': OpCase('mlp.CONV_MLP', lambda: _conv_mlp(True),
                       expect=lambda p: {TRAIN: 'ConvMlpPiecesFunction' if p.piece else 'ConvMlpFunction'}.get(p.impl)),
    'conv_mlp-recompute_fc1': OpCase('mlp.CONV_MLP', lambda: _conv_mlp(False),
                                     expect=lambda p: 'ConvMlpFunction' if p.impl == TRAIN else None),
    'norm_mlp': OpCase('mlp.NORM_MLP', _norm_mlp,
                       expect=lambda p: 'NormMlpFunction' if p.impl == TRAIN else None),
    'norm_mlp-uncheckpointed': OpCase('mlp.NORM_MLP_UNCHECKPOINTED', _norm_mlp,
                                      expect=lambda p: 'NormMlpFunction' if p.impl == TRAIN else None),
    'window_attention': OpCase('window_attention.WINDOW_ATTENTION', _window_attention),
    'window_attention-masked': OpCase('window_attention.WINDOW_ATTENTION', lambda: _window_attention(masked=True)),
    'window_attention-norm': OpCase('window_attention.WINDOW_ATTENTION', lambda: _window_attention(norm=True)),
    'ttt': OpCase('ttt.TTT', lambda: _ttt(False), expect=_fn('TTTCore')),
    'ttt-rope': OpCase('ttt.TTT', lambda: _ttt(True), expect=_fn('TTTCore')),
    'ttt-core': OpCase('ttt.TTT', lambda: _ttt_core(False), expect=_fn('TTTCore')),
    'ttt-core-rope': OpCase('ttt.TTT', lambda: _ttt_core(True), expect=_fn('TTTCore')),
}

#: Supports declarations whose op is written inside a layer, not an entry point taking a Path: the layer case
INLINE_OPS = {'dispatch.INFERENCE_ONLY': 'PA'}


def _supports():
    """Every Supports declaration under models/ops: {'module.NAME': Supports}, named after the deepest module
    that holds it (where it is declared, not a package that re-exports it)."""
    found = {}
    for mod in _walk(ops_pkg):
        depth = mod.__name__.count('.')
        for name, value in vars(mod).items():
            if isinstance(value, Supports) and depth > found.get(id(value), (-1,))[0]:
                found[id(value)] = (depth, f'{mod.__name__[len(ops_pkg.__name__) + 1:]}.{name}', value)
    return {label: value for _, label, value in found.values()}


def _declared_paths(s):
    """(Path, modes) of every implementation the declaration `s` lets `choose` give: the reference in every
    mode; inference (whole maps unless pieces only, and pieces) in eval modes; train (likewise) in training,
    with an input that requires a gradient where the path needs one; the checkpoint (whole maps) in training."""
    out = [(Path(REFERENCE), EVAL_MODES + TRAIN_MODES)]
    for impl, fast, modes in ((INFERENCE, s.inference, EVAL_MODES), (TRAIN, s.train, TRAIN_MODES)):
        if fast is None:
            continue
        if impl == TRAIN and fast.input_grad:
            modes = GRAD_MODES
        out += [(Path(impl, piece), modes) for piece in ((PIECE,) if fast.pieces_only else (None, PIECE))]
    if s.checkpoint:
        out.append((Path(CHECKPOINT), TRAIN_MODES))
    return out


def _op_variants():
    supports = _supports()
    out = []
    for name, case in OP_CASES.items():
        for path, modes in _declared_paths(supports[case.op]):
            if case.paths is None or path.impl in case.paths:
                out += [(name, path, mode) for mode in modes]
    return out


def _path_id(path):
    return path.impl + ('-pieces' if path.piece else '')


@pytest.mark.parametrize('name,path,mode', [
    pytest.param(*v, id=f'{v[0]}-{_path_id(v[1])}-{v[2]}') for v in _op_variants()])
def test_op_path_leaves_its_inputs_unchanged(name, path, mode):
    case = OP_CASES[name]
    run, args, modules = case.build()
    _, ran = run_case(lambda *a: run(path, *a), args, mode, modules)
    expected = case.expect(path)
    if expected is not None:
        assert expected in ran, (expected, ran)


def test_every_op_path_has_a_case():
    """Every Supports declaration of models/ops has op cases (or is written inside a layer that has a case), and
    every path it declares is run by one of them."""
    supports = _supports()
    assert 'mlp.CONV_MLP' in supports and 'dispatch.INFERENCE_ONLY' in supports, sorted(supports)
    unknown = {c.op for c in OP_CASES.values()} - set(supports)
    assert not unknown, unknown
    for op, s in supports.items():
        if op in INLINE_OPS:
            assert INLINE_OPS[op] in LAYER_CASES
            continue
        declared = {p for p, _ in _declared_paths(s)}
        run = {p for name, p, _ in _op_variants() if OP_CASES[name].op == op}
        assert declared and declared == run, (op, declared - run)


#: autograd Functions that compute one torch op another way (the same values and derivative), inside the paths
#: above and not a path themselves: EMSA's expm1 through float64 on CPU (out of place; tests/ops/test_emsa.py)
KERNEL_FUNCTIONS = {'_Expm1Float32CPU'}


def test_every_autograd_function_has_a_case():
    expected = {case.expect(p) for case in OP_CASES.values() for impl in (TRAIN, CHECKPOINT)
                for p in (Path(impl), Path(impl, PIECE))}
    names = {f.__name__ for f in AUTOGRAD_FUNCTIONS}
    assert KERNEL_FUNCTIONS <= names
    names -= KERNEL_FUNCTIONS
    assert len(names) >= 7 and names <= expected, names - expected


# ---- functions: layers.__all__ and the ops' naive forms ------------------------------------------
class FunctionCase(NamedTuple):
    """A function: `build()` -> (fn, args, modules); `writes`: indices of arguments the function documents
    that it writes (not checked); `modes`: where it applies."""
    build: Callable
    writes: tuple = ()
    modes: tuple = EVAL_MODES + TRAIN_MODES


def _naive_lcm():
    m, pre = LCM(C, 3), nn.LayerNorm(C)
    return (lambda x, hw: lcm_naive(x, hw, m.conv1, m.bn, m.conv2, pre)), (tokens(), HW), (m, pre)


def _naive_ttt():
    t = TTTAttention(C, 2)
    return ((lambda qkv, rot: ttt_core_naive(qkv, rot, t.w1, t.w2, t.w3, HW, 2, t.scale, t.lr)),
            (torch.randn(B, N, 3 * C + 3 * 4), rope()), (t,))


def _naive_mlp():
    m, pre = Mlp(C, 16), nn.LayerNorm(C)
    return (lambda x: mlp_naive(x, m.fc1, m.fc2, m.act, m.drop, pre)), (tokens(),), (m, pre)


def _naive_conv_mlp():
    m = ConvMlp(C, 16)
    return (lambda x, hw: conv_mlp_naive(x, hw, m.fc1, m.dwc, m.fc2, m.act, m.drop)), (tokens(), HW), (m,)


def _naive_window_msa():
    wa = WindowAttention(C, 2, 4)
    return (lambda x: window_msa_naive(wa, x)), (torch.randn(4, 16, C),), (wa,)


def _naive_window_attention():
    wa = WindowAttention(C, 2, 4)
    mask = wa_op.padding_key_mask(HW, (8, 8), 4, 'cpu').repeat(B, 1)
    return ((lambda x, key_mask: window_attention_naive(x, HW, 4, wa.attention, key_mask)), (tokens(), mask),
            (wa,))


def _conv_chain_naive():
    layers = nn.ModuleList([ConvLayer(4, C, 3, padding=1), ConvLayer(C, C, 1, act=None)])
    return (lambda x: conv_chain_naive(layers, x)), (fmap(4),), (layers,)


def _add_residual():
    return add_residual, (tokens(), tokens()), ()


def _tokens_conv():
    conv = Conv2dCL(C, C, 3, padding=1, groups=C)
    return (lambda x, hw: tokens_conv(conv, x, hw)), (tokens(), HW), (conv,)


def _emsa_function(fn):
    conv = nn.Conv2d(2, 2, 1)
    return (lambda q, k, v: fn(q, k, v, 0.5, conv)), heads_qkv(n_keys=9), (conv,)


def _swiglu_inner_grads():
    return ((lambda k, v, w1, w2: swiglu_inner_grads(k, v, w1, w2, 1 / 3)),
            heads_qkv()[1:] + (torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)), ())


FUNCTION_CASES = {
    # models.layers.__all__
    'add_residual': FunctionCase(_add_residual, writes=(0,)),     # y + x into the branch output y
    'map_to_tokens': FunctionCase(lambda: (map_to_tokens, (fmap(),), ())),
    'tokens_to_map': FunctionCase(lambda: (tokens_to_map, (tokens(), HW), ())),
    'pad_to_multiple': FunctionCase(lambda: (pad_to_multiple, (fmap(), 4), ())),
    'tokens_conv': FunctionCase(_tokens_conv),
    'apply_rope': FunctionCase(lambda: (apply_rope, (tokens(), rope()), ())),
    'emsa_attention': FunctionCase(lambda: _emsa_function(lambda *a: emsa_attention(Path(REFERENCE), *a))),
    'emsa_attention_reference': FunctionCase(lambda: _emsa_function(emsa_attention_reference)),
    'window_partition': FunctionCase(lambda: (window_partition, (torch.randn(B, 8, 8, C), 4), ())),
    'window_reverse': FunctionCase(lambda: (window_reverse, (torch.randn(B * 4, 16, C), 4, 8, 8), ())),
    'dwconv_inner_grad': FunctionCase(lambda: (dwconv_inner_grad, (torch.randn(B, *HW, 4),
                                                                   torch.randn(B, *HW, 4), 1 / 3), ())),
    'normalize_inner_grad': FunctionCase(lambda: (normalize_inner_grad, (torch.randn(B, 2, 4, 8), -2), ())),
    'swiglu_inner_grads': FunctionCase(_swiglu_inner_grads),
    'norm_mlp_branch': FunctionCase(lambda: _norm_mlp_branch()),
    # the ops' naive forms (the oracles)
    'conv_chain_naive': FunctionCase(_conv_chain_naive),
    'lcm_naive': FunctionCase(_naive_lcm),
    'emsa_attention_naive': FunctionCase(lambda: _emsa_function(emsa_attention_naive)),
    'linear_attention_naive': FunctionCase(lambda: (lambda q, k, v: linear_attention_naive(
        q, k, v, torch.full((2, 1, 1), 0.5), 1.), heads_qkv(), ())),
    'mlp_naive': FunctionCase(_naive_mlp),
    'conv_mlp_naive': FunctionCase(_naive_conv_mlp),
    'window_msa_naive': FunctionCase(_naive_window_msa),
    'window_attention_naive': FunctionCase(_naive_window_attention),
    # the inner step by autograd (create_graph): not under inference_mode, whose tensors autograd cannot record
    'ttt_core_naive': FunctionCase(_naive_ttt, modes=('no_grad',) + TRAIN_MODES),
}

#: layers.__all__ functions without a tensor argument
NO_TENSOR_ARGUMENT = {'rope_tables', 'set_memory_policy'}


def _norm_mlp_branch():
    block = with_modules(nn.Module(), norm=nn.LayerNorm(C), mlp=Mlp(C, 16))
    block.fast_train = True
    return (lambda x: norm_mlp_branch(block, block.norm, block.mlp, x)), (tokens(),), (block,)


@pytest.mark.parametrize('name,mode', [pytest.param(n, m, id=f'{n}-{m}')
                                       for n, case in FUNCTION_CASES.items() for m in case.modes])
def test_function_leaves_its_inputs_unchanged(name, mode):
    case = FUNCTION_CASES[name]
    fn, args, modules = case.build()
    run_case(fn, args, mode, modules, writes=case.writes)


def test_every_function_has_a_case():
    functions = {n for n in layers_pkg.__all__ if inspect.isfunction(getattr(layers_pkg, n))}
    missing = functions - set(FUNCTION_CASES) - NO_TENSOR_ARGUMENT
    assert 'add_residual' in functions and not missing, missing
    naive = {n for mod in _walk(ops_pkg) if mod.__name__.endswith('.naive')
             for n, f in vars(mod).items() if inspect.isfunction(f) and f.__module__ == mod.__name__
             and n.endswith('_naive')}
    assert len(naive) >= 9 and naive <= set(FUNCTION_CASES), naive - set(FUNCTION_CASES)


# ---- backbones -----------------------------------------------------------------------------------
BACKBONES = {
    'HViT3': lambda **kw: HViT3(arch=TINY_HVIT3, **kw),
    'ViT3': lambda **kw: ViT3(arch=dict(embed_dims=16, num_layers=2, num_heads=2), patch_size=8, **kw),
    'L2ViT': lambda **kw: L2ViT(arch=TINY_L2VIT, **kw),
    'ResT': lambda **kw: ResT(arch=TINY_REST, **kw),
}

#: (policy, fast_train, with_cp) in training: pieces need fast_train; with_cp on top of the fast paths
TRAIN_SETTINGS = (('whole', False, False), ('whole', True, False), ('pieces', True, False), ('pieces', True, True))


def _backbone_variants():
    out = []
    for name in BACKBONES:
        out += [(name, mode, p, None, False) for mode in EVAL_MODES for p in ('whole', 'pieces')]
        out += [(name, mode, *s) for mode in ('train_leaf', 'train_nograd') for s in TRAIN_SETTINGS]
    return out


@pytest.mark.parametrize('name,mode,policy,fast_train,with_cp', [
    pytest.param(*v, id=f'{v[0]}-{v[1]}-{v[2]}{_ft_id(v[3])}{"-with_cp" if v[4] else ""}')
    for v in _backbone_variants()])
def test_backbone_leaves_its_input_unchanged(name, mode, policy, fast_train, with_cp):
    m = BACKBONES[name](with_cp=with_cp)
    _set_policy(m, policy)
    _set_fast_train(m, fast_train)
    given, _ = run_case(m, (image(),), mode, (m,))
    if policy == 'pieces':
        impl = INFERENCE if mode in EVAL_MODES else TRAIN
        assert any(i == impl and piece for i, piece in given), given


def test_every_backbone_has_a_case():
    classes = [c for c in _classes(backbones_pkg, PyramidBackbone)]
    assert classes and {c.__name__ for c in classes} == set(BACKBONES) == set(backbones_pkg.__all__)
