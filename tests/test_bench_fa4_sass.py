"""benchmarks/bench_fa4_sass.py: its choice of flash-attn-4's steady-state loop and its side-by-side summary.

Compiling flash-attn-4 needs its own environment (flash-attn-4, nvidia-cutlass-dsl); these tests check the
parts that read SASS and results, on hand-written listings.
"""

import pytest

from tests.helpers import benchmark_module

fa4 = benchmark_module("bench_fa4_sass")


def _listing(*loops):
    """SASS text with one backward branch per loop; each loop is a list of instruction texts."""
    lines, addr = [], 0
    for body in loops:
        start = addr
        for text in body:
            lines.append(f"        /*{addr:04x}*/                   {text} ;")
            addr += 16
        lines.append(f"        /*{addr:04x}*/               @P0 BRA 0x{start:x} ;")
        addr += 16
    return "\n".join(lines)


QK = "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT"  # 2*64*128*16 FLOPs per warpgroup
PV = "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8], R88"  # 2*64*64*16


def test_steady_state_is_the_leanest_whole_iteration():
    # head_dim 64, forward (2 matmuls): 4 QK + 8 PV HGMMAs are one iteration of a 64x128 tile per warpgroup
    # (8192 scores, 64 exponentials per thread).
    whole = [QK] * 4 + [PV] * 8 + ["MUFU.EX2 R1, R2"] * 64 + ["FFMA R1, R2, R3, R4"] * 100
    padded = whole + ["IMAD R1, R2, R3, R4"] * 300  # the same iteration with more work (a masked copy)
    pv_only = [PV] * 8 + ["MUFU.EX2 R1, R2"] * 2  # an epilogue: not an exponential per score
    body, scores = fa4.steady_state_loop(_listing(padded, pv_only, whole), head_dim=64, matmuls=2)
    assert scores == 8192 and len(body) == len(whole) + 1  # the loop's branch included
    # Two iterations unrolled count as 16384 scores: 253 instructions for them beat 477 for 8192.
    twice = [QK] * 8 + [PV] * 16 + ["MUFU.EX2 R1, R2"] * 128 + ["FFMA R1, R2, R3, R4"] * 100
    body, scores = fa4.steady_state_loop(_listing(padded, twice), head_dim=64, matmuls=2)
    assert scores == 16384 and len(body) == len(twice) + 1


def test_no_whole_iteration_is_an_error():
    with pytest.raises(ValueError, match="whole matmul iterations"):
        fa4.steady_state_loop(_listing([PV] * 8 + ["MUFU.EX2 R1, R2"] * 2), head_dim=64, matmuls=2)


def _row(kind, slopes, ipe, serial):
    return {"kernel": kind, "head_dim": 64, "slopes": slopes, "instructions_per_element": ipe,
            "cycles_per_element": {"bound_serial": serial, "bound_overlap": serial / 2}}


def test_summary_sets_the_fused_kernel_beside_flash_attn_4():
    rows = [_row("fwd", None, 0.2, 0.125), _row("fwd", "constant", 0.5, 0.185), _row("bwd", None, 0.3, 0.25),
            _row("bwd", "constant", 0.75, 0.35)]
    triton = {"summary": [{"head_dim": 64, "dtype": "bfloat16", "slopes": "constant", "default_backward": "atomic",
                           "fwd": {"alibi": 0.32, "nobias": 0.29, "bound_serial": {"alibi": 0.15},
                                   "bound_overlap": {"alibi": 0.08}},
                           "bwd_atomic": {"alibi": 0.6, "nobias": 0.5, "bound_serial": {"alibi": 0.3},
                                          "bound_overlap": {"alibi": 0.15}}}]}
    (constant, per_head) = fa4.summarise(rows, triton)
    assert constant["fwd"]["fa4_ratio"] == 2.5 and constant["bwd"]["fa4_ratio"] == 2.5
    assert constant["fwd"]["triton_alibi_vs_fa4_nobias"] == 1.6 and constant["bwd"]["triton_alibi_vs_fa4_nobias"] == 2.0
    assert constant["fwd"]["triton_alibi_vs_fa4_nobias_bound_serial"] == round(0.15 / 0.125, 3)
    assert constant["bwd"]["triton_alibi_vs_fa4_nobias_bound_overlap"] == round(0.15 / 0.125, 3)
    assert "fwd" not in per_head  # no per-head rows measured
