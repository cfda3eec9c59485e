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
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "attention_cpu-smoke.json").read_text())
    assert report["smoke"] is True and report["command"].startswith("python benchmarks/bench_attention.py --smoke")
    assert report["complete"] is True
    assert report["torch"] and report["triton"]
    got = {(r["mode"], r["slopes"], r["backend"]) for r in report["rows"]}
    biased = ("triton", "sdpa-bias", "eager")
    want = {("fwd", None, b) for b in ("triton-nobias", "sdpa-nobias")}
    want |= {("fwd+bwd", None, b) for b in ("triton-nobias", "sdpa-nobias")}
    want |= {("fwd", s, b) for s in ("constant", "per-head") for b in biased}
    # atomic dQ's forward is triton's, and a forward does not know whether slopes are learned
    want |= {("fwd+bwd", s, b) for s in ("constant", "per-head", "learned") for b in (*biased, "triton-atomic-dq")}
    assert got == want
    for r in report["rows"]:
        assert r["status"] == "ok" and r["ms"] > 0 and r["N"] == 5 + 5 * 5, r
        assert r["ms_p20"] <= r["ms"] <= r["ms_p80"] and len(r["ms_rounds"]) == 1
        # Output and gradients (slopes' too when learned) checked against fp32 before timing.
        want_keys = {"out"} if r["mode"] == "fwd" else {"out", "dq", "dk", "dv"}
        if r["slopes"] == "learned":
            want_keys.add("dslopes")
        assert set(r["errors"]) == want_keys and max(r["errors"].values()) <= 1e-4
    assert {(e["mode"], e["slopes"], e["triton_variant"]) for e in report["ratios"]} == {
        ("fwd", "constant", "triton"), ("fwd", "per-head", "triton"),
        *{("fwd+bwd", s, v) for s in ("constant", "per-head", "learned") for v in ("triton", "triton-atomic-dq")}}
    assert "| tiny | 70 |" in (tmp_path / "attention_cpu-smoke.md").read_text()


def test_full_mode_without_cuda_exits_with_message():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--models", "vit-s", "--sizes", "224"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "needs a CUDA device" in proc.stderr


def test_correctness_check_catches_a_backend_without_the_bias():
    pytest.importorskip("triton")
    import torch

    from tests.helpers import benchmark_module

    bench = benchmark_module("bench_attention")
    grid = (5, 5)
    q, k, v, dout = (torch.randn(1, 2, 30, 16, generator=torch.Generator().manual_seed(i)) for i in range(4))
    fns = bench.backend_fns(["sdpa-bias", "sdpa-nobias"], grid)
    worst, _ = bench.check("sdpa-bias", fns["sdpa-bias"], q, k, v, None, grid, dout, True, "float32")
    assert worst <= bench.TOLERANCE["float32"]
    # The bias-free SDPA checked as if it were a biased backend: its error is far above the threshold.
    worst, errors = bench.check("sdpa-bias", fns["sdpa-nobias"], q, k, v, None, grid, dout, True, "float32")
    assert worst > 100 * bench.TOLERANCE["float32"] and set(errors) == {"out", "dq", "dk", "dv"}


def test_check_compares_the_slice_of_the_full_call_with_learned_slopes():
    """The check runs the timed call on the whole batch and compares one batch element and two heads; the
    upstream gradient is zero elsewhere, so the slopes' gradient is the slice's as well."""
    import torch

    from tests.helpers import benchmark_module

    bench = benchmark_module("bench_attention")
    grid, heads = (4, 4), 3
    q, k, v, dout = (torch.randn(3, heads, bench.PREFIX + 16, 16, generator=torch.Generator().manual_seed(i))
                     for i in range(4))
    slopes = torch.tensor([0.5, 1.0, 2.0], requires_grad=True)
    calls = []

    def eager(q, k, v, s):
        calls.append(q.shape)
        return bench.backend_fns(["eager"], grid)["eager"](q, k, v, s)

    worst, errors = bench.check("eager", eager, q, k, v, slopes, grid, dout, True, "float32")
    assert calls == [q.shape]  # the timed shape, not a slice
    assert set(errors) == {"out", "dq", "dk", "dv", "dslopes"} and worst <= bench.TOLERANCE["float32"]
    # A wrong slope on a head outside the slice does not matter; on one inside it does.
    worst_outside, _ = bench.check("eager", eager, q, k, v, torch.tensor([0.5, 1.0, 9.0], requires_grad=True), grid,
                                   dout, True, "float32")
    assert worst_outside <= bench.TOLERANCE["float32"]

    def off(q, k, v, s):
        return eager(q, k, v, s * torch.tensor([1.0, 1.5, 1.0]))

    worst_inside, _ = bench.check("eager", off, q, k, v, slopes, grid, dout, True, "float32")
    assert worst_inside > 10 * bench.TOLERANCE["float32"]
