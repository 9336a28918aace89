"""`ExactResumeHook`: a resumed run continues exactly where the interrupted one stopped.

mmengine's checkpoints hold the weights, optimizer, schedulers and message hub, but not the random state of
the data pipeline nor the position of the sampler inside an epoch: after `--resume` the augmentations (and
after a mid-epoch checkpoint, the data order) differ from an uninterrupted run. This hook writes into every
checkpoint, under `exact_resume`:

* the states of Python's `random`, NumPy's global generator, torch's CPU generator and (when CUDA is
  initialised) every CUDA generator, taken when the checkpoint is written;
* the position in the data: iterations done, epoch, and batches already consumed from the current epoch
  (iteration-based checkpoints inside an epoch-based loop, or an IterBasedTrainLoop).

On `--resume` (never on a plain `load_from`), before the first resumed epoch / iteration it restores the
random states and makes the batch sampler skip the batches already consumed, without loading them (an
IterBasedTrainLoop's own "advance the dataloader" step is turned into a no-op, so it neither costs time nor
consumes random numbers). Validation is made neutral for the training randomness: the random states are
put back after every validation run, so a resumed run that skips a validation still matches.

Limits: with `num_workers > 0` the workers draw from their own generators, seeded by mmengine at each
epoch start; resuming at an epoch boundary is then exact (with `persistent_workers=False`), resuming
inside an epoch is not (a warning says so). A different batch size, dataset length or number of processes
than in the checkpoint makes the position meaningless: a warning says so and the data position is not
restored.

Enable it with `custom_hooks = [dict(type='ExactResumeHook')]` (tools/train.py adds it to configs that
do not list it).
"""
import itertools
import logging
import random

import numpy as np
import torch
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS

KEY = 'exact_resume'
VERSION = 1


def rng_state():
    """The global random states, as plain Python / torch objects (readable by torch's safe loader)."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    state = dict(python=random.getstate(),
                 numpy=(name, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
                 torch=torch.get_rng_state(), cuda=None)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    version, internal, gauss = state['python']
    random.setstate((version, tuple(internal), gauss))
    name, key, pos, has_gauss, cached = state['numpy']
    np.random.set_state((name, key.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state['torch'])
    if state.get('cuda') is not None and torch.cuda.is_available():
        cuda = state['cuda']
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            torch.cuda.set_rng_state(cuda[0])


_SKIPPING = {}


def _skipping_class(cls):
    """A subclass of a batch sampler class whose next iteration starts `_skip_batches` batches in (same
    instance layout, so an existing sampler can take it as its __class__)."""
    if cls not in _SKIPPING:
        def __iter__(self):
            n = self.__dict__.pop('_skip_batches', 0)
            return itertools.islice(cls.__iter__(self), n, None)
        _SKIPPING[cls] = type(cls.__name__, (cls,), {'__iter__': __iter__, '__module__': cls.__module__,
                                                    '__qualname__': cls.__qualname__})
    return _SKIPPING[cls]


def skip_batches(batch_sampler, n):
    """Make the next pass over `batch_sampler` (a BatchSampler, mmdet's AspectRatioBatchSampler, ...)
    start after its first `n` batches: index lists only, no data is loaded."""
    if type(batch_sampler) not in _SKIPPING.values():
        batch_sampler.__class__ = _skipping_class(type(batch_sampler))
    batch_sampler._skip_batches = n


class _NoOpAdvance:
    """Stands in for IterBasedTrainLoop's dataloader iterator during its `_iter` advance calls at the
    start of a resumed run (the batch sampler already skips those batches), then delegates."""

    def __init__(self, iterator, n):
        self.iterator, self.n = iterator, n

    def __iter__(self):
        return self

    def __next__(self):
        if self.n > 0:
            self.n -= 1
            return None
        return next(self.iterator)

    def __getattr__(self, name):
        return getattr(self.iterator, name)


def _unwrap_loader_state(dataloader):
    bs = getattr(dataloader, 'batch_sampler', None)
    sampler = getattr(bs, 'sampler', None) or getattr(dataloader, 'sampler', None)
    return bs, sampler


def _is_infinite(sampler):
    try:
        from mmengine.dataset import InfiniteSampler
    except ImportError:  # pragma: no cover
        return False
    return isinstance(sampler, InfiniteSampler)


def _warn(msg):
    print_log(f'ExactResumeHook: {msg}', logger='current', level=logging.WARNING)


@HOOKS.register_module()
class ExactResumeHook(Hook):
    """Save the random states and the data position in checkpoints; restore them on resume.

    Args:
        neutral_validation (bool): put the random states back after each validation run, so that
            validations (which a resumed run may skip) do not shift the training randomness.
            Default: True.
    """
    priority = 'VERY_HIGH'

    def __init__(self, neutral_validation=True):
        self.neutral_validation = neutral_validation
        self._pending = None
        self._val_state = None
        self._loader_generator = None

    # ---- saving ----------------------------------------------------------------------------
    def before_save_checkpoint(self, runner, checkpoint):
        loop = getattr(runner, '_train_loop', None)
        if loop is None or not hasattr(loop, 'dataloader'):
            return  # not training
        meta = checkpoint['meta']
        loader = loop.dataloader
        n = len(loader)
        done = int(meta.get('iter', runner.iter))
        epoch = int(meta.get('epoch', runner.epoch))
        epoch_based = hasattr(loop, 'run_epoch')
        checkpoint[KEY] = dict(
            version=VERSION, rng=rng_state(), iter=done, epoch=epoch, epoch_based=epoch_based,
            batches_in_epoch=done - epoch * n if epoch_based else None,
            dataloader_len=n, batch_size=getattr(loader, 'batch_size', None), world_size=runner.world_size,
            num_workers=getattr(loader, 'num_workers', 0))

    # ---- loading ---------------------------------------------------------------------------
    def after_load_checkpoint(self, runner, checkpoint):
        if not getattr(runner, '_resume', False):
            return  # load_from (fine-tuning, testing): only the weights matter
        state = checkpoint.get(KEY)
        if state is None:
            _warn('the checkpoint holds no random state nor data position (it was written without this '
                  'hook): training resumes, but the data order and augmentations from here on differ from '
                  'an uninterrupted run')
            return
        self._pending = state

    def before_train_epoch(self, runner):
        state, self._pending = self._pending, None
        if state is None:
            return
        loop = runner.train_loop
        loader = loop.dataloader
        bs, sampler = _unwrap_loader_state(loader)
        skip, iter_epoch = 0, None
        problems = []
        if state['dataloader_len'] != len(loader):
            problems.append(f'{len(loader)} batches per epoch, the checkpoint {state["dataloader_len"]}')
        if state['batch_size'] != getattr(loader, 'batch_size', None):
            problems.append(f'batch size {loader.batch_size}, the checkpoint {state["batch_size"]}')
        if state['world_size'] != runner.world_size:
            problems.append(f'{runner.world_size} processes, the checkpoint {state["world_size"]}')
        if problems:
            _warn('the data position is not restored: this run has ' + '; '.join(problems) +
                  '. The random states are restored, the data order differs from an uninterrupted run.')
        elif hasattr(loop, 'run_epoch'):
            skip = state['batches_in_epoch'] or 0
        else:
            # IterBasedTrainLoop: one endless stream of batches (an InfiniteSampler's, or epochs of a
            # finite sampler that mmengine's _InfiniteDataloaderIterator restarts with set_epoch)
            skip = state['iter']
            if not _is_infinite(sampler) and hasattr(sampler, 'set_epoch'):
                iter_epoch, skip = divmod(state['iter'], len(loader))
                sampler.set_epoch(iter_epoch)
        if skip and bs is None:
            _warn('the dataloader has no batch sampler: the batches already trained are not skipped')
            skip = 0
        if skip and getattr(loader, 'num_workers', 0) > 0:
            _warn(f'num_workers={loader.num_workers}: the dataloader workers restart at their seeds, so '
                  f'the augmentations after this mid-epoch resume differ from an uninterrupted run '
                  f'(exact with num_workers=0, or when resuming from an epoch-end checkpoint)')
        if skip:
            skip_batches(bs, skip)
        set_rng_state(state['rng'])
        if hasattr(loop, 'run_epoch'):
            if skip:
                # the uninterrupted run did not start a new dataloader iterator here: do not let this one
                # draw its base seed from the global generator
                self._private_generator(loader)
        elif not problems:
            # rebuild the iterator so that the skip applies (workers may already have prefetched), without
            # a base-seed draw, and make the loop's own advance over `iter` batches a no-op
            from mmengine.runner.loops import _InfiniteDataloaderIterator
            self._private_generator(loader)
            new = _InfiniteDataloaderIterator(loader)
            self._restore_generator()
            if iter_epoch is not None:
                new._epoch = iter_epoch
            loop.dataloader_iterator = _NoOpAdvance(new, state['iter'])
        print_log(f'ExactResumeHook: restored the random states of iteration {state["iter"]}'
                  + (f' and skipped {skip} batches already trained' if skip else ''), logger='current')

    def _private_generator(self, loader):
        self._loader_generator = (loader, loader.generator)
        loader.generator = torch.Generator().manual_seed(0)

    def _restore_generator(self):
        if self._loader_generator is not None:
            loader, gen = self._loader_generator
            loader.generator = gen
            self._loader_generator = None

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        self._restore_generator()

    def after_train_epoch(self, runner):
        self._restore_generator()  # an epoch that the skip left empty

    # ---- validation does not shift the training randomness ---------------------------------------
    def before_val(self, runner):
        if self.neutral_validation:
            self._val_state = rng_state()

    def after_val(self, runner):
        if self._val_state is not None:
            set_rng_state(self._val_state)
            self._val_state = None
