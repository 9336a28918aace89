"""EMSA, ResT's efficient multi-head self-attention (Zhang & Yang, arXiv 2105.13677, Eq. 4 and the code).

For tokens x (B, N, C) of an (H, W) map, h heads of d = C / h channels, spatial reduction s:

    q    = Linear_q(x)                                 -> (B, h, N, d)
    x'   = LN(DWConv(x as a map))                      -> (B, N', C)  k = s + 1, stride s, padding s // 2
                                                          (`sr`, `sr_norm`), N' = ceil(H / s) * ceil(W / s);
                                                          with s = 1: x' = x, there is no `sr` / `sr_norm`
    k, v = Linear_kv(x')                               -> (B, h, N', d) each; output rows [0:C] are K and
                                                          [C:2C] are V, heads contiguous within each
    S    = (q @ k^T) * d^-0.5                          -> (B, h, N, N')
    h > 1:  A = IN(softmax(Conv1x1(S)))                   the 1x1 conv (`transform_conv`, with bias) mixes the
                                                          heads before the softmax over N'; the instance
                                                          norm (no affine, eps 1e-5) normalises each (image,
                                                          head) N x N' map over all of its entries
    h = 1:  A = softmax(S)                                no conv and no IN, as the authors' code
    out  = Linear_proj(merge_heads(A @ v))             -> (B, N, C)

The maths of A @ v: `ops/emsa/naive.py` (`emsa_attention_naive`: Eq. 4 as written). It runs as the op
`ops.emsa` (a well-conditioned form of the same function; its reference and fast paths are
described there), chosen once per forward by `ops.dispatch.choose`.
"""
import torch.nn as nn

from ...deprecation import renamed_attributes
from ..ops import choose
from ..ops.emsa import EMSA_ATTENTION, EMSAPiecesFunction, emsa_attention, emsa_attention_reference
from ..ops.memory import DEFAULT_POLICY
from ..ops.tokens import map_to_tokens, tokens_to_map
from .conv import Conv2dCL

__all__ = ['EMSA', 'EMSAPiecesFunction', 'emsa_attention', 'emsa_attention_reference']


class EMSA(nn.Module):
    """Efficient multi-head self-attention on tokens (B, N, C) of an (H, W) map; see the module docstring.

    Args:
        dim (int): channels C.
        num_heads (int): heads h.
        sr_ratio (int): spatial reduction s of K and V. Default: 1.
        qkv_bias (bool): biases of `q` and `kv` (the ResT factories set True). Default: False.
        qk_scale (float | None): the logits' scale; None: d^-0.5. Default: None.
        attn_drop (float): dropout on the attention map (0 in ResT; > 0 takes the reference in training).
            Default: 0.
        proj_drop (float): dropout after `proj`. Default: 0.
        apply_transform (bool): the head-mixing conv + IN when num_heads > 1. Default: True.
        fast_train (bool): in training, large maps take the train path (pieces of queries recomputed in
            backward) on the memory policy's devices. Default: True.

    forward(x, hw_shape): x (B, N, C) tokens of an (H, W) map -> (B, N, C).
    """

    #: pieces of the attention map (query rows x keys x heads, the batch included)
    memory_policy = DEFAULT_POLICY

    def __init__(self, dim, num_heads, sr_ratio=1, qkv_bias=False, qk_scale=None, attn_drop=0., proj_drop=0.,
                 apply_transform=True, fast_train=True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'EMSA: dim {dim} is not divisible by num_heads {num_heads}')
        self.num_heads = num_heads
        self.scale = qk_scale or (dim // num_heads) ** -0.5
        self.sr_ratio = sr_ratio
        self.fast_train = fast_train
        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        if sr_ratio > 1:
            self.sr = Conv2dCL(dim, dim, kernel_size=sr_ratio + 1, stride=sr_ratio, padding=sr_ratio // 2,
                               groups=dim)
            self.sr_norm = nn.LayerNorm(dim)
        self.apply_transform = apply_transform and num_heads > 1
        if self.apply_transform:
            self.transform_conv = nn.Conv2d(num_heads, num_heads, kernel_size=1)
            self.transform_norm = nn.InstanceNorm2d(num_heads)  # no parameters, no running statistics

    def forward(self, x, hw_shape):
        b, n, c = x.shape
        h = self.num_heads
        q = self.q(x).reshape(b, n, h, c // h).permute(0, 2, 1, 3)
        if self.sr_ratio > 1:
            x = self.sr_norm(map_to_tokens(self.sr(tokens_to_map(x, hw_shape))))
        k, v = self.kv(x).reshape(b, -1, 2, h, c // h).permute(2, 0, 3, 1, 4).unbind(0)
        conv = self.transform_conv if self.apply_transform else None
        eps = self.transform_norm.eps if self.apply_transform else 1e-5
        path = choose(self, x, b * h * n * k.shape[2], EMSA_ATTENTION, modules=(self.attn_drop,))
        out = emsa_attention(path, q, k, v, self.scale, conv, eps, self.attn_drop if self.attn_drop.p > 0 else None)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))


__getattr__ = renamed_attributes(__name__, globals(), {'naive_emsa_attention': 'emsa_attention_reference',
                                                       'ChunkedEMSAAttention': 'EMSAPiecesFunction'})
