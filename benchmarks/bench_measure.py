"""`segment measure` in bounded memory: a 512³ volume and a 16384² mosaic (issue 43 goals), and the global metrics.

    python benchmarks/bench_measure.py                 # writes benchmarks/results/measure_cpu.{md,json}
    python benchmarks/bench_measure.py --smoke         # small sizes, a check that the script works
    python benchmarks/bench_measure.py --schedulers threads local:2 --local-only   # → measure_cpu_local.{md,json}
    python benchmarks/bench_measure.py --tortuosity-on cuda --sides 128 256 --out-dir DIR   # GPU phase `measure`

Inputs are generated chunk by chunk as zarr stores (never whole in memory): three phases from thresholding a
sum of random plane waves (a smooth, bicontinuous structure with features 6–20 voxels across). Each command
runs in a fresh process under ``/usr/bin/time -v``: peak RSS and wall time of the whole command (imports
included; with ``local:N`` the peak is that of the largest single process, not the sum over the workers).
Tortuosity is also timed beside TauFactor's solver called directly on the same sub-volume.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.report import command_line, environment, load_average, missing_modules, write_report

WAVES = 24


def _waves(ndim: int, seed: int):
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(WAVES, ndim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return directions * (2 * np.pi / rng.uniform(12, 40, size=(WAVES, 1))), rng.uniform(0, 2 * np.pi, WAVES)


def generate(path: Path, shape: tuple[int, ...], chunk: int, seed: int = 0) -> Path:
    """A zarr store of ``shape`` holding phases 0, 1, 2, written chunk by chunk."""
    import zarr

    if path.exists():
        return path
    vectors, phases = _waves(len(shape), seed)
    store = zarr.create_array(str(path), shape=shape, chunks=(chunk,) * len(shape), dtype=np.uint8,
                              dimension_names="zyx"[3 - len(shape):])
    for corner in np.ndindex(*(n // chunk for n in shape)):
        grid = np.ogrid[tuple(slice(c * chunk, (c + 1) * chunk) for c in corner)]
        field = np.zeros((chunk,) * len(shape), np.float32)
        for k in range(WAVES):
            field += np.cos(sum(vectors[k, a] * grid[a] for a in range(len(shape))) + phases[k]).astype(np.float32)
        store[tuple(slice(c * chunk, (c + 1) * chunk) for c in corner)] = np.digitize(field, [-1.5, 1.5])
    return path


def timed_command(args: list[str]) -> dict:
    """Wall time and peak RSS of ``alibi-vit ARGS`` in a fresh process."""
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "alibi_vit.cli.main", *args]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if result.returncode:
        raise RuntimeError(result.stderr[-2000:])
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1))
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(rss_kb / 2**20, 3), "load": load_average()}


def tortuosity_beside_taufactor(path: Path, side: int, device: str = "cpu") -> dict:
    """One solve (phase 1 along x) on a side³ sub-volume on ``device``: through alibi_vit.measure and TauFactor
    directly (each after a warm-up solve on 8³, so that neither pays the imports or CUDA's start)."""
    import taufactor
    import zarr

    from alibi_vit.measure.transport import tortuosity

    values = np.asarray(zarr.open_array(str(path), mode="r")[:side, :side, :side])
    tortuosity(values[:8, :8, :8], 1, 2, (1.0, 1.0, 1.0), device=device)  # imports and warm-up outside the timing
    started = time.perf_counter()
    ours = tortuosity(values, 1, 2, (1.0, 1.0, 1.0), device=device)
    ours_s = time.perf_counter() - started
    indicator = np.ascontiguousarray(np.transpose(values == 1, (2, 0, 1))).astype(np.uint8)
    started = time.perf_counter()
    solver = taufactor.Solver(indicator, device=device)
    with contextlib.redirect_stdout(io.StringIO()):
        direct = float(np.ravel(solver.solve(verbose=False, iter_limit=20000, conv_crit=1e-2))[0])
    direct_s = time.perf_counter() - started
    return {"side": side, "device": device, "tau": round(ours["tau"], 4), "tau_taufactor": round(direct, 4),
            "seconds": round(ours_s, 2), "seconds_taufactor": round(direct_s, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes: check that the script works")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/alibi_vit_bench_measure"),
                        help="where the generated inputs go (reused when there)")
    parser.add_argument("--schedulers", nargs="+", default=["threads"], metavar="SPEC",
                        help="measure the local metrics with each of these --scheduler values (default threads)")
    parser.add_argument("--local-only", action="store_true",
                        help="only the local metrics (results go to measure_cpu_local)")
    parser.add_argument("--tortuosity-on", nargs="+", default=None, metavar="DEVICE",
                        help="only tortuosity: one solve per --sides on each device, through alibi_vit.measure and "
                             "TauFactor directly (results go to measure_tortuosity_<device of the first>)")
    parser.add_argument("--sides", nargs="+", type=int, default=[128], help="sub-volume sides for --tortuosity-on")
    parser.add_argument("--out-dir", type=Path, default=None, help="where results go (default benchmarks/results)")
    args = parser.parse_args(argv)
    if args.tortuosity_on:
        return tortuosity_rows(args)
    volume_side, mosaic_side, sub = (64, 1024, 32) if args.smoke else (512, 16384, 128)
    args.folder.mkdir(parents=True, exist_ok=True)
    volume = generate(args.folder / f"volume_{volume_side}.zarr", (volume_side,) * 3, min(128, volume_side))
    mosaic = generate(args.folder / f"mosaic_{mosaic_side}.zarr", (mosaic_side,) * 2, 1024)
    local = ["--metrics", "fractions", "surfaces", "s2", "objects", "percolation", "--radius", "32", "--no-plots",
             "--quiet"]
    rows = []
    for name, path in ((f"{volume_side}³ volume", volume), (f"{mosaic_side}² mosaic", mosaic)):
        for scheduler in args.schedulers:
            measured = timed_command(["segment", "measure", str(path), "--out", str(args.folder / "out"), *local,
                                      "--scheduler", scheduler])
            rows.append({"input": name, "metrics": "fractions, surfaces, S2 (r ≤ 32), objects, percolation",
                         "scheduler": scheduler, **measured})
            print(rows[-1], flush=True)
    if args.local_only:
        return _report(rows, None, argv, args.smoke, "measure_cpu_local")
    region = ",".join([f"0:{sub}"] * 3)
    measured = timed_command(["segment", "measure", str(volume), "--out", str(args.folder / "out_global"),
                              "--region", region, "--metrics", "chords", "thickness", "tortuosity", "--device", "cpu",
                              "--no-plots", "--quiet", "--max-memory", "4GB"])
    rows.append({"input": f"{sub}³ region of the volume", "metrics": "chords, local thickness, tortuosity "
                 "(3 phases × 3 axes)", "scheduler": "threads", **measured})
    print(rows[-1], flush=True)
    beside = tortuosity_beside_taufactor(volume, sub)
    print(beside, flush=True)
    beside["side"] = sub
    return _report(rows, beside, argv, args.smoke, "measure_cpu")


def tortuosity_rows(args) -> int:
    """Tortuosity alone on side³ sub-volumes of the volume, per device (the GPU phase ``measure``)."""
    missing = missing_modules(("zarr", "taufactor"))  # the GPU image has neither unless their wheels were carried
    rows = []
    if not missing:
        side = 64 if args.smoke else max(args.sides)
        volume = generate(args.folder / f"volume_{side}.zarr", (side,) * 3, min(128, side))
        for device in args.tortuosity_on:
            for sub in ([16] if args.smoke else args.sides):
                rows.append(tortuosity_beside_taufactor(volume, sub, device))
                print(rows[-1], flush=True)
    name = args.tortuosity_on[0]
    if name.startswith("cuda"):
        import torch

        name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    payload = {"command": command_line("bench_measure.py", sys.argv[1:]), "environment": environment(), "rows": rows,
               "skipped": f"{', '.join(missing)} not installed" if missing else None}
    lines = [f"# Tortuosity factor: `alibi_vit.measure` beside TauFactor's `Solver` ({name})", "",
             "One solve each (phase 1 along x) on a side³ sub-volume of the generated three-phase volume, after a "
             "warm-up solve on 8³; conv_crit 1e-2, iteration limit 20000.", "",
             "| side | device | measure (s) | TauFactor (s) | τ measure | τ TauFactor |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['side']} | {r['device']} | {r['seconds']} | {r['seconds_taufactor']} | {r['tau']} | "
              f"{r['tau_taufactor']} |" for r in rows]
    if missing:
        lines += ["", f"Nothing measured: {payload['skipped']} (carry their wheels in .whl/ on the GPU machine)."]
        print(f"skipped: {payload['skipped']}")
    lines += ["", f"`{payload['command']}`"]
    md, js = write_report(args.out_dir, f"measure_tortuosity_{name}", payload, lines, smoke=args.smoke)
    print(f"wrote {md} and {js}")
    return 0


def _report(rows: list[dict], beside: dict | None, argv, smoke: bool, name: str) -> int:
    payload = {"command": command_line("bench_measure.py", argv or sys.argv[1:]), "environment": environment(),
               "rows": rows, "tortuosity_beside_taufactor": beside}
    lines = ["# `segment measure`: memory and time (2-core CPU)", "",
             "Fresh process per command under `/usr/bin/time -v`, imports included; inputs are zarr stores of "
             "three phases (see the script's docstring). With `local:N` the peak RSS is that of the largest "
             "process, not the sum over the workers.", "",
             "| input | metrics | scheduler | wall (s) | peak RSS (GB) | load |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['input']} | {r['metrics']} | {r['scheduler']} | {r['wall_s']} | {r['peak_rss_gb']:.2f} | "
              f"{' '.join(str(v) for v in r['load'])} |" for r in rows]
    if beside is not None:
        lines += ["", f"Tortuosity, one solve (phase 1 along x) on the {beside['side']}³ region: {beside['seconds']} s "
                  f"through `alibi_vit.measure` (τ = {beside['tau']}), {beside['seconds_taufactor']} s with "
                  f"TauFactor's `Solver` directly (τ = {beside['tau_taufactor']}).", ""]
    lines += ["", f"`{payload['command']}`"]
    md, js = write_report(None, name, payload, lines, smoke=smoke)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
