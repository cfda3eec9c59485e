"""alibi-vit's trainable segmentation side by side with scikit-image's pipeline: accuracy and speed.

    python benchmarks/bench_trainable_peers.py            # both parts; results in benchmarks/results/
    python benchmarks/bench_trainable_peers.py --smoke    # small crops, one seed: checks the script

Accuracy: every image of the shipped labelled micrograph set (``alibi_vit.trainable.datasets``),
the protocols of ``alibi_vit.trainable.micrograph_benchmark`` (sparse strokes from the ground
truth over --seeds, dense labels, the interactive-seg-backend authors' scribbles), the very same
label images for every system: train on the image's labels, segment the image, score it.

Speed: the first segmentation of one image (features + fit + predict, nothing cached before),
best of --repeats, every system in the same run: a 1024² grey micrograph of the set (sparse
protocol, seed 0) and a 1024² colour image (scikit-image's immunohistochemistry image, a real
stained micrograph, resized from 512²; strokes drawn from a 3-level split of its luma).

Systems:
- ``alibi-vit``: ``TrainableSegmenter()`` with its defaults (classical features) and a
  :class:`FeatureCache`, so predict reuses the features fit computed (as the CLI and app do).
- ``scikit-image``: ``multiscale_basic_features`` (its defaults: intensity, edges, texture,
  σ 0.5-16) + scikit-learn's random forest with the settings of scikit-image's trainable
  segmentation example (50 trees, depth 10, 5% of the rows per tree, all cores), through
  ``skimage.future.fit_segmenter`` / ``predict_segmenter``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import command_line, environment, write_report  # noqa: E402


class AlibiVit:
    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.name = "alibi-vit (defaults" + "".join(f", {k} {v}" for k, v in kwargs.items()) + ")"

    def segment(self, image, labels, seed):
        from alibi_vit.trainable.cache import FeatureCache
        from alibi_vit.trainable.segmenter import TrainableSegmenter

        t0 = time.perf_counter()
        seg = TrainableSegmenter(seed=seed, cache=FeatureCache(), **self.kwargs).fit([image], [labels])
        t1 = time.perf_counter()
        mask = seg.predict([image])[0]
        t2 = time.perf_counter()
        return mask, {"fit_s": t1 - t0, "predict_s": t2 - t1}


class ScikitImage:
    name = "scikit-image (mbf + random forest)"

    def segment(self, image, labels, seed):
        from skimage.feature import multiscale_basic_features
        from skimage.future import fit_segmenter, predict_segmenter
        from skimage.util import img_as_float32
        from sklearn.ensemble import RandomForestClassifier

        t0 = time.perf_counter()
        colour = image.ndim == 3
        features = multiscale_basic_features(img_as_float32(image), channel_axis=-1 if colour else None)
        t1 = time.perf_counter()
        clf = RandomForestClassifier(n_estimators=50, n_jobs=-1, max_depth=10, max_samples=0.05, random_state=seed)
        clf = fit_segmenter(labels, features, clf)
        t2 = time.perf_counter()
        mask = predict_segmenter(features, clf)
        t3 = time.perf_counter()
        return mask, {"features_s": t1 - t0, "fit_s": t2 - t1, "predict_s": t3 - t2}


SYSTEMS = (AlibiVit, ScikitImage)
# Timed beside them: the default pipeline with its CRF preset switched on (what the CRF costs).
SPEED_ONLY = (lambda: AlibiVit(crf="gentle"),)


def accuracy(items, protocols, seeds, systems, dense_seeds=None, progress=True) -> list[dict]:
    """One row per system, protocol, image and seed, in the columns of micrograph_benchmark's runs."""
    from tqdm.auto import tqdm

    from alibi_vit.trainable.benchmark import mean_iou, pixel_accuracy
    from alibi_vit.trainable.micrograph_benchmark import protocol_labels

    jobs = [(item, p, s) for item in items for p in protocols
            for s in (dense_seeds if p == "dense" and dense_seeds is not None else seeds)
            if protocol_labels(item, p, s) is not None]
    rows = []
    for item, protocol, seed in tqdm(jobs, desc="accuracy", disable=not progress):
        labels = protocol_labels(item, protocol, seed)
        for system in systems:
            mask, _ = system.segment(item.image, labels, seed)
            rows.append({"configuration": system.name, "protocol": protocol, "image": item.name, "split": item.split,
                         "seed": seed, "labelled_pixels": int((labels > 0).sum()), "miou": mean_iou(mask, item.mask),
                         "pixel_accuracy": pixel_accuracy(mask, item.mask)})
    return rows


def colour_test_image(size: int):
    """(RGB uint8 image, labels): skimage's IHC image resized to size², strokes from a 3-level luma split."""
    import skimage.data
    from skimage.transform import resize

    from alibi_vit.trainable.scribbles import scribbles

    rgb = (resize(skimage.data.immunohistochemistry(), (size, size), order=1) * 255).round().astype(np.uint8)
    luma = rgb @ np.array([0.299, 0.587, 0.114])
    levels = np.digitize(luma, np.quantile(luma, [1 / 3, 2 / 3])) + 1
    return rgb, scribbles(levels, 3, rng=0, length=32)


def speed(grey, grey_labels, colour, colour_labels, systems, repeats) -> dict:
    """Per case and system: the best total of ``repeats`` first segmentations and that run's parts."""
    from alibi_vit.synthetic import synthetic_micrograph
    from alibi_vit.trainable.scribbles import scribbles

    small, small_mask = synthetic_micrograph(64, seed=0)
    small_labels = scribbles(small_mask, 2, rng=0)
    out = {}
    for case, image, labels in (("grey", grey, grey_labels), ("colour", colour, colour_labels)):
        for system in systems:
            warm = small if image.ndim == 2 else np.stack([(small >> 4).astype(np.uint8)] * 3, axis=-1)
            system.segment(warm, small_labels, 0)  # imports and thread pools start untimed
            best = None
            for _ in range(repeats):
                _, parts = system.segment(image, labels, 0)
                total = sum(parts.values())
                if best is None or total < best["total_s"]:
                    best = {"total_s": total, **parts}
            out[f"{case}/{system.name}"] = best
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="all")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--dense-seeds", type=int, nargs="+", default=[0],
                   help="seeds of the dense protocol (only the classifiers' own randomness varies)")
    p.add_argument("--protocol", nargs="+", default=["sparse", "dense", "authors"])
    p.add_argument("--repeats", type=int, default=3, help="speed: best of this many runs")
    p.add_argument("--size", type=int, default=1024, help="speed: side of the colour image")
    p.add_argument("--speed-image", default="ebc_040617_2_S127_2_0015", help="speed: the grey image of the set")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="64-px crops, one seed, one repeat")
    args = p.parse_args(argv)
    if args.smoke:
        args.seeds, args.repeats, args.size, args.speed_image = [0], 1, 64, "super_spot2_0d_0"

    from alibi_vit.trainable.datasets import load_micrographs
    from alibi_vit.trainable.micrograph_benchmark import markdown_tables, protocol_labels, summarise, write_tables

    systems = [s() for s in SYSTEMS]
    env = environment()
    command = command_line("bench_trainable_peers.py", argv)
    stem = "trainable_peers" + ("-smoke" if args.smoke else "")
    out_dir = args.out_dir or Path(__file__).resolve().parent / "results" / ("smoke" if args.smoke else "")
    machine = f"{os.cpu_count()} CPU cores"
    payload = {"command": command, "smoke": args.smoke, **env, "machine": machine, "load_before": os.getloadavg()[0]}
    lines = ["# Trainable segmentation side by side: alibi-vit and scikit-image" + (" (smoke)" if args.smoke else ""),
             "", f"Command: `{command}`", "",
             f"Machine: {machine}, load average {payload['load_before']:.1f} at the start; torch {env['torch']}; "
             f"{env['date']}.", ""]
    if not args.no_speed:
        item = load_micrographs("all", names=[args.speed_image])[0]
        if args.smoke:
            item = item.cropped(args.size)
        colour, colour_labels = colour_test_image(args.size)
        load = os.getloadavg()[0]
        timed = systems + [make() for make in SPEED_ONLY]
        times = speed(item.image, protocol_labels(item, "sparse", 0), colour, colour_labels, timed, args.repeats)
        payload["speed"] = {"load_before": load, "load_after": os.getloadavg()[0], "repeats": args.repeats,
                            "times": times}
        lines += [f"## Speed: first segmentation (features + fit + predict), best of {args.repeats}", "",
                  f"Grey: `{item.name}` ({item.image.shape[0]}×{item.image.shape[1]}, {item.image.dtype}), sparse "
                  f"protocol seed 0 ({int((protocol_labels(item, 'sparse', 0) > 0).sum())} labelled px). Colour: "
                  f"scikit-image's IHC image resized to {args.size}² RGB. Load average {load:.1f} before, "
                  f"{os.getloadavg()[0]:.1f} after (other work on the cores shows in wall times; the ratio is "
                  "measured side by side in one run).", "",
                  "| image | system | total (s) | parts (s) | ratio to scikit-image |", "|---|---|---:|---|---:|"]
        for case in ("grey", "colour"):
            ref = times[f"{case}/{ScikitImage.name}"]["total_s"]
            for system in timed:
                t = times[f"{case}/{system.name}"]
                parts = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in t.items() if k != "total_s")
                lines.append(f"| {case} | {system.name} | {t['total_s']:.2f} | {parts} | {t['total_s'] / ref:.2f} |")
        lines.append("")
    if not args.no_accuracy:
        items = load_micrographs(args.dataset)
        if args.smoke:
            items = [item.cropped(64) for item in items[:2]]
        rows = accuracy(items, args.protocol, args.seeds, systems, args.dense_seeds)
        table_dir = out_dir / f"{stem}_accuracy"
        write_tables(table_dir, rows)
        summary = summarise(rows)
        payload["accuracy"] = summary
        lines += ["## Accuracy: mIoU ± std over seeds (pixel accuracy), same labels for every system", "",
                  f"Per-run rows: `{table_dir.name}/runs.csv`.", ""]
        lines += markdown_tables(summary)
    md, js = write_report(out_dir, stem, payload, lines, smoke=args.smoke)
    print("\n".join(lines))
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
