"""Training data of RASA post-training (docs/method.md §8), as the RASA reference feeds it.

The reference trains the position head on Pascal VOC 2012 ``train`` (1,464 images; Franca's RASA:
``trainaug``) with random resized crops (518 px, 25–100 % of the area), colour jitter, grayscale,
blur, horizontal and vertical flips and 90° rotations, batch 32, 12 epochs per round: 45 steps
per epoch (the last partial batch dropped), 540 steps per round. Augmentation matters: with
centre crops of photos the head can learn photo-layout priors (sky at the top) instead of
position, and removing its plane then removes semantic directions too.

:class:`RASADataModule` gives that by default (``dataset="voc"``); ``dataset="coco"`` trains on COCO
``train2017`` images and ``dataset="folder"`` on any image folder, both with
``samples_per_epoch`` (default for them: 1,464, so an epoch is 45 steps as with VOC train) fresh
random images per epoch. Training batches are image tensors (B, 3, S, S); validation batches are
VOC segmentation batches (``image``, ``label``, …) of ``val_split`` at ``image_size`` (stretched,
no augmentation), so :class:`lit_modules.rasa.RASAModule` can score OverClustering on them; with
no VOC validation root (COCO or folder without ``val_root``) there is no validation.

Augmentations are seeded per sample: the sampler draws, for every epoch, the order of the images
and one seed per sample from ``seed + epoch``; a sample's transforms are drawn from its seed
alone. The batches of a run therefore depend only on ``seed`` (not on worker count or timing), and
a test can find which step holds which transform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from alibi_vit.images import IntensityMode, check_intensity, list_images, load_image, normalize

from . import DatasetLayoutError, usable_workers
from .segmentation import EpochSubsetSampler

__all__ = ["RASA_VOC_TRAIN_IMAGES", "AugmentedImageDataset", "RASAAugmentation", "RASADataModule", "SeededSampler"]

RASA_VOC_TRAIN_IMAGES = 1464  # VOC12 train: 45 batches of 32 per epoch, 540 steps in 12 epochs


class RASAAugmentation:
    """The reference's training transform of one image (3, H, W) in [0, 1] → normalised (3, S, S).

    In order: random resized crop (``crop_scale`` of the area, aspect 3/4–4/3, bilinear antialiased
    to S×S; ``crop_scale=(1, 1)`` with a square image keeps it whole), colour jitter (brightness 0.4,
    contrast 0.4, saturation 0.2, hue 0.1, p 0.8), grayscale (p 0.2), Gaussian blur (p 0.5, σ
    0.1–2), horizontal flip (p 0.5), vertical flip (p 0.5), rotation by k·90° (k uniform in 0..3),
    ImageNet normalisation. ``colour``, ``flips`` and ``rotations`` switch groups off.
    All random draws come from ``seed`` (torch's RNG forked and seeded inside the call).
    """

    def __init__(self, size: int = 518, crop_scale: Sequence[float] = (0.25, 1.0), colour: bool = True,
                 flips: bool = True, rotations: bool = True):
        size = int(size)
        if size < 1:
            raise ValueError(f"image_size must be positive, got {size}")
        lo, hi = (float(s) for s in crop_scale)
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must be (low, high) with 0 < low <= high <= 1, got {tuple(crop_scale)}")
        self.size, self.crop_scale = size, (lo, hi)
        self.colour, self.flips, self.rotations = bool(colour), bool(flips), bool(rotations)

    def __call__(self, image: torch.Tensor, seed: int) -> torch.Tensor:
        import torchvision.transforms as T
        import torchvision.transforms.functional as TF

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            top, left, h, w = T.RandomResizedCrop.get_params(image, list(self.crop_scale), [3 / 4, 4 / 3])
            out = TF.resized_crop(image, top, left, h, w, [self.size, self.size], antialias=True).clamp(0, 1)
            if self.colour:
                out = T.RandomApply([T.ColorJitter(0.4, 0.4, 0.2, 0.1)], p=0.8)(out)
                out = T.RandomGrayscale(p=0.2)(out)
                out = T.RandomApply([T.GaussianBlur(9, sigma=(0.1, 2.0))], p=0.5)(out)
            if self.flips:
                if torch.rand(()) < 0.5:
                    out = out.flip(-1)
                if torch.rand(()) < 0.5:
                    out = out.flip(-2)
            if self.rotations:
                out = torch.rot90(out, int(torch.randint(0, 4, ())), dims=(-2, -1))
        return normalize(out.contiguous())


class AugmentedImageDataset(Dataset):
    """Image files, each read on access and augmented by ``transform(image, seed)``.

    Items are requested as ``(index, seed)`` pairs (from :class:`SeededSampler`); a plain index uses
    the index as the seed.
    """

    def __init__(self, files: Sequence, transform: RASAAugmentation, intensity: IntensityMode = "dtype"):
        self.files = [Path(f) for f in files]
        if not self.files:
            raise ValueError("RASA training needs at least one image")
        self.transform = transform
        self.intensity = check_intensity(intensity)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, item) -> torch.Tensor:
        index, seed = item if isinstance(item, tuple) else (item, item)
        return self.transform(load_image(self.files[index], self.intensity), seed)


class SeededSampler(EpochSubsetSampler):
    """Each epoch: ``num_samples`` images (all, shuffled, by default; else a fresh random draw of distinct
    images) with one augmentation seed each, both drawn from ``seed + epoch``; split over processes like
    :class:`~datamodules.segmentation.EpochSubsetSampler`. Yields ``(index, sample_seed)`` pairs."""

    option = "samples_per_epoch"

    def __init__(self, dataset, num_samples: Optional[int] = None, seed: int = 0, num_replicas: int | None = None,
                 rank: int | None = None):
        super().__init__(dataset, len(dataset) if num_samples is None else int(num_samples), seed, num_replicas, rank)

    def epoch_indices(self) -> list[tuple[int, int]]:
        """This epoch's (index, sample seed) pairs, the same in every process."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=g)[:self.subset_size].tolist()
        seeds = torch.randint(0, 2**31 - 1, (self.subset_size,), generator=g).tolist()
        return list(zip(order, seeds))


class RASADataModule(L.LightningDataModule):
    """RASA's training images, augmented as the reference does, and VOC validation batches.

    Args:
        root: the VOC root (``dataset="voc"``: the folder holding VOCdevkit/VOC2012, or that folder),
            COCO root (``coco``: holds ``train2017/``) or an image folder (``folder``, searched recursively).
        dataset: ``voc`` (default, the reference), ``coco`` or ``folder``.
        year, train_split: VOC year and the ImageSets/Segmentation list of training images (``train``:
            1,464 images; ``train_aug``/``trainaug`` with ``label_dir`` for Franca's set).
        val_split: VOC list of validation images (default ``val``); ``val_root``: the VOC root for
            validation when ``root`` is not VOC (default: ``root`` for VOC, none otherwise).
        coco_split: COCO image folder (default ``train2017``).
        image_size: crop size in px (518; a multiple of the patch size).
        batch_size: global batch (32); the last partial batch of an epoch is dropped (VOC train: 45 steps).
        samples_per_epoch: images per epoch; default: every training image for VOC, 1,464 for COCO and
            folders (the reference's 45 steps per epoch at batch 32).
        crop_scale, colour, flips, rotations: the augmentation (:class:`RASAAugmentation`).
        seed: seeds the image order and every augmentation.
    """

    def __init__(self, root: str, dataset: Literal["voc", "coco", "folder"] = "voc", year: int = 2012,
                 train_split: str = "train", val_split: Optional[str] = "val", label_dir: str = "SegmentationClass",
                 val_root: Optional[str] = None, coco_split: str = "train2017", image_size: int = 518,
                 batch_size: int = 32, val_batch_size: Optional[int] = None, num_workers: int = 8,
                 samples_per_epoch: Optional[int] = None, crop_scale: tuple[float, float] = (0.25, 1.0),
                 colour: bool = True, flips: bool = True, rotations: bool = True, seed: int = 0,
                 intensity: IntensityMode = "dtype", pin_memory: bool = True):
        super().__init__()
        self.save_hyperparameters()
        if dataset not in ("voc", "coco", "folder"):
            raise ValueError(f"dataset must be voc, coco or folder, got {dataset!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.root = Path(root).expanduser()
        self.dataset = dataset
        self.year, self.train_split, self.val_split, self.label_dir = year, train_split, val_split, label_dir
        self.val_root = val_root if val_root is not None else (str(self.root) if dataset == "voc" else None)
        self.coco_split = coco_split
        self.image_size = int(image_size)
        self.batch_size = int(batch_size)
        self.val_batch_size = int(val_batch_size or batch_size)
        self.num_workers = usable_workers(num_workers)
        self.samples_per_epoch = samples_per_epoch if samples_per_epoch is not None or dataset == "voc" \
            else RASA_VOC_TRAIN_IMAGES
        self.augmentation = RASAAugmentation(image_size, crop_scale, colour, flips, rotations)
        self.seed = int(seed)
        self.intensity = check_intensity(intensity)
        self.pin_memory = pin_memory
        self.train_set: AugmentedImageDataset | None = None
        self._voc_val = None

    def _voc(self, root) -> "VOCSegmentation":  # noqa: F821
        from .segmentation import VOCSegmentation

        val = self.val_split or "val"
        train = self.train_split if self.train_split != val else "train"
        return VOCSegmentation(str(root), year=self.year, train_split=train, val_split=val,
                               label_dir=self.label_dir, image_size=self.image_size, batch_size=self.val_batch_size,
                               num_workers=self.num_workers, pin_memory=self.pin_memory)

    def train_files(self) -> list[Path]:
        if self.dataset == "voc":
            return [s.image for s in self._voc(self.root).samples(self.train_split)]
        if self.dataset == "coco":
            folder = self.root / self.coco_split
            if not folder.is_dir():
                raise DatasetLayoutError(f"COCO image folder {folder} does not exist (set --data.root to the folder "
                                         f"holding {self.coco_split}/)")
            return list_images(folder, recursive=False)
        return list_images(self.root)

    def setup(self, stage: Optional[str] = None) -> None:
        if stage in (None, "fit") and self.train_set is None:
            files = self.train_files()
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise DatasetLayoutError(f"{len(missing)} listed training images do not exist, e.g. {missing[0]}")
            self.train_set = AugmentedImageDataset(files, self.augmentation, self.intensity)
            if self.samples_per_epoch is not None and not 0 < self.samples_per_epoch <= len(files):
                raise ValueError(f"samples_per_epoch={self.samples_per_epoch} must be between 1 and the {len(files)} "
                                 "training images")
            if min(self.samples_per_epoch or len(files), len(files)) < self.batch_size:
                raise ValueError(f"an epoch of {self.samples_per_epoch or len(files)} images holds no full batch of "
                                 f"{self.batch_size} (the last partial batch is dropped)")
        if self.val_root is not None and self.val_split is not None and self._voc_val is None:
            self._voc_val = self._voc(self.val_root)
            self._voc_val.setup("validate")

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            self.setup("fit")
        trainer = self.trainer  # None when the datamodule is used on its own
        replicas = dict(num_replicas=trainer.world_size, rank=trainer.global_rank) if trainer is not None else {}
        sampler = SeededSampler(self.train_set, self.samples_per_epoch, seed=self.seed, **replicas)
        per_process = max(1, self.batch_size // sampler.num_replicas)
        return DataLoader(self.train_set, batch_size=per_process, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers, pin_memory=self.pin_memory and torch.cuda.is_available(),
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self):
        if self.val_root is None or self.val_split is None:
            return []
        if self._voc_val is None:
            self.setup("validate")
        return self._voc_val.val_dataloader()
