"""Unlabelled image DataModules for distillation: a folder of images, COCO, or scikit-image's bundled images.

Every sample is the DINOv2 preprocessing of one image: shortest side resized to the stage's
``image_size``, centre crop, ImageNet normalisation; no augmentation (docs/method.md §4).
Batches are plain tensors (B, 3, S, S). How pixel values become [0, 1] first is the
``intensity`` mode of :mod:`alibi_vit.images` (``auto``, ``dtype``, ``minmax``, ``percentile``).

``batch_size`` is the *global* batch: each of the ``world_size`` processes loads
``batch_size // world_size`` images, so one config gives the same optimisation on 1 or 8 GPUs.
The training sampler is a seeded ``DistributedSampler`` even on one process: its permutation
depends only on the seed and the epoch, so rank r of N sees ``perm[r::N]`` and the N local
batches of a step together hold exactly the images of the single-process batch.

The training loader is resumable: a checkpoint records the sampler's epoch and how many
batches of it were trained, and a resumed run continues with the next batch of the same
permutation instead of starting the epoch's data over (what a SLURM requeue mid-epoch needs).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from alibi_vit.images import (BUNDLED_SETS, ImageReadError, IntensityMode, bundled_images, check_intensity,
                              list_images, load_image, normalize, resize_center_crop)

from . import DatasetLayoutError, usable_workers

__all__ = ["BundledImagesDataModule", "CocoImagesDataModule", "ImageFileDataset", "ImageFolderDataModule",
           "ResumableDataLoader", "ResumableSampler", "TensorImageDataset"]

log = logging.getLogger(__name__)


class ImageFileDataset(Dataset):
    """Images read from files on access, preprocessed to ``image_size``.

    Readability is checked lazily, in ``__getitem__``: scanning 100k files up front would
    delay every (re)start. With ``skip_unreadable`` an unreadable file is logged (once per
    worker) and replaced by the next readable file in the list, so batches keep their size and
    DDP ranks stay in step; otherwise it raises :class:`ImageReadError` naming the file.
    ``intensity`` is the mode of :func:`alibi_vit.images.load_image` (default ``"auto"``).
    """

    def __init__(self, files: Sequence, image_size: int, skip_unreadable: bool = False,
                 intensity: IntensityMode = "auto"):
        self.files = [Path(f) for f in files]
        if not self.files:
            raise ValueError("an image dataset needs at least one file")
        self.image_size = int(image_size)
        self.skip_unreadable = bool(skip_unreadable)
        self.intensity = check_intensity(intensity)
        self._unreadable: set[Path] = set()

    def __len__(self) -> int:
        return len(self.files)

    def _load(self, path: Path) -> torch.Tensor:
        return normalize(resize_center_crop(load_image(path, self.intensity), self.image_size))

    def __getitem__(self, index: int) -> torch.Tensor:
        if not self.skip_unreadable:
            return self._load(self.files[index])
        n = len(self.files)
        for offset in range(n):
            path = self.files[(index + offset) % n]
            if path in self._unreadable:
                continue
            try:
                return self._load(path)
            except ImageReadError as err:
                self._unreadable.add(path)
                log.warning("skipping unreadable image: %s", err)
        raise ImageReadError(f"none of the {n} images is readable (first: {self.files[0]})")


class TensorImageDataset(Dataset):
    """Already preprocessed images held in memory, shape (N, 3, S, S)."""

    def __init__(self, images: torch.Tensor):
        self.images = images

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index]


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start one epoch part-way through its permutation."""

    def __init__(self, *args, batch_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_size = int(batch_size)
        self._resume: Optional[tuple[int, int]] = None  # (epoch, batches already trained in it)

    def resume_at(self, epoch: int, batches: int) -> None:
        self.set_epoch(epoch)
        self._resume = (int(epoch), max(0, int(batches)))

    def __iter__(self):
        indices = list(super().__iter__())
        if self._resume is not None and self._resume[0] == self.epoch:
            indices = indices[self._resume[1] * self.batch_size:]
        return iter(indices)


class ResumableDataLoader(DataLoader):
    """DataLoader whose position in the epoch is saved in Lightning checkpoints (``state_dict`` hooks).

    ``progress`` returns how many batches of the current epoch the trainer has processed; with a
    :class:`ResumableSampler` that is where a resumed run picks up.
    """

    def __init__(self, *args, progress=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._progress = progress

    def state_dict(self) -> dict:
        batches = self._progress() if self._progress is not None else 0
        return {"epoch": int(getattr(self.sampler, "epoch", 0)), "batches": int(batches)}

    def load_state_dict(self, state: dict) -> None:
        if isinstance(self.sampler, ResumableSampler):
            self.sampler.resume_at(state["epoch"], state["batches"])


class _ImageDataModule(LightningDataModule):
    """Loader logic shared by the image DataModules: global batch split over ranks, seeded sampler."""

    def __init__(self, image_size: int, batch_size: int, val_batch_size: Optional[int], num_workers: int,
                 shuffle: bool, seed: int, pin_memory: bool):
        super().__init__()
        if image_size <= 0 or batch_size <= 0:
            raise ValueError(f"image_size and batch_size must be positive, got {image_size} and {batch_size}")
        self.image_size = int(image_size)
        self.batch_size = int(batch_size)
        self.val_batch_size = int(val_batch_size or batch_size)
        self.num_workers = usable_workers(num_workers)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.pin_memory = bool(pin_memory)
        self.train_set: Optional[Dataset] = None
        self.val_set: Optional[Dataset] = None

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 1, 0
        return trainer.world_size, trainer.global_rank

    def _per_device(self, global_batch: int, what: str) -> int:
        world, _ = self._world()
        if global_batch % world:
            raise ValueError(f"{what} {global_batch} is the global batch and must divide evenly over "
                             f"{world} processes (num_nodes × devices)")
        return global_batch // world

    def _loader_kwargs(self) -> dict:
        return dict(num_workers=self.num_workers, pin_memory=self.pin_memory and torch.cuda.is_available(),
                    persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            self.setup("fit")
        world, rank = self._world()
        per_device = self._per_device(self.batch_size, "batch_size")
        if len(self.train_set) < self.batch_size:
            raise ValueError(f"the training set has {len(self.train_set)} images, fewer than one global batch "
                             f"of {self.batch_size}")
        sampler = ResumableSampler(self.train_set, num_replicas=world, rank=rank, shuffle=self.shuffle,
                                   seed=self.seed, drop_last=True, batch_size=per_device)
        return ResumableDataLoader(self.train_set, batch_size=per_device, sampler=sampler, drop_last=True,
                                   progress=self._batches_done, **self._loader_kwargs())

    def _batches_done(self) -> int:
        # Batches whose training step finished in the current epoch: the count Lightning's own
        # epoch loop resumes from (saves in on_train_batch_end already include the batch).
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)

    def val_dataloader(self):
        if self.train_set is None:
            self.setup("fit")
        if self.val_set is None:
            return []  # no validation data: Lightning skips validation (and the probes with it)
        per_device = self._per_device(self.val_batch_size, "val_batch_size")
        return DataLoader(self.val_set, batch_size=per_device, shuffle=False, **self._loader_kwargs())


def _split(files: list, fraction: float, seed: int) -> tuple[list, list]:
    """Deterministic train/val split of a file list: ``fraction`` of it (at least one file) for validation."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return files, []
    n_val = max(1, round(fraction * len(files)))
    if n_val >= len(files):
        raise ValueError(f"val_fraction={fraction} of {len(files)} images leaves none for training")
    order = np.random.default_rng(seed).permutation(len(files))
    val_idx = set(order[:n_val].tolist())
    return ([f for i, f in enumerate(files) if i not in val_idx], [f for i, f in enumerate(files) if i in val_idx])


class ImageFolderDataModule(_ImageDataModule):
    """Any folder of PNG/JPEG/TIFF images (8/16-bit, grayscale or RGB; micrographs included).

    Args:
        train_dir: folder of training images (searched recursively unless ``recursive=False``).
        val_dir: folder of validation images; if absent, ``val_fraction`` of ``train_dir`` is held out
            (a seeded split); with neither, there is no validation.
        image_size: side of the square crop, a multiple of the model's patch size.
        batch_size: global batch (split over processes); ``val_batch_size`` defaults to it.
        skip_unreadable: log and skip unreadable files (checked when loaded) instead of failing.
        intensity: how pixel values become [0, 1] (:mod:`alibi_vit.images`): ``"auto"`` (default;
            a 0.5–99.5 percentile stretch for single-channel images, ``dtype`` for colour ones),
            ``"dtype"`` (integers divided by their type's maximum), ``"minmax"`` or ``"percentile"``.
    """

    def __init__(self, train_dir: str, val_dir: Optional[str] = None, val_fraction: float = 0.0,
                 image_size: int = 224, batch_size: int = 256, val_batch_size: Optional[int] = None,
                 num_workers: int = 8, shuffle: bool = True, seed: int = 0, skip_unreadable: bool = False,
                 recursive: bool = True, pin_memory: bool = True, intensity: IntensityMode = "auto"):
        super().__init__(image_size, batch_size, val_batch_size, num_workers, shuffle, seed, pin_memory)
        if val_dir is not None and val_fraction:
            raise ValueError("give either val_dir or val_fraction, not both")
        self.train_dir, self.val_dir = train_dir, val_dir
        self.val_fraction = float(val_fraction)
        self.skip_unreadable = bool(skip_unreadable)
        self.recursive = bool(recursive)
        self.intensity = check_intensity(intensity)

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        try:
            files = list_images(self.train_dir, recursive=self.recursive)
            val_files = None if self.val_dir is None else list_images(self.val_dir, recursive=self.recursive)
        except FileNotFoundError as err:
            raise DatasetLayoutError(f"{err} (set --data.train_dir / --data.val_dir)") from None
        if val_files is not None:
            train, val = files, val_files
        else:
            train, val = _split(files, self.val_fraction, self.seed)
        self.train_set = ImageFileDataset(train, self.image_size, self.skip_unreadable, self.intensity)
        self.val_set = ImageFileDataset(val, self.image_size, self.skip_unreadable, self.intensity) if val else None


COCO_LAYOUT = """expected COCO layout:
  {root}/{train}/000000000009.jpg ...   (train images)
  {root}/{val}/000000000139.jpg ...     (val images)
  optional annotation JSONs, e.g. {root}/annotations/stuff_train2017.json (COCO-Stuff)"""


class CocoImagesDataModule(_ImageDataModule):
    """COCO (or COCO-Stuff, same images) ``train2017``/``val2017`` images; labels are not used.

    With ``train_annotations``/``val_annotations`` (COCO JSON, relative to ``root`` or absolute)
    the image lists come from the annotation files via pycocotools, e.g. to train on exactly
    the images COCO-Stuff annotates; otherwise every image in the split folder is used.

    ``intensity`` defaults to ``"dtype"``, not ``"auto"``: COCO holds 8-bit photos, and its
    grayscale ones are read as ordinary photo loaders (PIL, torchvision) read them: divided by 255,
    no stretch.
    """

    def __init__(self, root: str, train_split: str = "train2017", val_split: Optional[str] = "val2017",
                 train_annotations: Optional[str] = None, val_annotations: Optional[str] = None,
                 image_size: int = 224, batch_size: int = 256, val_batch_size: Optional[int] = None,
                 num_workers: int = 8, shuffle: bool = True, seed: int = 0, skip_unreadable: bool = False,
                 pin_memory: bool = True, intensity: IntensityMode = "dtype"):
        super().__init__(image_size, batch_size, val_batch_size, num_workers, shuffle, seed, pin_memory)
        self.root = Path(root)
        self.train_split, self.val_split = train_split, val_split
        self.train_annotations, self.val_annotations = train_annotations, val_annotations
        self.skip_unreadable = bool(skip_unreadable)
        self.intensity = check_intensity(intensity)

    def _files(self, split: str, annotations: Optional[str]) -> list[Path]:
        folder = self.root / split
        if not folder.is_dir():
            layout = COCO_LAYOUT.format(root=self.root, train=self.train_split, val=self.val_split or "val2017")
            raise DatasetLayoutError(f"COCO image folder {folder} does not exist (set --data.root);\n{layout}")
        if annotations is None:
            return list_images(folder, recursive=False)
        ann = Path(annotations)
        ann = ann if ann.is_absolute() else self.root / ann
        if not ann.is_file():
            raise FileNotFoundError(f"COCO annotation file {ann} does not exist")
        from pycocotools.coco import COCO

        coco = COCO(str(ann))
        infos = coco.loadImgs(sorted(coco.getImgIds()))
        if not infos:
            raise ValueError(f"{ann} lists no images")
        return [folder / info["file_name"] for info in infos]

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        self.train_set = ImageFileDataset(self._files(self.train_split, self.train_annotations), self.image_size,
                                          self.skip_unreadable, self.intensity)
        if self.val_split is not None:
            self.val_set = ImageFileDataset(self._files(self.val_split, self.val_annotations), self.image_size,
                                            self.skip_unreadable, self.intensity)


class BundledImagesDataModule(_ImageDataModule):
    """Tiles of scikit-image's bundled images (``alibi_vit.images.BUNDLED_SETS``): training data with no download.

    Each image gives ``tiles_per_image`` training and ``val_tiles_per_image`` validation
    squares of ``tile_size`` px (or the image's short side) at seeded positions, resized to
    ``image_size``. ``sets`` defaults to every bundled set; ``intensity`` as in
    :class:`ImageFolderDataModule`. For demos and tests, not for a real distillation.
    """

    def __init__(self, sets: Sequence[str] = tuple(BUNDLED_SETS), image_size: int = 112,
                 tile_size: int = 256, tiles_per_image: int = 8, val_tiles_per_image: int = 2,
                 batch_size: int = 8, val_batch_size: Optional[int] = None, num_workers: int = 0,
                 shuffle: bool = True, seed: int = 0, pin_memory: bool = False, intensity: IntensityMode = "auto"):
        super().__init__(image_size, batch_size, val_batch_size, num_workers, shuffle, seed, pin_memory)
        if tile_size <= 0 or tiles_per_image <= 0 or val_tiles_per_image < 0:
            raise ValueError("tile_size and tiles_per_image must be positive, val_tiles_per_image non-negative")
        self.sets = list(sets)
        self.intensity = check_intensity(intensity)
        self.tile_size = int(tile_size)
        self.tiles_per_image = int(tiles_per_image)
        self.val_tiles_per_image = int(val_tiles_per_image)

    def _tiles(self) -> tuple[list, list]:
        rng = np.random.default_rng(self.seed)
        train, val = [], []
        for name in self.sets:
            for _, image in bundled_images(name, self.intensity):
                h, w = image.shape[-2:]
                t = min(self.tile_size, h, w)
                for i in range(self.tiles_per_image + self.val_tiles_per_image):
                    top, left = int(rng.integers(0, h - t + 1)), int(rng.integers(0, w - t + 1))
                    tile = normalize(resize_center_crop(image[:, top:top + t, left:left + t], self.image_size))
                    (train if i < self.tiles_per_image else val).append(tile)
        return train, val

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        train, val = self._tiles()
        self.train_set = TensorImageDataset(torch.stack(train))
        self.val_set = TensorImageDataset(torch.stack(val)) if val else None
