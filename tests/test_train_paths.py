"""A slow path fails a test, not only a benchmark (issue 46). One whole-model training step of each family's tiny
backbone (`analysis.models.build(..., tiny=True)`: narrow widths, the full model's layer types and kernels) under
bf16 and fp16 autocast on CPU, recorded by `analysis.opprofile.profile_ops`: every op that called
`ops.dispatch.choose` took the Path its declaration (`Supports` in `ops/<op>/__init__.py`) and
docs/mixed_precision.md ("Fast paths under autocast") give it, no op with a declared fast path fell back to the
reference unless the table below says why, and the matrix products, convolutions and attention kernels of each op
ran in the dtypes the design promises (e.g. L2ViT's window-attention kernel in fp32, forward and backward, on the
half q, k, v of its half residual stream)."""
import collections
import re

import pytest
import torch
import torch.nn as nn

from mmplugin_l2.analysis.models import build
from mmplugin_l2.analysis.opprofile import profile_ops
from mmplugin_l2.models import ops
from mmplugin_l2.models.ops import Supports
from mmplugin_l2.models.ops.memory import set_memory_policy

FAMILIES = ('hvit3_t', 'vit3_t', 'l2vit_t', 'rest_s')
PRECISIONS = ('bf16', 'fp16')
DTYPES = dict(bf16=torch.bfloat16, fp16=torch.float16)
#: one image of 64 x 64: every stage runs (L2ViT's and ResT's stage 4 maps 2 x 2; L2ViT's window attention pads
#: them to one 7 x 7 window, its stage 1 has 3 x 3 windows; ResT's stage-1 9 x 9 key/value reduction has 2 x 2 keys)
SIZE = 64
#: the memory policy's piece (elements, each op in its own unit): small enough that every map of this size is cut
#: where an op's path allows pieces, as the large maps of detection sizes are by the default policy (EMSA's train
#: path exists only in pieces); EMSA's unit (entries of the attention map, 64 at stage 4) needs the smaller one
PIECE = dict(hvit3_t=127, vit3_t=127, l2vit_t=127, rest_s=31)
#: the blocks, whose input is the residual stream
BLOCKS = ('TTTBlock', 'LWABlock', 'LGABlock', 'ResTBlock')

# ---- the paths ------------------------------------------------------------------------------------------------
# Per family and precision, each Supports (as its op's module names it) -> the set of paths its ops took (' in
# backward': chosen again by a recomputation in backward; ' (pieces)': in the memory policy's pieces). Each op
# (module) took exactly these, up to the recomputation; together they took all of them.
RECOMPUTED_REFERENCE = {'reference', 'reference in backward'}
#: the stem's and downsamplings' conv chains (no train path) and their BatchNorms (on half maps); the downsamplings'
#: stride-2 depth-wise 3 x 3 convolutions: the depth-wise pass in bf16 (its input gradient in fp32)
HVIT3_CONVS = dict(CONV_CHAIN={'reference'}, BATCH_NORM={'reference'})
PATHS = {
    'hvit3_t': dict(
        # TTT: fp16 its closed form (TTTCore, in pieces of tokens), bf16 its compiled core (recomputed in backward);
        # ConvMlp: its train function on whole maps (keeping the fc1 output; the memory policy's pieces are for fp32)
        bf16=dict(TTT={'compiled'}, CONV_MLP={'train'}, DEPTHWISE_CONV={'train'}, **HVIT3_CONVS),
        fp16=dict(TTT={'train (pieces)'}, CONV_MLP={'train'}, DEPTHWISE_CONV={'reference'}, **HVIT3_CONVS)),
    'vit3_t': dict(
        # the block calls its plain Mlp itself (not NORM_MLP): `ops.mlp.MLP`, no train path, is checkpointed
        bf16=dict(TTT={'compiled'}, MLP={'checkpoint'}),
        fp16=dict(TTT={'train (pieces)'}, MLP={'checkpoint'})),
    'l2vit_t': {prec: dict(
        # the window attention trains with its kernel in fp32 (chosen again in backward: its branch recomputes the
        # LayerNorm and the windows); the linear attention trains in pieces; the MLP branch on half tokens runs
        # NormMlpFunction (NORM_MLP, whole maps); LCM (CONV_CHAIN, recomputed) and the stem
        WINDOW_ATTENTION={'train', 'train in backward'}, LINEAR_ATTENTION={'train (pieces)'},
        NORM_MLP={'train'}, CONV_CHAIN=RECOMPUTED_REFERENCE,
        BATCH_NORM=RECOMPUTED_REFERENCE,
        # LCM's depth-wise 7 x 7 convolutions: the depth-wise pass in bf16 only (fp16 keeps torch's kernel)
        DEPTHWISE_CONV={'train', 'train in backward'} if prec == 'bf16' else RECOMPUTED_REFERENCE)
        for prec in PRECISIONS},
    'rest_s': {prec: dict(
        # the MLP branch: NormMlpFunction on half tokens too; EMSA in pieces; stage 1's 9 x 9 key/value reduction
        # the depth-wise pass in bf16; BatchNorms on half maps and the pixel attention (inference only): reference
        NORM_MLP_UNCHECKPOINTED={'train'}, EMSA_ATTENTION={'train (pieces)'},
        DEPTHWISE_CONV={'train'} if prec == 'bf16' else {'reference'}, BATCH_NORM={'reference'},
        INFERENCE_ONLY={'reference'})
        for prec in PRECISIONS},
}

#: Supports -> (precisions, why): where an op whose Supports declares a train path or a checkpoint runs the
#: reference under autocast by design
REFERENCE_BY_DESIGN = {
    'BATCH_NORM': (PRECISIONS, 'its accurate pass takes fp32 channels-last maps; under autocast the convolution '
                               'before it gives a half one'),
    'MLP': (PRECISIONS, "L2ViT's Mlp (fast_train off) runs inside its block's checkpointed MLP branch (NORM_MLP)"),
    'DEPTHWISE_CONV': (('fp16',), 'the depth-wise pass is declared for bf16 only (fp16 keeps torch\'s kernel)'),
}

# ---- the dtypes -----------------------------------------------------------------------------------------------
# Per family and precision, each Supports -> {'<phase> <kernel>': dtypes}: the exact set of dtypes its ops' kernels
# of that kind ran in ('P' the autocast dtype), over all its ops; every other product of the step (also those of
# layers outside the dispatched ops: stems, downsamplings, CPEs) ran in the autocast dtype. Kernels: `linear` (mm,
# addmm: the projections and their backward), `bmm`, `conv` (convolution), `conv_backward`, `sdpa` (the
# attention kernel), `sdpa_backward`.
LINEARS = {'fwd linear': 'P', 'bwd linear': 'P'}
TTT_BF16 = {  # the compiled core (eager under the profile's dispatch mode: the reference's ops), not recomputed by a
    # checkpoint (its compiled backward recomputes what its memory budget does not keep): the reference's products in
    # bf16 (bf16 has fp32's range: token sums too), the conv head's inner gradient (tap sums) in fp32, and the
    # backward by autograd
    **LINEARS, 'fwd bmm': 'P', 'fwd conv_backward': 'fp32', 'bwd bmm': 'P', 'bwd conv': 'fp32',
    'bwd conv_backward': 'P'}
TTT_FP16 = {  # the closed form: products in fp16, the token sums (k^T a, q^T dz, k^T dz) and tap sums in fp32, its
    # per-sample convolutions in fp16 (no autograd through the fp32 tap sums)
    **LINEARS, 'fwd bmm': ('P', 'fp32'), 'fwd conv_backward': 'fp32', 'bwd bmm': ('P', 'fp32'), 'bwd conv': 'P',
    'bwd conv_backward': 'fp32'}
#: the depth-wise pass (bf16): forward in bf16; the input gradient in bf16 with stride 1 (torch's, convolution_backward)
#: and a transposed convolution in fp32 with a stride; the weight gradient a per-sample convolution for 7 x 7
#: kernels and more (in bf16 at batch 1, the step's batch: one rounding of the whole sum; in fp32 for larger
#: batches), else torch's in bf16 (convolution_backward); torch's kernel (fp16) computes all in the autocast
#: dtype. Each family has stride-1 or small strided kernels among its depth-wise convolutions, so both kinds run.
DEPTHWISE = dict(bf16={'fwd conv': 'P', 'bwd conv_backward': 'P', 'bwd conv': 'fp32'},
                 fp16={'fwd conv': 'P', 'bwd conv_backward': 'P'})
PRODUCTS = {
    'hvit3_t': {prec: dict(TTT=TTT_BF16 if prec == 'bf16' else TTT_FP16, CONV_MLP=LINEARS,
                           DEPTHWISE_CONV=DEPTHWISE[prec]) for prec in PRECISIONS},
    'vit3_t': dict(bf16=dict(TTT=TTT_BF16, MLP=LINEARS), fp16=dict(TTT=TTT_FP16, MLP=LINEARS)),
    'l2vit_t': {prec: dict(
        # qkv / proj in the autocast dtype, the attention kernel in fp32 on the half q, k, v, forward and backward
        WINDOW_ATTENTION={**LINEARS, 'fwd sdpa': 'fp32', 'bwd sdpa_backward': 'fp32'},
        # qkv / proj in the autocast dtype, K^T V, the denominator and their backward in fp32
        LINEAR_ATTENTION={**LINEARS, 'fwd bmm': 'fp32', 'bwd bmm': 'fp32'},
        NORM_MLP=LINEARS,
        # LCM is recomputed in backward: its convolutions' forward again there, in the autocast dtype; its
        # stride-1 7 x 7 convolutions' weight gradient at batch 1 in bf16 too (no fp32 product in the step)
        DEPTHWISE_CONV={**DEPTHWISE[prec], 'bwd conv': 'P'} if prec == 'bf16' else DEPTHWISE[prec])
        for prec in PRECISIONS},
    'rest_s': {prec: dict(
        NORM_MLP_UNCHECKPOINTED=LINEARS,
        # q k^T in the autocast dtype; G v (multi-head stages) and the backward's map products in fp32
        EMSA_ATTENTION={**LINEARS, 'fwd bmm': ('P', 'fp32'), 'bwd bmm': ('P', 'fp32')},
        # stage 1's 9 x 9 key / value reduction: its weight gradient at batch 1 in bf16, its input gradient (a
        # stride) in fp32
        DEPTHWISE_CONV={**DEPTHWISE[prec], 'bwd conv': ('P', 'fp32')} if prec == 'bf16' else DEPTHWISE[prec])
        for prec in PRECISIONS},
}
KERNELS = {'mm': 'linear', 'addmm': 'linear', 'bmm': 'bmm', 'baddbmm': 'bmm', 'convolution': 'conv',
           'convolution_backward': 'conv_backward'}


def _kernel(op):
    """The kind of an aten product as the tables name it ('sdpa_flash_backward' -> 'sdpa_backward')."""
    if op.startswith('sdpa'):
        return 'sdpa_backward' if op.endswith('_backward') else 'sdpa'
    return KERNELS.get(op, op)


def _declared():
    """{name: Supports} of every op's declaration, as the ops' modules name them."""
    out = {}
    for mod in (ops.dispatch, ops.conv, ops.emsa, ops.linear_attention, ops.mlp, ops.ttt, ops.window_attention):
        for name, value in vars(mod).items():
            if isinstance(value, Supports):
                assert out.setdefault(name, value) == value, name
    return out


def _path(key):
    """'TTT: train (piece 127) in backward' -> ('TTT', 'train (pieces) in backward')."""
    supports, path = key.split(': ', 1)
    return supports, re.sub(r' \(piece \d+\)', ' (pieces)', path)


def _dispatched(res):
    """[(row, its Supports' name, its paths)] of the rows of ops that called `choose` (one Supports each)."""
    out = []
    for row in res['rows']:
        if row['paths']:
            names, paths = zip(*map(_path, row['paths']))
            assert len(set(names)) == 1, row['op']
            out.append((row, names[0], set(paths)))
    return out


def _forward_paths(paths):
    return {p.replace(' in backward', '') for p in paths}


def _dtypes(spec, prec):
    return {prec if d == 'P' else d for d in ((spec,) if isinstance(spec, str) else spec)}


@pytest.fixture(autouse=True, scope='module')
def _one_thread():
    """One thread for these tiny tensors: on a shared 2-core machine an OpenMP region of two threads waits for
    the busy core, and a step then takes 100x its work (as in tests/test_inputs_unchanged.py)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope='module', params=[(f, p) for f in FAMILIES for p in PRECISIONS], ids='-'.join)
def step(request, _one_thread):
    """(family, precision, the per-op profile of one training step by module, the dtypes of the residual stream
    entering the blocks)."""
    family, prec = request.param
    torch.manual_seed(0)
    model = build(family, tiny=True)
    set_memory_policy(model, dict(max_elems=PIECE[family]))
    stream = set()
    hooks = [m.register_forward_pre_hook(lambda mod, args: stream.add(args[0].dtype))
             for m in model.modules() if type(m).__name__ in BLOCKS]
    res = profile_ops(model, torch.randn(1, 3, SIZE, SIZE), 'train', prec, warmup=0, by='module')
    for h in hooks:
        h.remove()
    return family, prec, res, stream


@pytest.mark.parametrize('family', FAMILIES)
def test_tiny_models_have_the_full_models_layers(family):
    """The tiny backbones differ from the full ones in widths and depths only: the same layer classes, the same
    convolutions (kernel, stride, depth-wise or not); the full model is built on the meta device."""
    def kinds(model):
        return {(type(m).__name__,) + ((m.kernel_size, m.stride, m.groups == m.in_channels > 1)
                                       if isinstance(m, nn.Conv2d) else ()) for m in model.modules()}
    with torch.device('meta'):
        full = build(family)
    assert kinds(build(family, tiny=True)) == kinds(full)


def test_each_op_takes_its_declared_path(step):
    """Each op that called `choose` took the paths of the table (its Supports, the family, the precision), every
    op of the table ran, and the residual stream the blocks see is the autocast dtype's (L2ViT's half stream after
    its conv stem is what its window attention and MLP branches are chosen on)."""
    family, prec, res, stream = step
    assert stream == {DTYPES[prec]}
    expected = PATHS[family][prec]
    seen = collections.defaultdict(set)
    for row, name, paths in _dispatched(res):
        assert name in expected, f'{row["op"]}: {name} is not in the table ({sorted(paths)})'
        assert _forward_paths(paths) == _forward_paths(expected[name]), f'{row["op"]} took {sorted(paths)}'
        seen[name] |= paths
    assert dict(seen) == expected


def test_no_op_falls_back_to_the_reference_where_a_fast_path_is_declared(step):
    """Where an op's Supports declares a train path or a checkpoint, the op ran one of them, in forward and in a
    recomputation, but for the reference of REFERENCE_BY_DESIGN; every Supports is an op's declaration."""
    family, prec, res, _ = step
    declared = _declared()
    for row, name, paths in _dispatched(res):
        assert name in declared, f'{row["op"]}: {name} is no op\'s declaration'
        supports = declared[name]
        if (supports.train is not None or supports.checkpoint) and any(p.startswith('reference') for p in paths):
            assert prec in REFERENCE_BY_DESIGN.get(name, ((),))[0], \
                f'{row["op"]} fell back to the reference ({sorted(paths)}) though {name} declares a fast path'


def test_each_ops_kernels_run_in_the_promised_dtypes(step):
    """The products of each Supports' ops ran in exactly the dtypes of the table (e.g. L2ViT's window-attention
    kernel in fp32 forward and backward, its projections in the autocast dtype; LCM's depth-wise weight gradient
    in bf16 at batch 1); every other product of the step in the autocast dtype."""
    family, prec, res, _ = step
    promised = PRODUCTS[family][prec]
    ran = collections.defaultdict(lambda: collections.defaultdict(set))   # Supports -> kernel -> dtypes
    names = {row['op']: name for row, name, _ in _dispatched(res)}
    for row in res['rows']:
        for phase, calls in row['products'].items():
            for key in calls:
                op, dts = key.rsplit(' ', 1)
                ran[names.get(row['op'], '-')][f'{phase} {_kernel(op)}'].add(dts)
    wrong = []
    for name, kernels in promised.items():
        for kernel, spec in kernels.items():
            if ran[name].get(kernel, set()) != _dtypes(spec, prec):
                wrong.append(f'{name} {kernel}: ran in {sorted(ran[name].get(kernel, ()))}, promised '
                             f'{sorted(_dtypes(spec, prec))}')
    for name, kernels in ran.items():
        for kernel, dts in kernels.items():
            if kernel not in promised.get(name, {}) and dts != {prec}:
                wrong.append(f'{name} {kernel}: ran in {sorted(dts)}, not in the autocast dtype {prec}')
    assert not wrong, '\n'.join(wrong)


#: under `with_cp` (a block recomputed in backward) the ops inside it that would recompute themselves take the
#: reference in the block's forward and in its recomputation (`ops.dispatch.recomputing`); TTT its compiled
#: reference (`ops.ttt.TTT.compiled`: bf16 on CPU, the layer's `fast_compile` on by default)
WITH_CP_PATHS = {
    'hvit3_t': dict(TTT={'compiled', 'compiled in backward'}, CONV_MLP={'reference', 'reference in backward'}),
    'l2vit_t': dict(NORM_MLP={'reference', 'reference in backward'}),
}


@pytest.mark.parametrize('family', sorted(WITH_CP_PATHS))
def test_with_cp_blocks_do_not_recompute_their_ops_again(family, _one_thread):
    """Under bf16 with `with_cp=True`: the ops that recompute themselves without it (ConvMlp's and L2ViT's MLP
    branch's checkpoint, TTT's compiled core under its own checkpoint) take the reference inside the recomputed
    blocks (TTT: its compiled core, without the checkpoint), in forward and in the recomputation,
    and no recomputation runs inside another (each block's ops run twice per step, not three times); the
    gradients are those of the model without `with_cp` (same function, other roundings: within bf16's)."""
    grads = {}
    for with_cp in (False, True):
        torch.manual_seed(0)
        model = build(family, dict(with_cp=with_cp), tiny=True)
        set_memory_policy(model, dict(max_elems=PIECE[family]))
        res = profile_ops(model, torch.randn(1, 3, SIZE, SIZE), 'train', 'bf16', warmup=0, by='module')
        paths = collections.defaultdict(set)
        for row, name, p in _dispatched(res):
            paths[name] |= p
        for name, want in WITH_CP_PATHS[family].items():
            if with_cp:
                assert paths[name] == want, (name, sorted(paths[name]))
            else:                                   # without: as PATHS has it (their own recomputation)
                assert paths[name] == PATHS[family]['bf16'][name], (name, sorted(paths[name]))
        torch.manual_seed(0)
        x = torch.randn(1, 3, SIZE, SIZE)
        model.zero_grad(set_to_none=True)
        with torch.autocast('cpu', torch.bfloat16):
            out = model(x)
        sum(o.float().mean() for o in out).backward()
        grads[with_cp] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    err = (grads[True] - grads[False]).norm() / grads[False].norm()
    assert err < 2e-2, err.item()
