"""Building backbones by name and loading plain timm state_dicts strictly."""

from __future__ import annotations

from pathlib import Path

import timm
import torch
import torch.nn as nn

from .models import MODEL_NAMES

__all__ = ["create_backbone", "load_state_dict_file", "load_weights"]

# Wrappers other tools put around a state_dict: Lightning ('state_dict'), DDP ('module.').
_NESTING_KEYS = ("state_dict", "model")


def load_state_dict_file(path) -> dict[str, torch.Tensor]:
    """Read a state_dict from .safetensors, .pt/.pth/.bin or a Lightning .ckpt (its 'state_dict')."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"cannot read checkpoint {path}: {type(err).__name__}: {err}") from err
    for key in _NESTING_KEYS:
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"checkpoint {path} does not hold a state_dict of tensors")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_weights(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str = "state_dict") -> None:
    """Load strictly; a key or shape mismatch is a ValueError that lists every offending key."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    shapes = sorted(f"{k}: checkpoint {tuple(state_dict[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
    if missing or unexpected or shapes:
        lines = [f"{source} does not match {type(model).__name__}:"]
        for title, keys in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)):
            if keys:
                lines.append(f"  {title} ({len(keys)}): " + ", ".join(keys))
        raise ValueError("\n".join(lines))
    model.load_state_dict(state_dict, strict=True)


def create_backbone(name: str, *, pretrained: bool = False, checkpoint=None, **model_kwargs) -> nn.Module:
    """A feature backbone by timm name: ALiBi/NoPE models of this project or any timm ViT.

    Plain timm ViTs (the DINOv2 teacher, say) get ``dynamic_img_size=True`` so that, like the
    ALiBi models, they take any image size that is a multiple of the patch size (their
    position embedding is interpolated; that is what DINOv2 does). ``checkpoint`` is a plain
    timm state_dict file loaded strictly after the model is built.
    """
    if name not in MODEL_NAMES:
        model_kwargs.setdefault("dynamic_img_size", True)
    model_kwargs.setdefault("num_classes", 0)
    model = timm.create_model(name, pretrained=pretrained, **model_kwargs)
    if checkpoint is not None:
        load_weights(model, load_state_dict_file(checkpoint), source=f"checkpoint {checkpoint}")
    return model
