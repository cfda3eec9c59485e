"""``alibi_attention``: multi-head attention with the 2D ALiBi bias, behind one switch of backends.

Every backend computes, per head ``h`` with slope ``m_h``,

    softmax(q kᵀ / sqrt(head_dim) + m_h · B) v

with ``B`` from :func:`kernels.alibi_bias`. Backends differ only in how ``B`` is applied:

- ``"eager"``: explicit scores and softmax; the readable reference.
- ``"sdpa"``: ``torch.nn.functional.scaled_dot_product_attention`` with ``B`` materialised once
  per grid/device/dtype and shared by all layers (O(N²) memory).
- ``"triton"``: fused FlashAttention-style kernel that derives ``B`` from token coordinates on
  the fly (O(N) memory; :mod:`kernels.alibi_triton`).
- ``"flex"``: ``torch.nn.attention.flex_attention`` with an equivalent score_mod
  (:mod:`kernels.alibi_flex`).

``"auto"`` follows a rule (:func:`auto_backend`: triton for CUDA tensors it supports, sdpa elsewhere)
on the CPU; on a GPU it times the fused kernel against SDPA with the materialised bias once per kind
of call and runs the faster (:mod:`kernels.backend_choice`; :func:`kernels.explain` says what it chose).
Every backend also takes ``metric="manhattan"`` (``d = dy + dx``; see :mod:`kernels.alibi_bias`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import backend_choice
from .alibi_bias import cached_alibi_bias, check_attention_inputs, check_metric

__all__ = ["BACKENDS", "alibi_attention", "auto_backend", "explain", "resolve_backend"]

explain = backend_choice.explain

BACKENDS = ("auto", "eager", "sdpa", "triton", "flex")

# The fused backends are imported here, not on first use, so that torch.compile never meets an
# import inside a traced forward (Triton reads TRITON_INTERPRET at this point). A platform
# without triton, or a torch without flex_attention, keeps the ImportError to report on use.
_UNAVAILABLE: dict[str, ImportError] = {}
try:
    from . import alibi_triton
except ImportError as err:
    alibi_triton, _UNAVAILABLE["triton"] = None, err
try:
    from . import alibi_flex
except ImportError as err:
    alibi_flex, _UNAVAILABLE["flex"] = None, err


def _slopes_or_ones(slopes, num_heads, like):
    if slopes is None:
        return torch.ones(num_heads, device=like.device, dtype=like.dtype)
    return slopes.to(like.dtype)


def _shared_bias(grid_size, num_prefix_tokens, wrap, normalize, device, dtype, metric="euclidean"):
    # The cached bias must be an ordinary tensor even when first built under inference_mode,
    # or a later training step could not save it for backward.
    with torch.inference_mode(False), torch.no_grad():
        if metric == "euclidean":  # the default's cache key stays what it always was
            return cached_alibi_bias(grid_size, num_prefix_tokens, wrap, normalize, torch.device(device), dtype)
        return cached_alibi_bias(grid_size, num_prefix_tokens, wrap, normalize, torch.device(device), dtype, metric)


def eager_alibi_attention(q, k, v, grid_size, num_prefix_tokens, slopes, wrap, normalize, metric="euclidean"):
    bias = _shared_bias(grid_size, num_prefix_tokens, wrap, normalize, q.device, q.dtype, metric)
    m = _slopes_or_ones(slopes, q.shape[1], q)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1]) + m.view(1, -1, 1, 1) * bias
    return scores.softmax(dim=-1) @ v


def sdpa_alibi_attention(q, k, v, grid_size, num_prefix_tokens, slopes, wrap, normalize, metric="euclidean"):
    bias = _shared_bias(grid_size, num_prefix_tokens, wrap, normalize, q.device, q.dtype, metric)
    # Per-head slopes make a 4-D (1, heads, N, N) mask: torch's cuDNN attention takes 2-D and 4-D masks
    # only, and a 3-D one would send every per-head call to the slower memory-efficient kernel.
    mask = bias if slopes is None else slopes.to(q.dtype).view(1, -1, 1, 1) * bias
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _backend_fn(name):
    if name in _UNAVAILABLE:
        raise ValueError(f"attention backend {name!r} is unavailable here: {_UNAVAILABLE[name]}")
    return {"eager": eager_alibi_attention, "sdpa": sdpa_alibi_attention,
            "triton": getattr(alibi_triton, "triton_alibi_attention", None),
            "flex": getattr(alibi_flex, "flex_alibi_attention", None)}[name]


def auto_backend(device_type: str, head_dim: int, dtype: torch.dtype) -> str:
    """What ``"auto"`` picks for queries on ``device_type`` with this head_dim and (autocast) dtype.

    The fused kernel for CUDA tensors whose head_dim and dtype it supports, except fp32 under
    ``torch.get_float32_matmul_precision() == "highest"`` (exact fp32 products would run without
    tensor cores: SDPA is faster there); SDPA with the materialised bias otherwise.
    """
    if alibi_triton is None or device_type != "cuda":
        return "sdpa"
    if head_dim not in alibi_triton.SUPPORTED_HEAD_DIMS or dtype not in alibi_triton.SUPPORTED_DTYPES:
        return "sdpa"
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "sdpa"
    return "triton"


def _call_dtype(q):
    device_type = q.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else q.dtype


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The backend the rule gives ``alibi_attention(..., backend=backend)`` for queries ``q``.

    ``"auto"``: see :func:`auto_backend`; inside ``torch.autocast`` the autocast dtype counts. On a GPU
    ``alibi_attention`` may run a faster candidate it timed instead (:func:`kernels.explain`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return auto_backend(q.device.type, q.shape[-1], _call_dtype(q))


def _slope_kind(slopes, backward):
    if slopes is None:
        return "constant"
    return "learned" if backward and slopes.requires_grad else "per-head"


def _auto_choice(q, k, v, grid, prefix, slopes, wrap, normalize, metric):
    """What ``backend="auto"`` runs for this call (:mod:`kernels.backend_choice`)."""
    dtype = _call_dtype(q)
    rule = auto_backend(q.device.type, q.shape[-1], dtype)
    if torch.compiler.is_compiling():
        return rule  # nothing is timed inside a trace; the rule decides what gets compiled
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or (
        slopes is not None and slopes.requires_grad))
    kind = backend_choice.CallKind(q.device, dtype, tuple(q.shape), grid, prefix, wrap, normalize, metric,
                                   _slope_kind(slopes, backward), backward)

    def runner(name):
        fn = _backend_fn(name)
        extra = {} if metric == "euclidean" else {"metric": metric}

        def run():
            leaves = [None if t is None else t.detach().requires_grad_(backward and t.requires_grad)
                      for t in (q, k, v, slopes)]
            with torch.set_grad_enabled(backward):
                out = fn(*leaves[:3], grid, prefix, leaves[3], wrap, normalize, **extra)
                if backward:
                    out.backward(torch.ones_like(out))
        return run

    chooser = backend_choice.chooser()
    return chooser.choose(kind, rule, lambda: {n: runner(n) for n in chooser.candidates if n not in _UNAVAILABLE},
                          q.device)


def alibi_attention(q, k, v, grid_size, num_prefix_tokens, slopes=None, *, wrap=True, normalize=True,
                    backend="auto", metric="euclidean"):
    """Attention over ``(batch, heads, N, head_dim)`` tensors with the 2D ALiBi bias.

    Args:
        q, k, v: tensors of shape (B, heads, N, head_dim), ``N = num_prefix_tokens + h·w``.
        grid_size: the patch grid ``(h, w)``; patches are in row-major order after the prefix.
        num_prefix_tokens: CLS and register tokens at the front; they get zero bias.
        slopes: per-head slopes, shape (heads,); ``None`` means 1 for every head. Gradients
            reach it when it requires grad.
        wrap: measure distances on a torus (the default), making attention circulant.
        normalize: divide distances by the grid's largest distance, so the bias is resolution-free.
        backend: one of ``BACKENDS``.
        metric: ``"euclidean"`` (the default, the paper's bias) or ``"manhattan"`` (``d = dy + dx``,
            a baseline), through every backend.

    Returns:
        Tensor of shape (B, heads, N, head_dim), dtype of ``q``.
    """
    grid, prefix = check_attention_inputs(q, k, v, grid_size, num_prefix_tokens, slopes)
    check_metric(metric)
    if backend == "auto":
        name = _auto_choice(q, k, v, grid, prefix, slopes, bool(wrap), bool(normalize), metric)
    else:
        name = resolve_backend(backend, q)
    if metric == "euclidean":
        return _backend_fn(name)(q, k, v, grid, prefix, slopes, bool(wrap), bool(normalize))
    return _backend_fn(name)(q, k, v, grid, prefix, slopes, bool(wrap), bool(normalize), metric=metric)
