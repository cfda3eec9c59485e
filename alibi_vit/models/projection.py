"""A fixed linear map of a ViT's patch tokens after its final norm, stored in the model.

RASA (:mod:`alibi_vit.analysis.rasa`) folds the planes it removes into one (C, C) matrix ``L``;
the model keeps it as the buffer ``rasa_projection`` and a forward hook on ``model.norm`` applies
``x ← x Lᵀ`` to the patch tokens (CLS and registers untouched). The state_dict is timm's plus
that one key, so loading such a file (``alibi_vit.create_backbone(name, checkpoint=...)``) only
needs the buffer and hook attached first: that is what this module provides to the loader.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["PROJECTION_KEY", "attach_projection", "folded_projection"]

# The one key a folded model adds to its timm state_dict.
PROJECTION_KEY = "rasa_projection"


class _ProjectPatchTokens:
    """Forward hook on the final norm: patch tokens → ``x Lᵀ`` with the model's ``rasa_projection``."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, module, inputs, output):
        if not isinstance(output, torch.Tensor) or output.dim() != 3:
            return output
        L = getattr(self.model, PROJECTION_KEY)
        p = self.model.num_prefix_tokens
        patches = output[:, p:]
        cleaned = (patches.to(L.dtype) @ L.T).to(output.dtype)
        return torch.cat([output[:, :p], cleaned], dim=1)


def folded_projection(model: nn.Module) -> torch.Tensor | None:
    """The (C, C) matrix a folded model applies (``x Lᵀ``), or None for an unfolded model."""
    return getattr(model, PROJECTION_KEY, None) if _hook_of(model) is not None else None


def _hook_of(model: nn.Module):
    norm = getattr(model, "norm", None)
    if norm is None:
        return None
    for hook in norm._forward_hooks.values():
        if isinstance(hook, _ProjectPatchTokens):
            return hook
    return None


def attach_projection(model: nn.Module, L: torch.Tensor) -> None:
    """Give ``model`` the buffer ``rasa_projection`` = ``L`` and the hook that applies it (before loading a RASA file)."""
    param = next(model.parameters())
    dtype = torch.float64 if param.dtype == torch.float64 else torch.float32  # never coarser than float32
    model.register_buffer(PROJECTION_KEY, L.to(device=param.device, dtype=dtype).contiguous())
    model.norm.register_forward_hook(_ProjectPatchTokens(model))

