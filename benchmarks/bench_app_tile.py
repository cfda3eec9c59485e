"""The app's featurisation tile size, side by side: Train → answer, and the fill's throughput.

A Train in the app featurises the whole tiles that hold labels and classifies the blocks of the tiles
under the view, so the tile size sets how much is computed beyond what is labelled and on screen.
This runs the server's engine in this process through its HTTP API (FastAPI's TestClient, no
browser), on the images and views of ``bench_app_bigimage.py`` (a 4096² 16-bit TIFF read whole, a
16384² OME-Zarr read chunk by chunk), with the same strokes (two per class, the page's default
brush), once per tile size and repeat, the sizes alternating so that load changes hit them alike:

* Train on the 4096² image, the view's region sent: seconds until the server answers (the view
  predicted; the page's drawing, about 0.1 s, is not included) and the model's own seconds;
* then the same on the 16384² image (its strokes added; the model fits on both images' labels);
* then the share of the 16384² image the background fill predicts in ``--fill-s`` seconds (MP/s).

Results: ``benchmarks/results/app_tile_cpu.{json,md}``.

    python benchmarks/bench_app_tile.py                       # tiles 518 (the app's) and 1036 (the library's)
    python benchmarks/bench_app_tile.py --tiles 518 1036 252 --repeats 3
    python benchmarks/bench_app_tile.py --smoke               # 1024² and 2048²: checks the script (results/smoke/)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_app import cpu_name, machine_name, run_and_report  # noqa: E402
from bench_app_bigimage import BRUSH, CLASSES, make_images, strokes_in_view  # noqa: E402
from report import command_line, environment, write_report  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiles", type=int, nargs="+", default=[518, 1036], help="featurisation tile sizes (px)")
    p.add_argument("--repeats", type=int, default=2, help="runs per tile size (alternating)")
    p.add_argument("--train-size", type=int, default=4096, help="side of the 16-bit TIFF (px)")
    p.add_argument("--big", type=int, default=16384, help="side of the OME-Zarr (px)")
    p.add_argument("--fill-s", type=float, default=15, help="seconds of background fill measured")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the .md and .json go (default: benchmarks/results/, smoke runs: benchmarks/results/smoke/)")
    p.add_argument("--smoke", action="store_true", help="1024² TIFF, 2048² OME-Zarr, 2 s of fill, one repeat")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.train_size, args.big, args.fill_s, args.repeats = 1024, 2048, 2, 1
    return args


def views(train_size: int, big: int) -> tuple[list[int], list[int]]:
    """[top, left, bottom, right] of bench_app_bigimage.py's views: 706 × 776 px at the TIFF's centre
    ([1695, 1660, 2401, 2436] at 4096²), 467 × 513 px at (0.61, 0.37) of the OME-Zarr (at 16384²
    [9705, 5851, 10172, 6364], its zoomed-in view to within 2 px)."""
    c = train_size // 2
    r, q = int(big * 0.61), int(big * 0.37)
    return [c - 353, c - 388, c + 353, c + 388], [r - 289, q - 211, r + 178, q + 302]


def one_run(data: Path, session_dir: Path, tile: int, truth, names, regions, big_px: int, fill_s: float) -> dict:
    """One fresh session and engine of ``tile``: both Trains, then ``fill_s`` seconds of fill."""
    from fastapi.testclient import TestClient

    from alibi_vit.app.engine import Engine
    from alibi_vit.app.server import create_app
    from alibi_vit.app.session import Session

    session = Session(session_dir, [data], allowed_roots=[data])
    engine = Engine(session, feature_tile=tile)
    out = {"tile": tile}
    try:
        client = TestClient(create_app(session, engine))
        for name in CLASSES:
            client.post("/api/classes", json={"name": name})
        ids = {im["name"]: im["id"] for im in client.get("/api/state").json()["images"]}
        for key, name, region in zip(("train", "big"), names, regions):
            image_id = ids[name]
            client.post(f"/api/images/{image_id}/open")
            for phase in range(1, len(CLASSES) + 1):
                for stroke in strokes_in_view(truth, region, phase):
                    r = client.post(f"/api/images/{image_id}/strokes",
                                    json={"class": phase, "radius": BRUSH, "points": [list(p) for p in stroke]})
                    r.raise_for_status()
            t0 = time.perf_counter()
            r = client.post("/api/train", json={"image": image_id, "region": region})
            seconds = time.perf_counter() - t0
            r.raise_for_status()
            out[key] = {"answer_s": seconds, "model_s": engine.model["seconds"],
                        "predicted": r.json()["prediction"]["predicted"]}
        start = out["big"]["predicted"]
        time.sleep(fill_s)
        state = next(i for i in client.get("/api/state").json()["images"] if i["id"] == ids[names[1]])
        out["fill_mp_per_s"] = (state["prediction"]["predicted"] - start) * big_px / 1e6 / fill_s
    finally:
        engine.close()
    return out


def warm_up() -> None:
    """Import and start what any Train uses (XGBoost, OpenCV, the filters' thread) with a tiny fit, so
    that the first arm does not pay for it."""
    import numpy as np

    from alibi_vit.trainable import TrainableSegmenter

    labels = np.zeros((64, 64), np.uint8)
    labels[:8], labels[-8:] = 1, 2
    TrainableSegmenter(intensity_range=(0.0, 1.0)).fit([np.linspace(0, 1, 64 * 64).reshape(64, 64)], [labels])


def run(args) -> dict:
    warm_up()
    work = Path(tempfile.mkdtemp(prefix="alibi-vit-bench-app-tile-"))
    try:
        data = work / "images"
        data.mkdir()
        truth = make_images(data, args.train_size, args.big)
        names = (f"m{args.train_size}.tif", f"big{args.big}.ome.zarr")
        regions = views(args.train_size, args.big)
        runs = []
        for i in range(args.repeats):
            for tile in args.tiles:
                runs.append(one_run(data, work / f"session-{i}-{tile}", tile, truth, names, regions, args.big ** 2,
                                    args.fill_s))
                print(runs[-1], flush=True)
        return {"train_size": args.train_size, "big_size": args.big, "views": regions, "fill_s": args.fill_s,
                "runs": runs}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def report(result: dict, args) -> tuple[Path, Path]:
    machine = machine_name()
    command = command_line("bench_app_tile.py", args.argv)
    env = environment()
    load = result["load_average"]
    s, b = result["train_size"], result["big_size"]
    median = statistics.median
    rows = {}
    for tile in args.tiles:
        mine = [r for r in result["runs"] if r["tile"] == tile]
        rows[tile] = {"train_answer_s": median([r["train"]["answer_s"] for r in mine]),
                      "train_model_s": median([r["train"]["model_s"] for r in mine]),
                      "big_answer_s": median([r["big"]["answer_s"] for r in mine]),
                      "big_model_s": median([r["big"]["model_s"] for r in mine]),
                      "fill_mp_per_s": median([r["fill_mp_per_s"] for r in mine])}
    payload = {"meta": {"command": command, "machine": machine, "cpu": cpu_name(), "cpu_count": os.cpu_count(), **env},
               "medians": rows, "result": result}

    def each(tile, key, sub) -> str:
        return ", ".join(f"{r[key][sub]:.2f}" for r in result["runs"] if r["tile"] == tile)

    lines = [f"# The app's featurisation tile size: {machine}", "", f"Command: `{command}`", "",
             f"The app's engine in one process through its HTTP API (no browser), classical features, the default "
             f"feature cache; the images and views of `bench_app_bigimage.py` ({s}² 16-bit TIFF, view "
             f"{result['views'][0]}; {b}² OME-Zarr, view {result['views'][1]}), two strokes per class in view; "
             f"{args.repeats} run(s) per tile size, the sizes alternating; medians (each run in brackets); torch "
             f"{env['torch']}; {env['date']}. Load average {load['before']:.1f} before and {load['after']:.1f} after "
             f"the run on the machine's {os.cpu_count()} cores (it shows in these wall times: compare the rows, "
             "measured side by side).", "",
             f"| tile (px) | Train {s}² → answer (s) | its fit (s) | then Train {b}² → answer (s) | "
             f"its fit (s) | fill of {b}² (MP/s, {args.fill_s:g} s) |", "|---:|---:|---:|---:|---:|---:|"]
    for tile, r in rows.items():
        lines.append(f"| {tile} | {r['train_answer_s']:.2f} ({each(tile, 'train', 'answer_s')}) | "
                     f"{r['train_model_s']:.2f} | {r['big_answer_s']:.2f} ({each(tile, 'big', 'answer_s')}) | "
                     f"{r['big_model_s']:.2f} | {r['fill_mp_per_s']:.2f} |")
    lines += ["", "A fit's seconds include reading and featurising the labelled tiles; an answer adds classifying "
              "the blocks under the view (the same blocks whatever the tile: 74 px for 518 and 1036)."]
    return write_report(args.out_dir, "app_tile_cpu", payload, lines, smoke=args.smoke)


def main(argv=None) -> int:
    return run_and_report(parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
