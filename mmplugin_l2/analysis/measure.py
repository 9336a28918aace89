"""The one measuring core of the analysis tools (benchmark, precision, roofline, compile check, device check):
device synchronisation, a timer with warm-up and median, peak memory on CPU and CUDA, numeric precision
settings, the training step and its gradients, and a runner of fresh Python processes.

* Time: wall clock between device synchronisations (`clock`), `warmup` calls untimed, then the median with
  min and max (`stats`) of the timed ones.
* Peak memory (`PeakMemory`): on CUDA `torch.cuda.max_memory_allocated()` above what was allocated at the
  start; on CPU the process's peak resident set (`ru_maxrss`) above its resident set at the start, measurable
  only when the measured code raises the process's peak (so: in a fresh process, before anything larger ran).
* Precision (`precision`): 'fp32' (TF32 off for CUDA matmuls and cuDNN), 'tf32' (TF32 on), 'bf16' / 'fp16'
  (autocast to that dtype, TF32 off).
* Training step (`train_steps`): forward, backward of the summed output means (`output_loss`), AdamW step and
  zero_grad; `gradients` is one forward and backward returning every parameter's gradient, optionally under
  autocast with a `torch.amp.GradScaler`.
"""
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

#: precision name -> (autocast dtype or None, TF32 on)
PRECISIONS = {'fp32': (None, False), 'tf32': (None, True), 'bf16': (torch.bfloat16, False),
              'fp16': (torch.float16, False)}
#: the prefix of a result line a fresh process prints on stdout (`run_fresh`)
RESULT = 'RESULT '


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


class PeakMemory:
    """Peak memory in MB (`.mb`) of what runs inside the `with` above what was held at its start (see the
    module docstring); None on CPU when the code stayed below the process's earlier peak."""

    def __init__(self, device):
        self.device, self.mb = torch.device(device), None

    def __enter__(self):
        if self.device.type == 'cuda':
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base, self.peak_before = rss_bytes(), _peak_rss_bytes()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        if self.device.type == 'cuda':
            sync(self.device)
            self.mb = (torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20
        else:
            peak = _peak_rss_bytes()
            self.mb = (peak - self.base) / 2**20 if peak > self.peak_before else None
        return False


@contextlib.contextmanager
def precision(name, device):
    """Run the body in precision `name` (PRECISIONS) on `device`; TF32 settings restored after."""
    if name not in PRECISIONS:
        raise ValueError(f'precision {name!r}; allowed: {", ".join(PRECISIONS)}')
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
    return sum((o if o.dtype == torch.float64 else o.float()).pow(2 if square else 1).mean() for o in outputs)


def train_steps(model, x, warmup, iters, lr=1e-4, memory=True, prec='fp32'):
    """`warmup` + `iters` training iterations of `model` on `x` (forward, backward of `output_loss`, AdamW step,
    zero_grad) in precision `prec`; returns (per-iteration dicts of total / forward / backward / optimizer ms
    of the timed ones, peak MB above what was held before the first iteration or None: not measured without
    `memory`, not measurable on CPU below the process's earlier peak)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.05)
    dev = x.device
    steps = []
    with contextlib.ExitStack() as stack:
        mem = stack.enter_context(PeakMemory(dev)) if memory else None
        for i in range(warmup + iters):
            t0 = clock(dev)
            with precision(prec, dev):
                loss = output_loss(model(x))
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
