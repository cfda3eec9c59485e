"""A tiny generated dataset in the Pascal VOC layout: try the segmentation probe offline.

The images are textured grey backgrounds with coloured rectangles whose colour is their class,
outlined by VOC's 255 (ignore) border (``datamodules.segmentation.write_synthetic_voc``). Nothing
is downloaded; with a tiny random-init backbone (``configs/probe_demo.yaml``) a probe trains in
seconds on a CPU and ``alibi-vit robustness`` runs on its checkpoint. The numbers say nothing
about any real backbone.

Write the set anywhere (then point any VOC config at it with ``--data.root=ROOT``)::

    python -m datamodules.demo_voc ROOT [--train 32] [--val 8] [--seed 0]

or let ``DemoVOCSegmentation`` write it on first use, as ``configs/probe_demo.yaml`` does (a
Trainer's ``prepare_data``; used without a Trainer, as ``alibi-vit robustness`` does, a missing set
is an error, never generated).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from .segmentation import DatasetLayoutError, VOCSegmentation, write_synthetic_voc

__all__ = ["DemoVOCSegmentation", "main", "write_demo_voc"]


def write_demo_voc(root, n_train: int = 32, n_val: int = 8, seed: int = 0, year: int = 2012) -> Path:
    """Write the demo set under ``root`` (``ROOT/VOCdevkit/VOC<year>/...``) and return ``root``.

    Images are 41–71 × 43–77 px with 4 classes in use (background + 3 colours) of VOC's 21.
    """
    if n_train < 1 or n_val < 1:
        raise ValueError(f"the demo set needs at least one training and one validation image, got {n_train}/{n_val}")
    return write_synthetic_voc(root, n_train=n_train, n_val=n_val, seed=seed, year=year)


class DemoVOCSegmentation(VOCSegmentation):
    """``VOCSegmentation`` on the generated demo set, written under ``root`` if it is not there yet.

    Args:
        root: folder of the demo set (default ``runs/probe_demo/voc``). ``prepare_data`` generates it
            when ``ROOT/VOCdevkit/VOC<year>`` does not exist; an existing folder is used as it is.
        n_train / n_val: images in the train and val splits when generating.
        seed: seed of the generated images.
        Everything else as ``VOCSegmentation`` (``image_size``, ``batch_size``, ``augment``, ...).
    """

    def __init__(self, root: str = "runs/probe_demo/voc", n_train: int = 32, n_val: int = 8, seed: int = 0,
                 year: int = 2012, **kwargs):
        super().__init__(root, year=year, **kwargs)
        self.n_train, self.n_val, self.seed = n_train, n_val, seed

    def prepare_data(self) -> None:
        """Generate the set (Lightning calls this once, before ``setup``, on the first process only)."""
        target = self.root / "VOCdevkit" / f"VOC{self.year}"
        if target.exists():
            return
        # written next to its place, then renamed: an interrupted run never leaves half a dataset behind
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.root, prefix=".demo-") as tmp:
            write_demo_voc(tmp, self.n_train, self.n_val, self.seed, self.year)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / "VOCdevkit" / f"VOC{self.year}"), str(target))

    def setup(self, stage: str | None = None) -> None:
        # Only prepare_data (a Trainer's fit/validate on this datamodule) writes the set: evaluating a
        # demo checkpoint elsewhere (alibi-vit robustness --data.root TYPO) must not invent data at a typo.
        if not (self.root / "VOCdevkit" / f"VOC{self.year}").exists():
            raise DatasetLayoutError(
                f"the demo VOC set is not in {self.root}: `lightning fit --config configs/probe_demo.yaml` or "
                f"`python -m datamodules.demo_voc {self.root}` writes it\nexpected layout:\n{self.layout}")
        super().setup(stage)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m datamodules.demo_voc", description=__doc__.splitlines()[0])
    parser.add_argument("root", help="folder to write ROOT/VOCdevkit/VOC2012/... into")
    parser.add_argument("--train", type=int, default=32, help="training images (default 32)")
    parser.add_argument("--val", type=int, default=8, help="validation images (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        root = write_demo_voc(args.root, args.train, args.val, args.seed)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {args.train} training and {args.val} validation images to {root / 'VOCdevkit' / 'VOC2012'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
