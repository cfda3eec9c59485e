"""Classical per-voxel features of volumes: a 3D filter bank of Gaussian derivatives (docs/method.md §7).

For each σ in ``sigmas`` (in units of the finest voxel side) every voxel gets: the Gaussian blur,
the gradient magnitude, the Laplacian of Gaussian, the three eigenvalues of the Hessian and the
three eigenvalues of the structure tensor; then the differences of neighbouring blurs (the finest
blur minus the volume itself first), and the volume itself. All derivatives are Gaussian
derivatives: the volume correlated along each axis with the sampled first or second derivative of
a Gaussian (truncated at 4σ, as scipy's ``gaussian_filter``), so the Hessian is
∂²(G_σ * f)/∂a∂b and the Laplacian its trace. The structure tensor is the outer product of the
gradient at σ (the inner scale) blurred at σ/2 (the outer scale). Eigenvalues are sorted from the
largest to the smallest.

Anisotropic voxels (``spacing`` (z, y, x), e.g. FIB-SEM slices thicker than their pixels): σ is
scaled per axis to σ · min(spacing) / spacing[axis] voxels, so every feature has the same
physical reach along each axis.

Computation is separable (one 1D correlation per axis and derivative order, in OpenCV, the kernels
scipy uses, float32) and borders are mirrored (scipy's ``mode="reflect"``), so the features of a
block with a margin of :func:`volume_halo` voxels per axis equal those of the whole volume inside
the block: the tiled engine computes volumes block by block. :func:`volume_features` can also
give only some planes of a block (the voxels of one slice, say): it filters along that axis first,
evaluating the correlation at the planes needed only, which costs a small fraction of the block.
"""

from __future__ import annotations

import cv2
import numpy as np

__all__ = ["VOLUME_SIGMAS", "volume_feature_names", "volume_features", "volume_halo", "axis_sigmas"]

VOLUME_SIGMAS = (1.0, 2.0, 4.0)
TRUNCATE = 4.0
PER_SIGMA = ("gaussian", "gradient", "log", "hessian_eig1", "hessian_eig2", "hessian_eig3", "structure_eig1",
             "structure_eig2", "structure_eig3")
OUTER_SCALE = 0.5  # the structure tensor is blurred at this fraction of σ


def check_sigmas(sigmas) -> tuple[float, ...]:
    sigmas = tuple(float(s) for s in (VOLUME_SIGMAS if sigmas is None else sigmas))
    if not sigmas or min(sigmas) <= 0 or list(sigmas) != sorted(set(sigmas)):
        raise ValueError(f"the 3D filters' sigmas must be distinct, positive and increasing, got {sigmas}")
    return sigmas


def check_spacing(spacing) -> tuple[float, float, float]:
    """(z, y, x) voxel spacing as three positive finite floats (None: isotropic), else a ValueError."""
    if spacing is None:
        return (1.0, 1.0, 1.0)
    try:
        values = tuple(float(v) for v in spacing)
    except (TypeError, ValueError):
        raise ValueError(f"voxel spacing must be three numbers Z,Y,X, got {spacing!r}") from None
    if len(values) != 3 or not all(np.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"voxel spacing must be three positive numbers Z,Y,X, got {spacing!r}")
    return values


def axis_sigmas(sigma: float, spacing) -> tuple[float, float, float]:
    """σ in voxels along (z, y, x): σ · min(spacing) / spacing per axis."""
    spacing = check_spacing(spacing)
    finest = min(spacing)
    return tuple(sigma * finest / s for s in spacing)


def _radius(sd: float) -> int:
    return int(TRUNCATE * sd + 0.5)  # scipy's gaussian_filter radius


def volume_feature_names(sigmas=None) -> list[str]:
    """Names of the features :func:`volume_features` returns, in order."""
    sigmas = check_sigmas(sigmas)
    names = [f"{kind}_s{s:g}" for s in sigmas for kind in PER_SIGMA]
    finer = ["s0"] + [f"s{s:g}" for s in sigmas[:-1]]  # s0: the volume itself
    names += [f"dog_s{s:g}-{f}" for s, f in zip(sigmas, finer)]
    return names + ["intensity"]


def volume_halo(sigmas=None, spacing=None) -> tuple[int, int, int]:
    """Voxels per axis (z, y, x) beyond which a voxel cannot influence another's features: the
    gradient's reach plus the structure tensor's blur at the largest σ."""
    top = check_sigmas(sigmas)[-1]
    return tuple(_radius(s) + _radius(OUTER_SCALE * s) for s in axis_sigmas(top, spacing))


def _kernels(sd: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Correlation weights of the Gaussian of ``sd`` voxels and of its first and second derivatives:
    correlating with them gives the derivatives of the blurred signal (scipy's kernels, flipped for
    correlation: the first derivative's changes sign)."""
    r = _radius(sd)
    t = np.arange(-r, r + 1, dtype=np.float64)
    g = np.exp(-0.5 * t * t / (sd * sd))
    g /= g.sum()
    return (g.astype(np.float32), (t / (sd * sd) * g).astype(np.float32),
            ((t * t / sd ** 4 - 1.0 / (sd * sd)) * g).astype(np.float32))


_ONE = np.ones(1, np.float32)


def _correlate(x: np.ndarray, w: np.ndarray, axis: int, lo: int = 0, hi: int | None = None, offset: int = 0,
               n: int | None = None) -> np.ndarray:
    """Correlation of ``x`` with ``w`` along ``axis`` (mirror borders), evaluated at planes [lo, hi)
    of an axis of ``n`` planes of which ``x`` holds [offset, offset + x.shape[axis]).

    Every plane the correlation reads (mirrored into [0, n)) must be among those ``x`` holds."""
    size = x.shape[axis]
    n = offset + size if n is None else n
    hi = n if hi is None else hi
    r = (len(w) - 1) // 2
    if len(w) == 1 and w[0] == 1:
        return np.ascontiguousarray(x.take(range(lo - offset, hi - offset), axis=axis))
    if lo == offset == 0 and hi == n == size:
        src, crop = x, None  # the whole axis: OpenCV mirrors the borders itself
    else:
        idx = np.arange(lo - r, hi + r)
        if n > 1:
            idx = idx % (2 * n)  # scipy's "reflect": d c b a | a b c d | d c b a
            idx = np.where(idx >= n, 2 * n - 1 - idx, idx)
        else:
            idx = np.zeros_like(idx)
        idx -= offset
        if idx.min() < 0 or idx.max() >= size:
            raise ValueError("the correlation reads planes outside the block: the block's margin is too small")
        src, crop = np.ascontiguousarray(x.take(idx, axis=axis)), slice(r, r + hi - lo)
    shape = src.shape
    if axis == 0:
        out = cv2.sepFilter2D(src.reshape(shape[0], -1), cv2.CV_32F, _ONE, w,
                              borderType=cv2.BORDER_REFLECT).reshape(shape)
    elif axis == src.ndim - 1:
        out = cv2.sepFilter2D(src.reshape(-1, shape[-1]), cv2.CV_32F, w, _ONE,
                              borderType=cv2.BORDER_REFLECT).reshape(shape)
    else:  # the middle axis of (z, y, x): slice by slice
        out = np.empty(shape, np.float32)
        for i in range(shape[0]):
            out[i] = cv2.sepFilter2D(src[i], cv2.CV_32F, _ONE, w, borderType=cv2.BORDER_REFLECT)
    if crop is None:
        return out
    index = [slice(None)] * out.ndim
    index[axis] = crop
    return out[tuple(index)]


EIGEN_CHUNK = 1 << 16  # voxels per step of the eigenvalue solver: its float64 temporaries stay in the CPU cache


def _eigenvalues(a, b, c, d, e, f) -> list[np.ndarray]:
    """Eigenvalues (largest first) of the symmetric matrices [[a, d, e], [d, b, f], [e, f, c]], per
    voxel, float32: the closed form for 3×3 symmetric matrices (trigonometric; Smith 1961) in
    float64, a cache-sized chunk at a time (a batched ``eigvalsh`` takes ten times longer, float32
    loses digits near repeated eigenvalues)."""
    comps = [np.asarray(v, np.float32).reshape(-1) for v in (a, b, c, d, e, f)]
    out = [np.empty(comps[0].shape, np.float32) for _ in range(3)]
    for i in range(0, len(out[0]), EIGEN_CHUNK):
        for o, v in zip(out, _eigenvalues64(*(x[i:i + EIGEN_CHUNK] for x in comps))):
            o[i:i + EIGEN_CHUNK] = v
    return [o.reshape(np.shape(a)) for o in out]


def _eigenvalues64(a, b, c, d, e, f):
    a, b, c, d, e, f = (v.astype(np.float64) for v in (a, b, c, d, e, f))
    q = (a + b + c) / 3.0
    a, b, c = a - q, b - q, c - q  # the matrix minus q·I: eigenvalues shifted by -q
    p2 = (a * a + b * b + c * c + 2.0 * (d * d + e * e + f * f)) / 6.0
    det = a * (b * c - f * f) - d * (d * c - f * e) + e * (d * f - b * e)
    p = np.sqrt(p2)
    cube = 2.0 * p2 * p
    r = np.divide(det, cube, out=np.zeros_like(det), where=cube > 0)  # cos 3φ; p = 0: three equal eigenvalues
    phi = np.arccos(np.clip(r, -1.0, 1.0)) / 3.0
    top = q + 2.0 * p * np.cos(phi)
    bottom = q + 2.0 * p * np.cos(phi + 2.0 * np.pi / 3.0)
    return top, 3.0 * q - top - bottom, bottom


def volume_features(block: np.ndarray, sigmas=None, spacing=None, *, inner=None, axis: int = 0,
                    planes=None) -> list[np.ndarray]:
    """The features of a (z, y, x) float block (scaled to [0, 1]) as a list of float32 arrays in
    :func:`volume_feature_names` order, cropped to ``inner`` (slices of the block; default all of it).

    planes: only these planes along ``axis`` (indices into the block, within ``inner``, increasing):
    each array then has ``len(planes)`` planes along ``axis``. Results equal the whole computation's
    to float32 rounding (the order of the 1D passes differs)."""
    sigmas = check_sigmas(sigmas)
    spacing = check_spacing(spacing)
    x = np.asarray(block, np.float32)
    if x.ndim != 3:
        raise ValueError(f"a volume block must be 3D (z, y, x), got shape {x.shape}")
    inner = tuple(inner) if inner is not None else tuple(slice(0, n) for n in x.shape)
    inner = tuple(slice(*s.indices(n)[:2]) for s, n in zip(inner, x.shape))
    # Filter along ``axis`` first: move it to the front (a copy, only when it is not there already).
    order = [axis] + [a for a in range(3) if a != axis]
    back = np.argsort(order)
    if axis != 0:
        x = np.ascontiguousarray(x.transpose(order))
        inner = tuple(inner[a] for a in order)
        spacing = tuple(spacing[a] for a in order)
    groups = [(inner[0].start, inner[0].stop)] if planes is None else [(int(p), int(p) + 1) for p in planes]
    parts = [_features_at(x, sigmas, spacing, lo, hi, inner[1], inner[2]) for lo, hi in groups]
    features = [np.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k]
                for k in range(len(parts[0]))]
    if axis != 0:
        features = [np.ascontiguousarray(f.transpose(back)) for f in features]
    return features


def _features_at(x, sigmas, spacing, lo: int, hi: int, rows: slice, cols: slice) -> list[np.ndarray]:
    """Features at planes [lo, hi) of axis 0 of block ``x``, cropped to ``rows`` × ``cols`` of the other two."""
    n = x.shape[0]
    per_sigma, blurs = [], []
    for s in sigmas:
        (g_a, d_a, h_a), (g_b, d_b, h_b), (g_c, d_c, h_c) = (_kernels(sd) for sd in axis_sigmas(s, spacing))
        r_out = max(_radius(OUTER_SCALE * sd) for sd in axis_sigmas(s, spacing))
        # The gradient is needed on the planes the structure tensor's blur reads: [wlo, whi).
        wlo, whi = max(lo - r_out, 0), min(hi + r_out, n)
        a0, a1 = _correlate(x, g_a, 0, wlo, whi), _correlate(x, d_a, 0, wlo, whi)
        a2 = _correlate(x, h_a, 0, lo, hi)
        k0, k1 = lo - wlo, hi - wlo  # [lo, hi) within the gradient planes
        a0b0, a0b1, a1b0 = _correlate(a0, g_b, 1), _correlate(a0, d_b, 1), _correlate(a1, g_b, 1)
        grad = [_correlate(a1b0, g_c, 2), _correlate(a0b1, g_c, 2), _correlate(a0b0, d_c, 2)]  # ∂a, ∂b, ∂c
        here = slice(k0, k1)
        blur = _correlate(a0b0[here], g_c, 2)
        h_aa = _correlate(_correlate(a2, g_b, 1), g_c, 2)
        h_bb = _correlate(_correlate(a0[here], h_b, 1), g_c, 2)
        h_cc = _correlate(a0b0[here], h_c, 2)
        h_ab = _correlate(_correlate(a1[here], d_b, 1), g_c, 2)
        h_ac = _correlate(a1b0[here], d_c, 2)
        h_bc = _correlate(a0b1[here], d_c, 2)
        crop = (slice(None), rows, cols)
        gradient = np.sqrt(sum(g[here] ** 2 for g in grad))[crop]
        hessian = _eigenvalues(*(h[crop] for h in (h_aa, h_bb, h_cc, h_ab, h_ac, h_bc)))
        # Structure tensor: products of the gradient blurred at the outer scale, evaluated at [lo, hi).
        o_a, o_b, o_c = (_kernels(OUTER_SCALE * sd)[0] for sd in axis_sigmas(s, spacing))
        products = [(0, 0), (1, 1), (2, 2), (0, 1), (0, 2), (1, 2)]
        tensor = [_correlate(_correlate(_correlate(grad[i] * grad[j], o_a, 0, lo, hi, wlo, n), o_b, 1), o_c, 2)[crop]
                  for i, j in products]
        structure = _eigenvalues(*tensor)
        blurs.append(blur[crop])
        per_sigma += [blur[crop], gradient, (h_aa + h_bb + h_cc)[crop], *hessian, *structure]
    intensity = np.ascontiguousarray(x[lo:hi, rows, cols])
    finer = [intensity] + blurs[:-1]
    dogs = [b - f for b, f in zip(blurs, finer)]
    return per_sigma + dogs + [intensity]
