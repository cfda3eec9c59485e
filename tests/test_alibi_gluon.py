"""The Gluon FA3-structured forward and backward (kernels/alibi_gluon.py), as far as a machine without a GPU can check it.

* A NumPy model of the kernel (:func:`model_forward`) mirrors its tiling and index logic step by step:
  128-row CTAs split between two 64-row consumers, key tiles of ``BLOCK_N`` with only the last one
  masked, K/V and Q rows read from the 2-D (B·N, ...) row views the TMA descriptors cover (the next
  image's rows, then zeros, past an image's end), the bias gathered from the key-pair table at
  ``2·a_i + c_j`` with the codes of ``kernels.alibi_bias.device_bias_lookup``, logits in base 2, the
  online-softmax rescaling in the kernel's order, P rounded to the input dtype before the PV product,
  and the base-2 logsumexp. It is checked against ``kernels.alibi_bias.alibi_bias`` and a float64
  softmax reference.
* The kernel compiles for sm_90a here, with TMA, wgmma, setmaxnreg and no spills in its SASS
  (skipped where this Triton lacks Gluon's Hopper API or ships no cuobjdump).
* On a Hopper GPU (``gpu`` marker) the kernel itself is checked against the float64 reference at
  224/518/1022 px (patch 14, 5 prefix tokens), on odd grids and with 0/1/5 prefix tokens.

The backward (dK/dV per key tile with dQ by atomic adds) likewise: a NumPy model of its tiling, bias gather and
order (:func:`model_backward`) against float64 autograd through ``kernels.attention.eager_alibi_attention``
(dq, dk, dv and the learned-slope gradient), a model of its mbarrier protocol, its sm_90a compile (TMA, wgmma,
setmaxnreg, vector fp32 reductions, no spills), and on a Hopper GPU the kernel against float64 autograd at
224/518/1022 px, odd grids, prefix 0/1/5, constant, per-head and learned slopes, and through
:class:`kernels.alibi_gluon.GluonAlibiAttention`.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import alibi_gluon
from kernels.alibi_bias import alibi_bias, device_bias_lookup

ROOT = Path(__file__).resolve().parents[1]
LOG2E = alibi_gluon.LOG2E
CUDA = torch.cuda.is_available()
HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9


# --------------------------------------------------------------------------------------------
# The NumPy model of the kernel
# --------------------------------------------------------------------------------------------

def _round(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """x rounded to a 16-bit dtype and back to float32 (what the kernel's P.to(dtype) does)."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype).float().numpy()


def _rows_view(t: np.ndarray) -> np.ndarray:
    """(B, H, N, D) → (B·N + pad, H, D): the token rows a TMA descriptor reads, zero-filled past the end."""
    bsz, heads, n, d = t.shape
    rows = t.transpose(0, 2, 1, 3).reshape(bsz * n, heads, d)
    return np.concatenate([rows, np.zeros((alibi_gluon.BLOCK_M + 256, heads, d), rows.dtype)])


def gathered_bias(codes: np.ndarray, tbl: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The kernel's gather: query pointers ``Tbl + 2·a_i`` (row 0), key-pair codes ``c_j`` (row 2)."""
    qptr = 2 * codes[0, rows]
    kp = codes[2, cols]
    idx = qptr[:, None] + kp[None, :]
    assert (idx >= 0).all() and (idx < len(tbl)).all()  # (NumPy would wrap a negative index silently)
    # Keys 2t, 2t+1 of one row read adjacent entries starting at an even (8-byte aligned) index (tiles start at
    # even keys).
    if cols[0] % 2 == 0:
        pairs = idx[:, : len(cols) // 2 * 2]
        assert (pairs[:, 0::2] % 2 == 0).all() and (pairs[:, 1::2] == pairs[:, 0::2] + 1).all()
    return tbl[idx]


def model_forward(q, k, v, grid, prefix, slopes=None, wrap=True, normalize=True, *, block_n=128,
                  rows_per_consumer=alibi_gluon.ROWS_PER_CONSUMER, dtype=torch.bfloat16, metric="euclidean",
                  pipeline=False):
    """What the kernel computes, tile by tile, in float32: returns (O, base-2 lse) as float64 arrays.

    q, k, v: float arrays (B, H, N, D) holding values of ``dtype`` (the model rounds nothing but P).
    ``pipeline``: the pipelined consumer's order (tile i's α rescales O after tile i-1's PV has been added;
    the last tile's PV after the loop) instead of ``O = α·O + P V`` per tile."""
    bsz, heads, n, d = q.shape
    h, w = grid
    codes, _, bias_norm, pair = device_bias_lookup(h, w, prefix, wrap, normalize, True, torch.device("cpu"), metric)
    codes = codes.numpy().astype(np.int64)
    pair = pair.numpy()
    per_head = slopes is not None
    tbl = pair if per_head else (pair * np.float32(LOG2E)).astype(np.float32)
    qk_scale = np.float32(LOG2E / math.sqrt(d))
    bias_scale = np.float32(LOG2E * bias_norm)
    q_rows, k_rows, v_rows = (_rows_view(np.asarray(t, np.float32)) for t in (q, k, v))
    block_m = rows_per_consumer * alibi_gluon.CONSUMERS
    out = np.zeros((bsz, heads, n, d))
    lse = np.zeros((bsz, heads, n))
    n_tiles = -(-n // block_n)
    for b in range(bsz):
        for hh in range(heads):
            b_scale = np.float32(np.float32(slopes[hh]) * bias_scale) if per_head else None
            for off_m in range(0, n, block_m):
                for cid in range(alibi_gluon.CONSUMERS):
                    rows = off_m + cid * rows_per_consumer + np.arange(rows_per_consumer)
                    qt = q_rows[b * n + rows, hh]
                    m_i = np.full(rows_per_consumer, -np.inf, np.float32)
                    l_i = np.zeros(rows_per_consumer, np.float32)
                    acc = np.zeros((rows_per_consumer, d), np.float32)
                    pv_prev = None
                    for i in range(n_tiles):
                        cols = i * block_n + np.arange(block_n)
                        kt = k_rows[b * n + cols, hh]
                        vt = v_rows[b * n + cols, hh]
                        s = (qt @ kt.T).astype(np.float32)
                        bias = gathered_bias(codes, tbl, rows, cols)
                        s = s * qk_scale + (bias * b_scale if per_head else bias)
                        if (i + 1) * block_n > n:  # only the last tile is masked
                            s = np.where((cols < n)[None, :], s, -np.inf)
                        m_new = np.maximum(m_i, s.max(axis=1))
                        alpha = np.exp2(m_i - m_new)
                        p = np.exp2(s - m_new[:, None])
                        l_i = l_i * alpha + p.sum(axis=1)
                        if pipeline:
                            if pv_prev is not None:
                                acc = acc + pv_prev
                            acc = acc * alpha[:, None]
                            pv_prev = _round(p, dtype) @ vt
                        else:
                            acc = acc * alpha[:, None]
                            acc = acc + _round(p, dtype) @ vt
                        m_i = m_new
                    if pipeline:
                        acc = acc + pv_prev
                    keep = rows < n
                    out[b, hh, rows[keep]] = (acc / l_i[:, None])[keep]
                    lse[b, hh, rows[keep]] = (m_i + np.log2(l_i))[keep]
    return out, lse


def reference(q, k, v, grid, prefix, slopes=None, wrap=True, normalize=True, metric="euclidean"):
    """float64 softmax(q kᵀ/√D + m_h·B) v and the base-2 logsumexp of its logits·log2(e)."""
    q, k, v = (torch.as_tensor(np.asarray(t), dtype=torch.float64) for t in (q, k, v))
    heads, d = q.shape[1], q.shape[-1]
    bias = alibi_bias(grid, prefix, wrap=wrap, normalize=normalize, dtype=torch.float64, metric=metric)
    m = torch.ones(heads, dtype=torch.float64) if slopes is None else torch.as_tensor(slopes, dtype=torch.float64)
    logits = q @ k.transpose(-2, -1) / math.sqrt(d) + m.view(1, -1, 1, 1) * bias
    lse = torch.logsumexp(logits, dim=-1) * LOG2E
    return (logits.softmax(-1) @ v).numpy(), lse.numpy()


def _inputs(bsz, heads, n, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(bsz, heads, n, d, generator=g)).to(dtype).float().numpy() for _ in range(3)]


# --------------------------------------------------------------------------------------------
# CPU: the index and bias logic
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("grid,prefix", [((4, 5), 0), ((3, 3), 1), ((7, 6), 5), ((1, 1), 5), ((9, 13), 2)])
@pytest.mark.parametrize("wrap,normalize", [(True, True), (False, True), (True, False), (False, False)])
def test_tile_codes_gather_the_bias(grid, prefix, wrap, normalize):
    """Every (query, key) the kernel's tiles cover gathers B_ij (with log2(e) for constant slopes); prefix
    tokens get 0 against everything; padding past N gathers finite values (the table's zero run)."""
    h, w = grid
    n = prefix + h * w
    codes, _, _, pair = device_bias_lookup(h, w, prefix, wrap, normalize, True, torch.device("cpu"))
    codes, pair = codes.numpy().astype(np.int64), pair.numpy()
    padded = codes.shape[1]
    assert padded % alibi_gluon.BLOCK_M == 0 and padded >= n
    got = gathered_bias(codes, pair, np.arange(padded), np.arange(padded))
    want = alibi_bias(grid, prefix, wrap=wrap, normalize=normalize, dtype=torch.float64).numpy()
    np.testing.assert_allclose(got[:n, :n], want, rtol=0, atol=1e-6)
    assert (got[:prefix, :] == 0).all() and (got[:, :prefix] == 0).all()
    assert np.isfinite(got).all()
    scaled = gathered_bias(codes, (pair * np.float32(LOG2E)).astype(np.float32), np.arange(n), np.arange(n))
    np.testing.assert_allclose(scaled, want * LOG2E, rtol=1e-6, atol=1e-6)


def test_wrap_and_normalisation_reach_the_gathered_values():
    """On a 6×8 grid the farthest pair is (3, 4) apart with wrap (d̂ = 1 at most), (5, 7) apart without."""
    for wrap, far in ((True, 5.0), (False, math.hypot(5, 7))):
        codes, _, _, pair = device_bias_lookup(6, 8, 0, wrap, False, True, torch.device("cpu"))
        got = gathered_bias(codes.numpy().astype(np.int64), pair.numpy(), np.arange(48), np.arange(48))
        assert got.min() == pytest.approx(-far, rel=1e-6)
        codes, _, _, pair = device_bias_lookup(6, 8, 0, wrap, True, True, torch.device("cpu"))
        got = gathered_bias(codes.numpy().astype(np.int64), pair.numpy(), np.arange(48), np.arange(48))
        assert got.min() == pytest.approx(-1.0, rel=1e-6)


@pytest.mark.parametrize("grid,prefix,bsz,block_n,slopes", [
    ((4, 5), 0, 2, 16, None),       # N = 20: one full and one masked 16-key tile, two images
    ((3, 3), 1, 1, 128, None),      # N = 10 < BLOCK_N: a single masked tile
    ((7, 6), 5, 2, 16, [0.5, 1.75]),  # per-head slopes, N = 47
    ((11, 13), 5, 1, 64, None),     # N = 148: two CTAs of 128 rows, the second one mostly padding
    ((16, 16), 5, 1, 128, [0.25, 1.0]),  # 224 px, patch 14: N = 261 = 2·128 + 5
])
@pytest.mark.parametrize("pipeline", [False, True])
def test_model_matches_the_float64_reference(grid, prefix, bsz, block_n, slopes, pipeline):
    heads, d = 2, 64
    n = prefix + grid[0] * grid[1]
    q, k, v = _inputs(bsz, heads, n, d)
    out, lse = model_forward(q, k, v, grid, prefix, slopes, block_n=block_n, pipeline=pipeline)
    ref, ref_lse = reference(q, k, v, grid, prefix, slopes)
    # Only P is rounded (to bf16) before the PV product: the tolerance the GPU tests use for bf16.
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-2
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-4)


def test_model_in_float32_is_the_reference_whatever_the_tiling():
    """With P unrounded the online softmax's rescaling order gives the reference to fp32 rounding, whether
    the keys come as one tile or as many (and the next image's rows past N never leak in)."""
    grid, prefix, heads, d = (5, 7), 3, 2, 64
    n = prefix + grid[0] * grid[1]
    q, k, v = _inputs(2, heads, n, d, dtype=torch.float32, seed=3)
    k[1] *= 50.0  # the next image's keys would dominate any row that read them unmasked
    ref, ref_lse = reference(q, k, v, grid, prefix, None, wrap=False, normalize=True)
    for block_n, pipeline in ((8, False), (16, False), (64, False), (8, True), (16, True)):
        out, lse = model_forward(q, k, v, grid, prefix, None, wrap=False, block_n=block_n, dtype=torch.float32,
                                 pipeline=pipeline)
        # fp32 rounding of logits up to ~40 (image 1's scaled keys); a leak of another image's keys would be O(1).
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4)
        np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-4)


def test_manhattan_metric_uses_the_same_gather():
    grid, prefix = (4, 6), 1
    n = prefix + grid[0] * grid[1]
    q, k, v = _inputs(1, 1, n, 64, seed=5)
    out, _ = model_forward(q, k, v, grid, prefix, block_n=16, metric="manhattan")
    ref, _ = reference(q, k, v, grid, prefix, metric="manhattan")
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-2


# --------------------------------------------------------------------------------------------
# CPU: the mbarrier protocol of the producer and the consumers
# --------------------------------------------------------------------------------------------

class _Barrier:
    """An mbarrier: ``count`` arrivals complete a phase; ``wait(parity)`` passes once the phase of that parity
    has completed, i.e. while the current phase's parity differs (so a fresh barrier passes parity 1)."""

    def __init__(self, count):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed += 1
            self.pending = self.count

    def passes(self, parity):
        return (self.completed & 1) != parity


def _simulate(n_tiles, stages, consumer, seed):
    """Run the kernel's producer and two consumers as coroutines over modelled mbarriers, in a random
    interleaving, mirroring the waits, arrivals and phases of kernels/alibi_gluon.py. TMA lands at once. Checks
    that every consumer reads the tile it expects from each stage and that the producer never refills a stage a
    consumer still holds; returns the order in which the consumers issued QKᵀ, or raises on a deadlock."""
    import random

    bars = {("q", c): _Barrier(1) for c in range(2)}
    bars.update({(kind, s): _Barrier(2 if kind == "empty" else 1) for kind in ("k", "v", "empty") for s in range(stages)})
    bars.update({("turn", c): _Barrier(1) for c in range(2)})
    content = {}  # (kind, stage) -> tile
    holders = {s: set() for s in range(stages)}
    qk_order = []

    def wait(key, parity):
        while not bars[key].passes(parity):
            yield
        return None

    def producer():
        for c in range(2):
            bars["q", c].arrive()
        for i in range(n_tiles):
            st = i % stages
            yield from wait(("empty", st), ((i // stages) & 1) ^ 1)
            assert not holders[st], f"stage {st} refilled with tile {i} while {holders[st]} hold it"
            content["k", st] = content["v", st] = i
            bars["k", st].arrive()
            bars["v", st].arrive()

    def use(cid, kind, i):
        st = i % stages
        assert content.get((kind, st)) == i, f"consumer {cid} read {kind}{content.get((kind, st))} for tile {i}"

    def serial(cid):
        yield from wait(("q", cid), 0)
        for i in range(n_tiles):
            st, ph = i % stages, (i // stages) & 1
            yield from wait(("k", st), ph)
            holders[st].add(cid)
            if consumer == "pingpong":
                yield from wait(("turn", cid), (i + 1 - cid) & 1)
            use(cid, "k", i)
            qk_order.append(cid)
            yield
            if consumer == "pingpong":
                bars["turn", 1 - cid].arrive()
            yield
            yield from wait(("v", st), ph)
            use(cid, "v", i)
            holders[st].discard(cid)
            bars["empty", st].arrive()

    def pipelined(cid):
        yield from wait(("q", cid), 0)
        yield from wait(("k", 0), 0)
        holders[0].add(cid)
        use(cid, "k", 0)
        for i in range(1, n_tiles):
            st, prev = i % stages, (i - 1) % stages
            yield from wait(("k", st), (i // stages) & 1)
            holders[st].add(cid)
            use(cid, "k", i)
            yield from wait(("v", prev), ((i - 1) // stages) & 1)
            use(cid, "v", i - 1)
            yield
            if prev != st:
                holders[prev].discard(cid)
            bars["empty", prev].arrive()
        last = n_tiles - 1
        yield from wait(("v", last % stages), (last // stages) & 1)
        use(cid, "v", last)
        holders[last % stages].discard(cid)
        bars["empty", last % stages].arrive()

    rng = random.Random(seed)
    body = pipelined if consumer == "pipelined" else serial
    roles = [producer(), body(0), body(1)]
    for _ in range(100_000):
        if not roles:
            return qk_order
        role = rng.choice(roles)
        try:
            next(role)
        except StopIteration:
            roles.remove(role)
    raise AssertionError(f"deadlock: {n_tiles} tiles, {stages} stages, {consumer}")


@pytest.mark.parametrize("consumer", ["serial", "pipelined", "pingpong"])
def test_barrier_protocol_never_deadlocks_nor_overwrites_a_stage_in_use(consumer):
    stages = alibi_gluon.launch_config(64, consumer)["STAGES"]
    for n_tiles in (1, 2, 3, 4, 7):
        for seed in range(40):
            order = _simulate(n_tiles, stages, consumer, seed)
            if consumer == "pingpong":  # the consumers take strict turns at QKᵀ, consumer 0 first
                assert order == [0, 1] * n_tiles
    with pytest.raises(AssertionError, match="deadlock|refilled|read"):
        for seed in range(40):  # the model does catch a broken protocol: the pipelined consumer on one stage
            _simulate(4, 1, "pipelined", seed)


# --------------------------------------------------------------------------------------------
# The backward: a NumPy model of its tiling and order, its barrier protocol
# --------------------------------------------------------------------------------------------

def model_backward(q, k, v, do, grid, prefix, slopes=None, wrap=True, normalize=True, *,
                   key_rows=alibi_gluon.BWD_KEY_ROWS, block_m=alibi_gluon.BWD_BLOCK_M, dtype=torch.bfloat16,
                   learned=False):
    """What the backward computes, tile by tile, in float32: returns (dq, dk, dv, dslopes) as float64 arrays.

    CTAs of 2·``key_rows`` keys split between two consumers; each consumer walks the query tiles of ``block_m``
    rows: Sᵀ = K Qᵀ, Pᵀ = exp2(Sᵀ·scale + bias − lse) with the bias gathered at ``Tbl[2·(−b_j) + codes[3, i]]``
    (query pairs), keys past N zeroed only in a consumer whose keys cross N, dV += Pᵀ dO (Pᵀ rounded to
    ``dtype``), dPᵀ = V dOᵀ, dSᵀ = Pᵀ ∘ (dPᵀ − Δ), dK += dSᵀ Q and dQ += dS K (dSᵀ rounded), all rows read from
    the (B·N, ...) row views (the next image's rows, then zeros, past N); lse and Δ from rows padded with +inf
    and 0 past N, as the preprocess kernel writes them; Δ = rowsum(dO∘O) from the float64 O."""
    bsz, heads, n, d = q.shape
    h, w = grid
    codes, _, bias_norm, pair = device_bias_lookup(h, w, prefix, wrap, normalize, True, torch.device("cpu"))
    codes = codes.numpy().astype(np.int64)
    pair = pair.numpy()
    per_head = slopes is not None
    tbl = pair if per_head else (pair * np.float32(LOG2E)).astype(np.float32)
    qk_scale, sm_scale = np.float32(LOG2E / math.sqrt(d)), np.float32(1 / math.sqrt(d))
    bias_scale = np.float32(LOG2E * bias_norm)
    o, lse = reference(q, k, v, grid, prefix, slopes, wrap, normalize)
    stride = codes.shape[1]
    assert stride % block_m == 0 and stride % (2 * key_rows) == 0
    lse_pad = np.full((bsz, heads, stride), np.inf, np.float32)
    lse_pad[..., :n] = lse
    delta = np.zeros((bsz, heads, stride), np.float32)
    delta[..., :n] = (np.asarray(do, np.float64) * o).sum(-1)
    q_rows, k_rows, v_rows, do_rows = (_rows_view(np.asarray(t, np.float32)) for t in (q, k, v, do))
    dq_acc = np.zeros((bsz, heads, n, d), np.float32)
    dk = np.zeros((bsz, heads, n, d))
    dv = np.zeros((bsz, heads, n, d))
    dsl = np.zeros((bsz, heads, n))
    n_tiles = -(-n // block_m)
    for b in range(bsz):
        for hh in range(heads):
            b_scale = np.float32(np.float32(slopes[hh]) * bias_scale) if per_head else None
            for off_n in range(0, n, 2 * key_rows):
                for cid in range(2):
                    keys = off_n + cid * key_rows + np.arange(key_rows)
                    masked = off_n + (cid + 1) * key_rows > n
                    kt, vt = k_rows[b * n + keys, hh], v_rows[b * n + keys, hh]
                    kptr = 2 * codes[1, keys]
                    dk_t = np.zeros((key_rows, d), np.float32)
                    dv_t = np.zeros((key_rows, d), np.float32)
                    dsl_t = np.zeros(key_rows, np.float32)
                    for i in range(n_tiles):
                        cols = i * block_m + np.arange(block_m)
                        qt, dot = q_rows[b * n + cols, hh], do_rows[b * n + cols, hh]
                        idx = kptr[:, None] + codes[3, cols][None, :]
                        assert (idx >= 0).all() and (idx < len(tbl)).all()
                        assert (idx[:, 0::2] % 2 == 0).all() and (idx[:, 1::2] == idx[:, 0::2] + 1).all()
                        bias = tbl[idx]
                        st = (kt @ qt.T).astype(np.float32)
                        lse_t, delta_t = lse_pad[b, hh, cols], delta[b, hh, cols]
                        with np.errstate(invalid="ignore"):
                            logits = st * qk_scale + ((bias * b_scale if per_head else bias) - lse_t[None, :])
                        pt = np.exp2(logits)
                        if masked:
                            pt = np.where((keys < n)[:, None], pt, 0.0).astype(np.float32)
                        dv_t += _round(pt, dtype) @ dot
                        dpt = (vt @ dot.T).astype(np.float32)
                        dst = pt * (dpt - delta_t[None, :])
                        if learned:
                            dsl_t += (dst * bias).sum(1)
                        ds16 = _round(dst, dtype)
                        dk_t += ds16 @ qt
                        keep = cols < n
                        dq_acc[b, hh, cols[keep]] += (ds16.T @ kt)[keep]
                    keep = keys < n
                    dk[b, hh, keys[keep]] = (dk_t * sm_scale)[keep]
                    dv[b, hh, keys[keep]] = dv_t[keep]
                    dsl[b, hh, keys[keep]] = (dsl_t * np.float32(bias_norm))[keep]
    dslopes = dsl.sum(axis=(0, 2)) if learned else None
    return dq_acc.astype(np.float64) * sm_scale, dk, dv, dslopes


def reference_grads(q, k, v, do, grid, prefix, slopes=None, wrap=True, normalize=True):
    """float64 autograd through the eager reference ``kernels.attention.eager_alibi_attention``."""
    from kernels.attention import eager_alibi_attention

    q, k, v = (torch.tensor(np.asarray(t), dtype=torch.float64, requires_grad=True) for t in (q, k, v))
    sl = None if slopes is None else torch.tensor(slopes, dtype=torch.float64, requires_grad=True)
    out = eager_alibi_attention(q, k, v, grid, prefix, sl, wrap, normalize)
    out.backward(torch.tensor(np.asarray(do), dtype=torch.float64))
    return q.grad.numpy(), k.grad.numpy(), v.grad.numpy(), None if sl is None else sl.grad.numpy()


def _rel(a, b):
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


@pytest.mark.parametrize("grid,prefix,bsz,key_rows,block_m,slopes", [
    ((4, 5), 0, 2, 8, 8, None),          # N = 20: three CTAs of 16 keys, the last mostly past N; two images
    ((3, 3), 1, 1, 64, 64, None),        # N = 10: one CTA, consumer 1 entirely past N
    ((7, 6), 5, 2, 8, 16, [0.5, 1.75]),  # per-head slopes, N = 47, key and query tiles of different widths
    ((16, 16), 5, 1, 64, 64, [0.25, 1.0]),  # 224 px, patch 14: N = 261, the shipped tiles
])
@pytest.mark.parametrize("learned", [False, True])
def test_backward_model_matches_float64_autograd(grid, prefix, bsz, key_rows, block_m, slopes, learned):
    if learned and slopes is None:
        slopes = [1.0, 1.0]  # a learned slope starts somewhere: here at the constant model's 1
    heads, d = 2, 64
    n = prefix + grid[0] * grid[1]
    q, k, v = _inputs(bsz, heads, n, d)
    do = _inputs(bsz, heads, n, d, seed=7)[0]
    got = model_backward(q, k, v, do, grid, prefix, slopes, key_rows=key_rows, block_m=block_m, learned=learned)
    want = reference_grads(q, k, v, do, grid, prefix, slopes)
    for name, g, r in zip(("dq", "dk", "dv"), got[:3], want[:3]):
        # P and dS rounded to bf16 before their products: the tolerance the GPU tests use for bf16.
        assert _rel(g, r) < 2e-2, f"{name}: {_rel(g, r):.3g}"
    if learned:
        np.testing.assert_allclose(got[3], want[3], rtol=2e-2, atol=2e-2 * np.abs(want[3]).max())


def test_backward_model_in_float32_is_autograd_whatever_the_tiling():
    """Unrounded, the model's tiling gives float64 autograd's gradients to fp32 rounding, with the next image's
    rows past N (scaled up, so a leak would show) never reaching an image's gradients."""
    grid, prefix, heads, d = (5, 7), 3, 2, 64
    n = prefix + grid[0] * grid[1]
    q, k, v = _inputs(2, heads, n, d, dtype=torch.float32, seed=3)
    do = _inputs(2, heads, n, d, dtype=torch.float32, seed=4)[0]
    k[1] *= 20.0
    v[1] *= 20.0
    q[1] *= 3.0
    want = reference_grads(q, k, v, do, grid, prefix, [0.5, 2.0], wrap=False)
    for key_rows, block_m in ((8, 8), (16, 8), (8, 32), (64, 64)):
        got = model_backward(q, k, v, do, grid, prefix, [0.5, 2.0], wrap=False, key_rows=key_rows, block_m=block_m,
                             dtype=torch.float32, learned=True)
        for name, g, r in zip(("dq", "dk", "dv", "dslopes"), got, want):
            assert _rel(g, r) < 1e-4, f"{name} ({key_rows}, {block_m}): {_rel(g, r):.3g}"


def _simulate_bwd(n_tiles, stages, seed, empty_count=2):
    """The backward's producer and two consumers as coroutines over modelled mbarriers (kernels/alibi_gluon.py's
    _bwd_producer and _bwd_query_tile): one K/V barrier per consumer, then per query tile Q and dO stages with
    their own ready barriers and an ``empty`` barrier both consumers arrive on. Checks every read and that no
    stage is refilled while a consumer holds it; raises on a deadlock."""
    import random

    bars = {("kv", c): _Barrier(1) for c in range(2)}
    bars.update({(kind, s): _Barrier(empty_count if kind == "empty" else 1) for kind in ("q", "do", "empty")
                 for s in range(stages)})
    content, holders = {}, {s: set() for s in range(stages)}

    def wait(key, parity):
        while not bars[key].passes(parity):
            yield

    def producer():
        for c in range(2):
            bars["kv", c].arrive()
        for i in range(n_tiles):
            st = i % stages
            yield from wait(("empty", st), ((i // stages) & 1) ^ 1)
            assert not holders[st], f"stage {st} refilled with tile {i} while {holders[st]} hold it"
            content["q", st] = i
            bars["q", st].arrive()
            yield
            content["do", st] = i
            bars["do", st].arrive()

    def consumer(cid):
        yield from wait(("kv", cid), 0)
        for i in range(n_tiles):
            st, ph = i % stages, (i // stages) & 1
            yield from wait(("q", st), ph)
            holders[st].add(cid)
            assert content.get(("q", st)) == i, f"consumer {cid} read Q{content.get(('q', st))} for tile {i}"
            yield
            yield from wait(("do", st), ph)
            assert content.get(("do", st)) == i, f"consumer {cid} read dO{content.get(('do', st))} for tile {i}"
            yield
            assert content.get(("q", st)) == i and content.get(("do", st)) == i  # still there for dK and dQ
            holders[st].discard(cid)
            bars["empty", st].arrive()

    rng = random.Random(seed)
    roles = [producer(), consumer(0), consumer(1)]
    for _ in range(100_000):
        if not roles:
            return
        role = rng.choice(roles)
        try:
            next(role)
        except StopIteration:
            roles.remove(role)
    raise AssertionError(f"deadlock: {n_tiles} tiles, {stages} stages")


def test_backward_barrier_protocol_never_deadlocks_nor_overwrites_a_stage_in_use():
    for n_tiles in (1, 2, 3, 5, 8):
        for seed in range(40):
            _simulate_bwd(n_tiles, alibi_gluon.BWD_STAGES, seed)
    with pytest.raises(AssertionError, match="deadlock|refilled|read"):
        for seed in range(40):  # the model catches a broken protocol: an empty barrier released by one consumer
            _simulate_bwd(5, alibi_gluon.BWD_STAGES, seed, empty_count=1)


# --------------------------------------------------------------------------------------------
# CPU: the launcher's errors and the import without Gluon
# --------------------------------------------------------------------------------------------

def _qkv(dtype=torch.bfloat16, d=64, device="cpu", n=5 + 16):
    return [torch.zeros(1, 2, n, d, dtype=dtype, device=device) for _ in range(3)]


@pytest.mark.skipif(not alibi_gluon.gluon_available(), reason=f"no Gluon Hopper API: {alibi_gluon.GLUON_ERROR}")
@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=torch.float32), "bfloat16 and float16"),
    (dict(d=32), "head_dim"),
    (dict(), "CUDA" if not CUDA else "token count"),
])
def test_launcher_refuses_unsupported_input(kwargs, match):
    q, k, v = _qkv(**kwargs, device="cuda" if CUDA and not kwargs else "cpu", n=5 + 16 if not CUDA else 7)
    with pytest.raises(ValueError, match=match):
        alibi_gluon.gluon_alibi_attention_fwd(q, k, v, (4, 4), 5)


@pytest.mark.skipif(not alibi_gluon.gluon_available(), reason=f"no Gluon Hopper API: {alibi_gluon.GLUON_ERROR}")
@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype=torch.float32), "bfloat16 and float16"),
    (dict(d=128), "head_dim in \\(64,\\)"),
    (dict(), "CUDA" if not CUDA else "token count"),
])
def test_backward_launcher_refuses_unsupported_input(kwargs, match):
    q, k, v = _qkv(**kwargs, device="cuda" if CUDA and not kwargs else "cpu", n=5 + 16 if not CUDA else 7)
    lse = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    with pytest.raises(ValueError, match=match):
        alibi_gluon.gluon_alibi_attention_bwd(q, q, k, v, q, lse, (4, 4), 5)


def test_kernels_import_without_gluon(monkeypatch):
    """A Triton without triton.experimental.gluon: the module imports (``kernels`` itself never imports it) and
    the Gluon kernel says why on use."""
    import importlib.abc
    import importlib.util

    import triton.experimental

    class NoGluon(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "triton.experimental.gluon" or name.startswith("triton.experimental.gluon."):
                raise ImportError("no gluon in this triton")
            return None

    for name in [m for m in sys.modules if m.startswith("triton.experimental.gluon")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(triton.experimental, "gluon", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoGluon(), *sys.meta_path])
    spec = importlib.util.spec_from_file_location("kernels._alibi_gluon_without_gluon", ROOT / "kernels" / "alibi_gluon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert not module.gluon_available() and "no gluon" in str(module.GLUON_ERROR)
    with pytest.raises(RuntimeError, match="Gluon"):
        module.gluon_alibi_attention_fwd(*_qkv(), (4, 4), 5)
    with pytest.raises(RuntimeError, match="Gluon"):
        module.compile_for_sm90(64)
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="Gluon"):
        module.gluon_alibi_attention_bwd(q, q, k, v, q, torch.zeros(q.shape[:3]), (4, 4), 5)
    with pytest.raises(RuntimeError, match="Gluon"):
        module.compile_bwd_for_sm90(64)
    with pytest.raises(RuntimeError, match="Gluon"):
        module.gluon_alibi_attention(q, k, v, (4, 4), 5)
    assert "kernels.alibi_gluon" not in _imports_of(ROOT / "kernels" / "__init__.py")


def _imports_of(path):
    import ast

    tree = ast.parse(path.read_text())
    return {f"kernels.{n.module}" if n.level else n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


# --------------------------------------------------------------------------------------------
# CPU: it compiles for sm_90a, with the FA3 structure in its SASS
# --------------------------------------------------------------------------------------------

def _cuobjdump():
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return path if path.is_file() else None


@pytest.mark.skipif(not alibi_gluon.gluon_available(),
                    reason=f"this Triton lacks Gluon's Hopper API: {alibi_gluon.GLUON_ERROR}")
@pytest.mark.skipif(_cuobjdump() is None, reason="this Triton build ships no cuobjdump to read SASS with")
def test_compiles_for_sm90a_with_tma_wgmma_setmaxnreg_and_no_spills(tmp_path):
    """Constant slopes, head_dim 64, bf16, the 518 px grid, as benchmarks/bench_gluon_sass.py measures it (which
    also compiles the other consumer forms, head_dim 128, fp16 and per-head slopes)."""
    kernel, _ = alibi_gluon.compile_for_sm90(64)
    _check_sass(kernel, tmp_path)


@pytest.mark.skipif(not alibi_gluon.gluon_available(),
                    reason=f"this Triton lacks Gluon's Hopper API: {alibi_gluon.GLUON_ERROR}")
@pytest.mark.skipif(_cuobjdump() is None, reason="this Triton build ships no cuobjdump to read SASS with")
def test_backward_compiles_for_sm90a_with_tma_wgmma_setmaxnreg_atomics_and_no_spills(tmp_path):
    """The backward, constant slopes, head_dim 64, bf16, 518 px: the FA3 structure, five wgmma per query tile, dQ
    by vector fp32 reductions, no spills. (benchmarks/bench_gluon_sass.py also compiles fp16, per-head slopes and
    the learned-slope gradient, which spills 8 bytes under Triton 3.8 and none under 3.6: see its results.)"""
    kernel, _ = alibi_gluon.compile_bwd_for_sm90(64)
    sass = _check_sass(kernel, tmp_path)
    assert "REDG.E.ADD.F32x2" in sass
    import re

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_gluon_sass import consumer_loop_body

    body = "\n".join(consumer_loop_body(sass))
    # Sᵀ, dPᵀ, dV, dK, dQ: four k-steps of 16 over head_dim 64 or over the 64-row query / key tile each.
    assert len(re.findall(r"HGMMA\.64x64x16", body)) == 20
    assert "STSM" in body  # dSᵀ to shared memory by stmatrix, read back by the dK and dQ wgmma


def _check_sass(kernel, tmp_path):
    import re

    (tmp_path / "k.cubin").write_bytes(kernel.asm["cubin"])
    regs = {int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", kernel.asm["ptx"])}
    assert alibi_gluon.CONSUMER_REGS in regs and alibi_gluon.PRODUCER_REGS in regs
    tool = str(_cuobjdump())
    sass = subprocess.run([tool, "-sass", str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", str(tmp_path / "k.cubin")], capture_output=True, text=True,
                           check=True).stdout
    for op in ("UTMALDG", "HGMMA", "USETMAXREG", "SYNCS"):
        assert op in sass, f"no {op} in the SASS"
    assert " LDL" not in sass and " STL" not in sass
    assert "STACK:0" in usage and "LOCAL:0" in usage
    return sass


# --------------------------------------------------------------------------------------------
# GPU: the kernel itself
# --------------------------------------------------------------------------------------------

GPU_CASES = [
    ((16, 16), 5, 4, None),           # 224 px, patch 14
    ((37, 37), 5, 2, None),           # 518 px
    ((73, 73), 5, 1, None),           # 1022 px
    ((37, 37), 5, 2, "per-head"),
    ((7, 9), 0, 3, None),             # odd grids, prefix 0/1/5
    ((13, 11), 1, 2, "per-head"),
    ((9, 15), 5, 2, None),
    ((1, 1), 1, 2, None),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA device")
@pytest.mark.skipif(not alibi_gluon.gluon_available(), reason=f"no Gluon Hopper API: {alibi_gluon.GLUON_ERROR}")
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 64), (torch.bfloat16, 128)])
@pytest.mark.parametrize("grid,prefix,bsz,slopes", GPU_CASES)
@pytest.mark.parametrize("consumer", alibi_gluon.CONSUMER_FORMS)
def test_gluon_forward_matches_the_float64_reference(grid, prefix, bsz, slopes, head_dim, dtype, consumer):
    heads = 3
    n = prefix + grid[0] * grid[1]
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(bsz, n, 3, heads, head_dim, generator=g).to("cuda", dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # a fused-qkv view, as the model hands it over
    sl = None if slopes is None else torch.tensor([0.5, 1.0, 2.5], device="cuda")
    out, lse = alibi_gluon.gluon_alibi_attention_fwd(q, k, v, grid, prefix, sl, True, True, consumer=consumer)
    torch.cuda.synchronize()
    # The float64 reference on the GPU (at 1022 px the logits are 3 × 5334² doubles).
    q64, k64, v64 = (t.double() for t in (q, k, v))
    bias = alibi_bias(grid, prefix, device="cuda", dtype=torch.float64)
    m = torch.ones(heads, device="cuda", dtype=torch.float64) if sl is None else sl.double()
    logits = q64 @ k64.transpose(-2, -1) / math.sqrt(head_dim) + m.view(1, -1, 1, 1) * bias
    ref = logits.softmax(-1) @ v64
    ref_lse = torch.logsumexp(logits, -1) * LOG2E
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < (4e-2 if dtype == torch.bfloat16 else 1e-2), f"max relative error {err:.3g}"
    assert (lse.double() - ref_lse).abs().max().item() < 2e-2
    assert out.stride() == (n * heads * head_dim, head_dim, heads * head_dim, 1)  # (B, N, heads, D) memory order


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA device")
@pytest.mark.skipif(not alibi_gluon.gluon_available(), reason=f"no Gluon Hopper API: {alibi_gluon.GLUON_ERROR}")
def test_gluon_forward_on_contiguous_inputs_and_without_bias():
    """(B, heads, N, D)-contiguous inputs take the copy into token rows; the bias-free build is plain attention."""
    grid, prefix, heads, d = (9, 11), 5, 2, 64
    n = prefix + grid[0] * grid[1]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, heads, n, d, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    out, _ = alibi_gluon.gluon_alibi_attention_fwd(q, k, v, grid, prefix)
    ref, _ = reference(q.float().cpu().numpy(), k.float().cpu().numpy(), v.float().cpu().numpy(), grid, prefix)
    assert np.abs(out.float().cpu().numpy() - ref).max() / np.abs(ref).max() < 4e-2
    plain, _ = alibi_gluon.gluon_alibi_attention_fwd(q, k, v, grid, prefix, has_bias=False)
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    assert ((plain.float() - want).abs().max() / want.abs().max()).item() < 4e-2


BWD_GPU_CASES = [
    ((16, 16), 5, 4, None),           # 224 px, patch 14
    ((37, 37), 5, 2, None),           # 518 px
    ((73, 73), 5, 1, None),           # 1022 px
    ((37, 37), 5, 2, "per-head"),
    ((37, 37), 5, 2, "learned"),
    ((7, 9), 0, 3, None),             # odd grids, prefix 0/1/5
    ((13, 11), 1, 2, "learned"),
    ((9, 15), 5, 2, "per-head"),
    ((1, 1), 1, 2, None),
]


def _float64_grads(q, k, v, do, grid, prefix, sl):
    """dq, dk, dv (and dslopes) by float64 autograd through kernels.attention.eager_alibi_attention, on the GPU."""
    from kernels.attention import eager_alibi_attention

    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s64 = None if sl is None else sl.detach().double().requires_grad_(True)
    eager_alibi_attention(q64, k64, v64, grid, prefix, s64, True, True).backward(do.double())
    return q64.grad, k64.grad, v64.grad, None if s64 is None else s64.grad


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA device")
@pytest.mark.skipif(not alibi_gluon.gluon_available(), reason=f"no Gluon Hopper API: {alibi_gluon.GLUON_ERROR}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grid,prefix,bsz,slopes", BWD_GPU_CASES)
def test_gluon_backward_matches_float64_autograd(grid, prefix, bsz, slopes, dtype):
    heads, head_dim = 3, 64
    n = prefix + grid[0] * grid[1]
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(bsz, n, 3, heads, head_dim, generator=g).to("cuda", dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    do = torch.randn(bsz, n, heads, head_dim, generator=g).to("cuda", dtype).transpose(1, 2)
    sl = None if slopes is None else torch.tensor([0.5, 1.0, 2.5], device="cuda")
    out, lse = alibi_gluon.gluon_alibi_attention_fwd(q, k, v, grid, prefix, sl)
    dq, dk, dv, dsl = alibi_gluon.gluon_alibi_attention_bwd(do, q, k, v, out, lse, grid, prefix, sl,
                                                            need_dslopes=slopes == "learned")
    torch.cuda.synchronize()
    want = _float64_grads(q, k, v, do, grid, prefix, sl)
    tol = 4e-2 if dtype == torch.bfloat16 else 1e-2
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, f"{name}: max relative error {err:.3g}"
        assert got.stride() == (n * heads * head_dim, head_dim, heads * head_dim, 1)
    if slopes == "learned":
        err = ((dsl.double() - want[3]).abs().max() / want[3].abs().max()).item()
        assert err < tol, f"dslopes: max relative error {err:.3g}"
    else:
        assert dsl is None


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm_90) CUDA device")
@pytest.mark.skipif(not alibi_gluon.gluon_available(), reason=f"no Gluon Hopper API: {alibi_gluon.GLUON_ERROR}")
def test_gluon_autograd_function_and_the_bias_free_backward():
    """GluonAlibiAttention through torch.autograd (contiguous inputs, learned slopes) and the bias-free backward
    against SDPA's gradients."""
    grid, prefix, heads, d = (9, 11), 5, 2, 64
    n = prefix + grid[0] * grid[1]
    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(2, heads, n, d, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    sl = torch.tensor([0.7, 1.3], device="cuda", requires_grad=True)
    alibi_gluon.gluon_alibi_attention(q, k, v, grid, prefix, sl).backward(do)
    want = _float64_grads(q, k, v, do, grid, prefix, sl)
    for name, got, ref in zip(("dq", "dk", "dv", "dslopes"), (q.grad, k.grad, v.grad, sl.grad), want):
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 4e-2, f"{name}: max relative error {err:.3g}"
    out, lse = alibi_gluon.gluon_alibi_attention_fwd(q.detach(), k.detach(), v.detach(), grid, prefix, has_bias=False)
    dq, dk, dv, _ = alibi_gluon.gluon_alibi_attention_bwd(do, q.detach(), k.detach(), v.detach(), out, lse, grid,
                                                          prefix, has_bias=False)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q32, k32, v32).backward(do.float())
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), (q32.grad, k32.grad, v32.grad)):
        err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 4e-2, f"bias-free {name}: max relative error {err:.3g}"
