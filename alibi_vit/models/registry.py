"""timm registrations of every model this project names: ALiBi/NoPE DINOv2 and DINOv3, and the baselines.

``timm.create_model("alibi_vit_small_patch14_reg4_dinov2", pretrained=True)`` builds the
DINOv2 architecture, loads DINOv2's weights through timm's own mechanism (the hub, or a local
file via ``pretrained_cfg_overlay=dict(file=...)``), then converts it: the starting point of
distillation (tag ``.lvd142m``, the default; ``.lvd1689m`` for the DINOv3 models). The paper's
released, distilled models are tags (docs/method.md §10), fetched from the hub repo
``rmdocherty/dino-saw``:

- ``alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco``: ALiBi-Dv2 distilled on COCO;
- ``alibi_vit_small_patch14_reg4_dinov2.dinosaw_imagenet``: ALiBi-Dv2 distilled on an ImageNet subset;
- ``nope_vit_small_patch14_reg4_dinov2.dinosaw_coco``: the NoPE baseline distilled on COCO;
- ``alibi_vit_small_plus_patch16_dinov3.dinosaw_coco``: ALiBi-Dv3 (see :mod:`alibi_vit.models.dinov3`).

They load into the converted model (a missing or zero ``pos_embed`` is fine, a learned one an
error); so does a local file in that format with ``checkpoint_path=...`` or
``pretrained_cfg_overlay=dict(file=...)``; keys are matched strictly. An unknown tag is an error
listing the known ones.

The names live in :mod:`alibi_vit.models.names`; the builders live in the conversions
(:mod:`~alibi_vit.models.vision_transformer`, :mod:`~alibi_vit.models.dinov3`,
:mod:`~alibi_vit.models.baselines`) and are imported when a model is built. A conversion never
imports this module, and this module imports no conversion at import time, so importing a
conversion first (which imports timm, which imports this module) never meets a half-initialised one.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import SwiGLUPacked
from timm.models import build_model_with_cfg, generate_default_cfgs, load_pretrained, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from .names import BASELINE_NAMES, DINOV2_NAMES, DINOV2_SIZES, DINOV3_NAMES, DINOV3_SIZES, RELEASE_HUB_ID, RELEASES

_DINOV2_ARCHS = {
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
    "giant": dict(embed_dim=1536, depth=40, num_heads=24, mlp_ratio=2.66667 * 2, mlp_layer=SwiGLUPacked,
                  act_layer=nn.SiLU),
}
assert tuple(_DINOV2_ARCHS) == DINOV2_SIZES
_DINOV2_COMMON = dict(patch_size=14, init_values=1e-5, reg_tokens=4, no_embed_class=True)

_DINOV2_CFG = dict(license="apache-2.0", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, num_classes=0,
                   input_size=(3, 518, 518), crop_pct=1.0,
                   fixed_input_size=True)  # sets the default img_size: pos_embed keeps the released (1, 1369, C) shape
_DINOV3_CFG = dict(license="dinov3-license", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, num_classes=0,
                   input_size=(3, 224, 224), crop_pct=1.0, fixed_input_size=False)

# The original weights come first: the default tag of every name is theirs (.lvd142m DINOv2,
# .lvd1689m DINOv3), the start of distillation; the releases are the other tags.
default_cfgs = generate_default_cfgs({
    **{f"{name}.lvd142m": dict(hf_hub_id=f"timm/vit_{name.split('_vit_')[1]}.lvd142m", **_DINOV2_CFG)
       for name in DINOV2_NAMES},
    **{f"{name}.lvd1689m": dict(hf_hub_id=f"timm/vit_{name.split('_vit_')[1]}.lvd1689m", **_DINOV3_CFG)
       for name in DINOV3_NAMES},
    **{f"{name}.lvd142m": dict(hf_hub_id="timm/vit_small_patch14_reg4_dinov2.lvd142m", **_DINOV2_CFG)
       for name in BASELINE_NAMES},
    **{name: dict(hf_hub_id=RELEASE_HUB_ID, hf_hub_filename=filename,
                  **(_DINOV3_CFG if "dinov3" in name else _DINOV2_CFG)) for name, filename in RELEASES.items()},
})


def known_tags(variant: str) -> list[str]:
    """The pretrained tags of a model registered here, the default first."""
    return list(default_cfgs[variant].tags)


def check_tag(variant: str, pretrained_cfg) -> str:
    """The pretrained tag asked for (the default when none); an unknown tag is a ValueError listing the known ones."""
    tags = known_tags(variant)
    if not isinstance(pretrained_cfg, str):
        return tags[0]
    if pretrained_cfg not in tags:
        raise ValueError(f"unknown pretrained tag {pretrained_cfg!r} for {variant}; known tags: "
                         + ", ".join(f"{variant}.{t}" for t in tags))
    return pretrained_cfg


def _create_dinov2(variant: str, size: str, position: str, pretrained: bool, **kwargs) -> VisionTransformer:
    from .attention import POSITION_KWARGS
    from .formats import strict_filter
    from .vision_transformer import convert_to_alibi, convert_to_nope

    released = f"{variant}.{check_tag(variant, kwargs.get('pretrained_cfg'))}" in RELEASES
    position_kwargs = {k: kwargs.pop(k) for k in POSITION_KWARGS if k in kwargs}
    if position == "nope" and position_kwargs:
        raise ValueError(f"NoPE models take no position options, got {sorted(position_kwargs)}")
    # DINOv2's weights load before conversion (their learned pos_embed is then zeroed); a
    # released checkpoint loads after it, through the converted model's release rules.
    model = build_model_with_cfg(
        VisionTransformer, variant, pretrained and not released, pretrained_filter_fn=checkpoint_filter_fn,
        **{**_DINOV2_COMMON, **_DINOV2_ARCHS[size], **kwargs},
    )
    model = convert_to_alibi(model, **position_kwargs) if position == "alibi" else convert_to_nope(model)
    if pretrained and released:
        load_pretrained(model, model.pretrained_cfg, num_classes=model.num_classes, filter_fn=strict_filter,
                        cache_dir=kwargs.get("cache_dir"))
    return model


def _create_dinov3(variant: str, size: str, position: str, pretrained: bool, **kwargs):
    from .dinov3 import create_dinov3

    released = f"{variant}.{check_tag(variant, kwargs.get('pretrained_cfg'))}" in RELEASES
    return create_dinov3(variant, size, position, pretrained, released=released, **kwargs)


def _create_baseline(variant: str, pretrained: bool, **kwargs):
    from . import baselines

    check_tag(variant, kwargs.pop("pretrained_cfg", None))  # .lvd142m is timm's own tag for DINOv2-S
    return baselines.create_baseline(variant, pretrained, **kwargs)


def _register(variant: str, build, doc: str):
    def create(pretrained: bool = False, **kwargs):
        return build(pretrained=pretrained, **kwargs)

    create.__name__ = create.__qualname__ = variant
    create.__module__ = __name__
    create.__doc__ = doc
    globals()[variant] = register_model(create)


def _what(position: str) -> str:
    return "2D wrapped ALiBi attention bias" if position == "alibi" else "no positional information (NoPE)"


for _position in ("alibi", "nope"):
    for _size in _DINOV2_ARCHS:
        _name = f"{_position}_vit_{_size}_patch14_reg4_dinov2"
        _register(_name, partial(_create_dinov2, _name, _size, _position),
                  f"DINOv2 ViT-{_size[0].upper()}/14 with 4 registers and {_what(_position)}.")
    for _size in DINOV3_SIZES:
        _name = f"{_position}_vit_{_size}_patch16_dinov3"
        _label = {"small": "S", "small_plus": "S+", "base": "B", "large": "L", "huge_plus": "H+"}[_size]
        _register(_name, partial(_create_dinov3, _name, _size, _position),
                  f"DINOv3 ViT-{_label}/16 with 4 storage tokens, RoPE off and {_what(_position)}.")
for _name, _doc in zip(BASELINE_NAMES, (
        "DINOv2-S/14-reg4 with its 4 most positional channels (47, 113, 117, 359) zeroed in the patch features.",
        "DINOv2-S/14-reg4 with patch features averaged over the 8 flips and 90° rotations (each inverted).",
        "DINOv2-S/14-reg4 with a frozen 2D sin-cos position embedding for a 224-px (16×16) grid.")):
    _register(_name, partial(_create_baseline, _name), _doc)
