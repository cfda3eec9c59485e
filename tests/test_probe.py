"""The positional probe: targets, held-out scoring, per-channel fingerprints, and real models."""

import copy
import warnings

import numpy as np
import pytest
import timm
import torch
from timm.layers import build_sincos2d_pos_embed

from alibi_vit import convert_to_alibi, patch_features
from alibi_vit.images import bundled_images, normalize, resize_center_crop
from alibi_vit.analysis.probe import MIN_TRAIN, fitted_patches, layer_fingerprint, per_channel_r2, position_targets, positional_r2


def test_targets_by_hand():
    np.testing.assert_allclose(position_targets((2, 3), "x")[:, 0], [0, 0.5, 1, 0, 0.5, 1])
    np.testing.assert_allclose(position_targets((2, 3), "y")[:, 0], [0, 0, 0, 1, 1, 1])
    # the reference's ramps: diag on one scale linspace(0, 1, max(h, w)) for both sides
    np.testing.assert_allclose(position_targets((2, 3), "diag")[:, 0], [0, 0.25, 0.5, 0.25, 0.5, 0.75])
    np.testing.assert_allclose(position_targets((3, 3), "diag")[:, 0], [0, .25, .5, .25, .5, .75, .5, .75, 1])
    # radial: 1 − r / max r from patch (h // 2, w // 2)
    radial = position_targets((3, 3), "radial")[:, 0]
    np.testing.assert_allclose(radial, 1 - np.array([2, 1, 2, 1, 0, 1, 2, 1, 2]) ** 0.5 / 2 ** 0.5)
    even = position_targets((4, 4), "radial")[:, 0].reshape(4, 4)  # centre patch (2, 2); farthest (0, 0)
    assert even[2, 2] == 1 and even[0, 0] == 0 and even[3, 3] == pytest.approx(1 - 2 ** 0.5 / 8 ** 0.5)
    wide = position_targets((2, 5), "radial")[:, 0].reshape(2, 5)  # centre (1, 2), farthest (0, 0) and (0, 4)
    np.testing.assert_allclose(wide[0], 1 - np.hypot(1, [2, 1, 0, 1, 2]) / 5 ** 0.5)
    assert position_targets((4, 5), "xy").shape == (20, 2)
    with pytest.raises(ValueError, match="unknown probe target"):
        position_targets((2, 2), "z")


def ramp_features(h=12, w=12, channels=16, noise=0.01, seed=0):
    rng = np.random.default_rng(seed)
    xy = position_targets((h, w), "xy")
    mix = rng.normal(size=(2, channels))
    feats = xy @ mix + noise * rng.normal(size=(h * w, channels))
    return feats.T.reshape(channels, h, w)


def test_linear_position_in_features_scores_one():
    assert positional_r2(ramp_features(), fraction=0.1) > 0.99
    assert positional_r2(ramp_features(), target="x", fraction=0.1) > 0.99


def test_scores_are_held_out_not_in_sample():
    # More channels than training patches: any in-sample score would be a perfect 1.
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(4, 64, 10, 10))
    assert positional_r2(feats, fraction=0.2, repeats=5) < 0.1


def test_batch_is_averaged_over_images():
    a, b = ramp_features(seed=1), np.random.default_rng(2).normal(size=(16, 12, 12))
    both = positional_r2(np.stack([a, b]), fraction=0.2, repeats=3)
    mean = (positional_r2(a, fraction=0.2, repeats=3) + positional_r2(b, fraction=0.2, repeats=3, seed=7919)) / 2
    assert both == pytest.approx(mean)


def test_probe_is_reproducible_and_seeded():
    f = np.random.default_rng(0).normal(size=(8, 10, 10))
    assert positional_r2(f, fraction=0.2, seed=3) == positional_r2(torch.from_numpy(f), fraction=0.2, seed=3)
    assert positional_r2(f, fraction=0.2, seed=3) != positional_r2(f, fraction=0.2, seed=4)


def test_per_channel_fingerprint_finds_the_ramp_channel():
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(5, 10, 10))
    feats[3] = position_targets((10, 10), "x")[:, 0].reshape(10, 10)
    r2 = per_channel_r2(feats, target="x", fraction=0.2, fit="lstsq")
    assert r2.shape == (5,)
    assert r2[3] == pytest.approx(1.0) and np.delete(r2, 3).max() < 0.3
    ridge = per_channel_r2(feats, target="x", fraction=0.2)  # α = 1 shrinks the exact fit a little
    assert 0.99 < ridge[3] < 1.0 and np.delete(ridge, 3).max() < 0.3


@pytest.mark.parametrize("target", ["x", "radial", "xy"])
def test_per_channel_ridge_equals_sklearn_on_each_channel(target):
    # the closed form is StandardScaler + Ridge(α) fitted on one channel alone, as positional_r2 does on C = 1
    rng = np.random.default_rng(1)
    feats = rng.normal(size=(2, 6, 9, 7)) * rng.uniform(0.1, 20, size=(1, 6, 1, 1))
    feats[:, 2] += 3 * position_targets((9, 7), "radial")[:, 0].reshape(9, 7)
    feats[:, 4] = 5.0  # a constant channel: its prediction is the mean
    for alpha in (1.0, 7.0):
        r2 = per_channel_r2(feats, target, fraction=0.3, repeats=3, seed=2, alpha=alpha)
        expected = [positional_r2(feats[:, [c]], target, fraction=0.3, repeats=3, seed=2, alpha=alpha)
                    for c in range(6)]
        np.testing.assert_allclose(r2, expected, atol=1e-10)
    with pytest.raises(ValueError, match="fit must be one of ridge, lstsq"):
        per_channel_r2(feats, target, fit="ols")


@pytest.mark.parametrize("bad", [np.zeros((3, 4)), np.full((2, 4, 4), np.nan), np.zeros((2, 1, 2))])
def test_bad_features_are_a_clear_error(bad):
    with pytest.raises(ValueError):
        positional_r2(bad)


def test_bad_fraction_is_a_clear_error():
    with pytest.raises(ValueError, match="fraction"):
        positional_r2(ramp_features(), fraction=1.5)


def learned_position_vit(grid=10):
    """A ViT whose learned position embedding is a strong, smooth 2D code: features know *where*."""
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch14_reg4_dinov2", depth=2, embed_dim=32, num_heads=2, init_values=1.0,
                              img_size=14 * grid).eval()
    with torch.no_grad():
        model.pos_embed.copy_(2.0 * build_sincos2d_pos_embed((grid, grid), 32, temperature=10.0).view(1, -1, 32))
    return model


def test_learned_position_scores_high_on_noise_and_its_alibi_twin_near_zero():
    vit = learned_position_vit()
    alibi = convert_to_alibi(copy.deepcopy(vit))
    noise = normalize(torch.rand(6, 3, 140, 140, generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        r2_vit = positional_r2(patch_features(vit, noise), fraction=0.25, repeats=5)
        r2_alibi = positional_r2(patch_features(alibi, noise), fraction=0.25, repeats=5)
    assert r2_vit > 0.7
    assert r2_alibi < 0.1


def test_layer_fingerprint_on_bundled_textures():
    textures = torch.stack([normalize(resize_center_crop(img, 140)) for _, img in bundled_images("textures")])
    result = layer_fingerprint(learned_position_vit(), textures, fraction=0.25, repeats=2)
    assert set(result) == {0, 1}
    for layer in result.values():
        assert layer["channel_r2"].shape == (32,) and np.isfinite(layer["r2"])
    # The position code is strongest right after it is added.
    assert result[0]["r2"] > 0.5


def test_fitted_patches_rule_by_hand():
    assert MIN_TRAIN == 32
    assert fitted_patches(37 * 37, 0.025) == 34  # 518 px: the fraction alone is enough
    assert fitted_patches(8 * 8, 0.025) == 32  # 112 px: 2 would be fitted; raised to the minimum
    assert fitted_patches(8 * 8, 0.025, min_train=0) == 2
    assert fitted_patches(4 * 4, 0.025) == 8  # never more than half the grid for a raised fraction
    assert fitted_patches(2 * 2, 0.025) == 2  # at least 2 fitted and 2 scored
    assert fitted_patches(10 * 10, 0.9) == 90  # an explicit large fraction is kept
    with pytest.raises(ValueError, match="fraction"):
        fitted_patches(100, 0.0)


def test_small_grid_raises_the_fraction_with_a_warning_and_the_score_becomes_meaningful():
    # Features that are a noisy linear code of (x, y) on an 8×8 grid (a 112 px image).
    rng = np.random.default_rng(0)
    feats = (position_targets((8, 8), "xy") @ rng.normal(size=(2, 48)) + 0.05 * rng.normal(size=(64, 48)))
    feats = feats.T.reshape(48, 8, 8)
    with pytest.warns(UserWarning, match=r"fitting 32 \(50.0%\) instead"):
        raised = positional_r2(feats, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # min_train=0 keeps the fraction: no warning
        two_patches = positional_r2(feats, seed=1, min_train=0)
    assert raised > 0.99  # position is linearly readable, and the raised fit sees it
    assert two_patches < 0  # two fitted patches cannot: the nonsense the minimum prevents
    with pytest.warns(UserWarning, match="fitting 32"):
        assert per_channel_r2(feats, target="x", seed=1).shape == (48,)
