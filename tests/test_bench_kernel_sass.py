"""benchmarks/bench_kernel_sass.py: its SASS parsing and occupancy rule, and one real sm_90 compile."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import benchmark_module

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_kernel_sass.py"


bench = benchmark_module("bench_kernel_sass")


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                       /* 0x0 */
        /*0010*/                   IADD3 R2, R1, 0x1, RZ ;                      /* 0x0 */
        /*0020*/                   FADD R3, R2, R2 ;                            /* 0x0 */
        /*0030*/               @P0 BRA 0x10 ;                                   /* 0x0 */
        /*0040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ; /* 0x0 */
        /*0050*/                   FMUL R4, R3, R3 ;                            /* 0x0 */
        /*0060*/              @!P4 BRA 0x40 ;                                   /* 0x0 */
        /*0070*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], R24 ; /* 0x0 */
        /*0080*/                   FMUL R4, R3, R3 ;                            /* 0x0 */
        /*0090*/                   FMUL R4, R3, R3 ;                            /* 0x0 */
        /*00a0*/              @!P4 BRA 0x70 ;                                   /* 0x0 */
        /*00b0*/                   BRA 0xc0 ;                                   /* 0x0 */
        /*00c0*/                   EXIT ;                                       /* 0x0 */
"""


def test_main_loop_is_the_shortest_loop_with_tensor_core_instructions():
    # Loops: 0x10-0x30 (3 instructions, no HGMMA), 0x40-0x60 (3, HGMMA), 0x70-0xa0 (4, HGMMA);
    # BRA 0xc0 jumps forward and is no loop.
    assert bench.sass_main_loop(SASS) == 3


def test_unit_counts_and_cycle_bounds_of_a_loop():
    body = bench.main_loop_body(SASS)  # 0x40-0x60: HGMMA.64x64x16, FMUL, BRA
    units = bench.unit_counts(body + ["MUFU.EX2 R1, R2", "@P0 LDGSTS.E [R1], desc[UR4][R2.64]",
                                      "WARPGROUP.DEPBAR.LE gsb0, 0x0", "LDL R3, [R1]"], num_warps=8)
    assert units["hgmma"] == 1 and units["hmma"] == 0 and units["waits"] == 1 and units["spill"] == 1
    assert units["flops"] == 2 * 64 * 64 * 16 * 2  # two warpgroups of 8 warps
    assert units["mufu"] == 8 * 32 and units["lsu"] == 2 * 8 and units["issue"] == 7 * 8
    assert units["loads"] == {"LDG": 0, "LDGSTS": 1}
    c = bench.cycles_per_score(units, scores=64 * 64)
    assert c["tensor"] == round(units["flops"] / 4096 / 4096, 5) and c["issue"] == round(56 / 4096 / 4, 5)
    assert c["bound_overlap"] == max(c["tensor"], c["mufu"], c["issue"], c["lsu"])


def test_gather_is_pipelined_only_when_the_added_loads_are_async_copies():
    def row(ldg, ldgsts):
        return {"loop_global_loads": {"LDG": ldg, "LDGSTS": ldgsts}}

    assert bench.gather_pipelined(row(2, 10), row(2, 6)) is True
    assert bench.gather_pipelined(row(6, 6), row(2, 6)) is False
    assert bench.gather_pipelined(row(2, 6), row(2, 6)) is None


def test_no_tensor_core_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop"):
        bench.sass_main_loop(SASS.replace("HGMMA", "FFMA"))


def test_ctas_per_sm_follows_the_sm90_limits():
    ctas = bench.ctas_per_sm
    # 169 registers → 176 per thread (a warp allocates 256-register units): 5632 per warp,
    # 11 warps fit in 64K registers: one CTA of 8 warps.
    assert ctas(169, 8, 82176) == 1
    # 106 → 112 per thread: 3584 per warp, 18 warps: two CTAs of 8; 2 × (82176 + 1024) B shared fit 228 KiB.
    assert ctas(106, 8, 82176) == 2
    # Registers would allow 4 CTAs of 4 warps (128 → 4096 per warp, 16 warps), shared memory only 2.
    assert ctas(128, 4, 100000) == 2
    assert ctas(32, 1, 0) == 32  # the 32-CTA cap


def test_script_compiles_the_forward_for_sm90(tmp_path):
    pytest.importorskip("triton")
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not ((bin_dir / "ptxas").is_file() and (bin_dir / "cuobjdump").is_file()):
        pytest.skip("this Triton build ships no ptxas/cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kernels", "fwd", "--head-dims", "64", "--dtypes",
                           "bfloat16", "--slopes", "constant", "--default-only", "--out-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # Status 1 only when a goal is missed; the results are written either way.
    assert proc.returncode in (0, 1) and "wrote" in proc.stdout, proc.stderr[-2000:]
    (path,) = tmp_path.glob("kernel_sass_sm90_triton*.json")  # named by the Triton version that compiled it
    report = json.loads(path.read_text())
    assert path.stem == "kernel_sass_sm90_triton" + ".".join(report["triton"].split(".")[:2])
    assert report["complete"] and (proc.returncode == 1) == (not report["summary"][0]["meets_goals"])
    rows = {r["variant"]: r for r in report["rows"]}
    assert set(rows) == {"alibi", "nobias"}
    for r in rows.values():
        assert r["kernel"] == "fwd" and r["default"] and r["head_dim"] == 64 and r["dtype"] == "bfloat16"
        assert r["slopes"] == "constant" and not r["atomic_dq"]
        # Constant slopes at head_dim 64: one forward program computes two heads from one bias tile.
        assert r["heads_per_program"] == 2
        assert r["instructions_per_element"] == round(
            r["main_loop_instructions"] * r["num_warps"] / (r["block_m"] * r["block_n"] * 2), 4)
        assert r["registers"] <= 255 and r["spill_bytes"] >= 0 and r["ctas_per_sm"] >= 1
        # sm_90's warpgroup MMA, not the mma.sync fallback; the forward's wgmma pipeline is not serialised.
        assert r["hgmma"] > 0 and r["hmma"] == 0 and "C7515" not in r["ptxas_advisories"]
        c = r["cycles_per_element"]
        assert c["bound_overlap"] == max(c["tensor"], c["mufu"], c["issue"], c["lsu"])
        assert c["bound_serial"] == round(c["tensor"] + max(c["issue"], c["mufu"]), 5)
    # Compiling the bias out must leave a shorter loop: the bias is real work in the shipped kernel.
    assert rows["nobias"]["main_loop_instructions"] < rows["alibi"]["main_loop_instructions"]
    fwd = report["summary"][0]["fwd"]
    ipe = {v: r["instructions_per_element"] for v, r in rows.items()}
    assert fwd["ratio"] == round(ipe["alibi"] / ipe["nobias"], 3)
    assert "| fwd | constant | alibi | 64 | bfloat16 |" in path.with_suffix(".md").read_text()


def test_script_refuses_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--default-only"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "unset TRITON_INTERPRET" in proc.stderr


def _row(kernel, variant, ipe, slopes="constant", atomic=False, default=True, registers=200, spill=0,
         advisories=()):
    cycles = {"tensor": 0.1, "mufu": 0.05, "issue": ipe / 4, "lsu": 0.01, "bound_overlap": ipe / 4,
              "bound_serial": 0.1 + ipe / 4}
    return {"kernel": kernel, "variant": variant, "head_dim": 64, "dtype": "bfloat16", "slopes": slopes,
            "atomic_dq": atomic, "default": default, "instructions_per_element": ipe, "cycles_per_element": cycles,
            "registers": registers, "spill_bytes": spill, "ptxas_advisories": list(advisories),
            "serialized_wgmma": "C7515" in advisories, "loop_global_loads": {"LDG": 0, "LDGSTS": 10},
            "ctas_per_sm": 2}


def _rows(slopes, fwd=(0.37, 0.31), two=((0.5, 0.4), (0.3, 0.2)), atomic=(0.66, 0.55), **alibi_kwargs):
    out = []
    for kernel, is_atomic, (a, n) in (("fwd", False, fwd), ("bwd_dkdv", False, two[0]), ("bwd_dq", False, two[1]),
                                      ("bwd_dkdv", True, atomic)):
        if kernel == "fwd" and slopes == "learned":
            continue  # the learned slopes' forward is the per-head one
        out += [_row(kernel, "alibi", a, slopes, is_atomic, **alibi_kwargs), _row(kernel, "nobias", n, slopes,
                                                                                   is_atomic)]
    return out


def test_summary_judges_the_forward_and_the_default_backward():
    rows = _rows("constant") + _rows("per-head", fwd=(0.40, 0.31)) + _rows("learned", atomic=(0.80, 0.55))
    rows.append(_row("bwd_dq", "alibi", 9.9, default=False))  # not a default config: left out
    summary = {s["slopes"]: s for s in bench.summarise(rows, atomic_default=lambda d, dt: True)}
    c = summary["constant"]
    assert c["fwd"]["ratio"] == round(0.37 / 0.31, 3) and c["bwd_two-kernel"]["ratio"] == round(0.8 / 0.6, 3)
    assert c["bwd_atomic"]["ratio"] == round(0.66 / 0.55, 3) and c["default_backward"] == "atomic"
    assert c["atomic_vs_two_kernel_serial"] == round((0.1 + 0.66 / 4) / (0.2 + 0.8 / 4), 3)
    assert c["judged"] == ["fwd", "bwd_atomic"] and c["meets_goals"] and c["register_headroom"] == 55
    # Per-head: forward 1.29 > 1.25. Learned: its forward is the per-head one, its atomic backward 1.45 > 1.35.
    assert not summary["per-head"]["meets_goals"]
    learned = summary["learned"]
    assert learned["fwd"]["ratio"] == summary["per-head"]["fwd"]["ratio"]
    assert not learned["meets_goals"] and learned["deterministic_meets_goals"]
    assert bench.goal_failures([learned]) == ["d=64 bfloat16 learned: fwd 1.29 > 1.25; bwd_atomic 1.455 > 1.35"]
    # With the two-kernel backward as the default, the atomic one is reported but not judged.
    learned = bench.summarise(_rows("learned", atomic=(0.80, 0.55)) + _rows("per-head"),
                              atomic_default=lambda d, dt: False)[-1]
    assert learned["slopes"] == "learned" and learned["judged"] == ["fwd", "bwd_two-kernel"] and learned["meets_goals"]


def test_summary_goals_need_headroom_no_spills_and_no_serialised_wgmma():
    for kwargs, why in (({"registers": 250}, "bwd_atomic: 250 registers"), ({"spill": 8}, "spills in"),
                        ({"advisories": ("C7515",)}, "C7515 in")):
        (entry,) = bench.summarise(_rows("constant", **kwargs), atomic_default=lambda d, dt: True)
        assert not entry["meets_goals"], kwargs
        assert why in bench.goal_failures([entry])[0]


def test_a_run_never_replaces_results_that_cover_more(tmp_path):
    """The committed d=64+128 results stay unless a run covers at least as much; the check comes before compiling."""
    pytest.importorskip("triton")
    import triton

    stem = bench.stem(triton.__version__)
    args = bench.parse_args(["--head-dims", "64", "128", "--dtypes", "bfloat16", "--default-only"])
    full = bench._plan_rows(bench.plan(args))
    (tmp_path / f"{stem}.json").write_text(json.dumps({"rows": full}))
    smaller = bench.plan(bench.parse_args(["--head-dims", "64", "--dtypes", "bfloat16", "--default-only"]))
    lost = bench.smaller_than_existing(tmp_path / f"{stem}.json", smaller)
    assert lost and {cell[0] for cell in lost} == {128}
    assert not bench.smaller_than_existing(tmp_path / f"{stem}.json", bench.plan(args))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--head-dims", "64", "--dtypes", "bfloat16", "--default-only",
                           "--out-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "this run would not" in proc.stderr
    assert json.loads((tmp_path / f"{stem}.json").read_text()) == {"rows": full}  # untouched


def test_merge_replaces_only_the_cells_the_smaller_run_covers():
    """--merge-from: the re-measured cells take the place of the old ones, every other row stays as it was."""
    rows = _rows("constant") + _rows("learned")
    new = [_row("bwd_dkdv", v, ipe, "learned", atomic, default=d) for v, ipe, atomic, d in
           (("alibi", 0.45, False, True), ("nobias", 0.4, False, True), ("alibi", 0.47, False, False),
            ("alibi", 0.6, True, True), ("nobias", 0.55, True, True))]
    merged = bench.merge_rows(rows, new)
    replaced = [r for r in rows if r["slopes"] == "learned" and r["kernel"] == "bwd_dkdv"]
    assert len(merged) == len(rows) - len(replaced) + len(new)
    assert [r for r in merged if r not in new] == [r for r in rows if r not in replaced]
    assert [r for r in merged if r in new] == new
    # The learned two-kernel rows stand where the old ones stood: before the dQ kernel's.
    kernels = [(r["kernel"], r["atomic_dq"]) for r in merged if r["slopes"] == "learned"]
    assert kernels.index(("bwd_dkdv", False)) < kernels.index(("bwd_dq", False))
    (learned,) = [s for s in bench.summarise(merged, atomic_default=lambda d, dt: True) if s["slopes"] == "learned"]
    assert learned["bwd_two-kernel"]["ratio"] == round((0.45 + 0.3) / (0.4 + 0.2), 3)
    assert learned["bwd_atomic"]["ratio"] == round(0.6 / 0.55, 3)
    # A run of the dK/dV kernel alone cannot judge a two-kernel default backward, and says so.
    (alone,) = bench.summarise(new, atomic_default=lambda d, dt: False)
    assert bench.goal_failures([alone]) == ["d=64 bfloat16 learned: not judged, the run has neither the forward nor "
                                            "every kernel of the default backward"]
    # A default-only run cannot stand in for cells measured with every config.
    with_all = rows + [_row("bwd_dkdv", "alibi", 0.5, "learned", default=False)]
    with pytest.raises(ValueError, match="only the default config"):
        bench.merge_rows(with_all, new[:2])
