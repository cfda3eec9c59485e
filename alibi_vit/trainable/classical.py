"""Classical per-pixel features: the Weka "trainable segmentation" set (docs/method.md §7).

For each σ in ``sigmas`` (0 = the image itself) the image is blurred with a Gaussian of
σ·``sigma_scale`` px (Weka's 0.4 scaling), and from each blur come: the blur, its gradient
magnitude (Sobel), the Hessian's two eigenvalues, its modulus, trace and determinant. Then the
differences of Gaussians (each blur minus every finer one) and the membrane projections (a 19×19
kernel holding a 1-px line through its centre, rotated in 6° steps: 30 kernels; sum, mean, std,
median, max and min over the 30 responses).

Border handling everywhere is mirror reflection (scipy's ``mode="reflect"``), so features of a
crop with a margin of :func:`halo` px equal those of the whole image inside the crop: that is
what lets :class:`~alibi_vit.trainable.TrainableSegmenter` featurise large images tile by tile.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage as ndi

from .io import to_unit_float

__all__ = ["DEFAULT_SIGMAS", "classical_feature_names", "classical_features", "classical_features_chw",
           "classical_features_torch", "halo",
           "membrane_kernels"]

DEFAULT_SIGMAS = (0, 1, 2, 4, 8, 16)
SIGMA_SCALE = 0.4
TRUNCATE = 4.0  # Gaussian kernels reach TRUNCATE·σ px, scipy's default
MEMBRANE_SIZE = 19
MEMBRANE_ANGLES = 30  # 6° steps over 180°
PER_SIGMA = ("gaussian", "gradient", "hessian_eig1", "hessian_eig2", "hessian_modulus", "hessian_trace",
             "hessian_det")
MEMBRANE_STATS = ("sum", "mean", "std", "median", "max", "min")


def classical_feature_names(sigmas=DEFAULT_SIGMAS) -> list[str]:
    """Names of the feature channels :func:`classical_features` returns, in order."""
    names = [f"{kind}_s{s:g}" for s in sigmas for kind in PER_SIGMA]
    names += [f"dog_s{sigmas[j]:g}-s{sigmas[i]:g}" for j in range(len(sigmas)) for i in range(j)]
    names += [f"membrane_{stat}" for stat in MEMBRANE_STATS]
    return names


def halo(sigmas=DEFAULT_SIGMAS, sigma_scale: float = SIGMA_SCALE) -> int:
    """Margin in px beyond which a pixel cannot influence another's features (the filters' reach)."""
    gauss = int(TRUNCATE * max(sigmas) * sigma_scale + 0.5)
    # + Sobel/np.gradient (1 px each, twice for the Hessian) + the membrane kernel's radius
    return gauss + 2 + MEMBRANE_SIZE // 2


def membrane_kernels(size: int = MEMBRANE_SIZE, angles: int = MEMBRANE_ANGLES) -> np.ndarray:
    """(angles, size, size) float32: a 1-px line through the centre, rotated by 180°/angles steps.

    Each kernel is rotated with bilinear interpolation and normalised to sum 1, so a response is
    the mean intensity along the line and a constant image gives the same value at every angle.
    """
    base = np.zeros((size, size), np.float64)
    base[:, size // 2] = 1.0
    kernels = []
    for i in range(angles):
        k = ndi.rotate(base, 180.0 * i / angles, reshape=False, order=1, mode="constant")
        kernels.append(k / k.sum())
    return np.stack(kernels).astype(np.float32)


_MEMBRANE_THREAD = ThreadPoolExecutor(1, thread_name_prefix="membrane")


def _membrane(image: np.ndarray) -> list[np.ndarray]:
    r = MEMBRANE_SIZE // 2
    # np.pad "symmetric" is scipy's "reflect"; the kernels are point-symmetric, so torch's
    # cross-correlation equals a convolution.
    padded = torch.from_numpy(np.pad(image, r, mode="symmetric"))[None, None]
    weight = torch.from_numpy(membrane_kernels())[:, None]
    with torch.no_grad():
        resp = F.conv2d(padded, weight)[0]  # (30, H, W)
        n = resp.shape[0]
        # A partial sort to the two middle ranks (numpy's introselect) is ~3× faster than a full sort.
        middle = np.partition(resp.numpy(), [(n - 1) // 2, n // 2], axis=0)
        median = 0.5 * (middle[(n - 1) // 2] + middle[n // 2])
        stats = (resp.sum(0), resp.mean(0), resp.std(0, unbiased=False), median, resp.amax(0), resp.amin(0))
    return [s if isinstance(s, np.ndarray) else s.numpy() for s in stats]


def _diff(x: np.ndarray, axis: int) -> np.ndarray:
    # Central difference with mirrored borders: exact for quadratics (the tests check hand values)
    # and defined for images of any size, 1 px included.
    return ndi.correlate1d(x, _CENTRAL, axis=axis, mode="reflect")


_CENTRAL = np.array([-0.5, 0.0, 0.5], np.float32)


def _hessian(blur: np.ndarray):
    d_r = _diff(blur, 0)
    return _diff(d_r, 0), _diff(d_r, 1), _diff(_diff(blur, 1), 1)


def classical_features(image, sigmas=DEFAULT_SIGMAS, *, sigma_scale: float = SIGMA_SCALE,
                       intensity: str | None = "auto", dtype=np.float32) -> np.ndarray:
    """(H, W, F) per-pixel features of a 2D image; names from :func:`classical_feature_names`.

    The array is a channels-last view of a channels-first buffer (call ``np.ascontiguousarray``
    if a library needs it contiguous); :func:`classical_features_chw` gives the (F, H, W) buffer.

    image: (H, W) of any integer or float dtype (16-bit included) or (H, W, 3|4) RGB(A), which is
        converted to luminance. Any size, down to 1×1.
    sigmas: Weka σ values, 0 meaning the unblurred image; ``sigma_scale`` (0.4) converts them to px.
    intensity: how the image becomes float in [0, 1] (see :func:`~alibi_vit.trainable.io.to_unit_float`);
        ``None`` takes a float image as it is (used when the caller has scaled it already).
    With the default six σ there are 6·7 + 15 + 6 = 63 features.
    """
    return np.moveaxis(classical_features_chw(image, sigmas, sigma_scale=sigma_scale, intensity=intensity,
                                              dtype=dtype), 0, -1)


def classical_features_chw(image, sigmas=DEFAULT_SIGMAS, *, sigma_scale: float = SIGMA_SCALE,
                           intensity: str | None = "auto", dtype=np.float32) -> np.ndarray:
    """(F, H, W) C-contiguous: the same features as :func:`classical_features`, channels first."""
    sigmas = tuple(float(s) for s in sigmas)
    if not sigmas or any(s < 0 for s in sigmas) or list(sigmas) != sorted(set(sigmas)):
        raise ValueError(f"sigmas must be distinct, non-negative and increasing, got {sigmas}")
    if intensity is None:
        x = np.asarray(image, dtype=np.float32)
        if x.ndim != 2:
            raise ValueError(f"image must be 2D (H, W) with intensity=None, got shape {x.shape}")
    else:
        x = to_unit_float(image, intensity)
    x = np.ascontiguousarray(x, dtype=np.float32)
    # The membrane statistics (torch and numpy) overlap with the scipy filters below: both release
    # the GIL for most of their time (1024² on 2 cores: 2.1 s → 1.7 s).
    membrane = _MEMBRANE_THREAD.submit(_membrane, x)
    n_feat = len(classical_feature_names(sigmas))
    out = np.empty((n_feat,) + x.shape, dtype=dtype)
    blurs = []
    col = 0
    for s in sigmas:
        blur = ndi.gaussian_filter(x, s * sigma_scale, mode="reflect", truncate=TRUNCATE) if s > 0 else x
        blurs.append(blur)
        grad = np.hypot(ndi.sobel(blur, 0, mode="reflect"), ndi.sobel(blur, 1, mode="reflect")) / 8.0
        h_rr, h_rc, h_cc = _hessian(blur)
        trace = h_rr + h_cc
        det = h_rr * h_cc - h_rc * h_rc
        root = np.sqrt(0.25 * (h_rr - h_cc) ** 2 + h_rc * h_rc)
        # Weka's "module": sqrt(Hxx² + Hxy·Hyx + Hyy²)
        modulus = np.sqrt(h_rr * h_rr + h_rc * h_rc + h_cc * h_cc)
        for feat in (blur, grad, 0.5 * trace + root, 0.5 * trace - root, modulus, trace, det):
            out[col] = feat
            col += 1
    for j in range(len(blurs)):
        for i in range(j):
            out[col] = blurs[j] - blurs[i]
            col += 1
    for feat in membrane.result():
        out[col] = feat
        col += 1
    assert col == n_feat
    return out


# ---- torch implementation (CUDA when present) -------------------------------------------------

def _reflect_index(n: int, r: int, device) -> torch.Tensor:
    """Indices of a length-n axis padded by r on each side as scipy's mode="reflect" pads
    (d c b a | a b c d | d c b a, repeating for pads longer than the axis)."""
    i = torch.arange(-r, n + r, device=device) % (2 * n)
    return torch.where(i >= n, 2 * n - 1 - i, i)


def _correlate1d(x: torch.Tensor, weights: torch.Tensor, axis: int) -> torch.Tensor:
    """scipy.ndimage.correlate1d(x, weights, axis, mode="reflect") for a (B, H, W) tensor; odd-length weights."""
    r = (len(weights) - 1) // 2
    dim = axis + 1
    idx = _reflect_index(x.shape[dim], r, x.device)
    xp = x.index_select(dim, idx)
    if dim == 1:  # along rows: (B, 1, H + 2r, W) with a (k, 1) kernel
        return F.conv2d(xp[:, None], weights.view(1, 1, -1, 1))[:, 0]
    return F.conv2d(xp[:, None], weights.view(1, 1, 1, -1))[:, 0]


def _gaussian_weights(sd: float, device) -> torch.Tensor:
    r = int(TRUNCATE * sd + 0.5)  # scipy's radius for gaussian_filter
    x = torch.arange(-r, r + 1, dtype=torch.float64)
    w = torch.exp(-0.5 * x * x / (sd * sd))
    return (w / w.sum()).to(device=device, dtype=torch.float32)


def classical_features_torch(image01, sigmas=DEFAULT_SIGMAS, *, sigma_scale: float = SIGMA_SCALE,
                             device=None) -> np.ndarray:
    """(F, H, W) float32: :func:`classical_features_chw` of an (H, W) image in [0, 1] computed with
    torch, on ``device`` (default CUDA when available, else CPU). Agrees with the scipy path to
    float32 rounding (the tests check 1e-4 relative, 1e-5 absolute)."""
    sigmas = tuple(float(s) for s in sigmas)
    if not sigmas or any(s < 0 for s in sigmas) or list(sigmas) != sorted(set(sigmas)):
        raise ValueError(f"sigmas must be distinct, non-negative and increasing, got {sigmas}")
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
        for s in sigmas:
            if s > 0:
                w = _gaussian_weights(s * sigma_scale, device)
                blur = _correlate1d(_correlate1d(x, w, 0), w, 1)
            else:
                blur = x
            blurs.append(blur)
            g_r = _correlate1d(_correlate1d(blur, deriv, 0), smooth, 1)
            g_c = _correlate1d(_correlate1d(blur, deriv, 1), smooth, 0)
            grad = torch.hypot(g_r, g_c) / 8.0
            d_r = _correlate1d(blur, central, 0)
            h_rr, h_rc = _correlate1d(d_r, central, 0), _correlate1d(d_r, central, 1)
            h_cc = _correlate1d(_correlate1d(blur, central, 1), central, 1)
            trace = h_rr + h_cc
            det = h_rr * h_cc - h_rc * h_rc
            root = torch.sqrt(0.25 * (h_rr - h_cc) ** 2 + h_rc * h_rc)
            modulus = torch.sqrt(h_rr * h_rr + h_rc * h_rc + h_cc * h_cc)
            out += [blur, grad, 0.5 * trace + root, 0.5 * trace - root, modulus, trace, det]
        out += [blurs[j] - blurs[i] for j in range(len(blurs)) for i in range(j)]
        r = MEMBRANE_SIZE // 2
        h, w_ = x.shape[1:]
        xp = x[:, _reflect_index(h, r, device)][:, :, _reflect_index(w_, r, device)]
        weight = torch.as_tensor(membrane_kernels(), device=device)[:, None]
        resp = F.conv2d(xp[:, None], weight)[0]  # (30, H, W)
        n = resp.shape[0]
        srt = resp.sort(0).values
        median = 0.5 * (srt[(n - 1) // 2] + srt[n // 2])
        out += [v[None] for v in (resp.sum(0), resp.mean(0), resp.std(0, unbiased=False), median, resp.amax(0),
                                  resp.amin(0))]
        return torch.cat(out).cpu().numpy()
