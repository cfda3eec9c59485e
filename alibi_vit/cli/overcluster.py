"""``alibi-vit overcluster``: OverClustering mIoU of frozen backbones on Pascal VOC (docs/method.md §9).

``--recipe`` picks the protocol (:data:`alibi_vit.analysis.overclustering.RECIPES`), and with it the
defaults of ``--size``, ``--mask-size``, ``--seeds`` and ``--max-images``, so that a run compares with
one reference's table:

- ``leopart`` (default): Leopart's (Ziegler & Asano 2022): images at 448 px, the first 1,440 val
  images (Leopart's loader drops the last partial batch of 60), patch features standardised, PCA to
  50 dimensions, faiss k-means (random initialisation, 100 iterations, best of 5, 256 points per
  centroid) for seeds 0–4, cluster maps nearest-upsampled to the 100×100 masks.
- ``rasa``: the RASA reference's: images at 224 px, the first 640 val images (its README's tables:
  40 batches of 16), features bilinearly upsampled to the 224×224 masks and every pixel clustered
  (faiss, 50 iterations, best of 5, seed 1).
- ``kmeans++``: this project's earlier recipe (scikit-learn k-means++); its numbers compare with no
  reference table.

For each backbone, every image of the VOC split is resized to ``--size`` px (stretched, as the
segmentation probe does) and its final-normed patch features are kept as float16; its label mask
is resized (nearest) to ``--mask-size`` px. The features are reduced once per backbone; k-means
with each ``--k`` and each seed runs over them; clusters are mapped to classes (Hungarian for k =
21, many-to-one above), mIoU from one confusion matrix over the whole set, classes absent from
labels and predictions counted as IoU 0 (Leopart; ``--absent skip`` leaves them out).

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

from ..analysis.overclustering import RECIPES

__all__ = ["add_arguments", "backbone_features", "build_backbones", "comparison", "markdown_table", "parse_backbones",
           "positional_r2_of", "probe_miou", "recipe_settings", "run", "voc_datamodule", "voc_patch_features"]


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
    parser.add_argument("--year", type=int, default=2012, choices=(2007, 2012), help="Pascal VOC year (default 2012)")
    parser.add_argument("--split", default="val", help="ImageSets/Segmentation split (default val)")
    parser.add_argument("--recipe", choices=list(RECIPES), default="leopart",
                        help="the protocol: leopart (default: Leopart's faiss k-means, 448 px, masks at 100 px), "
                             "rasa (the RASA reference's: pixels of upsampled features, 224 px, first 640 images) "
                             "or kmeans++ (this project's earlier scikit-learn k-means++: comparable with no "
                             "reference table)")
    parser.add_argument("--size", type=int, default=None,
                        help="images are resized to SIZE×SIZE px (default: the recipe's, leopart/kmeans++ 448, "
                             "rasa 224)")
    parser.add_argument("--k", type=int, nargs="+", default=[21, 100, 300],
                        help="k-means clusters (default 21 100 300)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="k-means seeds; the table gives the mean and standard deviation (default: the "
                             "recipe's, leopart/kmeans++ 0 1 2 3 4, rasa 1)")
    parser.add_argument("--mask-size", type=int, default=None,
                        help="label masks are resized (nearest) to SIZE×SIZE px and scored per pixel (default: the "
                             "recipe's, leopart/kmeans++ 100, rasa the image size)")
    parser.add_argument("--absent", choices=("zero", "skip"), default="zero",
                        help="a class absent from labels and predictions: IoU 0 in the mean (zero, Leopart's "
                             "PredsmIoU; default) or left out (skip)")
    parser.add_argument("--max-images", type=_image_count, default=None, metavar="N|all",
                        help="only the first N images of the split (default: the recipe's, leopart 1440, rasa 640, "
                             "kmeans++ all)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per forward pass")
    parser.add_argument("--num-workers", type=int, default=4, help="data-loading processes (0: in this process)")
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


def _image_count(text: str):
    if text == "all":
        return "all"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of images or 'all', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--max-images must be at least 1, got {value}")
    return value


def recipe_settings(args) -> dict:
    """The recipe's inputs, each overridden where the command line gives one: size, mask size, seeds, images."""
    recipe = RECIPES[args.recipe]
    size = recipe.image_size if args.size is None else args.size
    max_images = recipe.max_images if args.max_images is None else args.max_images
    mask_size = args.mask_size if args.mask_size is not None else recipe.mask_size or size
    return {"size": size, "mask_size": mask_size,
            "seeds": tuple(recipe.seeds if args.seeds is None else args.seeds),
            "max_images": None if max_images == "all" else max_images}


def comparison(recipe, settings: dict, images: int, year: int, split: str) -> str:
    """Which reference table the run compares with, or how its inputs depart from that reference's."""
    expected_images = recipe.max_images or (1449 if (year, split) == (2012, "val") else images)
    departures = [f"{got} {what} (the reference: {want})" for what, got, want in (
        ("px", settings["size"], recipe.image_size),
        ("px masks", settings["mask_size"], recipe.mask_size or recipe.image_size),
        ("images", images, expected_images),
        ("as seeds", " ".join(map(str, settings["seeds"])), " ".join(map(str, recipe.seeds))),
        ("split", f"VOC{year} {split}", "VOC2012 val")) if got != want]
    if recipe.name == "kmeans++" or not departures:
        return f"compares with {recipe.compares_with}"
    return f"does not compare with {recipe.compares_with}: " + ", ".join(departures)


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

    from ..analysis.overclustering import reduce_for_overclustering, score_overclustering
    from .options import check_image_size, checkpoints_by_model

    recipe = RECIPES[args.recipe]
    settings = recipe_settings(args)
    check_image_size(settings["size"])
    if settings["mask_size"] < 1:
        raise ValueError(f"--mask-size must be positive, got {settings['mask_size']}")
    for k in args.k:
        if k < len(VOC_CLASSES):
            raise ValueError(f"--k {k} is fewer than VOC's {len(VOC_CLASSES)} classes; OverClustering needs k >= 21")
    if recipe.kmeans == "faiss":
        try:
            import faiss  # noqa: F401
        except ImportError:
            raise ValueError(f"--recipe {recipe.name} runs faiss's k-means, which is not installed: pip install "
                             "faiss-cpu (or --recipe kmeans++, which needs no faiss but compares with no "
                             "reference table)") from None
    labels_given = [label for label, _ in parse_backbones(args.backbones)]
    probes = checkpoints_by_model(args.probe_checkpoint, labels_given) if args.probe_checkpoint else {}
    for path in probes.values():
        if not Path(path).is_file():
            raise FileNotFoundError(f"probe checkpoint {path} does not exist")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after the work
    # the dataset is checked (layout, files) before any model is built or downloaded
    size = settings["size"]
    datamodule = voc_datamodule(args.data_root, args.year, args.split, size, args.batch_size, args.num_workers)
    rows = []
    for label, name, weights, model in build_backbones(args):
        start = time.perf_counter()
        features, masks = voc_patch_features(model, datamodule, settings["max_images"], settings["mask_size"])
        seconds = time.perf_counter() - start
        extra = {f"r2_{s}": positional_r2_of(model, s, args.r2_size) for s in args.r2_images}
        if label in probes:
            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            extra["probe_mIoU"] = probe_miou(probes[label], args.data_root, args.year, args.split, size,
                                             args.batch_size, args.num_workers, device)
        del model
        start = time.perf_counter()
        reduced = reduce_for_overclustering(features, masks, len(VOC_CLASSES), recipe)
        reduce_seconds = time.perf_counter() - start
        for k in args.k:
            t0 = time.perf_counter()
            result = score_overclustering(reduced, k, settings["seeds"], absent=args.absent)
            rows.append({"backbone": label, "model": name, "weights": weights, "recipe": recipe.name, "k": k,
                         "mIoU": result.miou, "mIoU_std": result.std, "mIoU_min": result.min,
                         "mIoU_max": result.max, "mIoU_per_seed": " ".join(f"{m:.6f}" for m in result.mious),
                         "seeds": " ".join(map(str, result.seeds)), "absent": args.absent, **extra,
                         "size": size, "mask_size": settings["mask_size"], "images": features.shape[0],
                         "patches": features.shape[0] * features.shape[1] * features.shape[2],
                         "points": reduced.points.shape[0], "scored_pixels": int((masks != 255).sum()),
                         "feature_s": round(seconds, 2), "reduce_s": round(reduce_seconds, 2),
                         "kmeans_s": round(time.perf_counter() - t0, 2),
                         "comparison": comparison(recipe, settings, features.shape[0], args.year, args.split),
                         **{f"IoU_{c}": v for c, v in zip(VOC_CLASSES, result.per_class_iou)}})
    table = markdown_table(rows, args.k, args.r2_images, bool(probes))
    first = rows[0]
    what = "pixels" if recipe.pixels else "patches"
    print(f"OverClustering mIoU, recipe {recipe.name}, on VOC{args.year} {args.split}: {first['images']} images at "
          f"{size} px, {first['points']} {what} clustered, {first['scored_pixels']} pixels scored at "
          f"{settings['mask_size']}×{settings['mask_size']}; mean ± std over seeds "
          f"{' '.join(map(str, settings['seeds']))}. The run {first['comparison']}.\n")
    print(table)
    fields = list(dict.fromkeys(key for r in rows for key in r))
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    markdown = args.out.with_suffix(".md")
    markdown.write_text(f"OverClustering recipe `{recipe.name}` ({first['images']} images at {size} px); the run "
                        f"{first['comparison']}.\n\n{table}\n")
    print(f"\nwrote {args.out} and {markdown}")
    return 0
