"""benchmarks/gpu_suite.sh would run on the lent GPU machine: a CPU dry run (--smoke) of every phase in a
simulation of its image (the modules it lacks cannot be imported), into $OUT, within the limits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import benchmark_module, gpu_image_env

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"
# The GPU image (python 3.12, torch 2.11, triton 3.6, numpy 2.5, lightning, timm, scikit-image, tifffile) lacks these.
MISSING_ON_GPU_IMAGE = ("jsonargparse", "fastapi", "uvicorn", "xgboost", "pycocotools", "pydensecrf2", "playwright")
MAX_FILES = 8  # what one command on the GPU machine may bring back

suite = benchmark_module("gpu_suite")
shard = benchmark_module("pytest_shard")


@pytest.fixture
def gpu_image(tmp_path):
    """Environment of a process that sees the GPU image's modules: a sitecustomize blocks the missing ones."""
    return {**gpu_image_env(tmp_path, MISSING_ON_GPU_IMAGE), "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}


def _smoke(env, *phases):
    proc = subprocess.run(["bash", str(SUITE), "--smoke", *phases], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = Path(env["OUT"])
    status_file = out / "gpu_suite_cpu-smoke.json"
    return proc, out, json.loads(status_file.read_text()) if status_file.is_file() else {}


def _check_phase(out, status, phase):
    entry = status[phase]
    assert entry["ok"] and entry["smoke"] and entry["seconds"] < entry["limit_s"], entry
    assert all(c["returncode"] == 0 for c in entry["commands"])
    for name in entry["files"]:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    log = (out / f"gpu_suite_{phase}_cpu-smoke.log").read_text()
    assert f"== phase {phase}: ok" in log
    return entry


def test_the_simulated_image_lacks_its_modules(gpu_image):
    for name in MISSING_ON_GPU_IMAGE:
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], env=gpu_image, capture_output=True, text=True)
        assert proc.returncode != 0 and "the GPU image lacks it" in proc.stderr, name


def test_env_phase_reports_the_image_and_checks_a_first_call(gpu_image):
    proc, out, status = _smoke(gpu_image, "env")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    _check_phase(out, status, "env")
    report = json.loads((out / "gpu_env_cpu-smoke.json").read_text())
    assert report["torch"] and report["triton"] and report["numpy"]
    assert report["modules"]["pytest"] and not any(report["modules"][m] for m in MISSING_ON_GPU_IMAGE)
    first = report["first_call"]
    assert first["finite"] and set(first["max_relative_error"]) == {"out", "dq", "dk", "dv", "dslopes"}
    assert max(first["max_relative_error"].values()) < 5e-2  # fp16 against the float64 eager reference
    assert len(list(out.iterdir())) <= MAX_FILES


def test_tests_phase_collects_every_gpu_test_file_in_disjoint_shares(gpu_image):
    proc, out, status = _smoke(gpu_image, "tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    _check_phase(out, status, "tests")
    report = json.loads((out / "gpu_tests_cpu-smoke.json").read_text())
    assert report["files"] == list(suite.GPU_TEST_FILES)
    log = (out / "gpu_suite_tests_cpu-smoke.log").read_text()
    # Each share reports "kept/total tests collected": together they hold every test once.
    totals = {int(line.split("/")[1].split()[0]) for line in log.splitlines() if "tests collected" in line}
    (total,) = totals
    assert total > 100 and sum(report["collected"].values()) == total and len(report["collected"]) == 2
    assert len(list(out.iterdir())) <= MAX_FILES


def test_every_test_module_collects_on_the_gpu_image(gpu_image):
    """`pytest -m gpu tests/` on the GPU image: a module needing a package the image lacks skips, never errors."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                           "tests/"], cwd=ROOT, env=gpu_image, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("phase,tag", [("sweep-518", "518"), ("flex", "flex-518"), ("flex-learned", "flex-learned-518")])
def test_benchmark_phases_write_their_rows_as_they_go(gpu_image, phase, tag):
    proc, out, status = _smoke(gpu_image, phase)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    entry = _check_phase(out, status, phase)
    report = json.loads((out / f"attention_cpu-smoke_{tag}.json").read_text())
    assert report["complete"] and not report["autotune"] and report["rows"]
    assert all(r["status"] == "ok" for r in report["rows"]), [r for r in report["rows"] if r["status"] != "ok"]
    backends = {r["backend"] for r in report["rows"]}
    expected = {"sweep-518": {"triton", "triton-two-kernel", "triton-nobias", "sdpa-bias"},
                "flex": {"triton", "flex", "flex-table", "flex-nobias"}, "flex-learned": {"triton", "flex", "flex-table"}}
    assert backends == expected[phase]
    if phase == "flex-learned":  # flex compiled without autotuning (the smoke run's flex is eager anyway)
        assert "--flex-mode default" in report["command"]
    assert f"attention_cpu-smoke_{tag}.md" in entry["files"]
    assert len(list(out.iterdir())) <= MAX_FILES


def test_the_fair_baselines_the_backward_kernels_the_configs_and_the_sqrt_offsets(gpu_image):
    proc, out, status = _smoke(gpu_image, "fair", "learned-ab", "configs", "sqrt-offsets")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for phase in ("fair", "learned-ab", "configs", "sqrt-offsets"):
        _check_phase(out, status, phase)
    fair = json.loads((out / "attention_cpu-smoke_fair.json").read_text())
    # The smoke run keeps what the CPU can run of the fair set (not the SDPA kernels pinned to CUDA ones).
    assert {r["backend"] for r in fair["rows"]} == {"auto", "triton", "triton-nobias", "sdpa-bias"}
    auto_rows = [r for r in fair["rows"] if r["backend"] == "auto"]
    assert auto_rows and all(r["auto_choice"]["backend"] == "sdpa" and r["auto_choice"]["how"] == "rule"
                             for r in auto_rows)  # the CPU follows the rule
    assert [a["fastest_other"] for a in fair["auto"]] and all(a["auto_vs_fastest"] > 0 for a in fair["auto"])
    kernels = json.loads((out / "backward_kernels_cpu-smoke.json").read_text())
    assert [r["slopes"] for r in kernels["rows"]] == ["constant", "per-head", "learned"]
    assert all({"alibi_vit::alibi_attention_fwd", "alibi_vit::alibi_attention_bwd"} <= r["kernels"].keys()
               for r in kernels["rows"])
    configs = json.loads((out / "attention_cpu-smoke_configs.json").read_text())
    assert configs["autotune"] and "launch_configs" in configs
    for offsets in ("int32", "fp16"):  # one process each, told by the environment
        report = json.loads((out / f"attention_cpu-smoke_sqrt-{offsets}.json").read_text())
        assert {r["backend"] for r in report["rows"]} == {"triton", "triton-sqrt"}
        assert report["settings"]["ALIBI_TRITON_SQRT_OFFSETS"] == offsets
    assert all(len(status[p]["files"]) + 1 <= MAX_FILES for p in status)


def test_the_other_sizes_and_the_sass_phase(gpu_image):
    proc, out, status = _smoke(gpu_image, "sweep-1022", "flex-1022", "sass", "fa3", "measure")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    fa3 = _check_phase(out, status, "fa3")  # the Gluon kernel's phase: on the CPU its checks are the NumPy model's
    assert {"fa3_cpu-smoke.json", "fa3_cpu-smoke.md"} <= set(fa3["files"])
    _check_phase(out, status, "measure")  # TauFactor through segment measure and directly: the same τ
    report = json.loads((out / "measure_tortuosity_cpu.json").read_text())
    if suite.missing_modules(("taufactor",)):  # not in the test extra: the report says so and measures nothing
        assert report["skipped"] == "taufactor not installed" and not report["rows"]
    else:
        assert report["rows"] and all(r["tau"] == r["tau_taufactor"] for r in report["rows"])
    for phase, tag in (("sweep-1022", "1022"), ("flex-1022", "flex-1022")):
        _check_phase(out, status, phase)
        assert json.loads((out / f"attention_cpu-smoke_{tag}.json").read_text())["complete"]
    entry = _check_phase(out, status, "sass")
    (sass,) = [name for name in entry["files"] if name.endswith(".json")]
    report = json.loads((out / sass).read_text())
    assert report["complete"] and {r["variant"] for r in report["rows"]} == {"alibi", "nobias"}
    # The phases' results, logs and one status file: one command each on the GPU machine brings back its own.
    assert all(len(status[p]["files"]) + 1 <= MAX_FILES for p in status)


def test_model_and_train_phases_share_one_command_within_their_own_limits(gpu_image):
    env = {**gpu_image, "GPU_SUITE_LIMIT_MODEL": "200", "GPU_SUITE_LIMIT_TRAIN": "150"}
    proc, out, status = _smoke(env, "model", "train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    model, train = _check_phase(out, status, "model"), _check_phase(out, status, "train")
    assert (model["limit_s"], train["limit_s"]) == (200, 150)
    rows = json.loads((out / "model_cpu-smoke.json").read_text())["rows"]
    # the simulated image runs the interpreter, so the fused kernel is among the variants, and each row names its path
    assert {r["variant"] for r in rows} == {"dinov2", "alibi-sdpa", "alibi-eager", "alibi-triton"}
    assert all(r["status"] == "ok" and r["kernel"] for r in rows), rows
    assert {r["ran"] for r in rows if r["variant"] == "alibi-triton"} == {"triton"}
    # the benchmark was told to stop starting rows before the phase's limit, less the time to write up
    words = model["commands"][0]["command"].split()
    budget = int(words[words.index("--time-limit") + 1])
    assert 200 - suite.ROW_RESERVE["model"] - 10 <= budget <= 200 - suite.ROW_RESERVE["model"]
    report = json.loads((out / "distill_throughput_cpu-smoke.json").read_text())
    assert {r["backend"] for r in report["results"]} == {"triton", "sdpa"}
    assert all(r["status"] == "ok" and r["img_per_s"] > 0 for r in report["results"])
    # no GPU in the simulation: the DDP check records Lightning's refusal instead of a step
    assert report["ddp"]["runs"] is False and report["ddp"]["message"]
    assert len(list(out.iterdir())) <= MAX_FILES


def test_a_phase_needs_a_gpu_or_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SUITE), "env"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr + proc.stdout
    proc = subprocess.run(["bash", str(SUITE), "--smoke", "warp"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_shares_hold_every_test_once():
    items = list(range(11))
    shares = [shard.share(items, i, 3) for i in range(3)]
    kept = [k for k, _ in shares]
    assert kept == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    assert all(sorted(k + d) == items for k, d in shares)
    assert shard.parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "x/2", "1", "-1/3"):
        with pytest.raises(ValueError, match="--shard"):
            shard.parse_shard(bad)
