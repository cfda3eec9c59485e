"""The 3D filter bank against scipy.ndimage's own 3D filters (an independent reference: scipy's
Gaussian filters with per-axis σ and derivative orders, numpy's eigvalsh), and its blocks and planes
against the whole volume."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage as ndi

from alibi_vit.trainable.classical3d import (axis_sigmas, volume_feature_names, volume_features, volume_halo)

SIGMAS = (1.0, 2.0)


@pytest.fixture(scope="module")
def volume():
    rng = np.random.default_rng(3)
    return ndi.gaussian_filter(rng.random((30, 32, 34)), 1.0).astype(np.float32)


def _reference(v: np.ndarray, sigma: float, spacing) -> dict[str, np.ndarray]:
    """Every feature of one σ from scipy.ndimage's Gaussian filters (float64) and numpy's eigvalsh."""
    v = v.astype(np.float64)
    sd = axis_sigmas(sigma, spacing)
    gauss = lambda x, order, s=sd: ndi.gaussian_filter(x, s, order=order, mode="reflect")  # noqa: E731
    unit = np.eye(3, dtype=int)
    grad = [gauss(v, unit[i]) for i in range(3)]
    hessian = np.empty(v.shape + (3, 3))
    tensor = np.empty(v.shape + (3, 3))
    for i in range(3):
        for j in range(3):
            hessian[..., i, j] = gauss(v, unit[i] + unit[j])
            tensor[..., i, j] = gauss(grad[i] * grad[j], 0, [0.5 * s for s in sd])
    h_eig, s_eig = (np.linalg.eigvalsh(m)[..., ::-1] for m in (hessian, tensor))
    out = {"gaussian": gauss(v, 0), "gradient": ndi.gaussian_gradient_magnitude(v, sd, mode="reflect"),
           "log": ndi.gaussian_laplace(v, sd, mode="reflect")}
    for k in range(3):
        out[f"hessian_eig{k + 1}"], out[f"structure_eig{k + 1}"] = h_eig[..., k], s_eig[..., k]
    return out


@pytest.mark.parametrize("spacing", [(1.0, 1.0, 1.0), (3.0, 1.0, 1.0), (1.0, 1.5, 0.75)])
def test_features_equal_scipy_ndimage_3d_filters(volume, spacing):
    features = dict(zip(volume_feature_names(SIGMAS), volume_features(volume, SIGMAS, spacing)))
    assert len(features) == len(volume_feature_names(SIGMAS)) == 2 * 9 + 2 + 1
    for s in SIGMAS:
        for kind, ref in _reference(volume, s, spacing).items():
            got = features[f"{kind}_s{s:g}"]
            assert got.shape == volume.shape and got.dtype == np.float32
            np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * max(np.abs(ref).max(), 1e-3), err_msg=kind)
    blurs = {s: ndi.gaussian_filter(volume.astype(np.float64), axis_sigmas(s, spacing), mode="reflect") for s in SIGMAS}
    np.testing.assert_allclose(features["dog_s1-s0"], blurs[1.0] - volume, atol=1e-6)
    np.testing.assert_allclose(features["dog_s2-s1"], blurs[2.0] - blurs[1.0], atol=1e-6)
    np.testing.assert_array_equal(features["intensity"], volume)


def test_anisotropic_sigma_shrinks_along_the_coarse_axis():
    assert axis_sigmas(2.0, (4.0, 1.0, 1.0)) == (0.5, 2.0, 2.0)
    assert axis_sigmas(2.0, (1.0, 2.0, 2.0)) == (2.0, 1.0, 1.0)  # σ is in units of the finest side
    # the halo: gradient radius (4σ) plus the structure tensor's blur (4·σ/2), per axis
    assert volume_halo((1.0, 4.0), (4.0, 1.0, 1.0)) == (4 + 2, 16 + 8, 16 + 8)


def test_blocks_with_the_halo_equal_the_whole_volume(volume):
    whole = volume_features(volume, SIGMAS)
    halo = volume_halo(SIGMAS)
    core = (slice(12, 18), slice(13, 19), slice(14, 20))  # an interior block: the halo is cut at no edge ...
    outer = tuple(slice(max(c.start - h, 0), min(c.stop + h, n)) for c, h, n in zip(core, halo, volume.shape))
    inner = tuple(slice(c.start - o.start, c.stop - o.start) for c, o in zip(core, outer))
    for got, ref in zip(volume_features(volume[outer], SIGMAS, inner=inner), whole):
        # equal to float32 rounding (OpenCV's SIMD and scalar loops may round a voxel differently)
        np.testing.assert_allclose(got, ref[core], rtol=0, atol=1e-6 * np.abs(ref).max())
    # ... and half the halo is not enough: the comparison can fail
    short = tuple(slice(c.start - h // 2, c.stop + h // 2) for c, h in zip(core, halo))
    inner = tuple(slice(h // 2, h // 2 + c.stop - c.start) for c, h in zip(core, halo))
    diffs = [np.abs(got - ref[core]).max() for got, ref in zip(volume_features(volume[short], SIGMAS, inner=inner),
                                                                 whole)]
    assert max(diffs) > 1e-5  # ten times the tolerance above


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_features_of_some_planes_equal_those_planes_of_the_whole(volume, axis):
    whole = volume_features(volume, SIGMAS, (2.0, 1.0, 1.0))
    planes = [0, 5, 6, volume.shape[axis] - 1]  # the borders too
    some = volume_features(volume, SIGMAS, (2.0, 1.0, 1.0), axis=axis, planes=planes)
    for got, ref in zip(some, whole):
        np.testing.assert_allclose(got, np.take(ref, planes, axis=axis), rtol=0, atol=2e-6 * max(np.abs(ref).max(), 1))


def test_a_volume_thinner_than_the_kernels_mirrors_like_scipy():
    thin = np.random.default_rng(0).random((2, 12, 12)).astype(np.float32)
    got = dict(zip(volume_feature_names((4.0,)), volume_features(thin, (4.0,))))
    np.testing.assert_allclose(got["gaussian_s4"], ndi.gaussian_filter(thin.astype(np.float64), 4.0, mode="reflect"),
                               atol=1e-6)


@pytest.mark.parametrize("sigmas, spacing, message", [((2.0, 1.0), None, "increasing"), ((0.0, 1.0), None, "positive"),
                                                       (None, (1.0, 0.0, 1.0), "positive"),
                                                       (None, (1.0, -2.0, 1.0), "positive"),
                                                       (None, (1.0, 1.0), "three")])
def test_bad_sigmas_and_spacings_are_named(sigmas, spacing, message):
    with pytest.raises(ValueError, match=message):
        volume_features(np.zeros((4, 4, 4), np.float32), sigmas, spacing)
