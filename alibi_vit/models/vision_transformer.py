"""Converting a timm VisionTransformer into an ALiBi (or NoPE) ViT, in place.

The learned ``pos_embed`` stays in the state_dict under its timm name (zeroed and frozen) so
checkpoints keep timm's format, but the forward pass no longer adds it: position enters only
through the attention bias, which is defined for any grid. The patch embedding therefore
accepts any image size that is a multiple of the patch size, with no interpolation step.

Loading a state_dict into a converted model (``load_state_dict``, timm's ``checkpoint_path``,
released checkpoints) follows the release rules of docs/method.md §10: a missing
``pos_embed`` is filled with zeros, a zero one of another grid size is replaced by zeros of
this model's shape, and a non-zero (learned) one is an error, since the model would silently
ignore it. A checkpoint of a DINOv3 model is refused with an error naming both architectures.
"""

from __future__ import annotations

import torch
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer

from .attention import AlibiAttention, PatchGrid, hand_over_patch_grid
from .formats import DINOV3_META, DINOV3_TIMM, AdaptsStateDict, architecture_name, checkpoint_family

__all__ = ["AlibiVisionTransformer", "convert_to_alibi", "convert_to_nope"]


class AlibiVisionTransformer(AdaptsStateDict, VisionTransformer):
    """A VisionTransformer whose tokens carry no absolute position embedding.

    Instances come from :func:`convert_to_alibi` / :func:`convert_to_nope`, which also turn on
    ``dynamic_img_size`` so the patch embedding hands over its (h, w) grid.
    """

    patch_grid: PatchGrid

    def adapt_state_dict(self, state_dict: dict) -> dict:
        """A state_dict made loadable into this model by the release rules (see the module docstring).

        Returns a new dict; raises ValueError for a DINOv3 checkpoint or a learned ``pos_embed``.
        """
        family = checkpoint_family(state_dict)
        if family in (DINOV3_META, DINOV3_TIMM):
            raise ValueError(f"the checkpoint holds a {family} model, but {architecture_name(self)} is a "
                             f"DINOv2-architecture ViT (patch {self.patch_embed.patch_size[0]}, learned-position "
                             "layout); load it into an alibi_vit_*_patch16_dinov3 / nope_vit_*_patch16_dinov3 model")
        state = dict(state_dict)
        if self.pos_embed is None:
            return state
        own = self.pos_embed
        given = state.get("pos_embed")
        if given is not None and torch.count_nonzero(given) > 0:
            raise ValueError(f"the checkpoint holds a learned (non-zero) pos_embed {tuple(given.shape)}, but "
                             f"{architecture_name(self)} carries no absolute position and would silently ignore "
                             "it: this is not an ALiBi/NoPE checkpoint. Start from DINOv2 weights with "
                             "pretrained=True (tag .lvd142m), or load them into timm's VisionTransformer and "
                             "call alibi_vit.convert_to_alibi")
        # Absent, or zero for another grid: the model's own zero table (it is never added anyway).
        state["pos_embed"] = torch.zeros(own.shape, dtype=given.dtype if given is not None else own.dtype)
        return state

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
    from timm.models.eva import Eva

    if isinstance(model, Eva):  # timm's DINOv3
        from .dinov3 import convert_eva

        return convert_eva(model, use_bias=use_bias, **position_kwargs)
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
    hand_over_patch_grid(model)
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
                     backend: str = "auto", metric: str = "euclidean") -> AlibiVisionTransformer:
    """Turn a timm VisionTransformer (DINOv2, DINO, MAE, with or without registers) into an ALiBi ViT.

    A timm DINOv3 ``Eva`` (``vit_*_patch16_dinov3``) is converted too: RoPE is switched off and the
    result is an :class:`alibi_vit.models.dinov3.AlibiEva`.

    In place (the same object is returned): ``pos_embed`` is zeroed, frozen and no longer
    added; every attention layer adds ``m_h · B`` with ``B`` the 2D bias of docs/method.md §2.

    Args:
        slopes: ``"constant"`` (m_h = 1, the paper's choice), ``"learned"`` (a trainable
            ``blocks.i.attn.m`` of shape (heads, 1, 1), initialised to 1), ``"learned_random"``
            (the same, initialised uniform in [0, 1) as the authors' learned slopes) or ``"geometric"``.
        wrap: toroidal distances; the model is then exactly equivariant to rolling the image
            by whole patches.
        normalize: divide distances by the grid's largest, so one model serves every resolution.
        jitter: standard deviation of test-time noise on d̂ (paper S4); 0 (off) unless asked for.
            When on, it applies in train and eval alike and uses the materialised bias.
        jitter_seed: seed of layer 0's noise generator (layer i uses ``jitter_seed + i``).
        backend: attention backend passed to :func:`kernels.alibi_attention`.
        metric: ``"euclidean"`` (the default, the paper's bias) or ``"manhattan"`` (``d = dy + dx``
            with the same wrap and its own ``d_max``; a baseline), on every backend.
    """
    return _convert(model, use_bias=True, slopes=slopes, wrap=wrap, normalize=normalize, jitter=jitter,
                    jitter_seed=jitter_seed, backend=backend, metric=metric)


def convert_to_nope(model: VisionTransformer) -> AlibiVisionTransformer:
    """The NoPE baseline: ``pos_embed`` zeroed, frozen and unused, and no bias at all (a bag of patches)."""
    return _convert(model, use_bias=False)
