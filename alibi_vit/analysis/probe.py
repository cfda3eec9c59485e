"""The positional-bias linear probe (docs/method.md §5): how well do patch features predict *where* a patch is?

For an image's (C, h, w) feature grid, a ridge regression on standardised features is fitted
at a random ``fraction`` of the patches to a position target and scored (R²) on the patches it
did not see. Targets, as the authors' reference code defines them (``get_ramp``):

- ``x``: left → right, ``y``: top → bottom, each 0 → 1 over its own side;
- ``diag``: (a_row + a_col) / 2 with a = linspace(0, 1, max(h, w)), one scale for both sides, so
  on a non-square grid it reaches 1 only along the longer side;
- ``radial``: 1 − r / max r, r the distance in patches from patch (h // 2, w // 2) (the centre
  patch of an odd side; on an even side the patch just past the middle);
- ``xy``: the joint (x, y) target, R² averaged over both outputs: the headline score.

A model whose features carry absolute position scores near 1; a position-free model scores
near 0 or below (held-out R² is negative when the fit is worse than the mean).

The fit needs enough patches: 2.5 % of a 37×37 grid (518 px) is 34 patches, but of an 8×8
grid (112 px) it is 2, and R² then means nothing (−191 was seen). So at least ``min_train``
patches (default 32) are fitted, raising the fraction with a warning, and at most half the
patches, so that as many are scored.
"""

from __future__ import annotations

import sys
import warnings
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["MIN_TRAIN", "PER_CHANNEL_FITS", "TARGETS", "fitted_patches", "reference_fitted_patches", "layer_fingerprint", "per_channel_r2", "position_targets",
           "positional_r2"]

TARGETS = ("x", "y", "diag", "radial", "xy")
MIN_TRAIN = 32  # fitted patches at least: about what 2.5 % of a 518 px image (37×37 patches) gives


def position_targets(grid_size, target: str = "xy") -> np.ndarray:
    """Target values for every patch of an (h, w) grid, row-major: shape (h·w, outputs)."""
    if target not in TARGETS:
        raise ValueError(f"unknown probe target {target!r}; choose one of {', '.join(TARGETS)}")
    h, w = grid_size
    y, x = np.meshgrid(np.linspace(0.0, 1.0, h) if h > 1 else np.zeros(1),
                       np.linspace(0.0, 1.0, w) if w > 1 else np.zeros(1), indexing="ij")
    if target == "x":
        out = [x]
    elif target == "y":
        out = [y]
    elif target == "diag":
        a = np.linspace(0.0, 1.0, max(h, w)) if max(h, w) > 1 else np.zeros(1)
        out = [(a[:h, None] + a[None, :w]) / 2.0]
    elif target == "radial":
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        r = np.hypot(rows - h // 2, cols - w // 2)
        out = [1.0 - r / r.max() if r.max() > 0 else np.ones_like(r)]
    else:
        out = [x, y]
    return np.stack([o.reshape(-1) for o in out], axis=1)


def _as_feature_batch(features) -> np.ndarray:
    torch = sys.modules.get("torch")  # features cannot be a tensor if torch was never imported
    if torch is not None and isinstance(features, torch.Tensor):
        features = features.detach().to("cpu", torch.float64).numpy()
    features = np.asarray(features, dtype=np.float64)
    if features.ndim == 3:
        features = features[None]
    if features.ndim != 4:
        raise ValueError(f"features must be (C, h, w) or (B, C, h, w), got shape {features.shape}")
    if features.shape[2] * features.shape[3] < 4:
        raise ValueError(f"a {features.shape[2]}×{features.shape[3]} grid has too few patches to probe")
    if not np.isfinite(features).all():
        raise ValueError("features contain NaN or infinite values")
    return features


def fitted_patches(num_patches: int, fraction: float, min_train: int = MIN_TRAIN) -> int:
    """How many of ``num_patches`` the probe fits on: ``fraction`` of them, raised to ``min_train``,
    capped at half the patches (and at least 2, with at least 2 left to score)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if min_train < 0:
        raise ValueError(f"min_train must be at least 0, got {min_train}")
    wanted = round(fraction * num_patches)
    n = max(wanted, min(min_train, num_patches // 2))
    return min(max(2, n), num_patches - 2)  # R² is undefined on fewer than two patches


def reference_fitted_patches(num_patches: int) -> int:
    """Patches the paper's reference code fits on: (h·w)//36 (38 of a 37×37 grid), at least 2, leaving 2 to score."""
    return min(max(2, num_patches // 36), num_patches - 2)


def _fit_note(num_patches: int, fraction: float, min_train: int) -> int:
    n = fitted_patches(num_patches, fraction, min_train)
    if n > round(fraction * num_patches):
        warnings.warn(f"positional probe: {fraction:.1%} of {num_patches} patches is {round(fraction * num_patches)}, "
                      f"too few to fit; fitting {n} ({n / num_patches:.1%}) instead (min_train={min_train})",
                      stacklevel=3)
    if n < min_train:
        warnings.warn(f"positional probe: a grid of {num_patches} patches is small; fitting only {n} of them "
                      "makes R² noisy (use larger images)", stacklevel=3)
    return n


def _splits(num_patches: int, n_train: int, repeats: int, seed: int):
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rng = np.random.default_rng(seed)
    for _ in range(repeats):
        perm = rng.permutation(num_patches)
        yield perm[:n_train], perm[n_train:]


def positional_r2(features, target: str = "xy", fraction: float = 0.025, repeats: int = 10, seed: int = 0,
                  alpha: float = 1.0, min_train: int = MIN_TRAIN, n_train: int | None = None) -> float:
    """Held-out R² of a ridge probe from all channels to ``target``, averaged over repeats and images.

    Args:
        features: (C, h, w) or (B, C, h, w) array or tensor of patch features.
        target: one of ``TARGETS``.
        fraction: share of patches used to fit (the rest are scored).
        repeats: random samplings per image; image b uses seeds derived from ``seed`` and b.
        alpha: ridge penalty on the standardised features.
        min_train: fit on at least this many patches (at most half the grid); raising the
            fraction to reach it warns. 0 keeps ``fraction`` as given.
        n_train: fit on exactly this many patches instead of ``fraction``/``min_train`` (at least 2,
            leaving at least 2 to score); the paper's reference code fits (h·w)//36.
    """
    from sklearn.linear_model import Ridge
    from sklearn.metrics import r2_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    feats = _as_feature_batch(features)
    B, C, h, w = feats.shape
    y_all = position_targets((h, w), target)
    if n_train is None:
        n_train = _fit_note(h * w, fraction, min_train)
    else:
        n_train = min(max(2, int(n_train)), h * w - 2)
    scores = []
    for b in range(B):
        x_all = feats[b].reshape(C, h * w).T
        for train, test in _splits(h * w, n_train, repeats, seed + 7919 * b):
            probe = make_pipeline(StandardScaler(), Ridge(alpha=alpha))
            probe.fit(x_all[train], y_all[train])
            scores.append(r2_score(y_all[test], probe.predict(x_all[test])))
    return float(np.mean(scores))


PER_CHANNEL_FITS = ("ridge", "lstsq")


def per_channel_r2(features, target: str = "xy", fraction: float = 0.025, repeats: int = 10,
                   seed: int = 0, min_train: int = MIN_TRAIN, fit: str = "ridge", alpha: float = 1.0) -> np.ndarray:
    """Held-out R² of a one-channel linear fit per channel: the "positional fingerprint", shape (C,).

    ``fit="ridge"`` (default, as the authors' notebook): the channel standardised on the fitted
    patches, then ridge regression with penalty ``alpha`` (scikit-learn's ``StandardScaler`` +
    ``Ridge(alpha)`` on that one channel); ``fit="lstsq"``: plain least squares. Both in closed form
    for every channel at once; multi-output targets average R² over outputs, like
    :func:`positional_r2` (same ``fraction``/``min_train`` rule and splits).
    """
    if fit not in PER_CHANNEL_FITS:
        raise ValueError(f"fit must be one of {', '.join(PER_CHANNEL_FITS)}, got {fit!r}")
    if fit == "ridge" and alpha < 0:
        raise ValueError(f"alpha must be at least 0, got {alpha}")
    penalty = alpha if fit == "ridge" else 0.0
    feats = _as_feature_batch(features)
    B, C, h, w = feats.shape
    y_all = position_targets((h, w), target)  # (P, K)
    n_train = _fit_note(h * w, fraction, min_train)
    total = np.zeros(C)
    count = 0
    for b in range(B):
        x_all = feats[b].reshape(C, h * w).T  # (P, C)
        for train, test in _splits(h * w, n_train, repeats, seed + 7919 * b):
            xt, yt = x_all[train], y_all[train]
            mean = xt.mean(0)
            x_c = xt - mean
            var = (x_c ** 2).sum(0)  # (C,)
            if penalty:
                # standardise (StandardScaler: ddof 0, scale 1 for a constant channel): Σz² = n, slope_z = Σz·y / (n + α)
                std = np.sqrt(var / len(train))
                scale = np.where(std > 0, std, 1.0)
                z_c = x_c / scale
                slope_z = (z_c.T @ (yt - yt.mean(0))) / ((z_c ** 2).sum(0)[:, None] + penalty)  # (C, K)
                slope = slope_z / scale[:, None]
            else:
                cov = x_c.T @ (yt - yt.mean(0))  # (C, K)
                slope = np.divide(cov, var[:, None], out=np.zeros_like(cov), where=var[:, None] > 0)
            intercept = yt.mean(0)[None, :] - slope * mean[:, None]  # (C, K)
            pred = x_all[test][:, :, None] * slope[None] + intercept[None]  # (P_test, C, K)
            y_test = y_all[test][:, None, :]
            ss_res = ((y_test - pred) ** 2).sum(0)
            ss_tot = ((y_test - y_test.mean(0)) ** 2).sum(0)
            total += (1.0 - ss_res / ss_tot).mean(axis=1)
            count += 1
    return total / count


def layer_fingerprint(model, images: torch.Tensor, layers=None, target: str = "xy", fraction: float = 0.025,
                      repeats: int = 10, seed: int = 0, min_train: int = MIN_TRAIN) -> dict[int, dict]:
    """Per-layer probe of a timm ViT: ``{layer: {"r2": float, "channel_r2": (C,) array}}``."""
    import torch

    from ..features import patch_features

    layers = list(range(len(model.blocks))) if layers is None else list(layers)
    with torch.no_grad():
        feats = patch_features(model, images, layers=layers)
    return {layer: {"r2": positional_r2(f, target, fraction, repeats, seed, min_train=min_train),
                    "channel_r2": per_channel_r2(f, target, fraction, repeats, seed, min_train=min_train)}
            for layer, f in feats.items()}
