"""Why sparse strokes score as they do: feature sets × classifiers on the labelled micrographs.

    python benchmarks/bench_trainable_sparse_diagnosis.py --split train --seeds 0 1 2 3 4 5 6 7 8 9
    python benchmarks/bench_trainable_sparse_diagnosis.py --images isb_tem --seeds 0 1 2 3 4 5 6 7 8 9
    python benchmarks/bench_trainable_sparse_diagnosis.py --features compact --name midpoints \
        --classifiers "forest (defaults)" "forest, thresholds on labelled values"
    python benchmarks/bench_trainable_sparse_diagnosis.py --smoke

The sparse protocol of ``alibi-vit segment benchmark`` (the very same strokes per image and
seed), but each system is a pair taken apart: a feature set (``compact``, the project's
default, on the image scaled as the segmenter scales it; ``skimage``, scikit-image's
``multiscale_basic_features`` with its defaults) and a classifier (the project's forest with
its current defaults or with other settings, or without the thresholds moved midway between
labelled values, or scikit-learn's random forest with the settings of scikit-image's
trainable-segmentation example). Crossing them separates what the features
do from what the classifier does. Every run also records each class's labelled pixels, IoU and
predicted area fraction (``runs.csv``), so a loss can be traced to one class.

Results go to ``benchmarks/results/trainable_sparse_diagnosis_<name>/`` (runs.csv, summary.csv,
summary.md, the machine and load in summary.md). Scores do not depend on the load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_trainable_micrographs import write_results  # noqa: E402
from report import command_line  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# The project's forest (classifier.DEFAULTS: 25 trees of depth 12 on 30% of the rows, 30% of the features
# per split, 128 histogram bins), then one or two of its settings changed.
FORESTS = {
    "forest (defaults)": {},
    "forest, 1024 bins": {"max_bin": 1024},
    "forest, 20% features per split": {"colsample_bynode": 0.2},
    "forest, no leaf regularisation": {"reg_lambda": 0.0, "min_child_weight": 0.0},
    "forest, 10% rows": {"subsample": 0.1},
    "forest, 50 trees, 5% rows": {"n_estimators": 50, "subsample": 0.05},
    "forest, 50 trees, 10% rows": {"n_estimators": 50, "subsample": 0.1},
    "forest, 50 trees, 15% rows": {"n_estimators": 50, "subsample": 0.15},
    "forest, 100 trees, 10% rows": {"n_estimators": 100, "subsample": 0.1},
    # XGBoost's exact method: thresholds midway between the tree's own sorted values, no shared
    # histogram bins; it samples features per level, not per split.
    "forest, exact splits": {"tree_method": "exact", "colsample_bynode": 1.0, "colsample_bylevel": 0.3},
}
# The default forest as XGBoost fits it, before fit_classifier moves its thresholds midway between labelled values.
HISTOGRAM_THRESHOLDS = "forest, thresholds on labelled values"
SKLEARN = "scikit-learn forest (scikit-image example)"


def features(item, kind: str) -> np.ndarray:
    """(H, W, F) float32 features of ``item``'s image."""
    if kind == "compact":
        from alibi_vit.trainable.classical import classical_features
        from alibi_vit.trainable.segmenter import TrainableSegmenter

        seg = TrainableSegmenter(filters="compact")
        seg._prepare([item.image], fit=True)  # the intensity range a fit on this image uses
        return classical_features(seg.scale(item.image), filters="compact", intensity=None)
    from skimage.feature import multiscale_basic_features
    from skimage.util import img_as_float32

    return multiscale_basic_features(img_as_float32(item.image))


def classify(name: str, X, y, F, seed: int) -> np.ndarray:
    """Class indices 0..K-1 of every pixel of F (H, W, F) by classifier ``name`` fitted on rows X, y."""
    rows = F.reshape(-1, F.shape[-1])
    if name == SKLEARN:
        from sklearn.ensemble import RandomForestClassifier

        clf = RandomForestClassifier(n_estimators=50, max_depth=10, max_samples=0.05, n_jobs=-1, random_state=seed)
        return clf.fit(X, y).predict(rows).reshape(F.shape[:2])
    from alibi_vit.trainable.classifier import balanced_weights, fit_classifier, make_classifier

    if name == HISTOGRAM_THRESHOLDS:
        clf = make_classifier("random_forest", seed=seed, n_jobs=1).fit(X, y, sample_weight=balanced_weights(y))
        clf.set_threads(None)
    else:
        clf = fit_classifier("random_forest", X, y, seed=seed, params=FORESTS[name])
    return clf.predict(rows).reshape(F.shape[:2])


def diagnose(items, systems, seeds, progress=True) -> list[dict]:
    """One row per system (feature set, classifier), image and seed, in micrograph_benchmark's columns plus
    each class's labelled pixels and predicted area fraction."""
    from tqdm.auto import tqdm

    from alibi_vit.trainable.benchmark import mean_iou, pixel_accuracy
    from alibi_vit.trainable.micrograph_benchmark import class_ious, protocol_labels

    rows = []
    for item in tqdm(items, desc="images", disable=not progress):
        feats = {kind: features(item, kind) for kind in dict.fromkeys(f for f, _ in systems)}
        k = len(item.classes)
        for seed in seeds:
            labels = protocol_labels(item, "sparse", seed)
            if labels is None:
                continue
            sel = labels > 0
            for kind, clf in systems:
                F = feats[kind]
                pred = classify(clf, F[sel], labels[sel] - 1, F, seed) + 1
                row = {"configuration": f"{kind} | {clf}", "features": kind, "classifier": clf, "protocol": "sparse",
                       "image": item.name, "split": item.split, "seed": seed, "labelled_pixels": int(sel.sum()),
                       "miou": mean_iou(pred, item.mask), "pixel_accuracy": pixel_accuracy(pred, item.mask)}
                row.update({f"iou_{c}": v for c, v in enumerate(class_ious(pred, item.mask, k), start=1)})
                row.update({f"labelled_{c}": int((labels == c).sum()) for c in range(1, k + 1)})
                row.update({f"area_{c}": float((pred == c).mean()) for c in range(1, k + 1)})
                rows.append(row)
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--split", choices=("train", "test"), default=None, help="only this split's images")
    p.add_argument("--images", nargs="+", default=None, help="only these images")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--features", nargs="+", default=["compact", "skimage"], choices=("compact", "skimage"))
    p.add_argument("--classifiers", nargs="+", default=["forest (defaults)", SKLEARN],
                   choices=[*FORESTS, HISTOGRAM_THRESHOLDS, SKLEARN])
    p.add_argument("--name", default=None, help="results folder suffix (default: the split or the images)")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="64-px crops of two images, one seed")
    args = p.parse_args(argv)

    from alibi_vit.trainable.datasets import load_micrographs

    items = load_micrographs("all", split=args.split, names=args.images)
    if args.smoke:
        items, args.seeds = [item.cropped(64) for item in items[:2]], [0]
    systems = [(f, c) for f in args.features for c in args.classifiers]
    load, t0 = os.getloadavg()[0], time.perf_counter()
    rows = diagnose(items, systems, args.seeds)
    name = args.name or args.split or "_".join(args.images or ["all"])
    out = args.out_dir or RESULTS / ("smoke" if args.smoke else "") / f"trainable_sparse_diagnosis_{name}"
    what = (f"{len(items)} image(s), sparse protocol, seeds {' '.join(map(str, args.seeds))}. Each class's labelled "
            "pixels, IoU and predicted area are in runs.csv.")
    return write_results(out, f"Sparse strokes taken apart: feature sets × classifiers ({name})",
                         command_line("bench_trainable_sparse_diagnosis.py", argv), what, load, t0, rows)

if __name__ == "__main__":
    sys.exit(main())
