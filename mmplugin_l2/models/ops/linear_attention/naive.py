"""L2ViT's linear attention as the paper writes it (Eq. 2 with the ReLU kernel, the clamp and the scale s):
the oracle every implementation of `ops.linear_attention` is tested against (float64, values and gradients).

Per head, with phi = ReLU, Sim(Q_i, K_j) = phi(Q_i) phi(K_j)^T, the per-head scale s (`temperature`) and the
clamp c of the denominator:

    O_i = s sum_j Sim(Q_i, K_j) V_j / max(sum_j Sim(Q_i, K_j), c)

written with the N x N attention matrix (quadratic in N); the fast paths use the associative order
phi(Q) (phi(K)^T V) instead.
"""


def linear_attention_naive(q, k, v, temperature, clamp_min=100.):
    """The linear attention from q, k, v before the feature map (`linear_attention_reference`'s signature).

    Args:
        q (Tensor): queries (B, heads, N, d).
        k (Tensor): keys (B, heads, N, d).
        v (Tensor): values (B, heads, N, d).
        temperature (Tensor): s, (heads, 1, 1).
        clamp_min (float): c. Default: 100.

    Returns:
        Tensor: (B, heads, N, d).
    """
    sim = q.relu() @ k.relu().transpose(-2, -1)
    return temperature * (sim @ v) / sim.sum(-1, keepdim=True).clamp_min(clamp_min)
