"""Building blocks, one module per paper concept, shared by the three backbone families.

Paper concepts: `ttt` (TTT layer and its inner models), `cpe`, `lcm`, `linear_attention` (LGA),
`window_attention` (LWA), `emsa`, `pa`, `stems` (stems and downsamplings of all three families), `mlp`; `conv`
(ConvLayer, the channels-last conv, the accurate BatchNorm). The ops behind the layers, their dispatch, the
memory policy and its pieces, and the shared mechanics (RoPE's maths, token / map reshapes, checkpointing) are
under `models/ops/`.
"""
from ...deprecation import renamed_attributes
from .conv import Conv2dCL, ConvLayer
from .cpe import CPE, ResidualCPE
from .emsa import EMSA, EMSAPiecesFunction, emsa_attention, emsa_attention_reference
from .lcm import LCM
from .linear_attention import LinearAttention
from ..ops.memory import MemoryPolicy, set_memory_policy
from .mlp import ConvMlp, Mlp
from .pa import PA
from ..ops.rope import apply_rope, rope_tables
from .stems import (ConvDownsample, ConvStem, ConvStem2L, L2ViTDownsample, L2ViTStem, ResTPatchEmbed,
                    ResTStem)
from ..ops.tokens import add_residual, map_to_tokens, pad_to_multiple, tokens_conv, tokens_to_map
from .ttt import TTTAttention, dwconv_inner_grad, normalize_inner_grad, swiglu_inner_grads
from .window_attention import WindowAttention, window_partition, window_reverse

__all__ = [
    'Conv2dCL', 'ConvLayer', 'CPE', 'ResidualCPE', 'EMSA', 'EMSAPiecesFunction', 'emsa_attention',
    'emsa_attention_reference', 'LCM', 'LinearAttention', 'MemoryPolicy', 'set_memory_policy', 'ConvMlp', 'Mlp',
    'PA', 'apply_rope', 'rope_tables', 'ConvDownsample', 'ConvStem', 'ConvStem2L', 'L2ViTDownsample',
    'L2ViTStem', 'ResTPatchEmbed', 'ResTStem', 'add_residual', 'map_to_tokens', 'pad_to_multiple', 'tokens_conv',
    'tokens_to_map', 'TTTAttention', 'dwconv_inner_grad', 'normalize_inner_grad', 'swiglu_inner_grads',
    'WindowAttention', 'window_partition', 'window_reverse',
]

__getattr__ = renamed_attributes(__name__, globals(), {'naive_emsa_attention': 'emsa_attention_reference',
                                                       'ChunkedEMSAAttention': 'EMSAPiecesFunction'})
