"""Converting a timm VisionTransformer into an ALiBi (or NoPE) ViT, in place.

The learned ``pos_embed`` stays in the state_dict under its timm name (zeroed and frozen) so
checkpoints keep timm's format, but the forward pass no longer adds it: position enters only
through the attention bias, which is defined for any grid. The patch embedding therefore
accepts any image size that is a multiple of the patch size, with no interpolation step.
"""

from __future__ import annotations

import torch
from timm.layers import Attention, Format
from timm.models.vision_transformer import VisionTransformer

from .attention import AlibiAttention, PatchGrid

__all__ = ["AlibiVisionTransformer", "convert_to_alibi", "convert_to_nope"]


class AlibiVisionTransformer(VisionTransformer):
    """A VisionTransformer whose tokens carry no absolute position embedding.

    Instances come from :func:`convert_to_alibi` / :func:`convert_to_nope`, which also turn on
    ``dynamic_img_size`` so the patch embedding hands over its (h, w) grid.
    """

    patch_grid: PatchGrid

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        B, h, w, C = x.shape  # NHWC from the patch embedding
        self.patch_grid.size = (h, w)
        prefix = []
        if self.cls_token is not None:
            prefix.append(self.cls_token.expand(B, -1, -1))
        if self.reg_token is not None:
            prefix.append(self.reg_token.expand(B, -1, -1))
        x = x.reshape(B, h * w, C)
        if prefix:
            x = torch.cat(prefix + [x], dim=1)
        return self.pos_drop(x)


def _convert(model, *, use_bias, **position_kwargs):
    if not isinstance(model, VisionTransformer) or type(model) not in (VisionTransformer, AlibiVisionTransformer):
        raise TypeError(f"expected a timm VisionTransformer, got {type(model).__name__}")
    for i, block in enumerate(model.blocks):
        if type(block.attn) not in (Attention, AlibiAttention):
            raise TypeError(f"block {i} uses {type(block.attn).__name__}; only timm's standard Attention "
                            "can be converted")
    if model.pos_embed is not None:
        with torch.no_grad():
            model.pos_embed.zero_()
        model.pos_embed.requires_grad_(False)
    model.dynamic_img_size = True
    model.patch_embed.strict_img_size = False
    model.patch_embed.flatten = False
    model.patch_embed.output_fmt = Format.NHWC
    model.__class__ = AlibiVisionTransformer
    model.patch_grid = PatchGrid()
    jitter_seed = position_kwargs.pop("jitter_seed", 0)
    for i, block in enumerate(model.blocks):
        block.attn.__class__ = AlibiAttention
        block.attn.configure_position(model.patch_grid, model.num_prefix_tokens, use_bias=use_bias,
                                      jitter_seed=jitter_seed + i, **position_kwargs)
    return model


def convert_to_alibi(model: VisionTransformer, *, slopes: str = "constant", wrap: bool = True,
                     normalize: bool = True, jitter: float = 0.0, jitter_seed: int = 0,
                     backend: str = "auto") -> AlibiVisionTransformer:
    """Turn a timm VisionTransformer (DINOv2, DINO, MAE, with or without registers) into an ALiBi ViT.

    In place (the same object is returned): ``pos_embed`` is zeroed, frozen and no longer
    added; every attention layer adds ``m_h · B`` with ``B`` the 2D bias of README.md "Method" §2.

    Args:
        slopes: ``"constant"`` (m_h = 1, the paper's choice), ``"learned"`` (a trainable
            ``blocks.i.attn.m`` of shape (heads, 1, 1), initialised to 1) or ``"geometric"``.
        wrap: toroidal distances; the model is then exactly equivariant to rolling the image
            by whole patches.
        normalize: divide distances by the grid's largest, so one model serves every resolution.
        jitter: standard deviation of test-time noise on d̂ (paper S4); 0 (off) unless asked for.
            When on, it applies in train and eval alike and uses the materialised bias.
        jitter_seed: seed of layer 0's noise generator (layer i uses ``jitter_seed + i``).
        backend: attention backend passed to :func:`kernels.alibi_attention`.
    """
    return _convert(model, use_bias=True, slopes=slopes, wrap=wrap, normalize=normalize, jitter=jitter,
                    jitter_seed=jitter_seed, backend=backend)


def convert_to_nope(model: VisionTransformer) -> AlibiVisionTransformer:
    """The NoPE baseline: ``pos_embed`` zeroed, frozen and unused, and no bias at all (a bag of patches)."""
    return _convert(model, use_bias=False)
