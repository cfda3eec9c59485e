"""benchmarks/bench_model.py: the whole-model forward benchmark's rows, batches, kernels and time limit (CPU)."""

import json

import pytest

from tests.helpers import benchmark_module

bench = benchmark_module("bench_model")


def test_smoke_rows_name_the_attention_path_each_variant_took(tmp_path):
    assert bench.main(["--smoke", "--variants", "dinov2", "alibi-auto", "alibi-sdpa", "alibi-eager",
                       "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "model_cpu-smoke.json").read_text())
    rows = report["rows"]
    assert not report["meta"]["incomplete"]
    assert {(r["variant"], r["image_px"]) for r in rows} == {(v, s) for v in ("dinov2", "alibi-auto", "alibi-sdpa",
                                                                                "alibi-eager") for s in (28, 56)}
    assert all(r["status"] == "ok" and r["img_per_s"] > 0 and r["first_call_s"] > 0 for r in rows), rows
    by = {(r["variant"], r["image_px"]): r for r in rows}
    # auto on the CPU is SDPA with the materialised bias; DINOv2 is timm's own SDPA; eager is explicit softmax.
    assert by["alibi-auto", 56]["ran"] == "auto → sdpa (rule)" and by["dinov2", 56]["ran"] == "timm sdpa"
    assert any("scaled_dot_product" in k for k in by["alibi-sdpa", 56]["kernel"])
    assert any("softmax" in k for k in by["alibi-eager", 56]["kernel"])
    assert not any("scaled_dot_product" in k for k in by["alibi-eager", 56]["kernel"])
    # 56 px = 4×4 patches + 5 prefix tokens = 21 tokens; the fp32 (21, 21) bias, only where it is materialised.
    assert by["alibi-sdpa", 56]["tokens"] == 21
    assert by["alibi-sdpa", 56]["bias_mib"] == round(21 * 21 * 4 / 2**20, 1)
    assert by["dinov2", 56]["bias_mib"] == 0.0
    # seconds per megapixel and images per second describe the same batches
    r = by["dinov2", 56]
    assert r["s_per_mpx"] == pytest.approx(1 / (r["img_per_s"] * 56 * 56 / 1e6), rel=0.02)
    md = (tmp_path / "model_cpu-smoke.md").read_text()
    assert "| small | 56 | 21 | 2 | alibi-sdpa |" in md


def test_batches_follow_the_token_budget():
    args = bench.parse_args(["--device", "cuda"])
    args.device = "cuda"
    # 90000 tokens: 518 px has 37² + 5 = 1374 tokens → 66 images; 224 px: 261 → 345, capped at 256; 2044 px: 21321 → 4
    assert [bench.batch_for(args, s) for s in (518, 224, 2044)] == [66, 256, 4]
    args.device = "cpu"
    assert bench.batch_for(args, 518) == 1
    assert bench.batch_for(bench.parse_args(["--batch", "3"]), 1022) == 3


def test_compile_rows_take_the_fastest_variants_but_not_auto():
    rows = [{"model": "small", "image_px": 518, "compiled": False, "variant": v, "img_per_s": s}
            for v, s in (("dinov2", 10.0), ("alibi-triton", 12.0), ("alibi-auto", 12.5), ("alibi-sdpa", 8.0),
                         ("alibi-flex", None))]
    assert bench.fastest(rows, "small", 518, 2) == ["alibi-triton", "dinov2"]
    assert bench.fastest(rows, "base", 518, 2) == []


def test_rows_after_the_time_limit_are_skipped_not_lost(tmp_path):
    assert bench.main(["--smoke", "--variants", "alibi-sdpa", "--time-limit", "0", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "model_cpu-smoke.json").read_text())
    # every planned row is listed, none measured, and the report is complete
    assert [(r["image_px"], r["status"]) for r in report["rows"]] == [(56, "skipped: time limit"),
                                                                      (28, "skipped: time limit")]
    assert not report["meta"]["incomplete"]
    assert "skipped: time limit" in (tmp_path / "model_cpu-smoke.md").read_text()


def test_bad_sizes_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "500"])
    assert "500 px is not a positive multiple of the patch size 14" in capsys.readouterr().err
