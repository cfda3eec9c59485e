"""The labelled micrograph set shipped inside the package (``micrographs/``: README.md there names
the sources and licences; ``manifest.json`` lists the images).

Sets: ``super`` (Ni-superalloy SEM, 512², 3 classes), ``ebc`` (barrier-coating SEM, 1024², 3
classes, one of them thin cracks), ``isb`` (the two test images of the interactive-seg-backend
authors, with their own scribbles) and ``all``. Each image is in the ``train`` split (where the
segmentation defaults were chosen) or the ``test`` split (where they are reported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources

import numpy as np

from ..images import read_array

__all__ = ["DATASETS", "LabelledMicrograph", "load_micrographs", "micrograph_manifest"]

DATASETS = ("super", "ebc", "isb", "all")
SPLITS = ("train", "test")


@dataclass(frozen=True)
class LabelledMicrograph:
    """One image of the set: pixels as stored (8- or 16-bit), ground truth with classes 1..K."""
    name: str
    split: str
    image: np.ndarray
    mask: np.ndarray
    classes: tuple[str, ...]
    authors_scribbles: np.ndarray | None  # 0 = unlabelled, 1..K; None where the source has none
    source: str

    def cropped(self, size: int) -> "LabelledMicrograph":
        """The central ``size``×``size`` px (or less, along a shorter side) of the image and its labels."""
        h, w = self.mask.shape
        r0, c0 = max((h - size) // 2, 0), max((w - size) // 2, 0)
        cut = (slice(r0, r0 + size), slice(c0, c0 + size))
        return replace(self, image=self.image[cut], mask=self.mask[cut],
                       authors_scribbles=None if self.authors_scribbles is None else self.authors_scribbles[cut])


def _folder():
    return resources.files("alibi_vit.trainable").joinpath("micrographs")


def micrograph_manifest() -> list[dict]:
    """The manifest's entries (name, sets, split, classes, file names, source, licence files)."""
    return json.loads(_folder().joinpath("manifest.json").read_text())["images"]


def load_micrographs(dataset: str = "all", split: str | None = None, names=None) -> list[LabelledMicrograph]:
    """The images of ``dataset`` (one of :data:`DATASETS`), in manifest order.

    split: "train", "test" or None (both). names: keep only these image names (an unknown name is
    a ValueError listing the set's names).
    """
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)} or None, got {split!r}")
    entries = [e for e in micrograph_manifest() if dataset == "all" or dataset in e["sets"]]
    if names is not None:
        unknown = sorted(set(names) - {e["name"] for e in entries})
        if unknown:
            raise ValueError(f"no image {', '.join(unknown)} in dataset {dataset!r}; its images: "
                             + ", ".join(e["name"] for e in entries))
        entries = [e for e in entries if e["name"] in set(names)]
    entries = [e for e in entries if split is None or e["split"] == split]
    folder = _folder()
    out = []
    for e in entries:
        def read(key):
            with resources.as_file(folder.joinpath(e[key])) as path:
                return read_array(path)
        scribbles = read("authors_scribbles").astype(np.int64) if "authors_scribbles" in e else None
        out.append(LabelledMicrograph(e["name"], e["split"], read("image"), read("mask").astype(np.int64),
                                      tuple(e["classes"]), scribbles, e["source"]))
    return out
