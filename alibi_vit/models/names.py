"""The names of every model this project registers with timm, and the paper's released weights.

Plain data with no imports, so the conversions, the registry and the command line can all
read it without importing each other (or timm).
"""

from __future__ import annotations

__all__ = ["BASELINE_NAMES", "DINOV2_NAMES", "DINOV2_SIZES", "DINOV3_NAMES", "DINOV3_SIZES", "MODEL_NAMES",
           "RELEASES", "RELEASE_HUB_ID"]

DINOV2_SIZES = ("small", "base", "large", "giant")  # timm's vit_{size}_patch14_reg4_dinov2
DINOV3_SIZES = ("small", "small_plus", "base", "large", "huge_plus")  # timm's vit_{size}_patch16_dinov3

DINOV2_NAMES = tuple(f"{p}_vit_{s}_patch14_reg4_dinov2" for p in ("alibi", "nope") for s in DINOV2_SIZES)
DINOV3_NAMES = tuple(f"{p}_vit_{s}_patch16_dinov3" for p in ("alibi", "nope") for s in DINOV3_SIZES)
# Every ALiBi/NoPE model of this project (no absolute position, any image size); tags excluded.
MODEL_NAMES = DINOV2_NAMES + DINOV3_NAMES
BASELINE_NAMES = ("blanked_vit_small_patch14_reg4_dinov2", "tavg_vit_small_patch14_reg4_dinov2",
                  "sincos_vit_small_patch14_reg4_dinov2")

# The paper's released checkpoints (docs/method.md §10), files of the hub repo RELEASE_HUB_ID.
RELEASE_HUB_ID = "rmdocherty/dino-saw"
RELEASES = {
    "alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco": "alibi_coco_dv2_vits14_reg4.pth",
    "alibi_vit_small_patch14_reg4_dinov2.dinosaw_imagenet": "alibi_dv2_vits14_reg4.pth",
    "nope_vit_small_patch14_reg4_dinov2.dinosaw_coco": "nope_coco_dv2_vits14_reg4.pth",
    "alibi_vit_small_plus_patch16_dinov3.dinosaw_coco": "alibi_coco_dv3_vits16_plus_reg4.pth",
}
