"""alibi-vit's trainable segmentation side by side with napari-convpaint on the shipped micrographs.

    python benchmarks/bench_convpaint.py --convpaint-python /tmp/convpaint-venv/bin/python
    python benchmarks/bench_convpaint.py --convpaint-python ... --smoke   # 64-px crops, one seed

napari-convpaint is not a dependency: it runs in its own environment, whose Python is
``--convpaint-python`` (or ``$CONVPAINT_PYTHON``). This script calls it as a subprocess that reads
the image and label images as ``.npy`` files and writes its predictions as ``.npy`` files
(``--worker``, which imports nothing of alibi-vit). How the environment used for the committed
results was made (no torch of its own; it borrows alibi-vit's)::

    python3 -m venv /tmp/convpaint-venv
    /tmp/convpaint-venv/bin/pip install --no-deps napari-convpaint==1.2.0 catboost einops omegaconf \
        antlr4-python3-runtime napari-annotation-project napari-guitils six
    echo <alibi-vit's venv>/lib/python3.11/site-packages \
        > /tmp/convpaint-venv/lib/python3.11/site-packages/zz_devvenv.pth   # torch, timm, napari, skimage …

Accuracy: the nine labelled micrographs of ``alibi_vit.trainable.load_micrographs("all")``, the
sparse protocol's strokes (``micrograph_benchmark.protocol_labels(item, "sparse", seed)``) for each
seed, the very same label image for both systems; train on the image's strokes, segment the image,
score with ``micrograph_benchmark.mean_iou``. Per image: mean ± std over seeds for each system and
the paired difference (alibi-vit − convpaint) ± its standard error.

Systems:
- ``alibi-vit``: ``TrainableSegmenter(seed=seed)`` with its defaults (classical features, with a
  :class:`FeatureCache` as the app and the napari plugin keep one; it changes no result).
- ``convpaint``: ``ConvpaintModel(alias="gaussian")`` with that extractor's defaults (the one
  extractor that runs offline: VGG16, ConvNeXt, EfficientNet, DINOv2/v3 download their weights),
  ``train`` then ``segment``. Its CatBoost classifier has a fixed seed (0), so only the strokes vary.

Speed and memory: the first segmentation of one image in a fresh process (imports + reading the
.npy files + train + segment), wall time and peak RSS from ``/usr/bin/time -v``, median of
``--repeats`` processes per system.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()


# --------------------------------------------------------------------------------------------------
# Worker: runs inside either environment; reads jobs (image .npy, labels .npy, output .npy).


def _worker(system: str, jobs_file: str) -> int:
    jobs = json.loads(Path(jobs_file).read_text())
    if system == "convpaint":
        import warnings

        warnings.filterwarnings("ignore")
        from napari_convpaint.convpaint_model import ConvpaintModel

        def segment(image, labels, seed):
            model = ConvpaintModel(alias="gaussian")
            model.train(image, labels)
            return np.asarray(model.segment(image))
    else:
        from alibi_vit.trainable.cache import FeatureCache
        from alibi_vit.trainable.segmenter import TrainableSegmenter

        def segment(image, labels, seed):
            seg = TrainableSegmenter(seed=seed, cache=FeatureCache()).fit([image], [labels])
            return seg.predict([image])[0]

    times = []
    for job in jobs:
        image, labels = np.load(job["image"]), np.load(job["labels"])
        t0 = time.perf_counter()
        pred = segment(image, labels, job.get("seed", 0))
        times.append(time.perf_counter() - t0)
        np.save(job["out"], np.asarray(pred).astype(np.uint8))
    if len(jobs) > 0 and "times" in jobs[0]:
        Path(jobs[0]["times"]).write_text(json.dumps(times))
    return 0


# --------------------------------------------------------------------------------------------------
# Driver: runs in alibi-vit's environment.


def _python(system: str, convpaint_python: str) -> str:
    return convpaint_python if system == "convpaint" else sys.executable


def run_jobs(system: str, jobs: list[dict], convpaint_python: str) -> list[float]:
    """Run ``jobs`` in one process of ``system``'s environment; per-job seconds of train + segment."""
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [dict(j) for j in jobs]
        jobs[0]["times"] = str(Path(tmp) / "times.json")
        jf = Path(tmp) / "jobs.json"
        jf.write_text(json.dumps(jobs))
        # stdout off: CatBoost prints every iteration.
        subprocess.run([_python(system, convpaint_python), str(HERE), "--worker", system, str(jf)], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads(Path(jobs[0]["times"]).read_text())


def first_segmentation(system: str, image: np.ndarray, labels: np.ndarray, convpaint_python: str) -> dict:
    """One fresh process segmenting one image: wall seconds and peak RSS (MiB) from /usr/bin/time -v."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        np.save(t / "image.npy", image)
        np.save(t / "labels.npy", labels)
        jf = t / "jobs.json"
        jf.write_text(json.dumps([{"image": str(t / "image.npy"), "labels": str(t / "labels.npy"),
                                   "out": str(t / "out.npy"), "seed": 0}]))
        proc = subprocess.run(["/usr/bin/time", "-v", _python(system, convpaint_python), str(HERE), "--worker",
                               system, str(jf)], capture_output=True, text=True, check=False)
        err = proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"{system} worker failed:\n{err[-3000:]}")
        wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", err).group(1)
        parts = [float(x) for x in wall.split(":")]
        seconds = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
        rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1))
        return {"wall_s": seconds, "peak_rss_mib": rss_kb / 1024}


def accuracy(items, seeds, convpaint_python: str, workdir: Path) -> list[dict]:
    from alibi_vit.trainable.micrograph_benchmark import mean_iou, protocol_labels

    jobs, meta = [], []
    for item in items:
        np.save(workdir / f"{item.name}.image.npy", item.image)
        for seed in seeds:
            labels = protocol_labels(item, "sparse", seed)
            lab = workdir / f"{item.name}.{seed}.labels.npy"
            np.save(lab, labels)
            jobs.append({"image": str(workdir / f"{item.name}.image.npy"), "labels": str(lab), "seed": seed})
            meta.append((item, seed, int((labels > 0).sum())))
    rows = []
    for system in ("alibi-vit", "convpaint"):
        sys_jobs = [dict(j, out=str(workdir / f"{Path(j['labels']).stem}.{system}.pred.npy")) for j in jobs]
        t0 = time.perf_counter()
        seconds = run_jobs(system, sys_jobs, convpaint_python)
        print(f"{system}: {len(jobs)} segmentations in {time.perf_counter() - t0:.0f} s", flush=True)
        for job, (item, seed, n), s in zip(sys_jobs, meta, seconds):
            pred = np.load(job["out"])
            rows.append({"system": system, "image": item.name, "split": item.split, "seed": seed,
                         "labelled_pixels": n, "miou": mean_iou(pred, item.mask), "seconds": s})
    return rows


def summarise(rows, items) -> dict:
    per_image, overall = {}, {}
    for item in items:
        a = {r["seed"]: r["miou"] for r in rows if r["image"] == item.name and r["system"] == "alibi-vit"}
        c = {r["seed"]: r["miou"] for r in rows if r["image"] == item.name and r["system"] == "convpaint"}
        seeds = sorted(set(a) & set(c))
        d = np.array([a[s] - c[s] for s in seeds])
        av, cv = np.array([a[s] for s in seeds]), np.array([c[s] for s in seeds])
        se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
        per_image[item.name] = {
            "split": item.split, "shape": list(item.image.shape), "dtype": str(item.image.dtype), "seeds": seeds,
            "alibi_vit": [float(av.mean()), float(av.std(ddof=1)) if len(av) > 1 else 0.0],
            "convpaint": [float(cv.mean()), float(cv.std(ddof=1)) if len(cv) > 1 else 0.0],
            "difference": [float(d.mean()), se]}
    means = {k: np.array([v[k][0] for v in per_image.values()]) for k in ("alibi_vit", "convpaint", "difference")}
    # Overall: mean over images; the difference's SE from the per-seed means over images (seeds pair up).
    seeds = sorted({r["seed"] for r in rows})
    per_seed = [np.mean([next(r["miou"] for r in rows if r["image"] == it.name and r["seed"] == s
                                   and r["system"] == "alibi-vit")
                              - next(r["miou"] for r in rows if r["image"] == it.name and r["seed"] == s
                                     and r["system"] == "convpaint") for it in items]) for s in seeds]
    overall = {"alibi_vit": float(means["alibi_vit"].mean()), "convpaint": float(means["convpaint"].mean()),
               "difference": [float(means["difference"].mean()),
                              float(np.std(per_seed, ddof=1) / np.sqrt(len(per_seed))) if len(seeds) > 1
                              else float("nan")],
               "images_alibi_vit_better": int((means["difference"] > 0).sum()), "images": len(per_image)}
    return {"per_image": per_image, "overall": overall}


# What each opens: checked by reading the code and docs named in each cell (see the report's text).
CAPABILITIES = [
    ("2-D grey, 8- and 16-bit", "yes (any integer/float dtype; features in float32)",
     "yes (any dtype; `normalize` 2 = stack mean/std by default)"),
    ("RGB / multichannel", "yes (colour features)", "yes (`channel_mode` \"rgb\"/\"multi\")"),
    ("3-D volume", ("yes: `segment` on TIFF/Zarr/OME-Zarr stacks, 3-D strokes, plane-by-plane or 3-D "
     "features (docs/napari.md \"Volumes\")"),
     ("plane by plane: a 3-D array with `channel_mode` \"single\" is a stack of 2-D images, each featurised "
     "on its own (no 3-D filters)")),
    ("mosaic / OME-Zarr, lazily", ("yes: `segment apply` streams zarr/OME-Zarr and big TIFF tile by tile into "
     "OME-Zarr or tiled BigTIFF (docs/segmentation.md \"Images larger than memory\"); the plugin's reader opens "
     "them as lazy multiscale layers and featurises only stroked and on-screen tiles (docs/napari.md \"Big images\")"),
     ("no reader of its own (napari's readers load the layer); `train`/`segment` take one array (numpy, or "
     "dask/zarr materialised per plane); `tile_image` predicts it in tiles, optionally with dask, output in memory")),
]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "--worker":
        return _worker(argv[1], argv[2])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--convpaint-python", default=os.environ.get("CONVPAINT_PYTHON", "/tmp/convpaint-venv/bin/python"))
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--repeats", type=int, default=3, help="speed: median of this many fresh processes")
    p.add_argument("--speed-image", default="ebc_040617_2_S127_2_0015")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="64-px crops of two images, one seed, one repeat")
    args = p.parse_args(argv)
    if args.smoke:
        args.seeds, args.repeats = [0], 1

    sys.path.insert(0, str(HERE.parent))
    from report import command_line, environment, write_report

    from alibi_vit.trainable.datasets import load_micrographs
    from alibi_vit.trainable.micrograph_benchmark import protocol_labels

    convpaint_version = subprocess.run(
        [args.convpaint_python, "-c", ("import importlib.metadata as m; print(m.version('napari-convpaint'), "
         "m.version('catboost'))")], capture_output=True, text=True, check=True).stdout.split()
    env = environment()
    command = command_line("bench_convpaint.py", argv)
    machine = f"{os.cpu_count()} CPU cores"
    payload = {"command": command, "smoke": args.smoke, **env, "machine": machine,
               "napari_convpaint": convpaint_version[0], "catboost": convpaint_version[1],
               "load_before": os.getloadavg()[0], "seeds": args.seeds}

    items = load_micrographs("all")
    if args.smoke:
        items = [item.cropped(64) for item in items[:2]]
    with tempfile.TemporaryDirectory() as tmp:
        rows = accuracy(items, args.seeds, args.convpaint_python, Path(tmp))
    summary = summarise(rows, items)
    payload["accuracy"] = summary
    payload["rows"] = rows

    if not args.no_speed:
        item = items[0] if args.smoke else load_micrographs("all", names=[args.speed_image])[0]
        labels = protocol_labels(item, "sparse", 0)
        speed = {}
        for system in ("alibi-vit", "convpaint"):
            runs = [first_segmentation(system, item.image, labels, args.convpaint_python) for _ in range(args.repeats)]
            speed[system] = {"runs": runs, "wall_s": float(np.median([r["wall_s"] for r in runs])),
                             "peak_rss_mib": float(np.median([r["peak_rss_mib"] for r in runs]))}
        payload["speed"] = {"image": item.name, "shape": list(item.image.shape),
                            "labelled_pixels": int((labels > 0).sum()), "systems": speed}
    payload["load_after"] = os.getloadavg()[0]
    payload["capabilities"] = [list(c) for c in CAPABILITIES]

    ov = summary["overall"]
    n = len(args.seeds)
    lines = ["# Beside napari-convpaint: alibi-vit's trainable segmentation on the labelled micrographs"
             + (" (smoke)" if args.smoke else ""), "",
             f"Command: `{command}`", "",
             (f"Machine: {machine}, load average {payload['load_before']:.1f} at the start, "
             f"{payload['load_after']:.1f} at the end; torch {env['torch']}; napari-convpaint "
             f"{payload['napari_convpaint']} (catboost {payload['catboost']}); {env['date']}."), "",
             ("Systems: alibi-vit `TrainableSegmenter(seed=seed)` with its defaults; napari-convpaint "
             "`ConvpaintModel(alias=\"gaussian\")` with that extractor's defaults (Gaussian σ 3 feature, scale 1, "
             "stack normalisation, CatBoost 100 iterations, depth 5, its fixed seed 0). The gaussian extractor is "
             "the only one that runs offline: VGG16, ConvNeXt, EfficientNet and DINOv2/v3 download weights."), "",
             ("napari-convpaint's environment: its own venv with `pip install --no-deps napari-convpaint catboost "
             "einops omegaconf antlr4-python3-runtime napari-annotation-project napari-guitils six`, and a `.pth` "
             "file adding alibi-vit's venv (torch, timm, napari, scikit-image, dask, zarr) after its own packages."),
             "",
             (f"## Accuracy: sparse protocol, {n} seed{'s' if n > 1 else ''} "
             f"({', '.join(map(str, args.seeds))}), mIoU mean ± std over seeds"), "",
             ("Both systems get the same stroke image per image and seed. Difference: alibi-vit − convpaint, "
             "paired by seed, ± its standard error."), "",
             "| image | split | size | alibi-vit | convpaint (gaussian) | difference |",
             "|---|---|---|---:|---:|---:|"]
    for name, v in summary["per_image"].items():
        size = "×".join(map(str, v["shape"])) + f" {v['dtype']}"
        lines.append(f"| `{name}` | {v['split']} | {size} | {v['alibi_vit'][0]:.3f} ± {v['alibi_vit'][1]:.3f} | "
                     f"{v['convpaint'][0]:.3f} ± {v['convpaint'][1]:.3f} | "
                     f"{v['difference'][0]:+.3f} ± {v['difference'][1]:.3f} |")
    lines.append(f"| **all images (mean)** | | | **{ov['alibi_vit']:.3f}** | **{ov['convpaint']:.3f}** | "
                 f"**{ov['difference'][0]:+.3f} ± {ov['difference'][1]:.3f}** |")
    lines += ["", (f"alibi-vit is ahead on {ov['images_alibi_vit_better']} of {ov['images']} images. The overall "
              "difference's standard error is over seeds of the all-image mean difference."), ""]
    if "speed" in payload:
        s = payload["speed"]
        lines += [f"## First segmentation in a fresh process, median of {args.repeats}", "",
                  (f"`{s['image']}` ({'×'.join(map(str, s['shape']))}), sparse seed 0 ({s['labelled_pixels']} "
                  "labelled px). One process: imports, reading the .npy files, train, segment; wall time and peak "
                  "resident memory from `/usr/bin/time -v`."), "",
                  "| system | wall (s) | peak RSS (MiB) | runs (s) |", "|---|---:|---:|---|"]
        for system, v in s["systems"].items():
            lines.append(f"| {system} | {v['wall_s']:.1f} | {v['peak_rss_mib']:.0f} | "
                         + ", ".join(f"{r['wall_s']:.1f}" for r in v["runs"]) + " |")
        mean_s = {sy: np.mean([r["seconds"] for r in rows if r["system"] == sy]) for sy in ("alibi-vit", "convpaint")}
        lines += ["", "Train + segment only (no imports), mean over all accuracy runs: "
                  + ", ".join(f"{sy} {v:.2f} s" for sy, v in mean_s.items()) + ".", ""]
    lines += ["## What each opens (read from their code and docs, not run here)", "",
              "| input | alibi-vit | napari-convpaint |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in CAPABILITIES]
    stem = "convpaint_micrographs" + ("-smoke" if args.smoke else "")
    md, js = write_report(args.out_dir, stem, payload, lines, smoke=args.smoke)
    print("\n".join(lines))
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
