"""Fused Triton attention with the 2D wrapped ALiBi bias of docs/method.md §2.

Algorithm
---------
Per head with slope ``m`` the logits are ``s_ij = (q_i·k_j)/sqrt(D) + m·B_ij`` with
``B_ij = -d̂(i, j)``. Token ``i >= P`` (``P`` prefix tokens) is the patch at
``row = (i-P) // w``, ``col = (i-P) % w``; prefix tokens get ``B = 0`` against everything.
Per axis the offset is ``|Δ|``, or ``min(|Δ|, extent-|Δ|)`` with wrap; ``d`` is Euclidean and
``d̂ = d / d_max`` with ``d_max = sqrt(⌊h/2⌋²+⌊w/2⌋²)`` (wrap) or ``sqrt((h-1)²+(w-1)²)``
(no wrap); a 1×1 grid has ``d̂ = 0``. With ``metric="manhattan"`` (a baseline) ``d = |Δrow| + |Δcol|``
(wrapped the same way) and ``d_max = ⌊h/2⌋+⌊w/2⌋`` (wrap) or ``(h-1)+(w-1)``: only the table's
values change (:func:`kernels.alibi_bias.bias_lookup`), so Manhattan always runs in table mode and
the kernels are the same compiled code as for the Euclidean table.

The forward is FlashAttention-2: one program owns ``BLOCK_M`` query rows, streams
``BLOCK_N``-wide key/value tiles, and keeps a running row max ``m``, row sum ``l`` and fp32
output accumulator. Logits live in base 2: the softmax scale is pre-multiplied by log2(e) and
the slope likewise, so each element costs one ``exp2``. The program writes ``O`` and the row
logsumexp (base 2), the only statistic the backward needs. Nothing N×N is ever stored. Full key
tiles run without element masks; the last, partial one is masked, and when it holds at most
``TAIL_N`` = 16 keys (N = 5 + 16·16 = 261 at 224 px leaves 5) it runs as a 16-wide tile instead of
a mostly empty ``BLOCK_N``-wide one (forward and dQ kernels).

The bias is derived per tile, never materialised. Two interchangeable ways (``bias_mode``):

* ``"table"`` (default): a difference table. Each query gets a code
  ``a_i = C + row_i·(2w-1) + col_i`` and each key ``b_j = row_j·(2w-1) + col_j`` with
  ``C = (h-1)(2w-1) + (w-1)``; then ``a_i - b_j`` is the row-major index of the offset
  ``(row_i-row_j, col_i-col_j)`` in a ``(2h-1)×(2w-1)`` table of ``-d̂`` with wrapping and
  normalisation applied. Prefix (and out-of-range) tokens get codes that land in an appended
  run of zeros. Key codes are stored negated and both rows are padded past N to whole tiles
  (``kernels.alibi_bias.device_bias_lookup``), so codes load without masks and the gather adds.
  The gather reads pairs: adjacent tokens 2t, 2t+1 differ in their codes by one of a few values δ
  (-1 inside an image row, others at row ends and prefix/padding boundaries), so a pair table,
  built once per grid and cached, holds ``(T[c], T[c+δ])`` for each δ, and per-token pair codes
  make keys 2t and 2t+1 (queries, in the dK/dV kernel whose tiles are keys × queries) read two
  adjacent, 8-byte aligned entries: one 8-byte load and one 64-bit address per two elements, which
  the compiler is told with ``max_contiguous``/``multiple_of`` hints. With one slope for all heads
  each call scales the pair table by ``m·log2(e)`` (``TABLE == 1``); with a slope per head the
  kernels gather from the cached unscaled table and multiply by their head's ``m_h·log2(e)``
  (``TABLE == 2``), so no per-head table is built per call; the backward kernels then form
  ``m_h·log2(e)·B - lse`` first, so the bias costs two FFMAs per element, not FMUL, FFMA and FADD.
  Each program turns the codes of its
  resident tile into pointers once, outside its loop (``Tbl + 2·a_i``, or ``Tbl + 2·(-b_j)`` in the
  dK/dV kernel). Per element pair that leaves one 64-bit add for the address, one 8-byte gathered
  load from a table that stays in L1/L2, and one add into the logits each — no abs/min/sqrt — which
  matters because at head_dim 64 the MUFU unit is already as busy with ``exp2`` as the tensor cores
  are with the two matmuls. The slope gradient (learned slopes only) needs ``B`` itself: the
  ``TABLE == 2`` kernels gather it anyway, a single learned slope gathers it from the
  unscaled table as well. ``B`` itself is the same for all heads: forward and dQ programs compute
  two heads (``HEAD_PAIR``), each gathered value serves both, each head applying its own factor
  (16-bit inputs, head_dim <= 64, even head counts).
* ``"sqrt"``: rows and columns per token, then ``|Δ|``, wrap, ``sqrt`` per element. No
  gathered loads, but ~12 ALU ops and a second MUFU op per element. A reference only, never
  the default (``ALIBI_TRITON_BIAS=sqrt`` or ``bias_mode="sqrt"``): compiled for sm_90 it issues
  about 3× the bias-free instructions per score (``benchmarks/bench_kernel_sass.py --bias-mode sqrt``).

The backward may derive the bias in the other mode than its forward (the values agree up to fp32
rounding): by default the atomic-dQ backward on a GPU uses ``"sqrt"``, because on an H100 its table
gathers saturate L1 while the forward's do not (:func:`backward_uses_table`).

Codes / rows / columns per token are precomputed once per grid as an int32 (2, N) array, so
the kernels do no integer division in their inner loops.

Backward (non-causal), in one of two forms. The two-kernel form runs without atomics, so it is
bitwise deterministic for a given block configuration:

1. ``Δ_i = Σ_d O_id·dO_id`` (preprocess kernel), written with a copy of lse into rows padded to a
   multiple of CODE_PAD (lse = +inf, Δ = 0 past N), so the other kernels load both without masks.
2. dK/dV kernel: a program keeps one ``BLOCK_N`` tile of K and V resident and loops over all
   query tiles, recomputing ``P = exp2(s - lse)``; ``dV += Pᵀ dO``, ``dS = P ∘ (dP - Δ)``
   with ``dP = dO Vᵀ``, ``dK += dSᵀ Q · scale``. When the slope needs a gradient it also
   accumulates ``Σ_i dS_ij·B_ij`` per key token into a (B, heads, N) buffer; torch sums that
   to ``dL/dm_h = Σ_ij dS_ij·B_ij``. With the table bias, each thread carries its own partial
   sums across the loop (8 per key row, :func:`_add_row_products`: one FFMA per element, no
   shuffles) and reduces them across threads once, after it; the sqrt backward sums each tile's
   rows instead (on an H100 the partials made it 1.4× slower, the table backward 1.5% faster).
3. dQ kernel: a program keeps one query tile and loops over key tiles: ``dQ += dS K · scale``.
   Skipped entirely when q needs no gradient.

The atomic-dQ form: the dK/dV kernel also forms each tile's ``dS K`` and adds it into an fp32 dQ
buffer with atomic adds, and step 3 is skipped — five matmuls per tile pair instead of seven, no
second pass over QKᵀ, exp and the bias, at the price of an fp32 (B, heads, N, D) buffer and a
summation order (so dQ's last bits) that varies from run to run. It is the default for 16-bit inputs
with head_dim <= 64, where the SASS proxy puts its serial bound at about 0.8x the two-kernel form's
for every slope kind without spills (:func:`atomic_dq_default`); at head_dim 128 its dK/dV kernel
spills, so the two-kernel form stays. ``ALIBI_TRITON_ATOMIC_DQ=0`` (or :func:`atomic_dq` ``(False)``)
selects the two-kernel form everywhere, ``=1`` the atomic one; ``torch.use_deterministic_algorithms(True)``
always gets the two-kernel form.

Static cost (``benchmarks/bench_kernel_sass.py``): every kernel has a constexpr ``HAS_BIAS``
(default True) that compiles the bias out; the benchmark compiles both for sm_90 without a GPU
and compares SASS instructions per score, registers, spills and CTAs per SM like for like, for
constant, per-head and learned slopes. Launch configs that ptxas would fill to its 255-register
limit carry a ``maxnreg`` cap under which they compile to the same loop without spills.

Inputs: inside ``torch.autocast`` the op runs in the autocast dtype (like SDPA). fp32 inputs use
exact fp32 products under ``torch.get_float32_matmul_precision() == "highest"`` (a correctness
path: no tensor cores, small tiles; ``backend="auto"`` picks SDPA then) and tf32 otherwise.

Extra memory: the (B, heads, N) fp32 logsumexp, Δ and (optionally) slope partials, plus the
O(heads·h·w) tables — all O(N). Inputs may have any strides (e.g. q, k, v as views of timm's fused
qkv projection); ``O`` and the gradients are written in (B, N, heads, D) memory order, so a
following ``transpose(1, 2).reshape(B, N, heads·D)`` is free.

Determinism and autotuning: the forward and the two-kernel backward write every output exactly once
(no atomics, no split reductions), so repeated calls in one process are bitwise identical; the
atomic-dQ backward is so for dK, dV and the slopes, not dQ. With autotuning on (the default on GPU)
the chosen block sizes can differ between processes or machines, and with them the summation order;
``ALIBI_TRITON_AUTOTUNE=0`` pins one configuration per kernel and call class for bitwise
reproducibility across runs. Tuning is keyed by the power-of-two buckets of N (:func:`n_bucket`) and
of batch·heads (:func:`work_bucket`), the slope kind, the bias (so the bias-free benchmark baseline
tunes on its own) and the backward's form, and its results are cached on disk across processes.
Under ``TRITON_INTERPRET=1`` a single small configuration is used so CPU tests stay fast.

The op is registered with ``torch.library`` (``alibi_vit::alibi_attention_fwd`` and
``alibi_vit::alibi_attention_bwd`` with fake implementations and an autograd formula), so
``torch.compile`` treats it as one opaque node and does not graph-break.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os

import torch
import triton
import triton.language as tl

from . import triton_interpreter
from .alibi_bias import CODE_PAD, check_attention_inputs, check_metric, device_bias_lookup

__all__ = ["BIAS_MODES", "SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "atomic_dq", "atomic_dq_default",
           "atomic_dq_enabled", "triton_alibi_attention"]

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BIAS_MODES = ("table", "sqrt")
# Width of the narrow key tile that replaces a mostly empty last tile (the smallest tl.dot operand).
TAIL_N = tl.constexpr(16)
# Partial sums per key row that the dK/dV kernel carries for the slope gradient (_add_row_products): the
# column period of the tensor cores' accumulator layout, so each thread's columns map to its own partials.
ROW_PARTIALS = tl.constexpr(8)
# Grid axes 1 and 2 (heads, batch) are limited to 65535 programs by CUDA.
_MAX_GRID_YZ = 65535

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if _INTERPRET:
    triton_interpreter.patch()  # Triton 3.6's interpreter with numpy >= 2.4
_AUTOTUNE = os.environ.get("ALIBI_TRITON_AUTOTUNE", "1") != "0"
# ALIBI_TRITON_ATOMIC_DQ: "auto" (the measured default, atomic_dq_default), "1" always, "0" never.
_ATOMIC_DQ_SETTINGS = {"auto": None, "1": True, "0": False}
_ATOMIC_DQ_SETTING = os.environ.get("ALIBI_TRITON_ATOMIC_DQ", "auto")
if _ATOMIC_DQ_SETTING not in _ATOMIC_DQ_SETTINGS:
    raise ValueError(f"ALIBI_TRITON_ATOMIC_DQ must be one of {tuple(_ATOMIC_DQ_SETTINGS)}, got {_ATOMIC_DQ_SETTING!r}")
_ATOMIC_DQ = _ATOMIC_DQ_SETTINGS[_ATOMIC_DQ_SETTING]
_HAS_BIAS = True  # False only inside bias_compiled_out() (a benchmark baseline)
DEFAULT_BIAS_MODE = os.environ.get("ALIBI_TRITON_BIAS", "table")
if DEFAULT_BIAS_MODE not in BIAS_MODES:
    raise ValueError(f"ALIBI_TRITON_BIAS must be one of {BIAS_MODES}, got {DEFAULT_BIAS_MODE!r}")
# ALIBI_TRITON_BWD_BIAS: how the backward derives the bias: "auto" (the measured default,
# backward_uses_table), "same" as the forward did, or "table"/"sqrt" whatever the forward used (the
# Euclidean metric only; Manhattan is table-only). See backward_bias().
BACKWARD_BIAS_MODES = ("auto", "same", *BIAS_MODES)
_BWD_BIAS = os.environ.get("ALIBI_TRITON_BWD_BIAS", "auto")
if _BWD_BIAS not in BACKWARD_BIAS_MODES:
    raise ValueError(f"ALIBI_TRITON_BWD_BIAS must be one of {BACKWARD_BIAS_MODES}, got {_BWD_BIAS!r}")
# ALIBI_TRITON_SQRT_OFFSETS: the type in which the sqrt mode forms each element's row and column offsets and
# their wrap: "int32" (the default) or "fp16" (two per register; exact while both grid sides are at most
# FP16_EXACT_SIDE). A lever awaiting a GPU A/B (benchmarks/gpu_suite.py's sqrt-offsets phase), not a default.
SQRT_OFFSET_TYPES = ("int32", "fp16")
_SQRT_OFFSETS = os.environ.get("ALIBI_TRITON_SQRT_OFFSETS", "int32")
if _SQRT_OFFSETS not in SQRT_OFFSET_TYPES:
    raise ValueError(f"ALIBI_TRITON_SQRT_OFFSETS must be one of {SQRT_OFFSET_TYPES}, got {_SQRT_OFFSETS!r}")
SQRT_F16 = tl.constexpr(_SQRT_OFFSETS == "fp16")
FP16_EXACT_SIDE = 2048  # every integer up to 2048 is exact in fp16, and so is every offset and wrap below it


# --------------------------------------------------------------------------------------------
# Launch configurations
# --------------------------------------------------------------------------------------------

def _cfg(block_m, block_n, warps, stages, maxnreg=None):
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages,
                         maxnreg=maxnreg)


# Launch configs per kernel and call class, in order of preference: with ALIBI_TRITON_AUTOTUNE=0
# the first is used. A call's class is (head_dim <= 64 ? "small" : "large", bias mode), or "fp32"
# for fp32 inputs; the dK/dV kernel has its own lists for the atomic-dQ backward ("dkdv_atomic"),
# and _LEARNED_CONFIGS overrides a list when the slope gradient is computed. In the backward kernels
# BLOCK_N is the resident key tile of the dK/dV kernel and BLOCK_M the resident query tile of the dQ
# kernel. Registers, spills and instructions per score of every entry are measured by
# benchmarks/bench_kernel_sass.py (sm_90; benchmarks/results/kernel_sass_sm90_triton3.6.md, the Triton
# the GPU machines run, with 3.8 beside it), which chose the first entries by the serial bound among
# those with no ptxas C7515, no spills and at least 8 registers under the 255 cap for every slope kind.
# ptxas fills registers up to the cap when it may: a maxnreg entry caps a config that compiles to the
# same loop without spills under it, so the registers a kernel really needs are visible.
# At head_dim 128 the dK/dV kernel holds 128 fp32 registers of dK and dV accumulators per thread:
# 32-row query tiles spill there (per-head and learned slopes), 16-row tiles do not. The atomic dK/dV
# kernel spills at head_dim 128 with any tile that keeps its loop fast, so head_dim 128 uses the
# two-kernel backward (see atomic_dq_enabled); with learned slopes at head_dim 64 its 64-row query
# tiles spill, 32-row ones (dQ formed transposed) do not. The sqrt mode is a reference: two configs
# each. fp32 inputs with exact ("ieee") products use no tensor cores and far more registers: small
# tiles only, and even those spill; fp32 is a correctness path.
_FWD_CONFIGS = {
    ("small", "table"): [_cfg(64, 64, 4, 2, 232), _cfg(64, 64, 4, 3), _cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4)],
    ("small", "sqrt"): [_cfg(128, 64, 8, 3), _cfg(64, 64, 4, 3)],
    ("large", "table"): [_cfg(64, 64, 4, 2, 232), _cfg(64, 64, 4, 3)],
    ("large", "sqrt"): [_cfg(64, 64, 4, 3), _cfg(64, 64, 4, 2)],
    "fp32": [_cfg(32, 32, 4, 2), _cfg(64, 32, 4, 2)],
}
_DKDV_CONFIGS = {
    ("small", "table"): [_cfg(64, 64, 4, 3), _cfg(64, 128, 8, 2), _cfg(64, 64, 8, 2), _cfg(32, 64, 4, 3)],
    ("small", "sqrt"): [_cfg(64, 128, 8, 2), _cfg(64, 64, 8, 2)],
    ("large", "table"): [_cfg(16, 64, 4, 2), _cfg(16, 64, 4, 3), _cfg(32, 64, 4, 3)],
    ("large", "sqrt"): [_cfg(64, 64, 8, 2), _cfg(32, 64, 4, 3)],
    "fp32": [_cfg(32, 32, 4, 2), _cfg(32, 64, 4, 2)],
}
_DKDV_ATOMIC_CONFIGS = {
    ("small", "table"): [_cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3), _cfg(32, 64, 4, 2)],
    ("small", "sqrt"): [_cfg(64, 64, 4, 3), _cfg(32, 64, 4, 3)],
    ("large", "table"): [_cfg(32, 64, 4, 3), _cfg(16, 64, 4, 2)],
    ("large", "sqrt"): [_cfg(32, 64, 4, 3), _cfg(16, 64, 4, 2)],
    "fp32": [_cfg(32, 32, 4, 2), _cfg(32, 64, 4, 2)],
}
_DQ_CONFIGS = {
    ("small", "table"): [_cfg(64, 64, 4, 3, 244), _cfg(128, 64, 8, 2), _cfg(64, 64, 8, 2), _cfg(64, 32, 4, 3)],
    ("small", "sqrt"): [_cfg(128, 64, 8, 2), _cfg(64, 64, 8, 2)],
    ("large", "table"): [_cfg(128, 64, 8, 2, 240), _cfg(64, 64, 8, 2), _cfg(64, 64, 4, 3), _cfg(64, 32, 4, 3)],
    ("large", "sqrt"): [_cfg(64, 64, 8, 2), _cfg(64, 64, 4, 3)],
    "fp32": [_cfg(32, 32, 4, 2), _cfg(64, 32, 4, 2)],
}
_CONFIGS = {"fwd": _FWD_CONFIGS, "dkdv": _DKDV_CONFIGS, "dkdv_atomic": _DKDV_ATOMIC_CONFIGS, "dq": _DQ_CONFIGS}
_LEARNED_CONFIGS = {("dkdv_atomic", ("small", "table")): [_cfg(32, 64, 4, 3), _cfg(32, 64, 4, 2)]}
# The interpreter runs programs one by one on the CPU: small, unequal tiles keep tests fast and
# still exercise several blocks, partial tail blocks and BLOCK_M != BLOCK_N.
_INTERPRET_CONFIGS = {"fwd": [_cfg(16, 32, 4, 1)], "dkdv": [_cfg(32, 16, 4, 1)], "dq": [_cfg(16, 32, 4, 1)]}
# Codes are padded on the host to a multiple of CODE_PAD and loaded without masks: no tile may be wider.
assert all(max(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) <= CODE_PAD
           for table in (*_CONFIGS.values(), _LEARNED_CONFIGS, _INTERPRET_CONFIGS) for cs in table.values() for c in cs)


def n_bucket(n):
    """The autotuning key's stand-in for the token count: the next power of two. Best tiles change
    with the number of tiles per head, not with every N, so one tuning serves a bucket of N (and
    a change of image size within it retunes nothing)."""
    return triton.next_power_of_2(n)


def work_bucket(batch, heads):
    """The autotuning key's stand-in for the number of (batch, head) slices: the next power of two, so a
    call on a slice of the problem (one batch element, two heads) does not choose the tiles of the whole."""
    return triton.next_power_of_2(batch * heads)


# Tuning results are cached on disk (Triton's cache directory, keyed by kernel source, GPU, the
# tuning key and the configs), so a new process with the same bucket does not retune.
_CACHE_RESULTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def _config_key(cfg):
    return cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages, cfg.maxnreg


def gpu_launch_configs(kind, head_dim, table=True, fp32=False, atomic_dq=False, learned=False):
    """The GPU launch configs offered to one call of kernel ``kind`` ("fwd", "dkdv", "dq"), in order of
    preference: the first is the one used with ``ALIBI_TRITON_AUTOTUNE=0``. ``atomic_dq`` and ``learned``
    (the slope gradient is computed) matter to the dK/dV kernel only."""
    name = "dkdv_atomic" if kind == "dkdv" and atomic_dq else kind
    cls = "fp32" if fp32 else ("small" if head_dim <= 64 else "large", "table" if table else "sqrt")
    if learned and kind == "dkdv" and (name, cls) in _LEARNED_CONFIGS:
        return _LEARNED_CONFIGS[(name, cls)]
    return _CONFIGS[name][cls]


def _gpu_autotune(kind, extra_key=()):
    """Autotuner over all of a kernel's configs; its pruning keeps the call's list (tests call it, the
    interpreter never does)."""
    names = ("dkdv", "dkdv_atomic") if kind == "dkdv" else (kind,)
    unique = {}
    for configs in [*(cs for name in names for cs in _CONFIGS[name].values()),
                    *(cs for (name, _), cs in _LEARNED_CONFIGS.items() if name in names)]:
        for cfg in configs:
            unique.setdefault(_config_key(cfg), cfg)

    # Triton (3.x) calls this as early_config_prune(configs, positional args by name, **keyword args):
    # the tensors arrive in named_args, the constexprs passed by keyword in kwargs.
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        if not {"HEAD_DIM", "TABLE", "Q"} <= args.keys():  # an autotuner that passes no meta-args
            return list(configs)
        by_key = {_config_key(c): c for c in configs}
        wanted = gpu_launch_configs(kind, args["HEAD_DIM"], bool(args["TABLE"]), args["Q"].dtype == torch.float32,
                                    bool(args.get("ATOMIC_DQ", False)), bool(args.get("COMPUTE_DSLOPE", False)))
        offered = [by_key[_config_key(c)] for c in wanted if _config_key(c) in by_key] or list(configs)
        return offered if _AUTOTUNE else offered[:1]

    # Configs that still exceed a device's resources are skipped by the autotuner itself. Benchmark runs
    # of the dK/dV kernel add into the atomic-dQ buffer: each starts from zeros. The key holds what changes
    # the best tiles: the problem's size (buckets of N and of batch·heads), head_dim, the slope kind (TABLE:
    # one slope or one per head; COMPUTE_DSLOPE: learned; HEAD_PAIR), the bias itself (HAS_BIAS: the
    # bias-free benchmark baseline tunes on its own) and the backward's form (ATOMIC_DQ).
    return triton.autotune(configs=list(unique.values()), reset_to_zero=["DQ"] if kind == "dkdv" else None,
                           key=["N_BUCKET", "WORK_BUCKET", "HEAD_DIM", "TABLE", "WRAP", "COMPUTE_DSLOPE", "DOT_PREC",
                                "HAS_BIAS", *extra_key],
                           prune_configs_by={"early_config_prune": prune}, **_CACHE_RESULTS)


def _autotune(kind):
    if _INTERPRET:
        return triton.autotune(configs=_INTERPRET_CONFIGS[kind], key=["N_BUCKET", "HEAD_DIM"])
    return _gpu_autotune(kind, ("HEAD_PAIR",) if kind in ("fwd", "dq") else ("ATOMIC_DQ",))


# --------------------------------------------------------------------------------------------
# Bias helpers (device)
# --------------------------------------------------------------------------------------------

@triton.jit
def _load_codes(Codes, offs, code_stride, IS_KEY: tl.constexpr, TABLE: tl.constexpr):
    """Per-token bias coordinates for a vector of token indices, loaded without a mask: the host pads
    Codes (row stride ``code_stride``) past N to a whole number of the largest tile
    (:func:`kernels.alibi_bias.device_bias_lookup`).

    TABLE: returns (code, code) with query codes in row 0 and negated key codes in row 1 of Codes;
    prefix and out-of-range tokens have codes that point into the zero run of the table.
    sqrt: returns (row, col) with row = -1 for prefix and out-of-range tokens.
    """
    if TABLE:
        if IS_KEY:
            code = tl.load(Codes + code_stride + offs)
        else:
            code = tl.load(Codes + offs)
        return code, code
    else:
        row = tl.load(Codes + offs)
        col = tl.load(Codes + code_stride + offs)
        return row, col


@triton.jit
def _bias_tile(qa, qb, ka, kb, Tbl, h, w,
               TABLE: tl.constexpr, WRAP: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """fp32 tile of the bias: the table's values (table), or B = -d (sqrt; see _scaled_bias).

    Shape (queries, keys), or (keys, queries) when KEYS_FIRST.
    """
    if TABLE:
        # The resident side arrives as pointers into the pair table (Tbl + 2·(negated key code), or
        # Tbl + 2·query code), built once outside the loop; the other side's pair codes make adjacent
        # queries (keys) 2t, 2t+1 read adjacent, 8-byte aligned entries (kernels.alibi_bias.device_bias_lookup),
        # so the gather is one 8-byte load per pair of elements.
        if KEYS_FIRST:
            ptrs = ka[:, None] + qa[None, :]
        else:
            ptrs = qa[:, None] + ka[None, :]
        bias = tl.load(tl.max_contiguous(tl.multiple_of(ptrs, [4, 8]), [1, 2]))
    else:
        if KEYS_FIRST:
            valid = (ka[:, None] >= 0) & (qa[None, :] >= 0)
        else:
            valid = (qa[:, None] >= 0) & (ka[None, :] >= 0)
        if SQRT_F16:  # rows and columns as halves: offsets and wraps below run two to a register
            qa = qa.to(tl.float16)
            qb = qb.to(tl.float16)
            ka = ka.to(tl.float16)
            kb = kb.to(tl.float16)
        if KEYS_FIRST:
            dy = ka[:, None] - qa[None, :]
            dx = kb[:, None] - qb[None, :]
        else:
            dy = qa[:, None] - ka[None, :]
            dx = qb[:, None] - kb[None, :]
        dy = tl.abs(dy)
        dx = tl.abs(dx)
        if WRAP:
            dy = tl.minimum(dy, h - dy)
            dx = tl.minimum(dx, w - dx)
        if SQRT_F16:  # squares in fp32: dy² + dx² passes fp16's exact integers for grids over 45 a side
            dy = dy.to(tl.float32)
            dx = dx.to(tl.float32)
            dist = tl.sqrt(dy * dy + dx * dx)
        else:
            dist = tl.sqrt((dy * dy + dx * dx).to(tl.float32))
        bias = tl.where(valid, -dist, 0.0)
    return bias


@triton.jit
def _scaled_bias(bias, b_scale, TABLE: tl.constexpr):
    """The bias term of the base-2 logits: TABLE == 1, the table already holds slope·log2(e)·B; TABLE == 2
    (forward and dQ kernels with per-head slopes: one unscaled table for all heads), or sqrt mode: times
    ``b_scale`` = slope·log2(e)·norm."""
    if TABLE == 1:
        return bias
    else:
        return bias * b_scale


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------

@triton.jit
def _row_bias(qa, qb, start_n, Codes, Tbl, N, h, w, code_stride,
              BLOCK_N: tl.constexpr, TABLE: tl.constexpr, WRAP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The bias tile of the resident query rows against keys start_n.. (forward and dQ kernels) as
    gathered, before :func:`_scaled_bias`, or 0.0 when the bias is compiled out."""
    if HAS_BIAS:
        if TABLE:
            # Key-pair codes (row 2 of Codes) against qa = pair table + 2·a_i.
            kp = tl.load(Codes + 2 * code_stride + start_n + tl.arange(0, BLOCK_N))
            bias = _bias_tile(qa, qb, kp, kp, Tbl, h, w, TABLE, WRAP, False)
        else:
            ka, kb = _load_codes(Codes, start_n + tl.arange(0, BLOCK_N), code_stride, True, TABLE)
            bias = _bias_tile(qa, qb, ka, kb, Tbl, h, w, TABLE, WRAP, False)
        return bias
    else:
        return 0.0


@triton.jit
def _key_tile_logits(q, bias, row_offset, qa, qb, start_n, K, Codes, Tbl, stride_kn, stride_kd, N, h, w, code_stride,
                     qk_scale, b_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr,
                     DOT_PREC: tl.constexpr, TABLE: tl.constexpr, WRAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     GATHER: tl.constexpr, OFFSET: tl.constexpr):
    """The block both the forward and the dQ kernel run per key tile: load Kᵀ, form the base-2 logits
    ``s = q·kᵀ·scale + b_scale·bias`` of the resident query rows, minus ``row_offset`` per row when OFFSET
    (the dQ kernel's logsumexp), -inf for keys past N. The bias term and the offset are combined first: with a
    per-head ``b_scale`` that is two FFMAs per element, not FMUL, FFMA and FADD. GATHER: gather the bias tile
    here, after the QK product (so it is not live across it), and return it; otherwise use ``bias`` (the
    first head's, in a head pair: one gathered tile, each head's own ``b_scale``). Returns (kᵀ, s, bias)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kt_ptrs = K + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn
    if MASK_N:
        kt = tl.load(kt_ptrs, mask=(offs_n < N)[None, :], other=0.0)
    else:
        kt = tl.load(kt_ptrs)
    qk = tl.dot(q, kt, input_precision=DOT_PREC)
    if GATHER:
        bias = _row_bias(qa, qb, start_n, Codes, Tbl, N, h, w, code_stride, BLOCK_N, TABLE, WRAP, HAS_BIAS)
    if HAS_BIAS:
        if OFFSET:
            s = qk * qk_scale + (_scaled_bias(bias, b_scale, TABLE) - row_offset[:, None])
        else:
            s = qk * qk_scale + _scaled_bias(bias, b_scale, TABLE)
    else:
        if OFFSET:
            s = qk * qk_scale - row_offset[:, None]
        else:
            s = qk * qk_scale
    if MASK_N:
        # Keys past N must not enter the softmax (their loaded values are zeros, not -inf).
        s = tl.where((offs_n < N)[None, :], s, float("-inf"))
    return kt, s, bias


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, bias, qa, qb, start_n, K, V, Codes, Tbl,
              stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, DOT_PREC: tl.constexpr,
              TABLE: tl.constexpr, WRAP: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr):
    """One key tile of one head: the online-softmax update; GATHER as in _key_tile_logits."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    v_ptrs = V + offs_n[:, None] * stride_vn + tl.arange(0, HEAD_DIM)[None, :] * stride_vd
    if MASK_N:
        v = tl.load(v_ptrs, mask=(offs_n < N)[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    _, s, bias = _key_tile_logits(q, bias, 0.0, qa, qb, start_n, K, Codes, Tbl, stride_kn, stride_kd, N, h, w,
                                  code_stride, qk_scale, b_scale, HEAD_DIM, BLOCK_N, MASK_N, DOT_PREC, TABLE, WRAP,
                                  HAS_BIAS, GATHER, False)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PREC)
    return acc, l_i, m_new, bias


@triton.jit
def _fwd_step(acc, l_i, m_i, acc2, l2, m2, q, q2, qa, qb, start_n, K, V, Codes, Tbl, stride_kh, stride_kn, stride_kd,
              stride_vh, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale, b_scale2,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, DOT_PREC: tl.constexpr,
              TABLE: tl.constexpr, WRAP: tl.constexpr, HAS_BIAS: tl.constexpr, HEAD_PAIR: tl.constexpr):
    """One key tile of the program's head, and of its pair's second head with the same gathered bias tile."""
    acc, l_i, m_i, bias = _fwd_tile(acc, l_i, m_i, q, 0.0, qa, qb, start_n, K, V, Codes, Tbl,
                                    stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale,
                                    HEAD_DIM, BLOCK_N, MASK_N, DOT_PREC, TABLE, WRAP, HAS_BIAS, True)
    if HEAD_PAIR:
        acc2, l2, m2, _ = _fwd_tile(acc2, l2, m2, q2, bias, qa, qb, start_n, K + stride_kh, V + stride_vh, Codes, Tbl,
                                    stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale2,
                                    HEAD_DIM, BLOCK_N, MASK_N, DOT_PREC, TABLE, WRAP, HAS_BIAS, False)
    return acc, l_i, m_i, acc2, l2, m2


@triton.jit
def _fwd_store(acc, l_i, m_i, O, LSE, offs_m, offs_d, mask_m, stride_on, stride_od):
    out = acc * (1.0 / l_i)[:, None]
    tl.store(O + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=mask_m[:, None])
    tl.store(LSE + offs_m, m_i + tl.log2(l_i), mask=mask_m)


@triton.jit(do_not_specialize=["N_BUCKET", "WORK_BUCKET"])
def _alibi_fwd_kernel(Q, K, V, O, LSE, Slopes, Codes, Tbl,
                      stride_qb, stride_qh, stride_qn, stride_qd,
                      stride_kb, stride_kh, stride_kn, stride_kd,
                      stride_vb, stride_vh, stride_vn, stride_vd,
                      stride_ob, stride_oh, stride_on, stride_od,
                      H, N, N_BUCKET, WORK_BUCKET, h, w, code_stride, qk_scale, bias_scale,
                      HEAD_DIM: tl.constexpr, TABLE: tl.constexpr, WRAP: tl.constexpr,
                      COMPUTE_DSLOPE: tl.constexpr, DOT_PREC: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr = True,
                      HEAD_PAIR: tl.constexpr = False):
    # HEAD_PAIR: the program also computes head off_h + 1 with the same bias tile (table mode with
    # one slope for all heads), so each gathered bias value serves two heads' scores.
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    if HEAD_PAIR:
        off_h = off_h * 2
    off_b = tl.program_id(2).to(tl.int64)
    # int64 base offsets: a fused qkv view of a large batch exceeds 2**31 elements.
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b * stride_kb + off_h.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_h.to(tl.int64) * stride_vh
    O += off_b * stride_ob + off_h.to(tl.int64) * stride_oh
    LSE += (off_b * H + off_h) * N

    b_scale = tl.load(Slopes + off_h).to(tl.float32) * bias_scale
    b_scale2 = b_scale
    if HEAD_PAIR:
        b_scale2 = tl.load(Slopes + off_h + 1).to(tl.float32) * bias_scale
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < N
    q_off = offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(Q + q_off, mask=mask_m[:, None], other=0.0)
    qa, qb = _load_codes(Codes, offs_m, code_stride, False, TABLE)
    if TABLE:  # into the key-pair table (see _row_bias)
        qa = Tbl + 2 * qa

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # The pair's second head (scalar placeholders without HEAD_PAIR).
    q2, m2, l2, acc2 = 0.0, 0.0, 0.0, 0.0
    if HEAD_PAIR:
        q2 = tl.load(Q + stride_qh + q_off, mask=mask_m[:, None], other=0.0)
        m2 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Full key tiles need no per-element mask; only the last partial tile pays for one, and a short
    # one (at most TAIL_N keys, e.g. N = 5 + 16·16) runs as a narrow tile instead of a mostly empty one.
    n_full = (N // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i, acc2, l2, m2 = _fwd_step(
            acc, l_i, m_i, acc2, l2, m2, q, q2, qa, qb, start_n, K, V, Codes, Tbl, stride_kh, stride_kn, stride_kd,
            stride_vh, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale, b_scale2, HEAD_DIM, BLOCK_N, False,
            DOT_PREC, TABLE, WRAP, HAS_BIAS, HEAD_PAIR)
    if N - n_full <= TAIL_N:
        if n_full < N:
            acc, l_i, m_i, acc2, l2, m2 = _fwd_step(
                acc, l_i, m_i, acc2, l2, m2, q, q2, qa, qb, n_full, K, V, Codes, Tbl, stride_kh, stride_kn, stride_kd,
                stride_vh, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale, b_scale2, HEAD_DIM, TAIL_N, True,
                DOT_PREC, TABLE, WRAP, HAS_BIAS, HEAD_PAIR)
    else:
        acc, l_i, m_i, acc2, l2, m2 = _fwd_step(
            acc, l_i, m_i, acc2, l2, m2, q, q2, qa, qb, n_full, K, V, Codes, Tbl, stride_kh, stride_kn, stride_kd,
            stride_vh, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale, b_scale2, HEAD_DIM, BLOCK_N, True,
            DOT_PREC, TABLE, WRAP, HAS_BIAS, HEAD_PAIR)
    _fwd_store(acc, l_i, m_i, O, LSE, offs_m, offs_d, mask_m, stride_on, stride_od)
    if HEAD_PAIR:
        _fwd_store(acc2, l2, m2, O + stride_oh, LSE + N, offs_m, offs_d, mask_m, stride_on, stride_od)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------

@triton.jit
def _bwd_preprocess_kernel(O, DO, LSE, LSEP, Delta,
                           stride_ob, stride_oh, stride_on, stride_od,
                           stride_dob, stride_doh, stride_don, stride_dod,
                           H, N, stat_stride, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    # Per-row statistics for the backward kernels in rows of stat_stride (N rounded up to CODE_PAD):
    # Δ = rowsum(dO∘O) and a copy of lse; rows past N hold lse = +inf and Δ = 0, so the backward
    # kernels load them without masks (and, with the aligned row stride, as vectors).
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
    lse = tl.load(LSE + (off_b * H + off_h) * N + offs_m, mask=mask_m, other=float("inf"))
    row = (off_b * H + off_h) * stat_stride
    tl.store(LSEP + row + offs_m, lse)
    tl.store(Delta + row + offs_m, delta)


@triton.jit
def _fma_chain(acc, x, y):
    """``acc + Σ_k x[:, :, k]·y[:, :, k]`` over the last axis (a power of two) as a chain from ``acc``, so every
    product fuses into the add before it: one FFMA per element (``tl.split`` halves the axis in registers)."""
    K: tl.constexpr = x.shape[2]
    if K == 1:
        return acc + tl.reshape(x, acc.shape) * tl.reshape(y, acc.shape)
    else:
        x0, x1 = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], K // 2, 2]))
        y0, y1 = tl.split(tl.reshape(y, [y.shape[0], y.shape[1], K // 2, 2]))
        return _fma_chain(_fma_chain(acc, x0, y0), x1, y1)


@triton.jit
def _add_row_products(acc, x, y):
    """``acc + x∘y`` with column ``c`` of the (R, C) product added into ``acc[:, c % 8]``, acc (R, 8)
    (``ROW_PARTIALS``): row sums left as 8 partials per row, which :func:`_dkdv_loop` carries across its loop
    and sums once after it. In the tensor cores' accumulator layout (wgmma and mma.sync) a thread holds 2
    adjacent columns of every 8, so these partials stay in the thread's registers: the loop adds one FFMA per
    element and no shuffles, where ``tl.sum(x * y, 1)`` per tile costs a multiply and a half per element
    (Triton 3.8 adds a thread's values as a tree, so half the products do not fuse into the adds) and a
    cross-lane shuffle reduction."""
    R: tl.constexpr = x.shape[0]
    C: tl.constexpr = x.shape[1]
    x = tl.permute(tl.reshape(x, [R, C // ROW_PARTIALS, ROW_PARTIALS]), [0, 2, 1])
    y = tl.permute(tl.reshape(y, [R, C // ROW_PARTIALS, ROW_PARTIALS]), [0, 2, 1])
    return _fma_chain(acc, x, y)


@triton.jit
def _dkdv_loop(dk, dv, dsl, k, v, ka, kb, ku, offs_n, Q, DO, DQ, LSE, Delta, Codes, Tbl,
               stride_qn, stride_qd, stride_don, stride_dod, stride_gn, stride_gd,
               N, h, w, code_stride, qk_scale, b_scale,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK_N: tl.constexpr,
               TABLE: tl.constexpr, WRAP: tl.constexpr, COMPUTE_DSLOPE: tl.constexpr,
               DOT_PREC: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(0, N, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        mask_m = offs_m < N
        qt = tl.load(Q + offs_d[:, None] * stride_qd + offs_m[None, :] * stride_qn, mask=mask_m[None, :], other=0.0)
        do = tl.load(DO + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod, mask=mask_m[:, None],
                     other=0.0)
        # Padded rows (lse = +inf past N: probabilities exactly 0), loaded without masks: with masks Triton
        # 3.6 copied them element by element, 32 predicated copies per thread and iteration at 64x64.
        lse = tl.load(LSE + offs_m)
        delta = tl.load(Delta + offs_m)
        if HAS_BIAS:
            if TABLE:  # query-pair codes (row 3 of Codes) against ka = pair table + 2·(negated key code)
                qa = tl.load(Codes + 3 * code_stride + offs_m)
                qb = qa
            else:
                qa, qb = _load_codes(Codes, offs_m, code_stride, False, TABLE)
        qkt = tl.dot(k, qt, input_precision=DOT_PREC)
        if HAS_BIAS:
            bias_t = _bias_tile(qa, qb, ka, kb, Tbl, h, w, TABLE, WRAP, True)
            if TABLE == 2:  # bias term and logsumexp first: two FFMAs per element (see _key_tile_logits)
                pt = tl.exp2(qkt * qk_scale + (bias_t * b_scale - lse[None, :]))
            else:
                pt = tl.exp2(qkt * qk_scale + _scaled_bias(bias_t, b_scale, TABLE) - lse[None, :])
        else:
            pt = tl.exp2(qkt * qk_scale - lse[None, :])
        if MASK_N:
            # Keys past N were loaded as zeros; their p can overflow (exp2(-lse)) and dS·K sums over keys.
            pt = tl.where((offs_n < N)[:, None], pt, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, acc=dv, input_precision=DOT_PREC)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dst = pt * (dpt - delta[None, :])
        if COMPUTE_DSLOPE and HAS_BIAS:  # here, so the bias tile is not live across the dK (and dQ) products
            if TABLE == 1:  # dL/dm needs B itself: gather it from the unscaled table (TABLE == 2 gathered it)
                bias_t = _bias_tile(qa, qb, ku, kb, Tbl, h, w, TABLE, WRAP, True)
            if TABLE:  # partials per thread (see _add_row_products); the sqrt backward keeps one sum per row
                dsl = _add_row_products(dsl, dst, bias_t)
            else:
                dsl += tl.sum(dst * bias_t, 1)
        dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), acc=dk, input_precision=DOT_PREC)
        if ATOMIC_DQ:  # this key tile's share of dQ (unscaled), added into the fp32 buffer in any order
            if BLOCK_M < 64:
                # A query tile narrower than a warpgroup's 64 rows cannot be a wgmma's M: dS·K would be an
                # mma.sync beside the loop's wgmma, and ptxas serialises every wgmma (advisory C7515 on
                # Triton 3.6 at head_dim 128, 32x64 tiles). As (K^T·dS)^T the head dim is M instead.
                dqt = tl.dot(tl.trans(k), dst.to(k.dtype), input_precision=DOT_PREC)
                tl.atomic_add(DQ + offs_d[:, None] * stride_gd + offs_m[None, :] * stride_gn, dqt,
                              mask=mask_m[None, :], sem="relaxed")
            else:
                dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=DOT_PREC)
                tl.atomic_add(DQ + offs_m[:, None] * stride_gn + offs_d[None, :] * stride_gd, dq, mask=mask_m[:, None],
                              sem="relaxed")
    return dk, dv, dsl


@triton.jit(do_not_specialize=["N_BUCKET", "WORK_BUCKET"])
def _alibi_bwd_dkdv_kernel(Q, K, V, DO, DK, DV, DQ, LSE, Delta, DSL, Slopes, Codes, Tbl, TblU,
                           stride_qb, stride_qh, stride_qn, stride_qd,
                           stride_kb, stride_kh, stride_kn, stride_kd,
                           stride_vb, stride_vh, stride_vn, stride_vd,
                           stride_dob, stride_doh, stride_don, stride_dod,
                           stride_gb, stride_gh, stride_gn, stride_gd,
                           H, N, N_BUCKET, WORK_BUCKET, h, w, code_stride, stat_stride, qk_scale, sm_scale, bias_scale,
                           bias_norm,
                           HEAD_DIM: tl.constexpr, TABLE: tl.constexpr, WRAP: tl.constexpr,
                           COMPUTE_DSLOPE: tl.constexpr, DOT_PREC: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr = True,
                           ATOMIC_DQ: tl.constexpr = False):
    # ATOMIC_DQ: also accumulate dS·K into the fp32 buffer DQ with atomic adds (opt-in; the dQ kernel
    # is then skipped, and the summation order, so the result's last bits, varies from run to run).
    pid_n = tl.program_id(0)
    off_h = tl.program_id(1)
    off_b = tl.program_id(2).to(tl.int64)
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b * stride_kb + off_h.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_h.to(tl.int64) * stride_vh
    DO += off_b * stride_dob + off_h.to(tl.int64) * stride_doh
    DK += off_b * stride_gb + off_h.to(tl.int64) * stride_gh
    DV += off_b * stride_gb + off_h.to(tl.int64) * stride_gh
    DQ += off_b * stride_gb + off_h.to(tl.int64) * stride_gh
    row = (off_b * H + off_h) * N
    LSE += (off_b * H + off_h) * stat_stride
    Delta += (off_b * H + off_h) * stat_stride
    DSL += row

    b_scale = tl.load(Slopes + off_h).to(tl.float32) * bias_scale
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_n = offs_n < N
    k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=mask_n[:, None], other=0.0)
    v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=mask_n[:, None], other=0.0)
    ka, kb = _load_codes(Codes, offs_n, code_stride, True, TABLE)
    ku = ka
    if TABLE == 1:
        ku = TblU + 2 * ka
    if TABLE:  # into the query-pair half of the pair table (see _bias_tile)
        ka = Tbl + 2 * ka

    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    if TABLE:
        dsl = tl.zeros([BLOCK_N, ROW_PARTIALS], dtype=tl.float32)
    else:
        dsl = tl.zeros([BLOCK_N], dtype=tl.float32)
    # One loop for every program, the last partial key tile's included: keys past N were loaded as
    # zeros and their rows of dK, dV and the slope partials are never stored, so only the atomic dQ
    # (which sums over keys) masks their probabilities. (Two copies of the loop, one masked, made
    # ptxas serialise every wgmma of the loop: advisory C7515 on Triton 3.6.)
    dk, dv, dsl = _dkdv_loop(dk, dv, dsl, k, v, ka, kb, ku, offs_n, Q, DO, DQ, LSE, Delta, Codes, Tbl,
                             stride_qn, stride_qd, stride_don, stride_dod, stride_gn, stride_gd, N, h, w, code_stride,
                             qk_scale, b_scale, HEAD_DIM, BLOCK_M, ATOMIC_DQ, TABLE, WRAP, COMPUTE_DSLOPE, DOT_PREC,
                             HAS_BIAS, ATOMIC_DQ)
    g_off = offs_n[:, None] * stride_gn + offs_d[None, :] * stride_gd
    tl.store(DK + g_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=mask_n[:, None])
    tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=mask_n[:, None])
    if COMPUTE_DSLOPE:
        # Per-key partial sums of dS·B; summed over keys and batch in torch (deterministic).
        if TABLE:
            dsl = tl.sum(dsl, 1)
        tl.store(DSL + offs_n, dsl * bias_norm, mask=mask_n)


@triton.jit
def _dq_tile(dq, q, do, lse, delta, bias, qa, qb, start_n, K, V, Codes, Tbl,
             stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, DOT_PREC: tl.constexpr,
             TABLE: tl.constexpr, WRAP: tl.constexpr, HAS_BIAS: tl.constexpr, GATHER: tl.constexpr):
    """One key tile of one head's dQ; GATHER as in _key_tile_logits."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    vt_ptrs = V + tl.arange(0, HEAD_DIM)[:, None] * stride_vd + offs_n[None, :] * stride_vn
    if MASK_N:
        vt = tl.load(vt_ptrs, mask=(offs_n < N)[None, :], other=0.0)
    else:
        vt = tl.load(vt_ptrs)
    kt, s, bias = _key_tile_logits(q, bias, lse, qa, qb, start_n, K, Codes, Tbl, stride_kn, stride_kd, N, h, w,
                                   code_stride, qk_scale, b_scale, HEAD_DIM, BLOCK_N, MASK_N, DOT_PREC, TABLE, WRAP,
                                   HAS_BIAS, GATHER, True)
    p = tl.exp2(s)  # 0 for masked keys (s = -inf)
    dp = tl.dot(do, vt, input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), acc=dq, input_precision=DOT_PREC)
    return dq, bias


@triton.jit
def _dq_step(dq, dq2, q, do, lse, delta, q2, do2, lse2, delta2, qa, qb, start_n, K, V, Codes, Tbl,
             stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale,
             b_scale2, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr, DOT_PREC: tl.constexpr,
             TABLE: tl.constexpr, WRAP: tl.constexpr, HAS_BIAS: tl.constexpr, HEAD_PAIR: tl.constexpr):
    """One key tile of the program's head's dQ, and of its pair's second head with the same gathered bias tile."""
    dq, bias = _dq_tile(dq, q, do, lse, delta, 0.0, qa, qb, start_n, K, V, Codes, Tbl,
                        stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale,
                        HEAD_DIM, BLOCK_N, MASK_N, DOT_PREC, TABLE, WRAP, HAS_BIAS, True)
    if HEAD_PAIR:
        dq2, _ = _dq_tile(dq2, q2, do2, lse2, delta2, bias, qa, qb, start_n, K + stride_kh, V + stride_vh, Codes, Tbl,
                          stride_kn, stride_kd, stride_vn, stride_vd, N, h, w, code_stride, qk_scale, b_scale2,
                          HEAD_DIM, BLOCK_N, MASK_N, DOT_PREC, TABLE, WRAP, HAS_BIAS, False)
    return dq, dq2


@triton.jit
def _dq_head(Q, DO, LSE, Delta, offs_m, offs_d, mask_m, stride_qn, stride_qd, stride_don, stride_dod):
    """The resident query-side tiles of one head: q, dO, logsumexp, Δ."""
    q = tl.load(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, mask=mask_m[:, None], other=0.0)
    do = tl.load(DO + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod, mask=mask_m[:, None], other=0.0)
    lse = tl.load(LSE + offs_m)  # padded rows (see _bwd_preprocess_kernel)
    delta = tl.load(Delta + offs_m)
    return q, do, lse, delta


@triton.jit(do_not_specialize=["N_BUCKET", "WORK_BUCKET"])
def _alibi_bwd_dq_kernel(Q, K, V, DO, DQ, LSE, Delta, Slopes, Codes, Tbl,
                         stride_qb, stride_qh, stride_qn, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_dob, stride_doh, stride_don, stride_dod,
                         stride_gb, stride_gh, stride_gn, stride_gd,
                         H, N, N_BUCKET, WORK_BUCKET, h, w, code_stride, stat_stride, qk_scale, sm_scale, bias_scale,
                         HEAD_DIM: tl.constexpr, TABLE: tl.constexpr, WRAP: tl.constexpr,
                         COMPUTE_DSLOPE: tl.constexpr, DOT_PREC: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr = True,
                         HEAD_PAIR: tl.constexpr = False):
    # HEAD_PAIR as in the forward: heads off_h and off_h + 1 share each gathered bias tile.
    pid_m = tl.program_id(0)
    off_h = tl.program_id(1)
    if HEAD_PAIR:
        off_h = off_h * 2
    off_b = tl.program_id(2).to(tl.int64)
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b * stride_kb + off_h.to(tl.int64) * stride_kh
    V += off_b * stride_vb + off_h.to(tl.int64) * stride_vh
    DO += off_b * stride_dob + off_h.to(tl.int64) * stride_doh
    DQ += off_b * stride_gb + off_h.to(tl.int64) * stride_gh
    row = (off_b * H + off_h) * stat_stride

    b_scale = tl.load(Slopes + off_h).to(tl.float32) * bias_scale
    b_scale2 = b_scale
    if HEAD_PAIR:
        b_scale2 = tl.load(Slopes + off_h + 1).to(tl.float32) * bias_scale
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_m = offs_m < N
    q, do, lse, delta = _dq_head(Q, DO, LSE + row, Delta + row, offs_m, offs_d, mask_m,
                                 stride_qn, stride_qd, stride_don, stride_dod)
    qa, qb = _load_codes(Codes, offs_m, code_stride, False, TABLE)
    if TABLE:  # into the key-pair table (see _row_bias)
        qa = Tbl + 2 * qa

    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    q2, do2, lse2, delta2, dq2 = 0.0, 0.0, 0.0, 0.0, 0.0  # the pair's second head (placeholders without HEAD_PAIR)
    if HEAD_PAIR:
        q2, do2, lse2, delta2 = _dq_head(Q + stride_qh, DO + stride_doh, LSE + row + stat_stride, Delta + row + stat_stride,
                                         offs_m,
                                         offs_d, mask_m, stride_qn, stride_qd, stride_don, stride_dod)
        dq2 = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Key tiles as in the forward: full ones unmasked, then a wide or a narrow masked tail.
    n_full = (N // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        dq, dq2 = _dq_step(dq, dq2, q, do, lse, delta, q2, do2, lse2, delta2, qa, qb, start_n, K, V, Codes, Tbl,
                           stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd, N, h, w, code_stride, qk_scale,
                           b_scale, b_scale2, HEAD_DIM, BLOCK_N, False, DOT_PREC, TABLE, WRAP, HAS_BIAS, HEAD_PAIR)
    if N - n_full <= TAIL_N:
        if n_full < N:
            dq, dq2 = _dq_step(dq, dq2, q, do, lse, delta, q2, do2, lse2, delta2, qa, qb, n_full, K, V, Codes, Tbl,
                               stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd, N, h, w, code_stride,
                               qk_scale, b_scale, b_scale2, HEAD_DIM, TAIL_N, True, DOT_PREC, TABLE, WRAP, HAS_BIAS,
                               HEAD_PAIR)
    else:
        dq, dq2 = _dq_step(dq, dq2, q, do, lse, delta, q2, do2, lse2, delta2, qa, qb, n_full, K, V, Codes, Tbl,
                           stride_kh, stride_kn, stride_kd, stride_vh, stride_vn, stride_vd, N, h, w, code_stride, qk_scale,
                           b_scale, b_scale2, HEAD_DIM, BLOCK_N, True, DOT_PREC, TABLE, WRAP, HAS_BIAS, HEAD_PAIR)
    g_off = offs_m[:, None] * stride_gn + offs_d[None, :] * stride_gd
    tl.store(DQ + g_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=mask_m[:, None])
    if HEAD_PAIR:
        tl.store(DQ + stride_gh + g_off, (dq2 * sm_scale).to(DQ.dtype.element_ty), mask=mask_m[:, None])


_fwd_kernel = _autotune("fwd")(_alibi_fwd_kernel)
_dkdv_kernel = _autotune("dkdv")(_alibi_bwd_dkdv_kernel)
_dq_kernel = _autotune("dq")(_alibi_bwd_dq_kernel)
_PREPROCESS_BLOCK_M = 16 if _INTERPRET else 64
# Fused multiply-adds in the softmax and bias arithmetic, requested explicitly: on by default up
# to Triton 3.9, which warns that 3.10 turns the default off (ptxas --fmad=false; ~15% more fp32
# instructions in the forward's inner loop on sm_90).
_LAUNCH_OPTIONS = {"enable_fp_fusion": True}


# --------------------------------------------------------------------------------------------
# Host side: launches
# --------------------------------------------------------------------------------------------

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
    """fp32 inputs follow torch's matmul rule: exact ("ieee") products under the default
    ``torch.get_float32_matmul_precision() == "highest"``, tensor-core tf32 once it is "high" or
    "medium" (~3 fewer digits). 16-bit inputs ignore it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _table_mode(slopes, use_table):
    """The kernels' TABLE constexpr: 0 sqrt mode; 1 table mode with one slope for all heads (the kernels
    gather slope·log2(e)·B from a table scaled per call, :func:`_scaled_table`, and add it as it is); 2
    table mode with a slope per head (the kernels gather B from the cached unscaled tables, shared by all
    heads, and multiply by their head's slope·log2(e): no per-head tables are built per call)."""
    if not use_table:
        return 0
    return 1 if slopes.numel() == 1 else 2


@functools.lru_cache(maxsize=8)
def unit_slope(device: torch.device) -> torch.Tensor:
    """The (1,) fp32 slope 1 that ``slopes=None`` stands for, one tensor per device (never written), so
    calls without slopes allocate nothing for it and reuse the tables scaled for it."""
    return torch.ones(1, device=device, dtype=torch.float32)


@functools.lru_cache(maxsize=64)
def _unit_scaled(tbl):
    # log2(e)·tbl for the unit slope, cached with the (cached) table it scales.
    return tbl * LOG2E


@functools.lru_cache(maxsize=64)
def _unit_per_head(device, heads):
    return torch.ones(heads, device=device, dtype=torch.float32)


def _is_unit(slopes):
    return slopes is unit_slope(slopes.device)


def _scaled_table(tbl, slopes, table):
    """The table the kernels gather from: scaled by slope·log2(e) when TABLE == 1 (cached for the unit
    slope of ``slopes=None``), else as cached."""
    if table == 1:
        if _is_unit(slopes):
            return _unit_scaled(tbl)
        return (slopes.detach().to(torch.float32) * LOG2E) * tbl
    return tbl


def _per_head(slopes, heads):
    # The kernels read one slope per head; a single slope (slopes=None) stands for all heads.
    if slopes.numel() != 1:
        return slopes
    return _unit_per_head(slopes.device, heads) if _is_unit(slopes) else slopes.expand(heads).contiguous()


def head_pair(q, slopes, use_table):
    """Whether forward and dQ programs compute two heads from one gathered bias tile: table mode, one
    slope for every head (``slopes=None``), an even number of heads, 16-bit inputs with head_dim <= 64
    (at 128, or with fp32 operands, two heads' tiles exceed the registers and spill)."""
    heads, d = q.shape[1], q.shape[3]
    return bool(use_table and heads % 2 == 0 and d <= 64 and q.dtype != torch.float32)


def _fwd_args(q, k, v, o, lse, slopes, geometry, wrap, use_table):
    """(positional args, constexpr keyword args) of the forward kernel; also used by the SASS benchmark."""
    bsz, heads, n, d = q.shape
    (h, w), (codes, tbl, bias_norm, pair_tbl) = geometry
    code_stride = codes.stride(0)
    table = _table_mode(slopes, use_table)
    args = (q, k, v, o, lse, _per_head(slopes, heads), codes, _scaled_table(pair_tbl if table else tbl, slopes, table),
            *_strides(q), *_strides(k), *_strides(v), *_strides(o), heads, n, n_bucket(n), work_bucket(bsz, heads),
            h, w, code_stride, LOG2E / math.sqrt(d), LOG2E * bias_norm)
    return args, dict(HEAD_DIM=d, TABLE=table, WRAP=wrap, COMPUTE_DSLOPE=False, DOT_PREC=_dot_precision(q.dtype),
                      HEAD_PAIR=head_pair(q, slopes, use_table))


def stat_stride(n):
    """Row length of the backward's per-row statistics (lse copy, Δ): N rounded up to CODE_PAD, so every
    query tile reads them without masks and the rows start aligned."""
    return triton.cdiv(n, CODE_PAD) * CODE_PAD


def _bwd_args(do, q, k, v, dq, dk, dv, lse, delta, dsl, slopes, geometry, wrap, use_table):
    """(dK/dV args, dQ args, constexpr keyword args, dQ's HEAD_PAIR) of the backward kernels; also used by
    the SASS benchmark. ``lse`` and ``delta`` are the padded (B, heads, stat_stride(N)) rows that
    _bwd_preprocess_kernel writes."""
    bsz, heads, n, d = q.shape
    (h, w), (codes, tbl, bias_norm, pair_tbl) = geometry
    code_stride = codes.stride(0)
    sm_scale = 1.0 / math.sqrt(d)
    table = _table_mode(slopes, use_table)
    pair = head_pair(q, slopes, use_table)
    if table:  # every table-mode kernel gathers from the pair table
        tbl = pair_tbl
    scaled = _scaled_table(tbl, slopes, table)
    slopes = _per_head(slopes, heads)
    assert lse.shape[-1] == delta.shape[-1] == stat_stride(n)  # the padded rows of _bwd_preprocess_kernel
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), heads, n, n_bucket(n),
               work_bucket(bsz, heads), h, w, code_stride, stat_stride(n))
    scales = (sm_scale * LOG2E, sm_scale, LOG2E * bias_norm)
    dkdv = (q, k, v, do, dk, dv, dq, lse, delta, dsl, slopes, codes, scaled, tbl, *strides, *scales, bias_norm)
    dqa = (q, k, v, do, dq, lse, delta, slopes, codes, scaled, *strides, *scales)
    kw = dict(HEAD_DIM=d, TABLE=table, WRAP=wrap, DOT_PREC=_dot_precision(q.dtype))
    return dkdv, dqa, kw, pair


def _launch_fwd(q, k, v, slopes, h, w, prefix, wrap, normalize, use_table, metric="euclidean"):
    bsz, heads, n, d = q.shape
    geometry = (h, w), device_bias_lookup(h, w, prefix, wrap, normalize, use_table, q.device, metric)
    o = _new_bnhd(q)
    lse = q.new_empty((bsz, heads, n), dtype=torch.float32)

    args, kw = _fwd_args(q, k, v, o, lse, slopes, geometry, wrap, use_table)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]), heads // 2 if kw["HEAD_PAIR"] else heads, bsz)

    with _device_guard(q):
        _fwd_kernel[grid](*args, **kw, HAS_BIAS=_HAS_BIAS, **_LAUNCH_OPTIONS)
    return o, lse


def _launch_bwd(do, q, k, v, o, lse, slopes, h, w, prefix, wrap, normalize, use_table, need_dslopes, need_dq,
                metric="euclidean", atomic_dq=False):
    bsz, heads, n, d = q.shape
    geometry = (h, w), device_bias_lookup(h, w, prefix, wrap, normalize, use_table, q.device, metric)
    _check_tile_offsets("grad_output", do)
    # One allocation for the padded lse copy and Δ (see _bwd_preprocess_kernel).
    lse_pad, delta = q.new_empty((2, bsz, heads, stat_stride(n)), dtype=torch.float32).unbind(0)
    dk, dv = _new_bnhd(q), _new_bnhd(q)
    dq = _new_bnhd(q) if need_dq else dk  # without dQ no kernel writes it (dk stands in for the pointer)
    assert dq.stride() == dk.stride() == dv.stride()  # the kernels share one set of gradient strides
    # Without a slope gradient no kernel writes the partials (delta stands in for the pointer).
    dsl = q.new_empty((bsz, heads, n), dtype=torch.float32) if need_dslopes else delta
    atomic_dq = atomic_dq and need_dq
    # Atomic dQ: the dK/dV kernel adds into an fp32 buffer of the same layout (so the same strides).
    dq_acc = _new_bnhd(q, torch.float32).zero_() if atomic_dq else dq

    def grid_k(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), heads, bsz)

    dkdv_args, dq_args, kw, pair = _bwd_args(do, q, k, v, dq_acc, dk, dv, lse_pad, delta, dsl, slopes, geometry,
                                             wrap, use_table)

    def grid_q(meta):
        return (triton.cdiv(n, meta["BLOCK_M"]), heads // 2 if pair else heads, bsz)

    with _device_guard(q):
        _bwd_preprocess_kernel[(stat_stride(n) // _PREPROCESS_BLOCK_M, heads, bsz)](
            o, do, lse, lse_pad, delta, *_strides(o), *_strides(do), heads, n, stat_stride(n), HEAD_DIM=d,
            BLOCK_M=_PREPROCESS_BLOCK_M,
            **_LAUNCH_OPTIONS)
        _dkdv_kernel[grid_k](*dkdv_args, **kw, COMPUTE_DSLOPE=need_dslopes, ATOMIC_DQ=atomic_dq, HAS_BIAS=_HAS_BIAS,
                             **_LAUNCH_OPTIONS)
        # The dQ kernel, a third of the backward, is skipped for frozen (or detached) queries and with atomic dQ.
        if need_dq and not atomic_dq:
            _dq_kernel[grid_q](*dq_args, **kw, COMPUTE_DSLOPE=False, HEAD_PAIR=pair, HAS_BIAS=_HAS_BIAS,
                               **_LAUNCH_OPTIONS)
    if atomic_dq:
        torch.mul(dq_acc, 1.0 / math.sqrt(d), out=dq)  # one pass: scale and cast
    dslopes = dsl.sum(dim=(0, 2)) if need_dslopes else slopes.new_zeros(slopes.shape)
    return (dq if need_dq else q.new_empty(0)), dk, dv, dslopes


# --------------------------------------------------------------------------------------------
# torch.library registration (opaque to torch.compile, with fake tensors and autograd)
# --------------------------------------------------------------------------------------------

@torch.library.custom_op("alibi_vit::alibi_attention_fwd", mutates_args=())
def alibi_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slopes: torch.Tensor,
                        grid_h: int, grid_w: int, num_prefix_tokens: int, wrap: bool, normalize: bool,
                        use_table: bool, metric: str = "euclidean") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (O, base-2 logsumexp per row). ``slopes`` is fp32 of shape (heads,), or (1,) for one
    slope shared by all heads; ``metric="manhattan"`` needs ``use_table``."""
    return _launch_fwd(q, k, v, slopes.contiguous(), grid_h, grid_w, num_prefix_tokens, wrap, normalize, use_table,
                       metric)


@alibi_attention_fwd.register_fake
def _(q, k, v, slopes, grid_h, grid_w, num_prefix_tokens, wrap, normalize, use_table, metric="euclidean"):
    bsz, heads, n, _ = q.shape
    return _new_bnhd(q), q.new_empty((bsz, heads, n), dtype=torch.float32)


@torch.library.custom_op("alibi_vit::alibi_attention_bwd", mutates_args=())
def alibi_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        lse: torch.Tensor, slopes: torch.Tensor, grid_h: int, grid_w: int, num_prefix_tokens: int,
                        wrap: bool, normalize: bool, use_table: bool, need_dslopes: bool,
                        need_dq: bool, metric: str = "euclidean", atomic_dq: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv, dslopes); dslopes is zeros when ``need_dslopes`` is False, dq is empty
    (0 elements) when ``need_dq`` is False; ``atomic_dq`` see :func:`atomic_dq_enabled`."""
    return _launch_bwd(do, q, k, v, o, lse, slopes.contiguous(), grid_h, grid_w, num_prefix_tokens, wrap, normalize,
                       use_table, need_dslopes, need_dq, metric, atomic_dq)


@alibi_attention_bwd.register_fake
def _(do, q, k, v, o, lse, slopes, grid_h, grid_w, num_prefix_tokens, wrap, normalize, use_table, need_dslopes,
      need_dq, metric="euclidean", atomic_dq=False):
    dq = _new_bnhd(q) if need_dq else q.new_empty(0)
    return dq, _new_bnhd(q), _new_bnhd(q), slopes.new_empty(slopes.shape)


def atomic_dq_default(head_dim, dtype):
    """Whether the backward uses atomic dQ when nothing says otherwise: for 16-bit inputs with head_dim <= 64.
    There the SASS proxy puts its serial bound at about 0.8x the two-kernel backward's for every slope kind,
    with no spills (benchmarks/bench_kernel_sass.py); at head_dim 128 its dK/dV kernel spills, and fp32
    inputs are the exact correctness path, which stays deterministic."""
    return head_dim <= 64 and dtype in (torch.float16, torch.bfloat16)


def atomic_dq_enabled(q=None):
    """Whether a backward pass for ``q`` accumulates dQ with atomic adds inside the dK/dV kernel instead of
    running the separate dQ kernel: :func:`atomic_dq_default` unless ``ALIBI_TRITON_ATOMIC_DQ`` (``1``/``0``)
    or :func:`atomic_dq` says otherwise, and never while ``torch.use_deterministic_algorithms(True)`` is on
    (atomic adds make dQ's last bits vary from run to run)."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    if _ATOMIC_DQ is not None:
        return _ATOMIC_DQ
    return q is not None and atomic_dq_default(q.shape[-1], q.dtype)


@contextlib.contextmanager
def _temporarily(name: str, value):
    """The module setting ``name`` holds ``value`` inside the block, its previous value again after it."""
    previous = globals()[name]
    globals()[name] = value
    try:
        yield
    finally:
        globals()[name] = previous


def bias_compiled_out():
    """Benchmark baseline only: calls inside the block run the same kernels with the bias compiled out
    (``HAS_BIAS=False``), i.e. plain attention without ALiBi, at the same launch configs."""
    return _temporarily("_HAS_BIAS", False)


def atomic_dq(enabled: bool | None = True):
    """Backward passes run inside the block use atomic dQ (True) or the deterministic two-kernel backward
    (False), whatever ``ALIBI_TRITON_ATOMIC_DQ`` says; None: :func:`atomic_dq_default`."""
    return _temporarily("_ATOMIC_DQ", None if enabled is None else bool(enabled))


def backward_bias(mode: str = "auto"):
    """Backward passes run inside the block derive the bias in ``mode``: "auto" (:func:`backward_uses_table`),
    "same" as their forward, or "table"/"sqrt" whatever the forward used (Euclidean metric; Manhattan always
    gathers). The two modes give the same values up to fp32 rounding, so a forward in one mode and a
    backward in the other agree; which is faster differs between the passes on an H100."""
    if mode not in BACKWARD_BIAS_MODES:
        raise ValueError(f"backward bias mode must be one of {BACKWARD_BIAS_MODES}, got {mode!r}")
    return _temporarily("_BWD_BIAS", mode)


def backward_uses_table(q, use_table, metric, atomic):
    """Whether the backward gathers the bias from the difference table (else: per-element sqrt). By default
    ("auto") the atomic-dQ backward on a GPU computes it per element whatever the forward did: on an H100
    (bf16, head_dim 64, ViT-B at 518 and 1022 px) that made forward+backward 8-17% faster for every slope
    kind (re-timed in a second session), because the backward's gathers saturate L1 (74% of its
    throughput in the dK/dV kernel) while the forward, whose gathers leave room, is 9-27% faster with the
    table. Elsewhere nothing was timed, so the backward keeps the forward's mode. The Manhattan metric
    always gathers."""
    if metric != "euclidean" or _BWD_BIAS == "same":
        return use_table
    if _BWD_BIAS == "auto":
        return use_table and not (atomic and q.is_cuda)
    return _BWD_BIAS == "table"


def _setup_context(ctx, inputs, output):
    q, k, v, slopes, grid_h, grid_w, prefix, wrap, normalize, use_table, *rest = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, slopes)
    ctx.geometry = (grid_h, grid_w, prefix, wrap, normalize, use_table)
    ctx.metric, ctx.num_inputs = (rest[0] if rest else "euclidean"), len(inputs)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse, slopes = ctx.saved_tensors
    need_dq, need_dslopes = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[3])
    *geometry, use_table = ctx.geometry
    atomic = atomic_dq_enabled(q)
    dq, dk, dv, dslopes = alibi_attention_bwd(do, q, k, v, o, lse, slopes, *geometry,
                                              backward_uses_table(q, use_table, ctx.metric, atomic), need_dslopes,
                                              need_dq, ctx.metric, atomic)
    grads = (dq if need_dq else None), dk, dv, (dslopes if need_dslopes else None)
    return grads + (None,) * (ctx.num_inputs - len(grads))


alibi_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------

def _validate(q, k, v, grid_size, num_prefix_tokens, slopes, bias_mode):
    (h, w), prefix = check_attention_inputs(q, k, v, grid_size, num_prefix_tokens, slopes)
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
    if _SQRT_OFFSETS == "fp16" and max(h, w) > FP16_EXACT_SIDE:
        raise ValueError(f"ALIBI_TRITON_SQRT_OFFSETS=fp16 is exact for grids up to {FP16_EXACT_SIDE} a side, got "
                         f"{h}x{w}; unset it for this grid")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tile_offsets(name, t)
    _check_output_offsets(heads, n, d)
    if bias_mode not in BIAS_MODES:
        raise ValueError(f"bias_mode must be one of {BIAS_MODES}, got {bias_mode!r}")
    return h, w, prefix


def autocast_inputs(q, k, v):
    """Inside ``torch.autocast`` the op runs in the autocast dtype, as SDPA does (casts are differentiable)."""
    device_type = q.device.type if isinstance(q, torch.Tensor) else "cpu"
    if not torch.is_autocast_enabled(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (q, k, v))


def triton_alibi_attention(q, k, v, grid_size, num_prefix_tokens, slopes, wrap, normalize, *, bias_mode=None,
                           metric="euclidean"):
    """Fused attention with the 2D ALiBi bias: ``softmax(q kᵀ/sqrt(D) + m_h·B) v``.

    Args:
        q, k, v: (B, heads, N, head_dim), float16/bfloat16/float32, any strides;
            head_dim in ``SUPPORTED_HEAD_DIMS``; ``N = num_prefix_tokens + h·w``.
        grid_size: patch grid (h, w), patches row-major after the prefix tokens.
        num_prefix_tokens: CLS/register tokens at the front (zero bias).
        slopes: (heads,) tensor, or None for slope 1 on every head (then no slope gradient).
            A gradient reaches it when it requires grad.
        wrap, normalize: see docs/method.md §2.
        bias_mode: "table" or "sqrt" (how the kernel derives the bias; same result).
            Default: ``ALIBI_TRITON_BIAS`` or "table"; always "table" for the Manhattan metric.
        metric: "euclidean" (default) or "manhattan" (``d = dy + dx``; table mode only, so an
            explicit ``bias_mode="sqrt"`` is a ValueError).

    Inside ``torch.autocast`` the inputs are cast to the autocast dtype first. fp32 inputs use
    exact products, or tf32 when ``torch.get_float32_matmul_precision()`` allows it.

    Returns:
        (B, heads, N, head_dim) in q's dtype (the autocast dtype under autocast), stored in
        (B, N, heads, D) memory order.
    """
    if check_metric(metric) != "euclidean":
        if bias_mode == "sqrt":
            raise ValueError(f"bias_mode='sqrt' computes Euclidean distances only; the {metric} metric uses "
                             "bias_mode='table'")
        bias_mode = "table"
    bias_mode = DEFAULT_BIAS_MODE if bias_mode is None else bias_mode
    q, k, v = autocast_inputs(q, k, v)
    h, w, prefix = _validate(q, k, v, grid_size, num_prefix_tokens, slopes, bias_mode)
    if slopes is None:
        slopes32 = unit_slope(q.device)  # one slope for all heads
    else:
        slopes32 = slopes.to(torch.float32)  # differentiable cast: the gradient returns in slopes' dtype
    if metric == "euclidean":
        o, _ = alibi_attention_fwd(q, k, v, slopes32, h, w, prefix, bool(wrap), bool(normalize), bias_mode == "table")
    else:
        o, _ = alibi_attention_fwd(q, k, v, slopes32, h, w, prefix, bool(wrap), bool(normalize), True, metric)
    return o
