"""The conv chain of L2ViT's LCM (DWConv -> GELU -> BN2d -> DWConv) at inference in pieces of rows against
its reference (plain functional ops in float64), including an eval-mode model that holds a train-mode
BatchNorm: the pieces would use the running statistics, so that case must give the batch-statistics output
and update the running statistics exactly as the reference does."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mmplugin_l2.models.layers import LCM
from mmplugin_l2.models.ops.memory import MemoryPolicy

C, K = 3, 3


def _lcm(seed=0):
    torch.manual_seed(seed)
    m = LCM(C, kernel_size=K).double()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.5)
        m.bn.running_mean.normal_(0, 0.3)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def _reference(m, x, hw, norm=None, batch_stats=False, running=None):
    """LCM(norm(x)) with F.conv2d / F.gelu / F.batch_norm on NCHW maps; `running` (mean, var) are updated
    in place when `batch_stats`."""
    b, n, c = x.shape
    if norm is not None:
        x = norm(x)
    t = x.transpose(1, 2).reshape(b, c, *hw)
    pad = K // 2
    t = F.gelu(F.conv2d(t, m.conv1.weight, m.conv1.bias, padding=pad, groups=c))
    mean, var = running if running is not None else (m.bn.running_mean.clone(), m.bn.running_var.clone())
    t = F.batch_norm(t, mean, var, m.bn.weight, m.bn.bias, training=batch_stats, momentum=m.bn.momentum,
                     eps=m.bn.eps)
    t = F.conv2d(t, m.conv2.weight, m.conv2.bias, padding=pad, groups=c)
    return t.flatten(2).transpose(1, 2)


@pytest.mark.parametrize('hw', [(7, 5), (4, 9)])
@pytest.mark.parametrize('with_norm', [False, True])
def test_lcm_inference_in_pieces_matches_reference(hw, with_norm):
    m = _lcm().eval()
    m.memory_policy = MemoryPolicy(max_elems=2 * hw[1] * C, devices=('cpu',))   # a partial last piece
    norm = nn.LayerNorm(C).double() if with_norm else None
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64)
    with torch.no_grad():
        out = m(x, hw, norm=norm)
        ref = _reference(m, x, hw, norm)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_lcm_eval_model_with_train_mode_bn_uses_batch_statistics():
    hw = (7, 5)
    m = _lcm().eval()
    m.bn.train()      # a user's eval-mode model that holds a train-mode BatchNorm
    m.memory_policy = MemoryPolicy(max_elems=2 * hw[1] * C, devices=('cpu',))   # pieces forced
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64)
    running = (m.bn.running_mean.clone(), m.bn.running_var.clone())
    with torch.no_grad():
        ref = _reference(m, x, hw, batch_stats=True, running=running)
        out = m(x, hw)
        eval_ref = _reference(m, x, hw)       # the running statistics (before the update): must differ
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out, eval_ref, atol=1e-6)
    torch.testing.assert_close(m.bn.running_mean, running[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(m.bn.running_var, running[1], rtol=1e-12, atol=1e-14)
    assert m.bn.num_batches_tracked.item() == 1


def test_lcm_eval_with_grad_matches_reference():
    hw = (5, 6)
    m = _lcm().eval()
    m.memory_policy = MemoryPolicy(max_elems=2 * hw[1] * C, devices=('cpu',))
    x = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, hw[0] * hw[1], C, dtype=torch.float64)
    (m(x, hw) * g).sum().backward()
    (_reference(m, x2, hw) * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_lcm_pieces_under_autocast(dtype):
    hw = (7, 5)
    m = _lcm().float().eval()
    m.memory_policy = MemoryPolicy(max_elems=2 * hw[1] * C, devices=('cpu',))
    x = torch.randn(2, hw[0] * hw[1], C)
    with torch.no_grad():
        ref = _reference(m, x, hw)
        with torch.autocast('cpu', dtype=dtype):
            out = m(x, hw)
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
