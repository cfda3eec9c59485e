"""``alibi-vit robustness``: segmentation probes under flip, roll and rot90 (paper Tab. S3).

The evaluation itself is :func:`lit_modules.robustness.evaluate_robustness`; this command reads
the probe checkpoints, builds the validation set they were trained on (or ``--dataset``) and
writes the table::

    alibi-vit robustness --checkpoint dinov2=probe_dinov2.ckpt alibi=probe_alibi.ckpt \\
        --dataset voc2012 --data.root /data/voc --csv robustness_voc12.csv

Offline try-it: ``lightning fit --config configs/probe_demo.yaml`` trains a tiny probe on a
generated set, then ``alibi-vit robustness --checkpoint runs/probe_demo/checkpoints/last.ckpt``.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import warnings
from pathlib import Path

from lit_modules.robustness import TRANSFORMS

from .options import at_least

__all__ = ["add_arguments", "run"]

DATASETS = ("ade20k", "cocostuff", "voc2007", "voc2012")  # the keys of _datamodule_classes()


def _datamodule_classes():
    from datamodules.segmentation import ADE20KSegmentation, COCOStuffSegmentation, VOCSegmentation

    return {
        "voc2012": (VOCSegmentation, {"year": 2012}),
        "voc2007": (VOCSegmentation, {"year": 2007}),
        "ade20k": (ADE20KSegmentation, {}),
        "cocostuff": (COCOStuffSegmentation, {}),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", nargs="+", required=True, metavar="[LABEL=]PATH",
                        help="trained probe checkpoints (Lightning .ckpt of SegmentationProbeModule); "
                             "LABEL names the row (default: the backbone name)")
    parser.add_argument("--dataset", choices=DATASETS, default=None,
                        help="validation set (default: the datamodule stored in the first checkpoint, else voc2012)")
    parser.add_argument("--data.root", dest="data_root", default=None,
                        help="dataset root folder (default: the root stored in the first checkpoint)")
    parser.add_argument("--data.image_size", dest="image_size", type=at_least(1), default=None,
                        help="probe input size in px (default: the checkpoint's, else 518)")
    parser.add_argument("--data.resize_mode", dest="resize_mode", choices=("stretch", "crop"), default=None,
                        help="image resizing (default: the checkpoint's, else stretch)")
    parser.add_argument("--transforms", nargs="+", choices=TRANSFORMS, default=list(TRANSFORMS),
                        help="image transforms to score (default: all; none is the probe's own score)")
    parser.add_argument("--roll", nargs=2, type=int, default=None, metavar=("DY", "DX"),
                        help="roll in whole patches (default: half the patch grid)")
    parser.add_argument("--batch-size", type=at_least(1), default=16, help="images per forward pass")
    parser.add_argument("--num-workers", type=at_least(0), default=4,
                        help="data-loading processes (at most the CPU cores; 0 loads in this process)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--limit-batches", type=at_least(1), default=None, help="evaluate only this many batches (smoke runs)")
    parser.add_argument("--csv", default="robustness.csv", help="where to write the results table")


def _parse_checkpoints(specs: list[str]) -> list[tuple[str | None, Path]]:
    from ..files import require_file

    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        label, path = (label, path) if sep and not Path(spec).exists() else (None, spec)
        path = require_file(Path(path).expanduser(), "probe checkpoint")
        out.append((label, path))
    return out


def _effective_roll(roll, image_size, patch_size):
    """``--roll`` reduced to the patch grid (rolls wrap around): a roll that wraps to none is an error, one that
    wraps to another roll is said, so the table never calls an unrolled image rolled."""
    if roll is None:
        return roll
    grid = [int(s) // int(p) for s, p in zip(image_size, patch_size)]
    wrapped = [r % g for r, g in zip(roll, grid)]
    if not any(wrapped):
        raise ValueError(f"--roll {roll[0]} {roll[1]} wraps around the {grid[0]}×{grid[1]} patch grid to no roll at "
                         f"all: give a roll that is not a multiple of the grid (e.g. {grid[0] // 2} {grid[1] // 2})")
    if wrapped != list(roll):
        warnings.warn(f"--roll {roll[0]} {roll[1]} on the {grid[0]}×{grid[1]} patch grid is a roll of "
                      f"{wrapped[0]} {wrapped[1]} patches (rolls wrap around)")
    return tuple(wrapped)


def _make_datamodule(args, stored: dict):
    """The validation datamodule: ``--dataset`` or the one the probe was trained with, CLI options on top."""
    from datamodules.segmentation import SegmentationDataModule

    if args.dataset:
        cls, kwargs = _datamodule_classes()[args.dataset]
    elif stored.get("_class_path"):  # LightningCLI stores the datamodule's class path with its arguments
        module_name, _, class_name = stored["_class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module_name), class_name)
        if not (isinstance(cls, type) and issubclass(cls, SegmentationDataModule)):
            raise ValueError(f"the checkpoint's datamodule {stored['_class_path']} is not a segmentation datamodule; "
                             "pass --dataset")
        kwargs = {k: v for k, v in stored.items() if not k.startswith("_")}
    else:
        cls, kwargs = _datamodule_classes()["voc2012"]
    kwargs = dict(kwargs)
    for key, value in (("root", args.data_root), ("image_size", args.image_size), ("resize_mode", args.resize_mode)):
        if value is not None:
            kwargs[key] = value
        elif key in stored:
            kwargs.setdefault(key, stored[key])
    if not kwargs.get("root"):
        raise ValueError("no dataset root: pass --data.root")
    kwargs.update(batch_size=args.batch_size, val_batch_size=args.batch_size, num_workers=args.num_workers,
                  augment=False)
    return cls(**kwargs)


def run(args) -> int:
    checkpoints = _parse_checkpoints(args.checkpoint)  # before the heavy imports: a wrong path is said at once

    import torch

    from lit_modules.robustness import evaluate_robustness, format_table, read_probe_checkpoint
    from lit_modules.segmentation_probe import SegmentationProbeModule

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    stored = None
    for _, path in checkpoints:  # every file checked before the first (long) evaluation starts
        ckpt = read_probe_checkpoint(path)
        if stored is None:
            stored = ckpt.get("datamodule_hyper_parameters") or {}
        del ckpt
    datamodule = _make_datamodule(args, dict(stored))
    datamodule.setup("validate")
    loader = datamodule.val_dataloader()

    rows = []
    for label, path in checkpoints:
        try:
            module = SegmentationProbeModule.load_probe(path, map_location="cpu")
        except RuntimeError as err:  # strict loading: weights that do not fit the probe the hyper-parameters describe
            raise ValueError(f"{path}: the stored weights do not fit the probe its hyper-parameters describe "
                             f"({str(err).strip().splitlines()[0]})") from err
        if module.num_classes != datamodule.num_classes:
            raise ValueError(f"{path}: the probe has {module.num_classes} classes, "
                             f"{datamodule.name} has {datamodule.num_classes}")
        name = label or module.hparams.backbone
        roll = (_effective_roll(args.roll, datamodule.image_size, module.backbone.patch_embed.patch_size)
                if "roll" in args.transforms else args.roll)
        scores = evaluate_robustness(module, loader, args.transforms, roll=roll, device=device,
                                     limit_batches=args.limit_batches, desc=name)
        rows.append({"backbone": name, **scores, "checkpoint": str(path),
                     "roll_patches": "half grid" if roll is None else f"{roll[0]} {roll[1]}"})
        del module

    size = "x".join(str(s) for s in datamodule.image_size)
    print(f"\nmIoU on {datamodule.name} {datamodule.val_split} ({len(datamodule.val_set)} images, {size} px, "
          f"{datamodule.resize_mode}):\n")
    print(format_table(rows, args.transforms))
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["backbone", *args.transforms, "checkpoint", "dataset", "image_size",
                                               "roll_patches"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**{k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in row.items()},
                             "dataset": datamodule.name, "image_size": size})
    print(f"\nwrote {out}")
    return 0
