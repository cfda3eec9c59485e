"""The route to FA3 parity, measured without a GPU: flash-attn-4's sm90 kernels through the SASS proxy.

flash-attn-4 (CuTe DSL) carries FlashAttention-3's Hopper design: warp-specialised producer and
consumer warpgroups, TMA loads, 128-wide tiles, intra-warpgroup overlap of softmax and matmuls, and
an fp32 dQ accumulated with atomics in the backward. Its kernels take a ``score_mod`` (with
``score_mod_bwd`` and ``aux_tensors``), so the ALiBi bias can ride on them as a table gather. This
script compiles its sm90 forward and backward for sm_90a on a machine without a GPU (torch's
FakeTensorMode stands in for CUDA tensors, ``FLASH_ATTENTION_ARCH``/``CUTE_DSL_ARCH`` name the
target, the CuTe DSL writes the cubin), once without a score_mod and once with a table-gather
score_mod — the fused Triton kernel's difference table, query codes and negated key codes captured
as aux tensors, ``B_ij = T[a_i - b_j]``, times a per-head factor for per-head slopes — and reads
the SASS with the same proxy as ``benchmarks/bench_kernel_sass.py`` (instructions per score, HGMMA,
waits per HGMMA, MUFU, LSU, spills, registers, SM-cycle bounds at H100 per-SM rates).

Its kernels have several loops (peeled, masked and two-tile variants); the steady state taken here
is, among the loops that issue HGMMAs for whole iterations of all the kernel's matmuls (2 in the
forward, 5 in the backward) and one exponential per score, the one with the fewest instructions
per score. Scores per warpgroup and iteration come from the loop's own HGMMA FLOPs:
``FLOPs / (2 · head_dim · matmuls)``. Registers: the launch count and the ``setmaxnreg`` values
the warpgroups switch to. flash-attn-4 has no gradient for aux tensors, so learned slopes are not
covered.

Beside them the summary puts the fused Triton kernels' figures from their own results file
(``--triton-results``, default ``benchmarks/results/kernel_sass_sm90_triton3.6.json``): the gap of the
ALiBi kernel to the best bias-free design (flash-attn-4 without a score_mod, which is FA3's design)
by the proxy. None of it is a timing.

Needs a separate environment (flash-attn-4 pins its own CuTe DSL; Triton only for cuobjdump/ptxas)::

    python3 -m venv ~/venvs/fa4 && ~/venvs/fa4/bin/pip install torch==2.13.0 triton==3.6.0 numpy \\
        flash-attn-4==4.0.0b36 nvidia-cutlass-dsl
    PYTHONPATH=. ~/venvs/fa4/bin/python benchmarks/bench_fa4_sass.py

Results: ``benchmarks/results/fa4_sass_sm90.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_kernel_sass as proxy  # noqa: E402
from report import RESULTS, command_line, environment, write_report  # noqa: E402

STEM = "fa4_sass_sm90"
GRID, PREFIX, HEADS = proxy.GRID, proxy.PREFIX, 12
MATMULS = {"fwd": 2, "bwd": 5}
SLOPE_KINDS = ("constant", "per-head")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], choices=(64, 128))
    p.add_argument("--triton-results", type=Path, default=RESULTS / "kernel_sass_sm90_triton3.6.json",
                   help="the fused Triton kernels' proxy results, shown beside")
    p.add_argument("--out-dir", type=Path, default=None, help="default: benchmarks/results/")
    return p.parse_args(argv)


def _target_environment(dump_dir: Path):
    # Kernel selection and compilation target without a device (flash-attn-4's CPU-only compilation).
    os.environ.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
                      CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_KEEP_PTX="1", CUTE_DSL_DUMP_DIR=str(dump_dir))


def score_mods():
    """(forward score_mod per slope kind, backward score_mod): the table gather, and its gradient (the bias
    is added, so d(score)/d(score) = 1)."""
    import cutlass
    import cutlass.cute as cute

    def gather(q_idx, kv_idx, aux_tensors):
        query_codes, key_codes, table = aux_tensors[0], aux_tensors[1], aux_tensors[2]
        q = cute.make_rmem_tensor(1, cutlass.Int32)
        q.store(q_idx)
        k = cute.make_rmem_tensor(1, cutlass.Int32)
        k.store(kv_idx)
        value = cute.make_rmem_tensor(1, cutlass.Float32)
        value[0] = table[query_codes[q[0]] + key_codes[k[0]]]
        return value

    @cute.jit
    def constant(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return score + gather(q_idx, kv_idx, aux_tensors).load()  # the table holds slope·B

    @cute.jit
    def per_head(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        h = cute.make_rmem_tensor(1, cutlass.Int32)
        h.store(h_idx)
        factor = cute.make_rmem_tensor(1, cutlass.Float32)
        factor[0] = aux_tensors[3][h[0]]
        return score + gather(q_idx, kv_idx, aux_tensors).load() * factor.load()

    @cute.jit
    def backward(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    return {"constant": constant, "per-head": per_head}, backward


def compile_kernel(kind, head_dim, slopes, dump_dir: Path) -> Path:
    """Compile flash-attn-4's sm90 ``kind`` ("fwd", "bwd") kernel at ViT-B's 518 px shape (N = 1374) for
    sm_90a; ``slopes`` None: no score_mod. Returns the main kernel's cubin."""
    import torch
    from flash_attn.cute import interface
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kernels.alibi_bias import device_bias_lookup

    for old in dump_dir.glob("*"):
        old.unlink()
    n = PREFIX + GRID[0] * GRID[1]
    table_size = device_bias_lookup(*GRID, PREFIX, True, True, True, torch.device("cpu"))[1].numel()
    with FakeTensorMode():  # shapes and dtypes only: what the compiler sees of the call
        q, k, v, o, do = (torch.empty(1, n, HEADS, head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(5))
        extra = {}
        if slopes is not None:
            fwd_mods, bwd_mod = score_mods()
            aux = [torch.empty(n, dtype=torch.int32, device="cuda"), torch.empty(n, dtype=torch.int32, device="cuda"),
                   torch.empty(table_size, dtype=torch.float32, device="cuda"),
                   torch.empty(HEADS, dtype=torch.float32, device="cuda")]
            extra = {"score_mod": fwd_mods[slopes], "aux_tensors": aux}
            if kind == "bwd":
                extra["score_mod_bwd"] = bwd_mod
        if kind == "fwd":
            interface._flash_attn_fwd(q, k, v, softmax_scale=head_dim ** -0.5, **extra)
        else:
            lse = torch.empty(1, HEADS, n, dtype=torch.float32, device="cuda")
            interface._flash_attn_bwd(q, k, v, o, do, lse, softmax_scale=head_dim ** -0.5, **extra)
    pattern = "flash_fwd_sm90" if kind == "fwd" else "flash_bwd_sm90"
    cubins = [p for p in dump_dir.glob("*.cubin") if pattern in p.name]
    if len(cubins) != 1:
        raise RuntimeError(f"expected one {pattern} cubin in {dump_dir}, found {[p.name for p in cubins]}")
    return cubins[0]


def _loops(sass: str):
    insns = [(int(a, 16), t) for a, t in proxy._INSN.findall(sass)]
    for i, (addr, text) in enumerate(insns):
        m = proxy._BRANCH.search(text)
        if m and int(m.group(1), 16) <= addr:
            yield [t for a, t in insns[:i + 1] if a >= int(m.group(1), 16)]


def steady_state_loop(sass: str, head_dim: int, matmuls: int):
    """(loop body, scores per warpgroup and iteration) of the loop with the fewest instructions per score among
    those whose HGMMAs make whole iterations of all ``matmuls`` matmuls with one exponential per score."""
    best = None
    for body in _loops(sass):
        units = proxy.unit_counts(body, num_warps=4)  # one warpgroup
        if not units["hgmma"]:
            continue
        scores = units["flops"] / (2 * head_dim * matmuls)
        exps = sum(proxy.opcode(t).startswith("MUFU.EX2") for t in body)
        if scores != int(scores) or int(scores) % 128 or exps * 128 < scores:
            continue
        per_score = len(body) * 4 / scores
        if best is None or per_score < best[2]:
            best = (body, int(scores), per_score)
    if best is None:
        raise ValueError("no loop with whole matmul iterations found in the SASS")
    return best[0], best[1]


def analyse(cubin: Path, kind: str, head_dim: int, slopes, workdir: Path) -> dict:
    sass = subprocess.run([proxy._tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    body, scores = steady_state_loop(sass, head_dim, MATMULS[kind])
    units = proxy.unit_counts(body, num_warps=4)
    usage = proxy.resource_usage(cubin)
    ptx = next(iter(cubin.parent.glob(cubin.name.split(".sm_90a")[0] + "*.ptx")), None)
    advisories = proxy.ptxas_advisories(ptx.read_text().rstrip("\x00"), workdir) if ptx else []
    ops = Counter(proxy.opcode(t).split(".")[0] for t in body)
    # "USETMAXREG.DEALLOC.CTAPOOL 0x20", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa0": the producer's and consumers' counts.
    maxnreg = sorted({int(v, 0) for v in re.findall(r"USETMAXREG\.\w+\.\w+\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+|\d+)", sass)})
    return {"design": "flash-attn-4 sm90", "kernel": kind, "head_dim": head_dim, "dtype": "bfloat16",
            "variant": "nobias" if slopes is None else "alibi", "slopes": slopes,
            "scores_per_warpgroup_iteration": scores, "main_loop_instructions": len(body),
            "instructions_per_element": round(len(body) * 4 / scores, 4), "hgmma": units["hgmma"],
            "waits_per_hgmma": round(units["waits"] / units["hgmma"], 2), "loop_loads": {
                k: ops[k] for k in ("LDG", "LDGSTS", "UTMALDG", "LDS")},
            "spill_instructions_in_loop": units["spill"], "mufu_per_element": round(units["mufu"] / scores, 4),
            "lsu_per_element": round(units["lsu"] / scores, 4), "cycles_per_element": proxy.cycles_per_score(units, scores),
            "registers_at_launch": usage["registers"], "setmaxnreg": maxnreg, "spill_bytes": usage["spill_bytes"],
            "ptxas_advisories": advisories}


def summarise(rows, triton):
    """Per head_dim and slope kind: flash-attn-4's table score_mod over its own bias-free kernels, and the fused
    Triton kernels' ALiBi against flash-attn-4 without bias (the best bias-free design here)."""
    get = {(r["kernel"], r["head_dim"], r["slopes"]): r for r in rows}
    ours = {(s["head_dim"], s["slopes"]): s for s in (triton or {}).get("summary", []) if s["dtype"] == "bfloat16"}
    out = []
    for d in sorted({r["head_dim"] for r in rows}):
        for slopes in SLOPE_KINDS:
            entry = {"head_dim": d, "slopes": slopes}
            for kind in ("fwd", "bwd"):
                bias, plain = get.get((kind, d, slopes)), get.get((kind, d, None))
                if not (bias and plain):
                    continue
                e = {"fa4_nobias": plain["instructions_per_element"], "fa4_alibi": bias["instructions_per_element"],
                     "fa4_ratio": round(bias["instructions_per_element"] / plain["instructions_per_element"], 3)}
                for bound in ("bound_serial", "bound_overlap"):
                    e[f"fa4_{bound}"] = {"nobias": plain["cycles_per_element"][bound],
                                         "alibi": bias["cycles_per_element"][bound]}
                mine = ours.get((d, slopes), {}).get("fwd" if kind == "fwd" else "bwd_" + ours.get(
                    (d, slopes), {}).get("default_backward", ""))
                if mine:
                    e["triton_alibi"], e["triton_nobias"] = mine["alibi"], mine["nobias"]
                    e["triton_alibi_vs_fa4_nobias"] = round(mine["alibi"] / plain["instructions_per_element"], 3)
                    for bound in ("bound_serial", "bound_overlap"):
                        e[f"triton_alibi_vs_fa4_nobias_{bound}"] = round(
                            mine[bound]["alibi"] / plain["cycles_per_element"][bound], 3)
                entry[kind] = e
            out.append(entry)
    return out


def markdown(payload):
    t = payload.get("triton_results") or {}
    lines = ["# The route to FA3 parity: flash-attn-4's sm90 kernels through the SASS proxy", "",
             f"`{payload['command']}`", "",
             f"flash-attn-4 {payload['flash_attn_4']} with nvidia-cutlass-dsl {payload['cutlass_dsl']}, compiled for "
             f"sm_90a without a GPU (torch {payload['torch']} FakeTensorMode; cuobjdump and ptxas of triton "
             f"{payload['triton']}), {payload['date']}. bf16, N = {PREFIX + GRID[0] * GRID[1]} (ViT-B at 518 px), "
             f"{HEADS} heads. `alibi` = the same kernel with a table-gather score_mod (and score_mod_bwd); counts are "
             "per warp of a consumer warpgroup in its steady-state loop; cycles are bounds at H100 per-SM rates, "
             "not timings.", ""]
    if t:
        lines += [f"Beside them: the fused Triton kernels ({t.get('triton')}, default configs, default backward) from "
                  f"`{payload['triton_results_path']}`.", ""]
    lines += ["## Summary: instructions per score element", "",
              "| head_dim | slopes | pass | FA4 bias-free | FA4 + table score_mod | FA4 ratio | Triton ALiBi | "
              "Triton ALiBi / FA4 bias-free (insts) | (serial bound) | (overlap bound) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in payload["summary"]:
        for kind in ("fwd", "bwd"):
            e = s.get(kind)
            if not e:
                continue
            lines.append(f"| {s['head_dim']} | {s['slopes']} | {kind} | {e['fa4_nobias']} | {e['fa4_alibi']} | "
                         f"{e['fa4_ratio']} | {e.get('triton_alibi', '')} | {e.get('triton_alibi_vs_fa4_nobias', '')} "
                         f"| {e.get('triton_alibi_vs_fa4_nobias_bound_serial', '')} | "
                         f"{e.get('triton_alibi_vs_fa4_nobias_bound_overlap', '')} |")
    lines += ["", "## Every kernel", "",
              "| kernel | variant | slopes | head_dim | scores/WG-iteration | loop insts | insts/element | HGMMA | "
              "waits/HGMMA | loop LDG / UTMALDG / LDS | loop spills | MUFU/el | LSU/el | tc | mufu | issue | lsu | "
              "overlap | serial | regs at launch | setmaxnreg | spill B | advisories |",
              "|" + "---|" * 23]
    for r in payload["rows"]:
        c, loads = r["cycles_per_element"], r["loop_loads"]
        lines.append(f"| {r['kernel']} | {r['variant']} | {r['slopes'] or '-'} | {r['head_dim']} | "
                     f"{r['scores_per_warpgroup_iteration']} | {r['main_loop_instructions']} | "
                     f"{r['instructions_per_element']} | {r['hgmma']} | {r['waits_per_hgmma']} | {loads['LDG']} / "
                     f"{loads['UTMALDG']} / {loads['LDS']} | {r['spill_instructions_in_loop']} | "
                     f"{r['mufu_per_element']} | {r['lsu_per_element']} | {c['tensor']:.4f} | {c['mufu']:.4f} | "
                     f"{c['issue']:.4f} | {c['lsu']:.4f} | {c['bound_overlap']:.4f} | {c['bound_serial']:.4f} | "
                     f"{r['registers_at_launch']} | {', '.join(map(str, r['setmaxnreg'])) or '-'} | {r['spill_bytes']} | "
                     f"{', '.join(r['ptxas_advisories']) or '-'} |")
    return lines


def main(argv=None):
    import json
    from importlib import metadata

    args = parse_args(argv)
    try:
        fa4_version, dsl_version = metadata.version("flash-attn-4"), metadata.version("nvidia-cutlass-dsl")
        proxy._tool("cuobjdump")
    except (metadata.PackageNotFoundError, FileNotFoundError) as err:
        raise SystemExit(f"bench_fa4_sass.py needs flash-attn-4, nvidia-cutlass-dsl and a Triton with cuobjdump: "
                         f"{err}") from None
    triton = json.loads(args.triton_results.read_text()) if args.triton_results.is_file() else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "dump"
        dump.mkdir()
        _target_environment(dump)
        for d in args.head_dims:
            for kind in ("fwd", "bwd"):
                for slopes in (None, *SLOPE_KINDS):
                    row = analyse(compile_kernel(kind, d, slopes, dump), kind, d, slopes, Path(tmp))
                    rows.append(row)
                    print(f"{kind} d={d} {row['variant']} {slopes or '-'}: {row['main_loop_instructions']} insts, "
                          f"{row['instructions_per_element']}/elem, serial {row['cycles_per_element']['bound_serial']}, "
                          f"spill {row['spill_bytes']} B", flush=True)
    payload = {"command": command_line("bench_fa4_sass.py", sys.argv[1:] if argv is None else argv),
               **environment(), "flash_attn_4": fa4_version, "cutlass_dsl": dsl_version, "target": "sm_90a",
               "grid": list(GRID), "num_prefix_tokens": PREFIX, "heads": HEADS,
               "triton_results_path": str(args.triton_results.relative_to(ROOT) if args.triton_results.is_relative_to(
                   ROOT) else args.triton_results),
               "triton_results": triton and {k: triton[k] for k in ("triton", "torch", "date")},
               "summary": summarise(rows, triton), "rows": rows}
    md, js = write_report(args.out_dir, STEM, payload, markdown(payload))
    print(f"wrote {md} and {js}")
    return payload


if __name__ == "__main__":
    main()
