"""`alibi-vit app` on a volume, as a person sees it: the page in Chromium, the server as a subprocess.

The goals of the app's volume mode (classical 3D features, 2-core CPU):

* Open a 512³ 16-bit volume (a TIFF stack): click in the list → the first slice shown. Target ≤ 3 s.
* Change the slice (arrow keys, in XY, XZ and YZ): key → the new slice drawn (image and labels).
  Target ≤ 200 ms.
* Train: scribbles drawn with the mouse in the XZ view (two per class), then click Train → the overlay
  of the shown slice drawn. Target ≤ 5 s.

The volume is a two-phase microstructure: a smooth random field (Gaussian noise on a 64³ grid,
blurred, upsampled ×8 trilinearly) thresholded at 0, so the phases form interpenetrating blobs of
tens of voxels; intensities 900 and 1500 plus Gaussian noise (σ 250). Times come from the page's own
``window.appTimings`` (``performance.now()``): ``volume_open`` click → slice drawn, ``volume_slice``
key → slice drawn, ``volume_train_overlay`` click → overlay drawn, ``volume_overlay`` the overlay of
a slice stepped to after training. The overlay's agreement with the truth on the slices shown is
recorded too. Results go to ``benchmarks/results/app_volume_cpu.{json,md}``.

    python benchmarks/bench_app_volume.py            # 512³
    python benchmarks/bench_app_volume.py --smoke    # 96³: checks the script (results/smoke/)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from app_driver import (Server, canvas_pixels, draw_on_slice, open_app_page, strokes_inside,  # noqa: E402
                        wait_timing)
from bench_app import goal_report, peak_rss_gb, run_and_report, verdict_word  # noqa: E402
from report import write_report  # noqa: E402

TARGETS = {"open_s": 3.0, "slice_change_ms": 200.0, "train_to_overlay_s": 5.0}
STEPS = 8  # slice changes timed per view
SLAB = 32  # slices generated at a time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=512, help="side of the cubic 16-bit volume (voxels)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the .md and .json go (default: benchmarks/results/, smoke runs: benchmarks/results/smoke/)")
    p.add_argument("--smoke", action="store_true", help="a 96³ volume: checks the script")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.size = 96
    return args


def make_volume(path: Path, size: int, seed: int = 0) -> np.ndarray:
    """Write the two-phase volume (module docstring) as an uncompressed 16-bit TIFF stack, a slab at
    a time; returns its truth (uint8, 1 and 2)."""
    import tifffile
    from scipy import ndimage

    rng = np.random.default_rng(seed)
    coarse = ndimage.gaussian_filter(rng.normal(size=(size // 8,) * 3), 1.5, mode="wrap").astype(np.float32)
    field = ndimage.zoom(coarse, 8, order=1, mode="grid-wrap", grid_mode=True, output=np.float32)
    truth = np.where(field > 0, 2, 1).astype(np.uint8)
    del field
    stack = tifffile.memmap(path, shape=truth.shape, dtype=np.uint16, photometric="minisblack")
    for z in range(0, size, SLAB):
        phase = truth[z:z + SLAB]
        noisy = np.where(phase == 2, 1500.0, 900.0) + rng.normal(0, 250, phase.shape)
        stack[z:z + SLAB] = np.clip(noisy, 0, 65535).astype(np.uint16)
    stack.flush()
    del stack
    return truth


def agreement(page, truth_slice: np.ndarray, colours: dict[int, tuple]) -> float:
    """Share of the shown slice's voxels whose overlay colour is the class the truth gives."""
    pixels = canvas_pixels(page, "#volume-overlay")
    shown = np.zeros(pixels.shape[:2], np.uint8)
    for value, rgb in colours.items():
        shown[(pixels[..., :3] == rgb).all(-1)] = value
    return float(np.mean(shown == truth_slice))


def step_slices(page, volume_id: str, key: str, event: str = "volume_slice") -> list[dict]:
    """Press ``key`` STEPS times, each once the slice before is drawn; the page's timings of those."""
    records = []
    for _ in range(STEPS):
        count = len(page.evaluate(f"() => window.appTimings.filter(t => t.event === '{event}')"))
        page.keyboard.press(key)
        records.append(wait_timing(page, event, volume_id, count + 1))
    return records


def run(args) -> dict:
    from playwright.sync_api import sync_playwright

    work = Path(tempfile.mkdtemp(prefix="alibi-vit-bench-app-volume-"))
    server = None
    size = args.size
    try:
        data = work / "data"
        data.mkdir()
        t0 = time.perf_counter()
        truth = make_volume(data / f"vol{size}.tif", size)
        result = {"size": size, "make_volume_s": time.perf_counter() - t0,
                  "phase_2_fraction": float(np.mean(truth == 2))}
        t0 = time.perf_counter()
        server = Server(data, work / "session", log=work / "server.log")
        result["server_start_s"] = time.perf_counter() - t0
        volume_id = server.json("GET", "/api/state")["volumes"][0]["id"]
        with sync_playwright() as p:
            browser, page = open_app_page(p, server)
            page.wait_for_selector(f'.volume-row[data-id="{volume_id}"]')
            colours = {}
            for name in ("phase 1", "phase 2"):
                page.fill("#class-name", name)
                page.click("#add-class")
                page.wait_for_selector(f'.class-row:has-text("{name}")')
            for c in server.json("GET", "/api/state")["classes"]:
                colours[c["value"]] = tuple(int(c["color"][i:i + 2], 16) for i in (1, 3, 5))

            # 1. open: click → the middle XY slice drawn
            page.click(f'.volume-row[data-id="{volume_id}"]')
            result["open"] = wait_timing(page, "volume_open", volume_id, 1)
            # 2. slice changes before any model, in each view
            result["slices_xy"] = step_slices(page, volume_id, "ArrowUp")
            for view in ("yz", "xz"):
                page.click(f'[data-testid="view-{view}"]')
                wait_timing(page, "volume_view", volume_id, ("yz", "xz").index(view) + 1)
                result[f"slices_{view}"] = step_slices(page, volume_id, "ArrowUp")
            # 3. scribbles in XZ (two per class, inside each phase), Train → the overlay of the slice
            y = page.evaluate("() => window.volumeApp.index")
            for value in (1, 2):
                page.keyboard.press(str(value))
                for stroke in strokes_inside(truth[:, y, :], value, 2, 4, narrow_ok=True):
                    draw_on_slice(page, stroke)
            time.sleep(0.5)
            page.click("#train")
            result["train"] = wait_timing(page, "volume_train_overlay", None, 1)
            result["model"] = server.json("GET", "/api/state")["volume_model"]
            result["train_overlay_agreement"] = agreement(page, truth[:, y, :], colours)
            # 4. with a model: slice changes (the overlay of each follows), then one overlay waited for
            result["slices_xz_trained"] = step_slices(page, volume_id, "ArrowUp")
            overlays = len(page.evaluate("() => window.appTimings.filter(t => t.event === 'volume_overlay')"))
            result["overlay_after_step"] = wait_timing(page, "volume_overlay", volume_id, overlays + 1)
            index = page.evaluate("() => window.volumeApp.index")
            result["step_overlay_agreement"] = agreement(page, truth[:, index, :], colours)
            result["server_peak_rss_gb"] = peak_rss_gb(server.proc.pid)
            browser.close()
        return result
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(result: dict, args) -> tuple[Path, Path]:
    steps = {view: [r["ms"] for r in result[f"slices_{view}"]] for view in ("xy", "yz", "xz", "xz_trained")}
    every = [ms for view in ("xy", "yz", "xz") for ms in steps[view]]
    measured = {"open_s": result["open"]["ms"] / 1000, "slice_change_ms": float(np.median(every)),
                "train_to_overlay_s": result["train"]["ms"] / 1000}
    payload, env = goal_report("bench_app_volume.py", args, measured, TARGETS, result)
    machine, command = payload["meta"]["machine"], payload["meta"]["command"]
    ok = lambda k: verdict_word(payload, k)  # noqa: E731
    n, load, model = result["size"], result["load_average"], result["model"]
    spread = "; ".join(f"{v.upper().replace('_TRAINED', ' with a model')} median {np.median(ms):.0f}, max {max(ms):.0f}"
                       for v, ms in steps.items())
    lines = [f"# alibi-vit app on a volume: {machine}", "", f"Command: `{command}`", "",
             f"Headless Chromium driven by Playwright; the server `alibi-vit app` (classical 3D features) as a "
             f"subprocess on the same machine; a {n}³ 16-bit two-phase TIFF stack ({100 * result['phase_2_fraction']:.0f} % "
             f"phase 2; see the script); times from the page's `window.appTimings`; torch {env['torch']}; "
             f"{env['date']}. Load average {load['before']:.1f} before and {load['after']:.1f} after the run on the "
             f"machine's {os.cpu_count()} cores (other work on them shows up in these wall times).", "",
             "| goal | measured | target | |", "|---|---:|---:|---|",
             f"| {n}³ volume: click → first slice drawn | {measured['open_s']:.2f} s | ≤ {TARGETS['open_s']:g} s | "
             f"{ok('open_s')} |",
             f"| slice change: arrow key → slice drawn (median of {len(every)} in XY, YZ, XZ) | "
             f"{measured['slice_change_ms']:.0f} ms | ≤ {TARGETS['slice_change_ms']:g} ms | {ok('slice_change_ms')} |",
             f"| Train (scribbles in XZ) → overlay of the shown slice drawn | {measured['train_to_overlay_s']:.2f} s | "
             f"≤ {TARGETS['train_to_overlay_s']:g} s | {ok('train_to_overlay_s')} |", "",
             f"Slice changes, ms: {spread}. Model #{model['id']} trained in {model['seconds']:.2f} s (server side) on "
             f"{sum(model['voxels'].values())} labelled voxels; its overlay agrees with the truth on "
             f"{100 * result['train_overlay_agreement']:.1f} % of the slice shown at Train and "
             f"{100 * result['step_overlay_agreement']:.1f} % of a slice stepped to afterwards, whose overlay "
             f"took {result['overlay_after_step']['ms'] / 1000:.2f} s from its slice being drawn. The server "
             f"started (the folder scanned, nothing read but metadata) in {result['server_start_s']:.1f} s; its peak "
             f"resident memory over the run (VmHWM) was {result['server_peak_rss_gb']:.2f} GB."]
    return write_report(args.out_dir, "app_volume_cpu", payload, lines, smoke=args.smoke)


def main(argv=None) -> int:
    return run_and_report(parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
