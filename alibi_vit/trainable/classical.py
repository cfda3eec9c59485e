"""Classical per-pixel features: filter banks in the Weka "trainable segmentation" tradition (docs/method.md §7).

A filter set (:data:`FILTER_SETS`) names which features are computed. For each σ in ``sigmas``
(0 = the image itself) the image is blurred with a Gaussian of σ·``sigma_scale`` px, and from
each blur come some of: the blur, its gradient magnitude (Sobel), the Hessian's two eigenvalues,
its modulus, trace and determinant. Then differences of Gaussians (each blur minus every finer
one, or only minus the next finer one) and membrane projections (a 19×19 kernel holding a 1-px
line through its centre, rotated in equal steps over 180°; statistics over the responses).

- ``weka``: the full Weka set as the paper's authors use it: σ ∈ {0, 1, 2, 4, 8, 16} scaled by
  0.4 (Weka's convention, so the largest blur is 6.4 px), all seven per-σ features, all 15
  differences, 30 membrane angles (6° steps) with sum, mean, std, median, max and min: 63 features.
- ``compact``: the same σ values in px (blurs up to 16 px, as scikit-image's multiscale features
  reach), per σ the blur, gradient and two Hessian eigenvalues (modulus, trace and determinant
  are functions of those) and the 5 differences of neighbouring blurs: 29 features, no membrane
  projections (they took most of the time and added no accuracy on the labelled micrograph
  set's training split; docs/segmentation.md gives the comparison).

The filters run in OpenCV (separable kernels, SIMD, its own threads) with the kernels scipy would
use: the results equal ``scipy.ndimage`` to float32 rounding. Border handling everywhere is mirror
reflection (scipy's ``mode="reflect"``, OpenCV's ``BORDER_REFLECT``), so features of a crop with
a margin of :func:`halo` px equal those of the whole image inside the crop: that is what lets
:class:`~alibi_vit.trainable.TrainableSegmenter` featurise large images tile by tile.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cv2
import numpy as np

from .io import to_unit_float

if TYPE_CHECKING:  # torch is imported where it is used: the OpenCV path needs none
    import torch

__all__ = ["DEFAULT_SIGMAS", "FILTER_SETS", "FilterSet", "classical_feature_names", "classical_features",
           "classical_features_chw", "classical_features_torch", "classical_planes", "halo", "membrane_kernels",
           "pixel_major"]

DEFAULT_SIGMAS = (0, 1, 2, 4, 8, 16)
SIGMA_SCALE = 0.4
TRUNCATE = 4.0  # Gaussian kernels reach TRUNCATE·σ px, scipy's default
MEMBRANE_SIZE = 19
MEMBRANE_ANGLES = 30  # 6° steps over 180°
PER_SIGMA = ("gaussian", "gradient", "hessian_eig1", "hessian_eig2", "hessian_modulus", "hessian_trace",
             "hessian_det")
MEMBRANE_STATS = ("sum", "mean", "std", "median", "max", "min")


@dataclass(frozen=True)
class FilterSet:
    """Which classical features are computed (see the module docstring)."""
    sigmas: tuple
    sigma_scale: float
    per_sigma: tuple  # subset of PER_SIGMA, in that order
    dog: str  # "all": each blur minus every finer one; "adjacent": minus the next finer one
    membrane_stats: tuple  # subset of MEMBRANE_STATS, in that order (empty: no membrane projections)
    membrane_angles: int


FILTER_SETS = {
    "weka": FilterSet(DEFAULT_SIGMAS, SIGMA_SCALE, PER_SIGMA, "all", MEMBRANE_STATS, MEMBRANE_ANGLES),
    "compact": FilterSet(DEFAULT_SIGMAS, 1.0, PER_SIGMA[:4], "adjacent", (), MEMBRANE_ANGLES),
}


def filter_set(filters="weka", sigmas=None, sigma_scale=None) -> FilterSet:
    """The :class:`FilterSet` named ``filters`` (or given), with ``sigmas``/``sigma_scale`` overriding its own."""
    fs = filters if isinstance(filters, FilterSet) else FILTER_SETS.get(filters)
    if fs is None:
        raise ValueError(f"unknown filter set {filters!r}; choose one of {', '.join(FILTER_SETS)}")
    sigmas = fs.sigmas if sigmas is None else tuple(float(s) for s in sigmas)
    if not sigmas or any(s < 0 for s in sigmas) or list(sigmas) != sorted(set(sigmas)):
        raise ValueError(f"sigmas must be distinct, non-negative and increasing, got {sigmas}")
    scale = fs.sigma_scale if sigma_scale is None else float(sigma_scale)
    return FilterSet(tuple(float(s) for s in sigmas), scale, fs.per_sigma, fs.dog, fs.membrane_stats,
                     fs.membrane_angles)


def _dog_pairs(n: int, dog: str) -> list[tuple[int, int]]:
    """(coarse, fine) blur indices of the differences of Gaussians."""
    return [(j, i) for j in range(n) for i in range(j) if dog == "all" or i == j - 1]


def classical_feature_names(sigmas=None, filters="weka") -> list[str]:
    """Names of the feature channels :func:`classical_features` returns, in order."""
    fs = filter_set(filters, sigmas)
    sig = fs.sigmas
    names = [f"{kind}_s{s:g}" for s in sig for kind in fs.per_sigma]
    names += [f"dog_s{sig[j]:g}-s{sig[i]:g}" for j, i in _dog_pairs(len(sig), fs.dog)]
    names += [f"membrane_{stat}" for stat in fs.membrane_stats]
    return names


def halo(sigmas=None, sigma_scale=None, filters="weka") -> int:
    """Margin in px beyond which a pixel cannot influence another's features (the filters' reach)."""
    fs = filter_set(filters, sigmas, sigma_scale)
    gauss = int(TRUNCATE * max(fs.sigmas) * fs.sigma_scale + 0.5)
    # + Sobel/central differences (1 px each, twice for the Hessian) + the membrane kernel's radius
    return gauss + 2 + (MEMBRANE_SIZE // 2 if fs.membrane_stats else 0)


def membrane_kernels(size: int = MEMBRANE_SIZE, angles: int = MEMBRANE_ANGLES) -> np.ndarray:
    """(angles, size, size) float32: a 1-px line through the centre, rotated by 180°/angles steps.

    Each kernel is rotated with bilinear interpolation and normalised to sum 1, so a response is
    the mean intensity along the line and a constant image gives the same value at every angle.
    """
    from scipy import ndimage as ndi  # here, not on import: only the membrane filters need it

    base = np.zeros((size, size), np.float64)
    base[:, size // 2] = 1.0
    kernels = []
    for i in range(angles):
        k = ndi.rotate(base, 180.0 * i / angles, reshape=False, order=1, mode="constant")
        kernels.append(k / k.sum())
    return np.stack(kernels).astype(np.float32)


_MEMBRANE_THREAD = ThreadPoolExecutor(1, thread_name_prefix="membrane")


def _membrane(image: np.ndarray, stats=MEMBRANE_STATS, angles: int = MEMBRANE_ANGLES) -> list[np.ndarray]:
    """The ``stats`` over the ``angles`` membrane responses. Without the median, the responses are
    reduced as they come (running sums, max, min): no (angles, H, W) stack is held."""
    kernels = membrane_kernels(angles=angles)
    # The kernels are point-symmetric, so OpenCV's correlation equals a convolution.
    responses = (cv2.filter2D(image, cv2.CV_32F, k, borderType=cv2.BORDER_REFLECT) for k in kernels)
    if "median" in stats:
        resp = np.stack(list(responses))
        n = len(resp)
        # A partial sort to the two middle ranks (numpy's introselect) is ~3× faster than a full sort.
        middle = np.partition(resp, [(n - 1) // 2, n // 2], axis=0)
        mean = resp.mean(0)
        values = {"sum": resp.sum(0), "mean": mean, "std": resp.std(0), "max": resp.max(0), "min": resp.min(0),
                  "median": 0.5 * (middle[(n - 1) // 2] + middle[n // 2])}
        return [values[s] for s in stats]
    total = square = high = low = None
    for r in responses:
        if total is None:
            total, square, high, low = r.astype(np.float64), r.astype(np.float64) ** 2, r, r.copy()
            continue
        total += r
        square += np.square(r, dtype=np.float64)
        np.maximum(high, r, out=high)
        np.minimum(low, r, out=low)
    mean = total / angles
    values = {"sum": total, "mean": mean, "std": np.sqrt(np.maximum(square / angles - mean * mean, 0.0)), "max": high,
              "min": low}
    return [values[s].astype(np.float32) for s in stats]


def _correlate(x: np.ndarray, k_rows, k_cols) -> np.ndarray:
    """scipy.ndimage's correlate1d along rows with ``k_rows`` then along columns with ``k_cols``
    (None: no filtering along that axis), mirror borders."""
    one = np.ones(1, np.float32)
    kx = one if k_cols is None else np.asarray(k_cols, np.float32)
    ky = one if k_rows is None else np.asarray(k_rows, np.float32)
    return cv2.sepFilter2D(x, cv2.CV_32F, kx, ky, borderType=cv2.BORDER_REFLECT)


def _gaussian_kernel(sd: float) -> np.ndarray:
    r = int(TRUNCATE * sd + 0.5)  # scipy's radius for gaussian_filter
    t = np.arange(-r, r + 1, dtype=np.float64)
    w = np.exp(-0.5 * t * t / (sd * sd))
    return (w / w.sum()).astype(np.float32)


_CENTRAL = np.array([-0.5, 0.0, 0.5], np.float32)
_DERIV, _SMOOTH = np.array([-1.0, 0.0, 1.0], np.float32), np.array([1.0, 2.0, 1.0], np.float32)


def _per_sigma(blur: np.ndarray, kinds) -> list[np.ndarray]:
    out = {"gaussian": blur}
    if "gradient" in kinds:  # Sobel along each axis (scipy.ndimage.sobel), magnitude / 8
        out["gradient"] = np.hypot(_correlate(blur, _DERIV, _SMOOTH), _correlate(blur, _SMOOTH, _DERIV)) / 8.0
    if len(set(kinds) - {"gaussian", "gradient"}):
        # Central differences with mirrored borders, one axis at a time: exact for quadratics (the
        # tests check hand values) and defined for images of any size, 1 px included.
        d_r = _correlate(blur, _CENTRAL, None)
        h_rr, h_rc = _correlate(d_r, _CENTRAL, None), _correlate(d_r, None, _CENTRAL)
        h_cc = _correlate(_correlate(blur, None, _CENTRAL), None, _CENTRAL)
        trace = h_rr + h_cc
        root = np.sqrt(0.25 * (h_rr - h_cc) ** 2 + h_rc * h_rc)
        out.update(hessian_eig1=0.5 * trace + root, hessian_eig2=0.5 * trace - root, hessian_trace=trace)
        if "hessian_modulus" in kinds:  # Weka's "module": sqrt(Hxx² + Hxy·Hyx + Hyy²)
            out["hessian_modulus"] = np.sqrt(h_rr * h_rr + h_rc * h_rc + h_cc * h_cc)
        if "hessian_det" in kinds:
            out["hessian_det"] = h_rr * h_cc - h_rc * h_rc
    return [out[k] for k in kinds]


def classical_planes(image01: np.ndarray, sigmas=None, *, sigma_scale=None, filters="weka") -> list[np.ndarray]:
    """The features of a 2D float image (already scaled to [0, 1]) as a list of (H, W) float32
    planes in :func:`classical_feature_names` order (no stacking copy; see :func:`pixel_major`)."""
    fs = filter_set(filters, sigmas, sigma_scale)
    x = np.ascontiguousarray(image01, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"image must be 2D (H, W), got shape {x.shape}")
    # The membrane projections overlap with the filters below: OpenCV and numpy release the GIL.
    membrane = _MEMBRANE_THREAD.submit(_membrane, x, fs.membrane_stats, fs.membrane_angles) if fs.membrane_stats \
        else None
    blurs = [_correlate(x, k, k) if s > 0 else x
             for s, k in ((s, _gaussian_kernel(s * fs.sigma_scale) if s > 0 else None) for s in fs.sigmas)]
    planes = [p for blur in blurs for p in _per_sigma(blur, fs.per_sigma)]
    planes += [blurs[j] - blurs[i] for j, i in _dog_pairs(len(blurs), fs.dog)]
    if membrane is not None:
        planes += membrane.result()
    return planes


def pixel_major(planes, rows=slice(None), cols=slice(None), dtype=np.float32) -> np.ndarray:
    """(h, w, F) C-contiguous from F planes (each cropped to ``rows``, ``cols``): the layout a
    classifier reads rows from. OpenCV's interleaving is several times faster than numpy's transposed copy."""
    crops = [np.asarray(p, np.float32)[rows, cols] for p in planes]
    chunks = [cv2.merge(crops[i:i + 512]) for i in range(0, len(crops), 512)]  # cv2.merge: ≤ 512 channels
    chunks = [c[..., None] if c.ndim == 2 else c for c in chunks]
    out = chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=-1)
    return out if out.dtype == dtype else out.astype(dtype)


def _prepare(image, intensity):
    if intensity is None:
        x = np.asarray(image, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"image must be 2D (H, W) with intensity=None, got shape {x.shape}")
        return x
    return to_unit_float(image, intensity)


def classical_features(image, sigmas=None, *, sigma_scale=None, intensity: str | None = "auto", dtype=np.float32,
                       filters="weka") -> np.ndarray:
    """(H, W, F) C-contiguous per-pixel features of a 2D image; names from :func:`classical_feature_names`.

    image: (H, W) of any integer or float dtype (16-bit included) or (H, W, 3|4) RGB(A), which is
        converted to luminance. Any size, down to 1×1.
    filters: the filter set (:data:`FILTER_SETS`): "weka" (default here: 6·7 + 15 + 6 = 63
        features) or "compact"; ``sigmas`` and ``sigma_scale`` override its σ values (0 meaning the
        unblurred image) and their scale to px.
    intensity: how the image becomes float in [0, 1] (see :func:`~alibi_vit.trainable.io.to_unit_float`);
        ``None`` takes a float image as it is (used when the caller has scaled it already).
    """
    planes = classical_planes(_prepare(image, intensity), sigmas, sigma_scale=sigma_scale, filters=filters)
    return pixel_major(planes, dtype=dtype)


def classical_features_chw(image, sigmas=None, *, sigma_scale=None, intensity: str | None = "auto",
                           dtype=np.float32, filters="weka") -> np.ndarray:
    """(F, H, W) C-contiguous: the same features as :func:`classical_features`, channels first."""
    planes = classical_planes(_prepare(image, intensity), sigmas, sigma_scale=sigma_scale, filters=filters)
    return np.stack(planes).astype(dtype, copy=False)


# ---- torch implementation (CUDA when present) -------------------------------------------------

def _reflect_index(n: int, r: int, device) -> torch.Tensor:
    """Indices of a length-n axis padded by r on each side as scipy's mode="reflect" pads
    (d c b a | a b c d | d c b a, repeating for pads longer than the axis)."""
    import torch

    i = torch.arange(-r, n + r, device=device) % (2 * n)
    return torch.where(i >= n, 2 * n - 1 - i, i)


def _correlate1d(x: torch.Tensor, weights: torch.Tensor, axis: int) -> torch.Tensor:
    """scipy.ndimage.correlate1d(x, weights, axis, mode="reflect") for a (B, H, W) tensor; odd-length weights."""
    import torch.nn.functional as F

    r = (len(weights) - 1) // 2
    dim = axis + 1
    idx = _reflect_index(x.shape[dim], r, x.device)
    xp = x.index_select(dim, idx)
    if dim == 1:  # along rows: (B, 1, H + 2r, W) with a (k, 1) kernel
        return F.conv2d(xp[:, None], weights.view(1, 1, -1, 1))[:, 0]
    return F.conv2d(xp[:, None], weights.view(1, 1, 1, -1))[:, 0]


def _gaussian_weights(sd: float, device) -> torch.Tensor:
    import torch

    r = int(TRUNCATE * sd + 0.5)  # scipy's radius for gaussian_filter
    x = torch.arange(-r, r + 1, dtype=torch.float64)
    w = torch.exp(-0.5 * x * x / (sd * sd))
    return (w / w.sum()).to(device=device, dtype=torch.float32)


def classical_features_torch(image01, sigmas=None, *, sigma_scale=None, device=None, filters="weka") -> np.ndarray:
    """(F, H, W) float32: :func:`classical_features_chw` of an (H, W) image in [0, 1] computed with
    torch, on ``device`` (default CUDA when available, else CPU). Agrees with the OpenCV path to
    float32 rounding (the tests check 1e-4 relative, 1e-5 absolute)."""
    import torch  # here, not at the module's top: the OpenCV path (the CPU default) needs no torch
    import torch.nn.functional as F

    fs = filter_set(filters, sigmas, sigma_scale)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.as_tensor(np.ascontiguousarray(image01, np.float32), device=device)
    if x.ndim != 2:
        raise ValueError(f"image must be 2D (H, W), got shape {tuple(x.shape)}")
    x = x[None]
    central = torch.tensor([-0.5, 0.0, 0.5], device=device)
    deriv, smooth = torch.tensor([-1.0, 0.0, 1.0], device=device), torch.tensor([1.0, 2.0, 1.0], device=device)
    out = []
    blurs = []
    with torch.no_grad():
        for s in fs.sigmas:
            if s > 0:
                w = _gaussian_weights(s * fs.sigma_scale, device)
                blur = _correlate1d(_correlate1d(x, w, 0), w, 1)
            else:
                blur = x
            blurs.append(blur)
            g_r = _correlate1d(_correlate1d(blur, deriv, 0), smooth, 1)
            g_c = _correlate1d(_correlate1d(blur, deriv, 1), smooth, 0)
            d_r = _correlate1d(blur, central, 0)
            h_rr, h_rc = _correlate1d(d_r, central, 0), _correlate1d(d_r, central, 1)
            h_cc = _correlate1d(_correlate1d(blur, central, 1), central, 1)
            trace = h_rr + h_cc
            root = torch.sqrt(0.25 * (h_rr - h_cc) ** 2 + h_rc * h_rc)
            values = {"gaussian": blur, "gradient": torch.hypot(g_r, g_c) / 8.0, "hessian_eig1": 0.5 * trace + root,
                      "hessian_eig2": 0.5 * trace - root, "hessian_trace": trace,
                      "hessian_modulus": torch.sqrt(h_rr * h_rr + h_rc * h_rc + h_cc * h_cc),
                      "hessian_det": h_rr * h_cc - h_rc * h_rc}
            out += [values[k] for k in fs.per_sigma]
        out += [blurs[j] - blurs[i] for j, i in _dog_pairs(len(blurs), fs.dog)]
        if fs.membrane_stats:
            r = MEMBRANE_SIZE // 2
            h, w_ = x.shape[1:]
            xp = x[:, _reflect_index(h, r, device)][:, :, _reflect_index(w_, r, device)]
            weight = torch.as_tensor(membrane_kernels(angles=fs.membrane_angles), device=device)[:, None]
            resp = F.conv2d(xp[:, None], weight)[0]  # (angles, H, W)
            n = resp.shape[0]
            values = {"sum": resp.sum(0), "mean": resp.mean(0), "std": resp.std(0, unbiased=False),
                      "max": resp.amax(0), "min": resp.amin(0)}
            if "median" in fs.membrane_stats:
                srt = resp.sort(0).values
                values["median"] = 0.5 * (srt[(n - 1) // 2] + srt[n // 2])
            out += [values[k][None] for k in fs.membrane_stats]
        return torch.cat(out).cpu().numpy()
