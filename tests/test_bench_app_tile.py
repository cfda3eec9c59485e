"""benchmarks/bench_app_tile.py: a smoke run trains through the app's API with each tile size asked
and writes a report with a row per tile size."""

import json

import pytest

from tests.helpers import benchmark_module

pytest.importorskip("fastapi")
bench = benchmark_module("bench_app_tile")


def test_views_are_those_of_the_big_image_benchmark():
    # bench_app_bigimage.py's recorded views at 4096² and 16384² (the latter within 2 px: the page's zoom)
    train, big = bench.views(4096, 16384)
    assert train == [1695, 1660, 2401, 2436]
    assert all(abs(a - b) <= 2 for a, b in zip(big, [9705, 5849, 10172, 6362]))


@pytest.mark.slow
def test_smoke_run_writes_a_row_per_tile_size(tmp_path):
    assert bench.main(["--smoke", "--tiles", "518", "252", "--out-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "app_tile_cpu.json").read_text())
    runs = report["result"]["runs"]
    assert [r["tile"] for r in runs] == [518, 252]
    for r in runs:
        assert r["train"]["answer_s"] >= r["train"]["model_s"] > 0 and 0 < r["train"]["predicted"] <= 1
        assert 0 < r["big"]["predicted"] < 1 and r["fill_mp_per_s"] >= 0
    assert set(report["medians"]) == {"518", "252"}
    assert "| 518 |" in (tmp_path / "app_tile_cpu.md").read_text()
