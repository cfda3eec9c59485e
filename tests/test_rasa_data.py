"""RASA's training data (datamodules/rasa.py): the reference's augmentations, seeded per sample, VOC by default."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from alibi_vit.images import IMAGENET_MEAN, load_image
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


def _reference_normalize(image: torch.Tensor) -> torch.Tensor:
    """The reference's training normalisation: ImageNet mean, std (0.229, 0.224, 0.255)."""
    return (image - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor([0.229, 0.224, 0.255]).view(3, 1, 1)


def _views(image: torch.Tensor) -> dict[str, torch.Tensor]:
    base = _reference_normalize(image)
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
    base = _reference_normalize(image)
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
    # the reference's loader: list order, the last partial batch kept (1,464 images in batches of 32: 46 steps)
    assert len(loader) == 4
    batches = list(loader)
    assert [b.shape[0] for b in batches] == [2, 2, 2, 1] and all(b.shape[1:] == (3, 28, 28) for b in batches)
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        order, seeds = zip(*loader.sampler.epoch_indices())
        assert list(order) == list(range(7))  # not shuffled: every epoch the same order ...
        if epoch == 0:
            first_seeds = seeds
    assert seeds != first_seeds  # ... with fresh augmentations
    # validation: VOC val at the reference's 224 px, whatever the training crop size
    val = next(iter(dm.val_dataloader()))
    assert val["image"].shape == (2, 3, 224, 224) and val["label"].shape == (2, 224, 224)
    shuffled = RASADataModule(str(root), image_size=28, batch_size=2, num_workers=0, shuffle=True, drop_last=True)
    shuffled.setup("fit")
    assert len(shuffled.train_dataloader()) == 3
    order = [index for index, _ in shuffled.train_dataloader().sampler.epoch_indices()]
    assert sorted(order) == list(range(7)) and order != list(range(7))


def test_reference_colour_blur_rotation_and_normalisation(tmp_path, monkeypatch):
    import torchvision.transforms as T
    import torchvision.transforms.functional as TF

    image = load_image(_asymmetric_image(tmp_path / "a.png"), "dtype")
    # the reference's training normalisation: ImageNet mean, std (0.229, 0.224, 0.255) — blue 0.255, not 0.225
    plain = RASAAugmentation(32, crop_scale=(1.0, 1.0), colour=False, flips=False, rotations=False)
    torch.testing.assert_close(plain(image, 0), _reference_normalize(image))
    # RandomRotate90(p=0.5) draws k in 0..3 half of the time: 1/2 + 1/2 · 1/4 = 62.5 % stay unrotated
    rot = RASAAugmentation(32, crop_scale=(1.0, 1.0), colour=False, flips=False, rotations=True)
    base = plain(image, 0)
    unrotated = sum(torch.allclose(rot(image, seed), base) for seed in range(400)) / 400
    assert abs(unrotated - 0.625) < 0.07  # binomial standard deviation 0.024
    # colour jitter with the reference's strengths, blur kernels 3, 5, 7 with σ in 0.1–2, each half of the time
    jitters, blurs = [], []
    real_jitter, real_blur = T.ColorJitter, TF.gaussian_blur
    monkeypatch.setattr(T, "ColorJitter", lambda *a: jitters.append(a) or real_jitter(*a))
    monkeypatch.setattr(TF, "gaussian_blur", lambda img, k, s: blurs.append((k, s)) or real_blur(img, k, s))
    colour = RASAAugmentation(32, crop_scale=(1.0, 1.0), flips=False, rotations=False)
    for seed in range(60):
        colour(image, seed)
    assert set(jitters) == {(0.32, 0.32, 0.32, 0.08)}
    assert {k[0] for k, _ in blurs} == {3, 5, 7} and all(k[0] == k[1] for k, _ in blurs)
    assert all(0.1 <= s[0] <= 2.0 and s[0] == s[1] for _, s in blurs) and 15 < len(blurs) < 45
    with pytest.raises(ValueError, match="blur_kernel must be"):
        RASAAugmentation(32, blur_kernel=(2, 6))


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
