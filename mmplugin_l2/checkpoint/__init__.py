"""Checkpoint handling: loading the authors' release files and mmengine's own checkpoints on torch >= 2.6."""
from .io import (CheckpointError, check_state_dict_fits, describe_mismatch, extract_state_dict,
                 load_checkpoint_file, load_pretrained, model_state_dict, state_dict_mismatch)
from .safe_globals import register_mmengine_safe_globals

register_mmengine_safe_globals()

__all__ = ['CheckpointError', 'check_state_dict_fits', 'describe_mismatch', 'model_state_dict',
           'state_dict_mismatch', 'load_checkpoint_file', 'load_pretrained', 'extract_state_dict',
           'register_mmengine_safe_globals']
