"""Robustness of trained segmentation probes to image transforms (paper Tab. S3).

Each validation image is transformed (flipped upside down, rolled by whole patches with
wrap-around, or rotated by 90°), the frozen backbone computes features of the transformed
image, the *inverse* transform is applied to those features so they line up with the original
label again, and the same trained head predicts. A backbone whose features depend only on
content scores the same with and without the transform; positional bias costs mIoU.

For a wrapped-ALiBi backbone rolling by whole patches rolls its features exactly (the bias is
circulant), so its ``roll`` column equals its ``none`` column.

Command::

    alibi-vit robustness --checkpoint dinov2=probe_dinov2.ckpt alibi=probe_alibi.ckpt \\
        --dataset voc2012 --data.root /data/voc --csv robustness_voc12.csv

Offline try-it: ``lightning fit --config configs/probe_demo.yaml`` trains a tiny probe on a
generated set, then ``alibi-vit robustness --checkpoint runs/probe_demo/checkpoints/last.ckpt``.
A file that is not a readable probe checkpoint (a truncated or corrupt ``.ckpt``, a
distillation checkpoint, an exported state_dict) is a ValueError with one message.
"""

from __future__ import annotations

import argparse
import csv
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch loads on use: `alibi-vit robustness --help` answers at once
    import torch

__all__ = ["TRANSFORMS", "Transform", "add_arguments", "evaluate_robustness", "format_table", "make_transform",
           "read_probe_checkpoint", "run"]

TRANSFORMS = ("none", "flip-ud", "roll", "rot90")
DATASETS = ("ade20k", "cocostuff", "voc2007", "voc2012")  # the keys of _datamodule_classes()


@dataclass(frozen=True)
class Transform:
    """An image transform and its inverse on (B, C, h, w) patch-feature grids."""

    name: str
    image: Callable[[torch.Tensor], torch.Tensor]
    features_inverse: Callable[[torch.Tensor], torch.Tensor]


def make_transform(name: str, patch_size=(14, 14), roll=(0, 0)) -> Transform:
    """``roll`` = (dy, dx) in whole patches; images move by ``roll × patch_size`` pixels, wrapping around.

    Flips and rotations of the image permute patches and transform pixels *inside* each patch;
    only the permutation can be undone on features, which is the point: a position-free model
    sees each patch's content changed in the same way wherever it is.
    """
    ph, pw = patch_size
    dy, dx = (int(r) for r in roll)
    if name == "none":
        return Transform(name, lambda x: x, lambda f: f)
    if name == "flip-ud":
        return Transform(name, lambda x: x.flip(-2), lambda f: f.flip(-2))
    if name == "roll":
        return Transform(name, lambda x: x.roll((dy * ph, dx * pw), dims=(-2, -1)),
                         lambda f: f.roll((-dy, -dx), dims=(-2, -1)))
    if name == "rot90":
        return Transform(name, lambda x: x.rot90(1, dims=(-2, -1)), lambda f: f.rot90(-1, dims=(-2, -1)))
    raise ValueError(f"unknown transform {name!r}; choose from {', '.join(TRANSFORMS)}")


def evaluate_robustness(module, loader, transforms=TRANSFORMS, roll=None, device="cpu", limit_batches=None,
                        desc: str = "robustness") -> dict[str, float]:
    """mIoU (accumulated over the whole loader) of a ``SegmentationProbeModule`` under each transform.

    ``roll`` = (dy, dx) patches; default: half the patch grid in both directions (the largest
    displacement on the torus).
    """
    import torch
    from tqdm.auto import tqdm

    from lit_modules.segmentation_probe import confusion_matrix, iou_from_confusion

    device = torch.device(device)
    module = module.to(device).eval()
    patch_size = tuple(module.backbone.patch_embed.patch_size)
    # the probe's own whole-set mIoU, so that the "none" column is its validation score
    metrics = {name: confusion_matrix(module.num_classes).to(device) for name in transforms}
    total = len(loader) if limit_batches is None else min(len(loader), limit_batches)
    with torch.no_grad():
        for index, batch in enumerate(tqdm(loader, total=total, desc=desc, unit="batch")):
            if limit_batches is not None and index >= limit_batches:
                break
            if "image" not in batch or "features" in batch:
                raise ValueError("robustness needs images in every batch (no feature cache attached)")
            images, label = batch["image"].to(device), batch["label"].to(device)
            h, w = images.shape[-2] // patch_size[0], images.shape[-1] // patch_size[1]
            shift = roll if roll is not None else (h // 2, w // 2)
            for name in transforms:
                t = make_transform(name, patch_size, shift)
                features = t.features_inverse(module.backbone_features(t.image(images)))
                logits = module.head_logits(features, label.shape[-2:])
                metrics[name].update(logits.argmax(1), label)
    return {name: float(iou_from_confusion(m.compute())[0]) for name, m in metrics.items()}


def format_table(rows: list[dict], transforms=TRANSFORMS) -> str:
    """Markdown table in the layout of the paper's Tab. S3: one row per backbone, mIoU per transform."""
    lines = ["| backbone | " + " | ".join(transforms) + " |", "|---|" + "---:|" * len(transforms)]
    for row in rows:
        lines.append(f"| {row['backbone']} | " + " | ".join(f"{row[t]:.3f}" for t in transforms) + " |")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------

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
    parser.add_argument("--data.image_size", dest="image_size", type=int, default=None,
                        help="probe input size in px (default: the checkpoint's, else 518)")
    parser.add_argument("--data.resize_mode", dest="resize_mode", choices=("stretch", "crop"), default=None,
                        help="image resizing (default: the checkpoint's, else stretch)")
    parser.add_argument("--transforms", nargs="+", choices=TRANSFORMS, default=list(TRANSFORMS))
    parser.add_argument("--roll", nargs=2, type=int, default=None, metavar=("DY", "DX"),
                        help="roll in whole patches (default: half the patch grid)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--limit-batches", type=int, default=None, help="evaluate only this many batches (smoke runs)")
    parser.add_argument("--csv", default="robustness.csv", help="where to write the results table")


def _parse_checkpoints(specs: list[str]) -> list[tuple[str | None, Path]]:
    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        label, path = (label, path) if sep and not Path(spec).exists() else (None, spec)
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"probe checkpoint {path} does not exist")
        out.append((label, path))
    return out


def read_probe_checkpoint(path) -> dict:
    """A trained probe's Lightning checkpoint as a dict, checked to be one; else ValueError with one message.

    Read with ``weights_only=True`` (tensors and plain containers only). A probe checkpoint
    holds the head (``head.1.weight``) and the backbone's weights next to the hyper-parameters
    ``backbone`` and ``num_classes``; anything else (a distillation run, an exported state_dict)
    is named and refused.
    """
    path = Path(path)
    with path.open("rb") as f:
        magic = f.read(2)
    if magic not in (b"PK", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05"):  # torch's zip, or a legacy pickle
        raise ValueError(f"{path} is not a PyTorch checkpoint file (neither a torch.save zip archive nor a pickle); "
                         "pass the Lightning .ckpt of a trained segmentation probe")
    from alibi_vit.checkpoint import read_torch_file

    ckpt = read_torch_file(path, what="probe checkpoint")
    hint = ("pass the checkpoint of a trained segmentation probe (runs/probe_*/.../checkpoints/last.ckpt from "
            "`lightning fit --config configs/probe_voc12.yaml ...`, or configs/probe_demo.yaml to try it)")
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("state_dict"), dict):
        raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict' entry; an exported backbone "
                         f"state_dict, perhaps): {hint}")
    hparams = ckpt.get("hyper_parameters") or {}
    state = ckpt["state_dict"]
    if not ("head.1.weight" in state and "backbone" in hparams and "num_classes" in hparams):
        class_path = hparams.get("_class_path")
        prefixes = sorted({key.split(".", 1)[0] for key in state})
        what = f"a checkpoint of {class_path}" if class_path else (
            "a checkpoint without a probe head (its weights: " + ", ".join(prefixes[:6]) + ")")
        raise ValueError(f"{path} is {what}, not of a segmentation probe: {hint}")
    return ckpt


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
    import torch

    from lit_modules.segmentation_probe import SegmentationProbeModule

    checkpoints = _parse_checkpoints(args.checkpoint)
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
        scores = evaluate_robustness(module, loader, args.transforms, roll=args.roll, device=device,
                                     limit_batches=args.limit_batches, desc=name)
        rows.append({"backbone": name, **scores, "checkpoint": str(path)})
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
                             "dataset": datamodule.name, "image_size": size,
                             "roll_patches": "half grid" if args.roll is None else f"{args.roll[0]} {args.roll[1]}"})
    print(f"\nwrote {out}")
    return 0
