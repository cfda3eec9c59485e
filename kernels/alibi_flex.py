"""FlexAttention backend for the 2D ALiBi bias of docs/method.md §2.

``torch.nn.attention.flex_attention`` applies a ``score_mod(score, b, h, q_idx, kv_idx)`` to
every logit inside a fused kernel; ``score`` already carries the ``1/sqrt(head_dim)`` scale.
Two score_mods give the same bias (``bias_mode``):

* ``"sqrt"`` (default): rebuilds ``B`` from the token indices exactly as the spec states it
  (row/column from ``(idx - prefix) // w`` and ``% w``, per-axis wrap, Euclidean distance,
  normalisation, zero for prefix tokens) and adds ``m_h · B``; ``metric="manhattan"`` sums the
  two wrapped offsets instead of taking the Euclidean norm.
* ``"table"``: gathers ``B`` from the difference table the fused Triton kernel uses
  (:func:`kernels.alibi_bias.device_bias_lookup`: per-token query codes ``a_i`` and negated key
  codes ``-b_j``, ``B_ij = T[a_i - b_j]``, prefix codes landing in zeros), captured as tensors: one
  gathered load and an add per logit instead of the integer divisions, wrap and ``sqrt``. It is the
  fairest Flex rival of the fused kernel's own gather, and any metric is just another table.
* ``"dense"``: reads ``B_ij`` from the materialised ``(N, N)`` bias that the sdpa backend shares
  (:func:`kernels.alibi_bias.cached_alibi_bias`, in the inputs' dtype): one load per logit and no index
  arithmetic, at the sdpa backend's O(N²) memory. The way Flex applies a T5-style bias; a baseline.

Execution:

* CUDA: the wrapper is ``torch.compile``-d once per process (module-level, ``dynamic=False``)
  so flex runs as a generated Triton kernel. Grid, prefix and wrap are compile-time
  constants (integer division by a constant is cheap); each distinct (grid, prefix, wrap)
  specialises one compiled variant; torch's recompile limit (8 by
  default) bounds how many such variants one process keeps.
* CPU: eager flex, an unfused O(N²) reference. Torch implements flex backward only on CUDA,
  so on the CPU this backend is inference-only and says so with a ValueError when inputs
  require grad.

Slopes: ``slope_h / d_max`` is one (heads,) fp32 tensor captured by the score_mod; flex
differentiates captured tensors, so learned slopes receive ``Σ_ij dS_ij·B_ij``. Older torch
releases had bugs in gradients of captured tensors; the GPU tests in
``tests/test_flex_attention.py`` check this on the installed version.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import flex_attention

from .alibi_bias import cached_alibi_bias, check_grid, check_metric, device_bias_lookup, max_distance

__all__ = ["BIAS_MODES", "flex_alibi_attention"]

BIAS_MODES = ("sqrt", "table", "dense")
_COMPILED = {}


def _alibi_flex(q, k, v, head_scale, h: int, w: int, prefix: int, wrap: bool, manhattan: bool = False,
                kernel_options=None):
    def score_mod(score, b, head, q_idx, kv_idx):
        # Prefix tokens give negative "patch" indices; their bias is masked to 0 below.
        qp = q_idx - prefix
        kp = kv_idx - prefix
        dy = torch.abs(qp // w - kp // w)
        dx = torch.abs(qp % w - kp % w)
        if wrap:
            dy = torch.minimum(dy, h - dy)
            dx = torch.minimum(dx, w - dx)
        if manhattan:
            dist = (dy + dx).to(torch.float32)
        else:
            dist = torch.sqrt((dy * dy + dx * dx).to(torch.float32))
        bias = torch.where((q_idx >= prefix) & (kv_idx >= prefix), -dist * head_scale[head], torch.zeros_like(dist))
        return score + bias.to(score.dtype)

    return flex_attention(q, k, v, score_mod=score_mod, kernel_options=kernel_options)


def _alibi_flex_table(q, k, v, head_scale, query_codes, key_codes, table, kernel_options=None):
    # key_codes hold -b_j, so a_i + (-b_j) indexes the table (prefix codes land in its run of zeros).
    def score_mod(score, b, head, q_idx, kv_idx):
        bias = table[query_codes[q_idx] + key_codes[kv_idx]] * head_scale[head]
        return score + bias.to(score.dtype)

    return flex_attention(q, k, v, score_mod=score_mod, kernel_options=kernel_options)


def _alibi_flex_dense(q, k, v, head_scale, bias, kernel_options=None):
    def score_mod(score, b, head, q_idx, kv_idx):
        return score + (bias[q_idx, kv_idx] * head_scale[head]).to(score.dtype)

    return flex_attention(q, k, v, score_mod=score_mod, kernel_options=kernel_options)


_SCORE_MODS = {"sqrt": _alibi_flex, "table": _alibi_flex_table, "dense": _alibi_flex_dense}


def _compiled(bias_mode="sqrt"):
    if bias_mode not in _COMPILED:
        _COMPILED[bias_mode] = torch.compile(_SCORE_MODS[bias_mode], dynamic=False)
    return _COMPILED[bias_mode]


def table_arguments(grid_size, num_prefix_tokens, wrap, normalize, device, metric="euclidean"):
    """(query codes, negated key codes, table) of the table score_mod: int32 (N,), int32 (N,), fp32, cached
    per grid (:func:`kernels.alibi_bias.device_bias_lookup`); the table holds ``B`` itself, normalised."""
    h, w = check_grid(grid_size)
    n = int(num_prefix_tokens) + h * w
    codes, table, _, _ = device_bias_lookup(h, w, int(num_prefix_tokens), bool(wrap), bool(normalize), True,
                                            torch.device(device), metric)
    return codes[0, :n], codes[1, :n], table


def flex_alibi_attention(q, k, v, grid_size, num_prefix_tokens, slopes, wrap, normalize, metric="euclidean",
                         bias_mode="sqrt"):
    """Attention with the 2D ALiBi bias through FlexAttention.

    Same contract as :func:`kernels.alibi_attention`: (B, heads, N, head_dim) in and out,
    ``slopes`` of shape (heads,) or None (slope 1, no gradient); ``metric`` "euclidean" or "manhattan";
    ``bias_mode`` "sqrt" (the bias from token indices), "table" (gathered from a difference table) or
    "dense" (read from the materialised (N, N) bias).
    """
    if not q.is_floating_point():
        raise ValueError(f"the flex backend needs floating-point inputs, got {q.dtype}")
    if q.shape[-1] < 16:
        raise ValueError(f"the flex backend needs head_dim >= 16, got {q.shape[-1]}")
    if bias_mode not in BIAS_MODES:
        raise ValueError(f"bias_mode must be one of {BIAS_MODES}, got {bias_mode!r}")
    h, w = check_grid(grid_size)
    prefix = int(num_prefix_tokens)
    manhattan = check_metric(metric) == "manhattan"
    d_max = max_distance((h, w), wrap, metric)
    # A 1×1 grid has d_max = 0 and d̂ = 0 by definition. The table holds d̂ already.
    norm_scale = (1.0 / d_max if d_max > 0 else 0.0) if normalize and bias_mode == "sqrt" else 1.0
    # slope·(1/d_max) per head as one captured fp32 tensor: a float in the closure would turn into
    # a symbolic float when flex's internal compile sees a second value, which flex rejects.
    # Autograd carries the gradient of head_scale back to learned slopes.
    if slopes is None:
        head_scale = torch.full((q.shape[1],), norm_scale, device=q.device, dtype=torch.float32)
    else:
        head_scale = slopes.to(torch.float32) * norm_scale
    if q.device.type != "cuda" and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, slopes)):
        raise ValueError("the flex backend has no backward on the CPU (a torch limitation); use backend='eager' "
                         "or 'sdpa' for training on the CPU")
    if bias_mode == "table":
        tables = table_arguments((h, w), prefix, wrap, normalize, q.device, metric)
        run = _compiled("table") if q.device.type == "cuda" else _alibi_flex_table
        return run(q, k, v, head_scale, *tables)
    if bias_mode == "dense":
        with torch.inference_mode(False), torch.no_grad():  # the shared bias stays an ordinary tensor
            bias = cached_alibi_bias((h, w), prefix, bool(wrap), bool(normalize), q.device, q.dtype,
                                     *(() if metric == "euclidean" else (metric,)))
        run = _compiled("dense") if q.device.type == "cuda" else _alibi_flex_dense
        return run(q, k, v, head_scale, bias)
    if q.device.type == "cuda":
        if manhattan:  # its own compiled variant; the Euclidean call is unchanged
            return _compiled()(q, k, v, head_scale, h, w, prefix, bool(wrap), True)
        return _compiled()(q, k, v, head_scale, h, w, prefix, bool(wrap))
    return _alibi_flex(q, k, v, head_scale, h, w, prefix, bool(wrap), manhattan)
