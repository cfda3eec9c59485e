"""Time and memory of OverClustering's recipes (docs/method.md §9) at the sizes their references run.

Features are what ``alibi-vit overcluster`` holds after the backbone pass, float16 (B, h, w, C) maps
with their label masks, but synthetic (21 classes as rectangles on background, three sub-centres per
class, noise, a positional pattern shared by all images; 5 % of the mask pixels 255): only the
clustering and scoring are measured, the backbone pass is the segmentation probe's. Each recipe runs
in its own process, so its peak resident memory is its own:

- ``leopart``: 1,440 images × 32×32 patches (448 px / 14) × 384 channels, masks 100×100: the
  standardisation, faiss PCA and one k-means seed per k (the command runs 5 seeds: 5× the k-means
  time), then the scoring;
- ``rasa``: 80 images × 16×16 patches (224 px) upsampled to 224×224 pixels (4.0 M pixels: the PCA
  fits on the first 4,000,000, as the reference, and is applied in chunks), one seed; the reference
  scores 640 images (32 M pixels), whose dominant allocations the report computes;
- ``kmeans++``: the leopart input, scikit-learn k-means++ (5 restarts, ≤ 50 iterations over every
  point), k = 21 only by default: its time grows with points × k.

Reported per recipe: the reduction time, one k-means seed's time per k (with scoring), the mIoU on
the synthetic set, and the process's peak resident memory above what it held with the features in
place; beside it the dominant allocations computed from the sizes (float32 arrays of the
standardised rows the PCA is fitted on, and of the reduced points). ``--threads N`` limits the BLAS
and OpenMP pools and torch's (OpenMP threads busy-wait: on a loaded machine one thread can be much
faster than two).

Results go to ``benchmarks/results/overclustering_<device>.{md,json}``.

    python benchmarks/bench_overclustering.py                      # every recipe at its reference size
    python benchmarks/bench_overclustering.py --recipe leopart      # one recipe
    python benchmarks/bench_overclustering.py --smoke              # tiny sizes: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from report import command_line, environment, write_report  # noqa: E402

# images, patches per side, mask size, k values: the references' sizes (rasa: its 640 images cut to 80)
SIZES = {"leopart": (1440, 32, 100, (21, 100, 300)), "rasa": (80, 16, 224, (21, 100, 300)),
         "kmeans++": (1440, 32, 100, (21,))}
SMOKE_SIZES = {"leopart": (12, 8, 20, (21, 30)), "rasa": (4, 4, 28, (21, 30)), "kmeans++": (12, 8, 20, (21,))}
REFERENCE_RASA_IMAGES = 640


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=["all", *SIZES], default="all")
    p.add_argument("--dim", type=int, default=384, help="feature channels (default 384: ViT-S)")
    p.add_argument("--threads", type=int, default=None, help="limit BLAS/OpenMP pools to this many threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes; results to benchmarks/results/smoke/")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--json-out", type=Path, default=None, help=argparse.SUPPRESS)  # one recipe's run, for the parent
    return p.parse_args(argv)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def synthetic_maps(images: int, grid: int, dim: int, mask: int, seed: int = 0):
    """(images, grid, grid, dim) float16 features and (images, mask, mask) uint8 masks (see the module docstring)."""
    rng = np.random.default_rng(seed)
    labels = np.zeros((images, grid, grid), np.int64)
    for b in range(images):
        for _ in range(4):
            y0, x0 = rng.integers(0, max(1, grid - grid // 4), 2)
            hh, ww = rng.integers(max(2, grid // 7), max(3, grid // 2), 2)
            labels[b, y0:y0 + hh, x0:x0 + ww] = rng.integers(1, 21)
    centres = rng.normal(size=(21, 3, dim)).astype(np.float32)
    pattern = 0.5 * rng.normal(size=(grid, grid, dim)).astype(np.float32)
    features = np.empty((images, grid, grid, dim), np.float16)
    for b in range(images):
        sub = rng.integers(0, 3, (grid, grid))
        noise = rng.normal(size=(grid, grid, dim)).astype(np.float32)
        features[b] = centres[labels[b], sub] + noise + pattern
    idx = (np.arange(mask) * grid) // mask
    masks = labels[:, idx][:, :, idx].astype(np.uint8)
    masks[rng.random(masks.shape) < 0.05] = 255
    return features, masks


def run_recipe(recipe: str, dim: int, smoke: bool) -> dict:
    """One recipe in this process: reduce once, one k-means seed per k; times, mIoU and peak memory."""
    from alibi_vit.analysis.overclustering import RECIPES, reduce_for_overclustering, score_overclustering
    import faiss  # noqa: F401  (libraries loaded before the baseline: their code is not working set)
    import sklearn.cluster  # noqa: F401
    import torch  # noqa: F401

    images, grid, mask, ks = (SMOKE_SIZES if smoke else SIZES)[recipe]
    features, masks = synthetic_maps(images, grid, dim, mask)
    held = current_rss_mb()
    t0 = time.perf_counter()
    reduced = reduce_for_overclustering(features, masks, 21, recipe)
    reduce_s = time.perf_counter() - t0
    seed = RECIPES[recipe].seeds[0]
    runs = []
    for k in ks:
        t0 = time.perf_counter()
        summary = score_overclustering(reduced, k, seeds=(seed,))
        runs.append({"k": k, "seconds_per_seed": round(time.perf_counter() - t0, 1), "mIoU": round(summary.miou, 4)})
        print(f"{recipe} k={k}: {runs[-1]['seconds_per_seed']} s, mIoU {summary.miou:.4f}", flush=True)
    points, width = reduced.points.shape[0], features.shape[-1]
    pca_rows = RECIPES[recipe].pca_rows  # leopart: every row; rasa: the first 4 M; kmeans++: 200,000 random rows
    fit_rows = points if pca_rows is None else min(points, pca_rows)
    return {"recipe": recipe, "images": images, "grid": grid, "mask": mask, "dim": width, "points": points,
            "feature_mb_float16": round(features.nbytes / 2**20, 1), "rss_with_features_mb": round(held, 0),
            "reduce_s": round(reduce_s, 1), "runs": runs, "peak_above_features_mb": round(peak_rss_mb() - held, 0),
            "computed_fit_rows_mb": round(fit_rows * width * 4 / 2**20, 0),
            "computed_points_mb": round(points * reduced.points.shape[1] * 4 / 2**20, 0)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        import faiss  # noqa: F401  (threadpoolctl limits only the libraries loaded when it is called)
        import sklearn.cluster  # noqa: F401
        import torch  # noqa: F401
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.threads)
        torch.set_num_threads(args.threads)  # faiss's OpenMP calls can run on torch's runtime
    if args.json_out is not None:  # a child: one recipe
        args.json_out.write_text(json.dumps(run_recipe(args.recipe, args.dim, args.smoke)))
        return 0
    recipes = list(SIZES) if args.recipe == "all" else [args.recipe]
    results = []
    for recipe in recipes:
        child = (args.out_dir or ROOT / "benchmarks" / "results") / f".overclustering_{recipe}.json"
        child.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, __file__, "--recipe", recipe, "--dim", str(args.dim), "--json-out", str(child)]
        cmd += ["--smoke"] if args.smoke else []
        cmd += ["--threads", str(args.threads)] if args.threads else []
        subprocess.run(cmd, check=True)
        results.append(json.loads(child.read_text()))
        child.unlink()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    load = os.getloadavg()
    payload = {"command": command_line("bench_overclustering.py", argv if argv is not None else sys.argv[1:]),
               "environment": environment(), "device": f"CPU ({cores} cores)", "threads": args.threads,
               "load_average_at_end": [round(v, 2) for v in load], "results": results}
    md = [f"# OverClustering recipes on CPU ({cores} cores)", "", f"`{payload['command']}`", "",
          f"Synthetic float16 features, {args.dim} channels; BLAS/OpenMP threads: {args.threads or 'library default'}; "
          f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min). Times are one "
          "k-means seed per k, scoring included; peak memory is the process's resident peak above what it held with "
          "the features in place; the computed columns are the float32 arrays of the rows the PCA is fitted on and "
          "of the reduced points.", "",
          "| recipe | images | points | reduce (s) | k-means + score per seed (s) | mIoU (synthetic) | peak above "
          "features (MB) | PCA rows (MB, computed) | points (MB, computed) |",
          "|---|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in results:
        per_k = ", ".join(f"k={run['k']}: {run['seconds_per_seed']}" for run in r["runs"])
        mious = ", ".join(f"{run['mIoU']}" for run in r["runs"])
        md.append(f"| {r['recipe']} | {r['images']} | {r['points']:,} | {r['reduce_s']} | {per_k} | {mious} | "
                  f"{r['peak_above_features_mb']:,.0f} | {r['computed_fit_rows_mb']:,.0f} | "
                  f"{r['computed_points_mb']:,.0f} |")
    rasa = next((r for r in results if r["recipe"] == "rasa"), None)
    if rasa is not None and not args.smoke:
        pixels = REFERENCE_RASA_IMAGES * rasa["mask"] ** 2
        md += ["", f"At the RASA reference's {REFERENCE_RASA_IMAGES} images ({pixels:,} pixels) the same arrays are "
               f"{min(pixels, 4_000_000) * rasa['dim'] * 4 / 2**20:,.0f} MB (PCA rows, freed before the points are "
               f"filled) and {pixels * 50 * 4 / 2**20:,.0f} MB (points), computed, not measured."]
    md += ["", f"Environment: {payload['environment']}"]
    stem = "overclustering_cpu" if not args.smoke else "overclustering_cpu_smoke"
    md_path, _ = write_report(args.out_dir, stem, payload, md, smoke=args.smoke)
    print("\n".join(md))
    print(f"wrote {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
