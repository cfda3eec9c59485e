"""Fused Triton attention with the 2D wrapped ALiBi bias of SPEC.md §2.

Algorithm
---------
Per head with slope ``m`` the logits are ``s_ij = (q_i·k_j)/sqrt(D) + m·B_ij`` with
``B_ij = -d̂(i, j)``. Token ``i >= P`` (``P`` prefix tokens) is the patch at
``row = (i-P) // w``, ``col = (i-P) % w``; prefix tokens get ``B = 0`` against everything.
Per axis the offset is ``|Δ|``, or ``min(|Δ|, extent-|Δ|)`` with wrap; ``d`` is Euclidean and
``d̂ = d / d_max`` with ``d_max = sqrt(⌊h/2⌋²+⌊w/2⌋²)`` (wrap) or ``sqrt((h-1)²+(w-1)²)``
(no wrap); a 1×1 grid has ``d̂ = 0``.

The forward is FlashAttention-2: one program owns ``BLOCK_M`` query rows, streams
``BLOCK_N``-wide key/value tiles, and keeps a running row max ``m``, row sum ``l`` and fp32
output accumulator. Logits live in base 2: the softmax scale is pre-multiplied by log2(e) and
the slope likewise, so each element costs one ``exp2``. The program writes ``O`` and the row
logsumexp (base 2), the only statistic the backward needs. Nothing N×N is ever stored.

The bias is derived per tile, never materialised. Two interchangeable ways (``bias_mode``):

* ``"table"`` (default): a difference table. Each query gets a code
  ``a_i = C + row_i·(2w-1) + col_i`` and each key ``b_j = row_j·(2w-1) + col_j`` with
  ``C = (h-1)(2w-1) + (w-1)``; then ``a_i - b_j`` is the row-major index of the offset
  ``(row_i-row_j, col_i-col_j)`` in a ``(2h-1)×(2w-1)`` table that already holds ``-d̂``
  with wrapping and normalisation applied. Prefix (and out-of-range) tokens get codes that
  land in an appended run of zeros. Per element that is one integer subtraction and one
  gathered (computed-offset) load from a table of O(h·w) floats that stays in L1/L2 — no
  abs/min/sqrt — which matters because at head_dim 64 the MUFU unit is already as busy
  with ``exp2`` as the tensor cores are with the two matmuls.
* ``"sqrt"``: rows and columns per token, then ``|Δ|``, wrap, ``sqrt`` per element. No
  gathered loads, but ~12 ALU ops and a second MUFU op per element. Kept as a switch
  (environment ``ALIBI_TRITON_BIAS=sqrt`` or ``bias_mode="sqrt"``) because which one wins is
  a GPU measurement (``benchmarks/bench_attention.py`` times both).

Codes / rows / columns per token are precomputed once per grid as an int32 (2, N) array, so
the kernels do no integer division in their inner loops.

Backward (non-causal, no atomics, so bitwise deterministic for a given block configuration):

1. ``Δ_i = Σ_d O_id·dO_id`` (preprocess kernel).
2. dK/dV kernel: a program keeps one ``BLOCK_N`` tile of K and V resident and loops over all
   query tiles, recomputing ``P = exp2(s - lse)``; ``dV += Pᵀ dO``, ``dS = P ∘ (dP - Δ)``
   with ``dP = dO Vᵀ``, ``dK += dSᵀ Q · scale``. When the slope needs a gradient it also
   accumulates ``Σ_i dS_ij·B_ij`` per key token into a (B, heads, N) buffer; torch sums that
   to ``dL/dm_h = Σ_ij dS_ij·B_ij``.
3. dQ kernel: a program keeps one query tile and loops over key tiles: ``dQ += dS K · scale``.

Extra memory: the (B, heads, N) fp32 logsumexp, Δ and (optionally) slope partials, plus the
O(h·w) table — all O(N). Inputs may have any strides (e.g. q, k, v as views of timm's fused
qkv projection); ``O`` and the gradients are written in (B, N, heads, D) memory order, so a
following ``transpose(1, 2).reshape(B, N, heads·D)`` is free.

Determinism and autotuning: every kernel writes its outputs exactly once (no atomics, no
split reductions), so repeated calls in one process are bitwise identical. With autotuning on
(the default on GPU) the chosen block sizes can differ between processes or machines, and
with them the summation order; ``ALIBI_TRITON_AUTOTUNE=0`` pins one configuration per
head_dim for bitwise reproducibility across runs. Under ``TRITON_INTERPRET=1`` a single small
configuration is used so CPU tests stay fast.

The op is registered with ``torch.library`` (``alibi_vit::alibi_attention_fwd`` and
``alibi_vit::alibi_attention_bwd`` with fake implementations and an autograd formula), so
``torch.compile`` treats it as one opaque node and does not graph-break.
"""

from __future__ import annotations

import contextlib
import math
import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .alibi_bias import check_grid, max_distance

__all__ = ["BIAS_MODES", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "triton_alibi_attention"]

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BIAS_MODES = ("table", "sqrt")
# Grid axes 1 and 2 (heads, batch) are limited to 65535 programs by CUDA.
_MAX_GRID_YZ = 65535

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_AUTOTUNE = os.environ.get("ALIBI_TRITON_AUTOTUNE", "1") != "0"
DEFAULT_BIAS_MODE = os.environ.get("ALIBI_TRITON_BIAS", "table")
if DEFAULT_BIAS_MODE not in BIAS_MODES:
    raise ValueError(f"ALIBI_TRITON_BIAS must be one of {BIAS_MODES}, got {DEFAULT_BIAS_MODE!r}")


# --------------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------------

def _cfg(block_m, block_n, warps, stages):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


_SMALL_D, _ALL_D, _LARGE_D = (16, 32, 64), (16, 32, 64, 128), (128,)


def _offer(dims=_ALL_D, table=(True, False), fp32=False):
    """Which calls a config is offered to: head_dims, bias modes (TABLE), fp32 or 16-bit inputs."""
    return lambda head_dim, is_table, is_fp32: head_dim in dims and is_table in table and is_fp32 == fp32


# (config, offer) in order of preference: with ALIBI_TRITON_AUTOTUNE=0 the first config offered
# to a call is used. In the backward kernels BLOCK_N is the resident key tile of the dK/dV
# kernel and BLOCK_M the resident query tile of the dQ kernel. The lists keep tiles that
# compiled for sm_90 (triton 3.9) without register spills and within shared memory: e.g. a
# 128x128 forward tile spills in table mode (the gathered bias needs a 64-bit address per
# element) but not in sqrt mode. fp32 inputs use exact ("ieee") products, which do not use
# tensor cores and need far more registers: small tiles only, and even those spill on sm_90
# (triton 3.6 and 3.9); fp32 is a correctness path.
_FWD_CONFIGS = [(_cfg(128, 64, 8, 3), _offer(_SMALL_D)), (_cfg(64, 64, 4, 3), _offer()),
                (_cfg(128, 128, 8, 2), _offer(_SMALL_D, table=(False,))), (_cfg(64, 64, 4, 2), _offer()),
                (_cfg(128, 64, 8, 4), _offer(_SMALL_D)), (_cfg(128, 64, 8, 3), _offer(_LARGE_D, table=(False,))),
                (_cfg(32, 32, 4, 2), _offer(fp32=True)), (_cfg(64, 32, 4, 2), _offer(fp32=True))]
_DKDV_CONFIGS = [(_cfg(64, 128, 8, 2), _offer(_SMALL_D)), (_cfg(64, 64, 8, 2), _offer()),
                 (_cfg(64, 64, 4, 3), _offer(_SMALL_D)), (_cfg(32, 64, 4, 3), _offer()),
                 (_cfg(32, 32, 4, 2), _offer(fp32=True)), (_cfg(32, 64, 4, 2), _offer(fp32=True))]
_DQ_CONFIGS = [(_cfg(128, 64, 8, 2), _offer(_SMALL_D)), (_cfg(64, 64, 8, 2), _offer()),
               (_cfg(128, 32, 4, 3), _offer(_SMALL_D)), (_cfg(64, 64, 4, 3), _offer()), (_cfg(64, 32, 4, 3), _offer()),
               (_cfg(128, 128, 8, 2), _offer(_SMALL_D)), (_cfg(128, 64, 8, 2), _offer(_LARGE_D)),
               (_cfg(32, 32, 4, 2), _offer(fp32=True)), (_cfg(64, 32, 4, 2), _offer(fp32=True))]
# The interpreter runs programs one by one on the CPU: small, unequal tiles keep tests fast and
# still exercise several blocks, partial tail blocks and BLOCK_M != BLOCK_N.
_INTERPRET_CONFIGS = {"fwd": [_cfg(16, 32, 4, 1)], "dkdv": [_cfg(32, 16, 4, 1)], "dq": [_cfg(16, 32, 4, 1)]}


def _gpu_autotune(tagged):
    """Autotuner over the (config, offer) list; tests call its pruning, which the interpreter skips."""
    offer_of = {id(cfg): offer for cfg, offer in tagged}

    # Triton (3.x) calls this as early_config_prune(configs, positional args by name, **keyword args):
    # the tensors arrive in named_args, the constexprs passed by keyword in kwargs.
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        if not {"HEAD_DIM", "TABLE", "Q"} <= args.keys():  # an autotuner that passes no meta-args
            return list(configs)
        call = (args["HEAD_DIM"], bool(args["TABLE"]), args["Q"].dtype == torch.float32)
        offered = [c for c in configs if offer_of[id(c)](*call)] or list(configs)
        return offered if _AUTOTUNE else offered[:1]

    # Configs that still exceed a device's resources are skipped by the autotuner itself.
    return triton.autotune(configs=[cfg for cfg, _ in tagged],
                           key=["N", "HEAD_DIM", "TABLE", "WRAP", "COMPUTE_DSLOPE"],
                           prune_configs_by={"early_config_prune": prune})


def _autotune(kind, tagged):
    if _INTERPRET:
        return triton.autotune(configs=_INTERPRET_CONFIGS[kind], key=["N", "HEAD_DIM"])
    return _gpu_autotune(tagged)


# --------------------------------------------------------------------------------------------
# Bias helpers (device)
# --------------------------------------------------------------------------------------------

@triton.jit
def _load_codes(Codes, offs, N, pad, IS_KEY: tl.constexpr, TABLE: tl.constexpr):
    """Per-token bias coordinates for a vector of token indices.

    TABLE: returns (code, code) with query codes in row 0 and key codes in row 1 of Codes;
    out-of-range tokens get ``pad``, which points into the zero run of the table.
    sqrt: returns (row, col) with row = -1 for prefix and out-of-range tokens.
    """
    mask = offs < N
    if TABLE:
        if IS_KEY:
            code = tl.load(Codes + N + offs, mask=mask, other=pad)
        else:
            code = tl.load(Codes + offs, mask=mask, other=pad)
        return code, code
    else:
        row = tl.load(Codes + offs, mask=mask, other=-1)
        col = tl.load(Codes + N + offs, mask=mask, other=0)
        return row, col


@triton.jit
def _bias_tile(qa, qb, ka, kb, Tbl, h, w,
               TABLE: tl.constexpr, WRAP: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """fp32 tile of B = -d̂ (table) or -d (sqrt; the caller applies 1/d_max).

    Shape (queries, keys), or (keys, queries) when KEYS_FIRST.
    """
    if TABLE:
        if KEYS_FIRST:
            idx = qa[None, :] - ka[:, None]
        else:
            idx = qa[:, None] - ka[None, :]
        bias = tl.load(Tbl + idx)
    else:
        if KEYS_FIRST:
            dy = ka[:, None] - qa[None, :]
            dx = kb[:, None] - qb[None, :]
            valid = (ka[:, None] >= 0) & (qa[None, :] >= 0)
        else:
            dy = qa[:, None] - ka[None, :]
            dx = qb[:, None] - kb[None, :]
            valid = (qa[:, None] >= 0) & (ka[None, :] >= 0)
        dy = tl.abs(dy)
        dx = tl.abs(dx)
        if WRAP:
            dy = tl.minimum(dy, h - dy)
            dx = tl.minimum(dx, w - dx)
        dist = tl.sqrt((dy * dy + dx * dx).to(tl.float32))
        bias = tl.where(valid, -dist, 0.0)
    return bias


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------

@triton.jit
def _fwd_tile(acc, l_i, m_i, q, qa, qb, start_n, K, V, Codes, Tbl,
              stride_kn, stride_kd, stride_vn, stride_vd,
              N, h, w, k_pad, qk_scale, b_scale,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr,
              TABLE: tl.constexpr, WRAP: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kt_ptrs = K + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn
    v_ptrs = V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    if MASK_N:
        mask_n = offs_n < N
        kt = tl.load(kt_ptrs, mask=mask_n[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        kt = tl.load(kt_ptrs)
        v = tl.load(v_ptrs)
    ka, kb = _load_codes(Codes, offs_n, N, k_pad, True, TABLE)
    qk = tl.dot(q, kt, input_precision=DOT_PREC)
    bias = _bias_tile(qa, qb, ka, kb, Tbl, h, w, TABLE, WRAP, False)
    s = qk * qk_scale + bias * b_scale
    if MASK_N:
        # Keys past N must not enter the softmax (their loaded values are zeros, not -inf).
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _alibi_fwd_kernel(Q, K, V, O, LSE, Slopes, Codes, Tbl,
                      stride_qb, stride_qh, stride_qn, stride_qd,
                      stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd,
                      stride_ob, stride_oh, stride_on, stride_od,
                      H, N, h, w, q_pad, k_pad, qk_scale, bias_scale,
                      HEAD_DIM: tl.constexpr, TABLE: tl.constexpr, WRAP: tl.constexpr,
                      COMPUTE_DSLOPE: tl.constexpr, DOT_PREC: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    # int64 base offsets: a fused qkv view of a large batch exceeds 2**31 elements.
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b * stride_kb + off_h.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_h.to(tl.int64) * stride_vh
    O += off_b * stride_ob + off_h.to(tl.int64) * stride_oh
    LSE += (off_b * H + off_h) * N

    b_scale = tl.load(Slopes + off_h).to(tl.float32) * bias_scale
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < N
    q = tl.load(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=mask_m[:, None], other=0.0)
    qa, qb = _load_codes(Codes, offs_m, N, q_pad, False, TABLE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Full key tiles need no per-element mask; only the last partial tile pays for one.
    n_full = (N // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, qa, qb, start_n, K, V, Codes, Tbl,
                                  stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, k_pad, qk_scale, b_scale,
                                  HEAD_DIM, BLOCK_N, False, TABLE, WRAP, DOT_PREC)
    if n_full < N:
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, qa, qb, n_full, K, V, Codes, Tbl,
                                  stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, k_pad, qk_scale, b_scale,
                                  HEAD_DIM, BLOCK_N, True, TABLE, WRAP, DOT_PREC)
    out = acc * (1.0 / l_i)[:, None]
    tl.store(O + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=mask_m[:, None])
    tl.store(LSE + offs_m, m_i + tl.log2(l_i), mask=mask_m)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess_kernel(O, DO, Delta,
                           stride_ob, stride_oh, stride_on, stride_od,
                           stride_dob, stride_doh, stride_don, stride_dod,
                           H, N, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    O += off_b * stride_ob + off_h.to(tl.int64) * stride_oh
    DO += off_b * stride_dob + off_h.to(tl.int64) * stride_doh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < N
    o = tl.load(O + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od, mask=mask_m[:, None], other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod, mask=mask_m[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + (off_b * H + off_h) * N + offs_m, delta, mask=mask_m)


@triton.jit
def _dkdv_loop(dk, dv, dsl, k, v, ka, kb, offs_n, Q, DO, LSE, Delta, Codes, Tbl,
               stride_qn, stride_qd, stride_don, stride_dod,
               N, h, w, q_pad, qk_scale, b_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK_N: tl.constexpr,
               TABLE: tl.constexpr, WRAP: tl.constexpr, COMPUTE_DSLOPE: tl.constexpr,
               DOT_PREC: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(0, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < N
        qt = tl.load(Q + offs_d[:, None] * stride_qd + offs_m[None, :] * stride_qn, mask=mask_m[None, :], other=0.0)
        do = tl.load(DO + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod, mask=mask_m[:, None],
                     other=0.0)
        # lse = +inf for queries past N makes their probabilities exactly 0: no element mask needed.
        lse = tl.load(LSE + offs_m, mask=mask_m, other=float("inf"))
        delta = tl.load(Delta + offs_m, mask=mask_m, other=0.0)
        qa, qb = _load_codes(Codes, offs_m, N, q_pad, False, TABLE)
        qkt = tl.dot(k, qt, input_precision=DOT_PREC)
        bias_t = _bias_tile(qa, qb, ka, kb, Tbl, h, w, TABLE, WRAP, True)
        pt = tl.exp2(qkt * qk_scale + bias_t * b_scale - lse[None, :])
        if MASK_N:
            # Keys past N were loaded as zeros; their p could overflow and poison dslope.
            pt = tl.where((offs_n < N)[:, None], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, acc=dv, input_precision=DOT_PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), acc=dk, input_precision=DOT_PREC)
        if COMPUTE_DSLOPE:
            dsl += tl.sum(dst * bias_t, 1)
    return dk, dv, dsl


@triton.jit
def _alibi_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, Delta, DSL, Slopes, Codes, Tbl,
                           stride_qb, stride_qh, stride_qn, stride_qd,
                           stride_kb, stride_kh, stride_kn, stride_kd,
                           stride_vb, stride_vh, stride_vn, stride_vd,
                           stride_dob, stride_doh, stride_don, stride_dod,
                           stride_gb, stride_gh, stride_gn, stride_gd,
                           H, N, h, w, q_pad, k_pad, qk_scale, sm_scale, bias_scale, bias_norm,
                           HEAD_DIM: tl.constexpr, TABLE: tl.constexpr, WRAP: tl.constexpr,
                           COMPUTE_DSLOPE: tl.constexpr, DOT_PREC: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b * stride_kb + off_h.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_h.to(tl.int64) * stride_vh
    DO += off_b * stride_dob + off_h.to(tl.int64) * stride_doh
    DK += off_b * stride_gb + off_h.to(tl.int64) * stride_gh
    DV += off_b * stride_gb + off_h.to(tl.int64) * stride_gh
    row = (off_b * H + off_h) * N
    LSE += row
    Delta += row
    DSL += row

    b_scale = tl.load(Slopes + off_h).to(tl.float32) * bias_scale
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < N
    k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=mask_n[:, None], other=0.0)
    v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=mask_n[:, None], other=0.0)
    ka, kb = _load_codes(Codes, offs_n, N, k_pad, True, TABLE)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dsl = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Only the program holding the last, partial key tile needs the per-element key mask.
    if pid_n * BLOCK_N + BLOCK_N <= N:
        dk, dv, dsl = _dkdv_loop(dk, dv, dsl, k, v, ka, kb, offs_n, Q, DO, LSE, Delta, Codes, Tbl,
                                 stride_qn, stride_qd, stride_don, stride_dod, N, h, w, q_pad, qk_scale, b_scale,
                                 HEAD_DIM, BLOCK_M, False, TABLE, WRAP, COMPUTE_DSLOPE, DOT_PREC)
    else:
        dk, dv, dsl = _dkdv_loop(dk, dv, dsl, k, v, ka, kb, offs_n, Q, DO, LSE, Delta, Codes, Tbl,
                                 stride_qn, stride_qd, stride_don, stride_dod, N, h, w, q_pad, qk_scale, b_scale,
                                 HEAD_DIM, BLOCK_M, True, TABLE, WRAP, COMPUTE_DSLOPE, DOT_PREC)
    g_off = offs_n[:, None] * stride_gn + offs_d[None, :] * stride_gd
    tl.store(DK + g_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask_n[:, None])
    tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=mask_n[:, None])
    if COMPUTE_DSLOPE:
        # Per-key partial sums of dS·B; summed over keys and batch in torch (deterministic).
        tl.store(DSL + offs_n, dsl * bias_norm, mask=mask_n)


@triton.jit
def _dq_tile(dq, q, do, lse, delta, qa, qb, start_n, K, V, Codes, Tbl,
             stride_kn, stride_kd, stride_vn, stride_vd,
             N, h, w, k_pad, qk_scale, b_scale,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr,
             TABLE: tl.constexpr, WRAP: tl.constexpr, DOT_PREC: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kt_ptrs = K + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn
    vt_ptrs = V + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn
    if MASK_N:
        mask_n = offs_n < N
        kt = tl.load(kt_ptrs, mask=mask_n[None, :], other=0.0)
        vt = tl.load(vt_ptrs, mask=mask_n[None, :], other=0.0)
    else:
        kt = tl.load(kt_ptrs)
        vt = tl.load(vt_ptrs)
    ka, kb = _load_codes(Codes, offs_n, N, k_pad, True, TABLE)
    qk = tl.dot(q, kt, input_precision=DOT_PREC)
    bias = _bias_tile(qa, qb, ka, kb, Tbl, h, w, TABLE, WRAP, False)
    p = tl.exp2(qk * qk_scale + bias * b_scale - lse[:, None])
    if MASK_N:
        p = tl.where(mask_n[None, :], p, 0.0)
    dp = tl.dot(do, vt, input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), acc=dq, input_precision=DOT_PREC)
    return dq


@triton.jit
def _alibi_bwd_dq_kernel(Q, K, V, DO, DQ, LSE, Delta, Slopes, Codes, Tbl,
                         stride_qb, stride_qh, stride_qn, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_dob, stride_doh, stride_don, stride_dod,
                         stride_gb, stride_gh, stride_gn, stride_gd,
                         H, N, h, w, q_pad, k_pad, qk_scale, sm_scale, bias_scale,
                         HEAD_DIM: tl.constexpr, TABLE: tl.constexpr, WRAP: tl.constexpr,
                         COMPUTE_DSLOPE: tl.constexpr, DOT_PREC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b * stride_kb + off_h.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_h.to(tl.int64) * stride_vh
    DO += off_b * stride_dob + off_h.to(tl.int64) * stride_doh
    DQ += off_b * stride_gb + off_h.to(tl.int64) * stride_gh
    row = (off_b * H + off_h) * N

    b_scale = tl.load(Slopes + off_h).to(tl.float32) * bias_scale
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < N
    q = tl.load(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=mask_m[:, None], other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod, mask=mask_m[:, None], other=0.0)
    lse = tl.load(LSE + row + offs_m, mask=mask_m, other=float("inf"))
    delta = tl.load(Delta + row + offs_m, mask=mask_m, other=0.0)
    qa, qb = _load_codes(Codes, offs_m, N, q_pad, False, TABLE)

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    n_full = (N // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse, delta, qa, qb, start_n, K, V, Codes, Tbl,
                      stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, k_pad, qk_scale, b_scale,
                      HEAD_DIM, BLOCK_N, False, TABLE, WRAP, DOT_PREC)
    if n_full < N:
        dq = _dq_tile(dq, q, do, lse, delta, qa, qb, n_full, K, V, Codes, Tbl,
                      stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, k_pad, qk_scale, b_scale,
                      HEAD_DIM, BLOCK_N, True, TABLE, WRAP, DOT_PREC)
    tl.store(DQ + offs_m[:, None] * stride_gn + offs_d[None, :] * stride_gd, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=mask_m[:, None])


_fwd_kernel = _autotune("fwd", _FWD_CONFIGS)(_alibi_fwd_kernel)
_dkdv_kernel = _autotune("dkdv", _DKDV_CONFIGS)(_alibi_bwd_dkdv_kernel)
_dq_kernel = _autotune("dq", _DQ_CONFIGS)(_alibi_bwd_dq_kernel)
_PREPROCESS_BLOCK_M = 16 if _INTERPRET else 64
# Fused multiply-adds in the softmax and bias arithmetic, requested explicitly: on by default up
# to Triton 3.9, which warns that 3.10 turns the default off (ptxas --fmad=false; ~15% more fp32
# instructions in the forward's inner loop on sm_90).
_LAUNCH_OPTIONS = {"enable_fp_fusion": True}


# --------------------------------------------------------------------------------------------
# Host side: geometry tables, launches
# --------------------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _geometry(h: int, w: int, prefix: int, wrap: bool, normalize: bool, table: bool, device: torch.device):
    """Per-grid constants, built once: (codes int32 (2, N), table fp32, q_pad, k_pad, bias_norm).

    Table mode: ``table[a_i - b_j] = B_ij`` for every pair (see module docstring); the table is
    the (2h-1)×(2w-1) array of -d̂ over offsets, followed by 2C+2 zeros that prefix and
    out-of-range codes map into. bias_norm is 1 (the table is already normalised).
    sqrt mode: codes are (row, col) with row -1 for prefix tokens; bias_norm is 1/d_max.
    """
    n = prefix + h * w
    p = torch.arange(h * w, dtype=torch.int64)
    row, col = p // w, p % w
    d_max = max_distance((h, w), wrap)
    if normalize:
        # 1×1 grid: d_max = 0 and d̂ is defined as 0.
        norm = 1.0 / d_max if d_max > 0 else 0.0
    else:
        norm = 1.0
    codes = torch.empty(2, n, dtype=torch.int64)
    if table:
        w2 = 2 * w - 1
        center = (h - 1) * w2 + (w - 1)
        q_pad, k_pad = 3 * center + 1, -(center + 1)
        codes[0, :prefix], codes[1, :prefix] = q_pad, k_pad
        codes[0, prefix:] = center + row * w2 + col
        codes[1, prefix:] = row * w2 + col
        dy = torch.arange(-(h - 1), h, dtype=torch.float64).abs()
        dx = torch.arange(-(w - 1), w, dtype=torch.float64).abs()
        if wrap:
            dy = torch.minimum(dy, h - dy)
            dx = torch.minimum(dx, w - dx)
        core = -(dy[:, None] ** 2 + dx[None, :] ** 2).sqrt().flatten() * norm
        tbl = torch.cat([core, torch.zeros(2 * center + 2, dtype=torch.float64)])
        assert tbl.numel() == 4 * center + 3 and core.numel() == 2 * center + 1
        bias_norm = 1.0
    else:
        q_pad = k_pad = 0  # unused: sqrt mode pads in-kernel with row = -1
        codes[0, :prefix], codes[1, :prefix] = -1, 0
        codes[0, prefix:], codes[1, prefix:] = row, col
        tbl = torch.zeros(1, dtype=torch.float64)
        bias_norm = norm
    if codes.abs().max() >= 2**31 or tbl.numel() >= 2**31:
        raise ValueError(f"grid {h}x{w} is too large for int32 bias codes")
    return (codes.to(device=device, dtype=torch.int32), tbl.to(device=device, dtype=torch.float32),
            int(q_pad), int(k_pad), float(bias_norm))


def _strides(t):
    return tuple(t.stride())


def _new_bnhd(q, dtype=None):
    """An empty (B, heads, N, D) tensor stored in (B, N, heads, D) order (see module docstring)."""
    b, hd, n, d = q.shape
    return q.new_empty((b, n, hd, d), dtype=dtype or q.dtype).transpose(1, 2)


def _check_tile_offsets(name, t):
    # Offsets inside one (batch, head) slice are int32 in the kernels; batch/head bases are int64.
    n, d = t.shape[2], t.shape[3]
    if (n - 1) * abs(t.stride(2)) + (d - 1) * abs(t.stride(3)) >= 2**31:
        raise ValueError(f"{name}: one (batch, head) slice spans more than 2**31 elements; make it contiguous")


def _check_output_offsets(heads, n, d):
    # O, dQ, dK and dV are (B, N, heads, D) in memory: a slice's token stride is heads·D, whatever
    # the inputs' strides, so that product must fit the kernels' int32 offsets as well.
    if (n - 1) * heads * d + (d - 1) >= 2**31:
        raise ValueError(f"(tokens - 1) * heads * head_dim = {(n - 1) * heads * d} reaches 2**31, the limit of "
                         "the triton backend's (B, N, heads, D) outputs; use fewer heads or tokens per call")


def _device_guard(t):
    # Triton launches on the current CUDA device; make that the tensors' device.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _dot_precision(dtype):
    # fp32 inputs get exact fp32 products (as torch's default matmul); tf32 would lose ~3 digits.
    return "ieee" if dtype == torch.float32 else "tf32"


def _launch_fwd(q, k, v, slopes, h, w, prefix, wrap, normalize, use_table):
    bsz, heads, n, d = q.shape
    codes, tbl, q_pad, k_pad, bias_norm = _geometry(h, w, prefix, wrap, normalize, use_table, q.device)
    o = _new_bnhd(q)
    lse = q.new_empty((bsz, heads, n), dtype=torch.float32)
    sm_scale = 1.0 / math.sqrt(d)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]), heads, bsz)

    with _device_guard(q):
        _fwd_kernel[grid](q, k, v, o, lse, slopes, codes, tbl,
                          *_strides(q), *_strides(k), *_strides(v), *_strides(o),
                          heads, n, h, w, q_pad, k_pad, sm_scale * LOG2E, LOG2E * bias_norm,
                          HEAD_DIM=d, TABLE=use_table, WRAP=wrap, COMPUTE_DSLOPE=False,
                          DOT_PREC=_dot_precision(q.dtype), **_LAUNCH_OPTIONS)
    return o, lse


def _launch_bwd(do, q, k, v, o, lse, slopes, h, w, prefix, wrap, normalize, use_table, need_dslopes):
    bsz, heads, n, d = q.shape
    codes, tbl, q_pad, k_pad, bias_norm = _geometry(h, w, prefix, wrap, normalize, use_table, q.device)
    sm_scale = 1.0 / math.sqrt(d)
    prec = _dot_precision(q.dtype)
    _check_tile_offsets("grad_output", do)
    delta = q.new_empty((bsz, heads, n), dtype=torch.float32)
    dq, dk, dv = _new_bnhd(q), _new_bnhd(q), _new_bnhd(q)
    assert dq.stride() == dk.stride() == dv.stride()
    dsl = q.new_empty((bsz, heads, n) if need_dslopes else (1,), dtype=torch.float32)

    def grid_k(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), heads, bsz)

    def grid_q(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]), heads, bsz)

    with _device_guard(q):
        _bwd_preprocess_kernel[(triton.cdiv(n, _PREPROCESS_BLOCK_M), heads, bsz)](
            o, do, delta, *_strides(o), *_strides(do), heads, n, HEAD_DIM=d, BLOCK_M=_PREPROCESS_BLOCK_M,
            **_LAUNCH_OPTIONS)
        _dkdv_kernel[grid_k](q, k, v, do, dk, dv, lse, delta, dsl, slopes, codes, tbl,
                             *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
                             heads, n, h, w, q_pad, k_pad, sm_scale * LOG2E, sm_scale, LOG2E * bias_norm, bias_norm,
                             HEAD_DIM=d, TABLE=use_table, WRAP=wrap, COMPUTE_DSLOPE=need_dslopes, DOT_PREC=prec,
                             **_LAUNCH_OPTIONS)
        _dq_kernel[grid_q](q, k, v, do, dq, lse, delta, slopes, codes, tbl,
                           *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq),
                           heads, n, h, w, q_pad, k_pad, sm_scale * LOG2E, sm_scale, LOG2E * bias_norm,
                           HEAD_DIM=d, TABLE=use_table, WRAP=wrap, COMPUTE_DSLOPE=False, DOT_PREC=prec,
                           **_LAUNCH_OPTIONS)
    dslopes = dsl.sum(dim=(0, 2)) if need_dslopes else slopes.new_zeros(heads)
    return dq, dk, dv, dslopes


# --------------------------------------------------------------------------------------------
# torch.library registration (opaque to torch.compile, with fake tensors and autograd)
# --------------------------------------------------------------------------------------------

@torch.library.custom_op("alibi_vit::alibi_attention_fwd", mutates_args=())
def alibi_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                        grid_h: int, grid_w: int, num_prefix_tokens: int, wrap: bool, normalize: bool,
                        use_table: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (O, base-2 logsumexp per row). ``slopes`` is fp32 of shape (heads,)."""
    return _launch_fwd(q, k, v, slopes.contiguous(), grid_h, grid_w, num_prefix_tokens, wrap, normalize, use_table)


@alibi_attention_fwd.register_fake
def _(q, k, v, slopes, grid_h, grid_w, num_prefix_tokens, wrap, normalize, use_table):
    bsz, heads, n, _ = q.shape
    return _new_bnhd(q), q.new_empty((bsz, heads, n), dtype=torch.float32)


@torch.library.custom_op("alibi_vit::alibi_attention_bwd", mutates_args=())
def alibi_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, slopes: torch.Tensor, grid_h: int, grid_w: int, num_prefix_tokens: int,
                        wrap: bool, normalize: bool, use_table: bool,
                        need_dslopes: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dslopes); dslopes is zeros when ``need_dslopes`` is False."""
    return _launch_bwd(do, q, k, v, o, lse, slopes.contiguous(), grid_h, grid_w, num_prefix_tokens, wrap, normalize,
                       use_table, need_dslopes)


@alibi_attention_bwd.register_fake
def _(do, q, k, v, o, lse, slopes, grid_h, grid_w, num_prefix_tokens, wrap, normalize, use_table, need_dslopes):
    return _new_bnhd(q), _new_bnhd(q), _new_bnhd(q), slopes.new_empty(slopes.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, slopes, grid_h, grid_w, prefix, wrap, normalize, use_table = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, slopes)
    ctx.geometry = (grid_h, grid_w, prefix, wrap, normalize, use_table)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, slopes = ctx.saved_tensors
    need_dslopes = bool(ctx.needs_input_grad[3])
    dq, dk, dv, dslopes = alibi_attention_bwd(do, q, k, v, o, lse, slopes, *ctx.geometry, need_dslopes)
    return dq, dk, dv, (dslopes if need_dslopes else None), None, None, None, None, None, None


alibi_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------

def _validate(q, k, v, grid_size, num_prefix_tokens, slopes, bias_mode):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4D tensor (batch, heads, tokens, head_dim)")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k, v must share one dtype and one device")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the triton backend supports float16, bfloat16 and float32 inputs, got {q.dtype}")
    bsz, heads, n, d = q.shape
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the triton backend supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}; "
                         "use backend='sdpa' or 'flex' for other sizes")
    if q.device.type != "cuda" and not _INTERPRET:
        raise ValueError(f"the triton backend needs CUDA tensors (got {q.device}); set TRITON_INTERPRET=1 "
                         "before importing triton to run it on the CPU interpreter")
    if bsz > _MAX_GRID_YZ or heads > _MAX_GRID_YZ:
        raise ValueError(f"batch and heads must each be at most {_MAX_GRID_YZ}, got {bsz} and {heads}")
    h, w = check_grid(grid_size)
    if isinstance(num_prefix_tokens, bool) or int(num_prefix_tokens) != num_prefix_tokens or num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be a non-negative integer, got {num_prefix_tokens!r}")
    if n != num_prefix_tokens + h * w:
        raise ValueError(f"token count {n} does not match num_prefix_tokens + h*w = {num_prefix_tokens + h * w}")
    if n == 0:
        raise ValueError("need at least one token")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tile_offsets(name, t)
    _check_output_offsets(heads, n, d)
    if slopes is not None:
        if not isinstance(slopes, torch.Tensor) or slopes.shape != (heads,):
            raise ValueError(f"slopes must be a tensor of shape (heads,) = ({heads},)")
        if slopes.device != q.device:
            raise ValueError(f"slopes are on {slopes.device} but q is on {q.device}")
    if bias_mode not in BIAS_MODES:
        raise ValueError(f"bias_mode must be one of {BIAS_MODES}, got {bias_mode!r}")
    return h, w, int(num_prefix_tokens)


def triton_alibi_attention(q, k, v, grid_size, num_prefix_tokens, slopes, wrap, normalize, *, bias_mode=None):
    """Fused attention with the 2D ALiBi bias: ``softmax(q kᵀ/sqrt(D) + m_h·B) v``.

    Args:
        q, k, v: (B, heads, N, head_dim), float16/bfloat16/float32, any strides;
            head_dim in ``SUPPORTED_HEAD_DIMS``; ``N = num_prefix_tokens + h·w``.
        grid_size: patch grid (h, w), patches row-major after the prefix tokens.
        num_prefix_tokens: CLS/register tokens at the front (zero bias).
        slopes: (heads,) tensor, or None for slope 1 on every head (then no slope gradient).
            A gradient reaches it when it requires grad.
        wrap, normalize: see SPEC.md §2.
        bias_mode: "table" or "sqrt" (how the kernel derives the bias; same result).
            Default: ``ALIBI_TRITON_BIAS`` or "table".

    Returns:
        (B, heads, N, head_dim) in q's dtype, stored in (B, N, heads, D) memory order.
    """
    bias_mode = DEFAULT_BIAS_MODE if bias_mode is None else bias_mode
    h, w, prefix = _validate(q, k, v, grid_size, num_prefix_tokens, slopes, bias_mode)
    if slopes is None:
        slopes32 = torch.ones(q.shape[1], device=q.device, dtype=torch.float32)
    else:
        slopes32 = slopes.to(torch.float32)  # differentiable cast: the gradient returns in slopes' dtype
    o, _ = alibi_attention_fwd(q, k, v, slopes32, h, w, prefix, bool(wrap), bool(normalize), bias_mode == "table")
    return o
