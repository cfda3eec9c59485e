"""The Manhattan-distance bias (``metric="manhattan"``): hand-computed matrices, every backend
against eager, the fused kernel under the interpreter, and roll-equivariance of a whole model."""

import math
import os

import pytest
import timm
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import alibi_vit  # noqa: E402,F401  (registers the models)
from kernels import alibi_bias, max_distance, patch_distances  # noqa: E402
from kernels.alibi_bias import bias_lookup  # noqa: E402
from kernels.attention import alibi_attention, eager_alibi_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(depth=2, embed_dim=48, num_heads=2, img_size=56)

# Patches of a 2x3 grid in row-major order: (0,0) (0,1) (0,2) (1,0) (1,1) (1,2).
# With wrap the row offset is min(|dy|, 2-|dy|) ∈ {0, 1} and the column offset
# min(|dx|, 3-|dx|) ∈ {0, 1}; d_max = ⌊2/2⌋ + ⌊3/2⌋ = 2.
MANHATTAN_2x3_WRAP = torch.tensor([
    [0, 1, 1, 1, 2, 2],
    [1, 0, 1, 2, 1, 2],
    [1, 1, 0, 2, 2, 1],
    [1, 2, 2, 0, 1, 1],
    [2, 1, 2, 1, 0, 1],
    [2, 2, 1, 1, 1, 0],
], dtype=torch.float64) / 2
# Without wrap: |dy| + |dx|, d_max = (2-1) + (3-1) = 3.
MANHATTAN_2x3_NOWRAP = torch.tensor([
    [0, 1, 2, 1, 2, 3],
    [1, 0, 1, 2, 1, 2],
    [2, 1, 0, 3, 2, 1],
    [1, 2, 3, 0, 1, 2],
    [2, 1, 2, 1, 0, 1],
    [3, 2, 1, 2, 1, 0],
], dtype=torch.float64) / 3


def test_max_distance_by_hand():
    assert max_distance((5, 7), wrap=True, metric="manhattan") == 2 + 3
    assert max_distance((5, 7), wrap=False, metric="manhattan") == 4 + 6
    assert max_distance((1, 1), metric="manhattan") == 0.0
    assert max_distance((5, 7), wrap=True) == pytest.approx(math.hypot(2, 3))  # default unchanged


@pytest.mark.parametrize("wrap, want", [(True, MANHATTAN_2x3_WRAP), (False, MANHATTAN_2x3_NOWRAP)])
def test_bias_matches_hand_computed_matrix(wrap, want):
    prefix = 2
    bias = alibi_bias((2, 3), prefix, wrap=wrap, metric="manhattan", dtype=torch.float64)
    expected = torch.zeros(8, 8, dtype=torch.float64)
    expected[prefix:, prefix:] = -want
    torch.testing.assert_close(bias, expected, atol=0, rtol=0)
    raw = patch_distances((2, 3), wrap=wrap, normalize=False, metric="manhattan", dtype=torch.float64)
    torch.testing.assert_close(raw, want * max_distance((2, 3), wrap, "manhattan"), atol=0, rtol=0)


@pytest.mark.parametrize("wrap", [True, False])
def test_bias_lookup_table_reproduces_manhattan_bias(wrap):
    grid, prefix = (3, 4), 1
    codes, values, *_ = bias_lookup(grid, prefix, wrap=wrap, metric="manhattan")
    got = values[codes[0][:, None] - codes[1][None, :]]
    torch.testing.assert_close(got, alibi_bias(grid, prefix, wrap=wrap, metric="manhattan", dtype=torch.float64))
    with pytest.raises(ValueError, match="table"):
        bias_lookup(grid, prefix, wrap=wrap, metric="manhattan", table=False)


def test_unknown_metric_is_an_error():
    with pytest.raises(ValueError, match="unknown distance metric 'chebyshev'.*euclidean, manhattan"):
        alibi_bias((2, 2), 1, metric="chebyshev")
    q = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="unknown distance metric"):
        alibi_attention(q, q, q, (2, 2), 1, metric="l1")
    with pytest.raises(ValueError, match="unknown distance metric"):
        timm.create_model("alibi_vit_small_patch14_reg4_dinov2", metric="l1", **TINY)


def _qkv(grid, prefix, heads=2, head_dim=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n = prefix + grid[0] * grid[1]
    return [torch.randn(2, heads, n, head_dim, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize("wrap", [True, False])
def test_eager_is_softmax_with_the_hand_bias(wrap):
    prefix, slopes = 2, torch.tensor([0.5, 2.0], dtype=torch.float64)
    q, k, v = _qkv((2, 3), prefix, dtype=torch.float64)
    bias = torch.zeros(8, 8, dtype=torch.float64)
    bias[prefix:, prefix:] = -(MANHATTAN_2x3_WRAP if wrap else MANHATTAN_2x3_NOWRAP)
    scores = q @ k.transpose(-2, -1) / 4.0 + slopes.view(1, -1, 1, 1) * bias
    want = scores.softmax(-1) @ v
    got = alibi_attention(q, k, v, (2, 3), prefix, slopes, wrap=wrap, backend="eager", metric="manhattan")
    torch.testing.assert_close(got, want)
    # The metric matters: the Euclidean bias differs on this grid (diagonal neighbours).
    eu = alibi_attention(q, k, v, (2, 3), prefix, slopes, wrap=wrap, backend="eager")
    assert (eu - got).abs().max() > 1e-4


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("wrap", [True, False])
def test_backends_match_eager(backend, wrap):
    grid, prefix = (3, 4), 1
    q, k, v = _qkv(grid, prefix)
    slopes = torch.tensor([0.7, 1.6])
    want = eager_alibi_attention(q.double(), k.double(), v.double(), grid, prefix, slopes.double(), wrap, True,
                                 metric="manhattan")
    with torch.no_grad():
        got = alibi_attention(q, k, v, grid, prefix, slopes, wrap=wrap, backend=backend, metric="manhattan")
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("wrap, normalize", [(True, True), (False, True), (True, False)])
def test_triton_matches_eager_forward_and_gradients(wrap, normalize):
    pytest.importorskip("triton")
    from kernels.alibi_triton import triton_alibi_attention

    grid, prefix = (3, 3), 1
    q, k, v = (t.to(DEVICE) for t in _qkv(grid, prefix, seed=4))
    do = torch.randn_like(q)
    slopes = torch.tensor([0.5, 1.25], device=DEVICE, requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [slopes]
    out = triton_alibi_attention(*leaves[:3], grid, prefix, slopes, wrap, normalize, metric="manhattan")
    grads = torch.autograd.grad(out, leaves, do)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    ref_out = eager_alibi_attention(*ref[:3], grid, prefix, ref[3], wrap, normalize, metric="manhattan")
    ref_grads = torch.autograd.grad(ref_out, ref, do.double())
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    for name, g, r in zip(("dq", "dk", "dv", "dslopes"), grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=5e-5, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(ValueError, match="Euclidean distances only"):
        triton_alibi_attention(q, k, v, grid, prefix, None, wrap, normalize, metric="manhattan", bias_mode="sqrt")


def _roll_patches(x, patch, shift):
    return x.roll((shift[0] * patch, shift[1] * patch), dims=(2, 3))


@pytest.mark.parametrize("name, patch, prefix", [("alibi_vit_small_patch14_reg4_dinov2", 14, 5),
                                                 ("alibi_vit_small_patch16_dinov3", 16, 5)])
def test_manhattan_model_is_roll_equivariant_with_wrap(name, patch, prefix):
    torch.manual_seed(0)
    kwargs = dict(TINY, img_size=4 * patch) if "dinov2" in name else dict(depth=2, embed_dim=48, num_heads=2)
    kwargs["init_values"] = 1.0  # LayerScale at DINO's 1e-5 would leave attention almost without effect
    model = timm.create_model(name, metric="manhattan", backend="eager", **kwargs).eval()
    assert all(b.attn.metric == "manhattan" for b in model.blocks)
    assert "metric=manhattan" in repr(model.blocks[0].attn)
    h, w, shift = 4, 5, (1, 2)
    x = torch.randn(1, 3, h * patch, w * patch)
    with torch.no_grad():
        f = model.forward_features(x)[:, prefix:].unflatten(1, (h, w))
        f_rolled = model.forward_features(_roll_patches(x, patch, shift))[:, prefix:].unflatten(1, (h, w))
    torch.testing.assert_close(f_rolled, f.roll(shift, dims=(1, 2)), atol=1e-4, rtol=1e-4)
    # The Euclidean model with the same weights gives other features: the option reaches the layers.
    euclid = timm.create_model(name, backend="eager", **kwargs).eval()
    euclid.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (euclid.forward_features(x)[:, prefix:].unflatten(1, (h, w)) - f).abs().max() > 1e-3


def test_nope_refuses_a_metric():
    with pytest.raises(ValueError, match="NoPE models take no position options"):
        timm.create_model("nope_vit_small_patch14_reg4_dinov2", metric="manhattan", **TINY)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_backend_is_roll_equivariant_with_wrap(backend):
    """With wrap the Manhattan bias is circulant too: rolling the patch grid rolls the output."""
    if backend == "triton":
        pytest.importorskip("triton")
    h, w, prefix, shift = 4, 5, 2, (1, 3)
    q, k, v = (t.to(DEVICE) for t in _qkv((h, w), prefix, seed=9))

    def roll(t):
        patches = t[:, :, prefix:].unflatten(2, (h, w)).roll(shift, dims=(2, 3)).flatten(2, 3)
        return torch.cat([t[:, :, :prefix], patches], dim=2)

    slopes = torch.tensor([1.0, 3.0], device=DEVICE)
    for wrap in (True, False):
        with torch.no_grad():
            rolled_out = alibi_attention(roll(q), roll(k), roll(v), (h, w), prefix, slopes, wrap=wrap,
                                         backend=backend, metric="manhattan")
            out_rolled = roll(alibi_attention(q, k, v, (h, w), prefix, slopes, wrap=wrap, backend=backend,
                                              metric="manhattan"))
        if wrap:
            torch.testing.assert_close(rolled_out, out_rolled, atol=1e-5, rtol=1e-5)
        else:  # without wrap, distances across the border change
            assert (rolled_out - out_rolled).abs().max() > 1e-3


def test_triton_ops_pass_opcheck_with_the_metric_argument():
    """The metric travels through the registered ops (schema, fake tensors, autograd, AOT dispatch)."""
    pytest.importorskip("triton")
    from kernels.alibi_triton import alibi_attention_fwd

    q, k, v = (t.to(DEVICE) for t in _qkv((2, 3), 1, seed=17))
    do = torch.randn_like(q)
    slopes = torch.tensor([0.5, 1.5], device=DEVICE)
    geometry = (2, 3, 1, True, True, True)
    o, lse = alibi_attention_fwd(q, k, v, slopes, *geometry, "manhattan")
    ref = eager_alibi_attention(q.double(), k.double(), v.double(), (2, 3), 1, slopes.double(), True, True,
                                metric="manhattan")
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=2e-5)
    torch.library.opcheck(torch.ops.alibi_vit.alibi_attention_bwd.default,
                          (do, q, k, v, o, lse, slopes, *geometry, True, True, "manhattan"))
    for t in (q, k, v, slopes):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.alibi_vit.alibi_attention_fwd.default, (q, k, v, slopes, *geometry, "manhattan"))
