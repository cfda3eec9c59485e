"""An FA3-structured forward and backward of the 2D-ALiBi attention for Hopper (sm_90a), written in Gluon.

Status: **experimental, not a default, awaiting a GPU** (compiled for sm_90a with Triton 3.6 and 3.8,
never launched). Nothing in the project calls it; :func:`gluon_alibi_attention_fwd`,
:func:`gluon_alibi_attention_bwd` and the autograd wrapper :func:`gluon_alibi_attention` are for the GPU
phase (``benchmarks/bench_fa3.py``) and the tests. On a machine without a GPU the kernels are compiled
for sm_90a (``benchmarks/bench_gluon_sass.py``) and their index, bias and tiling logic is mirrored by
NumPy models (``tests/test_alibi_gluon.py``); no output of the kernels themselves has been checked yet. Importing this module never needs a GPU or
Gluon: a Triton without ``triton.experimental.gluon`` (or without its Hopper pieces) is reported
when the kernel is used (:func:`gluon_available`, :data:`GLUON_ERROR`).

Structure (one CTA = 128 query rows of one head of one image, ``grid = (⌈N/128⌉, heads, batch)``):

* **Producer** (a worker partition of 1 warp, 24 registers): loads both consumers' Q tiles by
  TMA once, then streams the head's K and V tiles, ``BLOCK_N`` keys each, by TMA into a ring of
  ``STAGES`` shared-memory stages. Each stage has three mbarriers: ``k_ready`` and ``v_ready``
  (armed with the tile's byte count, completed by the TMA engine; separate, so QKᵀ starts before
  V has landed) and ``empty`` (count 2: each consumer arrives once it is done with the stage).
* **Two consumer warpgroups** (the default partition, and a 4-warp worker partition), each owning
  64 of the 128 query rows and reading the same K/V stages. Per key tile: wait ``k_ready``; issue
  ``S = Q Kᵀ`` as an asynchronous ``warpgroup_mma`` (Q and K from shared memory); while it runs,
  load the tile's key-pair codes and gather the bias (below); wait for S; ``s = S·log2(e)/√D + bias``;
  online softmax in base 2 (``m_new = max(m, rowmax s)``, ``α = exp2(m - m_new)``,
  ``p = exp2(s - m_new)``, ``l = α·l + rowsum p``, ``O ← α·O``); wait ``v_ready``; ``O += P V`` as a
  ``warpgroup_mma`` with P from registers (bf16/fp16) and V from shared memory; wait; arrive on
  ``empty``. Two warpgroups on the same SM give the warp schedulers one's softmax to run under the
  other's matmuls (FA3's inter-warpgroup overlap, left to the schedulers: no named-barrier
  ping-pong).
* **Pipelined consumers** (``consumer="pipelined"``, experimental, for the GPU A/B): FA3's intra-warpgroup
  overlap. After a prologue tile, each step issues ``S_i = Q K_iᵀ`` and then ``O += P_{i-1} V_{i-1}``
  (both asynchronous), gathers tile i's bias, waits for S_i alone (wgmma groups retire in order, so
  the PV stays in flight) and runs tile i's softmax under the PV; then it waits for the PV, releases
  stage i-1 and rescales O by tile i's α; the last tile's PV follows the loop. A consumer then holds
  two stages at once, so the ring gets three.
* **Ping-pong consumers** (``consumer="pingpong"``, experimental, for the GPU A/B): the serial consumer,
  but the two warpgroups take turns at issuing QKᵀ through two turn mbarriers, each passing the turn
  once its S is done, so one's softmax and PV run while the other's QKᵀ does (FA3's explicit
  inter-warpgroup schedule, with mbarriers in place of named barriers).
* **Registers** are rebalanced by ``gl.warp_specialize``'s per-partition register counts, which
  Triton lowers to ``setmaxnreg`` (SASS ``USETMAXREG``): the producer drops to 24, the consumers
  rise to 240 under the kernel's ``maxnreg`` (168 = 65536 / (3 warpgroups · 128 threads), rounded
  down to a multiple of 8).
* **Epilogue**: each consumer writes its 64 rows of ``O = acc / l`` (plain stores, masked at N)
  in the (B, N, heads, D) memory order of :mod:`kernels.alibi_triton`, and the base-2 logsumexp
  ``m + log2(l)`` (B, heads, N), fp32, the statistic that module's backward reads.

Bias: exactly the fused Triton kernel's table mode (:func:`kernels.alibi_bias.device_bias_lookup`):
each consumer loads its rows' query codes ``a_i`` once (row 0 of the codes, padded past N) and
turns them into pointers ``Tbl + 2·a_i`` into the key-pair table; per key tile it loads the key-pair
codes ``c_j`` (row 2) and gathers ``Tbl[2·a_i + c_j]``: keys 2t and 2t+1 read adjacent, 8-byte
aligned entries, so one 8-byte load serves two scores (the accumulator layout of wgmma gives each
thread pairs of adjacent columns). Prefix tokens and padding codes land in the table's zero run.
Constant slopes (``slopes=None``, the paper's model): the pair table is pre-scaled by ``log2(e)``
(one FFMA per score adds it). Per-head slopes: the unscaled table times the head's
``m_h·log2(e)`` (one FMUL more per score). The table (up to ~1.5 MB at 1022 px) is too large for
shared memory beside the K/V ring, so it is gathered from global memory (L1/L2-resident) as in
the Triton kernel, issued while the QKᵀ wgmma runs.

Keys past N: the last key tile (when N is not a multiple of ``BLOCK_N``) masks its scores to
-inf; its K/V rows beyond N are the next image's first tokens (finite, times P = 0) or the TMA
engine's zero fill past the tensor's end. Q rows beyond N likewise compute garbage that is never
stored.

Backward (head_dim 64; one CTA = 128 keys of one head of one image, ``grid = (⌈N/128⌉, heads, batch)``):

* **Producer** (1 warp, 24 registers): each consumer's 64 K and V rows once, by TMA, onto one barrier per
  consumer; then, for every 64-row query tile, its Q and dO tiles into a ring of ``BWD_STAGES`` stages with
  separate ``q_ready``/``do_ready`` barriers and an ``empty`` barrier of count 2.
* **Two consumer warpgroups** (240 registers), each owning 64 keys, so keys are every wgmma's M (the
  transposed form): per query tile ``Sᵀ = K Qᵀ`` (async; the lse row and the bias gathered meanwhile, the
  keys' pointers ``Tbl + 2·(−b_j)`` against the query-pair codes, row 3 of the codes, one 8-byte load per two
  scores), ``Pᵀ = exp2(Sᵀ·log2(e)/√D + bias − lse)`` (keys past N zeroed, only in a consumer whose keys
  cross N: two copies of the loop), ``dPᵀ = V dOᵀ`` and ``dV += Pᵀ dO`` issued together (Pᵀ from registers),
  Δ loaded meanwhile, ``dSᵀ = Pᵀ ∘ (dPᵀ − Δ)`` stored to shared memory (``stmatrix``), then ``dK += dSᵀ Q``
  and ``dQ_tile = dS K`` (both from shared memory, the latter transposed), the stage released, and dQ_tile
  added into an fp32 (B, N, heads, D) buffer with vector reductions (``red.global.add.v2.f32``); dQ is scaled
  and cast once at the end. Δ = rowsum(dO∘O) and the +inf/0-padded lse rows come from
  :mod:`kernels.alibi_triton`'s preprocess kernel.
* **Learned slopes** (``need_dslopes``): the per-head path (unscaled table) also sums ``dS·B`` per key,
  gathering B a second time after dSᵀ (keeping it live across dPᵀ spilled); the host sums the per-key
  partials to ``dL/dm_h``. Under Triton 3.6 (the GPU machine's) nothing spills; under 3.8 this build spills
  8 bytes (a pointer LLVM hoists above the partitions' dispatch, reloaded once per query tile), constant and
  per-head slopes none.

Inputs: q, k, v of shape (B, heads, N, D), bf16 or fp16, on a CUDA device of compute capability
9.x, D in :data:`SUPPORTED_HEAD_DIMS`. TMA reads them as 2-D row matrices (token rows of
``stride(2)`` elements, the head's columns at ``h·stride(1)``): views of a fused qkv projection
(timm's ``(B, N, 3, heads, D)``) qualify as they are; other layouts are copied to (B, N, heads, D)
first.
"""

from __future__ import annotations

import functools
import math

import torch

from .alibi_bias import CODE_PAD, check_attention_inputs, check_metric, device_bias_lookup
from .compile_sm90 import compile_sm90

__all__ = ["BWD_SUPPORTED_HEAD_DIMS", "CONSUMER_FORMS", "GLUON_ERROR", "GluonAlibiAttention", "SUPPORTED_DTYPES",
           "SUPPORTED_HEAD_DIMS", "bwd_launch_config", "compile_bwd_for_sm90", "compile_for_sm90", "gluon_alibi_attention",
           "gluon_alibi_attention_bwd", "gluon_alibi_attention_fwd", "gluon_available", "launch_config"]

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
# Query rows per consumer warpgroup (wgmma's M is 64 per warpgroup) and consumers per CTA.
ROWS_PER_CONSUMER = 64
CONSUMERS = 2
BLOCK_M = ROWS_PER_CONSUMER * CONSUMERS
# Registers per thread: the producer's and the consumers' setmaxnreg targets, and the kernel's cap that
# splits 64K registers over 3 warpgroups (2 consumers + the producer's, padded to a warpgroup).
PRODUCER_REGS = 24
# The backward (head_dim 64 only): keys per consumer warpgroup (wgmma's M), the query tile, Q/dO ring stages.
BWD_SUPPORTED_HEAD_DIMS = (64,)
BWD_KEY_ROWS = 64
BWD_BLOCK_M = 64
BWD_STAGES = 2
BWD_CONSUMER_REGS = 240
BWD_PRODUCER_REGS = 24
CONSUMER_REGS = 240
KERNEL_MAXNREG = 168

# Gluon and its Hopper pieces are optional: without them the module still imports and says why on use.
GLUON_ERROR: Exception | None = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    for _name in ("warp_specialize", "NVMMADistributedLayout", "NVMMASharedLayout", "DotOperandLayout",
                  "allocate_shared_memory", "max_contiguous", "multiple_of"):
        if not hasattr(gl, _name):
            raise ImportError(f"triton.experimental.gluon.language has no {_name}")
    for _mod, _name in ((tma, "async_copy_global_to_shared"), (mbarrier, "expect"), (mbarrier, "arrive")):
        if not hasattr(_mod, _name):
            raise ImportError(f"{_mod.__name__} has no {_name}")
except Exception as err:  # ImportError, or an incompatible Triton failing inside its own imports
    GLUON_ERROR = err


def gluon_available() -> bool:
    """Whether this Triton has the Gluon Hopper API the kernel is written in (compiling needs nothing more)."""
    return GLUON_ERROR is None


def _require_gluon():
    if GLUON_ERROR is not None:
        try:
            import triton

            version = f"Triton {triton.__version__}"
        except ImportError:
            version = "no Triton"
        raise RuntimeError(f"the Gluon ALiBi kernel needs triton.experimental.gluon with its Hopper API "
                           f"(TMA, mbarrier, warpgroup_mma, warp_specialize); {version} here: {GLUON_ERROR}")


CONSUMER_FORMS = ("serial", "pipelined", "pingpong")


def launch_config(head_dim: int, consumer: str = "serial") -> dict:
    """Tile and pipeline constants per head_dim: key tile width, K/V ring depth. head_dim 64 takes 128-key
    tiles (S, its bias and P: 64 + 64 + 32 registers per consumer thread, O 32); head_dim 128 takes 64-key
    tiles so O (64 registers) fits beside them. The pipelined consumer holds two stages at a time (tile i's K,
    tile i-1's V), so it gets a third for the producer to fill meanwhile. ``consumer``: one of
    :data:`CONSUMER_FORMS` (see the module docstring)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the Gluon kernel supports head_dim in {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if consumer not in CONSUMER_FORMS:
        raise ValueError(f"consumer must be one of {CONSUMER_FORMS}, got {consumer!r}")
    pipeline = consumer == "pipelined"
    return dict(BLOCK_N=128 if head_dim == 64 else 64, STAGES=3 if pipeline else 2, PIPELINE=pipeline,
                PINGPONG=consumer == "pingpong")


if GLUON_ERROR is None:

    # Row reductions with Gluon combine functions (gl.max/gl.sum would call Triton's @triton.jit combiners, which
    # under TRITON_INTERPRET=1 — the CPU test session — are interpreter objects Gluon cannot compile).
    @gluon.jit
    def _max_combine(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _add_combine(a, b):
        return a + b

    @gluon.jit
    def _online_softmax(s, m_i, l_i, cols, N, MASK: gl.constexpr):
        """One tile's base-2 logits ``s`` (keys past N masked when MASK) folded into the running row max ``m_i`` and
        sum ``l_i``: returns (P, the new max, the rescale factor α of what came before, the new sum)."""
        if MASK:
            s = gl.where((cols < N)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.reduce(s, 1, _max_combine))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        return p, m_new, alpha, l_i * alpha + gl.reduce(p, 1, _add_combine)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars,
                  q_row, kv_row, q_col, k_col, v_col, N,
                  ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """One warp: both consumers' Q tiles once, then every K/V tile of the head through the ring."""
        for c in gl.static_range(2):
            mbarrier.expect(q_bars.index(c), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row + c * ROWS, q_col], q_bars.index(c), q_smem.index(c))
        n_tiles = (N + BLOCK_N - 1) // BLOCK_N
        for i in range(n_tiles):
            stage = i % STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0: the first pass over
            # the ring waits on parity 1 and goes straight through.
            mbarrier.wait(empty_bars.index(stage), ((i // STAGES) & 1) ^ 1)
            row = kv_row + i * BLOCK_N
            mbarrier.expect(k_bars.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, k_col], k_bars.index(stage), k_smem.index(stage))
            mbarrier.expect(v_bars.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, v_col], v_bars.index(stage), v_smem.index(stage))

    @gluon.jit
    def _attend_tile(i, acc, m_i, l_i, q_buf, k_smem, v_smem, k_bars, v_bars, empty_bars, turn_bars, qptr, Codes,
                     code_stride, N, qk_scale, b_scale, s_zero,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PER_HEAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                     MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr,
                     CID: gl.constexpr, PINGPONG: gl.constexpr):
        """One key tile of one consumer: S = Q Kᵀ (async) with the bias gathered meanwhile, the online-softmax
        update in base 2, O += P V; then the stage is released. PINGPONG: the consumers take turns at issuing
        QKᵀ (turn barriers), each passing the turn once its S is done, so one's softmax runs under the other's
        matmul."""
        stage = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(k_bars.index(stage), phase)
        if PINGPONG:
            # Consumer 0 goes first (parity 1 on a fresh barrier passes at once), consumer 1 after its first turn.
            mbarrier.wait(turn_bars.index(CID), (i + 1 - CID) & 1)
        s_tok = warpgroup_mma(q_buf, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        cols = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if HAS_BIAS:
            # Key-pair codes (row 2 of the codes, padded past N) against the rows' table pointers: keys 2t, 2t+1
            # read adjacent 8-byte-aligned entries, one 8-byte load per two scores.
            kp = gl.load(Codes + 2 * code_stride + cols)
            ptrs = qptr[:, None] + kp[None, :]
            bias = gl.load(gl.max_contiguous(gl.multiple_of(ptrs, [4, 8]), [1, 2]))
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        if PINGPONG:
            mbarrier.arrive(turn_bars.index(1 - CID), count=1)
        if HAS_BIAS:
            if PER_HEAD:
                s = s * qk_scale + bias * b_scale
            else:
                s = s * qk_scale + bias
        else:
            s = s * qk_scale
        p, m_new, alpha, l_i = _online_softmax(s, m_i, l_i, cols, N, MASK)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        mbarrier.wait(v_bars.index(stage), phase)
        acc = warpgroup_mma(p16, v_smem.index(stage), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty_bars.index(stage), count=1)
        return acc, m_new, l_i

    @gluon.jit
    def _pipelined_step(i, acc, m_i, l_i, p_prev, q_buf, k_smem, v_smem, k_bars, v_bars, empty_bars, qptr, Codes,
                        code_stride, N, qk_scale, b_scale, s_zero,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PER_HEAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                        MASK: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """FA3's intra-warpgroup overlap, one step: issue S_i = Q K_iᵀ, then O += P_{i-1} V_{i-1}, both async; gather
        tile i's bias; wait for S_i only (PV stays in flight) and run tile i's softmax under it; then wait for PV,
        release stage i-1, rescale O by tile i's α. Returns P_i (registers) for the next step's PV."""
        stage = i % STAGES
        prev = (i - 1) % STAGES
        mbarrier.wait(k_bars.index(stage), (i // STAGES) & 1)
        s_tok = warpgroup_mma(q_buf, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(prev), ((i - 1) // STAGES) & 1)
        acc_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
        cols = i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if HAS_BIAS:
            kp = gl.load(Codes + 2 * code_stride + cols)
            ptrs = qptr[:, None] + kp[None, :]
            bias = gl.load(gl.max_contiguous(gl.multiple_of(ptrs, [4, 8]), [1, 2]))
        s = warpgroup_mma_wait(1, deps=(s_tok, ))  # wgmma groups retire in order: S_i done, PV may still run
        if HAS_BIAS:
            if PER_HEAD:
                s = s * qk_scale + bias * b_scale
            else:
                s = s * qk_scale + bias
        else:
            s = s * qk_scale
        p, m_new, alpha, l_i = _online_softmax(s, m_i, l_i, cols, N, MASK)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))  # P_{i-1} stays live until its PV is done
        mbarrier.arrive(empty_bars.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
        return acc, m_new, l_i, p16

    @gluon.jit
    def _first_tile(q_buf, k_smem, k_bars, qptr, Codes, code_stride, N, qk_scale, b_scale, s_zero,
                    BLOCK_N: gl.constexpr, PER_HEAD: gl.constexpr, HAS_BIAS: gl.constexpr, s_layout: gl.constexpr,
                    p_layout: gl.constexpr, dtype: gl.constexpr):
        """The pipelined loop's prologue: tile 0's S, softmax and P (masked: it may be the only, partial tile)."""
        mbarrier.wait(k_bars.index(0), 0)
        s_tok = warpgroup_mma(q_buf, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if HAS_BIAS:
            kp = gl.load(Codes + 2 * code_stride + cols)
            bias = gl.load(gl.max_contiguous(gl.multiple_of(qptr[:, None] + kp[None, :], [4, 8]), [1, 2]))
        s = warpgroup_mma_wait(0, deps=(s_tok, ))
        if HAS_BIAS:
            if PER_HEAD:
                s = s * qk_scale + bias * b_scale
            else:
                s = s * qk_scale + bias
        else:
            s = s * qk_scale
        s = gl.where((cols < N)[None, :], s, float("-inf"))
        m_i = gl.reduce(s, 1, _max_combine)
        p = gl.exp2(s - m_i[:, None])
        l_i = gl.reduce(p, 1, _add_combine)
        return m_i, l_i, gl.convert_layout(p.to(dtype), p_layout)

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, O, LSE, Codes, Tbl, Slopes,
                  off_b, off_h, off_m, N, H, code_stride, stride_ob, stride_oh, stride_on, qk_scale, bias_scale,
                  CID: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                  STAGES: gl.constexpr, PER_HEAD: gl.constexpr, HAS_BIAS: gl.constexpr, PIPELINE: gl.constexpr,
                  PINGPONG: gl.constexpr):
        """One warpgroup: query rows off_m + CID·ROWS .. + ROWS against every key tile, then O and the logsumexp."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows = off_m + CID * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        qptr = Tbl
        if HAS_BIAS:
            qptr = Tbl + 2 * gl.load(Codes + rows)  # query codes, row 0 (padded past N)
        b_scale = bias_scale
        if PER_HEAD:
            b_scale = gl.load(Slopes + off_h) * bias_scale
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
        q_buf = q_smem.index(CID)
        mbarrier.wait(q_bars.index(CID), 0)
        n_full = N // BLOCK_N
        if PIPELINE:
            # Tile 0 in a prologue, then each step overlaps tile i's softmax with tile i-1's PV; the last PV after.
            m_i, l_i, p16 = _first_tile(q_buf, k_smem, k_bars, qptr, Codes, code_stride, N, qk_scale, b_scale, s_zero,
                                        BLOCK_N, PER_HEAD, HAS_BIAS, s_layout, p_layout, k_smem.dtype)
            n_tiles = (N + BLOCK_N - 1) // BLOCK_N
            for i in range(1, n_full):
                acc, m_i, l_i, p16 = _pipelined_step(i, acc, m_i, l_i, p16, q_buf, k_smem, v_smem, k_bars, v_bars,
                                                     empty_bars, qptr, Codes, code_stride, N, qk_scale, b_scale, s_zero,
                                                     BLOCK_N, STAGES, PER_HEAD, HAS_BIAS, False, s_layout, o_layout,
                                                     p_layout)
            if n_full * BLOCK_N < N:
                if n_full > 0:
                    acc, m_i, l_i, p16 = _pipelined_step(n_full, acc, m_i, l_i, p16, q_buf, k_smem, v_smem, k_bars,
                                                         v_bars, empty_bars, qptr, Codes, code_stride, N, qk_scale,
                                                         b_scale, s_zero, BLOCK_N, STAGES, PER_HEAD, HAS_BIAS, True,
                                                         s_layout, o_layout, p_layout)
            last = n_tiles - 1
            mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
            acc = warpgroup_mma(p16, v_smem.index(last % STAGES), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(empty_bars.index(last % STAGES), count=1)
        else:
            for i in range(n_full):
                acc, m_i, l_i = _attend_tile(i, acc, m_i, l_i, q_buf, k_smem, v_smem, k_bars, v_bars, empty_bars,
                                             turn_bars, qptr, Codes, code_stride, N, qk_scale, b_scale, s_zero, BLOCK_N,
                                             STAGES, PER_HEAD, HAS_BIAS, False, s_layout, o_layout, p_layout, CID,
                                             PINGPONG)
            if n_full * BLOCK_N < N:
                acc, m_i, l_i = _attend_tile(n_full, acc, m_i, l_i, q_buf, k_smem, v_smem, k_bars, v_bars, empty_bars,
                                             turn_bars, qptr, Codes, code_stride, N, qk_scale, b_scale, s_zero, BLOCK_N,
                                             STAGES, PER_HEAD, HAS_BIAS, True, s_layout, o_layout, p_layout, CID,
                                             PINGPONG)
        # Epilogue: O = acc / l in (B, N, heads, D) order and the base-2 logsumexp, both masked at N.
        o_rows = off_m + CID * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
        o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        inv_l = gl.convert_layout(1.0 / l_i, gl.SliceLayout(1, o_layout))
        out = (acc * inv_l[:, None]).to(O.dtype.element_ty)
        o_base = O + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
        o_mask = (o_rows < N)[:, None] & (o_cols < HEAD_DIM)[None, :]
        gl.store(o_base + o_rows[:, None] * stride_on + o_cols[None, :], out, mask=o_mask)
        lse = m_i + gl.log2(l_i)
        gl.store(LSE + (off_b.to(gl.int64) * H + off_h) * N + rows, lse, mask=rows < N)

    @gluon.jit
    def _gluon_alibi_fwd_kernel(q_desc, k_desc, v_desc, O, LSE, Slopes, Codes, Tbl,
                                N, H, code_stride, q_head_cols, k_head_cols, v_head_cols,
                                stride_ob, stride_oh, stride_on, qk_scale, bias_scale,
                                HEAD_DIM: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                                STAGES: gl.constexpr, PER_HEAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                                PIPELINE: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                PRODUCER_REGS: gl.constexpr):
        pid_m = gl.program_id(0)
        off_h = gl.program_id(1)
        off_b = gl.program_id(2)
        off_m = pid_m * (2 * ROWS)
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, ROWS, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(q_bars.index(c), count=1)
            mbarrier.init(turn_bars.index(c), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(s), count=1)
            mbarrier.init(v_bars.index(s), count=1)
            mbarrier.init(empty_bars.index(s), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()
        # Token rows of this image in the 2-D (B·N, row stride) views; the head's columns start at h·stride(1).
        q_row = off_b * N + off_m
        kv_row = off_b * N
        # (Spelt out per partition: a tuple built with + would unwrap the constexprs.)
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, O, LSE, Codes, Tbl,
                         Slopes, off_b, off_h, off_m, N, H, code_stride, stride_ob, stride_oh, stride_on, qk_scale,
                         bias_scale, gl.constexpr(0), ROWS, BLOCK_N, HEAD_DIM, STAGES, PER_HEAD, HAS_BIAS, PIPELINE,
                         PINGPONG)),
            (_consumer, (q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars, turn_bars, O, LSE, Codes, Tbl,
                         Slopes, off_b, off_h, off_m, N, H, code_stride, stride_ob, stride_oh, stride_on, qk_scale,
                         bias_scale, gl.constexpr(1), ROWS, BLOCK_N, HEAD_DIM, STAGES, PER_HEAD, HAS_BIAS, PIPELINE,
                         PINGPONG)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bars, k_bars, v_bars, empty_bars,
                         q_row, kv_row, off_h * q_head_cols, off_h * k_head_cols, off_h * v_head_cols, N,
                         ROWS, BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


    # ----------------------------------------------------------------------------------------
    # Backward: dK/dV per key tile (FA3's structure), dQ by fp32 atomic adds
    # ----------------------------------------------------------------------------------------

    @gluon.jit
    def _bwd_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bars, q_bars, do_bars,
                      empty_bars, q_row, kv_row, q_col, do_col, k_col, v_col, N,
                      KROWS: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
        """One warp: each consumer's K and V rows once (one barrier per consumer), then every query tile's Q and
        dO through the ring (separate ready barriers, so Sᵀ = K Qᵀ starts before dO has landed)."""
        for c in gl.static_range(2):
            mbarrier.expect(kv_bars.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [kv_row + c * KROWS, k_col], kv_bars.index(c), k_smem.index(c))
            tma.async_copy_global_to_shared(v_desc, [kv_row + c * KROWS, v_col], kv_bars.index(c), v_smem.index(c))
        n_tiles = (N + BLOCK_M - 1) // BLOCK_M
        for i in range(n_tiles):
            stage = i % STAGES
            mbarrier.wait(empty_bars.index(stage), ((i // STAGES) & 1) ^ 1)  # first pass: parity 1 passes at once
            row = q_row + i * BLOCK_M
            mbarrier.expect(q_bars.index(stage), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row, q_col], q_bars.index(stage), q_smem.index(stage))
            mbarrier.expect(do_bars.index(stage), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [row, do_col], do_bars.index(stage), do_smem.index(stage))

    @gluon.jit
    def _bwd_query_tile(i, dk, dv, dsl, keys, kptr, k_buf, v_buf, ds_buf, q_smem, do_smem, q_bars, do_bars,
                        empty_bars, DQ, LSE, Delta, Codes, stat_row, code_stride, dq_base, stride_qn, N,
                        qk_scale, b_scale, s_zero, g_zero,
                        BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                        PER_HEAD: gl.constexpr, HAS_BIAS: gl.constexpr, COMPUTE_DSLOPE: gl.constexpr,
                        ATOMIC_DQ: gl.constexpr, MASK: gl.constexpr, st_layout: gl.constexpr,
                        g_layout: gl.constexpr, p_layout: gl.constexpr):
        """One query tile against one consumer's 64 keys, all transposed (keys are the wgmma's M):
        Sᵀ = K Qᵀ (async; lse, Δ and the bias gathered meanwhile), Pᵀ = exp2(Sᵀ·scale + bias − lse);
        dPᵀ = V dOᵀ and dV += Pᵀ dO (both async, Pᵀ from registers); dSᵀ = Pᵀ ∘ (dPᵀ − Δ) to shared memory;
        dK += dSᵀ Q and dQ_tile = dS K (both from shared memory), dQ added into the fp32 buffer; release."""
        stage = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(q_bars.index(stage), phase)
        q_tile = q_smem.index(stage)
        do_tile = do_smem.index(stage)
        st_tok = warpgroup_mma(k_buf, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        # Padded rows (lse = +inf, Δ = 0 past N: the rows' probabilities are exactly 0), loaded without masks.
        lse = gl.load(LSE + stat_row + cols)
        if HAS_BIAS:
            # Query-pair codes (row 3) against the keys' pointers Tbl + 2·(−b_j): queries 2t, 2t+1 read adjacent,
            # 8-byte aligned entries of the query-pair half of the table, one 8-byte load per two scores.
            qp = gl.load(Codes + 3 * code_stride + cols)
            bias = gl.load(gl.max_contiguous(gl.multiple_of(kptr[:, None] + qp[None, :], [4, 8]), [1, 2]))
        st = warpgroup_mma_wait(0, deps=(st_tok, ))
        if HAS_BIAS:
            if PER_HEAD:  # the bias term and lse first: two FFMAs per score
                pt = gl.exp2(st * qk_scale + (bias * b_scale - lse[None, :]))
            else:
                pt = gl.exp2(st * qk_scale + (bias - lse[None, :]))
        else:
            pt = gl.exp2(st * qk_scale - lse[None, :])
        if MASK:
            # Keys past N hold the next image's rows (or the TMA's zeros): their p can be anything, and dQ sums
            # over keys. (Queries past N need nothing: lse = +inf gives p = 0.)
            pt = gl.where((keys < N)[:, None], pt, 0.0)
        mbarrier.wait(do_bars.index(stage), phase)
        dpt_tok = warpgroup_mma(v_buf, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        p16 = gl.convert_layout(pt.to(do_tile.dtype), p_layout)
        dv = warpgroup_mma(p16, do_tile, dv, is_async=True)
        # Δ only now: loaded beside the table gather (during Sᵀ), it pushed the consumers over 240 registers.
        delta = gl.load(Delta + stat_row + cols)
        if COMPUTE_DSLOPE:  # (fewer registers: Pᵀ's 16-bit copy is free before dSᵀ and the slope products)
            dpt, dv, p16 = warpgroup_mma_wait(0, deps=(dpt_tok, dv, p16))
        else:
            dpt = warpgroup_mma_wait(1, deps=(dpt_tok, ))  # groups retire in order: dPᵀ done, dV may still run
        dst = pt * (dpt - delta[None, :])
        if COMPUTE_DSLOPE and HAS_BIAS:
            # Σ_i dS_ij·B_ij per key (the unscaled table: B itself; summed over keys on the host). B is gathered
            # again (L1-resident) rather than kept live across dPᵀ: that spilled at 240 registers.
            qp = gl.load(Codes + 3 * code_stride + cols)
            b_again = gl.load(gl.max_contiguous(gl.multiple_of(kptr[:, None] + qp[None, :], [4, 8]), [1, 2]))
            dsl = dsl + gl.reduce(dst * b_again, 1, _add_combine)
        ds_buf.store(dst.to(do_tile.dtype))
        fence_async_shared()
        dk = warpgroup_mma(ds_buf, q_tile, dk, is_async=True)
        if ATOMIC_DQ:
            dq = warpgroup_mma(ds_buf.permute((1, 0)), k_buf, g_zero, use_acc=False, is_async=True)
            dv, dk, dq, p16 = warpgroup_mma_wait(0, deps=(dv, dk, dq, p16))
            mbarrier.arrive(empty_bars.index(stage), count=1)
            q_rows = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, g_layout))
            d_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
            gl.atomic_add(dq_base + q_rows[:, None] * stride_qn + d_cols[None, :], dq,
                          mask=(q_rows < N)[:, None] & (d_cols < HEAD_DIM)[None, :], sem="relaxed")
        else:
            dv, dk, p16 = warpgroup_mma_wait(0, deps=(dv, dk, p16))
            mbarrier.arrive(empty_bars.index(stage), count=1)
        return dk, dv, dsl

    @gluon.jit
    def _bwd_loop(dk, dv, dsl, keys, kptr, k_buf, v_buf, ds_buf, q_smem, do_smem, q_bars, do_bars, empty_bars, DQ,
                  LSE, Delta, Codes, stat_row, code_stride, dq_base, stride_qn, N, qk_scale, b_scale, s_zero, g_zero,
                  BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PER_HEAD: gl.constexpr,
                  HAS_BIAS: gl.constexpr, COMPUTE_DSLOPE: gl.constexpr, ATOMIC_DQ: gl.constexpr, MASK: gl.constexpr,
                  st_layout: gl.constexpr, g_layout: gl.constexpr, p_layout: gl.constexpr):
        n_tiles = (N + BLOCK_M - 1) // BLOCK_M
        for i in range(n_tiles):
            dk, dv, dsl = _bwd_query_tile(i, dk, dv, dsl, keys, kptr, k_buf, v_buf, ds_buf, q_smem, do_smem, q_bars,
                                          do_bars, empty_bars, DQ, LSE, Delta, Codes, stat_row, code_stride, dq_base,
                                          stride_qn, N, qk_scale, b_scale, s_zero, g_zero, BLOCK_M, HEAD_DIM, STAGES,
                                          PER_HEAD, HAS_BIAS, COMPUTE_DSLOPE, ATOMIC_DQ, MASK, st_layout, g_layout,
                                          p_layout)
        return dk, dv, dsl

    @gluon.jit
    def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bars, q_bars, do_bars, empty_bars,
                      DK, DV, DQ, DSL, LSE, Delta, Codes, Tbl, Slopes, N, H, code_stride,
                      stat_stride, stride_gb, stride_gh, stride_gn, stride_qb, stride_qh, stride_qn,
                      qk_scale, sm_scale, bias_scale, bias_norm,
                      CID: gl.constexpr, KROWS: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                      STAGES: gl.constexpr, PER_HEAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                      COMPUTE_DSLOPE: gl.constexpr, ATOMIC_DQ: gl.constexpr):
        """One warpgroup: keys off_n + CID·KROWS .. + KROWS against every query tile, then dK, dV (and the slope
        partials) of its keys."""
        # The CTA's coordinates, read here rather than captured from the kernel's prologue.
        off_n = gl.program_id(0) * (2 * KROWS)
        off_h = gl.program_id(1)
        off_b = gl.program_id(2)
        st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, BLOCK_M, 16])
        g_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=g_layout, k_width=2)
        keys = off_n + CID * KROWS + gl.arange(0, KROWS, layout=gl.SliceLayout(1, st_layout))
        kptr = Tbl
        if HAS_BIAS:
            kptr = Tbl + 2 * gl.load(Codes + code_stride + keys)  # negated key codes, row 1 (padded past N)
        b_scale = bias_scale
        if PER_HEAD:
            b_scale = gl.load(Slopes + off_h) * bias_scale
        stat_row = (off_b * H + off_h) * stat_stride
        dq_base = DQ + off_b.to(gl.int64) * stride_qb + off_h.to(gl.int64) * stride_qh
        dk = gl.zeros([KROWS, HEAD_DIM], gl.float32, layout=g_layout)
        dv = gl.zeros([KROWS, HEAD_DIM], gl.float32, layout=g_layout)
        dsl = gl.zeros([KROWS], gl.float32, layout=gl.SliceLayout(1, st_layout))
        s_zero = gl.zeros([KROWS, BLOCK_M], gl.float32, layout=st_layout)
        g_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=g_layout)
        k_buf = k_smem.index(CID)
        v_buf = v_smem.index(CID)
        ds_buf = ds_smem.index(CID)
        mbarrier.wait(kv_bars.index(CID), 0)
        # Only a consumer whose keys cross N masks its probabilities (two copies of the loop).
        if off_n + (CID + 1) * KROWS > N:
            dk, dv, dsl = _bwd_loop(dk, dv, dsl, keys, kptr, k_buf, v_buf, ds_buf, q_smem, do_smem, q_bars, do_bars,
                                    empty_bars, DQ, LSE, Delta, Codes, stat_row, code_stride, dq_base, stride_qn, N,
                                    qk_scale, b_scale, s_zero, g_zero, BLOCK_M, HEAD_DIM, STAGES, PER_HEAD, HAS_BIAS,
                                    COMPUTE_DSLOPE, ATOMIC_DQ, True, st_layout, g_layout, p_layout)
        else:
            dk, dv, dsl = _bwd_loop(dk, dv, dsl, keys, kptr, k_buf, v_buf, ds_buf, q_smem, do_smem, q_bars, do_bars,
                                    empty_bars, DQ, LSE, Delta, Codes, stat_row, code_stride, dq_base, stride_qn, N,
                                    qk_scale, b_scale, s_zero, g_zero, BLOCK_M, HEAD_DIM, STAGES, PER_HEAD, HAS_BIAS,
                                    COMPUTE_DSLOPE, ATOMIC_DQ, False, st_layout, g_layout, p_layout)
        # Epilogue: dK·(1/√D) and dV in (B, N, heads, D) order, masked at N; the slope partials per key.
        g_rows = off_n + CID * KROWS + gl.arange(0, KROWS, layout=gl.SliceLayout(1, g_layout))
        g_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
        g_off = (off_b.to(gl.int64) * stride_gb + off_h.to(gl.int64) * stride_gh + g_rows[:, None] * stride_gn
                 + g_cols[None, :])
        g_mask = (g_rows < N)[:, None] & (g_cols < HEAD_DIM)[None, :]
        gl.store(DK + g_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=g_mask)
        gl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=g_mask)
        if COMPUTE_DSLOPE:
            gl.store(DSL + (off_b.to(gl.int64) * H + off_h) * N + keys, dsl * bias_norm, mask=keys < N)

    @gluon.jit
    def _gluon_alibi_bwd_kernel(q_desc, k_desc, v_desc, do_desc, DK, DV, DQ, DSL, LSE, Delta, Slopes, Codes, Tbl,
                                N, H, code_stride, stat_stride, q_head_cols, k_head_cols, v_head_cols, do_head_cols,
                                stride_gb, stride_gh, stride_gn, stride_qb, stride_qh, stride_qn,
                                qk_scale, sm_scale, bias_scale, bias_norm,
                                HEAD_DIM: gl.constexpr, KROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                                STAGES: gl.constexpr, PER_HEAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                                COMPUTE_DSLOPE: gl.constexpr, ATOMIC_DQ: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        pid_n = gl.program_id(0)
        off_h = gl.program_id(1)
        off_b = gl.program_id(2)
        off_n = pid_n * (2 * KROWS)
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [2, KROWS, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, KROWS, HEAD_DIM], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([KROWS, BLOCK_M], dtype)
        ds_smem = gl.allocate_shared_memory(dtype, [2, KROWS, BLOCK_M], ds_layout)
        kv_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(kv_bars.index(c), count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(q_bars.index(s), count=1)
            mbarrier.init(do_bars.index(s), count=1)
            mbarrier.init(empty_bars.index(s), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()
        q_row = off_b * N
        kv_row = off_b * N + off_n
        gl.warp_specialize([
            (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bars, q_bars, do_bars, empty_bars, DK, DV,
                             DQ, DSL, LSE, Delta, Codes, Tbl, Slopes, N, H, code_stride,
                             stat_stride, stride_gb, stride_gh, stride_gn, stride_qb, stride_qh, stride_qn, qk_scale,
                             sm_scale, bias_scale, bias_norm, gl.constexpr(0), KROWS, BLOCK_M, HEAD_DIM, STAGES,
                             PER_HEAD, HAS_BIAS, COMPUTE_DSLOPE, ATOMIC_DQ)),
            (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, ds_smem, kv_bars, q_bars, do_bars, empty_bars, DK, DV,
                             DQ, DSL, LSE, Delta, Codes, Tbl, Slopes, N, H, code_stride,
                             stat_stride, stride_gb, stride_gh, stride_gn, stride_qb, stride_qh, stride_qn, qk_scale,
                             sm_scale, bias_scale, bias_norm, gl.constexpr(1), KROWS, BLOCK_M, HEAD_DIM, STAGES,
                             PER_HEAD, HAS_BIAS, COMPUTE_DSLOPE, ATOMIC_DQ)),
            (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bars, q_bars,
                             do_bars, empty_bars, q_row, kv_row, off_h * q_head_cols, off_h * do_head_cols,
                             off_h * k_head_cols, off_h * v_head_cols, N, KROWS, BLOCK_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------

def _gl_dtype(dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _row_view(t):
    """(2-D view of ``t`` as token rows (B·N, stride(2)), the column stride per head), copying ``t`` into
    (B, N, heads, D) order when its strides do not allow the view or TMA's 16-byte alignment."""
    bsz, heads, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    elem = t.element_size()
    ok = (sd == 1 and (sb == n * sn or bsz == 1) and sh >= 0 and (heads - 1) * sh + d <= sn
          and (sn * elem) % 16 == 0 and t.data_ptr() % 16 == 0)
    if not ok:
        t = t.transpose(1, 2).contiguous().transpose(1, 2)
        sb, sh, sn, sd = t.stride()
    # Columns up to the last head's end: a tile at h·stride(1) never reaches past the row (or the storage).
    rows = torch.as_strided(t, (bsz * n, (heads - 1) * sh + d), (sn, 1))
    return rows, sh


def _descriptor(rows, block_rows, head_dim):
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, head_dim], _gl_dtype(rows.dtype))
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_rows, head_dim], layout)


@functools.lru_cache(maxsize=64)
def _log2e_scaled(pair_tbl):
    # Keyed by the tensor object: device_bias_lookup returns the same cached table for the same grid and options.
    return pair_tbl * LOG2E


def _kernel_args(q, k, v, o, lse, slopes, geometry, has_bias=True, consumer="serial"):
    """(positional args, constexpr kwargs) of one launch; the SASS benchmark and the tests use it too."""
    bsz, heads, n, d = q.shape
    codes, _, bias_norm, pair_tbl = geometry
    cfg = launch_config(d, consumer)
    per_head = slopes is not None
    if per_head:
        tbl, slope_arg = pair_tbl, slopes.to(torch.float32).contiguous()
    else:  # constant slope 1 (the paper's model): the pair table pre-scaled by log2(e), once per cached table
        tbl, slope_arg = _log2e_scaled(pair_tbl), pair_tbl  # Slopes is never read
    (q_rows, q_cols), (k_rows, k_cols), (v_rows, v_cols) = (_row_view(t) for t in (q, k, v))
    args = (_descriptor(q_rows, ROWS_PER_CONSUMER, d), _descriptor(k_rows, cfg["BLOCK_N"], d),
            _descriptor(v_rows, cfg["BLOCK_N"], d), o, lse, slope_arg, codes, tbl,
            n, heads, codes.stride(0), q_cols, k_cols, v_cols, o.stride(0), o.stride(1), o.stride(2),
            LOG2E / math.sqrt(d), LOG2E * bias_norm)
    kw = dict(HEAD_DIM=d, ROWS=ROWS_PER_CONSUMER, BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], PER_HEAD=per_head,
              HAS_BIAS=has_bias, PIPELINE=cfg["PIPELINE"], PINGPONG=cfg["PINGPONG"], CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=KERNEL_MAXNREG)
    return args, kw


def _new_outputs(q):
    bsz, heads, n, d = q.shape
    o = q.new_empty((bsz, n, heads, d)).transpose(1, 2)  # (B, N, heads, D) memory order, like alibi_triton
    lse = q.new_empty((bsz, heads, n), dtype=torch.float32)
    return o, lse


def _validate(q, k, v, grid_size, num_prefix_tokens, slopes):
    (h, w), prefix = check_attention_inputs(q, k, v, grid_size, num_prefix_tokens, slopes)
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"the Gluon kernel supports bfloat16 and float16 inputs, got {q.dtype}")
    bsz, heads, n, d = q.shape
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the Gluon kernel supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}")
    if q.device.type != "cuda":
        raise ValueError(f"the Gluon kernel needs CUDA tensors on a Hopper GPU, got {q.device}")
    major = torch.cuda.get_device_capability(q.device)[0]
    if major != 9:
        raise ValueError(f"the Gluon kernel is written for Hopper (sm_90a: TMA, wgmma, setmaxnreg); "
                         f"{torch.cuda.get_device_name(q.device)} has compute capability {major}.x")
    if bsz > 65535 or heads > 65535:
        raise ValueError(f"batch and heads must each be at most 65535, got {bsz} and {heads}")
    if bsz * n >= 2**31 or (n - 1) * heads * d + d >= 2**31:
        raise ValueError("too many tokens for the Gluon kernel's int32 row coordinates and offsets")
    return h, w, prefix


def gluon_alibi_attention_fwd(q, k, v, grid_size, num_prefix_tokens, slopes=None, wrap=True, normalize=True,
                              metric="euclidean", *, has_bias=True, consumer="serial"):
    """Forward of ``softmax(q kᵀ/√D + m_h·B) v`` with the 2D ALiBi bias ``B`` (docs/method.md §2) on Hopper.

    Args as :func:`kernels.alibi_triton.triton_alibi_attention` (``slopes=None``: slope 1 on every head),
    but bf16/fp16 only, head_dim 64 or 128, a CUDA device of compute capability 9.x, and no autograd.

    Returns ``(O, lse)``: O of shape (B, heads, N, D) in q's dtype, stored in (B, N, heads, D) memory order,
    and the base-2 logsumexp of each row's logits ``(q·k/√D + m_h·B)·log2(e)``, fp32 (B, heads, N) — the
    same pair as ``kernels.alibi_triton.alibi_attention_fwd``. ``has_bias=False`` compiles the bias out (the
    benchmarks' like-for-like bias-free baseline: same tiles and pipeline, plain softmax attention).
    ``consumer``: ``"serial"`` (the default), ``"pipelined"`` (FA3's intra-warpgroup overlap: tile i's softmax
    under tile i-1's PV wgmma, three K/V stages) or ``"pingpong"`` (the consumers take turns at QKᵀ): the
    latter two experimental, for the GPU A/B.
    """
    _require_gluon()
    check_metric(metric)
    h, w, prefix = _validate(q, k, v, grid_size, num_prefix_tokens, slopes)
    bsz, heads, n, d = q.shape
    geometry = device_bias_lookup(h, w, prefix, bool(wrap), bool(normalize), True, q.device, metric)
    o, lse = _new_outputs(q)
    args, kw = _kernel_args(q, k, v, o, lse, None if slopes is None else slopes.detach(), geometry,
                            has_bias=bool(has_bias), consumer=consumer)
    grid = (-(-n // BLOCK_M), heads, bsz)
    with torch.cuda.device(q.device):
        _gluon_alibi_fwd_kernel[grid](*args, **kw)
    return o, lse


# --------------------------------------------------------------------------------------------
# Host side: backward
# --------------------------------------------------------------------------------------------

def bwd_launch_config(head_dim: int) -> dict:
    """The backward's tiles: 64 keys per consumer warpgroup (wgmma's M), 128 per CTA, 64-row query tiles, two
    Q/dO stages. head_dim 64 only: per consumer thread Sᵀ and dPᵀ (32 fp32 registers each), Pᵀ, the bias, and
    the dK, dV and dQ accumulators (32 each) fit under 240 registers; at 128 the three accumulators alone are 192."""
    if head_dim not in BWD_SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the Gluon backward supports head_dim in {BWD_SUPPORTED_HEAD_DIMS}, got {head_dim}")
    return dict(KROWS=BWD_KEY_ROWS, BLOCK_M=BWD_BLOCK_M, STAGES=BWD_STAGES)


def _bwd_kernel_args(q, k, v, do, dk, dv, dq_acc, dsl, lse_pad, delta, slopes, geometry, stat_stride, *,
                     has_bias=True, compute_dslope=False, need_dq=True):
    """(positional args, constexpr kwargs) of one backward launch; the SASS benchmark and the tests use it too.
    ``lse_pad``/``delta``: (B, heads, stat_stride) fp32 rows, +inf / 0 past N. ``dk``, ``dv`` (input dtype) and
    ``dq_acc`` (fp32, zeroed) in (B, N, heads, D) memory order; ``dsl``: (B, heads, N) fp32 (learned slopes)."""
    _, heads, n, d = q.shape
    codes, _, bias_norm, pair_tbl = geometry
    cfg = bwd_launch_config(d)
    per_head = slopes is not None
    if compute_dslope and not per_head:
        raise ValueError("the slope gradient needs the slopes (per-head path)")
    if per_head:
        tbl, slope_arg = pair_tbl, slopes.to(torch.float32).contiguous()
    else:
        tbl, slope_arg = _log2e_scaled(pair_tbl), pair_tbl
    assert dk.stride() == dv.stride() and dk.stride(3) == 1 and dq_acc.stride(3) == 1
    (q_rows, q_cols), (k_rows, k_cols), (v_rows, v_cols), (do_rows, do_cols) = (_row_view(t) for t in (q, k, v, do))
    args = (_descriptor(q_rows, cfg["BLOCK_M"], d), _descriptor(k_rows, cfg["KROWS"], d),
            _descriptor(v_rows, cfg["KROWS"], d), _descriptor(do_rows, cfg["BLOCK_M"], d),
            dk, dv, dq_acc, dsl, lse_pad, delta, slope_arg, codes, tbl,
            n, heads, codes.stride(0), stat_stride, q_cols, k_cols, v_cols, do_cols,
            dk.stride(0), dk.stride(1), dk.stride(2), dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2),
            LOG2E / math.sqrt(d), 1.0 / math.sqrt(d), LOG2E * bias_norm, bias_norm)
    kw = dict(HEAD_DIM=d, KROWS=cfg["KROWS"], BLOCK_M=cfg["BLOCK_M"], STAGES=cfg["STAGES"], PER_HEAD=per_head,
              HAS_BIAS=has_bias, COMPUTE_DSLOPE=bool(compute_dslope), ATOMIC_DQ=bool(need_dq),
              CONSUMER_REGS=BWD_CONSUMER_REGS, PRODUCER_REGS=BWD_PRODUCER_REGS, num_warps=4, maxnreg=KERNEL_MAXNREG)
    return args, kw


def _stat_stride(n):
    return -(-n // CODE_PAD) * CODE_PAD


def gluon_alibi_attention_bwd(do, q, k, v, o, lse, grid_size, num_prefix_tokens, slopes=None, wrap=True,
                              normalize=True, metric="euclidean", *, need_dslopes=False, need_dq=True, has_bias=True):
    """Backward of :func:`gluon_alibi_attention_fwd`: returns ``(dq, dk, dv, dslopes)``.

    ``do``: the gradient of O (B, heads, N, D), any strides; ``o``, ``lse``: what the forward returned (``lse``
    the base-2 logsumexp, fp32 (B, heads, N)). Same conventions and limits as the forward, head_dim 64 only.
    dq, dk, dv come back in q's dtype, in (B, N, heads, D) memory order; dQ is summed in an fp32 buffer by
    atomic adds (its last bits vary from run to run; dK, dV and dslopes do not). ``need_dslopes`` (learned
    slopes; needs ``slopes``): ``dslopes = Σ_ij dS_ij·B_ij`` per head, fp32 (heads,); otherwise None.
    ``need_dq=False`` skips dQ (returns None for it). ``has_bias=False``: the bias-free baseline.
    Δ = rowsum(dO∘O) and the padded copy of lse come from :mod:`kernels.alibi_triton`'s preprocess kernel."""
    _require_gluon()
    check_metric(metric)
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        bwd_launch_config(q.shape[-1])  # head_dim 64 only, said before anything else
    h, w, prefix = _validate(q, k, v, grid_size, num_prefix_tokens, slopes)
    bsz, heads, n, d = q.shape
    if not isinstance(do, torch.Tensor) or do.shape != q.shape or do.dtype != q.dtype or do.device != q.device:
        raise ValueError(f"do must be a tensor of q's shape {tuple(q.shape)}, dtype and device")
    if not isinstance(o, torch.Tensor) or o.shape != q.shape or o.dtype != q.dtype or o.device != q.device:
        raise ValueError(f"o must be the forward's output, of q's shape {tuple(q.shape)}, dtype and device")
    if (not isinstance(lse, torch.Tensor) or lse.shape != (bsz, heads, n) or lse.dtype != torch.float32
            or not lse.is_contiguous()):
        raise ValueError(f"lse must be the forward's contiguous fp32 logsumexp of shape {(bsz, heads, n)}")
    if need_dslopes and slopes is None:
        raise ValueError("need_dslopes needs the slopes (a tensor of shape (heads,))")
    from .alibi_triton import _LAUNCH_OPTIONS, _PREPROCESS_BLOCK_M, _bwd_preprocess_kernel, _strides

    geometry = device_bias_lookup(h, w, prefix, bool(wrap), bool(normalize), True, q.device, metric)
    stride = _stat_stride(n)
    lse_pad, delta = q.new_empty((2, bsz, heads, stride), dtype=torch.float32).unbind(0)
    dk = q.new_empty((bsz, n, heads, d)).transpose(1, 2)
    dv = q.new_empty((bsz, n, heads, d)).transpose(1, 2)
    dq_acc = (q.new_zeros((bsz, n, heads, d), dtype=torch.float32).transpose(1, 2) if need_dq else
              q.new_empty((1, 1, 1, d), dtype=torch.float32))
    dsl = q.new_empty((bsz, heads, n), dtype=torch.float32) if need_dslopes else delta
    args, kw = _bwd_kernel_args(q, k, v, do, dk, dv, dq_acc, dsl, lse_pad, delta,
                                None if slopes is None else slopes.detach(), geometry, stride, has_bias=bool(has_bias),
                                compute_dslope=need_dslopes, need_dq=need_dq)
    with torch.cuda.device(q.device):
        _bwd_preprocess_kernel[(stride // _PREPROCESS_BLOCK_M, heads, bsz)](
            o, do, lse, lse_pad, delta, *_strides(o), *_strides(do), heads, n, stride, HEAD_DIM=d,
            BLOCK_M=_PREPROCESS_BLOCK_M, **_LAUNCH_OPTIONS)
        _gluon_alibi_bwd_kernel[(-(-n // (2 * BWD_KEY_ROWS)), heads, bsz)](*args, **kw)
    dq = (dq_acc * (1.0 / math.sqrt(d))).to(q.dtype) if need_dq else None
    dslopes = dsl.sum(dim=(0, 2)) if need_dslopes else None
    return dq, dk, dv, dslopes


class GluonAlibiAttention(torch.autograd.Function):
    """Autograd over the Gluon forward and backward (experimental; registered as no backend). Apply as
    ``GluonAlibiAttention.apply(q, k, v, grid_size, num_prefix_tokens, slopes, wrap, normalize, metric, has_bias)``,
    or through :func:`gluon_alibi_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, grid_size, num_prefix_tokens, slopes=None, wrap=True, normalize=True,
                metric="euclidean", has_bias=True):
        o, lse = gluon_alibi_attention_fwd(q, k, v, grid_size, num_prefix_tokens, slopes, wrap, normalize, metric,
                                           has_bias=has_bias)
        ctx.save_for_backward(q, k, v, o, lse, slopes)
        ctx.opts = (grid_size, num_prefix_tokens, wrap, normalize, metric, has_bias)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, slopes = ctx.saved_tensors
        grid_size, prefix, wrap, normalize, metric, has_bias = ctx.opts
        need_dslopes = slopes is not None and ctx.needs_input_grad[5]
        dq, dk, dv, dslopes = gluon_alibi_attention_bwd(
            do.to(q.dtype), q, k, v, o, lse, grid_size, prefix, slopes, wrap, normalize, metric,
            need_dslopes=need_dslopes and has_bias, need_dq=ctx.needs_input_grad[0], has_bias=has_bias)
        if need_dslopes:
            dslopes = torch.zeros_like(slopes) if dslopes is None else dslopes.to(slopes.dtype)
        return dq, dk, dv, None, None, dslopes, None, None, None, None


def gluon_alibi_attention(q, k, v, grid_size, num_prefix_tokens, slopes=None, wrap=True, normalize=True,
                          metric="euclidean", *, has_bias=True):
    """O = softmax(q kᵀ/√D + m_h·B) v on Hopper with the Gluon forward and backward, differentiable in q, k, v
    (and ``slopes``, when they require a gradient). ``has_bias=False``: the bias-free build of both (a benchmark
    baseline). Experimental: nothing in the project selects it."""
    _require_gluon()
    return GluonAlibiAttention.apply(q, k, v, grid_size, num_prefix_tokens, slopes, wrap, normalize, metric,
                                     has_bias)


def compile_for_sm90(head_dim=64, dtype=torch.bfloat16, *, per_head=False, has_bias=True, consumer="serial",
                     grid=(37, 37), prefix=5, heads=None, stages=None, block_n=None):
    """Compile the kernel for sm_90a as a launch on a (1, heads, N, head_dim) fused-qkv view would, without a GPU
    (CPU tensors stand in; nothing is launched). Returns Triton's compiled kernel (``.asm["cubin"]``,
    ``.asm["ptx"]``, ``.metadata``) and the constexpr kwargs it was compiled with."""
    _require_gluon()
    heads = heads or 768 // head_dim
    n = prefix + grid[0] * grid[1]
    qkv = torch.empty(1, n, 3, heads, head_dim, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    o, lse = _new_outputs(q)
    geometry = device_bias_lookup(grid[0], grid[1], prefix, True, True, True, torch.device("cpu"))
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]) if per_head else None
    args, kw = _kernel_args(q, k, v, o, lse, slopes, geometry, has_bias=has_bias, consumer=consumer)
    if stages is not None:
        kw["STAGES"] = stages
    if block_n is not None:
        kw["BLOCK_N"] = block_n
        args = (*args[:1], _descriptor(_row_view(k)[0], block_n, head_dim), _descriptor(_row_view(v)[0], block_n,
                                                                                         head_dim), *args[3:])
    return compile_sm90(_gluon_alibi_fwd_kernel, args, kw, gluon=True), kw


def compile_bwd_for_sm90(head_dim=64, dtype=torch.bfloat16, *, per_head=False, has_bias=True, compute_dslope=False,
                         need_dq=True, grid=(37, 37), prefix=5, heads=None):
    """Compile the backward kernel for sm_90a as a launch on fused-qkv views (1, heads, N, head_dim) would, without
    a GPU (CPU tensors stand in; nothing is launched). ``compute_dslope`` (learned slopes) implies ``per_head``.
    Returns Triton's compiled kernel and the constexpr kwargs it was compiled with."""
    _require_gluon()
    heads = heads or 768 // head_dim
    n = prefix + grid[0] * grid[1]
    qkv = torch.empty(1, n, 3, heads, head_dim, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    do = torch.empty(1, n, heads, head_dim, dtype=dtype).transpose(1, 2)
    dk, dv = (torch.empty(1, n, heads, head_dim, dtype=dtype).transpose(1, 2) for _ in range(2))
    dq_acc = torch.empty(1, n, heads, head_dim, dtype=torch.float32).transpose(1, 2)
    stride = _stat_stride(n)
    lse_pad, delta = torch.empty(2, 1, heads, stride).unbind(0)
    dsl = torch.empty(1, heads, n)
    geometry = device_bias_lookup(grid[0], grid[1], prefix, True, True, True, torch.device("cpu"))
    per_head = per_head or compute_dslope
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]) if per_head else None
    args, kw = _bwd_kernel_args(q, k, v, do, dk, dv, dq_acc, dsl, lse_pad, delta, slopes, geometry, stride,
                                has_bias=has_bias, compute_dslope=compute_dslope, need_dq=need_dq)
    return compile_sm90(_gluon_alibi_bwd_kernel, args, kw, gluon=True), kw


# The codes are padded to CODE_PAD tokens; every tile this kernel loads codes for must stay inside.
assert BLOCK_M <= CODE_PAD and CODE_PAD % BLOCK_M == 0
assert CODE_PAD % BWD_BLOCK_M == 0 and CODE_PAD % (2 * BWD_KEY_ROWS) == 0
