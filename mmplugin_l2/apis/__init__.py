"""What the tools share: config loading and runner set-up (`runner`), checks before a run (`checks`: data,
pretrained weights, checkpoint fit) and `--resume` (`resume`)."""
from .checks import (DATA_HELP, FIT_HINT, DatasetNotFoundError, check_checkpoint_fits, check_data,
                     check_pretrained, dataset_paths, read_checkpoint, unwrap_model)
from .resume import RESUME_HOOK, NothingToResumeError, add_resume_hook, resolve_resume
from .runner import (SCOPES, build_runner, enable_visualization, format_metrics, load_config,
                     set_local_rank, setup_cpu_distributed, to_json)

__all__ = [
    'DATA_HELP',
    'FIT_HINT',
    'DatasetNotFoundError',
    'check_checkpoint_fits',
    'check_data',
    'check_pretrained',
    'dataset_paths',
    'read_checkpoint',
    'unwrap_model',
    'RESUME_HOOK',
    'NothingToResumeError',
    'add_resume_hook',
    'resolve_resume',
    'SCOPES',
    'build_runner',
    'enable_visualization',
    'format_metrics',
    'load_config',
    'set_local_rank',
    'setup_cpu_distributed',
    'to_json',
]
