"""RASA: removing the planes in which linear heads find patch position (docs/method.md §8).

A RASA round fits a bias-free linear head W (2×C) + sigmoid to predict each patch's (row, col)
from the frozen encoder's final-normed patch tokens. The two rows of W span a plane; it is
orthonormalised by Gram–Schmidt (``r = w0/|w0|``, ``c = w1 − (w1·r) r``, ``c /= |c|``) and removed
from every token: ``x ← x − (x·r) r − (x·c) c``. Rounds repeat on the cleaned tokens.

The planes of T rounds make one fixed matrix ``L = (I − P_T)…(I − P_1)`` (``P_t = r rᵀ + c cᵀ``)
that acts on token rows as ``x ← x Lᵀ``. :func:`fold_planes` stores it in the model (one buffer,
``rasa_projection``) and applies it to the patch tokens the final norm puts out, so the result is
still the same timm model class with a timm state_dict plus that one matrix. A product of
projections is not symmetric in general, so applying ``x L`` instead (a ``weight = Lᵀ`` in an
``nn.Linear``) would be wrong; the tests check the fold with such products.

Functions:

- :func:`orthonormal_plane`: the Gram–Schmidt pair (r, c) of one plane, with the rank check;
- :func:`remove_planes`: features (B, C, h, w) or (B, N, C) with the planes removed, in order;
- :func:`projection_matrix`: L of a list of planes;
- :func:`orthogonalize_planes`: planes whose later members are made orthogonal to earlier ones;
- :func:`fold_planes`: put L into a model (:func:`alibi_vit.models.projection.folded_projection` reads
  it back; ``alibi_vit.create_backbone(name, checkpoint=...)`` rebuilds a folded model from its file).
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
import torch.nn as nn

from ..models.projection import PROJECTION_KEY, attach_projection, folded_projection

__all__ = ["PROJECTION_KEY", "fold_planes", "orthogonalize_planes", "orthonormal_plane", "projection_matrix",
           "remove_planes"]

# A second row whose part orthogonal to the first is below this fraction of its length spans no plane.
_RANK_TOL = 1e-6


def _check_planes(planes, width: int | None = None) -> list[torch.Tensor]:
    if isinstance(planes, torch.Tensor):
        if planes.dim() == 2:  # a single (2, C) plane
            planes = [planes]
        elif planes.dim() == 3:  # stacked (T, 2, C)
            planes = list(planes)
        else:
            raise ValueError(f"planes must be (2, C) tensors or a (T, 2, C) stack, got shape {tuple(planes.shape)}")
    planes = list(planes)
    for t, plane in enumerate(planes):
        if not isinstance(plane, torch.Tensor) or plane.dim() != 2 or plane.shape[0] != 2:
            shape = tuple(plane.shape) if isinstance(plane, torch.Tensor) else type(plane).__name__
            raise ValueError(f"plane {t} must be a (2, C) tensor, got {shape}")
        if width is not None and plane.shape[1] != width:
            raise ValueError(f"plane {t} has width {plane.shape[1]} but the features have {width} channels")
        if not torch.isfinite(plane).all():
            raise ValueError(f"plane {t} has non-finite values")
    return planes


def orthonormal_plane(plane: torch.Tensor, index: int = 0) -> torch.Tensor:
    """The (2, C) orthonormal pair (r, c) of a plane's rows by Gram–Schmidt, in float64.

    Raises ValueError when the rows do not span a plane (a zero row, or parallel rows: rank < 2).
    ``index`` only numbers the plane in that message.
    """
    (plane,) = _check_planes([plane])
    w0, w1 = plane.detach().double()
    n0 = w0.norm()
    if n0 == 0:
        raise ValueError(f"plane {index}: its first row is zero, it spans no plane (rank < 2)")
    r = w0 / n0
    c = w1 - (w1 @ r) * r
    nc = c.norm()
    if nc <= _RANK_TOL * max(float(w1.norm()), float(n0)):
        raise ValueError(f"plane {index}: its two rows are parallel (or the second is zero), so they span "
                         "no plane (rank < 2)")
    return torch.stack([r, c / nc])


def projection_matrix(planes: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """``L = (I − P_T)…(I − P_1)`` in float64, (C, C); token rows are cleaned as ``x Lᵀ``.

    With no planes, ``width`` gives the size of the identity returned.
    """
    planes = _check_planes(planes, width)
    if not planes and width is None:
        raise ValueError("projection_matrix of no planes needs the width")
    width = planes[0].shape[1] if planes else width
    L = torch.eye(width, dtype=torch.float64)
    for t, plane in enumerate(planes):
        if plane.shape[1] != width:
            raise ValueError(f"plane {t} has width {plane.shape[1]}, plane 0 has {width}")
        q = orthonormal_plane(plane, t)  # (2, C)
        L = L - q.T @ (q @ L)  # (I − P_t) L
    return L


def remove_planes(features: torch.Tensor, planes: Sequence[torch.Tensor]) -> torch.Tensor:
    """Features with each plane removed in turn (docs/method.md §8), same shape and dtype.

    Args:
        features: (B, C, h, w) maps or (B, N, C) tokens (channels last).
        planes: (2, C) tensors, one per round, in the order they were found (a (T, 2, C) stack works too).

    Each plane's rows are orthonormalised (Gram–Schmidt, :func:`orthonormal_plane`) and
    ``x − (x·r) r − (x·c) c`` is applied, plane 1 first. Computed in float32 (float64 for float64 input).
    """
    if not isinstance(features, torch.Tensor) or features.dim() not in (3, 4):
        shape = tuple(features.shape) if isinstance(features, torch.Tensor) else type(features).__name__
        raise ValueError(f"features must be (B, C, h, w) or (B, N, C), got {shape}")
    channel_dim = 1 if features.dim() == 4 else -1
    planes = _check_planes(planes, features.shape[channel_dim])
    compute = torch.float64 if features.dtype == torch.float64 else torch.float32
    x = features.to(compute).movedim(channel_dim, -1)
    for t, plane in enumerate(planes):
        q = orthonormal_plane(plane, t).to(device=x.device, dtype=compute)  # (2, C)
        x = x - (x @ q.T) @ q
    return x.movedim(-1, channel_dim).to(features.dtype)


def orthogonalize_planes(planes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Planes with each one's rows made orthogonal to all earlier planes, then orthonormalised.

    Round t of RASA sees tokens that have no component in planes 1..t−1, so the head's weights
    along those planes read nothing; dropping them changes none of its predictions on those
    tokens. Removing the planes so orthogonalised leaves features orthogonal to every plane
    (with the raw heads, removing plane t can bring back a little of planes 1..t−1).
    A plane that lies (almost) inside the earlier ones is a ValueError (rank < 2).
    """
    planes = _check_planes(planes)
    basis = None  # (2t, C) orthonormal rows of the planes so far
    out = []
    for t, plane in enumerate(planes):
        w = plane.detach().double()
        if basis is not None:
            w = w - (w @ basis.T) @ basis
        q = orthonormal_plane(w, t)
        out.append(q.to(plane.dtype))
        basis = q if basis is None else torch.cat([basis, q])
    return out


def fold_planes(model: nn.Module, planes: Sequence[torch.Tensor], *, inplace: bool = False) -> nn.Module:
    """The model with the planes removed from the patch tokens of its final norm.

    Args:
        model: a timm ViT of this project or timm's (``forward_features`` through ``model.norm``,
            ``num_prefix_tokens``), e.g. from ``alibi_vit.create_backbone``.
        planes: (2, C) tensors, one per round, in order (a (T, 2, C) stack works too).
        inplace: change ``model`` itself; default False: a deep copy is changed and returned.

    Returns a model of the same class whose ``forward_features`` patch tokens are
    ``remove_planes(tokens, planes)``, i.e. ``tokens @ Lᵀ`` with ``L`` of :func:`projection_matrix`
    (stored as the buffer ``rasa_projection``, float32 or the model's float64; the product is formed in
    float64). CLS and register tokens are untouched. Intermediate layers read through the final norm
    (``forward_intermediates(norm=True)``) get the same projection. Its state_dict is the timm
    state_dict plus ``rasa_projection``; ``alibi_vit.create_backbone(name, checkpoint=FILE)`` rebuilds it.
    Folding an already folded model composes the projections.

    Models whose final features are changed after the norm (the ``blanked_`` baseline zeroes
    channels) get the projection before that change.
    """
    width = getattr(model, "num_features", None) or getattr(model, "embed_dim", None)
    if not hasattr(model, "norm") or not hasattr(model, "num_prefix_tokens"):
        raise ValueError(f"fold_planes needs a timm ViT (a final 'norm' and 'num_prefix_tokens'), got "
                         f"{type(model).__name__}")
    planes = _check_planes(planes, width)
    L = projection_matrix(planes, width)
    if not inplace:
        model = copy.deepcopy(model)
    previous = folded_projection(model)
    if previous is not None:
        # x ← (x L_oldᵀ) L_newᵀ = x (L_new L_old)ᵀ
        getattr(model, PROJECTION_KEY).copy_((L @ previous.double()).to(previous.dtype))
        return model
    attach_projection(model, L)
    return model

