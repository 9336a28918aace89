"""`--resume`: which checkpoint to continue from, and the hook that makes the continuation exact."""
import os.path as osp


class NothingToResumeError(FileNotFoundError):
    pass


def resolve_resume(cfg, resume):
    """`--resume` (auto: the latest checkpoint of work_dir, as named by its `last_checkpoint` file) or
    `--resume PATH` -> the checkpoint path; set cfg.resume / cfg.load_from. Nothing to resume is an
    error (NothingToResumeError), not a silent run from scratch."""
    if resume is None:
        return None
    if resume == 'auto':
        from mmengine.runner import find_latest_checkpoint
        path = find_latest_checkpoint(cfg.work_dir) if osp.isdir(cfg.work_dir) else None
        if path is None:
            raise NothingToResumeError(
                f'--resume: nothing to resume in work dir {cfg.work_dir!r} (no last_checkpoint file there; '
                f'it is written with each checkpoint). Start without --resume to train from scratch, pass '
                f'the checkpoint as --resume PATH, or point --work-dir at the interrupted run.')
    else:
        path = resume
        if not osp.exists(path):
            raise NothingToResumeError(f'--resume: checkpoint file not found: {path!r}')
    cfg.resume, cfg.load_from = True, path
    return path


RESUME_HOOK = 'ExactResumeHook'


def add_resume_hook(cfg):
    """Add ExactResumeHook (mmplugin_l2.hooks) to `custom_hooks` unless the config lists it; a config
    opts out with `exact_resume = False`."""
    if cfg.get('exact_resume', True) is False:
        return
    hooks = list(cfg.get('custom_hooks') or [])
    if not any(h.get('type') in (RESUME_HOOK, f'mmplugin_l2.{RESUME_HOOK}') for h in hooks):
        hooks.append(dict(type=RESUME_HOOK))
    cfg.custom_hooks = hooks
