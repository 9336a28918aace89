"""ExactResumeHook's random states, unit by unit: each global generator (Python's `random` included) is
saved and put back through a checkpoint file, and a validation run between the checkpoint and a resume
leaves the training randomness as the resumed run sees it. The full resume after a kill is in
test_fault_injection.py."""
import io
import random

import numpy as np
import pytest
import torch

from mmplugin_l2.hooks import ExactResumeHook, rng_state, set_rng_state


def _draws():
    """Random numbers of each global generator, by generator (Python's gauss uses a cached second value)."""
    return dict(python=[random.random(), random.gauss(0, 1), random.randint(0, 10 ** 9)],
                numpy=np.random.rand(3).tolist() + [float(np.random.randn())],
                torch=torch.rand(3).tolist())


def _through_checkpoint(state):
    buf = io.BytesIO()
    torch.save(dict(rng=state), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)['rng']


def _seed(s):
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)
    random.gauss(0, 1)       # leaves Python's cached gauss value set
    np.random.randn()        # and NumPy's


def test_rng_state_round_trip_through_a_checkpoint():
    _seed(1)
    saved = _through_checkpoint(rng_state())
    expected = _draws()
    _seed(2)                 # other states in between
    set_rng_state(saved)
    got = _draws()
    for name in ('python', 'numpy', 'torch'):
        assert got[name] == expected[name], f'{name} random state not restored'


def _validation():
    """What a validation run may consume: every global generator."""
    random.random()
    random.shuffle(list(range(10)))
    np.random.rand(5)
    torch.randn(7)


@pytest.mark.parametrize('neutral', [True, False])
def test_validation_between_checkpoint_and_resume(neutral):
    """Uninterrupted: checkpoint, validation, training draws. Resumed: the checkpoint's states, training
    draws (the validation is not run again). Same draws only with neutral validation."""
    hook = ExactResumeHook(neutral_validation=neutral)
    _seed(3)
    checkpoint = _through_checkpoint(rng_state())
    hook.before_val(None)
    _validation()
    hook.after_val(None)
    uninterrupted = _draws()

    _seed(4)                 # a fresh process
    set_rng_state(checkpoint)
    resumed = _draws()
    for name in ('python', 'numpy', 'torch'):
        assert (resumed[name] == uninterrupted[name]) == neutral, name


def test_each_validation_restores_its_own_state():
    """Two validations with training in between: the second puts back the state it found, not the first's."""
    hook = ExactResumeHook()
    _seed(5)
    hook.before_val(None)
    _validation()
    hook.after_val(None)
    first = _draws()
    hook.before_val(None)
    _validation()
    hook.after_val(None)
    second = _draws()
    _seed(5)
    assert _draws() == first
    assert _draws() == second
