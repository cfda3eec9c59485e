"""The attention benchmark's --smoke mode runs on the CPU and writes its JSON and markdown reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_attention.py"


def test_smoke_mode_writes_expected_rows(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "attention_cpu-smoke.json").read_text())
    assert report["smoke"] is True and report["command"].startswith("python benchmarks/bench_attention.py --smoke")
    assert report["torch"] and report["triton"]
    got = {(r["mode"], r["backend"]) for r in report["rows"]}
    want = {(m, b) for m in ("fwd", "fwd+bwd") for b in ("triton", "sdpa-bias", "sdpa-nobias", "eager")}
    assert got == want | {("fwd+bwd", "triton-atomic-dq")}  # its forward is triton's: timed once
    for r in report["rows"]:
        assert r["status"] == "ok" and r["ms"] > 0 and r["N"] == 5 + 5 * 5
        if r["mode"] == "fwd" and r["backend"] != "sdpa-nobias":
            # Every biased backend agrees with the materialised-bias SDPA; the unbiased one does not.
            assert r["max_abs_diff_vs_sdpa_bias"] < 1e-5
    nobias = next(r for r in report["rows"] if r["mode"] == "fwd" and r["backend"] == "sdpa-nobias")
    assert nobias["max_abs_diff_vs_sdpa_bias"] > 1e-3
    assert {(e["mode"], e["triton_variant"]) for e in report["ratios"]} == {
        ("fwd", "triton"), ("fwd+bwd", "triton"), ("fwd+bwd", "triton-atomic-dq")}
    assert "| tiny | 70 |" in (tmp_path / "attention_cpu-smoke.md").read_text()


def test_full_mode_without_cuda_exits_with_message():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "vit-s", "--sizes", "224"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "needs a CUDA device" in proc.stderr
