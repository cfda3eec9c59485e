"""Dense-CRF clean-up of class probabilities (Krähenbühl & Koltun 2011), README.md "Method" §7.

Defaults are the paper authors' settings: a Gaussian (smoothness) term of sxy 3, compat 10 and a
bilateral (appearance) term of sxy 80, srgb 13, compat 10, run for 10 mean-field iterations. The
CRF works on the whole image at once (memory grows with its pixel count, about K·H·W·4 bytes a
few times over), unlike the tiled featuriser and classifier.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CRF_DEFAULTS", "dense_crf"]

CRF_DEFAULTS = dict(gaussian_sxy=3.0, gaussian_compat=10.0, bilateral_sxy=80.0, bilateral_srgb=13.0,
                    bilateral_compat=10.0, iterations=10)


def dense_crf(proba: np.ndarray, image01: np.ndarray, **params) -> np.ndarray:
    """Refined (H, W, K) probabilities from (H, W, K) class probabilities and the (H, W) or RGB
    (H, W, 3) image in [0, 1] (the bilateral term compares colours; grey is repeated to RGB)."""
    try:
        import pydensecrf.densecrf as dcrf
        from pydensecrf.utils import unary_from_softmax
    except ImportError as err:  # pragma: no cover - pydensecrf2 is a dependency; this names the fix
        raise ImportError("the dense CRF needs the package pydensecrf2: pip install pydensecrf2") from err
    unknown = set(params) - set(CRF_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown CRF parameters {sorted(unknown)}; known: {sorted(CRF_DEFAULTS)}")
    p = {**CRF_DEFAULTS, **params}
    h, w, k = proba.shape
    if image01.shape[:2] != (h, w) or image01.ndim not in (2, 3):
        raise ValueError(f"image is {image01.shape} but the probabilities are {(h, w)}")
    crf = dcrf.DenseCRF2D(w, h, k)
    softmax = np.clip(np.moveaxis(proba, -1, 0), 1e-8, 1.0).astype(np.float32)
    crf.setUnaryEnergy(np.ascontiguousarray(unary_from_softmax(softmax)))
    crf.addPairwiseGaussian(sxy=p["gaussian_sxy"], compat=p["gaussian_compat"])
    u8 = (np.clip(image01, 0, 1) * 255).round().astype(np.uint8)
    rgb = np.ascontiguousarray(u8[..., :3] if u8.ndim == 3 else np.repeat(u8[..., None], 3, -1))
    crf.addPairwiseBilateral(sxy=p["bilateral_sxy"], srgb=p["bilateral_srgb"], rgbim=rgb,
                             compat=p["bilateral_compat"])
    q = np.asarray(crf.inference(int(p["iterations"])), np.float32).reshape(k, h, w)
    return np.moveaxis(q, 0, -1)
