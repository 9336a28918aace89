"""The TTT inner step, written once for every implementation of the op except `naive` (the oracle).

One full-batch gradient step of an inner model W on its keys and values (N tokens) with the inner loss
L = -(scale / N) sum(f_W(k) * v) and learning rate lr:

    W' = W - lr * g / (||g|| + 1),   g = dL/dW = (-scale / N) * G          (`loss_factor`, `normalise`, `update`)

with G the unscaled sum over the tokens (k^T a for the SwiGLU model, the tap sums for the conv head). The
SwiGLU model f(x) = (x W1) * SiLU(x W2) has a = [v SiLU(z2) | v z1 SiLU'(z2)], z = k [W1 | W2]
(`silu_grad`). Backward through the step: `normalise_backward`.
"""
import torch

from ..export import exporting


def loss_factor(scale, n):
    """-scale / N, the inner loss's factor; while exporting, n (a traced size) stays in the graph."""
    return -scale / n if exporting() else -scale / float(n)


def normalise(g, dim):
    """The authors' gradient "clip": g / (||g||_2 over `dim` + 1)."""
    return g / (g.norm(dim=dim, keepdim=True) + 1.0)


def update(w, g, lr, dim):
    """The inner step W' = W - lr * normalise(g) (normalised over `dim`), in W's dtype."""
    return w - (lr * normalise(g, dim)).to(w.dtype)


def silu_grad(z, s):
    """SiLU'(z) = s + SiLU(z) (1 - s), s = sigmoid(z)."""
    return s + z * s * (1.0 - s)


def normalise_backward(g, dgn, dim):
    """dL/dg of gn = g / (||g|| + 1) (norm over `dim`) from dgn = dL/dgn:
    (dgn - g <dgn, g> / (||g|| (||g|| + 1))) / (||g|| + 1), the projection term dropped where ||g|| = 0
    (g is zero there; autograd's norm subgradient is zero too)."""
    nrm = g.norm(dim=dim, keepdim=True)
    den = nrm + 1.0
    dot = (dgn * g).sum(dim=dim, keepdim=True)
    return (dgn - g * (dot / (nrm.clamp_min(torch.finfo(g.dtype).tiny) * den))) / den
