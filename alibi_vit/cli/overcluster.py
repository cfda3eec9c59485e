"""``alibi-vit overcluster``: OverClustering mIoU of frozen backbones on Pascal VOC (docs/method.md §9).

For each backbone, every image of the VOC split (``val`` by default: 1,449 images for VOC12) is
resized to ``--size`` px (stretched, as the segmentation probe does) and its final-normed patch
features are kept as float16; its label mask is resized (nearest) to ``--mask-size`` px (100:
Leopart's protocol). The features of all patches are standardised per channel and reduced to 50
dimensions with PCA; k-means (scikit-learn, 5 restarts, ≤ 50 iterations) with each ``--k`` and
each of ``--seeds`` (5 by default) runs over them; each image's cluster map is nearest-upsampled
to the mask size and the non-ignore pixels are scored: clusters mapped to classes (Hungarian for
k = 21, many-to-one above), mIoU from one confusion matrix over the whole set, classes absent
from labels and predictions counted as IoU 0 (Leopart; ``--absent skip`` leaves them out).

Prints a table (backbone × k, mean ± standard deviation over the seeds) and writes a CSV with the
per-seed mIoU and the per-class IoU (mean over the seeds). A ``--checkpoint`` that
holds a RASA projection (``rasa_projection``, from ``lightning fit --config configs/rasa.yaml``)
is loaded as the folded model. Without ``--pretrained`` or ``--checkpoint`` a backbone is randomly
initialised: that checks the pipeline, nothing more.

Comparison: ``--backbone LABEL=NAME`` names a row (so one model can appear with and without
RASA: ``dinov2=vit_small_patch14_reg4_dinov2 dinov2+rasa=vit_small_patch14_reg4_dinov2
--checkpoint dinov2+rasa=runs/rasa/rasa/rasa_backbone.safetensors``); ``--r2-images textures
noise`` adds the positional probe's (x, y) R² (docs/method.md §5) on those image sets;
``--probe-checkpoint LABEL=CKPT`` adds a trained segmentation probe's mIoU on the same VOC
images. All of it goes into one Markdown table next to the CSV (``<out>.md``).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

__all__ = ["add_arguments", "backbone_features", "build_backbones", "markdown_table", "parse_backbones",
           "positional_r2_of", "probe_miou", "run", "voc_datamodule", "voc_patch_features"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backbone", "--backbones", dest="backbones", nargs="+", required=True,
                        metavar="[LABEL=]NAME",
                        help="timm model names, e.g. vit_small_patch14_reg4_dinov2 "
                             "alibi_vit_small_patch14_reg4_dinov2; LABEL= names the row (default: NAME), so one model can appear twice")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="[LABEL=]PATH",
                        help="state_dict for backbone LABEL (a timm file, an export, or a RASA export with its "
                             "rasa_projection), loaded strictly; repeatable; LABEL= may be omitted with one backbone")
    parser.add_argument("--pretrained", action="store_true",
                        help="timm's pretrained weights for backbones without --checkpoint")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="architecture override for every backbone, e.g. depth=2")
    parser.add_argument("--data.root", dest="data_root", required=True, metavar="VOC_ROOT",
                        help="folder holding VOCdevkit/VOC2012 (or that folder itself)")
    parser.add_argument("--year", type=int, default=2012, choices=(2007, 2012))
    parser.add_argument("--split", default="val", help="ImageSets/Segmentation split (default val)")
    parser.add_argument("--size", type=int, default=518,
                        help="images are resized to SIZE×SIZE px (default 518: 37×37 patches of 14 px; the "
                             "RASA reference used 224)")
    parser.add_argument("--k", type=int, nargs="+", default=[21, 100, 300],
                        help="k-means clusters (default 21 100 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                        help="k-means seeds; the table gives the mean and standard deviation (default 0 1 2 3 4)")
    parser.add_argument("--mask-size", type=int, default=100,
                        help="label masks are resized (nearest) to SIZE×SIZE px and scored per pixel (default 100, "
                             "Leopart's protocol)")
    parser.add_argument("--absent", choices=("zero", "skip"), default="zero",
                        help="a class absent from labels and predictions: IoU 0 in the mean (zero, Leopart's "
                             "PredsmIoU; default) or left out (skip)")
    parser.add_argument("--max-images", type=int, default=None, help="only the first N images of the split")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-workers", type=int, default=4)
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--r2-images", nargs="*", default=[], metavar="SET",
                        help="also the positional probe's (x, y) R² on these image sets (e.g. textures noise; any "
                             "--images value of alibi-vit probe)")
    parser.add_argument("--r2-size", type=int, default=224, help="image size of the R² probe (default 224)")
    parser.add_argument("--probe-checkpoint", action="append", default=[], metavar="LABEL=CKPT",
                        help="Lightning checkpoint of a segmentation probe trained on VOC: its mIoU on the same "
                             "images joins row LABEL of the Markdown table (repeatable)")
    parser.add_argument("--out", type=Path, default=Path("overclustering.csv"),
                        help="CSV file to write; the Markdown table goes next to it (.md)")


def parse_backbones(items) -> list[tuple[str, str]]:
    """``[LABEL=]NAME`` entries → (label, name); labels must be unique."""
    pairs = []
    for item in items:
        label, sep, name = item.partition("=")
        pairs.append((label, name) if sep else (item, item))
        if sep and not (label and name):
            raise ValueError(f"--backbone expects NAME or LABEL=NAME, got {item!r}")
    labels = [label for label, _ in pairs]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        raise ValueError(f"backbone labels must be unique, {duplicates} repeat; name the rows with LABEL=NAME")
    return pairs


def build_backbones(args):
    """Yield (label, name, weights, model in eval mode) one at a time; a RASA checkpoint gives the folded model."""
    import torch

    from ..models.checkpoint import check_model_name, create_backbone
    from .options import checkpoints_by_model, parse_model_args

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_kwargs = parse_model_args(args.model_arg)
    pairs = parse_backbones(args.backbones)
    checkpoints = checkpoints_by_model(args.checkpoint, [label for label, _ in pairs])
    for _, name in pairs:
        check_model_name(name)
    for label, name in pairs:
        checkpoint = checkpoints.get(label)
        if checkpoint is not None:
            model, weights = create_backbone(name, checkpoint=checkpoint, **model_kwargs), str(checkpoint)
        else:
            model = create_backbone(name, pretrained=args.pretrained, **model_kwargs)
            weights = "pretrained" if args.pretrained else "random init"
            if not args.pretrained:
                print(f"note: {label} is randomly initialised (give --pretrained or --checkpoint for real features)",
                      file=sys.stderr)
        yield label, name, weights, model.to(device).eval()


def voc_datamodule(root, year: int = 2012, split: str = "val", size: int = 518, batch_size: int = 16,
                   num_workers: int = 4):
    from datamodules.segmentation import VOCSegmentation

    # the split is the datamodule's validation split; a different training split keeps its check quiet
    dm = VOCSegmentation(root, year=year, val_split=split, train_split="train" if split != "train" else "val",
                         image_size=size, batch_size=batch_size, num_workers=num_workers)
    dm.setup("validate")
    return dm


def backbone_features(model, loader, max_images: int | None = None, num_classes: int = 21, mask_size: int = 100):
    """Patch features (N, h, w, C) float16 and label masks (N, mask_size, mask_size) uint8 of every image
    ``loader`` gives (masks resized by nearest neighbour, 255 = ignore).

    Features are written into one preallocated float16 array, so memory is the features in float16.
    """
    import numpy as np
    import torch

    from ..analysis.overclustering import resize_labels_nearest
    from ..features import patch_features

    device = next(model.parameters()).device
    n_images = len(loader.dataset) if max_images is None else min(max_images, len(loader.dataset))
    features = masks = None
    done = 0
    for batch in loader:
        if done >= n_images:
            break
        images = batch["image"][:n_images - done].to(device)
        with torch.no_grad():
            feats = patch_features(model, images)  # (B, C, h, w)
        B, C, h, w = feats.shape
        if features is None:
            features = np.empty((n_images, h, w, C), dtype=np.float16)
            masks = np.empty((n_images, mask_size, mask_size), dtype=np.uint8)
        features[done:done + B] = feats.permute(0, 2, 3, 1).to(torch.float16).cpu().numpy()
        masks[done:done + B] = resize_labels_nearest(batch["label"][:B].numpy(), mask_size)
        done += B
    return features, masks


def voc_patch_features(model, datamodule, max_images: int | None = None, mask_size: int = 100):
    """(features (N, h, w, C) float16, masks (N, S, S) uint8) of a VOC datamodule's validation split."""
    from .options import check_image_size

    check_image_size(datamodule.image_size[0], model)
    return backbone_features(model, datamodule.val_dataloader(), max_images, mask_size=mask_size)


def positional_r2_of(model, image_set: str, size: int, batch_size: int = 8) -> float:
    """The positional probe's (x, y) R² of ``model`` on an image set (docs/method.md §5, default options:
    2.5 % of the patches fitted, at least 32)."""
    import warnings

    import torch

    from ..analysis.probe import positional_r2
    from ..features import patch_features
    from ..images import load_image_set, normalize

    device = next(model.parameters()).device
    images = [normalize(img) for _, img in load_image_set(image_set, size)]
    feats = []
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            feats.append(patch_features(model, torch.stack(images[start:start + batch_size]).to(device)).float().cpu())
    with warnings.catch_warnings():  # on small grids the probe raises the fitted share to 32 patches, as documented
        warnings.filterwarnings("ignore", message="positional probe:")
        return positional_r2(torch.cat(feats), "xy")


def probe_miou(path, root, year: int, split: str, size: int, batch_size: int, num_workers: int, device) -> float:
    """Whole-set mIoU of a trained segmentation probe (Lightning checkpoint) on a VOC split at ``size`` px."""
    from lit_modules.robustness import evaluate_robustness, read_probe_checkpoint
    from lit_modules.segmentation_probe import SegmentationProbeModule

    read_probe_checkpoint(path)  # a clear error for anything that is not a probe checkpoint
    module = SegmentationProbeModule.load_probe(path, map_location="cpu")
    if module.num_classes != 21:
        raise ValueError(f"probe {path} has {module.num_classes} classes; VOC has 21")
    dm = voc_datamodule(root, year, split, size, batch_size, num_workers)
    return evaluate_robustness(module, dm.val_dataloader(), ("none",), device=device, desc=str(path))["none"]


def markdown_table(rows: list[dict], ks, r2_sets, with_probe: bool) -> str:
    """One row per backbone: weights, positional R² per set, OverClustering mIoU per k (mean ± standard deviation
    over the seeds), probe mIoU (fractions, as every mIoU the project reports)."""
    by_label: dict[str, dict] = {}
    for r in rows:
        by_label.setdefault(r["backbone"], {"weights": r["weights"], **{f"R² {s}": r.get(f"r2_{s}") for s in r2_sets},
                                            "probe": r.get("probe_mIoU")})[f"k={r['k']}"] = (r["mIoU"], r["mIoU_std"])
    head = ["backbone", "weights", *[f"R² {s}" for s in r2_sets], *[f"OC k={k}" for k in ks]]
    head += ["probe mIoU"] if with_probe else []
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for label, v in by_label.items():
        cells = [label, v["weights"], *[f"{v[f'R² {s}']:.3f}" for s in r2_sets],
                 *[f"{v[f'k={k}'][0]:.3f} ± {v[f'k={k}'][1]:.3f}" for k in ks]]
        if with_probe:
            cells.append("" if v["probe"] is None else f"{v['probe']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    from datamodules.segmentation import VOC_CLASSES

    from ..analysis.overclustering import overclustering_seeds
    from .options import check_image_size, checkpoints_by_model

    check_image_size(args.size)
    if args.mask_size < 1:
        raise ValueError(f"--mask-size must be positive, got {args.mask_size}")
    for k in args.k:
        if k < len(VOC_CLASSES):
            raise ValueError(f"--k {k} is fewer than VOC's {len(VOC_CLASSES)} classes; OverClustering needs k >= 21")
    labels_given = [label for label, _ in parse_backbones(args.backbones)]
    probes = checkpoints_by_model(args.probe_checkpoint, labels_given) if args.probe_checkpoint else {}
    for path in probes.values():
        if not Path(path).is_file():
            raise FileNotFoundError(f"probe checkpoint {path} does not exist")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after the work
    # the dataset is checked (layout, files) before any model is built or downloaded
    datamodule = voc_datamodule(args.data_root, args.year, args.split, args.size, args.batch_size, args.num_workers)
    rows = []
    for label, name, weights, model in build_backbones(args):
        start = time.perf_counter()
        features, masks = voc_patch_features(model, datamodule, args.max_images, args.mask_size)
        seconds = time.perf_counter() - start
        extra = {f"r2_{s}": positional_r2_of(model, s, args.r2_size) for s in args.r2_images}
        if label in probes:
            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            extra["probe_mIoU"] = probe_miou(probes[label], args.data_root, args.year, args.split, args.size,
                                             args.batch_size, args.num_workers, device)
        del model
        for k in args.k:
            t0 = time.perf_counter()
            result = overclustering_seeds(features, masks, k, len(VOC_CLASSES), seeds=args.seeds, absent=args.absent)
            rows.append({"backbone": label, "model": name, "weights": weights, "k": k, "mIoU": result.miou,
                         "mIoU_std": result.std, "mIoU_min": result.min, "mIoU_max": result.max,
                         "mIoU_per_seed": " ".join(f"{m:.6f}" for m in result.mious),
                         "seeds": " ".join(map(str, result.seeds)), "absent": args.absent, **extra,
                         "images": features.shape[0], "patches": features.shape[0] * features.shape[1] * features.shape[2],
                         "scored_pixels": int((masks != 255).sum()), "feature_s": round(seconds, 2),
                         "kmeans_s": round(time.perf_counter() - t0, 2),
                         **{f"IoU_{c}": v for c, v in zip(VOC_CLASSES, result.per_class_iou)}})
    table = markdown_table(rows, args.k, args.r2_images, bool(probes))
    print(f"OverClustering mIoU on VOC{args.year} {args.split}, {args.size} px, {rows[0]['patches']} patches, "
          f"{rows[0]['scored_pixels']} pixels scored at {args.mask_size}×{args.mask_size}; mean ± std over seeds "
          f"{' '.join(map(str, args.seeds))}:\n")
    print(table)
    fields = list(dict.fromkeys(key for r in rows for key in r))
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    markdown = args.out.with_suffix(".md")
    markdown.write_text(table + "\n")
    print(f"\nwrote {args.out} and {markdown}")
    return 0
