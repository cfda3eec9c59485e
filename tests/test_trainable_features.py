"""Classical and ViT per-pixel features of alibi_vit.trainable against scipy/skimage and hand values."""

import numpy as np
import pytest
import skimage.filters
import skimage.feature
import torch

from alibi_vit.trainable import classical_feature_names, classical_features, membrane_kernels, to_unit_float
from alibi_vit.trainable.classical import halo
from alibi_vit.trainable.vit import ViTFeatures, vit_patch_features
from helpers import tiny_model

NAMES = classical_feature_names()


def feat(f, name):
    return f[..., NAMES.index(name)]


def test_feature_count_and_names():
    # 6 σ × 7 per-σ features + C(6, 2) differences of Gaussians + 6 membrane statistics
    assert len(NAMES) == 6 * 7 + 15 + 6 == len(set(NAMES))
    f = classical_features(np.random.default_rng(0).random((20, 30)), intensity=None)
    assert f.shape == (20, 30, 63) and f.dtype == np.float32


def test_gaussian_blurs_match_skimage():
    x = np.random.default_rng(0).random((40, 50)).astype(np.float32)
    f = classical_features(x, intensity=None)
    np.testing.assert_array_equal(feat(f, "gaussian_s0"), x)
    for s in (1, 4, 16):
        ref = skimage.filters.gaussian(x.astype(np.float64), sigma=0.4 * s, mode="reflect", truncate=4.0,
                                       preserve_range=True)
        np.testing.assert_allclose(feat(f, f"gaussian_s{s}"), ref, atol=2e-6)


def test_gradient_magnitude_of_a_ramp_is_its_slope():
    rows, cols = np.mgrid[0:30, 0:30].astype(np.float32)
    a, b = 0.003, -0.004
    f = classical_features(a * rows + b * cols, intensity=None)
    inner = (slice(3, -3), slice(3, -3))
    np.testing.assert_allclose(feat(f, "gradient_s0")[inner], np.hypot(a, b), rtol=1e-4)
    # Blurring a ramp leaves it a ramp (away from the border): same slope.
    np.testing.assert_allclose(feat(f, "gradient_s1")[inner], np.hypot(a, b), rtol=1e-3)


def test_hessian_features_of_a_quadratic_match_hand_values():
    rows, cols = np.mgrid[0:32, 0:32].astype(np.float64)
    a, b, c = 1e-3, 4e-4, -2e-3  # f = a r² + b r c + c c²: H = [[2a, b], [b, 2c]]
    f = classical_features((a * rows**2 + b * rows * cols + c * cols**2).astype(np.float32), intensity=None)
    hess = np.array([[2 * a, b], [b, 2 * c]])
    eig = np.linalg.eigvalsh(hess)  # ascending
    inner = (slice(4, -4), slice(4, -4))
    expect = {"hessian_eig1": eig[1], "hessian_eig2": eig[0], "hessian_trace": 2 * a + 2 * c,
              "hessian_det": np.linalg.det(hess), "hessian_modulus": np.sqrt(4 * a * a + b * b + 4 * c * c)}
    for name, value in expect.items():
        np.testing.assert_allclose(feat(f, f"{name}_s0")[inner], value, rtol=2e-3, atol=1e-9, err_msg=name)


def test_hessian_eigenvalues_match_skimage_on_random_image():
    x = np.random.default_rng(1).random((24, 24))
    f = classical_features(x.astype(np.float32), intensity=None)
    h = skimage.feature.hessian_matrix(x, sigma=0.0, order="rc", use_gaussian_derivatives=False)
    ev = skimage.feature.hessian_matrix_eigvals(h)  # (2, H, W), descending
    inner = (slice(2, -2), slice(2, -2))
    np.testing.assert_allclose(feat(f, "hessian_eig1_s0")[inner], ev[0][inner], atol=1e-5)
    np.testing.assert_allclose(feat(f, "hessian_eig2_s0")[inner], ev[1][inner], atol=1e-5)


def test_differences_of_gaussians_are_blur_differences():
    f = classical_features(np.random.default_rng(2).random((20, 20)), intensity=None)
    for fine, coarse in ((0, 1), (1, 16), (4, 8)):
        np.testing.assert_allclose(feat(f, f"dog_s{coarse}-s{fine}"),
                                   feat(f, f"gaussian_s{coarse}") - feat(f, f"gaussian_s{fine}"), atol=1e-6)


def test_membrane_kernels_are_rotated_lines():
    k = membrane_kernels()
    assert k.shape == (30, 19, 19)
    np.testing.assert_allclose(k.sum((1, 2)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(k[0][:, 9], 1 / 19, rtol=1e-6)  # 0°: the vertical central line
    np.testing.assert_allclose(k[15][9, :], 1 / 19, rtol=1e-6)  # 90°: horizontal
    np.testing.assert_allclose(k, k[:, ::-1, ::-1], atol=1e-7)  # point symmetric: correlation = convolution


def test_membrane_projections_of_constant_and_line_images():
    f = classical_features(np.full((25, 25), 0.3, np.float32), intensity=None)
    for stat, value in (("sum", 30 * 0.3), ("mean", 0.3), ("std", 0), ("median", 0.3), ("max", 0.3), ("min", 0.3)):
        np.testing.assert_allclose(feat(f, f"membrane_{stat}"), value, atol=1e-5, err_msg=stat)
    line = np.zeros((41, 41), np.float32)
    line[:, 20] = 1.0
    f = classical_features(line, intensity=None)
    # At the line the 0° kernel lies on it (mean 1); the 90° kernel crosses it at one pixel (1/19).
    assert feat(f, "membrane_max")[20, 20] == pytest.approx(1.0, abs=1e-5)
    assert feat(f, "membrane_min")[20, 20] == pytest.approx(1 / 19, abs=1e-5)
    ref = torch.nn.functional.conv2d(torch.from_numpy(np.pad(line, 9, mode="symmetric"))[None, None],
                                     torch.from_numpy(membrane_kernels())[:, None])[0].numpy()
    np.testing.assert_allclose(feat(f, "membrane_median"), np.median(ref, axis=0), atol=1e-6)
    np.testing.assert_allclose(feat(f, "membrane_std"), ref.std(0), atol=1e-6)


def test_intensity_scaling_of_16bit_and_rgb():
    x16 = (np.random.default_rng(3).random((30, 30)) * 4095).astype(np.uint16)
    np.testing.assert_allclose(to_unit_float(x16, "dtype"), x16 / 65535.0, rtol=1e-6)
    np.testing.assert_allclose(to_unit_float(x16, "minmax"), (x16 - x16.min()) / float(np.ptp(x16)), rtol=1e-5)
    p = to_unit_float(x16, "percentile")
    lo, hi = np.percentile(x16, (0.5, 99.5))
    np.testing.assert_allclose(p, np.clip((x16 - lo) / (hi - lo), 0, 1), atol=1e-6)
    # Percentile scaling makes a 12-bit image and the same image ×16 give the same features.
    np.testing.assert_allclose(classical_features(x16), classical_features(x16 * np.uint16(16)), atol=1e-5)
    # A grey image stored as RGB gives the grey features (colour defaults to dtype scaling, so ask for the stretch).
    rgb = np.stack([x16] * 3, axis=-1)
    np.testing.assert_allclose(classical_features(rgb, intensity="percentile"), classical_features(x16), atol=1e-4)


def test_bad_images_are_rejected_with_a_message():
    with pytest.raises(ValueError, match="3D stack"):
        classical_features(np.zeros((5, 20, 20)))
    with pytest.raises(ValueError, match="intensity"):
        classical_features(np.zeros((20, 20)), intensity="gamma")


def test_tiny_images_get_features():
    for shape in ((1, 1), (3, 7), (13, 13)):
        f = classical_features(np.random.default_rng(0).random(shape))
        assert f.shape == shape + (63,) and np.isfinite(f).all()


@pytest.mark.parametrize("filters, size", [("weka", (90, 100)), ("compact", (160, 170))])
def test_crop_with_halo_gives_the_whole_image_features(filters, size):
    x = np.random.default_rng(4).random(size).astype(np.float32)
    g = halo(filters=filters)
    whole = classical_features(x, intensity=None, filters=filters)
    crop = classical_features(x[10:, 5:], intensity=None, filters=filters)  # margin g around [10+g, H) × [5+g, W)
    np.testing.assert_allclose(crop[g:, g:], whole[10 + g:, 5 + g:], atol=1e-6)


# ---- ViT features ------------------------------------------------------------------------------

def test_vit_patch_features_pad_and_tile():
    model = tiny_model(dtype=torch.float32)
    x = np.random.default_rng(5).random((50, 61)).astype(np.float32)
    f = vit_patch_features(model, x)  # padded to 56 × 70: a 4 × 5 grid, one pass
    assert f.shape == (32, 4, 5)
    # Tiled (28-px tiles, 14-px overlap) vs one pass: shapes agree; averaging overlaps of a ViT with
    # attention across tiles is not exact, so only finite values and a clear correlation are asserted.
    t = vit_patch_features(model, x, tile=28, overlap=14)
    assert t.shape == f.shape and np.isfinite(t).all()
    assert np.corrcoef(t.ravel(), f.ravel())[0, 1] > 0.5
    # Tiles exactly covering the image without overlap equal per-crop forward passes.
    y = np.pad(x, ((0, 6), (0, 0)), mode="symmetric")[:, :56]  # 56 × 56: four 28-px tiles
    t2 = vit_patch_features(model, y, tile=28, overlap=0)
    np.testing.assert_allclose(t2[:, :2, 2:4], vit_patch_features(model, y[:28, 28:56]), atol=1e-5)


def test_vit_features_are_pca_projected_and_upsampled_to_every_size():
    model = tiny_model(dtype=torch.float32)
    rng = np.random.default_rng(6)
    vf = ViTFeatures(model, n_components=5).fit([rng.random((56, 56)).astype(np.float32)])
    for shape in ((56, 56), (23, 47), (5, 9)):
        out = vf.transform(rng.random(shape).astype(np.float32))
        assert out.shape == (5,) + shape and np.isfinite(out).all()
    # On the fitting patches the projections are uncorrelated with decreasing variance (PCA).
    pf = vf.patch_features(rng.random((56, 56)).astype(np.float32))
    vf2 = ViTFeatures(model, n_components=5).fit_patch_matrix(pf.reshape(32, -1).T)
    z = vf2.project(pf).reshape(5, -1)
    cov = np.cov(z)
    assert np.all(np.diff(np.diag(cov)) <= 1e-6)
    np.testing.assert_allclose(cov - np.diag(np.diag(cov)), 0, atol=1e-3 * cov[0, 0])


@pytest.mark.parametrize("shape,sigmas", [((37, 52), (0, 1, 2, 4, 8, 16)), ((6, 4), (0, 1, 4)), ((1, 1), (0, 2))])
def test_torch_filter_bank_matches_scipy(shape, sigmas):
    from alibi_vit.trainable.classical import classical_features_chw, classical_features_torch

    x = np.random.default_rng(5).random(shape).astype(np.float32)
    expected = classical_features_chw(x, sigmas, intensity=None)
    got = classical_features_torch(x, sigmas, device="cpu")
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)  # the stated tolerance


def test_segmenter_torch_backend_gives_the_scipy_features():
    from alibi_vit.trainable import TrainableSegmenter

    rgb = (np.random.default_rng(6).random((40, 30, 3)) * 255).astype(np.uint8)
    kw = dict(sigmas=(0, 1, 4), intensity="dtype", tile=28)
    np.testing.assert_allclose(TrainableSegmenter(**kw, classical_backend="torch").features(rgb),
                               TrainableSegmenter(**kw, classical_backend="scipy").features(rgb), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="classical_backend"):
        TrainableSegmenter(classical_backend="opencl")
