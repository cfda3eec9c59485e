"""ALiBi and NoPE DINOv3: timm's DINOv3 ViTs (``vit_*_patch16_dinov3``, an ``Eva``) with RoPE off.

``alibi_vit_{small,small_plus,base,large,huge_plus}_patch16_dinov3`` add the 2D bias of docs/method.md
§2 in every attention layer (the same :class:`~alibi_vit.models.attention.PositionBias` path as the
DINOv2 models, every backend); ``nope_vit_*_patch16_dinov3`` have no position at all. The prefix
is CLS + 4 storage tokens (5 tokens), the patch size 16, and any image size that is a multiple
of 16 works. With wrap on, the model is exactly equivariant to rolling the image by whole
patches (docs/method.md §2).

Weights (``pretrained=True``):

- ``.lvd1689m`` (default): Meta's DINOv3 weights as timm publishes them (the start of distillation).
- ``alibi_vit_small_plus_patch16_dinov3.dinosaw_coco``: the paper's released ALiBi-Dv3
  (``alibi_coco_dv3_vits16_plus_reg4.pth`` on the hub repo ``rmdocherty/dino-saw``), saved from
  Meta's dinov3 code; :func:`meta_to_timm` maps its keys. Meta's attention has query/value biases,
  so this tag builds the model with ``qkv_bias=True``.

Loading any state_dict into these models (``load_state_dict``, ``checkpoint_path``, the hub)
goes through :meth:`AlibiEva.adapt_state_dict`: Meta's keys are renamed, RoPE buffers dropped,
and a DINOv2 checkpoint is refused with an error naming both architectures.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from timm.layers import LayerNorm
from timm.models import build_model_with_cfg, load_pretrained
from timm.models.eva import Eva, EvaAttention

from .attention import POSITION_KWARGS, AlibiEvaAttention, PatchGrid, hand_over_patch_grid
from .formats import DINOV3_META, VIT, AdaptsStateDict, architecture_name, checkpoint_family, strict_filter
from .names import DINOV3_SIZES

__all__ = ["AlibiEva", "convert_eva", "create_dinov3", "meta_to_timm"]

# timm's DINOv3 architectures (timm.models.eva), RoPE and absolute position both off.
_DINOV3_COMMON = dict(patch_size=16, dynamic_img_size=True, qkv_bias=False, init_values=1e-5, num_reg_tokens=4,
                      use_fc_norm=False, norm_layer=partial(LayerNorm, eps=1e-5), use_abs_pos_emb=False,
                      use_rot_pos_emb=False)
_DINOV3_ARCHS = {
    "small": dict(embed_dim=384, depth=12, num_heads=6),
    "small_plus": dict(embed_dim=384, depth=12, num_heads=6, swiglu_mlp=True, swiglu_align_to=8),
    "base": dict(embed_dim=768, depth=12, num_heads=12),
    "large": dict(embed_dim=1024, depth=24, num_heads=16),
    "huge_plus": dict(embed_dim=1280, depth=32, num_heads=20, swiglu_mlp=True, swiglu_align_to=8),
}
assert tuple(_DINOV3_ARCHS) == DINOV3_SIZES

# Meta's dinov3 names → timm's Eva names (what timm's own DINOv3 checkpoint filter does too).
_META_RENAMES = [
    (re.compile(r"^storage_tokens$"), "reg_token"),
    (re.compile(r"\.ls([12])\.gamma$"), r".gamma_\1"),
    (re.compile(r"\.mlp\.w1\."), ".mlp.fc1_g."),  # SwiGLU: w1 is the gated (SiLU) branch
    (re.compile(r"\.mlp\.w2\."), ".mlp.fc1_x."),
    (re.compile(r"\.mlp\.w3\."), ".mlp.fc2."),
]
# Meta keys with no counterpart: the masked-pretraining token, RoPE periods, the k-bias mask,
# the 7B model's local-crop CLS norm.
_META_DROPPED = re.compile(r"^(mask_token|rope_embed\..*|local_cls_norm\..*|.*\.bias_mask)$")


def meta_to_timm(state_dict: dict, qv_bias: bool) -> dict:
    """A state_dict saved from Meta's dinov3 code, in timm's Eva key names.

    Meta's fused ``attn.qkv.bias`` becomes ``attn.q_bias`` and ``attn.v_bias`` when the model has
    them (``qv_bias``); its key third is dropped: a key bias adds the same amount to every logit of
    a query, which the softmax cancels (Meta masks it to zero anyway). Without ``qv_bias``, non-zero
    query/value biases are a ValueError rather than being dropped.
    """
    out = {}
    for key, value in state_dict.items():
        if _META_DROPPED.match(key):
            continue
        if key.endswith(".attn.qkv.bias"):
            q, _, v = value.chunk(3)
            stem = key[: -len("qkv.bias")]
            if qv_bias:
                out[stem + "q_bias"], out[stem + "v_bias"] = q, v
            elif torch.count_nonzero(q) or torch.count_nonzero(v):
                raise ValueError(f"the checkpoint's {key} holds non-zero query/value biases, which this model "
                                 "has no place for: build it with qkv_bias=True")
            continue
        for pattern, replacement in _META_RENAMES:
            key = pattern.sub(replacement, key)
        out[key] = value
    return out


class AlibiEva(AdaptsStateDict, Eva):
    """A timm DINOv3 ``Eva`` whose attention layers take the 2D ALiBi bias (or nothing) instead of RoPE.

    Instances come from :func:`convert_eva` (or ``convert_to_alibi``/``convert_to_nope`` on an Eva).
    """

    patch_grid: PatchGrid

    def _pos_embed(self, x: torch.Tensor):
        self.patch_grid.size = tuple(x.shape[1:3])  # NHWC from the patch embedding
        return super()._pos_embed(x)

    def adapt_state_dict(self, state_dict: dict) -> dict:
        """A state_dict in this model's key names: Meta's dinov3 format mapped, RoPE buffers dropped.

        A DINOv2-style checkpoint (learned ``pos_embed``, timm VisionTransformer keys) is a ValueError.
        """
        family = checkpoint_family(state_dict)
        if family == VIT:
            raise ValueError(f"the checkpoint holds a {family} model (DINOv2 layout: learned pos_embed, "
                             f"ls1/qkv.bias keys), but {architecture_name(self)} is a DINOv3 architecture "
                             f"(patch {self.patch_embed.patch_size[0]}, storage tokens); load it into an "
                             "alibi_vit_*_patch14_reg4_dinov2 model")
        has_qv_bias = any(k.endswith(".attn.q_bias") for k in self.state_dict())
        state = meta_to_timm(state_dict, has_qv_bias) if family == DINOV3_META else dict(state_dict)
        state = {k: v for k, v in state.items() if not k.startswith(("rope.", "rope_embed."))}
        if has_qv_bias and not any(k.endswith(".attn.q_bias") for k in state):
            # DINOv3 without biases is DINOv3 with zero biases (timm's _qkvb variants rest on this).
            for name, p in self.named_parameters():
                if name.endswith((".attn.q_bias", ".attn.v_bias")):
                    state[name] = torch.zeros_like(p)
        return state


def convert_eva(model: Eva, *, use_bias: bool = True, slopes: str = "constant", wrap: bool = True,
                normalize: bool = True, jitter: float = 0.0, jitter_seed: int = 0, backend: str = "auto",
                metric: str = "euclidean") -> AlibiEva:
    """Turn a timm DINOv3 ``Eva`` into an ALiBi (``use_bias``) or NoPE model, in place.

    RoPE is switched off (``rope`` set to None; its periods are a non-persistent buffer, so the
    state_dict keeps timm's keys); options as in :func:`alibi_vit.convert_to_alibi`. An Eva with
    an absolute position embedding (EVA, EVA02) is a ValueError.
    """
    if type(model) not in (Eva, AlibiEva):
        raise TypeError(f"expected a timm Eva (DINOv3) model, got {type(model).__name__}")
    for i, block in enumerate(model.blocks):
        if type(block.attn) not in (EvaAttention, AlibiEvaAttention):
            raise TypeError(f"block {i} uses {type(block.attn).__name__}; only timm's EvaAttention can be converted")
    if getattr(model, "patch_drop", None) is not None:
        raise ValueError("ALiBi/NoPE models keep every patch: build the model with patch_drop_rate=0")
    if model.pos_embed is not None:  # EVA/EVA02 layouts: not what the DINOv3 conversion is for
        raise ValueError("only Eva models without an absolute position embedding (timm's DINOv3) can be converted")
    model.rope = None
    model.rope_mixed = False
    hand_over_patch_grid(model)
    model.__class__ = AlibiEva
    model.patch_grid = PatchGrid()
    for i, block in enumerate(model.blocks):
        block.attn.__class__ = AlibiEvaAttention
        block.attn.configure_position(model.patch_grid, model.num_prefix_tokens, use_bias=use_bias, slopes=slopes,
                                      wrap=wrap, normalize=normalize, jitter=jitter, jitter_seed=jitter_seed + i,
                                      backend=backend, metric=metric)
    return model


def create_dinov3(variant: str, size: str, position: str, pretrained: bool, released: bool = False,
                  **kwargs) -> AlibiEva:
    """Build a registered ALiBi/NoPE DINOv3 (timm calls this through :mod:`alibi_vit.models.registry`)."""
    position_kwargs = {k: kwargs.pop(k) for k in POSITION_KWARGS if k in kwargs}
    if position == "nope" and position_kwargs:
        raise ValueError(f"NoPE models take no position options, got {sorted(position_kwargs)}")
    if released:
        kwargs.setdefault("qkv_bias", True)  # Meta's attention keeps query/value biases
    model = build_model_with_cfg(Eva, variant, False, feature_cfg=dict(feature_cls="getter"),
                                 **{**_DINOV3_COMMON, **_DINOV3_ARCHS[size], **kwargs})
    model = convert_eva(model, use_bias=position == "alibi", **position_kwargs)
    if pretrained:  # after conversion, so learned slopes and the key map apply
        load_pretrained(model, model.pretrained_cfg, num_classes=model.num_classes, filter_fn=strict_filter,
                        cache_dir=kwargs.get("cache_dir"))
    return model
