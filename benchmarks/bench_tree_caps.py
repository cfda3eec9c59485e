"""The random forest's size against its accuracy and its prediction time: which depth and tree count to default to.

    python benchmarks/bench_tree_caps.py                       # writes benchmarks/results/tree_caps_cpu.{md,json}
    python benchmarks/bench_tree_caps.py --smoke               # two configurations, one image, one seed
    python benchmarks/bench_tree_caps.py --protocol dense --configs 12,25 8,15 6,15 --seeds 0 --stem tree_caps_dense_cpu

Prediction is most of a first segmentation of a large image (at 4096², 24 of the 40 s of `segment apply` on the
2-core CPU), and its cost grows with the forest: XGBoost's random forest grows one tree per class per member, each
up to ``max_depth`` levels. For each configuration (``max_depth`` × ``n_estimators``, the other parameters the
defaults'), this reports:

- accuracy: mIoU on the nine labelled real micrographs shipped with the package (``--protocol sparse``: a few
  hundred stroked pixels per class, seeds 0-2, the same labels for every configuration; ``dense``: every
  labelled pixel of the training half), as ``segment benchmark --dataset all`` computes it, and on the
  generated texture-only image of the first-segmentation benchmark (5 strokes per class);
- prediction time: ``predict_proba`` on a 2048² image (the classifier only, features computed beforehand,
  median of 3 in this process after one warm-up call), and the forest's node count.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import command_line, environment, load_average, write_report

DEPTHS = (6, 8, 10, 12)
TREES = (15, 25)


def forest_nodes(clf) -> int:
    return int(sum(len(tree) for tree in clf.get_booster().trees_to_dataframe().groupby("Tree").groups.values()))


def prediction_seconds(clf, feats: np.ndarray, repeats: int = 3) -> float:
    rows = np.ascontiguousarray(feats.reshape(-1, feats.shape[-1]))
    clf.predict_proba(rows[:4096])  # warm-up: threads started, model loaded into the predictor
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        clf.predict_proba(rows)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--protocol", choices=("sparse", "dense"), default="sparse")
    p.add_argument("--configs", nargs="+", default=None, metavar="DEPTH,TREES",
                   help=f"configurations (default: every depth of {DEPTHS} with {TREES} trees)")
    p.add_argument("--stem", default="tree_caps_cpu", help="results file name")
    args = p.parse_args(argv)

    from alibi_vit.trainable import TrainableSegmenter, load_micrographs
    from alibi_vit.trainable.classifier import DEFAULTS
    from alibi_vit.trainable.micrograph_benchmark import mean_iou, micrograph_benchmark, summarise
    from alibi_vit.trainable.scribbles import scribbles
    from benchmarks.bench_first_segmentation import make_image

    configs = ([tuple(int(v) for v in c.split(",")) for c in args.configs] if args.configs
               else [(d, n) for n in TREES for d in DEPTHS])
    if args.smoke:
        configs, args.seeds = [(6, 15), (12, 25)], [0]
    items = load_micrographs("all")[:1 if args.smoke else None]
    size = 256 if args.smoke else 2048
    image, truth = make_image("texture", size, 0)
    strokes = scribbles(truth, 5, rng=0)
    base = DEFAULTS["random_forest"]
    rows = []
    for depth, trees in configs:
        params = {"max_depth": depth, "n_estimators": trees}
        started = time.perf_counter()
        runs = micrograph_benchmark(items, {"compact": {}}, {"rf": ("random_forest", params)}, {"off": False},
                                    protocols=(args.protocol,), seeds=args.seeds, dense_seeds=args.seeds)
        overall = next(r for r in summarise(runs) if r["image"] == "overall")
        seg = TrainableSegmenter(classifier_params=params, progress=False).fit([image], [strokes])
        feats = seg.features(image)
        mask = seg.predict([image])[0]
        row = {"max_depth": depth, "n_estimators": trees, "micrographs_miou": overall["miou_mean"],
               "micrographs_miou_std": overall["miou_std"],
               "per_image": {r["image"]: r["miou_mean"] for r in summarise(runs) if not r["image"].startswith("overall")},
               "texture_miou": mean_iou(mask, truth), "predict_s": prediction_seconds(seg.model_, feats),
               "predicted_px": int(feats.shape[0] * feats.shape[1]), "nodes": forest_nodes(seg.model_),
               "features": int(feats.shape[-1]), "seconds": time.perf_counter() - started, "load": load_average()}
        rows.append(row)
        print({k: v for k, v in row.items() if k != "per_image"}, flush=True)
    default = next((r for r in rows if (r["max_depth"], r["n_estimators"]) == (base["max_depth"], base["n_estimators"])),
                   rows[-1])
    payload = {"command": command_line("bench_tree_caps.py", argv or sys.argv[1:]), "environment": environment(),
               "defaults": base, "protocol": args.protocol, "seeds": args.seeds, "rows": rows}
    lines = ["# Random-forest size: accuracy and prediction time (2-core CPU)", "",
             f"Other parameters as the defaults ({', '.join(f'{k}={v}' for k, v in base.items() if k not in ('max_depth', 'n_estimators'))}); "
             f"mIoU over the {len(items)} shipped micrographs ({args.protocol} protocol, seeds {', '.join(map(str, args.seeds))}) and the "
             f"generated texture-only {size}² image (5 strokes per class); prediction: `predict_proba` of {size}² "
             "precomputed features, median of 3.", "",
             "| max_depth | trees | mIoU micrographs | mIoU texture | predict (s) | × default | nodes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['max_depth']} | {r['n_estimators']} | {r['micrographs_miou']:.4f} ± {r['micrographs_miou_std']:.4f} | "
              f"{r['texture_miou']:.4f} | {r['predict_s']:.2f} | {r['predict_s'] / default['predict_s']:.2f} | {r['nodes']} |"
              for r in rows]
    lines += ["", f"`{payload['command']}`"]
    md, js = write_report(None, args.stem, payload, lines, smoke=args.smoke)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
