"""Robustness of trained segmentation probes to image transforms (paper Tab. S3).

Each validation image is transformed (flipped upside down, rolled by whole patches with
wrap-around, or rotated by 90°), the frozen backbone computes features of the transformed
image, the *inverse* transform is applied to those features so they line up with the original
label again, and the same trained head predicts. A backbone whose features depend only on
content scores the same with and without the transform; positional bias costs mIoU.

For a wrapped-ALiBi backbone rolling by whole patches rolls its features exactly (the bias is
circulant), so its ``roll`` column equals its ``none`` column.

The command is ``alibi-vit robustness`` (:mod:`alibi_vit.cli.robustness`). A file that is not a
readable probe checkpoint (a truncated or corrupt ``.ckpt``, a distillation checkpoint, an
exported state_dict) is a ValueError with one message (:func:`read_probe_checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch loads on use
    import torch

__all__ = ["TRANSFORMS", "Transform", "evaluate_robustness", "format_table", "make_transform", "read_probe_checkpoint"]

TRANSFORMS = ("none", "flip-ud", "roll", "rot90")


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
    from alibi_vit.models.checkpoint import read_torch_file

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
