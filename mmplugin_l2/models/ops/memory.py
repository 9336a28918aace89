"""The memory policy: when a layer works on a large map in pieces, and how large the pieces are.

Every large-map layer of every family (stems and downsamplings, MLPs, window / linear / TTT attention,
EMSA) follows one `MemoryPolicy`, set for a whole backbone by its `memory_policy` argument
(`dict(max_elems=2**20, devices=('cpu',))` by default; `None` turns pieces off everywhere):

* **Unit.** `max_elems` counts elements of a piece, the batch included: for the token layers (MLPs, TTT,
  window and linear attention) the piece's input tokens x channels, for the convolution chains (stems,
  downsamplings) input rows x width x the last layer's channels, for EMSA query rows x keys x heads of its
  attention map.
* **Which implementation runs** is `ops.dispatch.choose`, once per forward: inference pieces for a module in
  eval mode, with no autograd recording and not being exported; train pieces (a closed-form or recomputing
  training function, `ops/*/train.py`) in train mode with autograd recording and the layer's `fast_train` on;
  the plain-autograd reference otherwise. Either kind of piece only on a device type in `devices`, and only
  once the whole map exceeds `2 * max_elems`; then pieces of about `max_elems`. Inference pieces keep the
  intermediates in cache and out of the peak memory; train pieces keep a training function's temporaries in
  cache instead of fresh map-sized tensors (on CPU each page of a fresh large tensor is zeroed by the kernel on
  first touch). Values are those of the whole map up to the summation order of sums over pieces.
* The mode conditions (`dispatch.inference`, `dispatch.trains_fast`) and the piece rule (`dispatch.choose`)
  are written once, in `ops/dispatch.py`; this module holds the policy's settings only.
* On devices not in `devices` (CUDA by default) every layer works on whole maps, in training too: a GPU has no
  cache to keep pieces in and pays a kernel launch per piece. docs/memory_policy.md has the whole rule.
"""
import contextlib


class MemoryPolicy:
    """How large a map a layer builds at once. See the module docstring for the rule.

    Args:
        max_elems (int | None): elements per piece; whole maps up to twice this. None: always whole maps.
            Default: 2**20.
        devices (Sequence[str]): device types on which inference works in pieces. Default: ('cpu',).
    """

    def __init__(self, max_elems=2 ** 20, devices=('cpu',)):
        if max_elems is not None and (isinstance(max_elems, bool) or not isinstance(max_elems, int)
                                      or max_elems < 1):
            raise ValueError(f'memory_policy: max_elems must be a positive int or None, got {max_elems!r}')
        if isinstance(devices, str):
            devices = (devices,)
        self.max_elems = max_elems
        self.devices = tuple(devices)

    @classmethod
    def build(cls, cfg):
        """A MemoryPolicy from a config value: a policy, a dict of its arguments, or None (no pieces)."""
        if isinstance(cfg, cls):
            return cfg
        if cfg is None:
            return cls(max_elems=None)
        if not isinstance(cfg, dict):
            raise TypeError(f'memory_policy must be a dict (e.g. dict(max_elems=2**20, devices=("cpu",))), '
                            f'a MemoryPolicy or None, got {type(cfg).__name__}')
        unknown = set(cfg) - {'max_elems', 'devices'}
        if unknown:
            raise ValueError(f'memory_policy: unknown keys {sorted(unknown)}; allowed: max_elems, devices')
        return cls(**cfg)

    def __repr__(self):
        return f'MemoryPolicy(max_elems={self.max_elems}, devices={self.devices})'


#: the policy of a layer built on its own (a backbone sets its own on every layer)
DEFAULT_POLICY = MemoryPolicy()


def set_memory_policy(model, policy):
    """Give every layer of `model` that follows a memory policy (has a `memory_policy` attribute) the
    policy `policy` (anything `MemoryPolicy.build` takes); returns the MemoryPolicy."""
    policy = MemoryPolicy.build(policy)
    for m in model.modules():
        if hasattr(m, 'memory_policy'):
            m.memory_policy = policy
    return policy


@contextlib.contextmanager
def whole_maps(model):
    """Inside the block every layer of `model` works on whole maps (the policy None); the policies are
    restored on exit. For counting the model's operations (FLOPs) without the halo rows that pieces of rows
    recompute."""
    saved = [(m, m.memory_policy) for m in model.modules() if hasattr(m, 'memory_policy')]
    set_memory_policy(model, None)
    try:
        yield model
    finally:
        for m, policy in saved:
            m.memory_policy = policy
