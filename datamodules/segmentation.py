"""Segmentation datasets in their released on-disk layouts, for the linear probes (docs/method.md §6).

Four datamodules, each pointed at ``--data.root``:

- ``VOCSegmentation`` (``year=2007`` or ``2012``, 21 classes)::

      ROOT/VOCdevkit/VOC2012/JPEGImages/<id>.jpg
      ROOT/VOCdevkit/VOC2012/SegmentationClass/<id>.png        palette PNG, index = class, 255 = ignore
      ROOT/VOCdevkit/VOC2012/ImageSets/Segmentation/{train,val}.txt

  (``ROOT`` may also be the ``VOCdevkit`` or the ``VOC2012`` folder itself.) Validation is
  always the ``val`` split; VOC 2007 is never validated on its training images.
- ``ADE20KSegmentation`` (150 classes)::

      ROOT/ADEChallengeData2016/images/{training,validation}/<id>.jpg
      ROOT/ADEChallengeData2016/annotations/{training,validation}/<id>.png    0 = other → ignored, k → k-1

- ``COCOStuffSegmentation`` (171 classes: 80 things + 91 stuff)::

      ROOT/{train2017,val2017}/<id>.jpg
      ROOT/stuffthingmaps_trainval2017/{train2017,val2017}/<id>.png   value = COCO category id - 1, 255 = ignore

  or, with ``train_annotations``/``val_annotations``, COCO JSON files (e.g. ``instances_*.json``
  plus ``stuff_*.json``) rendered with pycocotools.

Every image is resized to the probe size (518 px by default) and normalised with the ImageNet
mean/std (ADE20K included); labels get the same geometry with nearest-neighbour resampling.
``resize_mode="stretch"`` (default) resizes the whole image to the square so every labelled
pixel counts in the metric; ``"crop"`` resizes the shortest side and centre-crops (aspect kept,
borders dropped). Training augmentation is off by default, as in the paper, and never applied
at validation: ``augment="flip"`` (or ``true``) flips training pairs horizontally at random;
``augment="crop_flip"`` also takes a random resized crop first (see ``SegmentationDataModule``).

``train_samples_per_epoch`` makes an epoch a fresh random draw of that many training images
(the paper's ADE20K protocol, Tab. S2: 1,000 of the 20,210 per epoch); see ``EpochSubsetSampler``.

Batches are dicts: ``label`` (B, H, W) int64 with 255 = ignore, ``image_id`` and ``cache_key``
(lists of str), and ``image`` (B, 3, H, W) — or, for images whose backbone features a
``SegmentationProbeModule`` has cached on disk, ``features`` (B', C, h, w) read in the loader
workers instead of decoding the image (see ``attach_feature_cache``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from alibi_vit.images import load_image, normalize

from . import DatasetLayoutError, usable_workers

__all__ = [
    "ADE20K_CLASSES", "COCO_STUFF_CLASSES", "COCO_STUFF_CATEGORY_IDS", "IGNORE_INDEX", "VOC_CLASSES",
    "ADE20KSegmentation", "AUGMENTATIONS", "COCOStuffSegmentation", "DatasetLayoutError", "EpochSubsetSampler",
    "SegmentationDataModule",
    "SegmentationDataset", "VOCSegmentation", "collate_segmentation", "voc_palette", "write_synthetic_voc",
]

IGNORE_INDEX = 255

# Training augmentations: none, random horizontal flip, random resized crop + horizontal flip.
AUGMENTATIONS = ("none", "flip", "crop_flip")
# Random resized crop of "crop_flip": the crop covers 25–100 % of the image area with an aspect ratio in
# [3/4, 4/3] (torchvision's ratio default; its area default of 8 % would often leave a crop of a single object)
CROP_SCALE = (0.25, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)


def _augmentation(augment) -> str:
    """Normalise ``augment``: booleans (``true`` = ``flip``, the original option) or one of ``AUGMENTATIONS``."""
    if augment is None or augment is False:
        return "none"
    if augment is True:
        return "flip"
    if augment in AUGMENTATIONS:
        return augment
    raise ValueError(f"augment must be true/false or one of {', '.join(AUGMENTATIONS)}; got {augment!r}")

VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
    "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train", "tvmonitor",
)

ADE20K_CLASSES = (
    "wall", "building", "sky", "floor", "tree", "ceiling", "road", "bed", "windowpane", "grass", "cabinet",
    "sidewalk", "person", "earth", "door", "table", "mountain", "plant", "curtain", "chair", "car", "water",
    "painting", "sofa", "shelf", "house", "sea", "mirror", "rug", "field", "armchair", "seat", "fence", "desk",
    "rock", "wardrobe", "lamp", "bathtub", "railing", "cushion", "base", "box", "column", "signboard",
    "chest of drawers", "counter", "sand", "sink", "skyscraper", "fireplace", "refrigerator", "grandstand",
    "path", "stairs", "runway", "case", "pool table", "pillow", "screen door", "stairway", "river", "bridge",
    "bookcase", "blind", "coffee table", "toilet", "flower", "book", "hill", "bench", "countertop", "stove",
    "palm", "kitchen island", "computer", "swivel chair", "boat", "bar", "arcade machine", "hovel", "bus",
    "towel", "light", "truck", "tower", "chandelier", "awning", "streetlight", "booth", "television receiver",
    "airplane", "dirt track", "apparel", "pole", "land", "bannister", "escalator", "ottoman", "bottle",
    "buffet", "poster", "stage", "van", "ship", "fountain", "conveyer belt", "canopy", "washer", "plaything",
    "swimming pool", "stool", "barrel", "basket", "waterfall", "tent", "bag", "minibike", "cradle", "oven",
    "ball", "food", "step", "tank", "trade name", "microwave", "pot", "animal", "bicycle", "lake",
    "dishwasher", "screen", "blanket", "sculpture", "hood", "sconce", "vase", "traffic light", "tray",
    "ashcan", "fan", "pier", "crt screen", "plate", "monitor", "bulletin board", "shower", "radiator",
    "glass", "clock", "flag",
)

# COCO's 80 thing categories keep the ids of the original 91-id list (11 unused: 12, 26, 29, 30,
# 45, 66, 68, 69, 71, 83, 91); the 91 stuff categories are ids 92..182; 183 ("other") is not a class.
_COCO_THING_IDS = (
    *range(1, 12), *range(13, 26), 27, 28, *range(31, 45), *range(46, 66), 67, 70, *range(72, 83),
    *range(84, 91),
)
COCO_STUFF_CATEGORY_IDS = (*_COCO_THING_IDS, *range(92, 183))
_COCO_THINGS = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard",
    "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors",
    "teddy bear", "hair drier", "toothbrush",
)
_COCO_STUFF = (
    "banner", "blanket", "branch", "bridge", "building-other", "bush", "cabinet", "cage", "cardboard", "carpet",
    "ceiling-other", "ceiling-tile", "cloth", "clothes", "clouds", "counter", "cupboard", "curtain",
    "desk-stuff", "dirt", "door-stuff", "fence", "floor-marble", "floor-other", "floor-stone", "floor-tile",
    "floor-wood", "flower", "fog", "food-other", "fruit", "furniture-other", "grass", "gravel", "ground-other",
    "hill", "house", "leaves", "light", "mat", "metal", "mirror-stuff", "moss", "mountain", "mud", "napkin",
    "net", "paper", "pavement", "pillow", "plant-other", "plastic", "platform", "playingfield", "railing",
    "railroad", "river", "road", "rock", "roof", "rug", "salad", "sand", "sea", "shelf", "sky-other",
    "skyscraper", "snow", "solid-other", "stairs", "stone", "straw", "structural-other", "table", "tent",
    "textile-other", "towel", "tree", "vegetable", "wall-brick", "wall-concrete", "wall-other", "wall-panel",
    "wall-stone", "wall-tile", "wall-wood", "water-other", "waterdrops", "window-blind", "window-other", "wood",
)
COCO_STUFF_CLASSES = _COCO_THINGS + _COCO_STUFF
assert len(VOC_CLASSES) == 21 and len(ADE20K_CLASSES) == 150
assert len(_COCO_THING_IDS) == len(_COCO_THINGS) == 80
assert len(COCO_STUFF_CLASSES) == len(COCO_STUFF_CATEGORY_IDS) == 171


# --------------------------------------------------------------------------------------------
# Geometry shared by images and labels


def _output_hw(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    h, w = (int(s) for s in size)
    return h, w


def _resize(tensor: torch.Tensor, size, mode: str, resize_mode: str) -> torch.Tensor:
    """Resize (C, H, W) to ``size`` by stretching, or shortest-side resize + centre crop.

    Images use antialiased bilinear, labels ``nearest-exact`` (pixel-centre aligned, so the label
    grid stays registered with the image; plain ``nearest`` shifts by half a pixel).
    """
    out_h, out_w = _output_hw(size)
    h, w = tensor.shape[-2:]
    if resize_mode == "stretch":
        new_h, new_w = out_h, out_w
    elif resize_mode == "crop":
        scale = max(out_h / h, out_w / w)
        new_h, new_w = max(out_h, round(h * scale)), max(out_w, round(w * scale))
    else:
        raise ValueError(f"resize_mode must be 'stretch' or 'crop', got {resize_mode!r}")
    if (new_h, new_w) != (h, w):
        kwargs = dict(mode="bilinear", antialias=True, align_corners=False) if mode == "bilinear" else dict(mode=mode)
        tensor = F.interpolate(tensor[None], size=(new_h, new_w), **kwargs)[0]
    top, left = (new_h - out_h) // 2, (new_w - out_w) // 2
    return tensor[..., top:top + out_h, left:left + out_w]


# --------------------------------------------------------------------------------------------
# Label readers: a sample → (H, W) uint8 array of class indices with 255 = ignore


@dataclass(frozen=True)
class Sample:
    image: Path
    label: Path | None  # None where labels are rendered from COCO JSON
    image_id: str  # unique within the dataset: what errors name and what the feature cache is keyed by
    coco_id: int | None = None


class PngLabels:
    """Index PNGs (palette 'P' or greyscale 'L'); ``lut`` maps stored values to classes (255 = ignore).

    RGB colour masks are refused: their colours are not class indices and silently mapping them
    would train on garbage. So is a value that is neither a class below ``num_classes`` nor 255
    (an instance mask such as VOC's SegmentationObject, say): on the GPU it would otherwise end
    as an opaque device-side assert in the loss.
    """

    def __init__(self, lut: np.ndarray | None = None, num_classes: int | None = None):
        self.lut = lut
        self.num_classes = num_classes

    def __call__(self, sample: Sample) -> np.ndarray:
        from PIL import Image

        try:
            with Image.open(sample.label) as im:
                if im.mode not in ("P", "L"):
                    raise ValueError(f"{sample.label}: label PNGs must be palette (P) or greyscale (L) index images, "
                                     f"got mode {im.mode}")
                array = np.array(im, dtype=np.uint8)
        except ValueError:
            raise
        except Exception as err:
            raise ValueError(f"{sample.label}: cannot read label ({type(err).__name__}: {err})") from err
        label = self.lut[array] if self.lut is not None else array
        if self.num_classes is not None and int(label.max()) >= self.num_classes:
            bad = sorted(set(np.unique(label).tolist()) - set(range(self.num_classes)) - {IGNORE_INDEX})
            if bad:
                raise ValueError(f"{sample.label}: values {bad[:10]} are neither classes 0..{self.num_classes - 1} "
                                 f"nor {IGNORE_INDEX} (ignore); is this a class-index mask of this dataset?")
        return label


class CocoJsonLabels:
    """Render COCO JSON polygons/RLEs to class maps with pycocotools.

    Stuff is painted first and things over it (the order of the official stuffthingmaps), each
    by decreasing area so small regions stay visible; unannotated pixels and categories outside
    ``category_to_class`` (183 'other') stay 255.
    """

    def __init__(self, cocos: list, category_to_class: dict[int, int]):
        self.cocos = cocos
        self.category_to_class = category_to_class

    def __call__(self, sample: Sample) -> np.ndarray:
        anns, height, width = [], None, None
        for coco in self.cocos:
            if sample.coco_id in coco.imgs:
                info = coco.imgs[sample.coco_id]
                height, width = info["height"], info["width"]
                anns += [(coco, a) for a in coco.imgToAnns.get(sample.coco_id, [])]
        label = np.full((height, width), IGNORE_INDEX, dtype=np.uint8)
        # things (id < 92) after stuff; within each, large before small
        anns.sort(key=lambda ca: (ca[1]["category_id"] < 92, -float(ca[1].get("area", 0.0))))
        for coco, ann in anns:
            cls = self.category_to_class.get(ann["category_id"])
            if cls is None:
                continue
            label[coco.annToMask(ann).astype(bool)] = cls
        return label


def _lut(mapping: dict[int, int]) -> np.ndarray:
    lut = np.full(256, IGNORE_INDEX, dtype=np.uint8)
    for stored, cls in mapping.items():
        lut[stored] = cls
    return lut


# --------------------------------------------------------------------------------------------
# Dataset and collate


class SegmentationDataset(Dataset):
    """(image, label) pairs resized to the probe size; images ImageNet-normalised.

    With a ``feature_cache`` attached (an object with ``load(key) -> Tensor | None``), an item
    whose backbone features are cached returns them as ``features`` and its image is never
    decoded: later probe epochs then cost only label reading and the head.

    ``augment``: ``"none"``/``False``, ``"flip"``/``True`` (random horizontal flip of image and label) or
    ``"crop_flip"`` (a random resized crop of the original image, ``CROP_SCALE`` of its area and
    ``CROP_RATIO`` aspect, stretched to ``image_size``, then the random flip).
    """

    def __init__(self, samples: list[Sample], label_reader, image_size=518, resize_mode: str = "stretch",
                 augment: bool | str = False, name: str = "dataset"):
        if not samples:
            raise ValueError(f"{name}: no samples")
        if resize_mode not in ("stretch", "crop"):
            raise ValueError(f"resize_mode must be 'stretch' or 'crop', got {resize_mode!r}")
        self.samples = list(samples)
        self.label_reader = label_reader
        self.image_size = _output_hw(image_size)
        self.resize_mode = resize_mode
        self.augmentation = _augmentation(augment)
        self.name = name
        self.feature_cache = None

    @property
    def cache_tag(self) -> str:
        """Everything about the preprocessing that changes the features (not the backbone)."""
        h, w = self.image_size
        return f"{self.name}-{h}x{w}-{self.resize_mode}"

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        sample = self.samples[index]
        label = torch.from_numpy(self.label_reader(sample)).long()
        item = {"image_id": sample.image_id, "cache_key": f"{self.cache_tag}/{sample.image_id}"}
        features = self.feature_cache.load(item["cache_key"]) if self.feature_cache is not None else None
        flip = self.augmentation != "none" and random.random() < 0.5
        resize_mode = self.resize_mode
        if features is None:
            # Benchmark photos keep their stored values: a grayscale JPEG is not contrast-stretched.
            image = load_image(sample.image, intensity="dtype")
            if tuple(image.shape[-2:]) != tuple(label.shape):
                raise ValueError(f"image {sample.image} is {tuple(image.shape[-2:])} px but its label "
                                 f"{sample.label or 'annotation'} is {tuple(label.shape)} px")
            if self.augmentation == "crop_flip":
                from torchvision.transforms import RandomResizedCrop

                top, left, h, w = RandomResizedCrop.get_params(image, list(CROP_SCALE), list(CROP_RATIO))
                image, label = image[..., top:top + h, left:left + w], label[top:top + h, left:left + w]
                resize_mode = "stretch"  # the crop has already drawn the aspect ratio
            image = normalize(_resize(image, self.image_size, "bilinear", resize_mode))
            item["image"] = image.flip(-1) if flip else image
        else:
            item["features"] = features
        label = _resize(label[None].float(), self.image_size, "nearest-exact", resize_mode)[0].long()
        item["label"] = label.flip(-1) if flip else label
        return item


def collate_segmentation(items: list[dict]) -> dict:
    """Stack a batch; images and cached features may be mixed, with their positions in the batch."""
    batch = {
        "label": torch.stack([it["label"] for it in items]),
        "image_id": [it["image_id"] for it in items],
        "cache_key": [it["cache_key"] for it in items],
    }
    for key in ("image", "features"):
        where = [i for i, it in enumerate(items) if key in it]
        if where:
            batch[key] = torch.stack([items[i][key] for i in where])
            batch[f"{key}_index"] = torch.tensor(where, dtype=torch.long)
    return batch


class EpochSubsetSampler(DistributedSampler):
    """Each epoch, a fresh random draw of ``num_samples`` distinct indices, split over the processes.

    The draw of epoch ``e`` is a permutation seeded by ``seed + e``, cut to ``num_samples``, so
    every process draws the same subset (no communication needed) and a resumed run draws what
    the interrupted one would have; process ``rank`` of ``num_replicas`` takes every
    ``num_replicas``-th index of it, the draw padded by wrapping round to equal shares like
    ``DistributedSampler``. Lightning calls ``set_epoch`` at every epoch and, because this *is*
    a ``DistributedSampler``, leaves it in place under DDP instead of wrapping it.
    """

    option = "train_samples_per_epoch"  # the datamodule option that sets num_samples, for its error message

    def __init__(self, dataset, num_samples: int, seed: int = 0, num_replicas: int | None = None,
                 rank: int | None = None):
        if num_replicas is None or rank is None:
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            num_replicas = num_replicas if num_replicas is not None else (
                torch.distributed.get_world_size() if distributed else 1)
            rank = rank if rank is not None else (torch.distributed.get_rank() if distributed else 0)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        if not 0 < num_samples <= len(dataset):
            raise ValueError(f"{self.option}={num_samples} must be between 1 and the {len(dataset)} "
                             "training images (null: every image once per epoch)")
        self.subset_size = num_samples
        self.num_samples = math.ceil(num_samples / num_replicas)  # per process, what __len__ reports
        self.total_size = self.num_samples * num_replicas

    def epoch_indices(self) -> list[int]:
        """This epoch's draw, the same in every process (before it is split between them)."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.dataset), generator=generator)[:self.subset_size].tolist()

    def __iter__(self):
        indices = self.epoch_indices()
        indices += indices[:self.total_size - len(indices)]  # equal shares for every process
        return iter(indices[self.rank:self.total_size:self.num_replicas])


# --------------------------------------------------------------------------------------------
# Datamodules


def _require(paths: dict[str, Path], dataset: str, layout: str) -> None:
    missing = [f"{what}: {p}" for what, p in paths.items() if not p.exists()]
    if missing:
        raise DatasetLayoutError(f"{dataset}: missing " + "; ".join(missing) + f"\nexpected layout:\n{layout}")


def _check_files(samples: list[Sample], dataset: str, split: str) -> None:
    missing = [str(p) for s in samples for p in (s.image, s.label) if p is not None and not p.is_file()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DatasetLayoutError(f"{dataset} {split}: {len(missing)} listed files do not exist: {shown}")


class SegmentationDataModule(L.LightningDataModule):
    """Shared loading for the segmentation datasets; subclasses say where the files are.

    Args:
        root: dataset root folder (layouts in this module's docstring).
        image_size: probe input size in px (int or [H, W]); a multiple of the backbone's patch size.
        resize_mode: ``stretch`` (whole image to the square; default) or ``crop`` (shortest side, centre crop).
        batch_size: training batch size; ``val_batch_size`` defaults to it.
        num_workers: loader worker processes.
        augment: training augmentation, never at validation: ``false``/``none`` (default; the
            paper's probes), ``true``/``flip`` (random horizontal flips) or ``crop_flip`` (random
            resized crop, 25–100 % of the area, aspect 3/4–4/3, then a random flip). Any
            augmentation is incompatible with a feature cache.
        train_samples_per_epoch: draw this many distinct training images at random for each epoch,
            a new draw every epoch (``EpochSubsetSampler``, seeded by ``sampler_seed`` + epoch, the
            same in every DDP process); default ``None``: every training image once per epoch.
        sampler_seed: seed of those draws.
    """

    num_classes: int
    class_names: tuple[str, ...]
    name: str

    def __init__(self, root: str, image_size: int | list[int] = 518, resize_mode: str = "stretch",
                 batch_size: int = 64, val_batch_size: int | None = None, num_workers: int = 8,
                 augment: bool | Literal["none", "flip", "crop_flip"] = False, pin_memory: bool = True,
                 train_samples_per_epoch: int | None = None, sampler_seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        self.root = Path(root).expanduser()
        self.image_size = _output_hw(image_size)
        if resize_mode not in ("stretch", "crop"):
            raise ValueError(f"resize_mode must be 'stretch' or 'crop', got {resize_mode!r}")
        self.resize_mode = resize_mode
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = usable_workers(num_workers)
        self.augmentation = _augmentation(augment)  # "none", "flip" or "crop_flip"
        self.augment = self.augmentation != "none"  # whether training pairs are augmented at all
        self.pin_memory = pin_memory
        if train_samples_per_epoch is not None and train_samples_per_epoch < 1:
            raise ValueError(f"train_samples_per_epoch must be a positive number of images or null, "
                             f"got {train_samples_per_epoch}")
        self.train_samples_per_epoch = train_samples_per_epoch
        self.sampler_seed = sampler_seed
        self.feature_cache = None
        self.train_set: SegmentationDataset | None = None
        self.val_set: SegmentationDataset | None = None

    # subclasses: the samples of a split and how to read their labels
    def samples(self, split: str) -> list[Sample]:
        raise NotImplementedError

    def label_reader(self, split: str):
        raise NotImplementedError

    train_split = "train"
    val_split = "val"

    def make_dataset(self, split: str, train: bool) -> SegmentationDataset:
        samples = self.samples(split)
        _check_files(samples, self.name, split)
        return SegmentationDataset(samples, self.label_reader(split), self.image_size, self.resize_mode,
                                   augment=self.augmentation if train else "none", name=self.name)

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None:
            self.train_set = self.make_dataset(self.train_split, train=True)
        if self.val_set is None:
            self.val_set = self.make_dataset(self.val_split, train=False)
        if self.train_set is not None:
            shared = {s.image_id for s in self.train_set.samples} & {s.image_id for s in self.val_set.samples}
            if shared:
                raise ValueError(f"{self.name}: {len(shared)} validation images are also training images "
                                 f"(e.g. {sorted(shared)[0]}); validate on a held-out split")
        for dataset in (self.train_set, self.val_set):
            if dataset is not None:
                dataset.feature_cache = self.feature_cache

    def attach_feature_cache(self, cache) -> None:
        """Let loader workers read cached backbone features instead of decoding images.

        Cached features are of the unaugmented image, so a cache with random augmentation would
        train on features that do not match the (flipped) labels: refused.
        """
        if cache is not None and self.augment:
            raise ValueError("a feature cache needs augment=False: cached features are of the unaugmented "
                             "images and would not match randomly flipped labels")
        self.feature_cache = cache
        for dataset in (self.train_set, self.val_set):
            if dataset is not None:
                dataset.feature_cache = cache

    def _loader(self, dataset, batch_size: int, shuffle: bool, sampler=None) -> DataLoader:
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                          num_workers=self.num_workers,
                          collate_fn=collate_segmentation, pin_memory=self.pin_memory and torch.cuda.is_available(),
                          # probes run many short epochs: keep workers instead of re-forking them every epoch
                          persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            self.setup("fit")
        if self.train_samples_per_epoch is None:
            return self._loader(self.train_set, self.batch_size, shuffle=True)
        trainer = self.trainer  # set by Lightning; None when the datamodule is used on its own
        replicas = dict(num_replicas=trainer.world_size, rank=trainer.global_rank) if trainer is not None else {}
        sampler = EpochSubsetSampler(self.train_set, self.train_samples_per_epoch, seed=self.sampler_seed, **replicas)
        return self._loader(self.train_set, self.batch_size, shuffle=False, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        if self.val_set is None:
            self.setup("validate")
        return self._loader(self.val_set, self.val_batch_size, shuffle=False)

    # None of these datasets publishes test labels in the layouts above: test = validation split.
    test_dataloader = val_dataloader


class VOCSegmentation(SegmentationDataModule):
    """Pascal VOC 2007 or 2012 segmentation, 21 classes (background + 20), 255 = ignore.

    Args:
        year: 2007 or 2012.
        train_split / val_split: names of files in ``ImageSets/Segmentation`` (e.g. ``train_aug`` with
            ``label_dir=SegmentationClassAug`` for the SBD-augmented set).
        label_dir: folder of index PNGs next to ``JPEGImages``.
    """

    num_classes = len(VOC_CLASSES)
    class_names = VOC_CLASSES

    def __init__(self, root: str, year: int = 2012, train_split: str = "train", val_split: str = "val",
                 label_dir: str = "SegmentationClass", **kwargs):
        super().__init__(root, **kwargs)
        if year not in (2007, 2012):
            raise ValueError(f"year must be 2007 or 2012, got {year}")
        if train_split == val_split:
            raise ValueError(f"train_split and val_split are both {train_split!r}: validate on a held-out split")
        self.year, self.train_split, self.val_split, self.label_dir = year, train_split, val_split, label_dir
        self.name = f"voc{year}"

    @property
    def layout(self) -> str:
        return (f"  ROOT/VOCdevkit/VOC{self.year}/JPEGImages/<id>.jpg\n"
                f"  ROOT/VOCdevkit/VOC{self.year}/{self.label_dir}/<id>.png  "
                "(palette/greyscale index PNGs, 255 = ignore)\n"
                f"  ROOT/VOCdevkit/VOC{self.year}/ImageSets/Segmentation/{{{self.train_split},{self.val_split}}}.txt\n"
                f"(ROOT may also be the VOCdevkit or VOC{self.year} folder)")

    def voc_dir(self) -> Path:
        candidates = [self.root / "VOCdevkit" / f"VOC{self.year}", self.root / f"VOC{self.year}", self.root]
        for c in candidates:
            if (c / "JPEGImages").is_dir():
                return c
        raise DatasetLayoutError(f"Pascal VOC {self.year}: no JPEGImages folder in any of "
                                 + ", ".join(str(c) for c in candidates) + f"\nexpected layout:\n{self.layout}")

    def samples(self, split: str) -> list[Sample]:
        base = self.voc_dir()
        split_file = base / "ImageSets" / "Segmentation" / f"{split}.txt"
        _require({"split file": split_file, "label folder": base / self.label_dir},
                 f"Pascal VOC {self.year}", self.layout)
        ids = [line.split()[0] for line in split_file.read_text().splitlines() if line.strip()]
        if not ids:
            raise DatasetLayoutError(f"split file {split_file} lists no images")
        return [Sample(base / "JPEGImages" / f"{i}.jpg", base / self.label_dir / f"{i}.png", i) for i in ids]

    def label_reader(self, split: str):
        return PngLabels(num_classes=self.num_classes)  # stored values are already class indices, 255 = ignore


class ADE20KSegmentation(SegmentationDataModule):
    """ADE20K SceneParsing (ADEChallengeData2016), 150 classes; stored 0 ('other') is ignored.

    The paper's protocol (Tab. S2) trains on 1,000 randomly drawn training images per epoch:
    ``train_samples_per_epoch=1000``, as ``configs/probe_ade20k.yaml`` sets (the class default,
    ``None``, uses all 20,210 every epoch).
    """

    num_classes = len(ADE20K_CLASSES)
    class_names = ADE20K_CLASSES
    name = "ade20k"
    train_split = "training"
    val_split = "validation"
    layout = ("  ROOT/ADEChallengeData2016/images/{training,validation}/<id>.jpg\n"
              "  ROOT/ADEChallengeData2016/annotations/{training,validation}/<id>.png  (0 = other, 1..150 = classes)\n"
              "(ROOT may also be the ADEChallengeData2016 folder)")

    def __init__(self, root: str, batch_size: int = 32, **kwargs):
        super().__init__(root, batch_size=batch_size, **kwargs)

    def samples(self, split: str) -> list[Sample]:
        base = self.root / "ADEChallengeData2016"
        base = base if base.is_dir() or not (self.root / "images").is_dir() else self.root
        images, labels = base / "images" / split, base / "annotations" / split
        _require({"image folder": images, "annotation folder": labels}, f"ADE20K under {self.root}", self.layout)
        files = sorted(p for p in images.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        if not files:
            raise DatasetLayoutError(f"ADE20K: no images in {images}\nexpected layout:\n{self.layout}")
        return [Sample(p, labels / f"{p.stem}.png", p.stem) for p in files]

    def label_reader(self, split: str):
        return PngLabels(_lut({0: IGNORE_INDEX, **{k: k - 1 for k in range(1, 151)}}))


class COCOStuffSegmentation(SegmentationDataModule):
    """COCO-Stuff 164k, 171 classes (80 things then 91 stuff, in category-id order).

    Args:
        train_annotations / val_annotations: COCO JSON files (relative to ``root`` or absolute) to
            render labels from with pycocotools instead of the ``stuffthingmaps`` PNGs, e.g.
            ``[annotations/instances_val2017.json, annotations/stuff_val2017.json]``.
    """

    num_classes = len(COCO_STUFF_CLASSES)
    class_names = COCO_STUFF_CLASSES
    name = "cocostuff"
    train_split = "train2017"
    val_split = "val2017"
    layout = ("  ROOT/{train2017,val2017}/<id>.jpg\n"
              "  ROOT/stuffthingmaps_trainval2017/{train2017,val2017}/<id>.png  (COCO category id - 1, 255 = ignore)\n"
              "or COCO JSON files given as train_annotations/val_annotations")

    def __init__(self, root: str, train_annotations: list[str] | None = None,
                 val_annotations: list[str] | None = None, batch_size: int = 32, **kwargs):
        super().__init__(root, batch_size=batch_size, **kwargs)
        self.annotations = {self.train_split: train_annotations, self.val_split: val_annotations}
        self._cocos: dict[str, list] = {}
        self.category_to_class = {cid: i for i, cid in enumerate(COCO_STUFF_CATEGORY_IDS)}

    def _load_cocos(self, split: str) -> list:
        if split not in self._cocos:
            from pycocotools.coco import COCO

            cocos = []
            for f in self.annotations[split]:
                path = Path(f) if Path(f).is_absolute() else self.root / f
                _require({"annotation file": path}, f"COCO-Stuff {split}", self.layout)
                coco = COCO(str(path))
                unknown = sorted(set(coco.cats) - set(self.category_to_class) - {183})
                if unknown:
                    raise ValueError(f"{path}: categories {unknown} are not COCO-Stuff classes")
                cocos.append(coco)
            # instances alone (or stuff alone) would silently leave half of the 171 classes unlabelled
            missing = sorted(set(self.category_to_class) - {c for coco in cocos for c in coco.cats})
            if missing:
                raise ValueError(f"COCO-Stuff {split}: the annotation files {self.annotations[split]} define no "
                                 f"categories {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)} of 171); "
                                 "give both the instances_*.json (things) and the stuff_*.json (stuff) files")
            self._cocos[split] = cocos
        return self._cocos[split]

    def samples(self, split: str) -> list[Sample]:
        images = self.root / split
        if self.annotations[split]:
            _require({"image folder": images}, f"COCO-Stuff under {self.root}", self.layout)
            infos = {}
            for coco in self._load_cocos(split):
                infos.update({i: info["file_name"] for i, info in coco.imgs.items()})
            return [Sample(images / name, None, Path(name).stem, coco_id=i) for i, name in sorted(infos.items())]
        maps = self.root / "stuffthingmaps_trainval2017" / split
        _require({"image folder": images, "stuffthingmaps folder": maps}, f"COCO-Stuff under {self.root}", self.layout)
        files = sorted(maps.glob("*.png"))
        if not files:
            raise DatasetLayoutError(f"COCO-Stuff: no label PNGs in {maps}\nexpected layout:\n{self.layout}")
        return [Sample(images / f"{p.stem}.jpg", p, p.stem) for p in files]

    def label_reader(self, split: str):
        if self.annotations[split]:
            return CocoJsonLabels(self._load_cocos(split), self.category_to_class)
        # stuffthingmaps store category id - 1
        return PngLabels(_lut({cid - 1: cls for cid, cls in self.category_to_class.items()}))


# --------------------------------------------------------------------------------------------
# Synthetic data in the VOC layout (tests, benchmarks, smoke runs without the real dataset)


def voc_palette() -> list[int]:
    """The 256-entry Pascal VOC colour map (bit-interleaved class index), as PIL's flat RGB list."""
    palette = []
    for index in range(256):
        r = g = b = 0
        c = index
        for bit in range(8):
            r |= ((c >> 0) & 1) << (7 - bit)
            g |= ((c >> 1) & 1) << (7 - bit)
            b |= ((c >> 2) & 1) << (7 - bit)
            c >>= 3
        palette += [r, g, b]
    return palette


# class 0 = grey background; objects of class k get colour k (a colour→class task a linear probe can learn)
SYNTHETIC_COLOURS = ((0.5, 0.5, 0.5), (0.85, 0.15, 0.1), (0.15, 0.7, 0.2), (0.15, 0.25, 0.85), (0.9, 0.85, 0.15),
                     (0.7, 0.2, 0.8), (0.1, 0.75, 0.8))


def write_synthetic_voc(root, n_train: int = 8, n_val: int = 4, height=(41, 71), width=(43, 77),
                        n_classes: int = 4, year: int = 2012, seed: int = 0, border: int = 2) -> Path:
    """Write a small dataset in the exact VOC layout: JPEG images, palette-PNG labels, split files.

    Each image is textured grey background (class 0) with 1–3 rectangles whose colour gives
    their class (1..n_classes-1); like VOC, every object is outlined by a ``border``-px ring of
    255 (ignore). Image sizes are drawn from the ``height``/``width`` ranges (odd sizes welcome).
    Returns ``root``, ready for ``VOCSegmentation(root, year=year)``.
    """
    from PIL import Image

    if not 2 <= n_classes <= len(SYNTHETIC_COLOURS):
        raise ValueError(f"n_classes must be in 2..{len(SYNTHETIC_COLOURS)}, got {n_classes}")
    rng = np.random.default_rng(seed)
    base = Path(root) / "VOCdevkit" / f"VOC{year}"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    palette = voc_palette()
    ids = [f"{year}_{i:06d}" for i in range(n_train + n_val)]
    for image_id in ids:
        h, w = int(rng.integers(height[0], height[1] + 1)), int(rng.integers(width[0], width[1] + 1))
        label = np.zeros((h, w), dtype=np.uint8)
        for _ in range(int(rng.integers(1, 4))):
            cls = int(rng.integers(1, n_classes))
            rh, rw = int(rng.integers(h // 3, h // 2 + 1)), int(rng.integers(w // 3, w // 2 + 1))
            top, left = int(rng.integers(0, h - rh + 1)), int(rng.integers(0, w - rw + 1))
            t0, l0 = max(top - border, 0), max(left - border, 0)
            label[t0:top + rh + border, l0:left + rw + border] = IGNORE_INDEX
            label[top:top + rh, left:left + rw] = cls
        colours = np.array(SYNTHETIC_COLOURS, dtype=np.float32)[np.where(label == IGNORE_INDEX, 0, label)]
        # ignore rings are drawn as the surrounding object edge would be: blend of neighbours ≈ background
        image = colours + rng.normal(0.0, 0.08, size=colours.shape).astype(np.float32)
        Image.fromarray((image.clip(0, 1) * 255).round().astype(np.uint8)).save(
            base / "JPEGImages" / f"{image_id}.jpg", quality=95)
        mask = Image.fromarray(label, mode="P")
        mask.putpalette(palette)
        mask.save(base / "SegmentationClass" / f"{image_id}.png")
    split = base / "ImageSets" / "Segmentation"
    (split / "train.txt").write_text("".join(f"{i}\n" for i in ids[:n_train]))
    (split / "val.txt").write_text("".join(f"{i}\n" for i in ids[n_train:]))
    return Path(root)
