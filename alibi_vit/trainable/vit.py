"""ViT features for trainable segmentation: patch features → standardised → PCA → pixels (docs/method.md §7).

Any image size works. An image up to ``tile`` px a side goes through the backbone whole, padded by
mirror reflection to the next multiple of the patch size (reflection rather than zeros, so the
padding looks like more of the micrograph and adds no artificial edge). A larger image is cut into
``tile``-px tiles overlapping by ``overlap`` px, aligned to the patch grid; where tiles overlap
their patch features are averaged. Tiling rather than one pass keeps the attention's memory
(quadratic in the number of patches) bounded and the backbone near the image sizes it was trained
at (DINOv2: 518 px). The patch features are standardised per channel and projected to
``n_components`` principal components (both fitted on the training images and then fixed, so
every image is projected alike), then bilinearly upsampled to pixels and cropped to the image.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..features import patch_features
from ..images import normalize

__all__ = ["ViTFeatures", "vit_patch_features"]


def _patch_size(model) -> int:
    ph, pw = model.patch_embed.patch_size
    if ph != pw:
        raise ValueError(f"only square patches are supported, the backbone has {ph}×{pw}")
    return int(ph)


def _pad(x: torch.Tensor, ph: int, pw: int) -> torch.Tensor:
    # Mirror padding needs pad < size; a tiny image is repeated at its edge instead.
    if ph == 0 and pw == 0:
        return x
    mode = "reflect" if ph < x.shape[-2] and pw < x.shape[-1] else "replicate"
    return F.pad(x, (0, pw, 0, ph), mode=mode)


def _starts(n: int, t: int, step: int) -> list[int]:
    if n <= t:
        return [0]
    starts = list(range(0, n - t, step))
    return starts + [n - t]


@torch.no_grad()
def vit_patch_features(model: nn.Module, image01: np.ndarray, *, tile: int = 518, overlap: int = 56,
                       device="cpu") -> np.ndarray:
    """(C, gh, gw) float32 patch features of a (H, W) or RGB (H, W, 3) image in [0, 1] on the patch
    grid of its padded size.

    A grayscale image is repeated to RGB and ImageNet-normalised as DINOv2 expects; see the
    module docstring for padding and tiling. ``tile`` and ``overlap`` are in px and rounded down to
    multiples of the patch size.
    """
    p = _patch_size(model)
    t, o = max(tile // p, 1), max(overlap // p, 0)
    if o >= t:
        raise ValueError(f"overlap ({overlap} px) must be smaller than tile ({tile} px)")
    h, w = image01.shape[:2]
    gh, gw = -(-h // p), -(-w // p)
    if image01.ndim == 3:  # RGB (H, W, 3)
        x = torch.from_numpy(np.ascontiguousarray(np.moveaxis(image01, -1, 0), np.float32))[None].to(device)
    else:
        x = torch.from_numpy(np.ascontiguousarray(image01, np.float32))[None, None].to(device).expand(1, 3, -1, -1)
    x = _pad(x, gh * p - h, gw * p - w)
    x = normalize(x)
    dtype = next(model.parameters()).dtype
    out, count = None, torch.zeros(1, gh, gw, device=device)
    for y0 in _starts(gh, t, t - o):
        for x0 in _starts(gw, t, t - o):
            crop = x[..., y0 * p:(y0 + t) * p, x0 * p:(x0 + t) * p]
            f = patch_features(model, crop.to(dtype))[0].float()
            if out is None:
                out = torch.zeros(f.shape[0], gh, gw, device=device)
            out[:, y0:y0 + f.shape[1], x0:x0 + f.shape[2]] += f
            count[:, y0:y0 + f.shape[1], x0:x0 + f.shape[2]] += 1
    return (out / count).cpu().numpy()


class ViTFeatures:
    """Per-pixel ViT features: a backbone plus a standardisation and PCA fitted on training images.

    model: an ``nn.Module`` that :func:`alibi_vit.patch_features` accepts (any backbone
        :func:`alibi_vit.create_backbone` builds). It is put in eval mode.
    n_components: PCA components kept (default 9, the paper's).
    tile, overlap: see :func:`vit_patch_features`.
    """

    def __init__(self, model: nn.Module, n_components: int = 9, *, tile: int = 518, overlap: int = 56,
                 device="cpu"):
        if not isinstance(model, nn.Module):
            raise ValueError(f"backbone must be an nn.Module, got {type(model).__name__}")
        self.model = model.eval().to(device)
        self.n_components, self.tile, self.overlap, self.device = int(n_components), tile, overlap, device
        self.mean_ = self.scale_ = self.components_ = None

    def patch_features(self, image01: np.ndarray) -> np.ndarray:
        return vit_patch_features(self.model, image01, tile=self.tile, overlap=self.overlap, device=self.device)

    def fit(self, images01) -> "ViTFeatures":
        """Fit the standardisation and PCA on every patch of ``images01`` ((H, W) floats in [0, 1])."""
        feats = [self.patch_features(im) for im in images01]
        return self.fit_patch_matrix(np.concatenate([f.reshape(f.shape[0], -1).T for f in feats]))

    def fit_patch_matrix(self, feats: np.ndarray) -> "ViTFeatures":
        """Fit from an (N patches, C) matrix of patch features."""
        from sklearn.decomposition import PCA

        if feats.shape[0] < self.n_components:
            raise ValueError(f"PCA to {self.n_components} components needs at least as many patches; the training "
                             f"images give {feats.shape[0]}")
        self.mean_ = feats.mean(0)
        self.scale_ = feats.std(0)
        self.scale_[self.scale_ == 0] = 1.0  # a constant channel carries nothing; avoid 0/0
        pca = PCA(n_components=self.n_components, svd_solver="full").fit((feats - self.mean_) / self.scale_)
        self.components_ = pca.components_.astype(np.float32)
        self.pca_mean_ = pca.mean_.astype(np.float32)
        return self

    def project(self, patch_feats: np.ndarray) -> np.ndarray:
        """(C, gh, gw) patch features → (n_components, gh, gw)."""
        if self.components_ is None:
            raise ValueError("ViT features are not fitted yet: call fit() on the training images first")
        c, gh, gw = patch_feats.shape
        if c != self.components_.shape[1]:
            raise ValueError(f"the backbone gives {c} channels, the fitted PCA expects {self.components_.shape[1]}")
        z = ((patch_feats.reshape(c, -1).T - self.mean_) / self.scale_ - self.pca_mean_) @ self.components_.T
        return z.T.reshape(-1, gh, gw).astype(np.float32)

    def transform(self, image01: np.ndarray) -> np.ndarray:
        """(n_components, H, W) float32 per-pixel features of a (H, W) image in [0, 1]."""
        h, w = image01.shape
        z = torch.from_numpy(self.project(self.patch_features(image01)))[None]
        p = _patch_size(self.model)
        up = F.interpolate(z, size=(z.shape[-2] * p, z.shape[-1] * p), mode="bilinear", align_corners=False)
        return up[0, :, :h, :w].numpy()

    def state(self) -> dict[str, np.ndarray]:
        """The fitted arrays, for saving with ``np.savez`` (no pickle)."""
        return {"mean": self.mean_, "scale": self.scale_, "components": self.components_, "pca_mean": self.pca_mean_}

    def load_state(self, state) -> "ViTFeatures":
        self.mean_, self.scale_ = np.asarray(state["mean"]), np.asarray(state["scale"])
        self.components_, self.pca_mean_ = np.asarray(state["components"]), np.asarray(state["pca_mean"])
        self.n_components = self.components_.shape[0]
        return self
