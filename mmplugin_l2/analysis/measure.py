"""The one measuring core of the analysis tools (benchmark, precision, roofline, compile check, device check):
device synchronisation, a timer with warm-up and median, peak memory on CPU and CUDA, numeric precision
settings, the training step and its gradients, and a runner of fresh Python processes.

* Time: wall clock between device synchronisations (`clock`), `warmup` calls untimed, then the median with
  min and max (`stats`) of the timed ones.
* Peak memory (`PeakMemory`): on CUDA `torch.cuda.max_memory_allocated()` above what was allocated at the
  start; on CPU the process's peak resident set (`ru_maxrss`) above its resident set at the start, measurable
  only when the measured code raises the process's peak (so: in a fresh process, before anything larger ran).
  `PeakMemory(device, reset=True)` resets the peak first (CUDA's peak statistics; on Linux the resident set's
  high-water mark, `/proc/self/clear_refs`), so a window after warm-up (`train_steps(..., steady_memory=True)`)
  is measurable in any process, e.g. after a compile.
* Precision (`precision`): 'fp32' (TF32 off for CUDA matmuls and cuDNN), 'tf32' (TF32 on), 'bf16' / 'fp16'
  (autocast to that dtype, TF32 off).
* Training step (`train_steps`): forward, backward of the summed output means (`output_loss`), AdamW step and
  zero_grad; `gradients` is one forward and backward returning every parameter's gradient, optionally under
  autocast with a `torch.amp.GradScaler`.
* Steady state: `WARMUP` (2) untimed steps by default; a process's first steps still page-fault its heap in.
* Allocator (`ALLOCATORS`, `allocator_env`): the CPU memory allocator a fresh process runs under: glibc's default,
  `caching` (glibc keeping freed memory: no mmap, no trimming, as a GPU's caching allocator and jemalloc /
  tcmalloc do), `live` (glibc returning every freed block of 64 KiB or more at once, so the peak resident set
  follows the live tensors, as CUDA's max_memory_allocated counts them; its times are not a benchmark), or
  jemalloc / tcmalloc preloaded from the system's libraries, as `torch.backends.xeon.run_cpu` does.
"""
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

import torch

#: precision name -> (autocast dtype or None, TF32 on)
PRECISIONS = {'fp32': (None, False), 'tf32': (None, True), 'bf16': (torch.bfloat16, False),
              'fp16': (torch.float16, False)}
#: the prefix of a result line a fresh process prints on stdout (`run_fresh`)
RESULT = 'RESULT '
#: untimed steps before the timed ones: a fresh process's first steps page-fault its heap in (steady state after)
WARMUP = 2
#: allocator name -> environment of the fresh process (glibc's tunables), or a library to preload (`allocator_env`)
ALLOCATORS = {
    'glibc': {},
    'caching': {'MALLOC_MMAP_MAX_': '0', 'MALLOC_TRIM_THRESHOLD_': str(2**40), 'MALLOC_TOP_PAD_': str(2**26)},
    'live': {'MALLOC_MMAP_THRESHOLD_': '65536', 'MALLOC_TRIM_THRESHOLD_': '0'},
    'jemalloc': ('libjemalloc.so.2',),
    'tcmalloc': ('libtcmalloc.so.4', 'libtcmalloc_minimal.so.4'),
}
#: where `allocator_env` looks for a preloaded allocator's library (then `ldconfig -p`)
LIB_DIRS = ('/usr/lib/x86_64-linux-gnu', '/usr/lib/aarch64-linux-gnu', '/usr/lib64', '/usr/lib', '/usr/local/lib')


def find_library(names, dirs=None):
    """The path of the first of the shared libraries `names` (e.g. ('libjemalloc.so.2',)) found in `dirs` (None:
    LIB_DIRS, the interpreter's prefix (a conda environment's lib/), then the linker cache); None when none
    has one."""
    for name in names:
        for d in (*LIB_DIRS, os.path.join(sys.prefix, 'lib')) if dirs is None else dirs:
            path = os.path.join(d, name)
            if os.path.isfile(path):
                return path
    if dirs is not None:
        return None
    try:
        cache = subprocess.run(['ldconfig', '-p'], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((ln.rsplit('=> ', 1)[1].strip() for name in names for ln in cache.splitlines()
                 if ln.strip().startswith(name + ' ') and '=> ' in ln), None)


def allocator_env(name, base=None, dirs=None):
    """The environment (a copy of `base`, default os.environ) of a fresh process that runs under the allocator
    `name` (ALLOCATORS); ValueError (one line) for an unknown name or a library that is not installed (looked for
    by `find_library` in `dirs`). glibc's default has none of glibc's MALLOC_ tunables."""
    if name not in ALLOCATORS:
        raise ValueError(f'allocator {name!r}; allowed: {", ".join(ALLOCATORS)}')
    env = dict(os.environ if base is None else base)
    if name == 'glibc':
        return {k: v for k, v in env.items() if not k.startswith('MALLOC_')}
    spec = ALLOCATORS[name]
    if isinstance(spec, tuple):
        path = find_library(spec, dirs)
        if path is None:
            pkg = {'jemalloc': 'libjemalloc2', 'tcmalloc': 'libtcmalloc-minimal4'}[name]
            where = ', '.join(dirs) if dirs is not None else ', '.join(LIB_DIRS) + ' or the linker cache'
            raise ValueError(f'allocator {name!r}: {" / ".join(spec)} not found in {where}; install it '
                             f'(Debian / Ubuntu: {pkg}; conda: {name}) or use the allocator '
                             f'caching (glibc keeping freed memory)')
        env['LD_PRELOAD'] = ' '.join(p for p in (path, env.get('LD_PRELOAD')) if p)
    else:
        env.update(spec)
    return env


def sync(device):
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


def clock(device):
    """Seconds (perf_counter) once the device's queued work is done."""
    sync(device)
    return time.perf_counter()


def stats(values):
    """dict(median, min, max) of a non-empty list."""
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def time_calls(fn, device, warmup, iters):
    """Milliseconds of each of `iters` calls of `fn()` after `warmup` untimed calls, each between device
    synchronisations."""
    times = []
    for i in range(warmup + iters):
        t = clock(device)
        fn()
        t = clock(device) - t
        if i >= warmup:
            times.append(t * 1e3)
    return times


def rss_bytes():
    """This process's resident set now (Linux /proc)."""
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def _peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_rss_peak():
    """Reset this process's resident-set high-water mark (Linux `clear_refs` 5); False where that is not possible."""
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


def _rss_high_water_bytes():
    """VmHWM of /proc/self/status: the resident set's peak since the process started or `_reset_rss_peak`."""
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmHWM:'):
                return int(line.split()[1]) * 1024
    raise OSError('no VmHWM in /proc/self/status')


class PeakMemory:
    """Peak memory in MB (`.mb`) of what runs inside the `with` above what was held at its start (see the
    module docstring); None on CPU when the code stayed below the process's earlier peak. `reset`: the peak is
    reset at the start, so any window is measurable (on CPU where Linux allows resetting it, else as without)."""

    def __init__(self, device, reset=False):
        self.device, self.mb, self.reset = torch.device(device), None, reset

    def __enter__(self):
        if self.device.type == 'cuda':
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.high_water = self.reset and _reset_rss_peak()
            self.base, self.peak_before = rss_bytes(), _peak_rss_bytes()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        if self.device.type == 'cuda':
            sync(self.device)
            self.mb = (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        elif self.high_water:
            self.mb = (_rss_high_water_bytes() - self.base) / 2**20
        else:
            peak = _peak_rss_bytes()
            self.mb = (peak - self.base) / 2**20 if peak > self.peak_before else None
        return False


def half_units(name, device):
    """Whether precision `name`'s products run on units made for it: True for fp32 / tf32 and off the CPU; on a CPU
    whether oneDNN has kernels for its half dtype there (bf16: AVX512-BF16 or AMX; fp16: AVX512-FP16 or AMX-FP16).
    Without them torch runs bf16 / fp16 matrix products and convolutions in a scalar fallback, hundreds of times
    slower than fp32: figures measured so describe that fallback, not a machine that trains in the half dtype."""
    dtype = PRECISIONS[name][0]
    if dtype is None or torch.device(device).type != 'cpu':
        return True
    check = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
             else torch.ops.mkldnn._is_mkldnn_fp16_supported)
    return bool(check())


def cpu_isa(device='cpu'):
    """The instruction set torch's CPU kernels were dispatched for here ('AVX2', 'AVX512', ...); None off the CPU
    or where torch does not say."""
    get = getattr(torch.backends.cpu, 'get_cpu_capability', None)
    return get() if get is not None and torch.device(device).type == 'cpu' else None


def half_units_warning(name, device):
    """What to tell a user who measures in precision `name` on `device` without units for it (`half_units`); None
    where it has them."""
    if half_units(name, device):
        return None
    return (f'{name} on this CPU ({cpu_isa()}): it has no {name} units, so torch runs {name} matrix products and '
            f'convolutions in a scalar fallback, hundreds of times slower than fp32; {name} timings here describe '
            f'that fallback, not a machine that trains in {name}')


#: (precision, device type) pairs `precision` has checked for units (once per process: it runs inside timed steps)
_CHECKED = set()


@contextlib.contextmanager
def precision(name, device):
    """Run the body in precision `name` (PRECISIONS) on `device`; TF32 settings restored after. The first time
    a process runs a half precision on a CPU without units for it (`half_units`), a warning says so."""
    if name not in PRECISIONS:
        raise ValueError(f'precision {name!r}; allowed: {", ".join(PRECISIONS)}')
    key = (name, torch.device(device).type)
    if key not in _CHECKED:
        _CHECKED.add(key)
        message = half_units_warning(name, device)
        if message:
            warnings.warn(message, stacklevel=3)
    dtype, tf32 = PRECISIONS[name]
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    try:
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def measure_infer(model, x, warmup, iters, prec='fp32'):
    """(median ms, per-forward ms, peak MB) of `iters` no-grad forwards after `warmup` ones."""
    model.eval()
    with torch.no_grad(), precision(prec, x.device), PeakMemory(x.device) as mem:
        times = time_calls(lambda: model(x), x.device, warmup, iters)
    return statistics.median(times), times, mem.mb


def output_loss(outputs, square=False):
    """Sum over the output maps of their mean (of their squares with `square`), in fp32 (float64 for a
    float64 model)."""
    outputs = [outputs] if torch.is_tensor(outputs) else outputs
    outputs = [o if o.dtype == torch.float64 else o.float() for o in outputs]
    # no pow(1) without `square`: it would keep every output map for backward, memory a step does not need
    return sum((o.square() if square else o).mean() for o in outputs)


def model_loss(model, x):
    """The loss of a training step: `output_loss` of a backbone's outputs; for a whole model that computes its own
    losses (an mmengine BaseModel, e.g. a detector, given its preprocessed batch as a dict) their sum by its
    `parse_losses`."""
    if isinstance(x, dict):
        return model.parse_losses(model(**x, mode='loss'))[0]
    return output_loss(model(x))


def train_steps(model, x, warmup, iters, lr=1e-4, memory=True, prec='fp32', device=None, steady_memory=False):
    """`warmup` + `iters` training iterations of `model` on `x` (forward, backward of `model_loss`, AdamW step,
    zero_grad) in precision `prec`; `x` a tensor, or a whole model's preprocessed batch (a dict, with `device`);
    returns (per-iteration dicts of total / forward / backward / optimizer ms of the timed ones, peak MB above
    what was held before the first iteration or None: not measured without `memory`, not measurable on CPU below
    the process's earlier peak). `steady_memory`: the peak of the timed iterations only, above what was held after
    the warm-up ones (`PeakMemory(reset=True)`)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.05)
    dev = x.device if device is None else torch.device(device)
    steps, mem = [], None
    with contextlib.ExitStack() as stack:
        for i in range(warmup + iters):
            if memory and i == (warmup if steady_memory else 0):
                mem = stack.enter_context(PeakMemory(dev, reset=steady_memory))
            t0 = clock(dev)
            with precision(prec, dev):
                loss = model_loss(model, x)
            t1 = clock(dev)
            loss.backward()
            t2 = clock(dev)
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = clock(dev)
            if i >= warmup:
                steps.append(dict(total_ms=(t3 - t0) * 1e3, forward_ms=(t1 - t0) * 1e3,
                                  backward_ms=(t2 - t1) * 1e3, optimizer_ms=(t3 - t2) * 1e3))
            del loss
    return steps, mem.mb if mem else None


def gradients(model, x, prec='fp32', scaler=None, square=True):
    """One train-mode forward and backward of `output_loss(model(x), square)` in precision `prec` (a float64
    model and input run as they are), with `scaler` (a torch.amp.GradScaler) scaling the loss and unscaling
    the gradients; returns (loss, {parameter name: gradient as float64}). Gradients are set to None first."""
    model.train()
    model.zero_grad(set_to_none=True)
    with precision(prec, x.device):
        loss = output_loss(model(x), square)
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
        inv = 1. / scaler.get_scale()
        return loss.detach(), {n: p.grad.detach().double() * inv for n, p in model.named_parameters()
                               if p.grad is not None}
    return loss.detach(), {n: p.grad.detach().double().clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def run_fresh(argv, timeout=None, python=sys.executable, env=None):
    """`python argv...` in a fresh process that prints its results as lines `RESULT <json>` on stdout.

    Returns:
        tuple: (the results printed, in order, also those printed before a timeout or a crash; None when it
        exited with status 0, else the failure as text: its whole stderr and how it ended).
    """
    try:
        r = subprocess.run([python, *argv], capture_output=True, text=True, timeout=timeout, env=env)
        out, err, how = r.stdout, r.stderr, None if r.returncode == 0 else _exit_reason(r.returncode)
    except subprocess.TimeoutExpired as e:
        out, err, how = _text(e.stdout), _text(e.stderr), f'timed out after {timeout:.0f} s'
    results = [json.loads(ln[len(RESULT):]) for ln in out.splitlines() if ln.startswith(RESULT)]
    if how is None:
        return results, None
    return results, f'{how}\n--- stderr ---\n{err}'.rstrip() + '\n'


def _exit_reason(rc):
    if rc < 0:
        return f'killed by signal {-rc}' + (' (out of memory?)' if rc == -9 else '')
    return f'exit status {rc}'


def _text(b):
    return (b.decode(errors='replace') if isinstance(b, bytes) else b) or ''


def emit(result):
    """Print one result line for `run_fresh` (in the fresh process)."""
    print(RESULT + json.dumps(result), flush=True)


def failure_line(text):
    """The one line of a failure text of `run_fresh` that says what happened: the exception's last line
    (how the process ended when it left none)."""
    head, _, err = text.partition('\n--- stderr ---\n')
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if head.startswith('exit status') and lines:
        return lines[-1][:300]
    return head + (f' ({lines[-1][:200]})' if lines and not head.startswith('exit status') else '')
