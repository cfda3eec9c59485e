"""timm registrations of ALiBi-Dv2 and NoPE models built on the DINOv2 ViT-S/B/L/g/14-reg4.

``timm.create_model("alibi_vit_small_patch14_reg4_dinov2", pretrained=True)`` builds the
DINOv2 architecture, loads DINOv2's weights through timm's own mechanism (the hub, or a local
file via ``pretrained_cfg_overlay=dict(file=...)``), then converts it: the starting point of
distillation. A distilled checkpoint in the release format (a timm state_dict of the
converted model) loads with ``checkpoint_path=...``; keys are matched strictly.
"""

from __future__ import annotations

import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import SwiGLUPacked
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from .vision_transformer import convert_to_alibi, convert_to_nope

POSITION_KWARGS = ("slopes", "wrap", "normalize", "jitter", "jitter_seed", "backend")

_DINOV2_ARCHS = {
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
    "giant": dict(embed_dim=1536, depth=40, num_heads=24, mlp_ratio=2.66667 * 2, mlp_layer=SwiGLUPacked,
                  act_layer=nn.SiLU),
}
_DINOV2_COMMON = dict(patch_size=14, init_values=1e-5, reg_tokens=4, no_embed_class=True)

# Only the original DINOv2 weights are published on the hub: ``pretrained=True`` starts from them.
default_cfgs = generate_default_cfgs({
    f"{position}_vit_{size}_patch14_reg4_dinov2.lvd142m": dict(
        hf_hub_id=f"timm/vit_{size}_patch14_reg4_dinov2.lvd142m",
        license="apache-2.0",
        mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, num_classes=0,
        input_size=(3, 518, 518), crop_pct=1.0,
        fixed_input_size=True,  # sets the default img_size: pos_embed keeps the released (1, 1369, C) shape
    )
    for position in ("alibi", "nope") for size in _DINOV2_ARCHS
})


def _create(variant: str, size: str, position: str, pretrained: bool, **kwargs) -> VisionTransformer:
    position_kwargs = {k: kwargs.pop(k) for k in POSITION_KWARGS if k in kwargs}
    if position == "nope" and position_kwargs:
        raise ValueError(f"NoPE models take no position options, got {sorted(position_kwargs)}")
    model = build_model_with_cfg(
        VisionTransformer, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
        **{**_DINOV2_COMMON, **_DINOV2_ARCHS[size], **kwargs},
    )
    if position == "alibi":
        return convert_to_alibi(model, **position_kwargs)
    return convert_to_nope(model)


def _register(size: str, position: str):
    variant = f"{position}_vit_{size}_patch14_reg4_dinov2"

    def create(pretrained: bool = False, **kwargs) -> VisionTransformer:
        return _create(variant, size, position, pretrained, **kwargs)

    create.__name__ = create.__qualname__ = variant
    create.__module__ = __name__
    what = "2D wrapped ALiBi attention bias" if position == "alibi" else "no positional information (NoPE)"
    create.__doc__ = f"DINOv2 ViT-{size[0].upper()}/14 with 4 registers and {what}."
    globals()[variant] = register_model(create)


for _size in _DINOV2_ARCHS:
    for _position in ("alibi", "nope"):
        _register(_size, _position)

MODEL_NAMES = tuple(f"{p}_vit_{s}_patch14_reg4_dinov2" for p in ("alibi", "nope") for s in _DINOV2_ARCHS)
