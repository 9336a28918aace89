"""Checkpoint handling: loading the authors' release files and mmengine's own checkpoints on torch >= 2.6."""
from .io import check_state_dict_fits, extract_state_dict, load_checkpoint_file, load_pretrained
from .safe_globals import register_mmengine_safe_globals

register_mmengine_safe_globals()

__all__ = ['check_state_dict_fits', 'load_checkpoint_file', 'load_pretrained', 'extract_state_dict',
           'register_mmengine_safe_globals']
