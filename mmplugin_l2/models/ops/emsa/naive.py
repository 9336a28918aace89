"""ResT's EMSA attention as the paper writes it (Eq. 4): the oracle every implementation of `ops.emsa` is
tested against (float64, values and gradients).

For queries q (B, h, N, d), keys and values k, v (B, h, N', d) of the reduced map and the scale d^-0.5:

    h > 1:  A = IN(Softmax(Conv1x1(q k^T * scale)))     Conv1x1 mixes the h heads; IN: no affine, eps,
                                                        over each (image, head) N x N' map
    h = 1:  A = Softmax(q k^T * scale)                  (the authors' code skips Conv1x1 and IN)

    EMSA = A v

Written as above A is ill-conditioned in low precision (the softmax is close to uniform and IN subtracts its
mean); the reference computes the same function without that cancellation.
"""
import torch.nn.functional as F


def emsa_attention_naive(q, k, v, scale, transform_conv=None, eps=1e-5):
    """A v on the whole map (`emsa_attention`'s signature without the piece).

    Args:
        q (Tensor): queries (B, h, N, d).
        k (Tensor): keys (B, h, N', d).
        v (Tensor): values (B, h, N', d).
        scale (float): the logits' scale.
        transform_conv (nn.Conv2d | None): the (h, h) 1x1 head-mixing conv (its weight and bias); None: h = 1.
        eps (float): the instance norm's eps. Default: 1e-5.

    Returns:
        Tensor: (B, h, N, d).
    """
    s = q @ k.transpose(-2, -1) * scale
    if transform_conv is None:
        return s.softmax(-1) @ v
    s = F.conv2d(s, transform_conv.weight, transform_conv.bias)
    return F.instance_norm(s.softmax(-1), eps=eps) @ v
