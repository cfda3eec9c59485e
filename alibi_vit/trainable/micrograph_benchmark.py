"""Benchmark of segmentation configurations on the labelled micrograph set (:mod:`.datasets`).

Per image, per protocol, per seed: label the image by the protocol, train a segmenter on that
image's labels, segment the whole image and score it against its ground truth (mIoU as
:func:`~.benchmark.mean_iou`, pixel accuracy). This is the interactive use: a person labels an
image and segments it.

Protocols (:data:`PROTOCOLS`):

- ``sparse``: strokes drawn from the ground truth by :func:`~.scribbles.scribbles` with the fixed
  settings :data:`SPARSE` (3 strokes per class, 32 steps, 3 px wide, more strokes until a class
  has 60 px): a few hundred labelled pixels. The strokes of seed s on image n come from the
  generator seeded with (s, crc32(n)), so they depend on neither the other images nor the order.
- ``dense``: every pixel labelled with its true class (``max_samples`` caps what trains).
- ``authors``: the scribbles the interactive-seg-backend authors drew, where the image has them
  (seed-independent; the seed still seeds the classifier).

A configuration is a feature setting (segmenter keyword arguments: filters, intensity,
backbone, …), a classifier and a CRF setting. The classifier is trained once per feature
setting, classifier, protocol, image and seed; every CRF setting then refines the same
probabilities, and features come from one shared :class:`~.cache.FeatureCache`, so a grid costs
little more than its classifiers.
"""

from __future__ import annotations

import csv
import zlib
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .benchmark import mean_iou, pixel_accuracy
from .cache import FeatureCache
from .crf import dense_crf_tiled
from .scribbles import scribbles
from .segmenter import CRF_OVERLAP, TrainableSegmenter

__all__ = ["PROTOCOLS", "SPARSE", "micrograph_benchmark", "protocol_labels", "summarise", "write_tables"]

PROTOCOLS = ("sparse", "dense", "authors")
SPARSE = dict(per_class=3, length=32, width=3, min_pixels=60)


def protocol_labels(item, protocol: str, seed: int) -> np.ndarray | None:
    """The label image (0 = unlabelled, 1..K) ``protocol`` gives image ``item`` (a
    :class:`~.datasets.LabelledMicrograph`) at ``seed``; None where it labels fewer than two classes
    (``authors`` on an image without them, or a crop that misses them): nothing to train on."""
    if protocol == "sparse":
        labels = scribbles(item.mask, rng=np.random.default_rng([seed, zlib.crc32(item.name.encode())]), **SPARSE)
    elif protocol == "dense":
        labels = item.mask
    elif protocol == "authors":
        labels = item.authors_scribbles
    else:
        raise ValueError(f"unknown protocol {protocol!r}; choose from {', '.join(PROTOCOLS)}")
    return labels if labels is not None and len(np.unique(labels[labels > 0])) >= 2 else None


def class_ious(pred: np.ndarray, truth: np.ndarray, k: int) -> list[float]:
    """IoU of each class 1..k (nan for a class in neither prediction nor ground truth)."""
    out = []
    for c in range(1, k + 1):
        p, t = pred == c, truth == c
        union = (p | t).sum()
        out.append(float((p & t).sum() / union) if union else float("nan"))
    return out


def micrograph_benchmark(items, features: dict, classifiers: dict, crfs: dict, protocols=("sparse",), seeds=(0, 1, 2),
                         dense_seeds=None, cache_bytes: int = 3 << 30, progress: bool = False) -> list[dict]:
    """One row per run: configuration, its parts, protocol, image, split, seed, labelled pixels,
    miou, pixel_accuracy and the IoU of each class (``iou_1``…).

    items: :class:`~.datasets.LabelledMicrograph` list. features: {name: TrainableSegmenter keyword
    arguments}. classifiers: {name: (kind, classifier_params)}. crfs: {name: False or (preset,
    crf_params)}. The same seed gives the same labels in every configuration. dense_seeds: the
    dense protocol's seeds (default ``seeds``; only the classifier's randomness varies there).
    """
    for p in protocols:
        if p not in PROTOCOLS:
            raise ValueError(f"unknown protocol {p!r}; choose from {', '.join(PROTOCOLS)}")
    cache = FeatureCache(cache_bytes)
    jobs = [(f, c, p, item, s) for item in items for f in features for c in classifiers for p in protocols
            for s in (dense_seeds if p == "dense" and dense_seeds is not None else seeds)
            if protocol_labels(item, p, s) is not None]
    rows = []
    for fname, cname, protocol, item, seed in tqdm(jobs, desc="benchmark", disable=not progress):
        labels = protocol_labels(item, protocol, seed)
        kind, params = classifiers[cname]
        seg = TrainableSegmenter(classifier=kind, classifier_params=params, seed=seed, cache=cache, **features[fname])
        seg.fit([item.image], [labels])
        x = seg.scale(item.image)
        proba = seg.predict_proba([x], scaled=True)[0]
        for crf_name, crf in crfs.items():
            q = proba if not crf else dense_crf_tiled(proba, x, seg.tile, CRF_OVERLAP, crf[0], **crf[1])
            pred = seg.mask_from_proba(q)
            k = len(item.classes)
            row = {"configuration": f"{fname} | {cname} | crf {crf_name}", "features": fname, "classifier": cname,
                   "crf": crf_name, "protocol": protocol, "image": item.name, "split": item.split, "seed": seed,
                   "labelled_pixels": int((labels > 0).sum()), "miou": mean_iou(pred, item.mask),
                   "pixel_accuracy": pixel_accuracy(pred, item.mask)}
            row.update({f"iou_{c}": v for c, v in enumerate(class_ious(pred, item.mask, k), start=1)})
            rows.append(row)
    return rows


def summarise(rows) -> list[dict]:
    """Per configuration and protocol: each image's mIoU and pixel accuracy over seeds (mean,
    population std, min, max), then overall rows per split and for all images ("overall train",
    "overall test", "overall"): the mean of the images' means, the mean and largest of their stds."""
    groups = {}
    for r in rows:
        groups.setdefault((r["configuration"], r["protocol"]), {}).setdefault((r["image"], r["split"]), []).append(r)
    out = []
    for (config, protocol), images in groups.items():
        per_image = []
        for (image, split), runs in images.items():
            row = {"configuration": config, "protocol": protocol, "image": image, "split": split, "seeds": len(runs)}
            for metric in ("miou", "pixel_accuracy"):
                v = np.array([r[metric] for r in runs], float)
                row.update({f"{metric}_mean": v.mean(), f"{metric}_std": v.std(), f"{metric}_min": v.min(),
                            f"{metric}_max": v.max()})
            per_image.append(row)
        out += per_image
        for label, split in (("overall train", "train"), ("overall test", "test"), ("overall", None)):
            sel = [r for r in per_image if split is None or r["split"] == split]
            if not sel:
                continue
            row = {"configuration": config, "protocol": protocol, "image": label, "split": split or "all",
                   "seeds": min(r["seeds"] for r in sel)}
            for metric in ("miou", "pixel_accuracy"):
                means, stds = [r[f"{metric}_mean"] for r in sel], [r[f"{metric}_std"] for r in sel]
                row.update({f"{metric}_mean": float(np.mean(means)), f"{metric}_std": float(np.mean(stds)),
                            f"{metric}_min": float(min(r[f"{metric}_min"] for r in sel)),
                            f"{metric}_max": float(max(r[f"{metric}_max"] for r in sel)),
                            f"{metric}_std_max": float(max(stds))})
            out.append(row)
    return out


def _write_csv(path: Path, rows) -> Path:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def markdown_tables(summary) -> list[str]:
    """Per protocol a table: a row per configuration, a column per image and overall, cells
    "mIoU ± std over seeds (pixel accuracy)"."""
    lines = []
    for protocol in dict.fromkeys(r["protocol"] for r in summary):
        rows = [r for r in summary if r["protocol"] == protocol]
        images = list(dict.fromkeys(r["image"] for r in rows))
        splits = {r["image"]: r["split"] for r in rows}
        header = [f"{i} ({splits[i]})" if not i.startswith("overall") else i for i in images]
        lines += [f"### Protocol `{protocol}`: mIoU ± std over seeds (pixel accuracy)", "",
                  "| configuration | " + " | ".join(header) + " |", "|---|" + "---:|" * len(images)]
        for config in dict.fromkeys(r["configuration"] for r in rows):
            cells = {r["image"]: r for r in rows if r["configuration"] == config}
            lines.append(f"| {config} | " + " | ".join(
                f"{c['miou_mean']:.3f} ± {c['miou_std']:.3f} ({c['pixel_accuracy_mean']:.3f})" if c else ""
                for c in (cells.get(i) for i in images)) + " |")
        lines.append("")
    return lines


def write_tables(out_dir, rows, header_lines=()) -> list[Path]:
    """runs.csv (every run), summary.csv (:func:`summarise`) and summary.md (``header_lines``, then
    :func:`markdown_tables`) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(rows)
    md = out / "summary.md"
    md.write_text("\n".join([*header_lines, *markdown_tables(summary)]) + "\n")
    return [_write_csv(out / "runs.csv", rows), _write_csv(out / "summary.csv", summary), md]
