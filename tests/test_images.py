"""Image reading in the formats microscopists use, intensity modes, image sets, and their errors."""

import warnings

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from alibi_vit.images import (BUNDLED_SETS, INTENSITY_MODES, ImageReadError, bundled_images, list_images,
                              load_grayscale, load_image, load_image_set, noise_images, normalize,
                              resize_center_crop, scale_intensity, to_rgb_tensor)


# -- file formats ---------------------------------------------------------------------------------

def test_png_rgb_and_grayscale(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, size=(9, 13, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    img = load_image(tmp_path / "rgb.png")
    assert img.shape == (3, 9, 13) and img.dtype == torch.float32
    torch.testing.assert_close(img, torch.from_numpy(rgb).permute(2, 0, 1).float() / 255)  # colour: dtype
    Image.fromarray(rgb[..., 0]).save(tmp_path / "gray.png")
    gray = load_image(tmp_path / "gray.png", intensity="dtype")
    assert gray.shape == (3, 9, 13) and torch.equal(gray[0], gray[2])
    torch.testing.assert_close(gray[1], torch.from_numpy(rgb[..., 0]).float() / 255)
    Image.fromarray(np.dstack([rgb, np.full((9, 13), 7, np.uint8)])).save(tmp_path / "rgba.png")
    torch.testing.assert_close(load_image(tmp_path / "rgba.png"), img)


def test_cmyk_jpeg_keeps_its_colours(tmp_path):
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "red.jpg")  # pure red in CMYK
    img = load_image(tmp_path / "red.jpg")
    assert img.shape == (3, 8, 8)
    assert img[0].min() > 0.9 and img[1:].max() < 0.1


def test_16_bit_tiff_and_png_in_dtype_mode(tmp_path):
    a = np.array([[0, 65535], [32768, 1000]], dtype=np.uint16)
    tifffile.imwrite(tmp_path / "m.tif", a)
    img = load_image(tmp_path / "m.tif", intensity="dtype")
    assert img.shape == (3, 2, 2)
    torch.testing.assert_close(img[0], torch.tensor([[0.0, 1.0], [32768 / 65535, 1000 / 65535]]))
    Image.fromarray(a).save(tmp_path / "m16.png")
    torch.testing.assert_close(load_image(tmp_path / "m16.png", intensity="dtype")[0], img[0])


def test_float_tiff_dtype_and_minmax(tmp_path):
    tifffile.imwrite(tmp_path / "f.tiff", np.array([[-2.0, 0.0], [2.0, 6.0]], dtype=np.float32))
    expected = torch.tensor([[0.0, 0.25], [0.5, 1.0]])
    for mode in ("dtype", "minmax"):  # a float outside [0, 1] has no maximum to divide by: min-max
        torch.testing.assert_close(load_image(tmp_path / "f.tiff", intensity=mode)[0], expected)
    inside = np.array([[0.2, 0.4]], dtype=np.float32)  # already in [0, 1]: dtype keeps it
    np.testing.assert_allclose(scale_intensity(inside, "dtype"), inside)


def test_unreadable_files_name_the_file(tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG not really")
    with pytest.raises(ImageReadError, match="broken.png"):
        load_image(bad)
    with pytest.raises(ImageReadError, match="missing.tif"):
        load_image(tmp_path / "missing.tif")
    tifffile.imwrite(tmp_path / "stack.tif", np.zeros((5, 6, 7, 8), np.uint8))
    with pytest.raises(ImageReadError, match="stack.tif"):
        load_image(tmp_path / "stack.tif")
    with pytest.raises(ImageReadError, match="stack.tif"):
        load_grayscale(tmp_path / "stack.tif")


# -- intensity modes ------------------------------------------------------------------------------

def test_12_bit_image_in_uint16_is_no_longer_near_black(tmp_path):
    ramp = np.arange(4096, dtype=np.uint16).reshape(64, 64)  # a 12-bit camera: 0..4095 in uint16
    tifffile.imwrite(tmp_path / "cam.tif", ramp)
    assert float(load_image(tmp_path / "cam.tif", intensity="dtype").max()) == pytest.approx(4095 / 65535)
    img = load_image(tmp_path / "cam.tif")  # default: percentile for a single channel
    # numpy's linear percentile of 0..4095: the 0.5th is 0.005 * 4095, the 99.5th 0.995 * 4095.
    lo, hi = 0.005 * 4095, 0.995 * 4095
    expected = np.clip((ramp - lo) / (hi - lo), 0, 1)
    np.testing.assert_allclose(img[0].numpy(), expected, atol=1e-6)
    assert img.min() == 0 and img.max() == 1 and float(img[0].std()) > 0.25


def test_percentile_mode_against_hand_computed_values():
    a = np.arange(201, dtype=np.uint16).reshape(3, 67)  # percentiles 0.5 / 99.5 of 0..200 are 1 and 199
    out = scale_intensity(a, "percentile")
    assert out.dtype == np.float32 and out.shape == a.shape
    flat = out.ravel()
    assert flat[0] == 0 and flat[1] == 0 and flat[199] == 1 and flat[200] == 1  # clipped beyond
    assert flat[100] == pytest.approx(99 / 198) and flat[50] == pytest.approx(49 / 198)
    custom = scale_intensity(a, "percentile", percentiles=(10, 90))  # 20 and 180
    assert custom.ravel()[100] == pytest.approx(0.5) and custom.ravel()[20] == 0 and custom.ravel()[180] == 1


def test_minmax_stretches_a_low_range_image():
    a = np.array([[100, 105], [110, 102]], dtype=np.uint8)
    np.testing.assert_allclose(scale_intensity(a, "minmax"), [[0.0, 0.5], [1.0, 0.2]], atol=1e-7)
    np.testing.assert_allclose(scale_intensity(a, "dtype"), a / 255, atol=1e-7)
    auto = to_rgb_tensor(a)  # grayscale: percentile, so the 10 grey levels fill the range
    assert float(auto.min()) == 0 and float(auto.max()) == 1


def test_percentile_falls_back_to_minmax_for_sparse_spots():
    a = np.zeros((40, 50), dtype=np.uint16)
    a[3, 4], a[20, 30] = 50, 25  # 2 of 2000 pixels (0.1 %): both percentiles are 0
    out = scale_intensity(a, "percentile")
    assert out[3, 4] == 1 and out[20, 30] == pytest.approx(0.5) and out.sum() == pytest.approx(1.5)


def test_constant_images_give_zeros_not_nan():
    for array in (np.full((4, 5), 7, np.uint16), np.full((4, 5), 3.5, np.float32), np.full((4, 5, 3), 9, np.uint8)):
        for mode in ("minmax", "percentile"):
            out = scale_intensity(array, mode)
            assert np.isfinite(out).all() and not out.any()
    np.testing.assert_allclose(scale_intensity(np.full((2, 2), 51, np.uint8), "dtype"), 0.2)
    assert not to_rgb_tensor(np.full((6, 6), 1000, np.uint16)).any()  # auto on a constant micrograph


def test_nan_and_infinite_pixels_become_zero_and_are_ignored_by_the_statistics():
    a = np.array([[np.nan, 0.0], [2.0, 4.0], [np.inf, -np.inf]], dtype=np.float32)
    expected = [[0.0, 0.0], [0.5, 1.0], [0.0, 0.0]]
    for mode in ("dtype", "minmax"):
        np.testing.assert_allclose(scale_intensity(a, mode), expected)
    assert np.isfinite(scale_intensity(a, "percentile")).all()
    assert not scale_intensity(np.full((3, 3), np.nan, np.float32), "percentile").any()


def test_colour_statistics_are_joint_and_auto_keeps_colour_photos():
    rgb = np.zeros((2, 2, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1] = 100, 200
    rgb[0, 0] = 0
    out = scale_intensity(rgb, "minmax")  # one range for all channels: red stays half of green
    assert out[1, 1, 0] == pytest.approx(0.5) and out[1, 1, 1] == 1 and out[0, 0].sum() == 0
    np.testing.assert_allclose(scale_intensity(rgb), rgb / 255, atol=1e-7)  # auto: dtype for colour


def test_signed_integers_and_booleans_in_dtype_mode():
    np.testing.assert_allclose(scale_intensity(np.array([-5, 0, 32767], np.int16), "dtype"), [0, 0, 1])
    np.testing.assert_array_equal(scale_intensity(np.array([[True, False]]), "dtype"), [[1.0, 0.0]])


def test_bad_intensity_arguments_are_errors():
    with pytest.raises(ValueError, match="percentile"):
        scale_intensity(np.zeros((2, 2)), "gamma")
    with pytest.raises(ValueError, match="percentiles"):
        scale_intensity(np.zeros((2, 2)), "percentile", percentiles=(99, 1))
    with pytest.raises(ImageReadError, match="pixel type"):
        to_rgb_tensor(np.array([["a", "b"]]))
    assert INTENSITY_MODES == ("auto", "dtype", "minmax", "percentile")


def test_grayscale_helper_from_files_and_arrays(tmp_path):
    ramp = np.arange(4096, dtype=np.uint16).reshape(64, 64)
    tifffile.imwrite(tmp_path / "cam.tif", ramp)
    gray = load_grayscale(tmp_path / "cam.tif")
    assert gray.shape == (64, 64) and gray.dtype == np.float32
    np.testing.assert_array_equal(gray, load_image(tmp_path / "cam.tif")[0].numpy())
    np.testing.assert_allclose(load_grayscale(str(tmp_path / "cam.tif"), intensity="minmax"), ramp / 4095, atol=1e-6)
    rgb = np.zeros((2, 3, 3), dtype=np.uint8)
    rgb[0, :, 0] = 255   # red row
    rgb[1, :, 1] = 255   # green row
    # ITU-R BT.601 luma, 0.299 R + 0.587 G + 0.114 B; colour defaults to dtype (divide by 255).
    np.testing.assert_allclose(load_grayscale(rgb), [[0.299] * 3, [0.587] * 3], atol=1e-6)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    np.testing.assert_allclose(load_grayscale(tmp_path / "rgb.png"), load_grayscale(rgb))
    # minmax stretches the luma itself: red row 0, green row 1.
    np.testing.assert_allclose(load_grayscale(rgb, intensity="minmax"), [[0.0] * 3, [1.0] * 3], atol=1e-6)
    # PIL's own "L" conversion uses the same weights (it rounds to 8 bits).
    pil_l = np.asarray(Image.fromarray(rgb).convert("L"), dtype=np.float32) / 255
    np.testing.assert_allclose(load_grayscale(rgb), pil_l, atol=1 / 255)
    with_nan = np.array([[np.nan, 2.0], [4.0, 0.0]], dtype=np.float32)
    np.testing.assert_allclose(load_grayscale(with_nan, intensity="minmax"), [[0.0, 0.5], [1.0, 0.0]])


# -- folders, preprocessing, image sets -----------------------------------------------------------

def test_list_images(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_images(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="no images"):
        list_images(tmp_path)
    (tmp_path / "sub").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "sub" / "b.PNG")
    Image.new("RGB", (4, 4)).save(tmp_path / "a.jpg")
    assert [p.name for p in list_images(tmp_path)] == ["a.jpg", "b.PNG"]
    (tmp_path / "c_link.jpg").symlink_to("a.jpg")  # one real image under two names: listed once
    (tmp_path / "loop").symlink_to(".")
    assert [p.name for p in list_images(tmp_path)] == ["a.jpg", "b.PNG"]


def test_resize_center_crop_and_normalize():
    img = torch.rand(3, 100, 200)
    out = resize_center_crop(img, 50)
    assert out.shape == (3, 50, 50)
    assert resize_center_crop(img, (28, 42)).shape == (3, 28, 42)
    gray = torch.full((3, 8, 8), 0.5)
    torch.testing.assert_close(normalize(gray)[:, 0, 0], (0.5 - torch.tensor([0.485, 0.456, 0.406])) /
                               torch.tensor([0.229, 0.224, 0.225]))


def test_image_set_from_a_single_file_a_folder_and_noise(tmp_path):
    a = np.array([[10, 20], [30, 40]], dtype=np.uint16)
    tifffile.imwrite(tmp_path / "one.tif", a)
    [(name, img)] = load_image_set(str(tmp_path / "one.tif"), 2, intensity="minmax")
    assert name == "one"
    torch.testing.assert_close(img[0], torch.tensor([[0.0, 1 / 3], [2 / 3, 1.0]]))
    Image.fromarray(np.full((4, 4, 3), 200, np.uint8)).save(tmp_path / "two.png")
    named = load_image_set(tmp_path, 2, intensity="dtype")
    assert [n for n, _ in named] == ["one", "two"]
    torch.testing.assert_close(named[0][1][0], torch.tensor(a / 65535, dtype=torch.float32))
    a_noise, b_noise = noise_images(2, 28, seed=1), noise_images(2, 28, seed=1)
    assert torch.equal(a_noise[0][1], b_noise[0][1]) and a_noise[0][1].shape == (3, 28, 28)
    assert [n for n, _ in load_image_set("noise", 14, noise_count=3)] == ["noise_0", "noise_1", "noise_2"]


def test_unknown_image_source_lists_the_sets_and_suggests_a_close_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="did you mean 'textures'") as err:
        load_image_set("textrues", 28)
    assert "does not exist" in str(err.value) and all(name in str(err.value) for name in BUNDLED_SETS)
    with pytest.raises(FileNotFoundError) as err:
        load_image_set(str(tmp_path / "micro" / "data"), 28)  # a path: no name to suggest, the sets still listed
    assert "does not exist" in str(err.value) and "did you mean" not in str(err.value)
    assert "microscopy" in str(err.value)
    with pytest.raises(ValueError, match="did you mean 'microscopy'"):
        bundled_images("microscope")


def test_bundled_sets_are_named_for_what_they_hold_and_load_offline():
    assert BUNDLED_SETS["textures"] == ("brick", "grass", "gravel")
    assert BUNDLED_SETS["photos"] == ("astronaut", "chelsea", "coffee", "rocket")
    assert set(BUNDLED_SETS) == {"textures", "photos", "microscopy", "retina", "astronomy", "synthetic_micrographs"}
    for name, images in BUNDLED_SETS.items():
        loaded = bundled_images(name)
        assert [n for n, _ in loaded] == list(images)
        assert all(t.dtype == torch.float32 and t.shape[0] == 3 and 0 <= t.min() and t.max() <= 1
                   for _, t in loaded)
    # microaneurysms is stored as grey levels 38..129: the default stretch fills [0, 1], dtype does not.
    [(_, stretched)] = bundled_images("microaneurysms")
    [(_, raw)] = bundled_images("microaneurysms", intensity="dtype")
    assert float(stretched.max()) == 1 and float(stretched.min()) == 0
    assert float(raw.max()) == pytest.approx(129 / 255) and float(raw.min()) == pytest.approx(38 / 255)


def test_synthetic_micrographs_are_the_generators_16bit_images():
    from alibi_vit.synthetic import synthetic_micrograph

    [(name, image)] = bundled_images("synthetic_micrograph_1", intensity="dtype")
    expected = synthetic_micrograph(512, seed=1)[0].astype(np.float64) / 65535.0
    assert name == "synthetic_micrograph_1" and image.shape == (3, 512, 512)
    np.testing.assert_allclose(image[0].numpy(), expected, rtol=1e-6)
    assert torch.equal(image[0], image[2])  # grey, repeated over the three channels


def test_former_micrographs_set_still_reads_its_images_with_a_warning():
    with pytest.warns(FutureWarning, match="microscopy"):
        old = bundled_images("micrographs")
    assert [n for n, _ in old] == ["cell", "immunohistochemistry", "microaneurysms", "hubble_deep_field"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current names do not warn
        assert [n for n, _ in bundled_images("microscopy")] == ["cell", "immunohistochemistry"]
