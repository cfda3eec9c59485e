"""Image reading in the formats microscopists use, and its errors."""

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from alibi_vit.images import (ImageReadError, bundled_images, list_images, load_image, noise_images, normalize,
                              resize_center_crop)


def test_png_rgb_and_grayscale(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, size=(9, 13, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    img = load_image(tmp_path / "rgb.png")
    assert img.shape == (3, 9, 13) and img.dtype == torch.float32
    torch.testing.assert_close(img, torch.from_numpy(rgb).permute(2, 0, 1).float() / 255)
    Image.fromarray(rgb[..., 0]).save(tmp_path / "gray.png")
    gray = load_image(tmp_path / "gray.png")
    assert gray.shape == (3, 9, 13) and torch.equal(gray[0], gray[2])
    Image.fromarray(np.dstack([rgb, np.full((9, 13), 7, np.uint8)])).save(tmp_path / "rgba.png")
    torch.testing.assert_close(load_image(tmp_path / "rgba.png"), img)


def test_cmyk_jpeg_keeps_its_colours(tmp_path):
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(tmp_path / "red.jpg")  # pure red in CMYK
    img = load_image(tmp_path / "red.jpg")
    assert img.shape == (3, 8, 8)
    assert img[0].min() > 0.9 and img[1:].max() < 0.1


def test_16_bit_tiff_uses_the_full_range(tmp_path):
    a = np.array([[0, 65535], [32768, 1000]], dtype=np.uint16)
    tifffile.imwrite(tmp_path / "m.tif", a)
    img = load_image(tmp_path / "m.tif")
    assert img.shape == (3, 2, 2)
    torch.testing.assert_close(img[0], torch.tensor([[0.0, 1.0], [32768 / 65535, 1000 / 65535]]))
    Image.fromarray(a).save(tmp_path / "m16.png")
    torch.testing.assert_close(load_image(tmp_path / "m16.png")[0], img[0])


def test_float_tiff_is_rescaled_to_unit_range(tmp_path):
    tifffile.imwrite(tmp_path / "f.tiff", np.array([[-2.0, 0.0], [2.0, 6.0]], dtype=np.float32))
    torch.testing.assert_close(load_image(tmp_path / "f.tiff")[0], torch.tensor([[0.0, 0.25], [0.5, 1.0]]))


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


def test_resize_center_crop_and_normalize():
    img = torch.rand(3, 100, 200)
    out = resize_center_crop(img, 50)
    assert out.shape == (3, 50, 50)
    assert resize_center_crop(img, (28, 42)).shape == (3, 28, 42)
    gray = torch.full((3, 8, 8), 0.5)
    torch.testing.assert_close(normalize(gray)[:, 0, 0], (0.5 - torch.tensor([0.485, 0.456, 0.406])) /
                               torch.tensor([0.229, 0.224, 0.225]))


def test_bundled_and_noise_images():
    textures = bundled_images("textures")
    assert [n for n, _ in textures] == ["brick", "grass", "gravel"]
    assert all(t.shape[0] == 3 and 0 <= t.min() and t.max() <= 1 for _, t in textures)
    a, b = noise_images(2, 28, seed=1), noise_images(2, 28, seed=1)
    assert torch.equal(a[0][1], b[0][1]) and a[0][1].shape == (3, 28, 28)
    with pytest.raises(ValueError, match="unknown bundled image"):
        bundled_images("human_mitosis_offline")
