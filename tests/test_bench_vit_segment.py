"""benchmarks/bench_vit_segment.py as the lent GPU machine would run it: its --smoke (CPU, toy sizes) in a
simulation of the GPU image, whose missing modules cannot be imported, and the parts that need no model."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import benchmark_module, gpu_image_env

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
# What the GPU image lacks (pydensecrf2 installs the module pydensecrf). zarr and xgboost are missing there too,
# but the GPU phase installs them from the wheels in .whl/, so the smoke run may import them.
MISSING_ON_GPU_IMAGE = ("jsonargparse", "fastapi", "uvicorn", "pycocotools", "pydensecrf2", "pydensecrf", "playwright",
                        "dask")

bench = benchmark_module("bench_vit_segment")


def test_smoke_run_of_the_seg_phase_on_the_simulated_gpu_image(tmp_path):
    """`gpu_suite.sh --smoke seg`: the phase runs the script, which measures every row at toy sizes."""
    out = tmp_path / "out"
    env = {**gpu_image_env(tmp_path, MISSING_ON_GPU_IMAGE), "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SUITE), "--smoke", "seg"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    phase = json.loads((out / "gpu_suite_cpu-smoke.json").read_text())["seg"]
    assert phase["ok"] and {"vit_segment_cpu-smoke.json", "vit_segment_cpu-smoke.md"} <= set(phase["files"])
    report = json.loads((out / "vit_segment_cpu-smoke.json").read_text())
    assert report["complete"] and report["smoke"] and report["modules_missing"] == []
    assert report["cpu_count"] > 0 and len(report["load_average_start"]) == 3 and report["environment"]["torch"]
    rows = {row["input"]: row for row in report["rows"]}
    assert set(rows) == {"train 256² TIFF + scribbles", "apply grey TIFF", "apply OME-Zarr mosaic",
                         "ViT backbone windows, OME-Zarr mosaic", "ViT per-pixel features, OME-Zarr mosaic",
                         "app Train → overlay, grey TIFF"}
    for row in rows.values():
        assert row["device"] == "cpu" and row["status"] == "ok", row
        assert row["wall_s"] > 0 and row["host_peak_gb"] > 0, row
    # Each apply wrote a mask of its input's full size; the mosaic was streamed (the command's own time line).
    assert rows["apply grey TIFF"]["mask_shape"] == [256, 256]
    mosaic = rows["apply OME-Zarr mosaic"]
    assert mosaic["mask_shape"] == [1024, 1024] and mosaic["size"] == 1024 and mosaic["segment_s"] > 0
    # 1024 px = 74 patches of 14: windows of 37 patches start at 0, 33, 37 along each axis.
    assert "9 windows of 518² px" in rows["ViT backbone windows, OME-Zarr mosaic"]["notes"]
    app = rows["app Train → overlay, grey TIFF"]
    assert app["strokes"] >= 3 and app["tiles"] >= 1 and app["complete_s"] >= app["overlay_s"] >= app["train_answer_s"]
    table = (out / "vit_segment_cpu-smoke.md").read_text()
    assert "| input | size | device | wall s | host peak GB | GPU peak GB | status |" in table
    assert table.count("| ok |") == len(rows)


def test_the_script_imports_neither_zarr_nor_dask_when_loaded(tmp_path):
    env = gpu_image_env(tmp_path, MISSING_ON_GPU_IMAGE + ("zarr", "xgboost"))
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import bench_vit_segment as b; "
            "assert not {'zarr', 'dask', 'torch'} & set(sys.modules), sorted(sys.modules); "
            "print(b.missing_modules(b.NEEDED_MODULES))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "['zarr', 'xgboost']"  # a blocked module counts as missing, without a crash


def test_a_child_past_its_limit_is_stopped_and_recorded(tmp_path):
    log = tmp_path / "child.log"
    run = bench.run_child([sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 1.0,
                          log, gpu=False)
    assert run["timed_out"] and 1.0 <= run["wall_s"] < 15 and run["host_peak_gb"] > 0
    assert bench.status_of(run, log) == f"timed out after {run['wall_s']:.0f} s"
    done = bench.run_child([sys.executable, "-c", "raise SystemExit('bad input')"], 30, log, gpu=False)
    assert not done["timed_out"] and bench.status_of(done, log) == "failed (exit 1): bad input"


def test_app_strokes_lie_inside_their_phase():
    from alibi_vit.trainable import synthetic_micrograph

    _, truth = synthetic_micrograph(256, seed=0)
    view = [20, 30, 220, 250]
    rng = np.random.default_rng(0)
    for phase in (1, 2, 3):
        strokes = bench.strokes_in_view(truth, view, phase, rng)
        assert strokes
        for points in strokes:
            (x0, y0), (x1, y1) = points[0], points[-1]
            assert y0 == y1 and view[0] <= y0 < view[2] and view[1] <= x0 <= x1 < view[3]
            # the brush (radius BRUSH) stays inside the phase along the whole stroke
            rows = slice(y0 - bench.BRUSH, y0 + bench.BRUSH + 1)
            assert (truth[rows, x0 - bench.BRUSH:x1 + bench.BRUSH + 1] == phase).all()


@pytest.mark.parametrize("names,missing", [(("json", "no_such_module_xyz"), ["no_such_module_xyz"]), ((), [])])
def test_missing_modules(names, missing):
    assert bench.missing_modules(names) == missing
