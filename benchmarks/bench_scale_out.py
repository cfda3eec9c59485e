"""`segment apply` beyond one process (issue 29 goals): many images on `local:2` against `threads`, and a
mosaic larger than a worker's memory limit.

    python benchmarks/bench_scale_out.py make --folder /scratch/scale        # 200 images, the mosaic, a model
    python benchmarks/bench_scale_out.py batch --folder /scratch/scale --scheduler threads
    python benchmarks/bench_scale_out.py batch --folder /scratch/scale --scheduler local:2
    python benchmarks/bench_scale_out.py mosaic --folder /scratch/scale --scheduler local:2 --worker-memory 2GB
    python benchmarks/bench_scale_out.py report --folder /scratch/scale      # → benchmarks/results/
    python benchmarks/bench_scale_out.py smoke                                # all of it at toy sizes

make: 200 16-bit TIFFs of 1024² (10 generated 3-phase micrographs, alibi_vit.synthetic, each in 20
distinct orientations and shifts, so no two files are alike), a 16384² OME-Zarr mosaic (512² chunks,
a 2048² micrograph mirrored out, as benchmarks/bench_bigimage.py makes it) and a model trained on one
1024² image with three scribbles per class (the defaults: classical features of the compact set, random
forest, no CRF).

batch / mosaic: `alibi-vit segment apply` (mask + overlay) as a subprocess: its wall time, the CPU time
of it and its worker processes (user + system, from the kernel's accounting of every process in its
tree, sampled each 0.5 s), and each process's peak resident memory; the 1-minute load average before
and after (the machine is shared). Images (or megapixels) per CPU second hardly depend on the load of
other jobs; per wall second they do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import load_average  # noqa: E402
COUNT, SIZE, MOSAIC, CHUNK, BASES = 200, 1024, 16384, 512, 10


def make(folder: Path, count: int = COUNT, size: int = SIZE, mosaic: int = MOSAIC, base: int = 2048) -> None:
    import tifffile

    from bench_bigimage import write_mirrored_zarr

    from alibi_vit.trainable import TrainableSegmenter, scribbles, synthetic_micrograph

    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    bases = [synthetic_micrograph(size, seed=s) for s in range(BASES)]
    for i in range(count):
        picture = np.rot90(bases[i % BASES][0], (i // BASES) % 4)
        picture = np.roll(picture[:, ::-1] if (i // BASES) % 8 >= 4 else picture, 37 * (i // (8 * BASES)), axis=0)
        tifffile.imwrite(images / f"img{i:03d}.tif", np.ascontiguousarray(picture))
    image, truth = bases[0]
    if not (folder / "model" / "config.json").is_file():
        TrainableSegmenter().fit([image], [scribbles(truth, 3, rng=0)]).save(folder / "model")
    big, _ = synthetic_micrograph(base, seed=0)
    write_mirrored_zarr(folder / "mosaic" / f"mosaic{mosaic}.ome.zarr", big, mosaic, CHUNK)
    print(f"made {count} images of {size}² in {images}, a {mosaic}² mosaic and a model in {folder}", flush=True)


class _TreeSampler(threading.Thread):
    """Every 0.5 s: the CPU time and resident memory of a process and all its descendants (workers too)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        import psutil

        self.root, self.cpu, self.peak_rss, self.stop = psutil.Process(pid), {}, {}, threading.Event()

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                tree = [self.root] + self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            for p in tree:
                try:
                    with p.oneshot():
                        times, rss, name = p.cpu_times(), p.memory_info().rss, " ".join(p.cmdline()[-2:])
                except psutil.Error:
                    continue
                self.cpu[p.pid] = times.user + times.system
                self.peak_rss[p.pid] = max(self.peak_rss.get(p.pid, 0), rss)
                self.peak_rss.setdefault(("name", p.pid), name)
            self.stop.wait(0.5)


def run_apply(folder: Path, images: Path, out: Path, scheduler: str, extra=()) -> dict:
    """One `segment apply` run, measured; appended to folder/runs.jsonl."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "alibi_vit.cli.main", "segment", "apply", "--model", str(folder / "model"),
           "--images", str(images), "--out", str(out), "--scheduler", scheduler, *extra]
    load_before, started = load_average()[0], time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TQDM_DISABLE": "1"})
    sampler = _TreeSampler(proc.pid)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - started
    sampler.stop.set()
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    rss = {pid: v for pid, v in sampler.peak_rss.items() if not isinstance(pid, tuple)}
    workers = [v for pid, v in rss.items() if pid != proc.pid]
    row = {"images": str(images.name), "scheduler": scheduler, "extra": list(extra), "wall_seconds": round(wall, 1),
           "cpu_seconds": round(sum(sampler.cpu.values()), 1),
           "driver_cpu_seconds": round(sampler.cpu.get(proc.pid, 0.0), 1),  # the rest: its workers (and nannies)
           "driver_peak_rss_gb": round(rss.get(proc.pid, 0) / 2**30, 3),
           "worker_peak_rss_gb": sorted(round(v / 2**30, 3) for v in workers if v > 200 * 2**20),
           "load_before": load_before, "load_after": load_average()[0], "summary": stdout.strip().splitlines()[-1]}
    print(row, flush=True)
    with open(folder / "runs.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def report(folder: Path, stem: str = "scale_out_cpu") -> None:
    from report import environment, write_report

    runs = [json.loads(line) for line in open(folder / "runs.jsonl")]
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB (shared with other jobs)"
    batch = [r for r in runs if r["images"] == "images"]
    mosaic = [r for r in runs if r["images"] == "mosaic"]
    lines = [f"# `segment apply` beyond one process ({machine})", "",
             "`python benchmarks/bench_scale_out.py`; the default model (classical features of the compact set, random forest, no CRF), mask + overlay. Wall time: the "
             "whole command (start-up, cluster start and stop included). CPU s: the command and its worker "
             "processes (user + system). Load: the 1-minute load average before → after (other jobs share the "
             "machine, so wall times vary with it; per-CPU-second rates much less).", ""]
    if batch:
        lines += [f"## {COUNT} images of {SIZE}², 16-bit TIFF", "",
                  "Worker CPU s: the CPU time of the worker processes alone (the command's own process, which runs "
                  "Dask's scheduler, left out; with threads it does all the work). Images per worker CPU second is a "
                  "worker's rate on a core of its own: N workers on N free cores segment about N times as many per "
                  "second.", "",
                  "| scheduler | wall (s) | images/s | CPU s | images per CPU s | worker CPU s | images per worker "
                  "CPU s | peak RSS driver / workers (GB) | load |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in batch:
            n = COUNT
            driver = r.get("driver_cpu_seconds")
            workers = (r["cpu_seconds"] - driver if r["scheduler"] != "threads" else r["cpu_seconds"]) \
                if driver is not None or r["scheduler"] == "threads" else None
            lines.append(f"| {r['scheduler']}{' †' if r.get('note') else ''} | {r['wall_seconds']} | "
                         f"{n / r['wall_seconds']:.2f} | {r['cpu_seconds']} | "
                         f"{n / r['cpu_seconds']:.3f} | {f'{workers:.1f}' if workers else 'not recorded'} | "
                         f"{f'{n / workers:.3f}' if workers else '–'} | {r['driver_peak_rss_gb']:.2f} / "
                         f"{', '.join(f'{v:.2f}' for v in r['worker_peak_rss_gb']) or '–'} | "
                         f"{r['load_before']} → {r['load_after']} |")
    if mosaic:
        lines += ["", f"## One {MOSAIC}² mosaic (OME-Zarr, 512² chunks; {MOSAIC * MOSAIC / 1e6:.0f} MP)", "",
                  "| scheduler | options | wall (s) | MP/s | CPU s | MP per CPU s | peak RSS driver / workers (GB) | "
                  "load | result |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in mosaic:
            mp = MOSAIC * MOSAIC / 1e6
            lines.append(f"| {r['scheduler']}{' †' if r.get('note') else ''} | {' '.join(r['extra'])} | {r['wall_seconds']} | "
                         f"{mp / r['wall_seconds']:.3f} | {r['cpu_seconds']} | {mp / r['cpu_seconds']:.3f} | "
                         f"{r['driver_peak_rss_gb']:.2f} / {', '.join(f'{v:.2f}' for v in r['worker_peak_rss_gb'])} | "
                         f"{r['load_before']} → {r['load_after']} | {r['summary'].split(' into ')[0]} |")
    notes = sorted({r["note"] for r in runs if r.get("note")})
    if notes:
        lines += ["", "† " + "; ".join(notes) + "."]
    payload = {"machine": machine, "environment": environment(), "runs": runs,
               "command": "python benchmarks/bench_scale_out.py make|batch|mosaic|report --folder DIR"}
    for path in write_report(None, stem, payload, lines):
        print(f"wrote {path}")
    print("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("make", "batch", "mosaic", "report", "smoke"))
    p.add_argument("--folder", type=Path, default=Path("scale_out_bench"))
    p.add_argument("--scheduler", default="threads")
    p.add_argument("--worker-memory", default=None)
    args = p.parse_args(argv)
    extra = ["--worker-memory", args.worker_memory] if args.worker_memory else []
    if args.action == "smoke":
        import tempfile

        folder = Path(tempfile.mkdtemp())
        make(folder, count=4, size=128, mosaic=1024, base=256)
        for scheduler in ("threads", "local:2"):
            run_apply(folder, folder / "images", folder / f"out_{scheduler}", scheduler)
        run_apply(folder, folder / "mosaic", folder / "out_mosaic", "local:2", ["--worker-memory", "1GB"])
        print("smoke ok")
        return 0
    if args.action == "make":
        make(args.folder)
    elif args.action == "batch":
        run_apply(args.folder, args.folder / "images", args.folder / "out_batch", args.scheduler, extra)
    elif args.action == "mosaic":
        run_apply(args.folder, args.folder / "mosaic", args.folder / "out_mosaic", args.scheduler, extra)
    else:
        report(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
