"""Attention-head diagnostics: where each head of each layer looks (sinks, self-attention, reach).

For every layer and head, over the *patch* queries of a set of images (CLS and register queries
are left out; the prefix tokens are CLS + registers, docs/method.md §1):

- ``prefix_mass``: mean attention probability on the prefix tokens. A head near 1 is a *sink*:
  it parks its attention on CLS/registers, which the ALiBi bias never penalises.
- ``self_mass``: mean attention on the query's own token.
- ``entropy``: entropy of the attention row over all N keys divided by log N (0: one key, 1: uniform).
- ``mean_distance``: Σ_j p_ij d_ij / Σ_j p_ij over patch keys j, in patches, averaged over
  queries: how far a head looks among the patches it does attend to (the prefix mass is left out,
  so a sink is not mistaken for a local head). d is measured like the layer's own bias (on the
  torus when the layer wraps, with its metric), plain Euclidean for layers without an ALiBi bias.

The probabilities are recomputed, layer by layer, from the input a forward pre-hook sees at each
attention layer: queries and keys from the layer's own weights (q/k norms, DINOv3's RoPE and the
ALiBi bias included, test-time jitter left out), softmax in float32 (float64 for float64
models), in chunks of queries so memory stays bounded at any image size. The model's own
forward, fused kernels included, runs unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from timm.layers import Attention
from timm.models.eva import EvaAttention

from kernels.alibi_bias import check_grid, max_distance
from ..models.attention import AlibiAttention, AlibiEvaAttention, PositionBias, initial_slopes

__all__ = ["DEFAULT_LOCAL", "DEFAULT_SELF", "DEFAULT_SINK", "STATISTICS", "HeadStats", "attention_statistics",
           "distance_rows", "figure_to_array", "head_parameter_masks", "head_statistics", "plot_head_maps", "reinit_head_parameters"]

STATISTICS = ("prefix_mass", "self_mass", "entropy", "mean_distance")
DEFAULT_SINK, DEFAULT_SELF, DEFAULT_LOCAL = 0.9, 0.9, 1.0
# Query chunks hold at most this many attention probabilities (×4 temporaries, float32: ≈ 256 MB).
MAX_CHUNK_ELEMENTS = 2 ** 24

# Forwards whose queries and keys _queries_keys recomputes exactly; a subclass that overrides
# forward (a fused-only layer, say) may compute something else, so it is refused.
_KNOWN_FORWARDS = {Attention.forward, EvaAttention.forward, AlibiAttention.forward, AlibiEvaAttention.forward}


# ---- the statistics of one batch of attention rows ------------------------------------------------

def distance_rows(grid, rows: torch.Tensor, *, wrap: bool, metric: str = "euclidean",
                  dtype=torch.float32) -> torch.Tensor:
    """Distances in patches from patches ``rows`` (row-major indices) to every patch: (len(rows), h·w).

    The same geometry as :func:`kernels.alibi_bias.patch_distances` (unnormalised), one block of
    rows at a time so no (h·w)² array is needed.
    """
    h, w = check_grid(grid)
    cols = torch.arange(h * w, device=rows.device)
    dy = (rows[:, None] // w - cols[None, :] // w).abs()
    dx = (rows[:, None] % w - cols[None, :] % w).abs()
    if wrap:
        dy, dx = torch.minimum(dy, h - dy), torch.minimum(dx, w - dx)
    if metric == "manhattan":
        return (dy + dx).to(dtype)
    return torch.sqrt((dy * dy + dx * dx).to(dtype))


def attention_statistics(probs: torch.Tensor, query_patches: torch.Tensor, grid, num_prefix_tokens: int, *,
                         wrap: bool, metric: str = "euclidean") -> dict[str, torch.Tensor]:
    """Per-head sums over queries of the four statistics, for attention rows of patch queries.

    ``probs``: (B, heads, Q, N) probabilities of the queries at patch indices ``query_patches``
    (Q of them) over all N = prefix + h·w keys. Returns float64 (heads,) sums of
    ``prefix_mass``, ``self_mass``, ``entropy`` (normalised) and ``mean_distance`` (over the
    queries whose patch mass is > 0), and the counts ``queries`` and ``distance_queries``.
    """
    p = int(num_prefix_tokens)
    n = probs.shape[-1]
    patch = probs[..., p:]
    prefix = probs[..., :p].sum(-1)
    own = patch.gather(-1, query_patches.view(1, 1, -1, 1).expand(*patch.shape[:-1], 1)).squeeze(-1)
    entropy = torch.special.entr(probs).sum(-1) / math.log(n) if n > 1 else torch.zeros_like(prefix)
    dist = distance_rows(grid, query_patches, wrap=wrap, metric=metric, dtype=probs.dtype)
    mass = patch.sum(-1)
    reach = (patch * dist).sum(-1) / mass
    valid = mass > 0  # a row whose patch probabilities all underflowed says nothing about distance

    def total(x):
        return x.sum(dim=(0, 2), dtype=torch.float64)

    return {"prefix_mass": total(prefix), "self_mass": total(own), "entropy": total(entropy),
            "mean_distance": total(torch.where(valid, reach, torch.zeros_like(reach))),
            "queries": torch.full((probs.shape[1],), float(probs.shape[0] * probs.shape[2]), dtype=torch.float64),
            "distance_queries": total(valid.to(probs.dtype))}


# ---- queries, keys and the bias of one attention layer ------------------------------------------

def _check_attention(name: str, attn) -> None:
    if not isinstance(attn, (Attention, EvaAttention)) or type(attn).forward not in _KNOWN_FORWARDS:
        raise ValueError(
            f"cannot obtain the attention probabilities of {name} ({type(attn).__name__}): the head diagnostics "
            "recompute them from timm's Attention/EvaAttention or alibi_vit's AlibiAttention/AlibiEvaAttention, "
            "and this layer's forward is none of those (a fused-only path exposes no probabilities); give the "
            "model such attention layers (e.g. alibi_vit.convert_to_alibi) or an eager path with those weights")


def _queries_keys(attn, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k of shape (B, heads, N, d) exactly as the layer's forward makes them (before the 1/√d scale)."""
    B, N, _ = x.shape
    if isinstance(attn, EvaAttention):
        if attn.qkv is not None:
            bias = None if attn.q_bias is None else torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
            qkv = F.linear(x, attn.qkv.weight, bias) if bias is not None else attn.qkv(x)
            q, k, _ = qkv.reshape(B, N, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k = (proj(x).reshape(B, N, attn.num_heads, -1).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj))
    else:
        qkv = attn.qkv(x).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k, _ = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    if rope is not None:
        from timm.layers import apply_rot_embed_cat

        npt, half = attn.num_prefix_tokens, getattr(attn, "rotate_half", False)
        q = torch.cat([q[:, :, :npt], apply_rot_embed_cat(q[:, :, npt:], rope, half=half)], dim=2)
        k = torch.cat([k[:, :, :npt], apply_rot_embed_cat(k[:, :, npt:], rope, half=half)], dim=2)
    return q, k


def _has_bias(attn) -> bool:
    return isinstance(attn, PositionBias) and attn.use_bias


def _position_of(model, attn) -> str:
    """How position enters this layer, as the CSV's ``position`` column says it."""
    if isinstance(attn, PositionBias):
        return f"alibi ({attn.slope_scheme} slopes)" if attn.use_bias else "none (NoPE)"
    if getattr(model, "rope", None) is not None:
        return "RoPE"
    pos = getattr(model, "pos_embed", None)
    if pos is not None:
        return "learned pos. embedding" if pos.requires_grad else "fixed pos. embedding"
    return "none"


class _LayerObserver:
    """A forward pre-hook on one attention layer that adds its heads' statistics of every call to sums."""

    def __init__(self, attn, num_prefix_tokens: int, grid_box: list, max_elements: int):
        self.attn, self.grid_box, self.max_elements = attn, grid_box, max_elements
        self.prefix = attn.num_prefix_tokens if isinstance(attn, PositionBias) else num_prefix_tokens
        self.sums: dict[str, torch.Tensor] = {}

    def __call__(self, module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        if kwargs.get("attn_mask") is not None or kwargs.get("is_causal"):
            raise ValueError("the head diagnostics take attention without a mask, never causal")
        grid = self.grid_box[0]
        p, (h, w) = self.prefix, grid
        if x.shape[1] != p + h * w:
            raise ValueError(f"{type(module).__name__} sees {x.shape[1]} tokens, not {p} prefix + {h}×{w} patches: "
                             "the head diagnostics need every patch token (no patch dropout or pooling)")
        q, k = _queries_keys(module, x, kwargs.get("rope"))
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        q, k = q.to(dtype) * q.shape[-1] ** -0.5, k.to(dtype)
        biased = _has_bias(module)
        wrap = module.wrap if biased else False
        metric = module.metric if biased else "euclidean"
        if biased:
            d_max = max_distance(grid, module.wrap, module.metric)
            norm = (1.0 / d_max if d_max > 0 else 0.0) if module.normalize else 1.0
            slopes = module.m.detach().to(dtype).view(1, -1, 1, 1)
        B, H, N, _ = q.shape
        chunk = max(1, self.max_elements // max(1, B * H * N))
        for start in range(0, h * w, chunk):
            rows = torch.arange(start, min(start + chunk, h * w), device=q.device)
            logits = q[:, :, p + rows] @ k.transpose(-2, -1)
            if biased:
                # The layer's B = −d/d_max on patch keys, 0 on prefix keys (docs/method.md §2).
                d = distance_rows(grid, rows, wrap=module.wrap, metric=module.metric, dtype=dtype)
                logits[..., p:] -= slopes * (d * norm)
            stats = attention_statistics(logits.softmax(-1), rows, grid, p, wrap=wrap, metric=metric)
            for key, value in stats.items():
                self.sums[key] = self.sums.get(key, 0) + value.cpu()
        return None


# ---- the whole model ------------------------------------------------------------------------------

@dataclass
class HeadStats:
    """Per-layer, per-head means (each a float64 (layers, heads) tensor) and what each layer's position is."""

    prefix_mass: torch.Tensor
    self_mass: torch.Tensor
    entropy: torch.Tensor
    mean_distance: torch.Tensor
    slopes: torch.Tensor  # (layers, heads): the ALiBi slope m_h, NaN for layers without an ALiBi bias
    position: list[str]  # per layer, e.g. "alibi (constant slopes)", "learned pos. embedding"
    torus: list[bool]  # per layer: distances measured on the torus
    num_prefix_tokens: int
    num_images: int
    extra: dict = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.prefix_mass.shape)

    def flags(self, sink: float = DEFAULT_SINK, self_: float = DEFAULT_SELF,
              local: float = DEFAULT_LOCAL) -> dict[str, torch.Tensor]:
        """Boolean (layers, heads) maps: ``sink`` (prefix mass ≥ sink), ``self`` (self mass ≥ self_),
        ``local`` (mean distance ≤ local patches)."""
        return {"sink": self.prefix_mass >= sink, "self": self.self_mass >= self_,
                "local": self.mean_distance <= local}

    def sink_heads(self, threshold: float = DEFAULT_SINK) -> list[tuple[int, int]]:
        """(layer, head) of every head whose prefix mass is at least ``threshold``."""
        return [tuple(int(i) for i in ij) for ij in (self.prefix_mass >= threshold).nonzero()]

    def rows(self, sink: float = DEFAULT_SINK, self_: float = DEFAULT_SELF, local: float = DEFAULT_LOCAL):
        """One dict per (layer, head): the statistics, slope/position and flags (for a CSV)."""
        flags = self.flags(sink, self_, local)
        out = []
        for layer, head in ((i, j) for i in range(self.shape[0]) for j in range(self.shape[1])):
            slope = float(self.slopes[layer, head])
            out.append({"layer": layer, "head": head, "position": self.position[layer],
                        "slope": "" if math.isnan(slope) else slope,
                        **{s: float(getattr(self, s)[layer, head]) for s in STATISTICS},
                        "distance_on": "torus" if self.torus[layer] else "plain",
                        **{f: bool(v[layer, head]) for f, v in flags.items()}})
        return out


def _grid_of(model, images: torch.Tensor) -> tuple[int, int]:
    ph, pw = model.patch_embed.patch_size
    H, W = images.shape[-2:]
    if H < ph or W < pw:
        raise ValueError(f"an image of {H}×{W} px is smaller than one {ph}×{pw}-px patch")
    if H % ph or W % pw:
        raise ValueError(f"image size {H}×{W} px is not a multiple of the patch size {ph}×{pw}")
    return H // ph, W // pw


@torch.no_grad()
def head_statistics(model, images, *, batch_size: int = 8, max_chunk_elements: int = MAX_CHUNK_ELEMENTS,
                    progress: bool = False) -> HeadStats:
    """The diagnostics of every head of ``model`` (a timm ViT with ``blocks``) on ``images``.

    ``images``: a normalised (B, 3, H, W) tensor, or a list of (3, H, W) tensors of any sizes
    (multiples of the patch size; equal-sized neighbours share a batch). The model runs in eval
    mode (restored afterwards) in its own dtype and device.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None or not len(blocks):
        raise ValueError(f"{type(model).__name__} has no transformer blocks (model.blocks) to diagnose")
    attns = [(f"blocks.{i}.attn", getattr(block, "attn", None)) for i, block in enumerate(blocks)]
    for name, attn in attns:
        _check_attention(name, attn)
    images = list(images)
    if not images:
        raise ValueError("no images to compute head diagnostics on")
    for img in images:
        _grid_of(model, img)
    param = next(model.parameters())
    grid_box: list = [None]
    observers = [_LayerObserver(attn, getattr(model, "num_prefix_tokens", 0), grid_box, max_chunk_elements)
                 for _, attn in attns]

    def note_grid(module, args):
        # The grid of each forward (transform-averaged models rotate their views) from the patch embedding's input.
        grid_box[0] = _grid_of(model, args[0])

    handles = [model.patch_embed.register_forward_pre_hook(note_grid)]
    handles += [attn.register_forward_pre_hook(obs, with_kwargs=True) for (_, attn), obs in zip(attns, observers)]
    was_training = model.training
    model.eval()
    try:
        batches = _batches(images, batch_size)
        if progress:
            from tqdm.auto import tqdm

            batches = tqdm(batches, desc="heads", unit="batch", leave=False)
        for batch in batches:
            model.forward_features(torch.stack(batch).to(device=param.device, dtype=param.dtype))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)

    def mean(key, count="queries"):
        return torch.stack([o.sums[key] / o.sums[count] for o in observers])

    def slopes_of(attn):
        if _has_bias(attn):
            return attn.m.detach().double().view(-1).cpu()
        return torch.full((attn.num_heads,), float("nan"), dtype=torch.float64)

    return HeadStats(prefix_mass=mean("prefix_mass"), self_mass=mean("self_mass"), entropy=mean("entropy"),
                     mean_distance=mean("mean_distance", "distance_queries"),
                     slopes=torch.stack([slopes_of(a) for _, a in attns]),
                     position=[_position_of(model, a) for _, a in attns],
                     torus=[bool(_has_bias(a) and a.wrap) for _, a in attns],
                     num_prefix_tokens=observers[0].prefix, num_images=len(images))


def _batches(images, batch_size) -> list[list[torch.Tensor]]:
    """Consecutive images in groups of at most ``batch_size`` that share one size."""
    batches = [[]]
    for img in images:
        if batches[-1] and (img.shape != batches[-1][0].shape or len(batches[-1]) == batch_size):
            batches.append([])
        batches[-1].append(img)
    return batches


# ---- surgical re-initialisation of chosen heads -----------------------------------------------------

def head_parameter_masks(attn, heads) -> dict[str, torch.Tensor]:
    """``{parameter name within attn: bool mask}`` of the entries that belong to heads ``heads`` of one layer.

    Their Q/K/V weight rows and biases, their columns of the output projection and their entries
    of a learned slope; a parameter shared by all heads (the output bias, q/k norms) has none.
    """
    heads = sorted({int(h) for h in heads})
    if not heads or not all(0 <= h < attn.num_heads for h in heads):
        raise ValueError(f"heads {heads} must be a non-empty list of head indices below {attn.num_heads}")
    d = attn.proj.in_features // attn.num_heads
    rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])
    C = attn.num_heads * d
    masks: dict[str, torch.Tensor] = {}

    def mark(name, index, dim=0):
        param = attn.get_parameter(name)
        mask = torch.zeros(param.shape, dtype=torch.bool, device=param.device)
        mask.index_fill_(dim, index.to(param.device), True)
        masks[name] = mask

    if getattr(attn, "qkv", None) is not None:
        qkv_rows = torch.cat([rows + i * C for i in range(3)])
        mark("qkv.weight", qkv_rows)
        if attn.qkv.bias is not None:
            mark("qkv.bias", qkv_rows)
        for bias in ("q_bias", "v_bias"):  # EVA's separate biases; its k bias is a zero buffer
            if isinstance(getattr(attn, bias, None), torch.nn.Parameter):
                mark(bias, rows)
    else:
        for proj in ("q_proj", "k_proj", "v_proj"):
            mark(f"{proj}.weight", rows)
            if getattr(attn, proj).bias is not None:
                mark(f"{proj}.bias", rows)
    mark("proj.weight", rows, dim=1)
    if isinstance(getattr(attn, "m", None), torch.nn.Parameter):
        mark("m", torch.tensor(heads))
    return masks


def reinit_head_parameters(attn, heads, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Re-initialise heads ``heads`` of one attention layer in place; return :func:`head_parameter_masks`.

    Their Q/K/V weight rows are drawn again (truncated normal, ``std``, timm's ViT init), their
    Q/K/V biases and their columns of the output projection set to zero (so the layer's output
    starts as if those heads were absent), and a learned slope reset to its initial value.
    """
    masks = head_parameter_masks(attn, heads)
    with torch.no_grad():
        for name, mask in masks.items():
            param = attn.get_parameter(name)
            if name == "m":
                fresh = initial_slopes(attn.slope_scheme, attn.num_heads).to(param)
            elif name.endswith("weight") and not name.startswith("proj."):
                fresh = torch.nn.init.trunc_normal_(torch.empty_like(param), std=std)
            else:  # Q/K/V biases and the output columns start at zero
                fresh = torch.zeros_like(param)
            param.copy_(torch.where(mask, fresh, param))
    return masks


# ---- the figure -------------------------------------------------------------------------------------

def plot_head_maps(stats: dict[str, HeadStats], sink: float = DEFAULT_SINK):
    """Layers × heads heatmaps of prefix mass and mean distance, a column per model: a matplotlib Figure.

    Prefix mass spans 0–1 for every model; mean distance shares one colour scale (0 to the
    largest value) across models, so columns compare. Sink heads (prefix mass ≥ ``sink``) are
    marked with a dot.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=(0.6 + 3.4 * len(stats), 6.4), layout="constrained")
    axes = fig.subplots(2, len(stats), squeeze=False)
    far = max(float(torch.nan_to_num(s.mean_distance, nan=0.0).max()) for s in stats.values()) or 1.0
    for col, (name, s) in enumerate(stats.items()):
        for row, (key, label, vmax, cmap) in enumerate((("prefix_mass", "prefix mass (CLS + registers)", 1.0, "magma"),
                                                        ("mean_distance", "mean attention distance (patches)", far,
                                                         "viridis"))):
            ax = axes[row, col]
            im = ax.imshow(getattr(s, key).numpy(), aspect="auto", interpolation="nearest", cmap=cmap, vmin=0.0,
                           vmax=vmax)
            sinks = s.sink_heads(sink)
            if sinks:
                ax.scatter([j for _, j in sinks], [i for i, _ in sinks], s=8, c="cyan", marker="o",
                           label=f"sink (≥ {sink:g})")
            where = "" if row == 0 else " on the torus" if all(s.torus) else " (plain)" if not any(s.torus) else ""
            ax.set_title(f"{name}\n{label}{where}", fontsize="small")
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.yaxis.get_major_locator().set_params(integer=True)
            fig.colorbar(im, ax=ax, label=label)
    return fig


def figure_to_array(fig):
    """A matplotlib Figure rendered to an (H, W, 3) uint8 array (Agg, no pyplot)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()
