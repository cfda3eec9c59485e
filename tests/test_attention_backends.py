"""The reference backends of kernels.alibi_attention: values, gradients, caching and errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels import alibi_attention, alibi_bias, resolve_backend
from kernels.alibi_bias import cached_alibi_bias


def make_qkv(b=2, heads=3, grid=(3, 4), prefix=5, d=8, dtype=torch.float64, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    n = prefix + grid[0] * grid[1]
    return [torch.randn(b, heads, n, d, generator=gen, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def textbook_attention(q, k, v, bias, slopes):
    """softmax(q kᵀ/√d + m_h B) v written out, from a bias matrix built independently."""
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    scores = scores + slopes.view(1, -1, 1, 1) * bias
    return torch.einsum("bhij,bhjd->bhid", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("grid,prefix,wrap,normalize", [
    ((3, 4), 5, True, True), ((3, 4), 1, False, True), ((2, 5), 0, True, False), ((1, 1), 5, True, True),
])
def test_backend_matches_textbook_formula(backend, grid, prefix, wrap, normalize):
    q, k, v = make_qkv(grid=grid, prefix=prefix)
    slopes = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    bias = alibi_bias(grid, prefix, wrap=wrap, normalize=normalize, dtype=torch.float64)
    want = textbook_attention(q, k, v, bias, slopes)
    got = alibi_attention(q, k, v, grid, prefix, slopes, wrap=wrap, normalize=normalize, backend=backend)
    torch.testing.assert_close(got, want)


def test_default_slopes_are_one():
    q, k, v = make_qkv()
    ones = torch.ones(3, dtype=torch.float64)
    torch.testing.assert_close(alibi_attention(q, k, v, (3, 4), 5, backend="eager"),
                               alibi_attention(q, k, v, (3, 4), 5, ones, backend="eager"))


def test_one_by_one_grid_equals_plain_attention():
    q, k, v = make_qkv(grid=(1, 1), prefix=5)
    torch.testing.assert_close(alibi_attention(q, k, v, (1, 1), 5, backend="sdpa"), F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_gradients_pass_gradcheck(backend):
    q, k, v = make_qkv(b=1, heads=2, grid=(2, 3), prefix=1, d=4, requires_grad=True)
    slopes = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: alibi_attention(q, k, v, (2, 3), 1, m, backend=backend), (q, k, v, slopes))


def test_slope_gradient_is_sum_of_score_gradient_times_bias():
    # docs/method.md §2: dL/dm_h = Σ_ij dL/ds_ij · B_ij, checked against autograd through explicit scores.
    q, k, v = make_qkv(grid=(3, 3), prefix=1)
    bias = alibi_bias((3, 3), 1, dtype=torch.float64)
    slopes = torch.tensor([0.5, 1.0, 1.5], dtype=torch.float64, requires_grad=True)
    out = alibi_attention(q, k, v, (3, 3), 1, slopes, backend="sdpa")
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()
    scores = (torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1]) + slopes.detach().view(1, -1, 1, 1) * bias)
    scores.requires_grad_(True)
    (torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v) * grad_out).sum().backward()
    expected = (scores.grad * bias).sum(dim=(0, 2, 3))
    torch.testing.assert_close(slopes.grad, expected)


def test_sdpa_and_eager_agree_in_float32_values_and_gradients():
    q, k, v = make_qkv(grid=(4, 5), prefix=5, d=16, dtype=torch.float32, requires_grad=True)
    slopes = torch.tensor([1.0, 0.25, 3.0], requires_grad=True)
    grads = {}
    for backend in ("eager", "sdpa"):
        out = alibi_attention(q, k, v, (4, 5), 5, slopes, backend=backend)
        g = torch.autograd.grad(out.square().sum(), (q, k, v, slopes))
        grads[backend] = (out.detach(), *g)
    for a, b in zip(grads["eager"], grads["sdpa"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bias_is_built_once_and_shared():
    cached_alibi_bias.cache_clear()
    q, k, v = make_qkv(dtype=torch.float32)
    for _ in range(3):
        alibi_attention(q, k, v, (3, 4), 5, backend="sdpa")
    info = cached_alibi_bias.cache_info()
    assert (info.misses, info.hits) == (1, 2)


def test_bias_cached_under_inference_mode_still_trains():
    cached_alibi_bias.cache_clear()
    q, k, v = make_qkv(dtype=torch.float32)
    with torch.inference_mode():
        alibi_attention(q, k, v, (3, 4), 5, backend="sdpa")
    slopes = torch.ones(3, requires_grad=True)
    alibi_attention(q, k, v, (3, 4), 5, slopes, backend="sdpa").sum().backward()
    assert slopes.grad is not None


def test_auto_picks_sdpa_on_cpu():
    q, _, _ = make_qkv(dtype=torch.float32)
    assert resolve_backend("auto", q) == "sdpa"
    assert resolve_backend("eager", q) == "eager"


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_auto_rule_for_cuda_dtypes_and_fp32_precision(matmul_precision):
    """auto: the fused kernel for 16-bit CUDA inputs; fp32 only once tf32 is allowed, else SDPA."""
    from kernels import attention

    if attention.alibi_triton is None:
        pytest.skip("triton is not installed")
    matmul_precision("highest")
    assert attention.auto_backend("cuda", 64, torch.bfloat16) == "triton"
    assert attention.auto_backend("cuda", 64, torch.float16) == "triton"
    assert attention.auto_backend("cuda", 64, torch.float32) == "sdpa"  # exact fp32 would skip tensor cores
    assert attention.auto_backend("cuda", 48, torch.bfloat16) == "sdpa"  # head_dim the kernel lacks
    assert attention.auto_backend("cpu", 64, torch.bfloat16) == "sdpa"
    matmul_precision("high")
    assert attention.auto_backend("cuda", 64, torch.float32) == "triton"
    assert attention.alibi_triton._dot_precision(torch.float32) == "tf32"
    matmul_precision("highest")
    assert attention.alibi_triton._dot_precision(torch.float32) == "ieee"


def test_auto_uses_the_autocast_dtype(monkeypatch):
    from kernels import attention

    q, _, _ = make_qkv(dtype=torch.float32)
    calls = []
    real = attention.auto_backend
    monkeypatch.setattr(attention, "auto_backend", lambda *a: calls.append(a) or real(*a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert resolve_backend("auto", q) == "sdpa"  # CPU: never the fused kernel
    resolve_backend("auto", q)
    assert calls == [("cpu", 8, torch.bfloat16), ("cpu", 8, torch.float32)]


@pytest.mark.parametrize("call,match", [
    (lambda q, k, v: alibi_attention(q, k, v, (3, 4), 5, backend="fast"), "unknown attention backend"),
    (lambda q, k, v: alibi_attention(q, k, v, (3, 3), 5), "does not match the grid"),
    (lambda q, k, v: alibi_attention(q, k, v, (3, 4), 4), "does not match the grid"),
    (lambda q, k, v: alibi_attention(q[0], k[0], v[0], (3, 4), 5), "4D tensor"),
    (lambda q, k, v: alibi_attention(q, k[:, :2], v, (3, 4), 5), "same shape"),
    (lambda q, k, v: alibi_attention(q, k, v, (0, 4), 5), "grid_size"),
    (lambda q, k, v: alibi_attention(q, k, v, (3, 4), 5, torch.ones(2, dtype=torch.float64)), "slopes"),
    (lambda q, k, v: alibi_attention(q, k, v, (3, 4), -5), "num_prefix_tokens"),
])
def test_bad_input_is_a_clear_error(call, match):
    q, k, v = make_qkv()
    with pytest.raises(ValueError, match=match):
        call(q, k, v)
