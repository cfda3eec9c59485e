"""Image DataModules: real file formats, error messages, skipping, splits, global-batch sharding, COCO."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import tifffile
import torch
from PIL import Image

from alibi_vit.images import IMAGENET_MEAN, IMAGENET_STD, ImageReadError
from datamodules.images import BundledImagesDataModule, CocoImagesDataModule, ImageFolderDataModule

MEAN = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
STD = torch.tensor(IMAGENET_STD).view(3, 1, 1)


def denormalize(x: torch.Tensor) -> torch.Tensor:
    return x * STD + MEAN


def write_png(path, value, size=28, mode="RGB"):
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = np.full((size, size, channels), value, dtype=np.uint8).squeeze()
    Image.fromarray(arr, mode=mode).save(path)
    return path


def folder_of_constant_images(folder, n, size=28):
    """n PNGs whose pixel value encodes their index, so a sample can be traced back to its file."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        write_png(folder / f"img_{i:03d}.png", 10 * i, size)
    return folder


def index_of(sample: torch.Tensor) -> int:
    return round(float(denormalize(sample)[0].mean()) * 255 / 10)


def fake_trainer(world_size=1, rank=0):
    return SimpleNamespace(world_size=world_size, global_rank=rank)


# -- reading formats ------------------------------------------------------------------------------

def test_16bit_grayscale_tiff_in_each_intensity_mode(tmp_path):
    folder = tmp_path / "tif"
    folder.mkdir()
    arr = np.zeros((28, 28), dtype=np.uint16)
    arr[:, :14] = 3000           # well above 255: an 8-bit reading would saturate
    arr[:, 14:] = 4000           # a 12-bit camera: divided by 65535 both halves are near-black
    tifffile.imwrite(folder / "micro.tif", arr)
    expected = {"dtype": (3000 / 65535, 4000 / 65535), "minmax": (0.0, 1.0), "percentile": (0.0, 1.0),
                "auto": (0.0, 1.0)}
    for mode, (left, right) in expected.items():
        dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=1, num_workers=0, intensity=mode)
        dm.setup("fit")
        x = denormalize(dm.train_set[0])
        assert x.shape == (3, 28, 28)
        torch.testing.assert_close(x[:, :, :14], torch.full((3, 28, 14), left), atol=1e-5, rtol=0)
        torch.testing.assert_close(x[:, :, 14:], torch.full((3, 28, 14), right), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="unknown intensity mode 'gamma'"):
        ImageFolderDataModule(str(folder), batch_size=1, intensity="gamma")


def test_coco_reads_grayscale_photos_as_the_reference_does(tmp_path):
    root = tmp_path / "coco"
    (root / "train2017").mkdir(parents=True)
    gray = np.full((28, 28), 60, dtype=np.uint8)
    gray[:, 14:] = 90
    Image.fromarray(gray).save(root / "train2017" / "gray.jpg", quality=100)
    dm = CocoImagesDataModule(str(root), val_split=None, image_size=28, batch_size=1, num_workers=0)
    dm.setup("fit")
    x = denormalize(dm.train_set[0])  # default "dtype": 60/255 and 90/255, no stretch
    assert abs(float(x[:, :, :10].mean()) - 60 / 255) < 2 / 255 and abs(float(x[:, :, 18:].mean()) - 90 / 255) < 2 / 255
    dm = CocoImagesDataModule(str(root), val_split=None, image_size=28, batch_size=1, num_workers=0,
                              intensity="minmax")
    dm.setup("fit")
    assert float(denormalize(dm.train_set[0]).max()) == pytest.approx(1.0, abs=1e-5)


def test_png_jpeg_rgba_and_grayscale_become_three_channels(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    write_png(folder / "a_rgb.png", 200)
    write_png(folder / "b_gray.png", 100, mode="L")
    rgba = np.zeros((28, 28, 4), dtype=np.uint8)
    rgba[..., 0], rgba[..., 3] = 255, 7   # red, nearly transparent: alpha must be dropped, not blended
    Image.fromarray(rgba, mode="RGBA").save(folder / "c_rgba.png")
    Image.fromarray(np.full((28, 28, 3), 50, dtype=np.uint8)).save(folder / "d.jpg", quality=95)
    dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=1, num_workers=0, intensity="dtype")
    dm.setup("fit")
    samples = [denormalize(dm.train_set[i]) for i in range(4)]
    assert all(s.shape == (3, 28, 28) for s in samples)
    assert torch.allclose(samples[0], torch.tensor(200 / 255), atol=1e-5)
    assert torch.allclose(samples[1], torch.tensor(100 / 255), atol=1e-5)
    assert torch.allclose(samples[2][0], torch.tensor(1.0), atol=1e-5) and samples[2][1:].abs().max() < 1e-5
    assert torch.allclose(samples[3], torch.tensor(50 / 255), atol=3 / 255)  # JPEG is lossy


def test_resize_shortest_side_then_centre_crop(tmp_path):
    folder = tmp_path / "wide"
    folder.mkdir()
    arr = np.zeros((28, 56, 3), dtype=np.uint8)
    arr[:, 14:42] = 255   # the central square is white, the sides black
    Image.fromarray(arr).save(folder / "a_wide.png")
    Image.fromarray(np.full((70, 140, 3), 128, dtype=np.uint8)).save(folder / "b_large.png")
    dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=1, num_workers=0)
    dm.setup("fit")
    crop, resized = denormalize(dm.train_set[0]), denormalize(dm.train_set[1])
    assert crop.shape == resized.shape == (3, 28, 28)
    assert crop.min() > 0.999  # short side already 28: only the white centre survives the crop
    assert torch.allclose(resized, torch.tensor(128 / 255), atol=1e-3)


# -- errors ---------------------------------------------------------------------------------------

def test_missing_and_empty_folders_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolderDataModule(str(tmp_path / "nope"), batch_size=1).setup("fit")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not an image")
    with pytest.raises(FileNotFoundError, match="holds no images"):
        ImageFolderDataModule(str(tmp_path / "empty"), batch_size=1).setup("fit")


def test_unreadable_image_error_names_the_file(tmp_path):
    folder = folder_of_constant_images(tmp_path / "imgs", 3)
    (folder / "img_001.png").write_bytes(b"definitely not a png")
    dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=3, num_workers=0, shuffle=False)
    dm.setup("fit")
    with pytest.raises(ImageReadError, match="img_001.png"):
        next(iter(dm.train_dataloader()))


def test_wrong_channel_count_is_an_error_naming_the_file(tmp_path):
    folder = tmp_path / "five"
    folder.mkdir()
    tifffile.imwrite(folder / "stack.tif", np.zeros((28, 28, 5), dtype=np.uint8))
    dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=1, num_workers=0)
    dm.setup("fit")
    with pytest.raises(ImageReadError, match="stack.tif"):
        dm.train_set[0]


def test_skip_unreadable_logs_and_keeps_batches_full(tmp_path, caplog):
    folder = folder_of_constant_images(tmp_path / "imgs", 3)
    (folder / "img_002.png").write_bytes(b"broken")
    tifffile.imwrite(folder / "img_003.tif", np.zeros((28, 28, 5), dtype=np.uint8))  # wrong channel count
    dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=4, num_workers=0, shuffle=False,
                               skip_unreadable=True)
    dm.setup("fit")
    with caplog.at_level(logging.WARNING, logger="datamodules.images"):
        batch = next(iter(dm.train_dataloader()))
    assert batch.shape == (4, 3, 28, 28)
    # Files 2 and 3 are unreadable: each is replaced by the next readable file, wrapping around.
    assert [index_of(s) for s in batch] == [0, 1, 0, 0]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "img_002.png" in messages and "img_003.tif" in messages


# -- splits and batching --------------------------------------------------------------------------

def test_val_fraction_split_is_seeded_and_disjoint(tmp_path):
    folder = folder_of_constant_images(tmp_path / "imgs", 20)
    splits = []
    for _ in range(2):
        dm = ImageFolderDataModule(str(folder), val_fraction=0.25, image_size=28, batch_size=5, num_workers=0)
        dm.setup("fit")
        splits.append(([p.name for p in dm.train_set.files], [p.name for p in dm.val_set.files]))
    (train, val), (train2, val2) = splits
    assert (train, val) == (train2, val2)
    assert len(val) == 5 and len(train) == 15 and not set(train) & set(val)
    with pytest.raises(ValueError, match="either val_dir or val_fraction"):
        ImageFolderDataModule(str(folder), val_dir=str(folder), val_fraction=0.1)


def test_val_dir_and_no_validation(tmp_path):
    train = folder_of_constant_images(tmp_path / "train", 4)
    val = folder_of_constant_images(tmp_path / "val", 2)
    dm = ImageFolderDataModule(str(train), val_dir=str(val), image_size=28, batch_size=2, num_workers=0)
    dm.setup("fit")
    assert len(dm.val_set) == 2 and next(iter(dm.val_dataloader())).shape == (2, 3, 28, 28)
    dm = ImageFolderDataModule(str(train), image_size=28, batch_size=2, num_workers=0)
    dm.setup("fit")
    assert dm.val_dataloader() == []


def test_global_batch_is_split_over_ranks_into_the_single_process_batch(tmp_path):
    folder = folder_of_constant_images(tmp_path / "imgs", 16)

    def first_batches(world, rank, epoch=0):
        dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=8, num_workers=0, seed=3)
        dm.trainer = fake_trainer(world, rank)
        dm.setup("fit")
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return [[index_of(s) for s in b] for b in loader]

    single = first_batches(1, 0)
    rank0, rank1 = first_batches(2, 0), first_batches(2, 1)
    assert len(single) == len(rank0) == len(rank1) == 2
    assert all(len(b) == 4 for b in rank0 + rank1)
    for step in range(2):
        assert sorted(rank0[step] + rank1[step]) == sorted(single[step])
    assert sorted(sum(single, [])) == list(range(16))  # a permutation of the whole set per epoch
    assert first_batches(1, 0, epoch=1) != single       # reshuffled each epoch, deterministically
    assert first_batches(1, 0, epoch=1) == first_batches(1, 0, epoch=1)
    with pytest.raises(ValueError, match="divide evenly"):
        dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=8, num_workers=0)
        dm.trainer = fake_trainer(3, 0)
        dm.train_dataloader()


def test_resumed_loader_continues_the_epoch_permutation(tmp_path):
    folder = folder_of_constant_images(tmp_path / "imgs", 12)
    dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=3, num_workers=0, seed=1)
    dm.setup("fit")
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(2)
    full = [[index_of(s) for s in b] for b in loader]
    resumed = dm.train_dataloader()
    resumed.load_state_dict({"epoch": 2, "batches": 1})
    assert [[index_of(s) for s in b] for b in resumed] == full[1:]
    resumed.sampler.set_epoch(3)   # the next epoch is whole again
    assert len(list(resumed)) == 4


def test_too_few_images_for_one_global_batch(tmp_path):
    folder = folder_of_constant_images(tmp_path / "imgs", 3)
    dm = ImageFolderDataModule(str(folder), image_size=28, batch_size=4, num_workers=0)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        dm.train_dataloader()


# -- COCO and bundled images ----------------------------------------------------------------------

def test_coco_missing_folder_names_the_layout(tmp_path):
    dm = CocoImagesDataModule(str(tmp_path / "coco"), batch_size=1)
    with pytest.raises(FileNotFoundError, match=r"(?s)train2017.*expected COCO layout.*val2017"):
        dm.setup("fit")


def test_coco_images_from_folders_or_annotation_lists(tmp_path):
    root = tmp_path / "coco"
    folder_of_constant_images(root / "train2017", 5)
    folder_of_constant_images(root / "val2017", 2)
    dm = CocoImagesDataModule(str(root), image_size=28, batch_size=1, num_workers=0)
    dm.setup("fit")
    assert len(dm.train_set) == 5 and len(dm.val_set) == 2

    (root / "annotations").mkdir()
    listing = {"images": [{"id": 7, "file_name": "img_004.png", "height": 28, "width": 28},
                          {"id": 3, "file_name": "img_001.png", "height": 28, "width": 28}],
               "annotations": [], "categories": []}
    (root / "annotations" / "stuff_train2017.json").write_text(json.dumps(listing))
    dm = CocoImagesDataModule(str(root), train_annotations="annotations/stuff_train2017.json", val_split=None,
                              image_size=28, batch_size=1, num_workers=0)
    dm.setup("fit")
    assert [p.name for p in dm.train_set.files] == ["img_001.png", "img_004.png"]  # by image id
    assert [index_of(dm.train_set[i]) for i in range(2)] == [1, 4]
    assert dm.val_set is None


def test_bundled_tiles_are_deterministic_and_normalised():
    a = BundledImagesDataModule(sets=["textures"], image_size=28, tile_size=64, tiles_per_image=2,
                                val_tiles_per_image=1, batch_size=2, seed=0)
    b = BundledImagesDataModule(sets=["textures"], image_size=28, tile_size=64, tiles_per_image=2,
                                val_tiles_per_image=1, batch_size=2, seed=0)
    a.setup("fit")
    b.setup("fit")
    assert a.train_set.images.shape == (6, 3, 28, 28) and a.val_set.images.shape == (3, 3, 28, 28)
    assert torch.equal(a.train_set.images, b.train_set.images)
    pixels = denormalize(a.train_set.images)
    assert pixels.min() >= -1e-5 and pixels.max() <= 1 + 1e-5
    assert not torch.equal(a.train_set.images[0], a.train_set.images[1])  # different tiles


def test_bundled_tiles_follow_the_intensity_mode():
    def tiles(intensity):
        dm = BundledImagesDataModule(sets=["retina"], image_size=28, tile_size=102, tiles_per_image=1,
                                     val_tiles_per_image=0, batch_size=1, seed=0, intensity=intensity)
        dm.setup("fit")
        return denormalize(dm.train_set.images)

    # microaneurysms (grey levels 38..129, its whole 102 px image is the tile) is stretched by default;
    # the colour retina photograph keeps its 8-bit values either way.
    auto, dtype = tiles("auto"), tiles("dtype")
    assert float(auto[0].max()) > 0.99 and float(dtype[0].max()) < 130 / 255 + 1e-3
    torch.testing.assert_close(auto[1], dtype[1])
    assert BundledImagesDataModule(batch_size=1).sets == ["textures", "photos", "microscopy", "retina", "astronomy",
                                                              "synthetic_micrographs"]
