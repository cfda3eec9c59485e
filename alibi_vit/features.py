"""Patch features as image-shaped tensors, for users who just want features."""

from __future__ import annotations

import torch

__all__ = ["grid_size_of", "patch_features"]


def grid_size_of(model, images: torch.Tensor) -> tuple[int, int]:
    """The (h, w) patch grid ``model`` makes of ``images``; errors name what does not fit."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a (batch, channels, height, width) tensor, got {shape}")
    in_chans = model.patch_embed.proj.in_channels
    if images.shape[1] != in_chans:
        raise ValueError(f"images have {images.shape[1]} channels, the model expects {in_chans}")
    ph, pw = model.patch_embed.patch_size
    H, W = images.shape[-2:]
    if H % ph or W % pw:
        raise ValueError(f"image size {H}×{W} px is not a multiple of the patch size {ph}×{pw}; "
                         f"resize or crop to e.g. {H // ph * ph}×{W // pw * pw}")
    return H // ph, W // pw


def patch_features(model, images: torch.Tensor, layers=None):
    """Final-normed patch features of a timm ViT as (B, C, h, w).

    With ``layers`` (block indices, negative counting from the end), returns a dict
    ``{layer: (B, C, h, w)}`` of those blocks' outputs, each passed through the final norm.
    Gradients flow; wrap the call in ``torch.no_grad()`` for inference.
    """
    h, w = grid_size_of(model, images)
    if layers is None:
        tokens = model.forward_features(images)[:, model.num_prefix_tokens:]
        return tokens.reshape(images.shape[0], h, w, -1).permute(0, 3, 1, 2)
    depth = len(model.blocks)
    indices = []
    for layer in layers:
        if not -depth <= int(layer) < depth:
            raise ValueError(f"layer {layer} is out of range for a model with {depth} blocks")
        indices.append(int(layer) % depth)
    feats = model.forward_intermediates(images, indices=sorted(set(indices)), norm=True, output_fmt="NCHW",
                                        intermediates_only=True)
    by_index = dict(zip(sorted(set(indices)), feats))
    return {layer: by_index[int(layer) % depth] for layer in layers}
