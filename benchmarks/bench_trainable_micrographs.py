"""The runs behind the trainable segmentation's defaults, on the labelled micrograph set.

    python benchmarks/bench_trainable_micrographs.py --part train   # the choice: training split only
    alibi-vit segment benchmark --dataset all --split train --classifier random_forest xgboost \
        --filters compact weka --crf off gentle paper library --protocol sparse   # the same grid, sparse only
    python benchmarks/bench_trainable_micrographs.py --part test    # the report: test split only
    python benchmarks/bench_trainable_micrographs.py --smoke        # 64-px crops: checks the script

``train``: every classifier × filter set × CRF preset on the training split with sparse strokes
over three seeds; dense labels (one seed: only the classifiers' randomness varies there) for the
chosen filters and classifier with every CRF preset. The
defaults are the configuration with the best mean sparse mIoU among those that lose no training
image more than 0.01 mIoU with dense labels against the same pipeline without CRF, where a
setting costs no more than the whole segmentation without it (which rules the CRF out of the
default: docs/segmentation.md).

``test``: the chosen defaults with and without the CRF preset chosen with them, every protocol,
and the former defaults (XGBoost, Weka filters) with sparse strokes and the authors' scribbles,
on the test split. Results go to
``benchmarks/results/trainable_micrographs_<part>/`` (runs.csv, summary.csv, summary.md) with the
machine and load in summary.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CLASSIFIERS = {"random_forest": ("random_forest", {}), "xgboost": ("xgboost", {})}
CRFS = {"off": False, "gentle": ("gentle", {}), "paper": ("paper", {}), "library": ("library", {})}


def grids(part: str):
    """(features, classifiers, crfs, protocols) grids of one part: every combination within a grid runs.

    Dense labels cost most (a fit on up to 500 000 pixels, deep trees over every pixel), so they
    run for the default filters and classifier only, with every CRF setting."""
    default = ({"compact": {"filters": "compact"}}, {"random_forest": CLASSIFIERS["random_forest"]})
    if part == "train":
        return [({"compact": {"filters": "compact"}, "weka": {"filters": "weka"}}, CLASSIFIERS, CRFS, ("sparse",)),
                (*default, CRFS, ("dense",))]
    return [(*default, {"off": CRFS["off"], "gentle": CRFS["gentle"]}, ("sparse", "dense", "authors")),
            ({"weka": {"filters": "weka"}}, {"xgboost": CLASSIFIERS["xgboost"]}, {"off": False}, ("sparse", "authors"))]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("train", "test"), default="test")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--protocol", nargs="+", default=None,
                   help="only these protocols (default: sparse and dense for train, and authors for test); the "
                        "results folder is then named after them")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="64-px crops of two images, one seed")
    args = p.parse_args(argv)

    from alibi_vit.trainable.datasets import load_micrographs
    from alibi_vit.trainable.micrograph_benchmark import micrograph_benchmark

    items = load_micrographs("all", split=args.part)
    if args.smoke:
        items, args.seeds = [item.cropped(64) for item in items[:2]], [0]
    load, t0, rows = os.getloadavg()[0], time.perf_counter(), []
    protocols = []
    for features, classifiers, crfs, grid_protocols in grids(args.part):
        chosen = [p for p in grid_protocols if not args.protocol or p in args.protocol]
        protocols += [p for p in chosen if p not in protocols]
        rows += micrograph_benchmark(items, features, classifiers, crfs, protocols=chosen, seeds=args.seeds,
                                     dense_seeds=args.seeds[:1], progress=True)
    name = f"trainable_micrographs_{args.part}" + ("_" + "_".join(args.protocol) if args.protocol else "")
    out = args.out_dir or RESULTS / ("smoke" if args.smoke else "") / name
    what = (f"{len(items)} image(s), protocols {', '.join(protocols)}; sparse seeds {' '.join(map(str, args.seeds))}, "
            f"dense seed {args.seeds[0]}. Per image: label by the protocol, train on that image, segment it, score it.")
    return write_results(out, f"Trainable segmentation on the labelled micrographs: {args.part} split",
                         f"python benchmarks/bench_trainable_micrographs.py {' '.join(argv)}", what, load, t0, rows)


def write_results(out, title: str, command: str, what: str, load: float, t0: float, rows) -> int:
    """runs.csv, summary.csv and summary.md in ``out``, summary.md headed by the title, the command, what
    ran and the machine, load and time (since ``t0``, perf_counter); prints summary.md. Returns 0."""
    from alibi_vit.trainable.micrograph_benchmark import write_tables

    header = [f"# {title}", "", f"Command: `{command}`", "",
              f"{what} Machine: {os.cpu_count()} CPU cores, load average {load:.1f} at the start, "
              f"{os.getloadavg()[0]:.1f} at the end; {time.perf_counter() - t0:.0f} s in all (scores do not depend "
              "on the load).", ""]
    paths = write_tables(out, rows, header)
    print(paths[-1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
