"""FlexAttention backend against the float64 eager reference.

Torch runs flex backward only on CUDA, so on the CPU only the (eager, unfused) forward is
checked; gradients, learned slopes and the compiled kernel are checked on a GPU.
"""

import warnings

import pytest
import torch

from kernels.alibi_flex import flex_alibi_attention
from kernels.attention import alibi_attention, eager_alibi_attention

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")


def _qkv(bsz, heads, n, head_dim, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(bsz, heads, n, head_dim, generator=g).to(device, dtype) for _ in range(4)]


def _ref(q, k, v, grid, prefix, slopes, wrap, normalize):
    s = None if slopes is None else slopes.double()
    return eager_alibi_attention(q.double(), k.double(), v.double(), grid, prefix, s, wrap, normalize)


@pytest.mark.parametrize("bias_mode", ["sqrt", "table", "dense"])
@pytest.mark.parametrize("grid,prefix,wrap,normalize,use_slopes", [
    ((3, 5), 1, True, True, True),
    ((5, 3), 0, False, True, False),
    ((4, 4), 5, True, False, True),
    ((1, 1), 1, True, True, True),
])
def test_forward_matches_reference_cpu(grid, prefix, wrap, normalize, use_slopes, bias_mode):
    """Every score_mod: the bias from token indices, gathered from the difference table, read from the
    materialised (N, N) bias."""
    n = prefix + grid[0] * grid[1]
    q, k, v, _ = _qkv(2, 3, n, 32, "cpu", torch.float32)
    slopes = torch.tensor([0.5, 1.0, 2.5]) if use_slopes else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_alibi_attention(q, k, v, grid, prefix, slopes, wrap, normalize, bias_mode=bias_mode)
    torch.testing.assert_close(out.double(), _ref(q, k, v, grid, prefix, slopes, wrap, normalize),
                               atol=2e-6, rtol=1e-5)


def test_dispatcher_routes_to_flex_cpu():
    q, k, v, _ = _qkv(1, 2, 1 + 6, 16, "cpu", torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = alibi_attention(q, k, v, (2, 3), 1, None, backend="flex")
    torch.testing.assert_close(got.double(), _ref(q, k, v, (2, 3), 1, None, True, True), atol=2e-6, rtol=1e-5)


def test_table_mode_takes_the_manhattan_table_and_rejects_unknown_modes():
    grid, prefix = (3, 4), 2
    q, k, v, _ = _qkv(1, 2, prefix + 12, 16, "cpu", torch.float32, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex_alibi_attention(q, k, v, grid, prefix, None, True, True, metric="manhattan", bias_mode="table")
    ref = eager_alibi_attention(q.double(), k.double(), v.double(), grid, prefix, None, True, True, metric="manhattan")
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="bias_mode must be one of"):
        flex_alibi_attention(q, k, v, grid, prefix, None, True, True, bias_mode="pairs")


@pytest.mark.skipif(CUDA, reason="checks the CPU limitation")
def test_cpu_training_is_refused_clearly():
    q, k, v, _ = _qkv(1, 1, 5, 16, "cpu", torch.float32)
    q.requires_grad_()
    with pytest.raises(ValueError, match="no backward on the CPU"):
        flex_alibi_attention(q, k, v, (2, 2), 1, None, True, True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("grid,prefix,wrap,bias_mode", [((7, 9), 5, True, "sqrt"), ((16, 16), 1, False, "sqrt"),
                                                        ((7, 9), 5, True, "table"), ((7, 9), 5, True, "dense")])
def test_gpu_compiled_forward_backward_and_slope_grad(grid, prefix, wrap, bias_mode, dtype, atol):
    n = prefix + grid[0] * grid[1]
    q, k, v, do = _qkv(2, 4, n, 64, "cuda", dtype, seed=1)
    slopes = torch.tensor([0.5, 1.0, 1.5, 3.0], device="cuda", requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flex_alibi_attention(*leaves, grid, prefix, slopes, wrap, True, bias_mode=bias_mode)
    grads = torch.autograd.grad(out, [*leaves, slopes], do)

    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_s = slopes.detach().double().requires_grad_()
    ref = eager_alibi_attention(*ref_leaves, grid, prefix, ref_s, wrap, True)
    ref_grads = torch.autograd.grad(ref, [*ref_leaves, ref_s], do.double())
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)
    for g, r in zip(grads[:3], ref_grads[:3]):
        torch.testing.assert_close(g.double(), r, atol=2 * atol, rtol=2 * atol)
    # Gradient through the captured per-head scale reaches the learned slopes.
    slope_tol = 2 * atol * max(1.0, ref_grads[3].abs().max().item())
    torch.testing.assert_close(grads[3].double(), ref_grads[3], atol=slope_tol, rtol=2 * atol)
