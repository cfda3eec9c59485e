"""Trainable segmentation with ViT features as a user runs it: `segment train`, then `segment apply` in a fresh
process on a 4096² image and a 16384² OME-Zarr mosaic, ViT features of the mosaic alone, and the app's
Train → overlay, on the GPU and the CPU.

    python benchmarks/bench_vit_segment.py                                   # cuda then cpu, full sizes
    python benchmarks/bench_vit_segment.py --device cuda --budget 540 --work runs/vit_segment --out-dir DIR
    python benchmarks/bench_vit_segment.py --device cpu --append --work runs/vit_segment --out-dir DIR
    python benchmarks/bench_vit_segment.py --smoke                           # CPU dry run at toy sizes (results/smoke/)

What runs (rows are written to ``vit_segment_<device>.{json,md}`` as each is measured, so a run stopped by a
time limit keeps what it measured):

1. ``segment train`` once, on a generated 3-phase micrograph (``--train-size``², 16-bit TIFF, three scribbles
   per phase), with ViT features from a randomly initialised ``--backbone`` (``--allow-random-init``; default
   classifier and filters) on the first ``--device``: the model folder the other rows apply.
2. ``segment apply`` of that model, each run a fresh process (interpreter start-up, imports and model load
   included, as a user waits for it), per device: on a ``--image-size``² grey TIFF (read whole) and on a
   ``--mosaic-size``² OME-Zarr mosaic (streamed tile by tile into OME-Zarr). Both are a ``BASE``² generated
   micrograph mirrored out to the size, as in bench_bigimage.py.
3. ViT features of the mosaic alone, in a fresh process of this script: the backbone on every window of the
   fixed window grid (``vit windows``), then the per-pixel ViT features tile by tile as `segment apply`
   computes them (``vit features``: windows, PCA projection, upsampling; the model load is not timed).
4. The app's Train → overlay on the ``--image-size``² image with ViT features, in a fresh process of this
   script driving the app's engine and session directly (what the HTTP routes call; no FastAPI or uvicorn):
   strokes of two per phase in a 706 × 776 px view, then the seconds until Train answers (the view predicted)
   and the view's prediction tiles are made (the overlay the page draws); the background fill of the rest of
   the image is timed too.

How memory is measured: host peak RSS of each child process from ``os.wait4`` (the kernel's ru_maxrss of that
child alone); GPU peak as torch's own ``max_memory_reserved`` (allocator peak, CUDA context not included) —
reported at exit by a small ``atexit`` hook that wraps the CLI (``python -c``, running ``alibi_vit.cli.main``
as ``-m`` would) and measured directly in this script's own children — plus, where ``nvidia-smi`` exists, the
device's ``memory.used`` polled every 0.2 s, less its value before the child started (context included).

Each row has its own time limit (``--limit``, and what is left of ``--budget``): a child still running then is
stopped (SIGTERM, then SIGKILL) and its row says ``timed out after N s``. ``--work DIR`` keeps the generated
images and the model for a later run (``--append`` then adds its rows to the same results file).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))
from report import command_line, environment, load_average, missing_modules, slug, write_report  # noqa: E402

BACKBONE = "alibi_vit_small_patch14_reg4_dinov2"
# A one-layer toy backbone: the smoke run checks the code paths, not the speed of a real ViT.
SMOKE_MODEL_ARGS = ["depth=1", "embed_dim=32", "num_heads=2"]
BASE = 2048  # px: the generated micrograph the images are mirrored from
CHUNK = 512  # px: storage chunks of the mosaic
PHASES = 3
BRUSH = 4  # px: the app page's default brush radius
VIEW = (706, 776)  # px (rows, cols): the app's view, centred, as in bench_app_tile.py
ROWS = ("image", "mosaic", "vit", "app")
GB = 2**30
# What the lent GPU image lacks and `segment` needs; carried as wheels in .whl/ (see the report's notes).
NEEDED_MODULES = ("zarr", "xgboost")

# Runs `alibi-vit` as `python -m alibi_vit.cli.main` would, and at exit writes torch's GPU peak to the file
# named by $BENCH_GPU_PEAK_FILE (only if the process used CUDA).
CLI_WITH_GPU_PEAK = """\
import atexit, json, os, runpy, sys

def _gpu_peak():
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    with open(os.environ["BENCH_GPU_PEAK_FILE"], "w") as f:
        json.dump({"reserved": torch.cuda.max_memory_reserved(), "allocated": torch.cuda.max_memory_allocated()}, f)

atexit.register(_gpu_peak)
sys.argv = ["alibi-vit", *sys.argv[1:]]
runpy.run_module("alibi_vit.cli.main", run_name="__main__", alter_sys=True)
"""


# ---- the inputs -------------------------------------------------------------------------------------------
def make_inputs(work: Path, train_size: int, image_size: int, mosaic_size: int, base: int,
                need_mosaic: bool) -> dict:
    """The generated inputs in ``work`` (kept when already there): the training image and its scribbles,
    the grey TIFF and its ground truth (the app's strokes are drawn inside it), and the OME-Zarr mosaic.
    Returns their paths and the seconds each took to make."""
    import tifffile
    from bench_bigimage import _mirror_index, write_mirrored_zarr
    from PIL import Image

    from alibi_vit.trainable import scribbles, synthetic_micrograph

    work.mkdir(parents=True, exist_ok=True)
    paths = {"train": work / f"train{train_size}.tif", "labels": work / f"train{train_size}_labels.png",
             "image": work / f"image{image_size}.tif", "truth": work / f"image{image_size}_truth.npy",
             "mosaic": work / f"mosaic{mosaic_size}.ome.zarr"}
    made = {}
    base_image = base_truth = None
    if not all(paths[k].exists() for k in ("train", "labels", "image", "truth")) or \
            (need_mosaic and not paths["mosaic"].exists()):
        start = time.perf_counter()
        base_image, base_truth = synthetic_micrograph(base, PHASES, seed=0)
        made["base_s"] = round(time.perf_counter() - start, 1)
    if not (paths["train"].exists() and paths["labels"].exists()):
        start = time.perf_counter()
        idx = _mirror_index(train_size, base)
        truth = base_truth[np.ix_(idx, idx)]
        tifffile.imwrite(paths["train"], base_image[np.ix_(idx, idx)], photometric="minisblack")
        Image.fromarray(scribbles(truth, 3, rng=0).astype(np.uint8)).save(paths["labels"])
        made["train_s"] = round(time.perf_counter() - start, 1)
    if not (paths["image"].exists() and paths["truth"].exists()):
        start = time.perf_counter()
        idx = _mirror_index(image_size, base)
        tifffile.imwrite(paths["image"], base_image[np.ix_(idx, idx)], photometric="minisblack")
        np.save(paths["truth"], base_truth[np.ix_(idx, idx)].astype(np.uint8))
        made["image_s"] = round(time.perf_counter() - start, 1)
    if need_mosaic and not paths["mosaic"].exists():
        start = time.perf_counter()
        part = paths["mosaic"].with_name(paths["mosaic"].name + ".part")  # complete or absent, for --work reuse
        write_mirrored_zarr(part, base_image, mosaic_size, CHUNK, name=paths["mosaic"].name)
        os.replace(part, paths["mosaic"])
        made["mosaic_s"] = round(time.perf_counter() - start, 1)
    return {"paths": {k: str(v) for k, v in paths.items()}, "made_seconds": made}


# ---- running a child process and measuring it --------------------------------------------------------------
class GpuMemoryPoller:
    """The device's ``memory.used`` from nvidia-smi every 0.2 s while a child runs: its largest value."""

    def __init__(self):
        self.peak_mib = None
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def read_mib() -> int | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            return max(int(v) for v in out.split())
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def start(self):
        if shutil.which("nvidia-smi") is None:
            return self
        self.baseline_mib = self.read_mib()

        def poll():
            while not self._stop.wait(0.2):
                used = self.read_mib()
                if used is not None:
                    self.peak_mib = max(used, self.peak_mib or 0)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float | None:
        """GB the child added to the device at its peak (context included), or None without nvidia-smi."""
        if self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        if self.peak_mib is None or self.baseline_mib is None:
            return None
        return round(max(self.peak_mib - self.baseline_mib, 0) / 1024, 3)


def child_env() -> dict:
    """This environment, with the project importable (it is not pip-installed on the GPU image) and no
    progress bars (their redraws would fill the logs)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""), "TQDM_DISABLE": "1"}


def run_child(cmd: list[str], limit: float, log: Path, gpu: bool, env: dict | None = None) -> dict:
    """Run ``cmd`` (its output into ``log``) for at most ``limit`` s: wall seconds, exit status, whether it
    timed out, the host peak RSS of that child alone (``os.wait4``) and, on a GPU, what nvidia-smi saw."""
    poller = GpuMemoryPoller().start() if gpu else None
    # The child stays in this process group: whatever stops the whole run (a time limit on the GPU machine)
    # stops it too.
    with open(log, "w") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env or child_env())
        timed_out, reaped = False, None
        try:
            while reaped is None:
                found = os.wait4(proc.pid, os.WNOHANG)
                if found[0]:
                    reaped = found
                elif time.perf_counter() - start > limit:
                    timed_out = True
                    reaped = _stop(proc.pid)
                else:
                    time.sleep(0.05)
        finally:
            if reaped is None:  # this run is being stopped (SIGTERM, Ctrl-C): no child left behind
                _stop(proc.pid)
                if poller:
                    poller.stop()
        wall = time.perf_counter() - start
    _, status, usage = reaped
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return {"returncode": proc.returncode, "wall_s": round(wall, 2), "timed_out": timed_out,
            "host_peak_gb": round(usage.ru_maxrss * 1024 / GB, 3),  # ru_maxrss is in KiB on Linux
            "nvidia_smi_gb": poller.stop() if poller else None}


def _stop(pid: int):
    """SIGTERM to the child (segment apply then leaves its output folder consistent), SIGKILL after 10 s;
    the reaped child's (pid, status, rusage)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        deadline = time.perf_counter() + (grace or 1e9)
        while time.perf_counter() < deadline:
            reaped = os.wait4(pid, os.WNOHANG)
            if reaped[0]:
                return reaped
            time.sleep(0.1)
    return os.wait4(pid, 0)


def last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def status_of(run: dict, log: Path) -> str:
    if run["timed_out"]:
        return f"timed out after {run['wall_s']:.0f} s"
    if run["returncode"]:
        return f"failed (exit {run['returncode']}): {last_line(log)}"
    return "ok"


# ---- the rows ---------------------------------------------------------------------------------------------
class Results:
    """The rows so far, written as JSON + Markdown through report.write_report after each one."""

    def __init__(self, args, stem: str, device_name: str, earlier: dict | None):
        self.args, self.stem = args, stem
        self.payload = {
            "benchmark": "vit_segment", "smoke": args.smoke, "complete": False, "device": device_name,
            "commands": (earlier or {}).get("commands", []) + [command_line("bench_vit_segment.py", args.argv)],
            "environment": environment(), "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)), "host_memory_gb": _host_memory_gb(),
            "load_average_start": load_average(), "backbone": args.backbone, "model_args": args.model_arg,
            "sizes": {"train": args.train_size, "image": args.image_size, "mosaic": args.mosaic_size},
            "limit_s": args.limit, "budget_s": args.budget,
            "memory_methods": {
                "host_peak_gb": "ru_maxrss of the child process (os.wait4), whole process",
                "gpu_peak_gb": "torch.cuda.max_memory_reserved in the child (allocator peak, no CUDA context)",
                "nvidia_smi_gb": "nvidia-smi memory.used polled every 0.2 s, peak minus the value before the child"},
            "modules_missing": missing_modules(NEEDED_MODULES), "prepared": (earlier or {}).get("prepared", {}),
            "rows": (earlier or {}).get("rows", [])}

    def add(self, row: dict) -> None:
        row = {"load_after": load_average(), **row}
        self.payload["rows"].append(row)
        print(f"{row['input']} [{row['device']}]: {row['status']}, {row.get('wall_s')} s, "
              f"host {row.get('host_peak_gb')} GB, GPU {row.get('gpu_peak_gb')} GB", flush=True)
        self.write()

    def write(self, complete: bool = False) -> None:
        self.payload["complete"] = complete
        self.payload["load_average_end"] = load_average()
        write_report(self.args.out_dir, self.stem, self.payload, self.markdown(), smoke=self.args.smoke)

    def markdown(self) -> list[str]:
        p, env = self.payload, self.payload["environment"]
        lines = [f"# Trainable segmentation with ViT features, as a user runs it ({p['device']})", "",
                 f"{p['cpu_count']} CPU cores ({p['cpu_affinity']} usable), {p['host_memory_gb']} GB host memory; "
                 f"torch {env['torch']}, CUDA {env['cuda']}, triton {env['triton']}, python {env['python']}; "
                 f"load average at the start {p['load_average_start']}, at the end {p.get('load_average_end')}. "
                 f"Backbone `{p['backbone']}`, random init"
                 + (f" ({', '.join(p['model_args'])})" if p["model_args"] else "") + "; default classifier and "
                 "filters. Commands: " + "; ".join(f"`{c}`" for c in p["commands"]) + ".", "",
                 "Wall s: `segment` rows are whole fresh processes (start-up, imports, model load); `vit` and "
                 "`app` rows time the step alone, in a fresh process. Host peak: the child process's peak RSS. "
                 "GPU peak: torch's max_memory_reserved in the child (CUDA context not included); nvidia-smi: "
                 "the device's memory.used at its peak, less before the child.", "",
                 "| input | size | device | wall s | host peak GB | GPU peak GB | status | nvidia-smi GB | notes |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in p["rows"]:
            lines.append(f"| {r['input']} | {r['size']}² | {r['device']} | {_cell(r.get('wall_s'))} | "
                         f"{_cell(r.get('host_peak_gb'))} | {_cell(r.get('gpu_peak_gb'))} | {_cell(r['status'])} | "
                         f"{_cell(r.get('nvidia_smi_gb'))} | {_cell(r.get('notes', ''))} |")
        if p["prepared"]:
            lines += ["", "Inputs generated (s, not timed in the rows): " + json.dumps(p["prepared"])]
        if p["modules_missing"]:
            lines += ["", f"Missing here: {', '.join(p['modules_missing'])} (`segment` needs them: install the "
                          "wheels in .whl/)."]
        return lines


def _cell(value) -> str:
    """A table cell: a dash for no value; a '|' (in an error message) would split the cell."""
    return "–" if value is None else f"{value}".replace("|", "/")


def _host_memory_gb() -> float | None:
    try:
        kib = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1])
        return round(kib / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        return None


def _gpu_peak(path: Path) -> dict:
    if not path.is_file():
        return {"gpu_peak_gb": None}
    peak = json.loads(path.read_text())
    return {"gpu_peak_gb": round(peak["reserved"] / GB, 3), "gpu_allocated_gb": round(peak["allocated"] / GB, 3)}


def cli_row(name: str, size: int, device: str, cli_args: list[str], limit: float, work: Path) -> tuple[dict, Path]:
    """One `alibi-vit` command as a fresh process, measured; the row (not yet added) and its log."""
    tag = f"{name.split()[0]}_{size}_{device}"
    log, peak = work / f"{tag}.log", work / f"{tag}.gpu.json"
    peak.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", CLI_WITH_GPU_PEAK, *cli_args]
    run = run_child(cmd, limit, log, gpu=device.startswith("cuda"),
                    env={**child_env(), "BENCH_GPU_PEAK_FILE": str(peak)})
    row = {"input": name, "size": size, "device": device, "status": status_of(run, log), **run, **_gpu_peak(peak),
           "command": "alibi-vit " + " ".join(cli_args)}
    return row, log


def model_folder(args, work: Path) -> Path:
    """Where the model of these settings is trained (a --work folder reused with other settings trains anew)."""
    return work / f"model_{slug(' '.join([args.backbone, *args.model_arg, str(args.train_size)]))}"


def train_row(results, args, inputs, device, limit, work) -> bool:
    model = model_folder(args, work)
    shutil.rmtree(model, ignore_errors=True)
    cli = ["segment", "train", "--images", inputs["train"], "--labels", inputs["labels"], "--out", str(model),
           "--backbone", args.backbone, "--allow-random-init", "--device", device]
    for value in args.model_arg:
        cli += ["--model-arg", value]
    row, _ = cli_row(f"train {args.train_size}² TIFF + scribbles", args.train_size, device, cli, limit, work)
    row["notes"] = "segment train, whole process"
    results.add(row)
    return row["status"] == "ok" and (model / "config.json").is_file()


def apply_row(results, args, inputs, kind, device, limit, work) -> None:
    size = args.image_size if kind == "image" else args.mosaic_size
    name = "grey TIFF" if kind == "image" else "OME-Zarr mosaic"
    out = work / f"out_{kind}_{device}"
    shutil.rmtree(out, ignore_errors=True)
    cli = ["segment", "apply", "--model", str(model_folder(args, work)), "--images", inputs[kind], "--out", str(out),
           "--device", device]
    row, log = cli_row(f"apply {name}", size, device, cli, limit, work)
    text = log.read_text(errors="replace")
    streamed = re.search(r"MP in ([\d.]+) s \(([\d.]+) MP/s, (\d+) CPU s\)", text)
    notes = ["segment apply, whole process"]
    if streamed:  # the command's own line for a streamed image: its time without start-up and model load
        row.update(segment_s=float(streamed.group(1)), mp_per_s=float(streamed.group(2)),
                   segment_cpu_s=int(streamed.group(3)))
        notes.append(f"segmenting the image {row['segment_s']} s ({row['mp_per_s']} MP/s)")
    if row["status"] == "ok":
        row["mask_shape"] = mask_shape(out)
        notes.append(f"mask {row['mask_shape'][0]}×{row['mask_shape'][1]}" if row["mask_shape"] else "no mask found")
    row["notes"] = "; ".join(notes)
    results.add(row)


def mask_shape(out: Path) -> list[int] | None:
    """(rows, cols) of the mask `segment apply` wrote into ``out``, from its header or metadata only."""
    masks = sorted(out.glob("*_mask.*"))
    if not masks:
        return None
    mask = masks[0]
    if mask.name.endswith(".zarr"):
        from alibi_vit.chunked import open_image

        return [int(n) for n in open_image(mask).shape[:2]]
    from PIL import Image

    with Image.open(mask) as im:
        return [im.height, im.width]


def script_child(kind: str, spec: dict, device: str, limit: float, work: Path) -> dict:
    """One of this script's own measurements (``_child KIND SPEC``) as a fresh process: ``run`` (the process's
    figures), ``status``, and ``result``, what the child wrote (empty when it wrote nothing)."""
    spec_path, result_path = work / f"{kind}_{device}.spec.json", work / f"{kind}_{device}.result.json"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "device": device, "limit": limit, "result": str(result_path)}))
    log = work / f"{kind}_{device}.log"
    run = run_child([sys.executable, str(Path(__file__).resolve()), "_child", kind, str(spec_path)], limit, log,
                    gpu=device.startswith("cuda"))
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    return {"run": run, "status": status_of(run, log), "result": result}


def vit_rows(results, args, inputs, device, limit, work) -> None:
    got = script_child("vit", {"model": str(model_folder(args, work)), "image": inputs["mosaic"]}, device, limit,
                       work)
    run, result = got["run"], got["result"]
    for step, label in (("windows", "ViT backbone windows"), ("features", "ViT per-pixel features")):
        part = result.get(step)
        common = {"input": f"{label}, OME-Zarr mosaic", "size": args.mosaic_size, "device": device,
                  "process_wall_s": run["wall_s"], "nvidia_smi_gb": run["nvidia_smi_gb"]}
        if part is None:
            status = got["status"] if got["status"] != "ok" else "failed: the child wrote no figure"
            results.add({**common, "status": status, "wall_s": None, "host_peak_gb": run["host_peak_gb"]})
            continue
        notes = f"{part['windows']} windows of {part['window_px']}² px" if step == "windows" else \
            f"{part['tiles']} tile(s) of {part['tile_px']} px, as segment apply computes them"
        if step == "windows":
            notes += f"; first window (warm-up) {result['first_window_s']} s, model load {result['load_s']} s"
        results.add({**common, "status": "ok", "wall_s": part["seconds"],
                     "host_peak_gb": part["host_peak_gb"], "gpu_peak_gb": part.get("gpu_peak_gb"),
                     "gpu_allocated_gb": part.get("gpu_allocated_gb"), "mp_per_s": part["mp_per_s"],
                     "notes": notes + " (in-process step, fresh process)"})


def app_row(results, args, inputs, device, limit, work) -> None:
    spec = {"image": inputs["image"], "truth": inputs["truth"], "session": str(work / f"app_session_{device}"),
            "backbone": args.backbone, "model_args": args.model_arg}
    got = script_child("app", spec, device, limit, work)
    run, result = got["run"], got["result"]
    row = {"input": "app Train → overlay, grey TIFF", "size": args.image_size, "device": device,
           "process_wall_s": run["wall_s"], "host_peak_gb": run["host_peak_gb"], "nvidia_smi_gb": run["nvidia_smi_gb"]}
    if "overlay_s" not in result:
        status = got["status"] if got["status"] != "ok" else f"failed: {result.get('error', 'no figure written')}"
        results.add({**row, "status": status, "wall_s": None, **{k: v for k, v in result.items() if k != "error"}})
        return
    notes = (f"Train answered in {result['train_answer_s']} s (model fit {result['model_s']} s), view "
             f"{result['view'][2] - result['view'][0]}×{result['view'][3] - result['view'][1]} px in "
             f"{result['tiles']} tile(s); whole overlay filled in after "
             + (f"{result['complete_s']} s" if result.get("complete_s") is not None else "– (not within the limit)"))
    results.add({**row, **result, "status": "ok", "wall_s": result["overlay_s"], "notes": notes})


# ---- the children: measurements in a fresh process of this script -------------------------------------------
def _sync(device: str):
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _gpu_figures(device: str) -> dict:
    import torch

    if not str(device).startswith("cuda"):
        return {}
    return {"gpu_peak_gb": round(torch.cuda.max_memory_reserved() / GB, 3),
            "gpu_allocated_gb": round(torch.cuda.max_memory_allocated() / GB, 3)}


def _reset_gpu_peak(device: str) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()


def _own_peak_gb() -> float:
    import resource

    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB, 3)


def _write(path: str, result: dict) -> None:
    """The result so far (each figure as soon as it is measured: a timeout keeps the earlier ones)."""
    Path(path + ".part").write_text(json.dumps(result, indent=2))
    os.replace(path + ".part", path)


def child_vit(spec: dict) -> int:
    """ViT features of a chunked image alone: every backbone window once, then the per-pixel features tile by
    tile as `segment apply` computes them (the segmenter's own tile path, its window scratch cache included)."""
    from alibi_vit.chunked import open_image
    from alibi_vit.trainable import TrainableSegmenter
    from alibi_vit.trainable.vit import _window_features, window_grid

    device, result = spec["device"], {}
    start = time.perf_counter()
    seg = TrainableSegmenter.load(spec["model"], device=device)
    result["load_s"] = round(time.perf_counter() - start, 2)
    image = open_image(spec["image"])
    src = seg.source(image, image.name)
    model, p = seg.vit.model, int(seg.vit.model.patch_embed.patch_size[0])
    _, t, ys, xs = window_grid(src.shape, p, seg.vit_tile, seg.vit_overlap)
    megapixels = src.shape[0] * src.shape[1] / 1e6
    start = time.perf_counter()  # the first window pays for CUDA's start and the attention kernel's compilation
    _window_features(model, src.read, src.shape, p, ys[0], xs[0], t, device)
    _sync(device)
    result["first_window_s"] = round(time.perf_counter() - start, 2)
    _reset_gpu_peak(device)
    start = time.perf_counter()
    for y0 in ys:
        for x0 in xs:
            _window_features(model, src.read, src.shape, p, y0, x0, t, device)
    _sync(device)
    seconds = time.perf_counter() - start
    result["windows"] = {"seconds": round(seconds, 2), "windows": len(ys) * len(xs), "window_px": t * p,
                         "mp_per_s": round(megapixels / seconds, 2), "host_peak_gb": _own_peak_gb(),
                         **_gpu_figures(device)}
    _write(spec["result"], result)
    _reset_gpu_peak(device)
    grid = seg.tile_grid(src)
    start = time.perf_counter()
    with seg._call():  # the scratch cache of one apply call: neighbouring tiles share their windows
        for tile in grid:
            seg._vit_tile(src, tile)
    _sync(device)
    seconds = time.perf_counter() - start
    result["features"] = {"seconds": round(seconds, 2), "tiles": len(list(grid)), "tile_px": seg.tile,
                          "mp_per_s": round(megapixels / seconds, 2), "host_peak_gb": _own_peak_gb(),
                          **_gpu_figures(device)}
    _write(spec["result"], result)
    return 0


def strokes_in_view(truth: np.ndarray, view, phase: int, rng, count: int = 2, length: int = 40) -> list:
    """``count`` horizontal strokes ([[x, y], [x, y]] in image px) of ``length`` px inside ``phase`` and the
    view [top, left, bottom, right], at least the brush radius plus 2 px from the phase's border; a dot at the
    phase's deepest pixel where no such stroke fits."""
    from scipy import ndimage as ndi

    top, left, bottom, right = view
    # Distances on the view plus a margin wider than they are tested for: a phase border just outside the
    # view then counts too (the crop's own edge is no border to the distance transform).
    margin = BRUSH + 3
    t0, l0 = max(top - margin, 0), max(left - margin, 0)
    around = ndi.distance_transform_edt(truth[t0:bottom + margin, l0:right + margin] == phase)
    inside = around[top - t0:bottom - t0, left - l0:right - l0]
    if inside.max() == 0:
        return []
    deep = inside > BRUSH + 2
    length = min(length, deep.shape[1])
    runs = np.cumsum(np.pad(deep, ((0, 0), (1, 0))), axis=1)
    fits = np.argwhere(runs[:, length:] - runs[:, :-length] == length)  # (row, first col) of whole strokes
    if len(fits) == 0:
        y, x = np.unravel_index(np.argmax(inside), inside.shape)
        return [[[int(x) + left, int(y) + top]]]
    chosen = fits[rng.choice(len(fits), size=min(count, len(fits)), replace=False)]
    return [[[int(x) + left, int(y) + top], [int(x) + left + length - 1, int(y) + top]] for y, x in chosen]


def child_app(spec: dict) -> int:
    """The app's Train → overlay, through its engine and session (what the HTTP routes call)."""
    from alibi_vit.app.engine import Engine
    from alibi_vit.app.pyramid import TILE
    from alibi_vit.app.session import Session
    from alibi_vit.cli.options import parse_model_args

    device, result = spec["device"], {}
    deadline = CHILD_STARTED + spec["limit"] - 10  # stop waiting for the fill before the parent stops this process
    shutil.rmtree(spec["session"], ignore_errors=True)  # a fresh session: no labels or model restored
    session = Session(spec["session"], [spec["image"]])
    backbone_kwargs = dict(checkpoint=None, pretrained=False, model_kwargs=parse_model_args(spec["model_args"]),
                           seed=0)
    engine = Engine(session, spec["backbone"], backbone_kwargs, device=device)
    try:
        session.update_settings(backbone=spec["backbone"])  # PUT /api/settings {"backbone": …}
        engine.backbone_changed()
        (image_id,) = session.images
        engine.open(image_id)  # POST /api/images/{id}/open
        truth = np.load(spec["truth"])
        h, w = truth.shape
        rows, cols = min(VIEW[0], h), min(VIEW[1], w)
        view = [(h - rows) // 2, (w - cols) // 2, (h - rows) // 2 + rows, (w - cols) // 2 + cols]
        rng = np.random.default_rng(0)
        strokes = 0
        for phase in range(1, PHASES + 1):
            value = session.add_class(f"phase {phase}")["value"]  # POST /api/classes
            for points in strokes_in_view(truth, view, phase, rng):
                session.add_stroke(image_id, value, BRUSH, points)  # POST /api/images/{id}/strokes
                strokes += 1
        result.update(view=view, strokes=strokes)
        start = time.perf_counter()
        task = engine.submit_train(image_id, view)  # POST /api/train {image, region}
        try:
            answer = task.future.result(timeout=max(deadline - time.perf_counter(), 1))
        finally:
            engine.scheduler.release(task)
        result["train_answer_s"] = round(time.perf_counter() - start, 2)
        result["model_s"] = answer["model"]["seconds"]
        # The page then draws the overlay: the prediction tiles over the view (level 0, TILE² px each).
        tiles = [(r, c) for r in range(view[0] // TILE, (view[2] - 1) // TILE + 1)
                 for c in range(view[1] // TILE, (view[3] - 1) // TILE + 1)]
        for r, c in tiles:
            engine.tile(image_id, "prediction", 0, r, c)  # GET /api/images/{id}/tiles/prediction/0/r/c.png
        result.update(overlay_s=round(time.perf_counter() - start, 2), tiles=len(tiles), **_gpu_figures(device))
        result["host_peak_gb_at_overlay"] = _own_peak_gb()
        _write(spec["result"], result)
        while not (engine.predicted.get(image_id) or {}).get("complete"):  # the background fill of the rest
            if time.perf_counter() > deadline:
                break
            time.sleep(0.05)
        else:
            result["complete_s"] = round(time.perf_counter() - start, 2)
        result.update(_gpu_figures(device))
        _write(spec["result"], result)
    except Exception as err:  # noqa: BLE001 - reported in the row; the traceback goes to the child's log
        result["error"] = f"{type(err).__name__}: {err}"[:300]
        _write(spec["result"], result)
        raise
    finally:
        engine.close()
    return 0


CHILD_STARTED = time.perf_counter()  # a child's start, near enough: its limit counts from there


def child_main(argv) -> int:
    kind, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    return {"vit": child_vit, "app": child_app}[kind](spec)


# ---- the run ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", nargs="+", default=["cuda", "cpu"], choices=("cuda", "cpu"),
                   help="devices, in this order (default cuda cpu); the model is trained on the first")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS,
                   help="what to measure per device: image (apply on the grey TIFF), mosaic (apply on the OME-Zarr), "
                        "vit (ViT features of the mosaic alone), app (Train → overlay); default all")
    p.add_argument("--train-size", type=int, default=1024, help="side of the training image (px)")
    p.add_argument("--image-size", type=int, default=4096, help="side of the grey TIFF (px)")
    p.add_argument("--mosaic-size", type=int, default=16384, help="side of the OME-Zarr mosaic (px)")
    p.add_argument("--backbone", default=BACKBONE, help="timm name of the (randomly initialised) backbone")
    p.add_argument("--model-arg", action="append", default=None, metavar="KEY=VALUE",
                   help="architecture override for the backbone, as segment train takes it (repeatable)")
    p.add_argument("--limit", type=float, default=600, help="seconds each row may take (default 600)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds the whole run may take: a row gets at most what is left; rows past it are skipped")
    p.add_argument("--work", type=Path, default=None,
                   help="folder for the generated images, model and logs, kept (default: a temporary folder, removed)")
    p.add_argument("--append", action="store_true", help="add the rows to the results file of an earlier run")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the .md and .json go (default benchmarks/results/, smoke runs results/smoke/)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU only, a toy backbone, 256² images and a 1024² mosaic: checks every code path")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.device, args.train_size, args.image_size, args.mosaic_size = ["cpu"], 256, 256, 1024
        args.model_arg = SMOKE_MODEL_ARGS if args.model_arg is None else args.model_arg
        args.limit = min(args.limit, 120)
    args.model_arg = args.model_arg or []
    return args


def results_stem(args) -> tuple[str, str]:
    """(file stem, device in words): the GPU's name when a CUDA device is measured, else the CPU."""
    if args.smoke:
        return "vit_segment_cpu-smoke", "CPU (smoke run)"
    import torch

    if "cuda" in args.device and torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return f"vit_segment_{slug(name)}", name
    return "vit_segment_cpu", "CPU"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_child"]:
        return child_main(argv[1:])
    args = parse_args(argv)
    # SIGTERM (a time limit) ends the run like Ctrl-C: the running child is stopped, the rows stay written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    stem, device_name = results_stem(args)
    earlier = None
    if args.append:
        out_dir = args.out_dir or (BENCHMARKS / "results" / ("smoke" if args.smoke else ""))
        path = Path(out_dir) / f"{stem}.json"
        earlier = json.loads(path.read_text()) if path.is_file() else None
    results = Results(args, stem, device_name, earlier)
    first_row = len(results.payload["rows"])  # this run's rows start here (--append keeps the earlier ones)
    results.write()
    work = args.work or Path(tempfile.mkdtemp(prefix="vit_segment_"))
    work = work.resolve()

    def left() -> float:
        """Seconds the next row may take: --limit, or what is left of --budget."""
        if args.budget is None:
            return args.limit
        return min(args.limit, args.budget - (time.perf_counter() - started))

    import torch

    cuda = torch.cuda.is_available()
    missing = results.payload["modules_missing"]
    failed = False
    try:
        start = time.perf_counter()
        inputs = make_inputs(work, args.train_size, args.image_size, args.mosaic_size,
                             min(BASE, max(args.train_size, args.image_size)),
                             need_mosaic=bool({"mosaic", "vit"} & set(args.rows)) and "zarr" not in missing)
        results.payload["prepared"].update(inputs["made_seconds"], total_s=round(time.perf_counter() - start, 1))
        results.write()
        inputs = inputs["paths"]
        model_ready = (model_folder(args, work) / "config.json").is_file() and args.work is not None
        if model_ready:
            results.payload["prepared"]["model"] = f"reused from {model_folder(args, work)}"
        elif missing:
            skip = f"skipped: needs {', '.join(missing)} (install the wheels in .whl/)"
            results.add({"input": f"train {args.train_size}² TIFF + scribbles", "size": args.train_size,
                         "device": args.device[0], "status": skip})
        elif args.device[0] == "cuda" and not cuda:
            results.add({"input": f"train {args.train_size}² TIFF + scribbles", "size": args.train_size,
                         "device": "cuda", "status": "skipped: CUDA is not available"})
        elif left() < 5:
            results.add({"input": f"train {args.train_size}² TIFF + scribbles", "size": args.train_size,
                         "device": args.device[0], "status": "skipped: out of the --budget"})
        else:
            model_ready = train_row(results, args, inputs, args.device[0], left(), work)
            failed |= not model_ready
        for device in args.device:
            for kind in args.rows:
                size = args.mosaic_size if kind in ("mosaic", "vit") else args.image_size
                names = {"image": "apply grey TIFF", "mosaic": "apply OME-Zarr mosaic",
                         "vit": "ViT features, OME-Zarr mosaic", "app": "app Train → overlay, grey TIFF"}
                skip = None
                if device == "cuda" and not cuda:
                    skip = "skipped: CUDA is not available"
                elif missing:  # zarr too: reading a TIFF goes through alibi_vit.chunked.open_image, which imports it
                    skip = f"skipped: needs {', '.join(missing)} (install the wheels in .whl/)"
                elif kind != "app" and not model_ready:
                    skip = "skipped: no model (segment train did not finish)"
                elif left() < 5:
                    skip = "skipped: out of the --budget"
                if skip:
                    results.add({"input": names[kind], "size": size, "device": device, "status": skip})
                    continue
                if kind in ("image", "mosaic"):
                    apply_row(results, args, inputs, kind, device, left(), work)
                elif kind == "vit":
                    vit_rows(results, args, inputs, device, left(), work)
                else:
                    app_row(results, args, inputs, device, left(), work)
        failed |= any(r["status"].startswith("failed") or "needs" in r["status"]
                      for r in results.payload["rows"][first_row:])
        results.write(complete=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    for path in (Path(args.out_dir or (BENCHMARKS / "results" / ("smoke" if args.smoke else ""))) / f"{stem}.{ext}"
                 for ext in ("md", "json")):
        print(f"wrote {path}")
    print("\n".join(results.markdown()))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
