"""The paper's baselines as backbones (docs/method.md §10): blanked channels, transform
averaging and a sin-cos position embedding.

:func:`blank_channels` and :func:`transform_average` change a timm ViT (DINOv2, DINOv3, ALiBi…)
in place, like :func:`alibi_vit.convert_to_alibi`: the same object is returned, its class
extended so that ``forward_features`` and ``forward_intermediates`` (hence
:func:`alibi_vit.patch_features`, the probe and the segmentation probe) give the baseline's
features, and its state_dict stays a plain timm state_dict.

Names that the ``alibi-vit`` commands and the configs take (timm models, tag ``.lvd142m`` =
DINOv2's weights through timm):

- ``blanked_vit_small_patch14_reg4_dinov2``: DINOv2-S/14-reg4 with channels 47, 113, 117 and 359
  zeroed (``channels=[...]`` picks others);
- ``tavg_vit_small_patch14_reg4_dinov2``: DINOv2-S/14-reg4 averaged over the 8 flips and 90°
  rotations;
- ``sincos_vit_small_patch14_reg4_dinov2``: DINOv2-S/14-reg4 whose learned position embedding
  is replaced by a frozen 2D sin-cos table scaled to the learned table's standard deviation.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
from timm.layers import build_sincos2d_pos_embed
from timm.models.vision_transformer import VisionTransformer, vit_small_patch14_reg4_dinov2

from .names import BASELINE_NAMES

__all__ = ["BASELINE_NAMES", "DIHEDRAL", "DINOV2_S_POSITIONAL_CHANNELS", "FLIPS", "blank_channels",
           "create_baseline", "sincos_position_embedding", "transform_average"]

# DINOv2-S/14-reg4's most positional channels (docs/method.md §4).
DINOV2_S_POSITIONAL_CHANNELS = (47, 113, 117, 359)

Transform = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def _rot(k: int) -> Transform:
    return (lambda x: torch.rot90(x, k, dims=(-2, -1))), (lambda x: torch.rot90(x, -k, dims=(-2, -1)))


def _flip_rot(k: int) -> Transform:
    # rotate the left-right mirror image; undo in the opposite order
    return ((lambda x: torch.rot90(torch.flip(x, dims=(-1,)), k, dims=(-2, -1))),
            (lambda x: torch.flip(torch.rot90(x, -k, dims=(-2, -1)), dims=(-1,))))


DIHEDRAL: tuple[Transform, ...] = tuple(_rot(k) for k in range(4)) + tuple(_flip_rot(k) for k in range(4))
"""The 8 symmetries of the square (4 rotations × mirror), as (transform, inverse) pairs on (…, H, W)."""
FLIPS: tuple[Transform, ...] = (_rot(0), _flip_rot(0), _flip_rot(2), _rot(2))
"""Identity, left-right flip, up-down flip and both (= 180° rotation)."""


def _extend_class(model: nn.Module, mixin: type) -> None:
    base = type(model)
    if isinstance(model, mixin):
        raise ValueError(f"the model is already a {mixin.__name__.strip('_')} backbone")
    key = (mixin, base)
    cls = _CLASSES.get(key)
    if cls is None:
        cls = _CLASSES[key] = type(f"{mixin.__name__.strip('_')}{base.__name__}", (mixin, base), {})
    model.__class__ = cls


_CLASSES: dict = {}


def _check_backbone(model) -> None:
    for attr in ("forward_features", "forward_intermediates", "patch_embed", "num_prefix_tokens"):
        if not hasattr(model, attr):
            raise TypeError(f"expected a timm ViT (forward_features, patch_embed, num_prefix_tokens), got "
                            f"{type(model).__name__} without {attr}")


class _ChannelBlanked:
    """Patch features with a fixed set of channels zeroed; prefix tokens untouched."""

    blanked_channels: torch.Tensor

    def _blank(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.index_fill(dim, self.blanked_channels, 0.0)

    def _blank_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        p = self.num_prefix_tokens
        return torch.cat([tokens[:, :p], self._blank(tokens[:, p:], -1)], dim=1)

    def forward_features(self, x, *args, **kwargs):
        return self._blank_tokens(super().forward_features(x, *args, **kwargs))

    def forward_intermediates(self, x, *args, output_fmt: str = "NCHW", intermediates_only: bool = False, **kwargs):
        out = super().forward_intermediates(x, *args, output_fmt=output_fmt, intermediates_only=intermediates_only,
                                            **kwargs)
        dim = 1 if output_fmt == "NCHW" else -1
        final, feats = (None, out) if intermediates_only else out
        # with return_prefix_tokens each item is (spatial, prefix): only the spatial part is blanked
        feats = [(self._blank(f[0], dim), f[1]) if isinstance(f, tuple) else self._blank(f, dim) for f in feats]
        return feats if intermediates_only else (self._blank_tokens(final), feats)


def blank_channels(model: nn.Module, channels: Sequence[int]) -> nn.Module:
    """The paper's "channels blanked" baseline: ``model``'s patch features with ``channels`` set to zero.

    In place (returns ``model``): every other channel, and the CLS/register tokens, are exactly
    what the model gave before. Channels are indices into the feature width; one outside
    ``0..width-1`` is a ValueError.
    """
    _check_backbone(model)
    width = model.num_features
    channels = sorted({int(c) for c in channels})
    bad = [c for c in channels if not 0 <= c < width]
    if bad:
        raise ValueError(f"channels {bad} are out of range for a model with {width} feature channels "
                         f"(valid: 0..{width - 1})")
    device = next(model.parameters()).device
    _extend_class(model, _ChannelBlanked)
    model.register_buffer("blanked_channels", torch.tensor(channels, dtype=torch.long, device=device),
                          persistent=False)
    return model


class _TransformAveraged:
    """Features averaged over transformed views, each mapped back before averaging."""

    averaged_transforms: tuple

    def _grid(self, view):
        ph, pw = self.patch_embed.patch_size
        return view.shape[-2] // ph, view.shape[-1] // pw

    def forward_features(self, x, *args, **kwargs):
        p, outs = self.num_prefix_tokens, []
        for forward, inverse in self.averaged_transforms:
            view = forward(x)
            tokens = super().forward_features(view, *args, **kwargs)
            h, w = self._grid(view)
            patches = inverse(tokens[:, p:].unflatten(1, (h, w)).movedim(-1, 1))  # (B, C, H', W') in x's frame
            outs.append(torch.cat([tokens[:, :p], patches.flatten(2).transpose(1, 2)], dim=1))
        return torch.stack(outs).mean(0)

    def forward_intermediates(self, x, *args, output_fmt: str = "NCHW", intermediates_only: bool = False, **kwargs):
        if output_fmt != "NCHW" or kwargs.get("return_prefix_tokens"):
            raise ValueError("a transform-averaged backbone gives intermediates as NCHW maps without prefix tokens")
        views = [[inverse(f) for f in super(_TransformAveraged, self).forward_intermediates(
                     forward(x), *args, output_fmt="NCHW", intermediates_only=True, **kwargs)]
                 for forward, inverse in self.averaged_transforms]
        feats = [torch.stack(per_layer).mean(0) for per_layer in zip(*views)]
        return feats if intermediates_only else (self.forward_features(x), feats)


def transform_average(model: nn.Module, transforms: Sequence[Transform] = DIHEDRAL) -> nn.Module:
    """Features averaged over transformed views of the image, each view's features inverse-transformed first.

    In place (returns ``model``). ``transforms`` are (transform, inverse) pairs acting on the last
    two (height, width) dimensions of images and of feature maps alike; default :data:`DIHEDRAL`,
    the 4 rotations × mirror, which makes the features exactly equivariant (up to float rounding)
    to flips and 90° rotations of the image. :data:`FLIPS` gives the 4 flips only. The prefix
    tokens are averaged as they are. Images must be multiples of the patch size in both directions.
    """
    _check_backbone(model)
    transforms = tuple(transforms)
    if not transforms or not all(isinstance(t, tuple) and len(t) == 2 and all(map(callable, t)) for t in transforms):
        raise ValueError("transforms must be a non-empty sequence of (transform, inverse) pairs of callables")
    _extend_class(model, _TransformAveraged)
    model.averaged_transforms = transforms
    return model


def sincos_position_embedding(model: VisionTransformer, temperature: float = 10000.0) -> VisionTransformer:
    """Replace a timm ViT's learned ``pos_embed`` by a frozen 2D sin-cos table (the paper's Fig. S9), in place.

    The table is built for the model's own patch grid (``img_size`` / patch) with timm's
    ``build_sincos2d_pos_embed`` and scaled to the standard deviation of the table it replaces,
    so the tokens keep their scale; other image sizes interpolate it like DINOv2 does.
    """
    if not isinstance(model, VisionTransformer) or model.pos_embed is None:
        raise TypeError(f"expected a timm VisionTransformer with a position embedding, got {type(model).__name__}")
    old = model.pos_embed
    prefix = 0 if model.no_embed_class else model.num_prefix_tokens
    grid = model.patch_embed.grid_size
    table = build_sincos2d_pos_embed(list(grid), dim=old.shape[-1], temperature=temperature)
    table = table * (old.detach().float()[:, prefix:].std() / table.std())
    new = old.detach().clone()
    new[0, prefix:] = table.to(old.dtype)
    new[0, :prefix] = 0  # prefix tokens (if the layout gives them a slot) carry no position
    model.pos_embed = nn.Parameter(new, requires_grad=False)
    return model


def create_baseline(variant: str, pretrained: bool = False, channels: Sequence[int] = DINOV2_S_POSITIONAL_CHANNELS,
                    **kwargs) -> VisionTransformer:
    """Build a registered baseline (timm calls this through :mod:`alibi_vit.models.registry`).

    The backbone is timm's DINOv2-S/14-reg4 (``pretrained``: DINOv2's weights through timm) with
    ``dynamic_img_size`` on. ``channels`` is the blanked model's channel list; the sin-cos model's
    table is built for ``img_size`` (default 224 px, the 16×16 grid its paper model was distilled at).
    """
    if variant not in BASELINE_NAMES:
        raise ValueError(f"unknown baseline {variant!r}; choose one of {', '.join(BASELINE_NAMES)}")
    kind = variant.split("_", 1)[0]
    if kind != "blanked" and channels is not DINOV2_S_POSITIONAL_CHANNELS:
        raise ValueError(f"{variant} takes no channels (only blanked_vit_small_patch14_reg4_dinov2 does)")
    kwargs.setdefault("dynamic_img_size", True)  # any multiple of 14 px, like every backbone here
    if kind == "sincos":
        kwargs.setdefault("img_size", 224)
    model = vit_small_patch14_reg4_dinov2(pretrained=pretrained, **kwargs)
    if kind == "blanked":
        return blank_channels(model, channels)
    if kind == "tavg":
        return transform_average(model)
    return sincos_position_embedding(model)
