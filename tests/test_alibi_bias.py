"""The bias matrix against hand-computed values and a loop written straight from docs/method.md §2."""

import math

import pytest
import torch

from kernels import alibi_bias, max_distance


def loop_bias(h, w, prefix, wrap, normalize):
    """docs/method.md §2 written as plainly as possible, pair by pair."""
    if wrap:
        d_max = math.sqrt((h // 2) ** 2 + (w // 2) ** 2)
    else:
        d_max = math.sqrt((h - 1) ** 2 + (w - 1) ** 2)
    n = prefix + h * w
    out = torch.zeros(n, n, dtype=torch.float64)
    for i in range(prefix, n):
        y1, x1 = divmod(i - prefix, w)
        for j in range(prefix, n):
            y2, x2 = divmod(j - prefix, w)
            dy, dx = abs(y1 - y2), abs(x1 - x2)
            if wrap:
                dy, dx = min(dy, h - dy), min(dx, w - dx)
            d = math.sqrt(dy * dy + dx * dx)
            if normalize:
                d = d / d_max if d_max > 0 else 0.0
            out[i, j] = -d
    return out


def test_hand_computed_2x2_wrapped_with_cls():
    b = alibi_bias((2, 2), 1, dtype=torch.float64)
    # d_max = sqrt(1 + 1); neighbours are 1 apart, the opposite corner sqrt(2).
    assert b.shape == (5, 5)
    assert b[1, 2].item() == pytest.approx(-1 / math.sqrt(2))
    assert b[1, 3].item() == pytest.approx(-1 / math.sqrt(2))
    assert b[1, 4].item() == pytest.approx(-1.0)
    assert b[2, 2].item() == 0.0
    assert torch.all(b[0] == 0) and torch.all(b[:, 0] == 0)


def test_hand_computed_3x3_wrap_versus_no_wrap():
    wrapped = alibi_bias((3, 3), 0, dtype=torch.float64)
    flat = alibi_bias((3, 3), 0, wrap=False, dtype=torch.float64)
    # (0,0)→(0,2): 2 columns apart, 1 around the torus; d_max √2 wrapped, 2√2 flat.
    assert wrapped[0, 2].item() == pytest.approx(-1 / math.sqrt(2))
    assert flat[0, 2].item() == pytest.approx(-2 / (2 * math.sqrt(2)))
    # (0,0)→(2,2): the far corner is the maximum without wrap, a diagonal neighbour with it.
    assert flat[0, 8].item() == pytest.approx(-1.0)
    assert wrapped[0, 8].item() == pytest.approx(-1.0)


def test_hand_computed_rectangle_unnormalised_and_normalised():
    raw = alibi_bias((4, 3), 5, normalize=False, dtype=torch.float64)
    norm = alibi_bias((4, 3), 5, dtype=torch.float64)
    p = 5
    # (0,0)→(2,1): dy = min(2, 2) = 2, dx = min(1, 2) = 1: d = √5 = d_max for a 4×3 torus.
    assert raw[p, p + 2 * 3 + 1].item() == pytest.approx(-math.sqrt(5))
    assert norm[p, p + 2 * 3 + 1].item() == pytest.approx(-1.0)
    # (0,0)→(3,0): 3 rows down is 1 row up around the torus.
    assert raw[p, p + 9].item() == pytest.approx(-1.0)
    assert norm[p, p + 9].item() == pytest.approx(-1 / math.sqrt(5))
    assert torch.all(raw[:p] == 0) and torch.all(raw[:, :p] == 0)


@pytest.mark.parametrize("h,w", [(1, 1), (1, 4), (2, 3), (3, 3), (4, 4), (5, 2)])
@pytest.mark.parametrize("prefix", [0, 1, 5])
@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_matches_pairwise_loop(h, w, prefix, wrap, normalize):
    got = alibi_bias((h, w), prefix, wrap=wrap, normalize=normalize, dtype=torch.float64)
    torch.testing.assert_close(got, loop_bias(h, w, prefix, wrap, normalize), rtol=0, atol=1e-12)


def test_one_by_one_grid_is_all_zero():
    assert torch.count_nonzero(alibi_bias((1, 1), 5)) == 0
    assert max_distance((1, 1)) == 0.0


@pytest.mark.parametrize("grid", [(4, 6), (5, 3)])
def test_normalised_bias_spans_minus_one_to_zero_and_is_symmetric(grid):
    for wrap in (True, False):
        b = alibi_bias(grid, 1, wrap=wrap, dtype=torch.float64)
        assert b.min().item() == pytest.approx(-1.0)
        assert b.max().item() == 0.0
        torch.testing.assert_close(b, b.T)


def test_wrapped_bias_is_invariant_under_rolling_the_grid():
    h, w = 4, 5
    b = alibi_bias((h, w), 0, dtype=torch.float64)
    perm = torch.arange(h * w).view(h, w).roll((1, 2), (0, 1)).reshape(-1)
    torch.testing.assert_close(b[perm][:, perm], b)
    flat = alibi_bias((h, w), 0, wrap=False, dtype=torch.float64)
    assert not torch.allclose(flat[perm][:, perm], flat)


@pytest.mark.parametrize("grid", [(0, 3), (3, -1), "ab", (2,), None])
def test_bad_grid_is_a_clear_error(grid):
    with pytest.raises(ValueError, match="grid_size"):
        alibi_bias(grid, 1)


def test_negative_prefix_is_a_clear_error():
    with pytest.raises(ValueError, match="num_prefix_tokens"):
        alibi_bias((2, 2), -1)


@pytest.mark.parametrize("grid,prefix,wrap,normalize", [
    ((3, 5), 0, True, True), ((4, 4), 1, False, True), ((5, 3), 5, True, False), ((1, 1), 5, True, True),
    ((2, 7), 1, False, False),
])
def test_bias_lookup_reproduces_every_pair(grid, prefix, wrap, normalize):
    """The fused kernel's codes give back B for every (query, key) pair, prefix tokens included."""
    from kernels.alibi_bias import bias_lookup

    want = loop_bias(*grid, prefix, wrap, normalize)
    codes, values, q_pad, k_pad, norm = bias_lookup(grid, prefix, wrap=wrap, normalize=normalize, table=True)
    assert norm == 1.0 and (codes[0, :prefix] == q_pad).all() and (codes[1, :prefix] == k_pad).all()
    idx = codes[0][:, None] - codes[1][None, :]
    assert idx.min() >= 0 and idx.max() < values.numel()
    torch.testing.assert_close(values[idx], want, atol=1e-12, rtol=0)
    # Out-of-range key tokens of a partial tile carry k_pad too: zero against every query.
    assert (values[codes[0] - k_pad] == 0).all()
    # sqrt mode: (row, col) per token, row -1 for prefix tokens, the kernel scales -d by bias_norm.
    codes, _, _, _, norm = bias_lookup(grid, prefix, wrap=wrap, normalize=normalize, table=False)
    row, col = codes[0], codes[1]
    dy, dx = (row[:, None] - row[None, :]).abs(), (col[:, None] - col[None, :]).abs()
    if wrap:
        dy, dx = torch.minimum(dy, grid[0] - dy), torch.minimum(dx, grid[1] - dx)
    patch = (row[:, None] >= 0) & (row[None, :] >= 0)
    got = torch.where(patch, -(dy**2 + dx**2).double().sqrt() * norm, torch.zeros((), dtype=torch.float64))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
