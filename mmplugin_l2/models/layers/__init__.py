"""Building blocks named after the papers, shared by the backbone families."""
from .conv import ConvLayer
from .cpe import CPE, map_to_tokens, tokens_conv, tokens_to_map
from .mlp import ConvMlp, Mlp
from .rope import apply_rope, rope_tables
from .stem import ConvDownsample, ConvStem, pad_to_multiple
from .ttt import TTTAttention, dwconv_inner_grad, normalize_inner_grad, swiglu_inner_grads

__all__ = ['ConvLayer', 'CPE', 'map_to_tokens', 'tokens_conv', 'tokens_to_map', 'ConvMlp', 'Mlp', 'apply_rope',
           'rope_tables', 'ConvDownsample', 'ConvStem', 'pad_to_multiple', 'TTTAttention',
           'dwconv_inner_grad', 'normalize_inner_grad', 'swiglu_inner_grads']
