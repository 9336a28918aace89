"""Building blocks named after the papers, shared by the backbone families."""
from .conv import Conv2dCL, ConvLayer
from .cpe import CPE, map_to_tokens, tokens_conv, tokens_to_map
from .mlp import ConvMlp, Mlp
from .rope import apply_rope, rope_tables
from .stem import ConvDownsample, ConvStem, pad_to_multiple
from .stem import ConvStem2L  # noqa: E402  (L2ViT)
from .linear_attention import LCM, LinearAttention  # noqa: E402  (L2ViT)
from .window_attention import WindowAttention, window_partition, window_reverse  # noqa: E402  (L2ViT)
from .ttt import TTTAttention, dwconv_inner_grad, normalize_inner_grad, swiglu_inner_grads

__all__ = ['Conv2dCL', 'ConvLayer', 'CPE', 'map_to_tokens', 'tokens_conv', 'tokens_to_map', 'ConvMlp', 'Mlp', 'apply_rope',
           'rope_tables', 'ConvDownsample', 'ConvStem', 'pad_to_multiple', 'TTTAttention',
           'dwconv_inner_grad', 'normalize_inner_grad', 'swiglu_inner_grads']
__all__ += ['ConvStem2L', 'LCM', 'LinearAttention', 'WindowAttention', 'window_partition', 'window_reverse']
from .pa import PA  # noqa: E402  (ResT)
from .rest_stem import ResTStem  # noqa: E402  (ResT)
from .rest_patch_embed import ResTPatchEmbed  # noqa: E402  (ResT)
from .emsa import EMSA, ChunkedEMSAAttention, emsa_attention, naive_emsa_attention  # noqa: E402  (ResT)

__all__ += ['PA', 'ResTStem', 'ResTPatchEmbed', 'EMSA', 'ChunkedEMSAAttention', 'emsa_attention',
            'naive_emsa_attention']
