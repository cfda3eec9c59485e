"""Time and memory of OverClustering (docs/method.md §9) at the size of the VOC12 val set.

Features are what ``alibi-vit overcluster`` holds after the backbone pass: 1,449 images × 37×37
patches (518 px, patch 14) × C = 384 channels in float16 (1.52 GB), with one uint8 label per
patch. They are synthetic here (21 class centres, several sub-clusters per class, Gaussian
noise; 5 % of the labels 255), since only the clustering and scoring are measured: the backbone
pass is the same as the segmentation probe's. For each k the run times
``alibi_vit.analysis.overclustering.overclustering`` with one seed (per-channel standardisation,
PCA to 50 dimensions, scikit-learn KMeans with 5 restarts and ≤ 50 iterations, then the matching and
the confusion matrix; the ``overcluster`` command runs 5 seeds and scores pixels, so it takes about
5× the k-means time) and records the process's peak resident
memory above what it held with the features in place: the k-means working set.

Results go to ``benchmarks/results/overclustering_<device>.{md,json}``.

    python benchmarks/bench_overclustering.py                 # the full VOC12 val size, k = 21 100 300
    python benchmarks/bench_overclustering.py --smoke         # 60 images, k = 21 30: checks the script
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from report import command_line, environment, write_report  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=1449, help="images (default: VOC12 val, 1449)")
    p.add_argument("--grid", type=int, default=37, help="patches per side (default 37: 518 px / 14)")
    p.add_argument("--dim", type=int, default=384, help="feature channels (default 384: ViT-S)")
    p.add_argument("--k", type=int, nargs="+", default=[21, 100, 300])
    p.add_argument("--smoke", action="store_true", help="60 images, k = 21 30; results to benchmarks/results/smoke/")
    p.add_argument("--out-dir", type=Path, default=None)
    return p.parse_args(argv)


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def synthetic_features(m: int, dim: int, seed: int = 0, chunk: int = 1 << 16):
    """(m, dim) float16 features and (m,) uint8 labels: 21 classes × 4 sub-clusters plus noise, 5 % ignored."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(21 * 4, dim)).astype(np.float32)
    features = np.empty((m, dim), dtype=np.float16)
    labels = np.empty(m, dtype=np.uint8)
    for start in range(0, m, chunk):
        n = min(chunk, m - start)
        blob = rng.integers(0, 21 * 4, n)
        features[start:start + n] = centres[blob] + rng.normal(scale=1.5, size=(n, dim)).astype(np.float32)
        lab = (blob // 4).astype(np.uint8)
        lab[rng.random(n) < 0.05] = 255
        labels[start:start + n] = lab
    return features, labels


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.images, args.k = 60, [21, 30]
    from alibi_vit.analysis.overclustering import overclustering
    import scipy.optimize  # noqa: F401  (libraries loaded before the baseline: their code is not working set)
    import sklearn.cluster  # noqa: F401

    backend = "standardise + PCA 50 + scikit-learn KMeans (5 restarts, 50 iterations)"
    m = args.images * args.grid ** 2
    t0 = time.perf_counter()
    features, labels = synthetic_features(m, args.dim)
    make_s = time.perf_counter() - t0
    feature_mb = features.nbytes / 2**20
    held_mb = current_rss_mb()
    runs = []
    for k in args.k:
        t0 = time.perf_counter()
        result = overclustering(features, labels, k, 21, seed=0)
        seconds = time.perf_counter() - t0
        runs.append({"k": k, "seconds": round(seconds, 1), "mIoU": round(result.miou, 4),
                     "peak_rss_mb": round(peak_rss_mb(), 0)})
        print(f"k={k}: {seconds:.1f} s, mIoU {result.miou:.4f}, peak RSS {peak_rss_mb():.0f} MB", flush=True)
    working = max(r["peak_rss_mb"] for r in runs) - held_mb
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    payload = {"command": command_line("bench_overclustering.py", argv if argv is not None else sys.argv[1:]),
               "environment": environment(), "device": f"CPU ({cores} cores)", "backend": backend,
               "points": m, "dim": args.dim, "feature_mb_float16": round(feature_mb, 1),
               "rss_with_features_mb": round(held_mb, 0), "kmeans_working_set_mb": round(working, 0),
               "feature_generation_s": round(make_s, 1), "runs": runs}
    md = [f"# OverClustering on CPU ({cores} cores), {backend}", "",
          f"`{payload['command']}`", "",
          f"{m:,} patches ({args.images} images × {args.grid}×{args.grid}) × {args.dim} channels: "
          f"features {feature_mb:,.0f} MB in float16; process RSS with them in place {held_mb:,.0f} MB; "
          f"peak above that during clustering (k-means working set, matching, scoring): {working:,.0f} MB.", "",
          "| k | time (s) | mIoU (synthetic) | peak RSS (MB) |", "|---:|---:|---:|---:|"]
    md += [f"| {r['k']} | {r['seconds']} | {r['mIoU']} | {r['peak_rss_mb']:.0f} |" for r in runs]
    md += ["", f"Environment: {payload['environment']}"]
    stem = "overclustering_cpu" if not args.smoke else "overclustering_cpu_smoke"
    md_path, _ = write_report(args.out_dir, stem, payload, md, smoke=args.smoke)
    print("\n".join(md))
    print(f"wrote {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
