"""The attention layers of ALiBi (and NoPE) ViTs: timm's ``Attention`` (DINOv2) and
``EvaAttention`` (DINOv3) with the 2D bias added.

They keep timm's parameter names (``qkv``, ``proj``, ``q_norm``, ``q_bias``…), so a converted
model's state_dict is a plain timm state_dict; a learned slope adds ``m`` of shape (heads, 1, 1),
the constant and geometric slopes are non-persistent buffers. The patch grid of the current
forward pass comes from a :class:`PatchGrid` shared with the model, which sets it from the
patch embedding's output. Both layers share one bias path (:class:`PositionBias`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import Attention, Format
from timm.models.eva import EvaAttention

from kernels import alibi_attention
from kernels.alibi_bias import check_metric, patch_distances
from kernels.attention import BACKENDS

SLOPE_SCHEMES = ("constant", "learned", "learned_random", "geometric")
# The keyword arguments of configure_position (and of convert_to_alibi): how position enters the attention.
POSITION_KWARGS = ("slopes", "wrap", "normalize", "jitter", "jitter_seed", "backend", "metric")


class PatchGrid:
    """The (h, w) patch grid of the forward pass in flight, shared by the model and its layers."""

    def __init__(self):
        self.size: tuple[int, int] | None = None

    def __deepcopy__(self, memo):
        return memo.setdefault(id(self), PatchGrid())

    def __repr__(self):
        return f"PatchGrid(size={self.size})"


def hand_over_patch_grid(model) -> None:
    """Let the patch embedding take any image size and hand its (h, w) grid over in NHWC layout.

    The attention layers read the grid from it (no position embedding resizes anything).
    """
    model.dynamic_img_size = True
    model.patch_embed.strict_img_size = False
    model.patch_embed.flatten = False
    model.patch_embed.output_fmt = Format.NHWC


def initial_slopes(scheme: str, num_heads: int) -> torch.Tensor:
    """Per-head slopes, shape (heads, 1, 1): ones (``constant``, ``learned``), uniform random in [0, 1) from
    torch's global RNG (``learned_random``, as the authors' learned slopes start), or ALiBi's geometric
    2^(-8(h+1)/H)."""
    if scheme == "learned_random":
        return torch.rand(num_heads).view(-1, 1, 1)
    if scheme == "geometric":
        return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)]).view(-1, 1, 1)
    return torch.ones(num_heads, 1, 1)


class PositionBias:
    """The 2D ALiBi bias (or none, for NoPE) of one attention layer: options, slopes and the attention call.

    A mixin for timm attention modules; subclasses compute q, k, v their own way and call
    :meth:`_attend`.
    """

    def configure_position(self, patch_grid: PatchGrid, num_prefix_tokens: int, *, use_bias: bool = True,
                           slopes: str = "constant", wrap: bool = True, normalize: bool = True,
                           jitter: float = 0.0, jitter_seed: int = 0, backend: str = "auto",
                           metric: str = "euclidean") -> None:
        check_metric(metric)
        if slopes not in SLOPE_SCHEMES:
            raise ValueError(f"unknown slope scheme {slopes!r}; choose one of {', '.join(SLOPE_SCHEMES)}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if not jitter >= 0.0:
            raise ValueError(f"jitter must be a non-negative standard deviation, got {jitter!r}")
        if self.attn_drop.p > 0:
            raise ValueError("ALiBi attention has no attention dropout; build the model with attn_drop_rate=0")
        self.patch_grid = patch_grid
        self.num_prefix_tokens = int(num_prefix_tokens)
        self.use_bias = bool(use_bias)
        self.slope_scheme = slopes
        self.wrap, self.normalize, self.backend = bool(wrap), bool(normalize), backend
        self.metric = metric
        self.jitter, self.jitter_seed = float(jitter), int(jitter_seed)
        self._jitter_generators = {}
        # Re-configuring replaces the previous slope, parameter or buffer.
        self._parameters.pop("m", None)
        self._buffers.pop("m", None)
        m = initial_slopes(slopes, self.num_heads).to(self.proj.weight.device)
        if slopes in ("learned", "learned_random"):
            self.m = nn.Parameter(m)
        else:
            self.register_buffer("m", m, persistent=False)

    def _jittered_bias(self, grid, n, device, dtype):
        # Test-time jitter (paper S4): fresh N(0, σ²) noise on d̂ at every call, from a seeded generator.
        gen = self._jitter_generators.get(device)
        if gen is None:
            gen = self._jitter_generators[device] = torch.Generator(device=device).manual_seed(self.jitter_seed)
        dist = patch_distances(grid, wrap=self.wrap, normalize=self.normalize, device=device, metric=self.metric)
        noise = torch.randn(dist.shape, generator=gen, device=device) * self.jitter
        bias = torch.zeros(n, n, device=device, dtype=torch.float32)
        p = self.num_prefix_tokens
        bias[p:, p:] = -(dist + noise)
        return bias.to(dtype)

    def _check_call(self, attn_mask, is_causal):
        if attn_mask is not None or is_causal:
            raise ValueError("ALiBi/NoPE attention takes no attention mask and is never causal")
        grid = self.patch_grid.size
        if grid is None:
            raise RuntimeError("the patch grid is unknown: call the whole model, not its blocks alone")
        return grid

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid) -> torch.Tensor:
        """softmax(q kᵀ/√d + m_h·B) v on (B, heads, N, d) tensors, with the options of this layer."""
        if not self.use_bias:
            return F.scaled_dot_product_attention(q, k, v)
        if self.jitter > 0:
            bias = self._jittered_bias(grid, q.shape[-2], q.device, q.dtype)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.m.to(q.dtype) * bias)
        slopes = None if self.slope_scheme == "constant" else self.m.view(-1)
        return alibi_attention(q, k, v, grid, self.num_prefix_tokens, slopes, wrap=self.wrap,
                               normalize=self.normalize, backend=self.backend, metric=self.metric)

    def _finish(self, x: torch.Tensor, gate) -> torch.Tensor:
        # (B, heads, N, d) → (B, N, C), then the layer's own output norm, gate and projection.
        B, _, N, _ = x.shape
        x = x.transpose(1, 2).reshape(B, N, -1)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))

    def extra_repr(self) -> str:
        if not getattr(self, "use_bias", True):
            return "position=none"
        return (f"slopes={self.slope_scheme}, wrap={self.wrap}, normalize={self.normalize}, "
                f"jitter={self.jitter}, backend={self.backend}"
                + ("" if self.metric == "euclidean" else f", metric={self.metric}"))


class AlibiAttention(PositionBias, Attention):
    """timm ``Attention`` whose logits get ``m_h · B`` (docs/method.md §2), or no position at all (NoPE)."""

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        grid = self._check_call(attn_mask, is_causal)
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if getattr(self, "gate", None) is not None else None
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        return self._finish(self._attend(q, k, v, grid), gate)


class AlibiEvaAttention(PositionBias, EvaAttention):
    """timm ``EvaAttention`` (DINOv3's attention) with RoPE replaced by ``m_h · B``, or by nothing (NoPE)."""

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        if rope is not None:
            raise ValueError("ALiBi/NoPE DINOv3 attention takes no rotary embedding: position is the 2D bias")
        grid = self._check_call(attn_mask, is_causal)
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        if self.qkv is not None:
            # EVA keeps q and v biases apart; the k bias is a fixed zero buffer (a key bias cannot
            # change a softmax over keys).
            bias = None if self.q_bias is None else torch.cat((self.q_bias, self.k_bias, self.v_bias))
            qkv = F.linear(x, self.qkv.weight, bias)
            q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (proj(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.q_norm(q), self.k_norm(k)
        return self._finish(self._attend(q, k, v, grid), gate)
