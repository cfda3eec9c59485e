"""Fused Triton ALiBi attention against the float64 eager reference.

On a machine without CUDA the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1,
set by conftest.py, and here as well in case this file runs alone); shapes stay tiny. Cases
marked ``gpu`` need a CUDA device (bf16, long sequences, torch.compile).
"""

import inspect
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
tl = triton.language

from kernels.alibi_bias import device_bias_lookup  # noqa: E402
from kernels.attention import alibi_attention, eager_alibi_attention  # noqa: E402
from kernels.alibi_triton import (  # noqa: E402
    ROW_PARTIALS,
    _add_row_products,
    alibi_attention_bwd,
    alibi_attention_fwd,
    triton_alibi_attention,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def needs_gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(fn))


TOL = {  # (forward atol, gradient atol); rtol alongside
    torch.float32: (2e-5, 5e-5),
    torch.float16: (4e-3, 1.5e-2),
    torch.bfloat16: (2.5e-2, 8e-2),
}


def _inputs(bsz, heads, grid, prefix, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = prefix + grid[0] * grid[1]
    q, k, v, do = (torch.randn(bsz, heads, n, head_dim, generator=g).to(DEVICE, dtype) for _ in range(4))
    # Distinct per-head slopes so a head mix-up cannot cancel out.
    slopes = (0.5 + torch.arange(heads, dtype=torch.float32) * 0.75).to(DEVICE)
    return q, k, v, do, slopes


def _reference(q, k, v, do, grid, prefix, slopes, wrap, normalize):
    """Output and gradients of the eager reference in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = None if slopes is None else slopes.detach().double().requires_grad_()
    out = eager_alibi_attention(*leaves, grid, prefix, s, wrap, normalize)
    grads = torch.autograd.grad(out, leaves + ([s] if s is not None else []), do.double())
    return out, grads


def _check(got, want, atol, what):
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), what
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=atol, msg=lambda m: f"{what}: {m}")


def _run_and_compare(grid, prefix, wrap, normalize, head_dim, bias_mode, slope_kind, dtype,
                     bsz=2, heads=3, seed=0):
    q, k, v, do, slopes = _inputs(bsz, heads, grid, prefix, head_dim, dtype, seed)
    if slope_kind == "none":
        slopes = None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if slope_kind == "learned":
        slopes = slopes.clone().requires_grad_()
        leaves.append(slopes)
    out = triton_alibi_attention(*leaves[:3], grid, prefix, slopes, wrap, normalize, bias_mode=bias_mode)
    assert out.dtype == dtype and out.shape == q.shape
    grads = torch.autograd.grad(out, leaves, do)
    ref_out, ref_grads = _reference(q, k, v, do, grid, prefix, slopes, wrap, normalize)
    fwd_tol, grad_tol = TOL[dtype]
    _check(out, ref_out, fwd_tol, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == dtype
        _check(g, r, grad_tol, name)
    if slope_kind == "learned":
        # dL/dm_h sums over B·N² terms: compare relative to its size.
        _check(grads[3], ref_grads[3], grad_tol * max(1.0, ref_grads[3].abs().max().item()), "dslopes")


# grid, prefix, wrap, normalize, head_dim, bias_mode, slopes
FP32_CASES = [
    ((3, 5), 1, True, True, 32, "table", "learned"),
    ((3, 5), 1, True, True, 32, "sqrt", "learned"),
    ((5, 3), 0, False, True, 32, "table", "none"),
    ((5, 3), 0, False, True, 32, "sqrt", "fixed"),
    ((4, 4), 5, True, False, 64, "table", "learned"),
    ((4, 4), 5, False, False, 64, "sqrt", "learned"),
    # N = 47: several query and key blocks under the interpreter's 16/32 tiles, partial tails.
    ((6, 7), 5, True, True, 32, "table", "learned"),
    ((7, 6), 1, False, True, 16, "sqrt", "learned"),
    ((1, 1), 1, True, True, 32, "table", "learned"),   # N = 2, d_max = 0
    ((1, 1), 0, False, False, 32, "sqrt", "learned"),  # N = 1
    ((2, 9), 1, True, True, 128, "table", "learned"),
]


@pytest.mark.parametrize("grid,prefix,wrap,normalize,head_dim,bias_mode,slopes", FP32_CASES)
def test_matches_reference_fp32(grid, prefix, wrap, normalize, head_dim, bias_mode, slopes):
    _run_and_compare(grid, prefix, wrap, normalize, head_dim, bias_mode, slopes, torch.float32)


@pytest.mark.parametrize("bias_mode", ["table", "sqrt"])
def test_matches_reference_fp16(bias_mode):
    _run_and_compare((5, 4), 5, True, True, 64, bias_mode, "learned", torch.float16)


@pytest.mark.parametrize("grid,prefix,wrap,normalize,bias_mode,slopes", [
    ((6, 7), 5, True, True, "table", "none"),   # N = 47: partial key and query tiles
    ((5, 4), 1, False, False, "table", "none"),
    ((3, 3), 0, True, True, "table", "none"),
    ((4, 5), 5, True, True, "sqrt", "none"),    # slopes=None without head pairs: one slope read by every head
    ((6, 7), 5, True, True, "table", "fixed"),  # a slope per head: one gathered tile, each head's own factor
    ((5, 4), 1, True, False, "table", "learned"),
])
def test_head_pairs_match_reference(grid, prefix, wrap, normalize, bias_mode, slopes):
    """4 heads, fp16, table mode: each forward and dQ program computes two heads from one gathered bias tile,
    with one slope for all heads or each head's own (distinct per head, so a mix-up shows)."""
    from kernels import alibi_triton as at

    q = torch.zeros(1, 4, prefix + grid[0] * grid[1], 32, dtype=torch.float16)
    assert at.head_pair(q, torch.ones(4), bias_mode == "table") == (bias_mode == "table")
    _run_and_compare(grid, prefix, wrap, normalize, 32, bias_mode, slopes, torch.float16, heads=4, seed=3)


@triton.jit
def _loop_sum_kernel(X, Out, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):  # a run-time loop bound: the interpreter converts it with int()
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(X + offs, mask=offs < n, other=0.0)
    tl.store(Out, tl.sum(acc, 0))


@pytest.mark.skipif(CUDA, reason="checks Triton's CPU interpreter")
def test_interpreter_runs_loops_with_run_time_bounds():
    """Triton 3.6's interpreter converted loop bounds with int() on a one-element array, which numpy >= 2.4
    refuses; kernels.triton_interpreter makes it take the scalar (applied once, on import of the kernels)."""
    from kernels import triton_interpreter

    assert not triton_interpreter.patch()  # already applied by kernels.alibi_triton
    x, out = torch.arange(37, dtype=torch.float32), torch.zeros(1)
    _loop_sum_kernel[(1,)](x, out, 37, BLOCK=8)
    assert out.item() == sum(range(37))


@triton.jit
def _row_products_kernel(X, Y, Out, Sums, ROWS: tl.constexpr, COLS: tl.constexpr, TILES: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    acc = tl.zeros([ROWS, ROW_PARTIALS], tl.float32)
    for t in tl.static_range(TILES):  # carried across tiles, as the dK/dV kernel carries the slope partials
        acc = _add_row_products(acc, tl.load(X + t * ROWS * COLS + offs), tl.load(Y + t * ROWS * COLS + offs))
    tl.store(Out + tl.arange(0, ROWS)[:, None] * ROW_PARTIALS + tl.arange(0, ROW_PARTIALS)[None, :], acc)
    tl.store(Sums + tl.arange(0, ROWS), tl.sum(acc, 1))


@pytest.mark.skipif(CUDA, reason="runs on Triton's CPU interpreter")
@pytest.mark.parametrize("cols", [8, 16, 32, 64])
def test_row_products_are_partial_row_sums_by_column_mod_8(cols):
    """The slope gradient's partial sums: column c of x∘y lands in partial c % 8 of its row, over every tile,
    and a row's partials add up to the row sum of all tiles' products."""
    g = torch.Generator().manual_seed(cols)
    x, y = (torch.randn(2, 16, cols, generator=g) for _ in range(2))
    parts = ROW_PARTIALS.value
    out, sums = torch.empty(16, parts), torch.empty(16)
    _row_products_kernel[(1,)](x, y, out, sums, ROWS=16, COLS=cols, TILES=2)
    prod = (x.double() * y.double()).sum(0)  # (16, cols), both tiles
    want = torch.stack([prod[:, j::parts].sum(1) for j in range(parts)], 1)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(sums.double(), prod.sum(1), rtol=1e-6, atol=1e-5)


def test_bias_follows_spec_formula():
    """Attention weights recovered from the kernel give back -m·d̂ of docs/method.md §2, written out here.

    With q = k = 0 the logits are m·B, and with v the identity the output rows are the softmax
    weights; log-ratios against a prefix key (bias 0) are m·B_ij.
    """
    h, w, prefix, slope = 3, 4, 2, 1.7
    n = prefix + h * w
    for wrap in (True, False):
        q = torch.zeros(1, 1, n, 32, device=DEVICE)
        v = torch.zeros(1, 1, n, 32, device=DEVICE)
        v[0, 0, :, :n] = torch.eye(n)
        out = triton_alibi_attention(q, q, v, (h, w), prefix, torch.tensor([slope], device=DEVICE), wrap, True)
        weights = out[0, 0, :, :n].double().cpu()
        got = (weights.log() - weights[:, :1].log()) / slope
        d_max = math.hypot(h // 2, w // 2) if wrap else math.hypot(h - 1, w - 1)
        want = torch.zeros(n, n, dtype=torch.float64)
        for i in range(prefix, n):
            for j in range(prefix, n):
                (y1, x1), (y2, x2) = divmod(i - prefix, w), divmod(j - prefix, w)
                dy, dx = abs(y1 - y2), abs(x1 - x2)
                if wrap:
                    dy, dx = min(dy, h - dy), min(dx, w - dx)
                want[i, j] = -math.hypot(dy, dx) / d_max
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_wrapped_bias_is_equivariant_to_rolling_patches():
    """docs/method.md §2: with wrap the bias is circulant, so rolling the patch grid rolls the output."""
    h, w, prefix, shift = 4, 5, 2, (1, 3)
    q, k, v, _, slopes = _inputs(1, 3, (h, w), prefix, 16, torch.float32, seed=23)

    def roll(t):
        patches = t[:, :, prefix:].unflatten(2, (h, w)).roll(shift, dims=(2, 3)).flatten(2, 3)
        return torch.cat([t[:, :, :prefix], patches], dim=2)

    for wrap in (True, False):
        rolled_out = triton_alibi_attention(roll(q), roll(k), roll(v), (h, w), prefix, slopes, wrap, True)
        out_rolled = roll(triton_alibi_attention(q, k, v, (h, w), prefix, slopes, wrap, True))
        if wrap:
            torch.testing.assert_close(rolled_out, out_rolled, atol=1e-5, rtol=1e-5)
        else:  # without wrap, distances across the border change
            assert (rolled_out - out_rolled).abs().max() > 1e-3


def test_qkv_views_and_strided_grad_output():
    """q, k, v as timm's permuted views of one fused qkv tensor; dO non-contiguous too."""
    bsz, heads, head_dim, grid, prefix = 2, 2, 32, (3, 4), 1
    n = prefix + grid[0] * grid[1]
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(bsz, n, 3 * heads * head_dim, generator=g).to(DEVICE).requires_grad_()
    q, k, v = qkv.reshape(bsz, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous()
    do = torch.randn(bsz, heads, head_dim, n, generator=g).to(DEVICE).transpose(-1, -2)  # strided dO
    slopes = torch.tensor([0.7, 1.3], device=DEVICE, requires_grad=True)
    out = triton_alibi_attention(q, k, v, grid, prefix, slopes, True, True)
    gqkv, gs = torch.autograd.grad(out, (qkv, slopes), do)

    ref_qkv = qkv.detach().double().requires_grad_()
    ref_s = slopes.detach().double().requires_grad_()
    rq, rk, rv = ref_qkv.reshape(bsz, n, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    ref = eager_alibi_attention(rq, rk, rv, grid, prefix, ref_s, True, True)
    rg_qkv, rg_s = torch.autograd.grad(ref, (ref_qkv, ref_s), do.double())
    _check(out, ref, 2e-5, "out")
    _check(gqkv, rg_qkv, 5e-5, "dqkv")
    _check(gs, rg_s, 5e-5 * max(1.0, rg_s.abs().max().item()), "dslopes")
    # The output is laid out as (B, N, heads, D): merging heads afterwards needs no copy.
    assert out.transpose(1, 2).reshape(bsz, n, heads * head_dim).data_ptr() == out.data_ptr()


def test_backward_is_deterministic():
    q, k, v, do, slopes = _inputs(1, 2, (5, 6), 5, 32, torch.float32, seed=5)

    def grads():
        leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes)]
        out = triton_alibi_attention(*leaves[:3], (5, 6), 5, leaves[3], True, True)
        return [out, *torch.autograd.grad(out, leaves, do)]

    first, second = grads(), grads()
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_slopes_none_equals_unit_slopes_and_needs_no_slope_grad():
    q, k, v, do, _ = _inputs(1, 2, (3, 3), 1, 16, torch.float32, seed=7)
    q.requires_grad_()
    out_none = triton_alibi_attention(q, k, v, (3, 3), 1, None, True, True)
    out_ones = triton_alibi_attention(q, k, v, (3, 3), 1, torch.ones(2, device=DEVICE), True, True)
    # None takes the pre-scaled table (TABLE == 1), unit per-head slopes scale in the kernel (TABLE == 2):
    # the same values, but on a GPU the compiler fuses the two forms into different FMAs (last-bit
    # differences, seen on an H100); the interpreter rounds both alike.
    torch.testing.assert_close(out_none, out_ones, rtol=2e-6, atol=2e-6)
    (dq,) = torch.autograd.grad(out_none, (q,), do)  # only q requires grad
    assert torch.isfinite(dq).all()


def test_dispatcher_routes_to_triton():
    q, k, v, _, slopes = _inputs(1, 3, (2, 3), 1, 32, torch.float32, seed=11)
    via_dispatch = alibi_attention(q, k, v, (2, 3), 1, slopes, wrap=False, normalize=True, backend="triton")
    direct = triton_alibi_attention(q, k, v, (2, 3), 1, slopes, False, True)
    assert torch.equal(via_dispatch, direct)


@pytest.mark.parametrize("head_dim", [48, 8, 256])
def test_rejects_unsupported_head_dim(head_dim):
    q = torch.zeros(1, 1, 5, head_dim, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        triton_alibi_attention(q, q, q, (2, 2), 1, None, True, True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_rejects_unsupported_dtype(dtype):
    q = torch.zeros(1, 1, 5, 32, device=DEVICE, dtype=dtype)
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        triton_alibi_attention(q, q, q, (2, 2), 1, None, True, True)


def test_rejects_bad_geometry_slopes_and_mode():
    q = torch.zeros(1, 2, 5, 32, device=DEVICE)
    with pytest.raises(ValueError, match="token count"):
        triton_alibi_attention(q, q, q, (2, 3), 1, None, True, True)
    with pytest.raises(ValueError, match="slopes"):
        triton_alibi_attention(q, q, q, (2, 2), 1, torch.ones(3, device=DEVICE), True, True)
    with pytest.raises(ValueError, match="bias_mode"):
        triton_alibi_attention(q, q, q, (2, 2), 1, None, True, True, bias_mode="cosine")


@pytest.mark.parametrize("needs", [("k",), ("v", "slopes"), ("slopes",)])
def test_gradients_when_only_some_inputs_require_grad(needs):
    """Autograd returns exactly the requested gradients, equal to the reference's."""
    grid, prefix = (2, 3), 1
    q, k, v, do, slopes = _inputs(1, 2, grid, prefix, 16, torch.float32, seed=29)
    named = {"q": q, "k": k, "v": v, "slopes": slopes.clone()}
    leaves = [named[name].requires_grad_() for name in needs]
    out = triton_alibi_attention(named["q"], named["k"], named["v"], grid, prefix, named["slopes"], True, True)
    grads = torch.autograd.grad(out, leaves, do)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v, named["slopes"])]
    ref_out = eager_alibi_attention(*ref[:3], grid, prefix, ref[3], True, True)
    ref_grads = dict(zip(("q", "k", "v", "slopes"), torch.autograd.grad(ref_out, ref, do.double())))
    _check(out, ref_out, 2e-5, "out")
    for name, g in zip(needs, grads):
        _check(g, ref_grads[name], 5e-5 * max(1.0, ref_grads[name].abs().max().item()), name)


def test_dq_kernel_is_skipped_when_q_needs_no_gradient(monkeypatch):
    """Frozen queries: no dQ launch at all, and dK, dV are still the reference's."""
    from kernels import alibi_triton as at

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("the dQ kernel was launched although q needs no gradient")

    grid, prefix = (3, 3), 2
    q, k, v, do, slopes = _inputs(1, 2, grid, prefix, 16, torch.float32, seed=37)
    monkeypatch.setattr(at, "_dq_kernel", NoLaunch())
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    dk, dv = torch.autograd.grad(triton_alibi_attention(q, k, v, grid, prefix, slopes, True, True), (k, v), do)
    _, ref_grads = _reference(q, k, v, do, grid, prefix, slopes, True, True)
    _check(dk, ref_grads[1], 5e-5, "dk")
    _check(dv, ref_grads[2], 5e-5, "dv")
    q.requires_grad_()
    with pytest.raises(AssertionError, match="dQ kernel was launched"):
        torch.autograd.grad(triton_alibi_attention(q, k, v, grid, prefix, slopes, True, True), (q,), do)


@pytest.mark.parametrize("grid,prefix,dtype,slope_kind", [
    ((6, 7), 5, torch.float32, "learned"),  # N = 47: partial key and query tiles
    ((4, 4), 0, torch.float16, "none"),
])
def test_atomic_dq_matches_reference_without_the_dq_kernel(grid, prefix, dtype, slope_kind, monkeypatch):
    """Atomic dQ (ALIBI_TRITON_ATOMIC_DQ=1 or the atomic_dq context): dQ comes from the dK/dV kernel's atomic adds (no dQ launch), every gradient
    is the reference's; torch's deterministic mode turns it off again."""
    from kernels import alibi_triton as at

    launches = []

    class CountingLaunch:
        def __getitem__(self, grid_fn):
            launches.append(grid_fn)
            return real_dq[grid_fn]

    real_dq = at._dq_kernel
    monkeypatch.setattr(at, "_dq_kernel", CountingLaunch())
    before = at.atomic_dq_enabled()
    with at.atomic_dq():
        assert at.atomic_dq_enabled()
        _run_and_compare(grid, prefix, True, True, 32, "table", slope_kind, dtype, bsz=2, heads=2, seed=47)
        assert launches == []
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert not at.atomic_dq_enabled()
        _run_and_compare(grid, prefix, True, True, 32, "table", slope_kind, dtype, bsz=1, heads=2, seed=48)
        assert len(launches) == 1
    monkeypatch.undo()
    assert at.atomic_dq_enabled() == before


def test_atomic_dq_by_default_for_16_bit_head_dim_up_to_64(monkeypatch):
    """The backward the proxy picked runs without settings; one switch away the deterministic two-kernel one;
    torch's deterministic mode always wins."""
    from kernels import alibi_triton as at

    def q(d, dtype):
        return torch.zeros(1, 1, 1, d, dtype=dtype)

    with at.atomic_dq(None):
        assert at.atomic_dq_enabled(q(64, torch.bfloat16)) and at.atomic_dq_enabled(q(32, torch.float16))
        assert not at.atomic_dq_enabled(q(128, torch.bfloat16)) and not at.atomic_dq_enabled(q(64, torch.float32))
        with at.atomic_dq(False):
            assert not at.atomic_dq_enabled(q(64, torch.bfloat16))
        with at.atomic_dq(True):
            assert at.atomic_dq_enabled(q(128, torch.bfloat16))
            monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
            assert not at.atomic_dq_enabled(q(64, torch.bfloat16))


@pytest.mark.parametrize("forward_mode,backward_mode,slope_kind", [("table", "sqrt", "learned"), ("table", "sqrt", "none"),
                                                                   ("sqrt", "table", "fixed")])
def test_backward_bias_mode_independent_of_the_forward(forward_mode, backward_mode, slope_kind, monkeypatch):
    """backward_bias(): the backward kernels run in the other bias mode (TABLE constexpr 0 for sqrt, nonzero for
    the table), and the gradients are still the reference's (both modes give the same bias)."""
    from kernels import alibi_triton as at

    seen = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid_fn):
            def launch(*args, **kw):
                seen.append(kw["TABLE"])
                return self.kernel[grid_fn](*args, **kw)
            return launch

    monkeypatch.setattr(at, "_dkdv_kernel", Spy(at._dkdv_kernel))
    with at.backward_bias(backward_mode):
        _run_and_compare((4, 5), 2, True, True, 32, forward_mode, slope_kind, torch.float32, bsz=1, heads=2, seed=61)
    assert seen and all((t == 0) == (backward_mode == "sqrt") for t in seen)
    with pytest.raises(ValueError, match="backward bias mode"):
        with at.backward_bias("fast"):
            pass


def test_backward_bias_auto_is_sqrt_only_for_the_atomic_backward_on_a_gpu():
    """"auto" switches the backward to the per-element bias only where it was timed faster (atomic dQ on a GPU);
    "same" and the Manhattan metric keep the forward's mode."""
    from kernels import alibi_triton as at

    cpu = torch.zeros(1)
    gpu_like = type("Q", (), {"is_cuda": True})()
    with at.backward_bias("auto"):
        assert at.backward_uses_table(cpu, True, "euclidean", True)
        assert not at.backward_uses_table(gpu_like, True, "euclidean", True)
        assert at.backward_uses_table(gpu_like, True, "euclidean", False)
        assert at.backward_uses_table(gpu_like, True, "manhattan", True)
        assert not at.backward_uses_table(gpu_like, False, "euclidean", True)
    with at.backward_bias("same"):
        assert at.backward_uses_table(gpu_like, True, "euclidean", True)
    with at.backward_bias("table"):
        assert at.backward_uses_table(gpu_like, False, "euclidean", True)


def test_atomic_dq_setting_is_checked():
    import subprocess
    import sys

    env = {**os.environ, "ALIBI_TRITON_ATOMIC_DQ": "yes"}
    proc = subprocess.run([sys.executable, "-c", "import kernels.alibi_triton"], env=env, capture_output=True,
                          text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode != 0 and "ALIBI_TRITON_ATOMIC_DQ must be one of ('auto', '1', '0')" in proc.stderr


def sqrt_offsets_cases():
    """Forward and gradients of the sqrt mode on two small grids (wrap and not, prefix 5 and 1), fp16."""
    gen = torch.Generator().manual_seed(0)
    found = []
    for grid, prefix, wrap in (((5, 7), 5, True), ((4, 3), 1, False)):
        n = prefix + grid[0] * grid[1]
        q, k, v, do = (torch.randn(1, 2, n, 16, generator=gen).to(torch.float16) for _ in range(4))
        slopes = torch.tensor([0.5, 2.0], requires_grad=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = triton_alibi_attention(*leaves, grid, prefix, slopes, wrap, True, bias_mode="sqrt")
        found.append([out.detach(), *torch.autograd.grad(out, [*leaves, slopes], do)])
    return found


_FP16_OFFSETS_RUN = """
import sys, torch
from tests.test_triton_attention import sqrt_offsets_cases, triton_alibi_attention
torch.save(sqrt_offsets_cases(), sys.argv[1])
q = torch.zeros(1, 1, 2049, 16, dtype=torch.float16)
triton_alibi_attention(q, q, q, (1, 2049), 0, None, True, True)
"""


@pytest.mark.skipif(CUDA, reason="compares the interpreter's runs; the GPU A/B is benchmarks/gpu_suite.py sqrt-offsets")
def test_fp16_sqrt_offsets_give_the_int32_bits(tmp_path):
    """ALIBI_TRITON_SQRT_OFFSETS=fp16 forms the sqrt mode's offsets and wraps in halves: exact on these grids, so
    the forward and every gradient equal the int32 path's (this process's) bit for bit. It is read on import,
    hence the second process; there a grid wider than fp16's exact integers is refused, as is an unknown value."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(__file__))
    env = {**os.environ, "TRITON_INTERPRET": "1", "ALIBI_TRITON_SQRT_OFFSETS": "fp16"}
    path = tmp_path / "fp16.pt"
    proc = subprocess.run([sys.executable, "-c", _FP16_OFFSETS_RUN, str(path)], env=env, capture_output=True,
                          text=True, cwd=root, timeout=300)
    assert proc.returncode != 0 and "exact for grids up to 2048 a side, got 1x2049" in proc.stderr, proc.stderr[-2000:]
    assert os.environ.get("ALIBI_TRITON_SQRT_OFFSETS", "int32") == "int32"
    for int32_case, fp16_case in zip(sqrt_offsets_cases(), torch.load(path), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(int32_case, fp16_case, strict=True))
    env["ALIBI_TRITON_SQRT_OFFSETS"] = "half"
    proc = subprocess.run([sys.executable, "-c", "import kernels.alibi_triton"], env=env, capture_output=True,
                          text=True, cwd=root, timeout=300)
    assert proc.returncode != 0 and "ALIBI_TRITON_SQRT_OFFSETS must be one of ('int32', 'fp16')" in proc.stderr


@pytest.mark.skipif(CUDA, reason="swaps the interpreter's dK/dV tile config")
@pytest.mark.parametrize("block_m", [32, 64])
@pytest.mark.parametrize("head_dim,bias_mode,slope_kind", [(32, "table", "learned"), (64, "sqrt", "fixed")])
def test_atomic_dq_both_layouts_match_reference(block_m, head_dim, bias_mode, slope_kind, monkeypatch):
    """The atomic dQ adds dS·K as (K^T·dS)^T for query tiles under 64 rows (a wgmma needs 64) and as dS^T·K
    otherwise: both layouts, with partial query and key tiles (N = 47), give the reference's gradients."""
    from kernels import alibi_triton as at

    cfg = at._cfg(block_m, 16, 4, 1)
    monkeypatch.setattr(at, "_dkdv_kernel", triton.autotune(configs=[cfg], key=["N_BUCKET", "HEAD_DIM"])(
        at._alibi_bwd_dkdv_kernel))
    monkeypatch.setattr(at, "_dq_kernel", None)  # never launched with atomic dQ
    with at.atomic_dq():
        _run_and_compare((6, 7), 5, True, True, head_dim, bias_mode, slope_kind, torch.float32, bsz=1, heads=2,
                         seed=53)


def test_autocast_runs_in_the_autocast_dtype():
    """Like SDPA: fp32 inputs inside torch.autocast give a 16-bit output, fp32 gradients, the reference's values."""
    grid, prefix = (3, 4), 1
    q, k, v, do, slopes = _inputs(1, 2, grid, prefix, 32, torch.float32, seed=41)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast(DEVICE, dtype=torch.float16):
        out = triton_alibi_attention(*leaves, grid, prefix, slopes, True, True)
    assert out.dtype == torch.float16
    grads = torch.autograd.grad(out, leaves, do.half())
    half = [t.half().float() for t in (q, k, v)]  # the reference sees the same rounded inputs
    ref_out, ref_grads = _reference(*half, do, grid, prefix, slopes, True, True)
    _check(out, ref_out, TOL[torch.float16][0], "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.dtype == torch.float32
        _check(g, r, TOL[torch.float16][1], name)


@pytest.mark.parametrize("grid,prefix,dtype,learned,d", [
    ((12, 12), 6, torch.float32, True, 64),   # N = 150: wide partial key tiles (22 of 64 keys)
    ((11, 12), 1, torch.float16, False, 64),  # N = 133: a narrow 16-key tail (5 keys); head pairs
    ((5, 6), 1, torch.float16, True, 128),    # head_dim 128: the dK/dV kernel's 16-row query tiles
])
def test_gpu_default_tiles_under_the_interpreter(grid, prefix, dtype, learned, d):
    """The GPU's default tiles (16-128 rows/cols, not the interpreter's 16/32) through all three
    kernels of the two-kernel backward against the reference: learned slopes one head per program (fp32,
    head_dim 128), or one slope for all heads, two heads per forward and dQ program (fp16)."""
    from kernels import alibi_triton as at

    heads = 2
    q, k, v, do, slopes = _inputs(1, heads, grid, prefix, d, dtype, seed=43)
    if not learned:
        slopes = torch.ones(1, device=DEVICE)  # what slopes=None hands the launch helpers
    n = q.shape[2]
    geometry = grid, device_bias_lookup(*grid, prefix, True, True, True, q.device)
    cfg = {kind: at.gpu_launch_configs(kind, d, learned=learned)[0].kwargs for kind in ("fwd", "dkdv", "dq")}
    assert cfg["fwd"]["BLOCK_M"] >= 64 and cfg["dkdv"]["BLOCK_N"] >= 64 and cfg["dq"]["BLOCK_M"] >= 64
    o, lse = at._new_bnhd(q), torch.empty(1, heads, n, device=DEVICE)
    args, kw = at._fwd_args(q, k, v, o, lse, slopes, geometry, True, True)
    assert kw["HEAD_PAIR"] == (dtype != torch.float32 and d <= 64)
    programs = heads // 2 if kw["HEAD_PAIR"] else heads
    at._alibi_fwd_kernel[(triton.cdiv(n, cfg["fwd"]["BLOCK_M"]), programs, 1)](*args, **kw, **cfg["fwd"])
    dsl = torch.empty(1, heads, n, device=DEVICE)
    lse_pad, delta = torch.empty(2, 1, heads, at.stat_stride(n), device=DEVICE).unbind(0)
    dq, dk, dv = (at._new_bnhd(q) for _ in range(3))
    at._bwd_preprocess_kernel[(at.stat_stride(n) // 16, heads, 1)](o, do, lse, lse_pad, delta, *o.stride(),
                                                                   *do.stride(), heads, n, at.stat_stride(n),
                                                                   HEAD_DIM=d, BLOCK_M=16)
    dkdv_args, dq_args, kw, pair = at._bwd_args(do, q, k, v, dq, dk, dv, lse_pad, delta, dsl, slopes, geometry, True,
                                                True)
    at._alibi_bwd_dkdv_kernel[(triton.cdiv(n, cfg["dkdv"]["BLOCK_N"]), heads, 1)](
        *dkdv_args, **kw, COMPUTE_DSLOPE=learned, **cfg["dkdv"])
    at._alibi_bwd_dq_kernel[(triton.cdiv(n, cfg["dq"]["BLOCK_M"]), programs, 1)](
        *dq_args, **kw, COMPUTE_DSLOPE=False, HEAD_PAIR=pair, **cfg["dq"])
    ref_slopes = slopes.clone().requires_grad_() if learned else None
    inputs = [t.float() for t in (q, k, v, do)]  # the reference sees the same rounded inputs
    ref_out, ref_grads = _reference(*inputs, grid, prefix, ref_slopes, True, True)
    fwd_tol, grad_tol = (2e-5, 5e-5) if dtype == torch.float32 else TOL[dtype]
    _check(o, ref_out, fwd_tol, "out")
    got = (dq, dk, dv) + ((dsl.sum(dim=(0, 2)),) if learned else ())
    for name, g, r in zip(("dq", "dk", "dv", "dslopes"), got, ref_grads):
        _check(g, r, grad_tol * max(1.0, r.abs().max().item()), name)


def test_rejects_outputs_beyond_int32_offsets():
    """Outputs are (B, N, heads, D) in memory even for inputs whose own offsets are small."""
    n = 1 + 46 * 46
    q = torch.zeros(1, 1, 1, 16, device=DEVICE).expand(1, 65535, n, 16)  # token stride 0
    assert (n - 1) * 65535 * 16 >= 2**31
    with pytest.raises(ValueError, match="2\\*\\*31"):
        triton_alibi_attention(q, q, q, (46, 46), 1, None, True, True)


@pytest.mark.parametrize("which", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("autotune", [True, False])
def test_gpu_autotuner_prunes_to_the_offered_configs(which, autotune, monkeypatch):
    """The GPU autotuner's early_config_prune, called the way Triton calls it (the interpreter never does).

    Triton passes the positional arguments by name and the constexpr keywords as **kwargs; the
    prune keeps the configs offered to (head_dim, bias mode, fp32), or only the first of them
    when autotuning is off.
    """
    from kernels import alibi_triton as at

    monkeypatch.setattr(at, "_AUTOTUNE", autotune)
    fn = {"fwd": at._alibi_fwd_kernel, "dkdv": at._alibi_bwd_dkdv_kernel, "dq": at._alibi_bwd_dq_kernel}[which]
    tuner = at._gpu_autotune(which)(fn)
    key = at._config_key
    # The autotuner holds each config once, whichever lists share it.
    assert len({key(c) for c in tuner.configs}) == len(tuner.configs)
    forms = [(False, False), (True, False), (False, True), (True, True)] if which == "dkdv" else [(False, False)]
    for head_dim in at.SUPPORTED_HEAD_DIMS:
        for table in (True, False):
            for dtype in (torch.bfloat16, torch.float32):
                for atomic, learned in forms:
                    kwargs = dict(HEAD_DIM=head_dim, TABLE=table, WRAP=True, COMPUTE_DSLOPE=learned,
                                  DOT_PREC=at._dot_precision(dtype), **({"ATOMIC_DQ": atomic} if which == "dkdv" else {}))
                    positional = [name for name in tuner.arg_names if name not in kwargs and "BLOCK" not in name]
                    tuner.nargs = {name: 0 for name in positional}
                    tuner.nargs["Q"] = torch.zeros(1, dtype=dtype)
                    got = tuner.prune_configs(kwargs)
                    group = "fp32" if dtype == torch.float32 else ("small" if head_dim <= 64 else "large",
                                                                   "table" if table else "sqrt")
                    name = "dkdv_atomic" if atomic else which
                    want = [key(c) for c in at._LEARNED_CONFIGS.get((name, group), at._CONFIGS[name][group])] \
                        if learned else [key(c) for c in at._CONFIGS[name][group]]
                    assert [key(c) for c in got] == (want if autotune else want[:1]), (head_dim, table, dtype, atomic)
                    assert all(c in tuner.configs for c in got)  # the autotuner's own objects
                    assert all(cfg.kwargs["BLOCK_M"] >= 16 and cfg.kwargs["BLOCK_N"] >= 16 for cfg in got)
    # The atomic-dQ dK/dV kernel with learned slopes at head_dim 64 takes 32-row query tiles (its 64-row ones spill).
    assert at.gpu_launch_configs("dkdv", 64, atomic_dq=True, learned=True)[0].kwargs["BLOCK_M"] == 32


def test_every_gpu_call_is_offered_a_launch_config():
    """Each (head_dim, bias mode, fp32 or 16-bit) combination has a config list without repeats."""
    from kernels import alibi_triton as at

    for kind in ("fwd", "dkdv", "dq"):
        for head_dim in at.SUPPORTED_HEAD_DIMS:
            for table in (True, False):
                for fp32 in (True, False):
                    for atomic in (False, True):
                        for learned in (False, True):
                            keys = [at._config_key(c) for c in at.gpu_launch_configs(kind, head_dim, table, fp32,
                                                                                     atomic, learned)]
                            assert keys and len(set(keys)) == len(keys), (kind, head_dim, table, fp32, atomic)


def test_gpu_autotuning_is_keyed_by_a_bucket_of_n():
    """Tuning keys on the power-of-two bucket of N, never N itself, and every launch passes that bucket
    in the kernels' N_BUCKET argument; results are cached on disk where Triton supports it."""
    from kernels import alibi_triton as at

    assert [at.n_bucket(n) for n in (1, 2, 261, 512, 513, 1374, 5334, 21909)] == [1, 2, 512, 512, 1024, 2048, 8192,
                                                                                   32768]
    for kind, fn in (("fwd", at._alibi_fwd_kernel), ("dkdv", at._alibi_bwd_dkdv_kernel),
                     ("dq", at._alibi_bwd_dq_kernel)):
        tuner = at._gpu_autotune(kind)(fn)
        assert "N_BUCKET" in tuner.keys and "N" not in tuner.keys
        # A call on a slice of the problem (the benchmark's correctness check) must not pick the whole one's
        # tiles, and the bias-free baseline tunes on its own.
        assert {"WORK_BUCKET", "HAS_BIAS", "TABLE", "COMPUTE_DSLOPE"} <= set(tuner.keys)
    assert [at.work_bucket(b, h) for b, h in ((1, 2), (48, 12), (3, 12))] == [2, 1024, 64]
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        assert at._CACHE_RESULTS == {"cache_results": True}

    grid, prefix = (16, 16), 5  # N = 261: bucket 512
    q, k, v, do, slopes = _inputs(1, 2, grid, prefix, 32, torch.float32, seed=3)
    n = q.shape[2]
    geometry = grid, device_bias_lookup(*grid, prefix, True, True, True, q.device)
    lse = torch.empty(1, 2, n)
    args, _ = at._fwd_args(q, k, v, at._new_bnhd(q), lse, slopes, geometry, True, True)
    named = dict(zip(at._alibi_fwd_kernel.arg_names, args))
    assert (named["N"], named["N_BUCKET"]) == (261, 512)
    stats = torch.empty(1, 2, at.stat_stride(n))
    dkdv, dqa, _, _ = at._bwd_args(do, q, k, v, *(at._new_bnhd(q) for _ in range(3)), stats, stats, lse, slopes,
                                   geometry, True, True)
    for fn, fn_args in ((at._alibi_bwd_dkdv_kernel, dkdv), (at._alibi_bwd_dq_kernel, dqa)):
        named = dict(zip(fn.arg_names, fn_args))
        assert (named["N"], named["N_BUCKET"]) == (261, 512)


def test_fake_implementation_matches_real_op():
    """Shapes, dtypes and strides of the fake impls (what torch.compile traces) equal the real op's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, do, slopes = _inputs(2, 3, (3, 4), 2, 32, torch.float16, seed=13)
    args = (3, 4, 2, True, True, True)
    real_o, real_lse = alibi_attention_fwd(q, k, v, slopes, *args)
    real_grads = alibi_attention_bwd(do, q, k, v, real_o, real_lse, slopes, *args, True, True)
    with FakeTensorMode() as mode:
        fq, fk, fv, fdo, fs = (mode.from_tensor(t) for t in (q, k, v, do, slopes))
        fake_o, fake_lse = alibi_attention_fwd(fq, fk, fv, fs, *args)
        fake_grads = alibi_attention_bwd(fdo, fq, fk, fv, fake_o, fake_lse, fs, *args, True, True)
    for real, fake in zip((real_o, real_lse, *real_grads), (fake_o, fake_lse, *fake_grads)):
        assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride())


def test_opcheck_both_ops():
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch (dynamic shapes)."""
    q, k, v, do, slopes = _inputs(1, 2, (2, 3), 1, 16, torch.float32, seed=17)
    geometry = (2, 3, 1, True, True, True)
    o, lse = alibi_attention_fwd(q, k, v, slopes, *geometry)
    torch.library.opcheck(torch.ops.alibi_vit.alibi_attention_bwd.default,
                          (do, q, k, v, o, lse, slopes, *geometry, True, True))
    torch.library.opcheck(torch.ops.alibi_vit.alibi_attention_bwd.default,
                          (do, q, k, v, o, lse, slopes, *geometry, False, False))
    for t in (q, k, v, slopes):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.alibi_vit.alibi_attention_fwd.default, (q, k, v, slopes, *geometry))


# ------------------------------------------------------------------------------------------
# GPU only
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bias_mode", ["table", "sqrt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid,prefix,head_dim", [((37, 37), 5, 64), ((16, 23), 1, 128), ((9, 14), 0, 32)])
@needs_gpu
def test_gpu_medium_shapes(grid, prefix, head_dim, dtype, bias_mode):
    _run_and_compare(grid, prefix, True, True, head_dim, bias_mode, "learned", dtype, bsz=2, heads=6)


@needs_gpu
def test_gpu_largest_grid_148x148():
    """N = 5 + 148² = 21909 (2072 px at patch 14), bf16, one head against the float64 reference."""
    grid, prefix = (148, 148), 5
    q, k, v, do, slopes = _inputs(1, 1, grid, prefix, 64, torch.bfloat16, seed=19)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = triton_alibi_attention(*leaves, grid, prefix, None, True, True)
    grads = torch.autograd.grad(out, leaves, do)
    ref_out, ref_grads = _reference(q, k, v, do, grid, prefix, None, True, True)
    _check(out, ref_out, 2.5e-2, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        _check(g, r, 8e-2, name)


class _AttnBlock(torch.nn.Module):
    """timm-style attention: fused qkv projection, permuted q/k/v views, heads merged by a view."""

    def __init__(self, grid, prefix, dim=64, heads=2):
        super().__init__()
        self.grid, self.prefix, self.heads = grid, prefix, heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.slopes = torch.nn.Parameter(torch.linspace(0.5, 2.0, heads))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        o = triton_alibi_attention(q, k, v, self.grid, self.prefix, self.slopes, True, True)
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


def _compiled_matches_eager(model, x, backend, atol):
    compiled = torch.compile(model, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    got = compiled(x)
    got.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x)
    ref.square().mean().backward()
    torch.testing.assert_close(got, ref, atol=atol, rtol=atol)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=atol, rtol=atol)


def test_compiles_without_graph_break_aot_eager():
    """Dynamo + AOTAutograd trace the op through its fake impl and autograd formula (no inductor)."""
    torch.manual_seed(0)
    _compiled_matches_eager(_AttnBlock((3, 4), 1).to(DEVICE), torch.randn(2, 13, 64, device=DEVICE), "aot_eager", 1e-6)


def test_compiles_with_dynamic_shapes_across_grids_aot_eager():
    """dynamic=True: symbolic batch and token counts go through the fake impl; each grid runs right."""
    torch.manual_seed(0)

    class Block(_AttnBlock):
        def forward(self, x, grid):
            self.grid = grid
            return super().forward(x)

    model = Block(None, 1, dim=32).to(DEVICE)
    compiled = torch.compile(model, backend="aot_eager", dynamic=True, fullgraph=True)
    for grid, bsz in (((2, 3), 2), ((3, 3), 1)):
        x = torch.randn(bsz, 1 + grid[0] * grid[1], 32, device=DEVICE)
        got = compiled(x, grid)
        got.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        ref = model(x, grid)
        ref.square().mean().backward()
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-6)
        model.zero_grad()


@needs_gpu
def test_gpu_torch_compile_fullgraph_inductor():
    torch.manual_seed(0)
    model = _AttnBlock((7, 9), 5, dim=128, heads=4).cuda()
    _compiled_matches_eager(model, torch.randn(3, 5 + 63, 128, device="cuda"), "inductor", 1e-4)


def test_bias_compiled_out_is_plain_attention():
    """The benchmark's bias-free baseline (HAS_BIAS=False in every kernel): output and gradients of plain
    softmax attention, and the bias is back after the block."""
    from kernels import alibi_triton as at

    torch.manual_seed(0)
    grid, prefix = (4, 5), 2
    q, k, v, do = (torch.randn(1, 2, prefix + 20, 16, device=DEVICE) for _ in range(4))
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with at.bias_compiled_out():
        out = at.triton_alibi_attention(*leaves, grid, prefix, None, True, True)
        grads = torch.autograd.grad(out, leaves, do)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)
    biased = at.triton_alibi_attention(q, k, v, grid, prefix, None, True, True)
    assert (biased - ref).abs().max() > 1e-2


@pytest.mark.parametrize("grid,prefix,wrap", [((6, 7), 5, True), ((3, 5), 2, False)])
def test_single_head_learned_slope_scales_the_table_per_call(grid, prefix, wrap):
    """One head with a learned slope: the kernels add the per-call scaled table as it is (TABLE == 1)
    and the slope gradient gathers B from the unscaled pair table."""
    _run_and_compare(grid, prefix, wrap, True, 32, "table", "learned", torch.float32, heads=1)


@pytest.mark.parametrize("grid,prefix,wrap", [((6, 7), 5, True), ((3, 5), 0, False), ((1, 1), 2, True),
                                              ((2, 9), 3, True)])
def test_pair_codes_reproduce_the_bias(grid, prefix, wrap):
    """Key-pair (row 2) and query-pair (row 3) codes index the pair table to B, keys and queries past N
    included (they gather zeros)."""
    from kernels.alibi_bias import alibi_bias

    codes, tbl, _, pair = device_bias_lookup(*grid, prefix, wrap, True, True, torch.device("cpu"))
    n, n_pad = prefix + grid[0] * grid[1], codes.shape[1]
    a, nb, kp, qp = codes.long()
    want = torch.zeros(n_pad, n_pad)
    want[:n, :n] = alibi_bias(grid, prefix, wrap=wrap)
    assert torch.equal(tbl[a[:, None] + nb[None, :]], want)
    assert torch.equal(pair[2 * a[:, None] + kp[None, :]], want)
    assert torch.equal(pair[qp[:, None] + 2 * nb[None, :]], want)
    assert (kp % 2 == torch.arange(n_pad) % 2).all() and (qp % 2 == torch.arange(n_pad) % 2).all()
