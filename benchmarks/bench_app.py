"""Speed of `alibi-vit app` as a person sees it: the page in Chromium, the server as a subprocess.

The same flow as tests/test_app_browser.py, with times the page itself records in
``window.appTimings`` (``performance.now()``):

* features ready: from opening a 1024² synthetic micrograph (click) to the page seeing its
  classical features ready (the page polls /api/state every 250 ms meanwhile). Target ≤ 3 s.
* stroke to overlay, live mode: from the pointer-up of a stroke to the new prediction decoded and
  drawn, with the features cached (live training after each stroke). Median of several strokes.
  Target ≤ 2 s.
* image shown: from the click on a 4096² image to the display tiles of its fitted view drawn. Target ≤ 2 s.
* zoom frames: frame interval while wheel-zooming the 4096² image (median), for smoothness.
* Train with the 4096² image in the way: the large image is shown with a model (its prediction
  starts on the server), then the labelled image again and Train: click → overlay drawn, against
  the same Train with nothing else to do, measured just before in the same run. The app must not
  block on the large image: the ratio shows what it costs.
* /api/state while the large image is worked on: the longest of its answers (polled every 250 ms
  from the benchmark), and the server's peak memory (VmHWM) over the whole run.

Results go to ``benchmarks/results/app_speed_cpu.{json,md}``.

    python benchmarks/bench_app.py             # 1024² and 4096² images, 5 live strokes
    python benchmarks/bench_app.py --smoke     # 256² and 1024²: checks the script (results/smoke/)
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from app_driver import (CHROMIUM, Server, draw, open_app_page, strokes_inside, timings,  # noqa: E402
                        wait_idle, wait_timing)
from report import command_line, environment, write_report  # noqa: E402

TARGETS = {"features_ready_s": 3.0, "stroke_to_overlay_s": 2.0, "image_shown_4096_s": 2.0}
CLASSES = ("matrix", "speckle", "stripes")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1024, help="side of the image that is labelled and trained (px)")
    p.add_argument("--big", type=int, default=4096, help="side of the large image that is only shown (px; 0: skip)")
    p.add_argument("--strokes", type=int, default=5, help="live strokes timed after the first training")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the .md and .json go (default: benchmarks/results/, smoke runs: benchmarks/results/smoke/)")
    p.add_argument("--smoke", action="store_true", help="256² and 1024² images, 2 strokes: checks the script")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.size, args.big, args.strokes = 256, min(args.big, 1024), min(args.strokes, 2)
    return args


def cpu_name() -> str:
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return name or platform.machine()


def machine_name() -> str:
    """The machine as the app benchmarks' reports name it."""
    if (os.cpu_count() or 0) <= 2:
        return f"2-core CPU, no GPU ({cpu_name()}, {os.cpu_count()} CPUs)"
    return f"{os.cpu_count()}-core CPU ({cpu_name()})"


def stroke_plan(mask, strokes_per_phase: int, radius: int):
    """For each phase, strokes (lists of image points) well inside its grains."""
    return {phase: strokes_inside(mask, phase, strokes_per_phase, radius, longest=40, narrow_ok=True)
            for phase in (1, 2, 3)}


def zoom_frames(page, steps: int = 40) -> float:
    """Median frame interval (ms) while wheel-zooming in and out over the image centre."""
    box = page.locator("#canvas-area").bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.evaluate("""() => { window.__frames = []; let last = performance.now(); window.__stop = false;
        const tick = (t) => { window.__frames.push(t - last); last = t; if (!window.__stop) requestAnimationFrame(tick); };
        requestAnimationFrame(tick); }""")
    for i in range(steps):
        page.mouse.wheel(0, -120 if i < steps // 2 else 120)
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    frames = page.evaluate("() => { window.__stop = true; return window.__frames.slice(1); }")
    return statistics.median(frames) if frames else float("nan")


class StatePoller:
    """GET /api/state every 250 ms on a thread; stop() returns each answer's time (ms)."""

    def __init__(self, server):
        self.server, self.times, self._stop = server, [], threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self):
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.server.request("GET", "/api/state", timeout=300)
            self.times.append(round((time.perf_counter() - t0) * 1000, 1))
            self._stop.wait(0.25)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.times


def goal_report(script: str, args, measured: dict, targets: dict, result: dict) -> tuple[dict, dict]:
    """The JSON payload of an app benchmark measured against its goals, and the environment.

    A goal whose figure is missing (None) has no verdict; ``payload["meets_target"]`` feeds
    :func:`verdict_word`."""
    env = environment()
    meta = {"command": command_line(script, args.argv), "machine": machine_name(), "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), **env}
    verdict = {k: (None if v is None else v <= targets[k]) for k, v in measured.items()}
    return {"meta": meta, "targets": targets, "measured": measured, "meets_target": verdict, "result": result}, env


def verdict_word(payload: dict, goal: str) -> str:
    """'meets it', 'misses it', or '' where the goal was not measured."""
    met = payload["meets_target"][goal]
    return "" if met is None else ("meets it" if met else "misses it")


def peak_rss_gb(pid: int) -> float | None:
    """The process's peak resident memory so far (Linux VmHWM), in GB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def run(args) -> dict:
    import tifffile
    from playwright.sync_api import sync_playwright

    from alibi_vit.synthetic import synthetic_micrograph

    work = Path(tempfile.mkdtemp(prefix="alibi-vit-bench-app-"))
    server = poller = None
    try:
        data = work / "images"
        data.mkdir()
        image, mask = synthetic_micrograph(args.size, 3, seed=0)
        tifffile.imwrite(data / f"m{args.size}.tif", image)
        big_file = None
        if args.big:   # added later, as a person would upload it
            big, _ = synthetic_micrograph(args.big, 3, seed=1)
            big_file = work / f"m{args.big}.tif"
            tifffile.imwrite(big_file, big)
            del big
        server = Server(data, work / "session", log=work / "server.log")
        (small,) = [im["id"] for im in server.json("GET", "/api/state")["images"]]
        result = {"image_size": args.size, "big_size": args.big or None}
        with sync_playwright() as p:
            browser, page = open_app_page(p, server)
            page.wait_for_selector(f'.image-row[data-id="{small}"]')

            # 1. open → features ready (and the image shown) of the labelled image
            page.click(f'.image-row[data-id="{small}"]')
            result["image_shown_small_ms"] = wait_timing(page, "image_shown", small, 1)["ms"]
            ready = wait_timing(page, "features_ready", small, 1)
            result["features_ready_ms"], result["features_ready_since_click_ms"] = ready["ms"], ready["since_click_ms"]
            page.keyboard.press("0")

            # 2. live: a first stroke per class trains (features then cached); then timed strokes
            for name in CLASSES:
                page.fill("#class-name", name)
                page.click("#add-class")
                page.wait_for_selector(f'.class-row:has-text("{name}")')
            page.check("#live")
            radius = max(3, args.size // 128)
            page.fill("#brush-size", str(radius))
            plan = stroke_plan(mask, 1 + (args.strokes + 2) // 3, radius)
            values = {int(page.locator(".class-row", has_text=n).get_attribute("data-value")): ph
                      for ph, n in enumerate(CLASSES, start=1)}
            for value, phase in values.items():
                page.keyboard.press(str(value))
                draw(page, plan[phase][0])
                wait_idle(page)
            n0 = len(timings(page, "stroke_to_overlay", small))
            order = [list(values)[i % len(values)] for i in range(args.strokes)]
            stroke_ms = []
            for i, value in enumerate(order):
                page.keyboard.press(str(value))
                draw(page, plan[values[value]][1 + i // 3])
                stroke_ms.append(wait_timing(page, "stroke_to_overlay", small, n0 + i + 1)["ms"])
                wait_idle(page)
            result["stroke_to_overlay_ms"] = stroke_ms
            result["stroke_to_overlay_median_ms"] = statistics.median(stroke_ms)
            trains = timings(page, "train", small)[-len(stroke_ms):]
            result["train_server_ms"] = [t["server_ms"] for t in trains]
            model = server.json("GET", "/api/state")["model"]
            result["model"] = model

            # 3. the large image: click → shown, then zoom smoothness
            if big_file is not None:
                page.uncheck("#live")
                wait_idle(page)
                (large,) = server.json("POST", f"/api/images?name={big_file.name}", raw=big_file.read_bytes(),
                                       timeout=300)["ids"]
                page.reload()   # the page lists it; the labelled image comes back (its features are cached)
                page.wait_for_selector(f'.image-row[data-id="{large}"]')
                page.wait_for_function("() => window.app.labelsShown && window.app.overlayShown")
                time.sleep(1)
                page.click("#train")   # the same Train as in step 4, with nothing else to do
                result["train_idle_ms"] = wait_timing(page, "train", small, len(timings(page, "train", small)) + 1)["ms"]
                wait_idle(page)
                poller = StatePoller(server)
                page.click(f'.image-row[data-id="{large}"]')   # with a model: its prediction starts on the server
                shown = wait_timing(page, "image_shown", large, 1)
                result["image_shown_big_ms"], result["image_shown_big_tiles"] = shown["ms"], shown["tiles"]
                result["zoom_frame_ms"] = zoom_frames(page)

                # 4. back to the labelled image and Train while the large image's work is under way
                big_state = next(i for i in server.json("GET", "/api/state")["images"] if i["id"] == large)
                result["big_features_state"] = big_state["features"]
                shown_small = len(timings(page, "image_shown", small))
                page.click(f'.image-row[data-id="{small}"]')
                wait_timing(page, "image_shown", small, shown_small + 1)
                page.click("#train")
                result["train_big_in_the_way_ms"] = wait_timing(page, "train", small,
                                                                len(timings(page, "train", small)) + 1)["ms"]
                result["state_latency_ms"] = poller.stop()
                poller = None
            result["server_peak_rss_gb"] = peak_rss_gb(server.proc.pid)
            result["timings"] = page.evaluate("window.appTimings")
            browser.close()
        return result
    finally:
        if poller is not None:
            poller.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(result: dict, args) -> tuple[Path, Path]:
    machine = machine_name()
    command = command_line("bench_app.py", args.argv)
    env = environment()
    try:
        from playwright._repo_version import version as playwright_version
    except ImportError:
        playwright_version = None
    chromium = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True).stdout.split(" built")[0].strip()
    meta = {"command": command, "machine": machine, "processor": platform.processor(), "cpu": cpu_name(),
            "cpu_count": os.cpu_count(), "chromium": chromium, "playwright": playwright_version, **env}
    measured = {
        "features_ready_s": result["features_ready_ms"] / 1000,
        "stroke_to_overlay_s": result["stroke_to_overlay_median_ms"] / 1000,
        "image_shown_4096_s": result["image_shown_big_ms"] / 1000 if "image_shown_big_ms" in result else None,
    }
    if "train_idle_ms" in result:
        measured |= {"train_idle_s": result["train_idle_ms"] / 1000,
                     "train_big_in_the_way_s": result["train_big_in_the_way_ms"] / 1000,
                     "state_longest_s": max(result["state_latency_ms"]) / 1000}
    measured["server_peak_rss_gb"] = result.get("server_peak_rss_gb")
    verdict = {k: (None if v is None else v <= TARGETS[k]) for k, v in measured.items() if k in TARGETS}
    payload = {"meta": meta, "targets_s": TARGETS, "measured_s": measured, "meets_target": verdict,
               "result": result}
    s, b = args.size, args.big
    strokes = ", ".join(f"{ms / 1000:.2f}" for ms in result["stroke_to_overlay_ms"])
    ok = lambda k: "" if verdict[k] is None else ("meets it" if verdict[k] else "misses it")  # noqa: E731
    lines = [f"# alibi-vit app: speed in the browser on {machine}", "",
             f"Command: `{command}`", "",
             f"Headless {chromium} driven by Playwright; the server `alibi-vit app` (classical features, "
             f"no CRF) as a subprocess on the same machine; synthetic 3-phase 16-bit micrographs; "
             f"times from the page's own `window.appTimings` (`performance.now()`); torch {env['torch']}; "
             f"{env['date']}. Load average {result['load_average']['before']:.1f} before and "
             f"{result['load_average']['after']:.1f} after the run on the machine's {os.cpu_count()} cores (other "
             "work on them shows up in these wall times).", "",
             "| step | measured (s) | target (s) | |",
             "|---|---:|---:|---|",
             f"| open a {s}² image → features ready (page polls every 250 ms) | {measured['features_ready_s']:.2f} | "
             f"≤ {TARGETS['features_ready_s']:g} | {ok('features_ready_s')} |",
             f"| live mode: stroke → new prediction drawn, {s}² image, median of {len(result['stroke_to_overlay_ms'])} "
             f"| {measured['stroke_to_overlay_s']:.2f} | ≤ {TARGETS['stroke_to_overlay_s']:g} | {ok('stroke_to_overlay_s')} |"]
    if measured["image_shown_4096_s"] is not None:
        lines.append(f"| click a {b}² image → image drawn | {measured['image_shown_4096_s']:.2f} | "
                     f"≤ {TARGETS['image_shown_4096_s']:g} | {ok('image_shown_4096_s')} |")
    lines += ["", f"Each live stroke (s): {strokes}; of which the server's train + predict answer took "
              f"{', '.join(f'{ms / 1000:.2f}' for ms in result['train_server_ms'])} s. "
              f"Click → {s}² image drawn: {result['image_shown_small_ms'] / 1000:.2f} s; the page opens an image "
              f"(starts its features) once the server has sent it, so click → features ready took "
              f"{result['features_ready_since_click_ms'] / 1000:.2f} s."]
    if "zoom_frame_ms" in result:
        lines.append(f"Click → {b}² image drawn: the {result['image_shown_big_tiles']} display tiles the fitted view "
                     "needs, fetched and drawn.")
        lines.append(f"Wheel zoom on the {b}² image: median frame interval {result['zoom_frame_ms']:.1f} ms "
                     "(software compositing in headless Chromium).")
        idle, blocked = result["train_idle_ms"] / 1000, result["train_big_in_the_way_ms"] / 1000
        latency = result["state_latency_ms"]
        lines += ["", f"Train → overlay on the {s}² image: {idle:.2f} s with nothing else to do; {blocked:.2f} s "
                  f"({blocked / idle:.1f}×) right after the {b}² image was shown with a model (its prediction under "
                  f"way on the server; its features: {result['big_features_state']}). `/api/state` meanwhile "
                  f"({len(latency)} polls): median {statistics.median(latency):.0f} ms, longest {max(latency):.0f} ms."]
    if result.get("server_peak_rss_gb") is not None:
        lines.append(f"Server peak resident memory over the run: {result['server_peak_rss_gb']:.2f} GB.")
    return write_report(args.out_dir, "app_speed_cpu", payload, lines, smoke=args.smoke)


def run_and_report(args, run, report) -> int:
    """``run(args)`` with the 1-minute load average before and after it recorded in its result, then
    ``report(result, args)`` written and printed (also bench_app_bigimage.py's main)."""
    load_before = os.getloadavg()[0]
    result = run(args)
    result["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    md, js = report(result, args)
    print(md.read_text())
    print(f"wrote {md} and {js}")
    return 0


def main(argv=None) -> int:
    return run_and_report(parse_args(argv), run, report)


if __name__ == "__main__":
    sys.exit(main())
