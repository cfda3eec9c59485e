"""Training data of RASA post-training (docs/method.md §8), as the RASA reference feeds it.

The reference (``RobvanGastel/removing-pos-vit-bias``) trains the position head on Pascal VOC 2012
``train`` (1,464 images; Franca's RASA: ``trainaug``) in list order, not shuffled, batch 32 with the
last partial batch kept (46 steps per epoch, 552 per round of 12 epochs), each image augmented by
albumentations: a random resized crop (518 px, 25–100 % of the area, aspect 3/4–4/3), colour
jitter (brightness, contrast, saturation 0.32, hue 0.08, p 0.8: its jitter strength 0.4 times 0.8
and 0.2), grayscale (p 0.2), Gaussian blur (p 0.5, odd kernel 3–7, σ 0.1–2), horizontal and vertical
flips (p 0.5 each), ``RandomRotate90(p=0.5)`` (a multiple of 90° drawn from 0–3 half of the time, so
62.5 % of the images stay unrotated) and normalisation with std (0.229, 0.224, 0.255) — blue 0.255,
where its validation and ImageNet use 0.225. It validates on VOC val resized to 224 px. Augmentation
matters: with centre crops of photos the head can learn photo-layout priors (sky at the top)
instead of position, and removing its plane then removes semantic directions too.

:class:`RASADataModule` gives that by default (``dataset="voc"``); every difference from it is an
option (``shuffle``, ``drop_last``, ``jitter``, ``blur_kernel``, ``rotation_p``, ``std``, …). What
remains different: torchvision's transforms replace albumentations' (antialiased resizing, its own
colour-jitter arithmetic), and the 224-px validation labels are resized with ``nearest-exact``
(pixel centres) where the reference's OpenCV ``nearest`` rounds down. ``dataset="coco"`` trains on
COCO ``train2017`` images and ``dataset="folder"`` on any image folder, both with
``samples_per_epoch`` (default for them: 1,464) fresh random images per epoch. Training batches are
image tensors (B, 3, S, S); validation batches are VOC segmentation batches (``image``, ``label``,
…) of ``val_split`` at ``val_image_size`` (stretched, no augmentation), so
:class:`lit_modules.rasa.RASAModule` can score OverClustering on them; with no VOC validation root
(COCO or folder without ``val_root``) there is no validation.

Augmentations are seeded per sample: the sampler draws, for every epoch, the order of the images
(list order when not shuffled) and one seed per sample from ``seed + epoch``; a sample's transforms
are drawn from its seed alone. The batches of a run therefore depend only on ``seed`` (not on worker
count or timing), and a test can find which step holds which transform.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from alibi_vit.images import IMAGENET_MEAN, IntensityMode, check_intensity, list_images, load_image

from . import DatasetLayoutError, usable_workers
from .segmentation import EpochSubsetSampler

__all__ = ["RASA_VOC_TRAIN_IMAGES", "REFERENCE_BLUR_KERNEL", "REFERENCE_JITTER", "REFERENCE_TRAIN_STD",
           "AugmentedImageDataset", "RASAAugmentation", "RASADataModule", "SeededSampler"]

RASA_VOC_TRAIN_IMAGES = 1464  # VOC12 train: 46 batches of 32 per epoch (the last of 24), 552 steps in 12 epochs
REFERENCE_JITTER = (0.32, 0.32, 0.32, 0.08)  # brightness, contrast, saturation, hue: 0.8·0.4 ×3 and 0.2·0.4
REFERENCE_BLUR_KERNEL = (3, 7)  # odd Gaussian kernel sizes drawn from this range, σ from 0.1–2
REFERENCE_TRAIN_STD = (0.229, 0.224, 0.255)  # the reference's training normalisation (ImageNet's blue std: 0.225)


class RASAAugmentation:
    """The reference's training transform of one image (3, H, W) in [0, 1] → normalised (3, S, S).

    In order: random resized crop (``crop_scale`` of the area, aspect 3/4–4/3, bilinear antialiased
    to S×S; ``crop_scale=(1, 1)`` with a square image keeps it whole), colour jitter (``jitter``:
    brightness, contrast, saturation, hue; p 0.8), grayscale (p 0.2), Gaussian blur (p 0.5, an odd
    kernel size drawn from ``blur_kernel``, σ 0.1–2), horizontal flip (p 0.5), vertical flip (p 0.5),
    with probability ``rotation_p`` a rotation by k·90°, k uniform in 0..3, then normalisation with
    the ImageNet mean and ``std``. ``colour``, ``flips`` and ``rotations`` switch groups off.
    All random draws come from ``seed`` (torch's RNG forked and seeded inside the call).
    """

    def __init__(self, size: int = 518, crop_scale: Sequence[float] = (0.25, 1.0), colour: bool = True,
                 flips: bool = True, rotations: bool = True, jitter: Sequence[float] = REFERENCE_JITTER,
                 blur_kernel: Sequence[int] = REFERENCE_BLUR_KERNEL, rotation_p: float = 0.5,
                 std: Sequence[float] = REFERENCE_TRAIN_STD):
        size = int(size)
        if size < 1:
            raise ValueError(f"image_size must be positive, got {size}")
        lo, hi = (float(s) for s in crop_scale)
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must be (low, high) with 0 < low <= high <= 1, got {tuple(crop_scale)}")
        if len(jitter) != 4 or min(jitter) < 0 or jitter[3] > 0.5:
            raise ValueError(f"jitter must be (brightness, contrast, saturation, hue) >= 0 with hue <= 0.5, got "
                             f"{tuple(jitter)}")
        k_lo, k_hi = (int(k) for k in blur_kernel)
        if not (k_lo % 2 and k_hi % 2 and 1 <= k_lo <= k_hi):
            raise ValueError(f"blur_kernel must be (low, high) odd sizes with low <= high, got {tuple(blur_kernel)}")
        if not 0 <= rotation_p <= 1:
            raise ValueError(f"rotation_p must be a probability, got {rotation_p}")
        if len(std) != 3 or min(std) <= 0:
            raise ValueError(f"std must be three positive numbers, got {tuple(std)}")
        self.size, self.crop_scale = size, (lo, hi)
        self.colour, self.flips, self.rotations = bool(colour), bool(flips), bool(rotations)
        self.jitter, self.blur_kernel = tuple(float(j) for j in jitter), (k_lo, k_hi)
        self.rotation_p, self.std = float(rotation_p), tuple(float(v) for v in std)

    def __call__(self, image: torch.Tensor, seed: int) -> torch.Tensor:
        import torchvision.transforms as T
        import torchvision.transforms.functional as TF

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            top, left, h, w = T.RandomResizedCrop.get_params(image, list(self.crop_scale), [3 / 4, 4 / 3])
            out = TF.resized_crop(image, top, left, h, w, [self.size, self.size], antialias=True).clamp(0, 1)
            if self.colour:
                out = T.RandomApply([T.ColorJitter(*self.jitter)], p=0.8)(out)
                out = T.RandomGrayscale(p=0.2)(out)
                if torch.rand(()) < 0.5:
                    kernel = 2 * int(torch.randint(self.blur_kernel[0] // 2, self.blur_kernel[1] // 2 + 1, ())) + 1
                    sigma = float(torch.empty(()).uniform_(0.1, 2.0))
                    out = TF.gaussian_blur(out, [kernel, kernel], [sigma, sigma])
            if self.flips:
                if torch.rand(()) < 0.5:
                    out = out.flip(-1)
                if torch.rand(()) < 0.5:
                    out = out.flip(-2)
            if self.rotations and torch.rand(()) < self.rotation_p:
                out = torch.rot90(out, int(torch.randint(0, 4, ())), dims=(-2, -1))
        return TF.normalize(out.contiguous(), list(IMAGENET_MEAN), list(self.std))


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
    """Each epoch: ``num_samples`` images (by default all) with one augmentation seed each, both drawn from
    ``seed + epoch``: a fresh random draw of distinct images in random order, or with ``shuffle=False`` the
    first ``num_samples`` in list order (the reference's loader). Split over processes like
    :class:`~datamodules.segmentation.EpochSubsetSampler`. Yields ``(index, sample_seed)`` pairs."""

    option = "samples_per_epoch"

    def __init__(self, dataset, num_samples: Optional[int] = None, seed: int = 0, num_replicas: int | None = None,
                 rank: int | None = None, shuffle: bool = True):
        super().__init__(dataset, len(dataset) if num_samples is None else int(num_samples), seed, num_replicas, rank)
        self.shuffle = bool(shuffle)

    def epoch_indices(self) -> list[tuple[int, int]]:
        """This epoch's (index, sample seed) pairs, the same in every process."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = (torch.randperm(len(self.dataset), generator=g) if self.shuffle
                 else torch.arange(len(self.dataset)))[:self.subset_size].tolist()
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
        val_image_size: validation images and labels are resized to this (224, the reference's).
        batch_size: global batch (32).
        shuffle: draw the images of an epoch in random order (default: no for VOC, as the reference; yes
            for COCO and folders, whose epochs are random subsets).
        drop_last: drop an epoch's last partial batch (default no, as the reference: 46 steps per epoch on
            VOC train, the last of 24 images; yes: 45).
        samples_per_epoch: images per epoch; default: every training image for VOC, 1,464 for COCO and
            folders (the reference's epoch).
        crop_scale, colour, flips, rotations, jitter, blur_kernel, rotation_p, std: the augmentation
            (:class:`RASAAugmentation`; defaults: the reference's).
        seed: seeds the image order and every augmentation.
    """

    def __init__(self, root: str, dataset: Literal["voc", "coco", "folder"] = "voc", year: int = 2012,
                 train_split: str = "train", val_split: Optional[str] = "val", label_dir: str = "SegmentationClass",
                 val_root: Optional[str] = None, coco_split: str = "train2017", image_size: int = 518,
                 val_image_size: int = 224, batch_size: int = 32, val_batch_size: Optional[int] = None,
                 num_workers: int = 8, shuffle: Optional[bool] = None, drop_last: bool = False,
                 samples_per_epoch: Optional[int] = None, crop_scale: tuple[float, float] = (0.25, 1.0),
                 colour: bool = True, flips: bool = True, rotations: bool = True,
                 jitter: tuple[float, float, float, float] = REFERENCE_JITTER,
                 blur_kernel: tuple[int, int] = REFERENCE_BLUR_KERNEL, rotation_p: float = 0.5,
                 std: tuple[float, float, float] = REFERENCE_TRAIN_STD, seed: int = 0,
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
        self.val_image_size = int(val_image_size)
        self.batch_size = int(batch_size)
        self.val_batch_size = int(val_batch_size or batch_size)
        self.shuffle = dataset != "voc" if shuffle is None else bool(shuffle)
        self.drop_last = bool(drop_last)
        self.num_workers = usable_workers(num_workers)
        self.samples_per_epoch = samples_per_epoch if samples_per_epoch is not None or dataset == "voc" \
            else RASA_VOC_TRAIN_IMAGES
        self.augmentation = RASAAugmentation(image_size, crop_scale, colour, flips, rotations, jitter, blur_kernel,
                                             rotation_p, std)
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
                               label_dir=self.label_dir, image_size=self.val_image_size, batch_size=self.val_batch_size,
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
            if self.drop_last and min(self.samples_per_epoch or len(files), len(files)) < self.batch_size:
                raise ValueError(f"an epoch of {self.samples_per_epoch or len(files)} images holds no full batch of "
                                 f"{self.batch_size} (drop_last drops the last partial batch)")
        if self.val_root is not None and self.val_split is not None and self._voc_val is None:
            self._voc_val = self._voc(self.val_root)
            self._voc_val.setup("validate")

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            self.setup("fit")
        trainer = self.trainer  # None when the datamodule is used on its own
        replicas = dict(num_replicas=trainer.world_size, rank=trainer.global_rank) if trainer is not None else {}
        sampler = SeededSampler(self.train_set, self.samples_per_epoch, seed=self.seed, shuffle=self.shuffle,
                                **replicas)
        per_process = max(1, self.batch_size // sampler.num_replicas)
        return DataLoader(self.train_set, batch_size=per_process, sampler=sampler, drop_last=self.drop_last,
                          num_workers=self.num_workers, pin_memory=self.pin_memory and torch.cuda.is_available(),
                          persistent_workers=self.num_workers > 0)

    def val_dataloader(self):
        if self.val_root is None or self.val_split is None:
            return []
        if self._voc_val is None:
            self.setup("validate")
        return self._voc_val.val_dataloader()
