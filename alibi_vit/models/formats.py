"""Which architecture a state_dict holds, and the checks every way of loading weights goes through.

The DINOv2 and DINOv3 conversions translate other checkpoint formats (released files without
``pos_embed``, Meta's dinov3 key names) in their ``adapt_state_dict``; :class:`AdaptsStateDict`
makes every load (``load_state_dict``, timm's ``checkpoint_path`` and pretrained loading) pass
through it, and :func:`strict_filter` keeps timm's pretrained loading strict.
"""

from __future__ import annotations

__all__ = ["DINOV3_META", "DINOV3_TIMM", "VIT", "AdaptsStateDict", "architecture_name", "checkpoint_family",
           "key_mismatches", "strict_filter"]

DINOV3_META, DINOV3_TIMM, VIT = "DINOv3 (Meta's dinov3 format)", "DINOv3 (timm Eva format)", "DINOv2-style ViT"


def checkpoint_family(state_dict) -> str | None:
    """Which architecture family a state_dict's keys belong to, or None when they do not say.

    Meta's dinov3 code names its 4 extra tokens ``storage_tokens``; timm's DINOv3 (Eva) uses
    ``blocks.i.gamma_1`` for LayerScale and has no ``qkv.bias``; timm's VisionTransformer
    (DINOv2, DINO, MAE) has ``pos_embed``, ``ls1.gamma`` or a fused ``qkv.bias``.
    """
    keys = list(state_dict)
    if "storage_tokens" in state_dict:
        return DINOV3_META
    if any(k.endswith((".gamma_1", ".q_bias")) or k.startswith("rope.") for k in keys):
        return DINOV3_TIMM
    if "pos_embed" in state_dict or "register_tokens" in state_dict or any(
            k.endswith((".ls1.gamma", ".attn.qkv.bias")) for k in keys):
        return VIT
    return None


def architecture_name(model) -> str:
    """The timm name a model was built under (``pretrained_cfg['architecture']``), else its class."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return cfg.get("architecture") or type(model).__name__


def key_mismatches(own: dict, state: dict) -> tuple[list[str], list[str], list[str]]:
    """How a state_dict differs from a model's: missing keys, unexpected keys, shape mismatches (each sorted)."""
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(state) if own[k].shape != state[k].shape)
    return missing, unexpected, shapes


def strict_filter(state_dict: dict, model) -> dict:
    """timm ``pretrained_filter_fn``: the model's ``adapt_state_dict``, then an exact key and shape check.

    timm's loader turns strict loading off when the classifier differs; this check keeps it on
    for everything but the classifier (``head.*``).
    """
    state = model.adapt_state_dict(state_dict)
    missing, unexpected, shapes = key_mismatches(model.state_dict(), state)
    missing = [k for k in missing if not k.startswith("head.")]
    if missing or unexpected or shapes:
        parts = [f"{title} ({len(keys)}): {', '.join(keys[:5])}" for title, keys in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)) if keys]
        raise ValueError(f"pretrained weights do not match {architecture_name(model)}: " + "; ".join(parts))
    return state


class AdaptsStateDict:
    """Mixin for models with an ``adapt_state_dict``: their keys are replaced by its result on loading.

    ``_load_from_state_dict`` is the step every way into a model passes (``load_state_dict``, timm's
    ``checkpoint_path`` and pretrained loading, a parent module's checkpoint), before any key is compared.
    """

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        local = {k[len(prefix):]: k for k in state_dict if k.startswith(prefix)}
        adapted = self.adapt_state_dict({k: state_dict[full] for k, full in local.items()})
        for full in local.values():
            del state_dict[full]
        state_dict.update({prefix + k: v for k, v in adapted.items()})
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
