"""RASA's training data (datamodules/rasa.py): the reference's augmentations, seeded per sample, VOC by default."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from alibi_vit.images import load_image, normalize
from datamodules.demo_voc import write_demo_voc
from datamodules.rasa import RASAAugmentation, RASADataModule, SeededSampler

ROOT = Path(__file__).resolve().parents[1]


def _asymmetric_image(path: Path, size: int = 32) -> Path:
    """A square image with no symmetry: every flip and rotation of it is a different image."""
    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([x * 255 // size, y * 255 // size, (x * y) % 256], axis=-1).astype(np.uint8)
    rgb[2:6, 3:12] = [255, 0, 0]  # a red bar near the top left
    Image.fromarray(rgb).save(path)
    return path


def _views(image: torch.Tensor) -> dict[str, torch.Tensor]:
    base = normalize(image)
    return {"none": base, "hflip": base.flip(-1), "vflip": base.flip(-2), "both": base.flip(-1).flip(-2)}


def test_vertical_flip_appears_in_a_batch_at_the_seeded_step(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    _asymmetric_image(folder / "a.png")
    # one image, whole (crop scale 1 of a square image), no colour or rotation: only the flips vary
    dm = RASADataModule(str(folder), dataset="folder", image_size=32, batch_size=1, num_workers=0,
                        samples_per_epoch=1, crop_scale=(1.0, 1.0), colour=False, rotations=False, seed=3)
    dm.setup("fit")
    views = _views(load_image(folder / "a.png", "dtype"))
    loader = dm.train_dataloader()

    def seen(epochs):
        names = []
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            (batch,) = list(loader)
            assert batch.shape == (1, 3, 32, 32)
            match = [n for n, v in views.items() if torch.allclose(batch[0], v, atol=1e-5)]
            assert len(match) == 1, "each batch holds the image under exactly one combination of flips"
            names.append(match[0])
        return names

    names = seen(12)
    assert "vflip" in names or "both" in names
    assert "none" in names and len(set(names)) >= 3  # the flips are random, not always on
    step = next(i for i, n in enumerate(names) if n in ("vflip", "both"))
    assert seen(12) == names  # the same seed: the vertical flip at the same step
    # where it is follows from the sampler's per-sample seed alone
    sampler = SeededSampler(dm.train_set, 1, seed=3)
    sampler.set_epoch(step)
    (index, sample_seed), = sampler.epoch_indices()
    direct = dm.augmentation(load_image(folder / "a.png", "dtype"), sample_seed)
    torch.testing.assert_close(direct, views[names[step]], atol=1e-5, rtol=0)


def test_rotations_and_crops(tmp_path):
    image = load_image(_asymmetric_image(tmp_path / "a.png"), "dtype")
    base = normalize(image)
    rot = RASAAugmentation(32, crop_scale=(1.0, 1.0), colour=False, flips=False, rotations=True)
    found = set()
    for seed in range(40):
        out = rot(image, seed)
        ks = [k for k in range(4) if torch.allclose(out, torch.rot90(base, k, dims=(-2, -1)), atol=1e-5)]
        assert len(ks) == 1
        found.add(ks[0])
    assert found == {0, 1, 2, 3}
    crop = RASAAugmentation(16, crop_scale=(0.25, 0.5), colour=True)
    outs = [crop(image, s) for s in range(5)]
    assert all(o.shape == (3, 16, 16) for o in outs)
    torch.testing.assert_close(crop(image, 2), outs[2])  # a sample's transform depends on its seed alone
    assert not torch.allclose(outs[0], outs[1])
    with pytest.raises(ValueError, match="crop_scale"):
        RASAAugmentation(16, crop_scale=(0.0, 1.0))


def test_voc_default_epochs_and_validation(tmp_path):
    root = write_demo_voc(tmp_path / "voc", n_train=7, n_val=3)
    dm = RASADataModule(str(root), image_size=28, batch_size=2, num_workers=0)
    dm.setup("fit")
    assert len(dm.train_set) == 7  # VOC train's images (the reference: 1,464)
    loader = dm.train_dataloader()
    assert len(loader) == 3  # 7 // 2: the last partial batch is dropped, as 1,464 // 32 = 45 in the reference
    batches = list(loader)
    assert len(batches) == 3 and all(b.shape == (2, 3, 28, 28) for b in batches)
    val = next(iter(dm.val_dataloader()))
    assert val["image"].shape == (2, 3, 28, 28) and val["label"].shape == (2, 28, 28)


def test_coco_option_draws_the_reference_epoch(tmp_path):
    folder = tmp_path / "coco" / "train2017"
    folder.mkdir(parents=True)
    for i in range(5):
        _asymmetric_image(folder / f"{i:012d}.jpg", 20)
    dm = RASADataModule(str(tmp_path / "coco"), dataset="coco", image_size=14, batch_size=2, num_workers=0)
    assert dm.samples_per_epoch == 1464 and dm.val_dataloader() == []
    with pytest.raises(ValueError, match="samples_per_epoch=1464 must be between 1 and the 5"):
        dm.setup("fit")
    dm = RASADataModule(str(tmp_path / "coco"), dataset="coco", image_size=14, batch_size=2, num_workers=0,
                        samples_per_epoch=4)
    dm.setup("fit")
    assert len(dm.train_dataloader()) == 2
    with pytest.raises(ValueError, match="dataset must be voc, coco or folder"):
        RASADataModule(str(tmp_path), dataset="imagenet")
