"""Segmentation datamodules on small fixture datasets written in the real on-disk layouts."""

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from alibi_vit.images import IMAGENET_MEAN, IMAGENET_STD
from datamodules.segmentation import (
    ADE20K_CLASSES, COCO_STUFF_CATEGORY_IDS, COCO_STUFF_CLASSES, IGNORE_INDEX, VOC_CLASSES, ADE20KSegmentation,
    COCOStuffSegmentation, DatasetLayoutError, VOCSegmentation, voc_palette, write_synthetic_voc,
)


def nearest_exact(label: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """Independent pixel-centre nearest resampling: output pixel i reads source floor((i + 0.5)·H/out)."""
    h, w = label.shape
    rows = np.minimum(((np.arange(out_h) + 0.5) * h / out_h).astype(int), h - 1)
    cols = np.minimum(((np.arange(out_w) + 0.5) * w / out_w).astype(int), w - 1)
    return label[rows][:, cols]


@pytest.fixture
def voc_root(tmp_path):
    return write_synthetic_voc(tmp_path / "voc", n_train=5, n_val=3, seed=1)


def test_class_lists_have_the_dataset_sizes():
    assert (len(VOC_CLASSES), len(ADE20K_CLASSES), len(COCO_STUFF_CLASSES)) == (21, 150, 171)
    assert VOCSegmentation.num_classes == 21 and ADE20KSegmentation.num_classes == 150
    assert COCOStuffSegmentation.num_classes == 171


def test_voc_reads_palette_masks_as_indices_with_ignore(voc_root):
    dm = VOCSegmentation(str(voc_root), image_size=56, batch_size=4, num_workers=0)
    dm.setup("fit")
    base = voc_root / "VOCdevkit" / "VOC2012"
    train_ids = (base / "ImageSets/Segmentation/train.txt").read_text().split()
    assert [s.image_id for s in dm.train_set.samples] == train_ids
    item = dm.val_set[0]
    mask = Image.open(base / "SegmentationClass" / f"{item['image_id']}.png")
    assert mask.mode == "P" and mask.size[0] % 14 and mask.size[1] % 14  # odd sizes, not multiples of 14
    expected = nearest_exact(np.array(mask), 56, 56)
    assert IGNORE_INDEX in expected  # the object borders
    np.testing.assert_array_equal(item["label"].numpy(), expected)
    assert item["label"].dtype == torch.int64 and item["image"].shape == (3, 56, 56)

    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (4, 3, 56, 56) and batch["label"].shape == (4, 56, 56)
    assert set(batch["label"].unique().tolist()) <= {0, 1, 2, 3, IGNORE_INDEX}


def test_crop_mode_keeps_aspect_and_crops_the_centre(voc_root):
    dm = VOCSegmentation(str(voc_root), image_size=28, resize_mode="crop", num_workers=0)
    dm.setup("validate")
    item = dm.val_set[1]
    label = np.array(Image.open(voc_root / "VOCdevkit/VOC2012/SegmentationClass" / f"{item['image_id']}.png"))
    h, w = label.shape
    scale = max(28 / h, 28 / w)
    new_h, new_w = max(28, round(h * scale)), max(28, round(w * scale))
    top, left = (new_h - 28) // 2, (new_w - 28) // 2
    expected = nearest_exact(label, new_h, new_w)[top:top + 28, left:left + 28]
    np.testing.assert_array_equal(item["label"].numpy(), expected)


def test_voc2007_validates_on_its_val_split(tmp_path):
    root = write_synthetic_voc(tmp_path, n_train=4, n_val=2, year=2007)
    dm = VOCSegmentation(str(root / "VOCdevkit"), year=2007, image_size=28, num_workers=0)  # root may be VOCdevkit
    dm.setup("fit")
    val_ids = (root / "VOCdevkit/VOC2007/ImageSets/Segmentation/val.txt").read_text().split()
    assert [s.image_id for s in dm.val_set.samples] == val_ids
    assert not {s.image_id for s in dm.val_set.samples} & {s.image_id for s in dm.train_set.samples}
    with pytest.raises(ValueError, match="held-out"):
        VOCSegmentation(str(root), year=2007, val_split="train")
    # a val split file that lists training images is caught too
    (root / "VOCdevkit/VOC2007/ImageSets/Segmentation/trainval.txt").write_text(
        (root / "VOCdevkit/VOC2007/ImageSets/Segmentation/train.txt").read_text())
    with pytest.raises(ValueError, match="also training images"):
        VOCSegmentation(str(root), year=2007, val_split="trainval").setup("fit")


def test_images_are_imagenet_normalised(tmp_path):
    """A flat-colour ADE20K image must come out as (colour - mean) / std in every pixel."""
    base = tmp_path / "ADEChallengeData2016"
    for split in ("training", "validation"):
        (base / "images" / split).mkdir(parents=True)
        (base / "annotations" / split).mkdir(parents=True)
    colour = (200, 100, 30)
    Image.fromarray(np.full((33, 47, 3), colour, np.uint8)).save(base / "images/validation/ADE_val_1.png")
    Image.fromarray(np.ones((33, 47), np.uint8)).save(base / "annotations/validation/ADE_val_1.png")
    dm = ADE20KSegmentation(str(tmp_path), image_size=28, num_workers=0)
    dm.setup("validate")
    image = dm.val_set[0]["image"]
    expected = (torch.tensor(colour) / 255.0 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    torch.testing.assert_close(image, expected.view(3, 1, 1).expand(3, 28, 28), atol=1e-4, rtol=0)


def write_ade20k(root, label_values):
    base = root / "ADEChallengeData2016"
    rng = np.random.default_rng(0)
    for split, n in (("training", 2), ("validation", 1)):
        (base / "images" / split).mkdir(parents=True)
        (base / "annotations" / split).mkdir(parents=True)
        for i in range(n):
            stem = f"ADE_{split}_{i:08d}"
            image = rng.integers(0, 255, (28, 42, 3), dtype=np.uint8)
            Image.fromarray(image).save(base / "images" / split / f"{stem}.jpg")
            Image.fromarray(label_values).save(base / "annotations" / split / f"{stem}.png")  # mode L
    return root


def test_ade20k_maps_other_to_ignore_and_shifts_classes(tmp_path):
    stored = np.zeros((28, 42), np.uint8)
    stored[:, 10:20], stored[:, 20:30], stored[:, 30:] = 1, 37, 150
    root = write_ade20k(tmp_path, stored)
    dm = ADE20KSegmentation(str(root), image_size=[28, 42], num_workers=0)  # same size: no resampling
    dm.setup("fit")
    assert len(dm.train_set) == 2 and len(dm.val_set) == 1
    label = dm.val_set[0]["label"].numpy()
    expected = np.where(stored == 0, 255, stored.astype(np.int64) - 1)
    np.testing.assert_array_equal(label, expected)
    assert (ADE20K_CLASSES[0], ADE20K_CLASSES[36], ADE20K_CLASSES[149]) == ("wall", "lamp", "flag")  # stored 1, 37, 150


def write_cocostuff_maps(root, stored):
    for split in ("train2017", "val2017"):
        (root / split).mkdir(parents=True)
        (root / "stuffthingmaps_trainval2017" / split).mkdir(parents=True)
        Image.fromarray(np.full((*stored.shape, 3), 90, np.uint8)).save(root / split / "000000000139.jpg")
        Image.fromarray(stored).save(root / "stuffthingmaps_trainval2017" / split / "000000000139.png")
    return root


def test_cocostuff_stuffthingmaps_to_171_classes(tmp_path):
    # stored value = COCO category id - 1: person(1), toothbrush(90), banner(92), wood(182), unused 12 and 91, 255
    stored = np.array([[0, 89, 91, 181, 11, 90, 255]], np.uint8).repeat(14, axis=0)
    root = write_cocostuff_maps(tmp_path, stored)
    dm = COCOStuffSegmentation(str(root), image_size=list(stored.shape), num_workers=0)
    dm.setup("validate")
    label = dm.val_set[0]["label"][0].tolist()
    assert label == [0, 79, 80, 170, 255, 255, 255]
    names = [COCO_STUFF_CLASSES[i] for i in label[:4]]
    assert names == ["person", "toothbrush", "banner", "wood"]


def test_cocostuff_json_rendering_matches_the_maps(tmp_path):
    """COCO JSON (things over stuff, 'other' ignored) renders to the same labels as the equivalent map."""
    h, w = 28, 42
    stored = np.full((h, w), 255, np.uint8)
    stored[:, :] = 91  # banner (id 92) everywhere ...
    stored[5:15, 10:30] = 0  # ... a person (id 1) on top
    root = write_cocostuff_maps(tmp_path, stored)

    def rect(y0, x0, y1, x1):
        return [[x0, y0, x1, y0, x1, y1, x0, y1]]

    image = {"id": 139, "file_name": "000000000139.jpg", "height": h, "width": w}
    # the released files define every category, used in this image or not
    thing_categories = [{"id": i, "name": n} for i, n in zip(COCO_STUFF_CATEGORY_IDS[:80], COCO_STUFF_CLASSES[:80])]
    stuff_categories = [{"id": i, "name": n} for i, n in zip(COCO_STUFF_CATEGORY_IDS[80:], COCO_STUFF_CLASSES[80:])]
    things = {"images": [image], "categories": thing_categories,
              "annotations": [{"id": 1, "image_id": 139, "category_id": 1, "segmentation": rect(5, 10, 15, 30),
                               "area": 200.0, "bbox": [10, 5, 20, 10], "iscrowd": 0}]}
    stuff = {"images": [image], "categories": [*stuff_categories, {"id": 183, "name": "other"}],
             "annotations": [{"id": 2, "image_id": 139, "category_id": 92, "segmentation": rect(0, 0, h, w),
                              "area": float(h * w), "bbox": [0, 0, w, h], "iscrowd": 0},
                             {"id": 3, "image_id": 139, "category_id": 183, "segmentation": rect(20, 0, h, 5),
                              "area": 40.0, "bbox": [0, 20, 5, 8], "iscrowd": 0}]}
    (root / "annotations").mkdir()
    for name, data in (("instances_val2017.json", things), ("stuff_val2017.json", stuff)):
        (root / "annotations" / name).write_text(json.dumps(data))
    from_json = COCOStuffSegmentation(str(root), image_size=[h, w], num_workers=0,
                                      val_annotations=["annotations/instances_val2017.json",
                                                       "annotations/stuff_val2017.json"])
    from_json.setup("validate")
    from_maps = COCOStuffSegmentation(str(root), image_size=[h, w], num_workers=0)
    from_maps.setup("validate")
    json_label, map_label = from_json.val_set[0]["label"], from_maps.val_set[0]["label"]
    assert (json_label == 0).sum() > 150 and (json_label == 80).sum() > 600
    assert torch.equal(json_label, map_label)

    # the instances file alone would leave every stuff pixel unlabelled: refused
    things_only = COCOStuffSegmentation(str(root), image_size=[h, w], num_workers=0,
                                        val_annotations=["annotations/instances_val2017.json"])
    with pytest.raises(ValueError, match=r"(?s)define no categories \[92, .*stuff_\*\.json"):
        things_only.setup("validate")


def test_cocostuff_maps_skip_exactly_the_eleven_unused_thing_ids(tmp_path):
    """Every stored value 0..181 maps to its class; the 11 unused thing ids and 182.. are ignored."""
    stored = np.arange(256, dtype=np.uint8).reshape(16, 16)
    root = write_cocostuff_maps(tmp_path, stored)
    dm = COCOStuffSegmentation(str(root), image_size=[16, 16], num_workers=0)
    dm.setup("validate")
    label = dm.val_set[0]["label"].flatten().tolist()
    ignored = [v for v in range(182) if label[v] == IGNORE_INDEX]
    assert [v + 1 for v in ignored] == [12, 26, 29, 30, 45, 66, 68, 69, 71, 83, 91]  # as COCO category ids
    assert sorted(label[v] for v in range(182) if v not in ignored) == list(range(171))  # contiguous, once each
    assert all(v == IGNORE_INDEX for v in label[182:])
    # stored = category id - 1: ids 13, 89, 92 and 182
    assert [COCO_STUFF_CLASSES[label[v]] for v in (12, 88, 91, 181)] == ["stop sign", "hair drier", "banner", "wood"]


def test_missing_folders_and_split_files_say_what_layout_was_expected(tmp_path, voc_root):
    with pytest.raises(DatasetLayoutError, match=r"(?s)JPEGImages.*expected layout.*ImageSets/Segmentation"):
        VOCSegmentation(str(tmp_path / "nowhere")).setup("fit")
    (voc_root / "VOCdevkit/VOC2012/ImageSets/Segmentation/val.txt").unlink()
    with pytest.raises(DatasetLayoutError, match=r"(?s)split file.*val\.txt.*expected layout"):
        VOCSegmentation(str(voc_root)).setup("fit")
    with pytest.raises(DatasetLayoutError, match=r"(?s)annotation folder.*ADEChallengeData2016/annotations"):
        (tmp_path / "ade" / "ADEChallengeData2016" / "images" / "training").mkdir(parents=True)
        ADE20KSegmentation(str(tmp_path / "ade")).setup("fit")
    with pytest.raises(DatasetLayoutError, match=r"(?s)stuffthingmaps.*expected layout"):
        (tmp_path / "coco" / "train2017").mkdir(parents=True)
        COCOStuffSegmentation(str(tmp_path / "coco")).setup("fit")


def test_missing_label_file_is_named(voc_root):
    val_id = (voc_root / "VOCdevkit/VOC2012/ImageSets/Segmentation/val.txt").read_text().split()[0]
    (voc_root / f"VOCdevkit/VOC2012/SegmentationClass/{val_id}.png").unlink()
    with pytest.raises(DatasetLayoutError, match=f"{val_id}.png"):
        VOCSegmentation(str(voc_root)).setup("validate")


def test_rgb_colour_masks_are_refused(voc_root):
    val_id = (voc_root / "VOCdevkit/VOC2012/ImageSets/Segmentation/val.txt").read_text().split()[0]
    path = voc_root / f"VOCdevkit/VOC2012/SegmentationClass/{val_id}.png"
    Image.open(path).convert("RGB").save(path)
    dm = VOCSegmentation(str(voc_root), image_size=28, num_workers=0)
    dm.setup("validate")
    with pytest.raises(ValueError, match="palette"):
        dm.val_set[0]


def test_values_outside_the_classes_are_refused(voc_root):
    """A VOC SegmentationObject (instance ids) mask in place of SegmentationClass is an error, not a crash."""
    val_id = (voc_root / "VOCdevkit/VOC2012/ImageSets/Segmentation/val.txt").read_text().split()[0]
    path = voc_root / f"VOCdevkit/VOC2012/SegmentationClass/{val_id}.png"
    mask = np.array(Image.open(path))
    mask[:3, :3] = 23  # a 23rd object instance
    im = Image.fromarray(mask, mode="P")
    im.putpalette(voc_palette())
    im.save(path)
    dm = VOCSegmentation(str(voc_root), image_size=28, num_workers=0)
    dm.setup("validate")
    with pytest.raises(ValueError, match=r"values \[23\] are neither classes 0\.\.20 nor 255"):
        dm.val_set[0]


def test_augmentation_flips_pairs_in_training_only(voc_root):
    dm = VOCSegmentation(str(voc_root), image_size=28, augment=True, num_workers=0)
    dm.setup("fit")
    plain = VOCSegmentation(str(voc_root), image_size=28, num_workers=0)
    plain.setup("fit")
    reference = plain.train_set[0]
    random.seed(0)
    flipped = 0
    for _ in range(12):
        item = dm.train_set[0]
        is_flipped = not torch.equal(item["label"], reference["label"])
        if is_flipped:
            flipped += 1
            torch.testing.assert_close(item["image"], reference["image"].flip(-1))
            assert torch.equal(item["label"], reference["label"].flip(-1))
        else:
            torch.testing.assert_close(item["image"], reference["image"])
    assert 0 < flipped < 12
    for _ in range(4):  # validation never augments
        assert torch.equal(dm.val_set[0]["label"], plain.val_set[0]["label"])
    with pytest.raises(ValueError, match="augment=False"):
        dm.attach_feature_cache(object())


# ---- per-epoch random subsets (ADE20K protocol) and the crop augmentation ---------------------------


def test_epoch_subset_sampler_draws_fresh_distinct_subsets_shared_out_between_processes():
    from datamodules.segmentation import EpochSubsetSampler

    data = list(range(50))
    shards = {}
    for epoch in range(3):
        for rank in range(2):
            sampler = EpochSubsetSampler(data, 20, seed=7, num_replicas=2, rank=rank)
            sampler.set_epoch(epoch)
            shards[epoch, rank] = list(sampler)
            assert len(sampler) == len(shards[epoch, rank]) == 10
    for epoch in range(3):
        a, b = shards[epoch, 0], shards[epoch, 1]
        assert not set(a) & set(b) and len(set(a) | set(b)) == 20  # the two processes split one draw of 20
    draws = [set(shards[e, 0]) | set(shards[e, 1]) for e in range(3)]
    assert draws[0] != draws[1] != draws[2]  # a fresh draw every epoch
    # deterministic: a resumed run (new sampler, same seed and epoch) draws the same images
    again = EpochSubsetSampler(data, 20, seed=7, num_replicas=2, rank=1)
    again.set_epoch(2)
    assert list(again) == shards[2, 1]
    # uniform over the dataset: 400 epochs × 20 of 50 = 160 expected draws per image (binomial sd ≈ 10)
    sampler = EpochSubsetSampler(data, 20, seed=0, num_replicas=1, rank=0)
    counts = np.zeros(50)
    for epoch in range(400):
        sampler.set_epoch(epoch)
        drawn = list(sampler)
        assert len(drawn) == len(set(drawn)) == 20  # without replacement within an epoch
        counts[drawn] += 1
    assert counts.min() > 110 and counts.max() < 210


def test_epoch_subset_sampler_pads_uneven_shares_and_refuses_too_many():
    from datamodules.segmentation import EpochSubsetSampler

    shares = [list(EpochSubsetSampler(list(range(30)), 10, num_replicas=3, rank=r)) for r in range(3)]
    assert [len(s) for s in shares] == [4, 4, 4]  # 10 images over 3 processes: 2 repeated to even the shares
    assert len(set().union(*shares)) == 10
    with pytest.raises(ValueError, match="train_samples_per_epoch=31 must be between 1 and the 30 training images"):
        EpochSubsetSampler(list(range(30)), 31)


def test_datamodule_uses_the_subset_sampler_with_the_trainers_rank(voc_root):
    from types import SimpleNamespace

    from torch.utils.data import DistributedSampler

    from datamodules.segmentation import EpochSubsetSampler

    dm = VOCSegmentation(str(voc_root), image_size=28, batch_size=2, num_workers=0, train_samples_per_epoch=3)
    dm.trainer = SimpleNamespace(world_size=2, global_rank=1)  # what Lightning attaches under 2-process DDP
    sampler = dm.train_dataloader().sampler
    # a DistributedSampler, so Lightning keeps it under DDP instead of wrapping it in its own
    assert isinstance(sampler, EpochSubsetSampler) and isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (2, 1, 2)
    plain = VOCSegmentation(str(voc_root), image_size=28, batch_size=2, num_workers=0)
    assert not isinstance(plain.train_dataloader().sampler, DistributedSampler)  # default: every image, shuffled
    with pytest.raises(ValueError, match="train_samples_per_epoch must be a positive"):
        VOCSegmentation(str(voc_root), train_samples_per_epoch=0)


def _striped_voc(root, n=2):
    """VOC-layout images whose class is readable from the colour: vertical stripes of 3 classes, 255 borders."""
    from datamodules.segmentation import SYNTHETIC_COLOURS

    base = root / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    ids = [f"s{i}" for i in range(n)]
    for i, image_id in enumerate(ids):
        x = np.arange(90)[None, :].repeat(60, 0)
        label = ((x // (12 + 5 * i)) % 3).astype(np.uint8) + 1  # classes 1..3, stripes of unequal width
        label[:, ::(12 + 5 * i)] = IGNORE_INDEX
        label[:20, :30] = 0  # a background block: not symmetric, so a flip of one of the pair would show
        colours = np.array(SYNTHETIC_COLOURS, np.float32)[np.where(label == IGNORE_INDEX, 0, label)]
        Image.fromarray((colours * 255).round().astype(np.uint8)).save(base / "JPEGImages" / f"{image_id}.jpg",
                                                                       quality=98)
        mask = Image.fromarray(label, mode="P")
        mask.putpalette(voc_palette())
        mask.save(base / "SegmentationClass" / f"{image_id}.png")
    (base / "ImageSets/Segmentation/train.txt").write_text("\n".join(ids[:-1]))
    (base / "ImageSets/Segmentation/val.txt").write_text(ids[-1])
    return root


def test_crop_flip_augmentation_keeps_image_and_label_registered(tmp_path):
    from datamodules.segmentation import SYNTHETIC_COLOURS

    root = _striped_voc(tmp_path / "striped", n=3)
    dm = VOCSegmentation(str(root), image_size=42, augment="crop_flip", num_workers=0)
    dm.setup("fit")
    plain = VOCSegmentation(str(root), image_size=42, num_workers=0)
    plain.setup("fit")
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]
    palette = torch.tensor(SYNTHETIC_COLOURS[:4])  # background + classes 1..3
    torch.manual_seed(0)
    random.seed(0)
    labels = []
    for _ in range(16):
        item = dm.train_set[0]
        assert item["image"].shape == (3, 42, 42) and item["label"].shape == (42, 42)
        rgb = (item["image"] * std + mean).permute(1, 2, 0)  # back to [0, 1] colours
        nearest = ((rgb[..., None, :] - palette) ** 2).sum(-1).argmin(-1)  # class read off the colour
        valid = item["label"] != IGNORE_INDEX
        # away from stripe edges (bilinear mixes colours there) the colour gives the label
        agree = (nearest[valid] == item["label"][valid]).float().mean()
        assert agree > 0.9, float(agree)
        labels.append(item["label"])
    distinct = {tuple(lab.flatten().tolist()) for lab in labels}
    assert len(distinct) > 8  # random crops, not one fixed view
    assert torch.equal(dm.val_set[0]["label"], plain.val_set[0]["label"])  # validation never augments
    with pytest.raises(ValueError, match="augment=False"):
        dm.attach_feature_cache(object())
    with pytest.raises(ValueError, match="augment must be"):
        VOCSegmentation(str(root), augment="jitter")


def test_worker_count_is_capped_at_the_cores_with_one_warning(tmp_path, monkeypatch):
    import os
    import warnings

    import datamodules
    from datamodules.images import ImageFolderDataModule

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(datamodules, "_WARNED_WORKERS", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        modules = [VOCSegmentation(str(tmp_path), num_workers=8) for _ in range(3)]
        modules.append(ImageFolderDataModule(str(tmp_path), num_workers=8))
        small = VOCSegmentation(str(tmp_path), num_workers=1)
    assert [m.num_workers for m in modules] == [2, 2, 2, 2] and small.num_workers == 1
    messages = [str(w.message) for w in caught if "num_workers" in str(w.message)]
    assert messages == ["num_workers=8 exceeds the 2 CPU cores available here: using 2"]
    with pytest.raises(ValueError, match="num_workers must be 0 or more, got -1"):
        VOCSegmentation(str(tmp_path), num_workers=-1)
