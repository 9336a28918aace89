"""Per-op profile of one backbone in one precision (tools/analysis/profile_ops.py): for one training step
(forward under the precision's autocast, backward of measure.output_loss; no optimizer step) or one no-grad
forward, per op: its time in forward and backward, the `Path` that ops.dispatch.choose returned for it, and the
dtypes its matrix products, convolutions and attention kernels ran in.

* An *op* is the innermost module that called `ops.dispatch.choose` during the step (the layer of a dispatched
  op: an MLP, an attention, a CPE, a stem, a block's fused norm + MLP branch), else the innermost layer of
  roofline.layers (a norm or a projection outside the dispatched ops; its Path is '-'), else `other` (residual
  adds between layers, the loss).
* `choose` is wrapped, under every name the package imported it as, to record the calling module, the op's
  `Supports` (named as the calling Python module names it, else the calling function) and the Path returned.
* Every aten operator of the step (forward and backward) passes a TorchDispatchMode, which sees it below
  autocast (inputs already cast), times it (measure.clock: wall time between device synchronisations) and, for
  the matrix products (mm, bmm, addmm, baddbmm, ...), convolutions and scaled-dot-product attention kernels
  (forward and backward), records the dtypes of its floating-point tensor inputs. In forward an operator belongs
  to the modules running (forward hooks); in backward to the module whose forward created the autograd node
  being run (its sequence number lies between the numbers taken at that module call's start and end). A
  recomputation in backward (checkpoint) counts as backward time of the node whose saved tensors it recomputes
  (a pre-hook on every node of the graph says which one runs), and of the modules it calls below that node's.
* Times are sums of the aten operators' own times, without the Python between them; the instrumented step is
  slower than a plain one, whose forward and backward are timed first (`plain`) for comparison.
* An op on a `compiled` Path (`ops.compiled`) runs its code op by op in the instrumented step: torch.compile'd code
  runs eagerly while a TorchDispatchMode is active. Its row times the eager code the compiled path replaces (the
  table says so under it); benchmark.py times the compiled path.
* *Bounds* (`bounds=True`): the least time an op's step can take on this machine, `bound_ms` = max(bytes /
  copy bandwidth, multiply-adds / matmul peak), both measured here (`roofline.peak_bandwidth`,
  `roofline.peak_matmul` in the profile's precision). The bytes are what the op must move at least, counted
  from its module calls in forward (tensors as they are: bf16 where autocast made them so): in training the
  forward reads its inputs and parameters and writes its outputs; the backward reads the outputs' gradients, the
  inputs again (or saved tensors at least as large) and the parameters, and writes the inputs' and the
  parameters' gradients: 3 inputs + 2 outputs + 3 parameters. Inference: inputs + outputs + parameters. The
  multiply-adds are the forward's (mmengine's FlopAnalyzer by module, as get_flops.py counts them), three times
  that in training (recomputation not counted). `× bound` is the op's measured time over its bound: what a
  fused implementation could still gain at most. `other` and an op whose module holds other ops (e.g. a block
  that chooses its MLP branch's path, the branch's own ops then rows of their own) have no bound.
* *Kept* (training): the bytes autograd keeps from the forward for the backward, per op: every tensor saved for
  backward in the forward (`torch.autograd.graph.saved_tensors_hooks`: the autograd nodes' saved tensors, the
  custom functions' `save_for_backward`, a recomputed region's inputs, and the outputs a selective recomputation
  keeps, `ops.checkpoint.checkpointed(keep_products=True)`), counted once per storage (a view counts its whole
  storage), parameters and buffers excluded, on the op that saved it first. What a recomputed region recomputes is
  not kept, and nor is what a recomputation saves in backward (it lives while that backward runs). With the
  step's outputs and the parameters' gradients this is most of a training step's peak above its start (the peak
  itself: benchmark.py's `train` kind, `--allocator live`).
"""
import collections
import contextlib
import sys

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..models.ops import dispatch
from .measure import PRECISIONS, clock, cpu_isa, output_loss, precision
from .roofline import layers, module_macs, peak_bandwidth, peak_matmul, tensor_bytes

KINDS = ('train', 'infer')
DTYPE_NAMES = {torch.float32: 'fp32', torch.bfloat16: 'bf16', torch.float16: 'fp16', torch.float64: 'fp64'}
#: aten matrix products (by overload packet name); convolutions and attention kernels are found by name
MATMULS = frozenset(('mm', 'bmm', 'addmm', 'baddbmm', 'addbmm', 'mv', 'addmv', 'dot', 'vdot', 'matmul', 'linear',
                     '_addmm_activation', '_int_mm', '_mixed_mm'))
OTHER = 'other'


def is_product(name):
    """Whether the aten operator `name` is a matrix product, a convolution or an attention kernel (or the
    backward of one)."""
    return name in MATMULS or 'convolution' in name or 'attention' in name or 'scaled_dot_product' in name


def short_name(name):
    """A shorter name of an aten operator for the table: '_scaled_dot_product_flash_attention_for_cpu_backward'
    -> 'sdpa_flash_backward'."""
    return (name.lstrip('_').replace('scaled_dot_product_', 'sdpa_').replace('_attention', '')
            .replace('_for_cpu', ''))


def dtype_name(dtype):
    return DTYPE_NAMES.get(dtype, str(dtype).replace('torch.', ''))


def op_group(name, module):
    """'stage N / ClassName' of a module inside the N-th entry of a top-level list (`layers.2.blocks.0.attn`:
    stage 3), '- / ClassName' elsewhere (a stem, output norms)."""
    parts = name.split('.')
    return (f'stage {int(parts[1]) + 1}' if len(parts) > 1 and parts[1].isdigit() else '-') + \
        f' / {type(module).__name__}'


def path_name(path):
    """'train', 'inference (piece 65536)', ... of a dispatch.Path."""
    return path.impl + (f' (piece {path.piece})' if path.piece is not None else '')


class _Recorder(TorchDispatchMode):
    """The aten operators of a step: seconds per (module stack, phase) and product calls per (module stack,
    phase, operator, input dtypes); `owner()` says where the running operator belongs."""

    def __init__(self, owner, device):
        super().__init__()
        self.owner, self.device, self.quiet = owner, device, 0
        self.seconds = collections.defaultdict(float)
        self.products = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.quiet:
            return func(*args, **kwargs)
        key = self.owner()
        t = clock(self.device)
        out = func(*args, **kwargs)
        self.seconds[key] += clock(self.device) - t
        name = func.overloadpacket.__name__
        if is_product(name):
            dts = sorted({dtype_name(a.dtype) for a in tree_leaves((args, kwargs))
                          if isinstance(a, torch.Tensor) and a.is_floating_point()})
            self.products[key + (short_name(name), '+'.join(dts) or '-')] += 1
        return out


class _Tracker:
    """Module stacks in forward (hooks on every module of `model`), the owner of each autograd node (sequence
    numbers bracketed by module calls, training only) and the calls of `choose`."""

    def __init__(self, model, device, nodes, io_bytes=False):
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack, self.starts, self.phase, self.nodes = [()], [], 'forward', nodes
        self.node_owner, self.bwd_owner, self._node_hooks = {}, (), []
        self.calls = collections.Counter()
        # module name -> bytes of its forward calls' inputs / outputs (with `io_bytes`: for the bounds)
        self.io_bytes, self.bytes_in, self.bytes_out = io_bytes, collections.Counter(), collections.Counter()
        self.choices = collections.defaultdict(collections.Counter)   # module name -> {(supports, phase, path): n}
        self.recorder = _Recorder(self.owner, device)
        self._leaf = torch.zeros((), requires_grad=True)
        self._model, self._hooks, self._names_of = model, [], {}
        # module stack -> bytes kept for backward (storages saved in the forward, each once; not the model's own)
        self.kept, self._kept_storages = collections.Counter(), set()
        self._model_storages = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

    def _pack(self, t):
        """saved_tensors_hooks' pack: count a storage saved in the forward on the op running now, once."""
        if self.phase == 'forward' and not self.recorder.quiet:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr and ptr not in self._kept_storages and ptr not in self._model_storages:
                self._kept_storages.add(ptr)   # alive until backward: its address is not reused meanwhile
                self.kept[self.stack[-1]] += storage.nbytes()
        return t

    def owner(self):
        """(module stack, phase) of the operator running now."""
        if self.phase == 'backward' and len(self.stack) == 1:
            node = torch._C._current_autograd_node()
            seq = getattr(node, '_sequence_nr', None)
            return self.node_owner.get(seq() if seq else None, self.bwd_owner), 'backward'
        return self.stack[-1], self.phase

    def hook_graph(self, output):
        """A pre-hook on every node of `output`'s graph that makes its owner the backward owner while it runs
        (also for the nodes that a recomputation inside it creates and runs)."""
        todo, seen = [output.grad_fn], set()
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            owner = self.node_owner.get(node._sequence_nr(), ())
            self._node_hooks.append(node.register_prehook(lambda grads, o=owner: setattr(self, 'bwd_owner', o)))
            todo += [n for n, _ in node.next_functions]

    def _seq(self):
        """The autograd sequence number now: that of a throw-away node."""
        self.recorder.quiet += 1
        try:
            with torch.enable_grad():
                return (self._leaf * 1.).grad_fn._sequence_nr()
        finally:
            self.recorder.quiet -= 1

    def _pre(self, module, args):
        name = self.names[id(module)]
        # a module called by a recomputation in backward: below the modules of the node being recomputed
        base = self.owner()[0] if self.phase == 'backward' and len(self.stack) == 1 else self.stack[-1]
        self.stack.append(base + (name,))
        if self.phase == 'forward':
            self.calls[name] += 1
        self.starts.append(self._seq() if self.nodes else None)

    def _post(self, module, args, out):
        stack, start = self.stack.pop(), self.starts.pop()
        if self.io_bytes and self.phase == 'forward':
            self.bytes_in[stack[-1]] += tensor_bytes(args)
            self.bytes_out[stack[-1]] += tensor_bytes(out)
        if start is not None:
            for s in range(start + 1, self._seq()):   # inner calls ended first and took theirs
                self.node_owner.setdefault(s, stack)

    def choose(self, orig):
        """`orig` (dispatch.choose) recording each call: module, Supports' name, phase, Path."""
        def choose(module, x, whole_elems, supports=dispatch.Supports(), **kwargs):
            path = orig(module, x, whole_elems, supports, **kwargs)
            phase = 'forward' if self.phase == 'forward' else 'backward'
            self.choices[self.names.get(id(module), type(module).__name__)][
                (self._supports_name(supports, sys._getframe(1)), phase, path_name(path))] += 1
            return path
        return choose

    def _supports_name(self, supports, frame):
        """The name the calling Python module gives `supports` (that object, else an equal one), else the
        calling function's name (a Supports made on the spot)."""
        key = (frame.f_code, supports)
        if key not in self._names_of:
            g = frame.f_globals
            self._names_of[key] = (next((k for k, v in g.items() if v is supports), None)
                                   or next((k for k, v in g.items() if isinstance(v, dispatch.Supports)
                                            and v == supports), None) or frame.f_code.co_name)
        return self._names_of[key]

    @contextlib.contextmanager
    def active(self):
        """Hooks on every module, `choose` wrapped in every module of the package that imported it, the
        recorder on."""
        orig = dispatch.choose
        wrapped = self.choose(orig)
        patched = [m for name, m in list(sys.modules.items()) if name.startswith('mmplugin_l2') and m is not None
                   and getattr(m, 'choose', None) is orig]
        for m in self._model.modules():
            self._hooks += [m.register_forward_pre_hook(self._pre),
                            m.register_forward_hook(self._post, always_call=True)]
        for m in patched:
            m.choose = wrapped
        try:
            with self.recorder, torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for m in patched:
                m.choose = orig
            for h in self._hooks + self._node_hooks:
                h.remove()
            self._hooks, self._node_hooks = [], []


def _step(model, x, kind, prec, tracker=None):
    """One forward (and for 'train' its backward); (forward s, backward s)."""
    dev = x.device
    if kind == 'infer':
        t = clock(dev)
        with torch.no_grad(), precision(prec, dev):
            model(x)
        return clock(dev) - t, 0.
    t0 = clock(dev)
    with precision(prec, dev):
        loss = output_loss(model(x))
    t1 = clock(dev)
    if tracker is not None:
        tracker.phase = 'backward'
        tracker.hook_graph(loss)
    loss.backward()
    t2 = clock(dev)
    model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1


def profile_ops(model, x, kind='train', prec='fp32', warmup=1, by='group', bounds=False):
    """The per-op profile of `model` on `x` (see the module docstring).

    Args:
        model (nn.Module): the backbone, on x's device.
        x (Tensor): the input, (B, 3, H, W).
        kind (str): 'train' (forward under `prec`, backward) or 'infer' (no-grad forward, eval mode).
        prec (str): a measure.PRECISIONS name.
        warmup (int): plain steps before the timed plain step and the instrumented one.
        by (str): rows per 'group' (`op_group`: stage and class, with the op's Supports) or per
            'module' (each op's module by name).
        bounds (bool): also each op's least bytes, multiply-adds and bound (see the module docstring),
            against this machine's copy bandwidth and matmul peak, measured first.

    Returns:
        dict: kind, precision, plain (forward_ms, backward_ms of a plain step), instrumented (the same summed
        over the aten operators), kept_bytes (kept for backward, see the module docstring; 0 at inference), rows
        (dicts: op, modules, calls, paths {'<supports>: <path>[ in backward]': count}, forward_ms, backward_ms,
        kept_bytes, products {'fwd'|'bwd': {'<operator> <dtypes>': count}}; with `bounds`: bytes, macs,
        bound_ms), by time; with `bounds` also bandwidth_gbs, peak_gmacs.
    """
    if kind not in KINDS:
        raise ValueError(f'kind {kind!r}; allowed: {", ".join(KINDS)}')
    if prec not in PRECISIONS:
        raise ValueError(f'precision {prec!r}; allowed: {", ".join(PRECISIONS)}')
    if by not in ('group', 'module'):
        raise ValueError(f'by {by!r}; allowed: group, module')
    machine = {}
    if bounds:    # before the model's steps fill the heap
        machine = dict(bandwidth_gbs=peak_bandwidth(device=x.device) / 1e9,
                       peak_gmacs=peak_matmul(device=x.device, prec=prec) / 1e9,
                       cpu_isa=cpu_isa(x.device))
    model.train(kind == 'train')
    for _ in range(warmup):
        _step(model, x, kind, prec)
    plain = _step(model, x, kind, prec)
    tracker = _Tracker(model, x.device, nodes=kind == 'train', io_bytes=bounds)
    with tracker.active():
        _step(model, x, kind, prec, tracker)
    res = dict(kind=kind, precision=prec, by=by, plain=dict(forward_ms=plain[0] * 1e3, backward_ms=plain[1] * 1e3),
               **machine, **_rows(model, tracker, by))
    if bounds:
        _add_bounds(res, model, x, tracker)
    return res


def _add_bounds(res, model, x, tracker):
    """Each row's least bytes, multiply-adds and bound_ms (the module docstring), in place."""
    train = res['kind'] == 'train'
    _, macs_of = module_macs(model, x)
    modules = dict(model.named_modules())
    bw, peak = res['bandwidth_gbs'] * 1e9, res['peak_gmacs'] * 1e9
    op_modules = [n for r in res['rows'] for n in r['modules']]
    for r in res['rows']:
        # `other`, and an op whose module holds other ops (a block choosing its branch's path: its time is what
        # those ops leave, its inputs and multiply-adds include theirs): no bound
        if not r['modules'] or any(o.startswith(n + '.') for n in r['modules'] for o in op_modules):
            r.update(bytes=None, macs=None, bound_ms=None)
            continue
        ins = sum(tracker.bytes_in[n] for n in r['modules'])
        outs = sum(tracker.bytes_out[n] for n in r['modules'])
        params = sum(tensor_bytes(tuple(modules[n].parameters())) * tracker.calls[n] for n in r['modules'])
        macs = sum(macs_of.get(n, 0) for n in r['modules']) * (3 if train else 1)
        nbytes = 3 * ins + 2 * outs + 3 * params if train else ins + outs + params
        r.update(bytes=nbytes, macs=macs, bound_ms=max(nbytes / bw, macs / peak) * 1e3)


def _rows(model, tracker, by):
    modules = dict(model.named_modules())
    choosers = set(tracker.choices)
    layer_names = {n for n, _ in layers(model)}
    resolved = {}

    def op_of(stack):
        if stack not in resolved:
            resolved[stack] = (next((n for n in reversed(stack) if n in choosers), None)
                               or next((n for n in reversed(stack) if n in layer_names), None))
        return resolved[stack]

    def row_key(name):
        if name is None:
            return OTHER
        supports = sorted({k[0] for k in tracker.choices.get(name, ())})
        module = modules.get(name, nn.Identity())
        head = op_group(name, module) if by == 'group' else f'{name} ({type(module).__name__})'
        return head + (f' · {", ".join(supports)}' if supports else '')

    rows = {}

    def row(name):
        key = row_key(name)
        if key not in rows:
            rows[key] = dict(op=key, modules=[], calls=0, paths=collections.Counter(), forward_ms=0.,
                             backward_ms=0., kept_bytes=0,
                             products=dict(fwd=collections.Counter(), bwd=collections.Counter()))
        r = rows[key]
        if name is not None and name not in r['modules']:
            r['modules'].append(name)
            r['calls'] += tracker.calls[name]
            for (sup, phase, path), n in tracker.choices.get(name, {}).items():
                r['paths'][f'{sup}: {path}' + (' in backward' if phase == 'backward' else '')] += n
        return r

    for name in sorted(choosers):   # every op that called choose, even without time of its own
        row(name)
    for (stack, phase), s in tracker.recorder.seconds.items():
        row(op_of(stack))[f'{phase}_ms'] += s * 1e3
    for (stack, phase, op, dts), n in tracker.recorder.products.items():
        row(op_of(stack))['products']['fwd' if phase == 'forward' else 'bwd'][f'{op} {dts}'] += n
    for stack, n in tracker.kept.items():
        row(op_of(stack))['kept_bytes'] += n
    out = sorted(rows.values(), key=lambda r: (r['op'] == OTHER, -(r['forward_ms'] + r['backward_ms']), r['op']))
    for r in out:
        r['paths'] = dict(sorted(r['paths'].items()))
        r['products'] = {k: dict(sorted(v.items())) for k, v in r['products'].items()}
    return dict(rows=out, instrumented=dict(forward_ms=sum(r['forward_ms'] for r in out),
                                            backward_ms=sum(r['backward_ms'] for r in out)),
                kept_bytes=sum(r['kept_bytes'] for r in out))


def product_dtypes(result):
    """{dtypes: calls} of every product (matmul, convolution, attention) of the profile, forward and backward."""
    out = collections.Counter()
    for r in result['rows']:
        for calls in r['products'].values():
            for k, n in calls.items():
                out[k.rsplit(' ', 1)[1]] += n
    return dict(sorted(out.items()))


def table(result):
    """The profile as a markdown table (one row per op, by time), with a head line of totals."""
    train, bounded = result['kind'] == 'train', 'bandwidth_gbs' in result
    total = sum(r['forward_ms'] + r['backward_ms'] for r in result['rows']) or 1.
    p, i = result['plain'], result['instrumented']
    lines = [f'Plain step: forward {p["forward_ms"]:.1f} ms' + (f', backward {p["backward_ms"]:.1f} ms' if train
                                                                 else '')
             + f'; in aten operators of the instrumented step: forward {i["forward_ms"]:.1f} ms'
             + (f', backward {i["backward_ms"]:.1f} ms' if train else '')
             + (f'; kept for backward {result["kept_bytes"] / 2**20:.1f} MB' if train else '')
             + '. Products by input dtype: '
             + ', '.join(f'{k} ×{n}' for k, n in product_dtypes(result).items()) + '.', '',
             '| op | calls | path | forward ms | ' + ('backward ms | ' if train else '') + 'share | '
             + ('kept MB | ' if train else '')
             + ('least MB | bound ms | × bound | ' if bounded else '') + 'matmul / conv / attention dtypes |',
             '|---|---|---|---|' + ('---|---|' if train else '') + '---|' + ('---|---|---|' if bounded else '')
             + '---|']
    if bounded:
        lines[0] += (f' Bounds: {result["bandwidth_gbs"]:.1f} GB/s copy bandwidth, {result["peak_gmacs"]:.0f} '
                     f'GMAC/s {result["precision"]} matmul peak (this machine'
                     + (f', {result["cpu_isa"]}' if result.get('cpu_isa') else '') + ').')
        bounded_rows = [r for r in result['rows'] if r['bound_ms']]
        lines[0] += (f' The ops with a bound: {sum(r["forward_ms"] + r["backward_ms"] for r in bounded_rows):.1f} ms'
                     f' measured, {sum(r["bound_ms"] for r in bounded_rows):.1f} ms bound.')

    def products(r):
        parts = []
        for phase, calls in r['products'].items():
            if calls:
                parts.append((f'{phase} ' if train else '') + ', '.join(f'{k} ×{n}' for k, n in calls.items()))
        return '; '.join(parts) or '–'

    for r in result['rows']:
        paths = ', '.join(f'{k} ×{n}' for k, n in r['paths'].items()) or '–'
        ms = r['forward_ms'] + r['backward_ms']
        bound = ''
        if bounded:
            b = r['bound_ms']
            bound = (f'{r["bytes"] / 1e6:.1f} | {b:.2f} | {ms / b:.1f} | ' if b else '– | – | – | ')
        lines.append(f'| {r["op"]} | {r["calls"] or "–"} | {paths} | {r["forward_ms"]:.2f} | '
                     + (f'{r["backward_ms"]:.2f} | ' if train else '') + f'{ms / total:.1%} | '
                     + (f'{r["kept_bytes"] / 2**20:.1f} | ' if train else '') + f'{bound}{products(r)} |')
    compiled = sorted({r['op'] for r in result['rows'] if any(': compiled' in k for k in r['paths'])})
    if compiled:
        lines += ['', f'Compiled paths ran eagerly here (torch.compile runs op by op under the profile\'s dispatch '
                      f'mode): the rows of {", ".join(compiled)} time the eager code the compiled path replaces; '
                      f'benchmark.py times the compiled path.']
    return '\n'.join(lines) + '\n'
