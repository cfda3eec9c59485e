"""How much a segmentation moves from one set of strokes to the next: the defaults, one knob at a time, and
scikit-image's pipeline, on the shipped labelled micrographs.

    python benchmarks/bench_stroke_stability.py                 # Ni-superalloy images, 10 draws, every config
    python benchmarks/bench_stroke_stability.py --configs defaults "scikit-image" --draws 0 1 2
    python benchmarks/bench_stroke_stability.py --smoke         # 64-px crops of two images, two draws

Per image and draw d: the sparse protocol's strokes of ``alibi-vit segment benchmark`` (the project's
stroke generator, :func:`~alibi_vit.trainable.micrograph_benchmark.protocol_labels`, seeded by d and
the image's name), the same strokes for every configuration; train on the image's strokes, segment the
image, score mIoU against its ground truth. The classifier's seed is d too (as in the benchmark), except
in the configurations marked "classifier seed fixed", where only the strokes change: the difference
between the two shows what the classifier's own randomness adds to the spread.

Configurations (:data:`CONFIGS`): ``TrainableSegmenter()`` with its defaults; the same with one
setting changed (trees, depth, rows per tree, features per split, histogram bins, the thresholds left on
labelled values, no class balancing, a modal filter, the filters without the unblurred image); scikit-image's
pipeline,
``multiscale_basic_features(intensity=True, edges=False, texture=True, sigma_min=1, sigma_max=16)`` +
``RandomForestClassifier(50, max_depth=10, max_samples=0.05)`` (the settings of scikit-image's
trainable-segmentation example). Features are computed once per image and shared by every configuration
of its system, so the times are fit + predict (a configuration with other filters computes its own on its
first draw of each image).

Per configuration: the mean mIoU, the spread across draws (per image the population std of its ten
mIoUs, then the mean over images, as ``segment benchmark``'s summary gives it; also the std across draws
of the set's mean mIoU), a 95% bootstrap interval of the spread's difference to scikit-image's and to the
defaults' (draws resampled together for all configurations: the comparison is paired), the paired
difference of the mean to the defaults' ± its standard error, the correlation of its per-draw mIoU with
scikit-image's, and the mean fit + predict time per run. Then what a small design (4 images, 2 draws) would
see of the defaults' and scikit-image's spreads, and with ``--classifier-noise N`` the mIoU's std over N
classifier seeds on fixed strokes (the classifier's own share of the spread). Results: ``benchmarks/results/stroke_stability[_<name>].{json,md}`` and ``…_runs.csv`` (every run).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import command_line, environment, write_report  # noqa: E402

SKIMAGE = "scikit-image"


def alibi(classifier=None, segmenter=None, *, midway=True, balanced=True, fixed_seed=False) -> dict:
    """An alibi-vit configuration: ``TrainableSegmenter(classifier_params=classifier, **segmenter)``;
    ``midway`` False leaves the thresholds where XGBoost's histogram put them (on labelled values),
    ``balanced`` False fits without the class-balancing weights; ``fixed_seed``: classifier seed 0 on
    every draw (only the strokes change)."""
    return {"system": "alibi", "classifier_params": dict(classifier or {}), "segmenter": dict(segmenter or {}),
            "midway": midway, "balanced": balanced, "fixed_seed": fixed_seed}


# name: configuration. The classifier settings are those of xgboost.XGBRFClassifier over
# alibi_vit.trainable.classifier.DEFAULTS["random_forest"]; one knob at a time.
CONFIGS = {
    "defaults": alibi(),
    "defaults, classifier seed fixed": alibi(fixed_seed=True),
    "50 trees": alibi({"n_estimators": 50}),
    "100 trees": alibi({"n_estimators": 100}),
    "depth 6": alibi({"max_depth": 6}),
    "depth 10": alibi({"max_depth": 10}),
    "10% rows per tree": alibi({"subsample": 0.1}),
    "63% rows per tree": alibi({"subsample": 0.632}),
    "60% features per split": alibi({"colsample_bynode": 0.6}),
    "256 bins": alibi({"max_bin": 256}),
    "thresholds on labelled values": alibi(midway=False),
    "classes not balanced": alibi(balanced=False),
    "modal filter 3": alibi(segmenter={"modal": 3}),
    "no unblurred image (sigmas 1-16)": alibi(segmenter={"sigmas": (1, 2, 4, 8, 16)}),
    SKIMAGE: {"system": "skimage", "fixed_seed": False},
    f"{SKIMAGE}, classifier seed fixed": {"system": "skimage", "fixed_seed": True},
    # Tried once (benchmarks/results/stroke_stability.md names them), not in the default run:
    "min child weight 5": alibi({"min_child_weight": 5}),
    "leaf L2 1": alibi({"reg_lambda": 1.0}),
    "modal filter 5": alibi(segmenter={"modal": 5}),
    "10% features per split": alibi({"colsample_bynode": 0.1}),
    "50 trees, 5% rows": alibi({"n_estimators": 50, "subsample": 0.05}),
}
DEFAULT_CONFIGS = list(CONFIGS)[:list(CONFIGS).index("min child weight 5")]
# --classifier-noise: these configurations refitted with several classifier seeds on the same strokes.
NOISE_CONFIGS = ("defaults", "100 trees", SKIMAGE)


@contextmanager
def patched_fit(midway: bool, balanced: bool):
    """fit_classifier without its midway move and/or without class-balancing weights."""
    from alibi_vit.trainable import classifier

    keep = classifier.midpoint_thresholds, classifier.balanced_weights
    if not midway:
        classifier.midpoint_thresholds = lambda clf, X: clf
    if not balanced:
        classifier.balanced_weights = lambda y: np.ones(len(y), np.float32)
    try:
        yield
    finally:
        classifier.midpoint_thresholds, classifier.balanced_weights = keep


def skimage_features(image) -> np.ndarray:
    from skimage.feature import multiscale_basic_features
    from skimage.util import img_as_float32

    return multiscale_basic_features(img_as_float32(image), intensity=True, edges=False, texture=True,
                                     sigma_min=1, sigma_max=16)


def run_one(config, item, labels, seed, cache, feats):
    """(prediction 1..K, fit + predict seconds) of one configuration on one image's strokes."""
    if config["system"] == "skimage":
        from sklearn.ensemble import RandomForestClassifier

        F = feats[item.name]
        sel = labels > 0
        t0 = time.perf_counter()
        clf = RandomForestClassifier(n_estimators=50, max_depth=10, max_samples=0.05, n_jobs=-1, random_state=seed)
        clf.fit(F[sel], labels[sel])
        pred = clf.predict(F.reshape(-1, F.shape[-1])).reshape(F.shape[:2])
        return pred, time.perf_counter() - t0
    from alibi_vit.trainable.segmenter import TrainableSegmenter

    with patched_fit(config["midway"], config["balanced"]):
        t0 = time.perf_counter()
        seg = TrainableSegmenter(seed=seed, cache=cache, classifier_params=config["classifier_params"] or None,
                                 **config["segmenter"]).fit([item.image], [labels])
        pred = seg.predict([item.image])[0]
    return pred, time.perf_counter() - t0


def run(items, configs, draws, progress=True) -> list[dict]:
    from tqdm.auto import tqdm

    from alibi_vit.trainable.benchmark import mean_iou
    from alibi_vit.trainable.cache import FeatureCache
    from alibi_vit.trainable.micrograph_benchmark import class_ious, protocol_labels

    rows, feats = [], {}
    cache = FeatureCache()
    for item in items:  # warm the feature caches: every configuration's time is then fit + predict
        _warm(item, cache)
        if any(CONFIGS[c]["system"] == "skimage" for c in configs):
            feats[item.name] = skimage_features(item.image)
    jobs = [(item, d) for item in items for d in draws]
    for item, d in tqdm(jobs, desc="image × draw", disable=not progress):
        labels = protocol_labels(item, "sparse", d)
        if labels is None:
            continue
        for name in configs:
            pred, seconds = run_one(CONFIGS[name], item, labels, 0 if CONFIGS[name]["fixed_seed"] else d, cache, feats)
            row = {"configuration": name, "image": item.name, "split": item.split, "draw": d,
                   "labelled_pixels": int((labels > 0).sum()), "miou": mean_iou(pred, item.mask), "seconds": seconds}
            for c, iou in enumerate(class_ious(pred, item.mask, len(item.classes)), start=1):
                row[f"labelled_{c}"], row[f"iou_{c}"] = int((labels == c).sum()), iou
                row[f"area_{c}"] = float((pred == c).mean())
            rows.append(row)
    return rows


def classifier_noise(items, configs, draws, seeds, progress=True) -> list[dict]:
    """One row per configuration, image, draw and classifier seed: the same strokes refitted with each seed."""
    from tqdm.auto import tqdm

    from alibi_vit.trainable.benchmark import mean_iou
    from alibi_vit.trainable.cache import FeatureCache
    from alibi_vit.trainable.micrograph_benchmark import protocol_labels

    cache, feats, rows = FeatureCache(), {}, []
    for item in tqdm(items, desc="classifier noise", disable=not progress):
        _warm(item, cache)
        feats[item.name] = skimage_features(item.image)
        for d in draws:
            labels = protocol_labels(item, "sparse", d)
            if labels is None:
                continue
            for name in configs:
                for seed in seeds:
                    pred, _ = run_one(CONFIGS[name], item, labels, seed, cache, feats)
                    rows.append({"configuration": name, "image": item.name, "draw": d, "classifier_seed": seed,
                                 "miou": mean_iou(pred, item.mask)})
    return rows


def summarise_noise(rows, configs) -> list[dict]:
    """Per configuration: the population std of the mIoU over classifier seeds, per image and draw, then
    its mean (and range) over images and draws."""
    out = []
    for c in configs:
        groups = {}
        for r in rows:
            if r["configuration"] == c:
                groups.setdefault((r["image"], r["draw"]), []).append(r["miou"])
        stds = np.array([np.std(v) for v in groups.values()])
        out.append({"configuration": c, "classifier_std": float(stds.mean()), "min": float(stds.min()),
                    "max": float(stds.max()), "groups": len(stds)})
    return out


def _warm(item, cache):
    from alibi_vit.trainable.micrograph_benchmark import protocol_labels
    from alibi_vit.trainable.segmenter import TrainableSegmenter

    labels = protocol_labels(item, "sparse", 0)
    seg = TrainableSegmenter(cache=cache).fit([item.image], [labels])
    seg.predict([item.image])


def _table(rows, configs, images, draws):
    """{config: (images × draws) mIoU array}, {config: mean seconds per run}."""
    miou, secs = {}, {}
    for c in configs:
        m = np.full((len(images), len(draws)), np.nan)
        for r in rows:
            if r["configuration"] == c:
                m[images.index(r["image"]), draws.index(r["draw"])] = r["miou"]
        miou[c] = m
        secs[c] = float(np.mean([r["seconds"] for r in rows if r["configuration"] == c]))
    return miou, secs


def spread(m: np.ndarray) -> float:
    """Mean over images of the population std across draws (axis 1)."""
    return float(np.nanmean(np.nanstd(m, axis=1)))


def summarise(rows, configs, images, splits, draws, boot: int = 2000, seed: int = 0) -> list[dict]:
    """Per configuration: mean mIoU, spread (:func:`spread`), the same per split, per image, the std of the
    set's mean across draws, seconds per run, and the paired comparisons to scikit-image and the defaults
    (``spread_minus_*``: difference, 95% bootstrap interval over draws; ``mean_minus_defaults``: paired
    difference of the mean, its standard error over draws)."""
    miou, secs = _table(rows, configs, images, draws)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(draws), size=(boot, len(draws)))  # the same resampled draws for every config
    boot_spread = {c: np.array([spread(m[:, p]) for p in picks]) for c, m in miou.items()}
    ref = "defaults" if "defaults" in configs else None
    out = []
    for c in configs:
        m = miou[c]
        row = {"configuration": c, "mean_miou": float(np.nanmean(m)), "spread": spread(m),
               "std_of_set_mean": float(np.nanstd(np.nanmean(m, axis=0))), "seconds_per_run": secs[c],
               "by_split": {sp: {"mean": float(np.nanmean(m[sel])), "spread": spread(m[sel])}
                            for sp in ("train", "test") if (sel := [splits[im] == sp for im in images]) and any(sel)},
               "per_image": {im: {"mean": float(np.nanmean(m[i])), "std": float(np.nanstd(m[i]))}
                             for i, im in enumerate(images)}}
        for other, key in ((SKIMAGE, "spread_minus_skimage"), (ref, "spread_minus_defaults")):
            if other in miou and other != c:
                d = boot_spread[c] - boot_spread[other]
                row[key] = [row["spread"] - spread(miou[other]), *np.percentile(d, [2.5, 97.5]).tolist()]
        if SKIMAGE in miou and c != SKIMAGE:  # how far the two follow the same strokes: per image, over draws
            row["correlation_with_skimage"] = float(np.nanmean([np.corrcoef(a, b)[0, 1]
                                                                for a, b in zip(m, miou[SKIMAGE])]))
        if ref and c != ref:
            diff = np.nanmean(m - miou[ref], axis=0)  # per draw, over images
            row["mean_minus_defaults"] = [float(diff.mean()), float(diff.std(ddof=1) / np.sqrt(len(diff)))]
        out.append(row)
    return out


def few_draws(rows, images, draws, n_images: int = 4) -> dict | None:
    """What a small design would have seen: for every set of ``n_images`` images and every pair of draws, the
    spread of the defaults and of scikit-image's pipeline from those two draws alone (the sample std, ddof 1:
    |a - b| / sqrt 2, mean over the images). Their median and 5-95% range, and the 5-95% range of the
    difference (defaults - scikit-image). None without both configurations or with fewer than 3 draws."""
    from itertools import combinations

    configs = ["defaults", SKIMAGE]
    if len(draws) < 3 or not all(any(r["configuration"] == c for r in rows) for c in configs):
        return None
    miou, _ = _table(rows, configs, images, draws)
    k = min(n_images, len(images))
    subsets, pairs = [list(c) for c in combinations(range(len(images)), k)], list(combinations(range(len(draws)), 2))
    two = {c: np.array([np.mean(np.abs(miou[c][sub, a] - miou[c][sub, b])) / np.sqrt(2)
                        for sub in subsets for a, b in pairs]) for c in configs}
    diff = two["defaults"] - two[SKIMAGE]
    out = {"images": k, "designs": len(diff)}
    for c in configs:
        out[c] = {"median": float(np.median(two[c])), "p5_p95": np.percentile(two[c], [5, 95]).tolist()}
    out["difference_p5_p95"] = np.percentile(diff, [5, 95]).tolist()
    out["full_design_sample_std"] = {c: float(np.mean(np.nanstd(miou[c], axis=1, ddof=1))) for c in configs}
    return out


def markdown(summary, images, splits) -> list[str]:
    def interval(v):
        return f"{v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]" if v else ""

    split_names = [sp for sp in ("train", "test") if any(v == sp for v in splits.values())]
    lines = [("| configuration | mean mIoU | − defaults (paired ± s.e.) | spread across draws | − scikit-image [95%] | "
              "− defaults [95%] | " + "".join(f"{sp} split: mean, spread | " for sp in split_names)
              + "std of the set's mean | fit + predict (s) |"),
             "|---|" + "---:|" * (7 + len(split_names))]
    for r in summary:
        md = r.get("mean_minus_defaults")
        lines.append(f"| {r['configuration']} | {r['mean_miou']:.3f} | "
                     f"{f'{md[0]:+.3f} ± {md[1]:.3f}' if md else ''} | {r['spread']:.3f} | "
                     f"{interval(r.get('spread_minus_skimage'))} | {interval(r.get('spread_minus_defaults'))} | "
                     + "".join(f"{r['by_split'][sp]['mean']:.3f}, {r['by_split'][sp]['spread']:.3f} | "
                               for sp in split_names)
                     + f"{r['std_of_set_mean']:.3f} | {r['seconds_per_run']:.2f} |")
    corr = [f"{r['configuration']} {r['correlation_with_skimage']:.2f}" for r in summary
            if "correlation_with_skimage" in r]
    if corr:
        lines += ["", "Correlation of each configuration's per-draw mIoU with scikit-image's (per image, mean over "
                  "images): " + "; ".join(corr) + "."]
    lines += ["", "Per image: mean mIoU ± std across draws.", "",
              "| configuration | " + " | ".join(f"{im} ({splits[im]})" for im in images) + " |",
              "|---|" + "---:|" * len(images)]
    for r in summary:
        lines.append(f"| {r['configuration']} | " + " | ".join(
            f"{r['per_image'][im]['mean']:.3f} ± {r['per_image'][im]['std']:.3f}" for im in images) + " |")
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="super", help="super (default), ebc, isb or all")
    p.add_argument("--split", choices=("train", "test"), default=None)
    p.add_argument("--draws", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--name", default=None, help="suffix of the result files")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--classifier-noise", type=int, default=0, metavar="SEEDS",
                   help="also refit " + ", ".join(NOISE_CONFIGS) + " with this many classifier seeds on the strokes "
                        "of the first four draws (what the classifier's own randomness adds); 0: off")
    p.add_argument("--smoke", action="store_true", help="64-px crops of two images, two draws")
    args = p.parse_args(argv)

    from alibi_vit.trainable.classifier import DEFAULTS
    from alibi_vit.trainable.datasets import load_micrographs

    items = load_micrographs(args.dataset, split=args.split)
    if args.smoke:
        items, args.draws = [item.cropped(64) for item in items[:2]], [0, 1]
    load, t0 = os.getloadavg()[0], time.perf_counter()
    rows = run(items, args.configs, args.draws)
    images, splits = [i.name for i in items], {i.name: i.split for i in items}
    summary = summarise(rows, args.configs, images, splits, args.draws)
    small = few_draws(rows, images, args.draws)
    noise = None
    if args.classifier_noise:
        noise_draws, seeds = args.draws[:4], list(range(100, 100 + args.classifier_noise))
        noise = {"draws": noise_draws, "seeds": seeds, "summary": summarise_noise(
            classifier_noise(items, NOISE_CONFIGS, noise_draws, seeds), NOISE_CONFIGS)}
    command = command_line("bench_stroke_stability.py", argv)
    stem = "stroke_stability" + (f"_{args.name}" if args.name else "") + ("-smoke" if args.smoke else "")
    machine = f"{os.cpu_count()} CPU cores"
    env = environment()
    payload = {"command": command, **env, "machine": machine, "load_before": load, "load_after": os.getloadavg()[0],
               "seconds": time.perf_counter() - t0, "dataset": args.dataset, "split": args.split, "draws": args.draws,
               "images": images, "forest_defaults": DEFAULTS["random_forest"],
               "configs": {c: CONFIGS[c] for c in args.configs}, "summary": summary, "few_draws": small,
               "classifier_noise": noise}
    lines = [f"# Stability across stroke draws ({args.dataset}{', ' + args.split if args.split else ''})", "",
             f"Command: `{command}`", "",
             (f"{len(images)} images × {len(args.draws)} stroke draws (sparse protocol, draws "
              f"{' '.join(map(str, args.draws))}), the same strokes for every configuration. Defaults' forest: "
              f"{DEFAULTS['random_forest']}. Machine: {machine}, load average {load:.1f} at the start, "
              f"{payload['load_after']:.1f} at the end; {payload['seconds']:.0f} s in all (scores do not depend on "
              "the load; times do). Spread: per image the population std of the mIoU across draws, mean over "
              "images; intervals: 95% bootstrap over draws, paired."), "", *markdown(summary, images, splits)]
    if small:
        lines += ["", f"## What {small['images']} images × 2 draws would show", "",
                  (f"Every set of {small['images']} images and every pair of draws ({small['designs']} small designs): "
                   "the spread from two draws (sample std, |a − b| / √2, mean over the images)."), "",
                  "| configuration | median | 5–95% | all draws (sample std) |", "|---|---:|---:|---:|"]
        lines += [f"| {c} | {small[c]['median']:.3f} | {small[c]['p5_p95'][0]:.3f}–{small[c]['p5_p95'][1]:.3f} | "
                  f"{small['full_design_sample_std'][c]:.3f} |" for c in ("defaults", SKIMAGE)]
        lines += ["", ("Defaults − scikit-image in the same small design: 5–95% "
                       f"{small['difference_p5_p95'][0]:+.3f} to {small['difference_p5_p95'][1]:+.3f}.")]
    if noise:
        seeds = noise["seeds"]
        lines += ["", f"## The classifier's own randomness: the same strokes, classifier seeds {seeds[0]}-{seeds[-1]}",
                  "", (f"Per image and draw (draws {' '.join(map(str, noise['draws']))}), the population std of the "
                       f"mIoU over the {len(seeds)} seeds; mean (min-max) over images and draws."), "",
                  "| configuration | std over classifier seeds |", "|---|---:|"]
        lines += [f"| {r['configuration']} | {r['classifier_std']:.4f} ({r['min']:.4f}-{r['max']:.4f}) |"
                  for r in noise["summary"]]
    out_dir = args.out_dir or Path(__file__).resolve().parent / "results" / ("smoke" if args.smoke else "")
    md, js = write_report(out_dir, stem, payload, lines, smoke=args.smoke)
    with open(out_dir / f"{stem}_runs.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("\n".join(lines))
    print(f"wrote {md}, {js} and {out_dir / f'{stem}_runs.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
