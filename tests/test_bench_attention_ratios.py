"""bench_attention.ratios: speed ratios against each baseline and against the fastest SDPA kernel without bias."""

from tests.helpers import benchmark_module

bench = benchmark_module("bench_attention")


def test_ratios_take_the_fastest_pinned_sdpa_kernel_as_ceiling():
    times = {"triton": 2.0, "sdpa-nobias": 1.6, "sdpa-nobias-flash": 1.8, "sdpa-nobias-cudnn": 1.5,
             "sdpa-nobias-efficient": None, "sdpa-bias": 5.0, "flex": 3.0, "flex-table": 2.6}
    mib = {"triton": 110.0, "sdpa-nobias-cudnn": 100.0}
    # Bias-free backends carry no slopes; the biased ones run with constant slopes here.
    rows = [dict(model="vit-s", image_px=518, mode="fwd+bwd", backend=b, ms=t, extra_mib=mib.get(b),
                 slopes=None if "nobias" in b else "constant") for b, t in times.items()]
    (entry,) = bench.ratios(rows)
    assert entry["slopes"] == "constant" and entry["memory_vs_best_sdpa_nobias"] == 1.1
    assert entry["triton_variant"] == "triton"
    assert entry["speed_vs_sdpa-nobias"] == 0.8 and entry["speed_vs_sdpa-bias"] == 2.5
    assert entry["speed_vs_flex"] == 1.5 and entry["speed_vs_flex-table"] == 1.3
    # "Faster than Flex" is against Flex at its best: the table score_mod here.
    assert entry["best_flex"] == "flex-table" and entry["speed_vs_best_flex"] == 1.3
    # The failed (None) efficient kernel is ignored; cuDNN is the fastest without bias.
    assert entry["best_sdpa_nobias"] == "sdpa-nobias-cudnn" and entry["speed_vs_best_sdpa_nobias"] == 0.75
