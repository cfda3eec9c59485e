"""Static sm_90a analysis of the Gluon FA3-structured ALiBi forward and backward (kernels/alibi_gluon.py), no GPU.

The kernel is compiled for sm_90a with Triton's own ptxas (``kernels.alibi_gluon.compile_for_sm90``: the
JIT's binder on CPU tensors standing in for a fused-qkv view at 518 px, ViT-B heads; nothing is
launched), once as shipped (``alibi``) and once with the bias compiled out (``nobias``: the kernel's
``HAS_BIAS`` constexpr; same tiles, same pipeline), for constant (``slopes=None``) and per-head slopes,
with the default consumer (``serial``: per tile QKᵀ, softmax, PV) and the experimental ``pipelined`` one
(tile i's softmax under tile i-1's PV wgmma, three stages) and ``pingpong`` one (the consumers take turns
at QKᵀ through turn mbarriers), and its SASS (``cuobjdump`` bundled with Triton) is read for:

- compile success (or the error), compile seconds;
- registers: the kernel's launch cap (``REG``, the ``maxnreg`` the three warpgroups share) and the
  ``setmaxnreg`` targets in the PTX, by role: the consumer of the default partition, the consumer
  worker, the producer worker and the workers' idle state; ``USETMAXREG`` in the SASS;
- spills (stack/local bytes and LDL/STL anywhere; the goal is none);
- the FA3 structure: TMA loads (``UTMALDG``), wgmma (``HGMMA``, per consumer loop and in all),
  mbarrier operations (``SYNCS.*``), warpgroup arrive/wait (``WARPGROUP.*``), named barriers (``BAR``);
- the consumer's steady-state loop (the shortest loop holding HGMMA: one 64 × BLOCK_N tile of one
  consumer warpgroup): instructions per score element (loop × 4 warps / (64 · BLOCK_N)), its global
  loads, MUFU ops, and SM-cycles per score at H100 per-SM rates with ``bench_kernel_sass``'s proxy
  (tensor core, MUFU, issue, LSU; overlap and serial bounds);
- beside them, where the results files exist, the fused Triton kernel's forward (default config,
  ``kernel_sass_sm90_triton<version>.json``) and flash-attn-4's sm90 forward (``fa4_sass_sm90.json``).

The backward (``--kernels bwd``; head_dim 64): the dK/dV kernel with atomic dQ, for constant, per-head and
learned slopes (the slope gradient compiled in), as shipped and bias-free; its consumer loop is one query tile of
64 rows against one consumer's 64 keys (five wgmma: Sᵀ, dPᵀ, dV, dK, dQ), and it is set beside the fused Triton
kernel's default atomic-dQ dK/dV kernel and flash-attn-4's sm90 backward.

Results: ``benchmarks/results/gluon_sass_sm90_triton<major.minor>.{md,json}`` (``--out-dir``; ``--smoke``
writes under ``benchmarks/results/smoke/``). A run whose shipped ALiBi kernel spills, lacks TMA, wgmma
or setmaxnreg, or fails to compile, writes its results and exits with status 1.

    python benchmarks/bench_gluon_sass.py                       # d = 64 and 128, bf16 and fp16
    python benchmarks/bench_gluon_sass.py --head-dims 64 --dtypes bfloat16
    python benchmarks/bench_gluon_sass.py --kernels bwd
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Gluon cannot compile Triton's interpreter objects: never let the CPU test setting leak in.
if os.environ.get("TRITON_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "0"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_kernel_sass import (_BRANCH, _INSN, _tool, cycles_per_score, opcode, ptxas_advisories,  # noqa: E402
                               resource_usage, unit_counts)
from report import RESULTS, command_line, environment, write_report  # noqa: E402

STEM = "gluon_sass_sm90"
GRID, PREFIX, WIDTH = (37, 37), 5, 768
SLOPES = ("constant", "per-head")
BWD_SLOPES = ("constant", "per-head", "learned")
KERNELS = ("fwd", "bwd")
CONSUMER_FORMS = ("serial", "pipelined", "pingpong")  # kernels.alibi_gluon.CONSUMER_FORMS
STRUCTURE_OPS = ("UTMALDG", "HGMMA", "USETMAXREG", "SYNCS", "WARPGROUP", "BAR", "REDG")


def stem(triton_version: str) -> str:
    return f"{STEM}_triton{'.'.join(triton_version.split('.')[:2])}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], choices=(64, 128))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=("bfloat16", "float16"))
    p.add_argument("--slopes", nargs="+", default=list(SLOPES), choices=SLOPES)
    p.add_argument("--consumers", nargs="+", default=list(CONSUMER_FORMS), choices=CONSUMER_FORMS)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS,
                   help="fwd: the forward; bwd: the dK/dV + atomic-dQ backward (head_dim 64 only)")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="not a measurement: write under benchmarks/results/smoke/")
    return p.parse_args(argv)


def setmaxnreg_targets(ptx: str) -> list[tuple[str, int]]:
    """(inc|dec, registers) of every setmaxnreg in the PTX, in order."""
    return [(m.group(1), int(m.group(2))) for m in re.finditer(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)]


def registers_by_role(targets, maxnreg: int, consumer_regs: int, producer_regs: int) -> dict:
    """What each role runs with. Triton hands the default partition what the workers leave of maxnreg × 3
    warpgroups; the workers wait for their partition's start at an idle count and then move to their own."""
    values = [v for _, v in targets]
    default = 3 * maxnreg - consumer_regs - producer_regs
    idle = sorted({v for v in values if v not in (default, consumer_regs, producer_regs, 256)})
    return {"consumer_default_partition": default if default in values else None,
            "consumer_worker": consumer_regs if consumer_regs in values else None,
            "producer_worker": producer_regs if producer_regs in values else None,
            "workers_idle": idle, "entry": 256 if 256 in values else None}


def count_ops(sass_lines: list[str]) -> dict:
    ops = [opcode(t) for t in sass_lines]
    return {op: sum(o == op or o.startswith(op + ".") for o in ops) for op in STRUCTURE_OPS}


def consumer_loop_body(sass: str) -> list[str]:
    """The shortest innermost loop holding HGMMA: a consumer's key-tile loop. (bench_kernel_sass's shortest loop
    with HGMMA would pick a span closed by an mbarrier wait's out-of-line retry branch, or the workers' dispatch
    loop, in a warp-specialised kernel; innermost loops are those with no backward branch inside them.)"""
    insns = [(int(a, 16), text) for a, text in _INSN.findall(sass)]
    loops = []
    for i, (addr, text) in enumerate(insns):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= addr:
            loops.append((int(m.group(1), 16), addr, i))
    best = None
    for start, end, i in loops:
        if any(start <= s2 and e2 < end for s2, e2, _ in loops if (s2, e2) != (start, end)):
            continue
        body = [t for a, t in insns[:i + 1] if a >= start]
        if any("HGMMA" in t for t in body) and (best is None or len(body) < len(best)):
            best = body
    if best is None:
        raise ValueError("no innermost loop with HGMMA in the SASS")
    return best


def analyse(head_dim, dtype_name, slopes, variant, workdir, consumer="serial", kernel_name="fwd"):
    import torch

    from kernels import alibi_gluon as ag

    t0 = time.time()
    if kernel_name == "bwd":
        kernel, kw = ag.compile_bwd_for_sm90(head_dim, getattr(torch, dtype_name), per_head=slopes != "constant",
                                             compute_dslope=slopes == "learned", has_bias=variant == "alibi",
                                             grid=GRID, prefix=PREFIX, heads=WIDTH // head_dim)
        rows, block_n, block_m = kw["KROWS"], kw["BLOCK_M"], 2 * kw["KROWS"]  # keys per consumer × query tile
    else:
        kernel, kw = ag.compile_for_sm90(head_dim, getattr(torch, dtype_name), per_head=slopes == "per-head",
                                         has_bias=variant == "alibi", consumer=consumer, grid=GRID,
                                         prefix=PREFIX, heads=WIDTH // head_dim)
        rows, block_n, block_m = ag.ROWS_PER_CONSUMER, kw["BLOCK_N"], ag.BLOCK_M
    seconds = round(time.time() - t0, 1)
    cubin = Path(workdir) / f"gluon_{kernel_name}_{head_dim}_{dtype_name}_{slopes}_{variant}_{consumer}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    lines = [text for _, text in _INSN.findall(sass)]
    body = consumer_loop_body(sass)
    scores = rows * block_n  # one consumer warpgroup's tile per loop iteration
    units = unit_counts(body, 4)
    usage = resource_usage(cubin)
    targets = setmaxnreg_targets(kernel.asm["ptx"])
    advisories = ptxas_advisories(kernel.asm["ptx"], workdir)
    body_ops = [opcode(t) for t in body]
    # Registers the consumer loop touches (highest R index + 1): above the kernel's cap only under setmaxnreg.
    loop_regs = max((int(x) for t in body for x in re.findall(r"\bR(\d+)\b", t)), default=-1) + 1
    return {"kernel": kernel_name, "head_dim": head_dim, "dtype": dtype_name, "slopes": slopes, "variant": variant,
            "consumer": consumer, "compiled": True,
            "compile_seconds": seconds, "block_m": block_m, "rows_per_consumer": rows, "block_n": block_n,
            "stages": kw["STAGES"], "maxnreg": kw["maxnreg"], "launch_registers": usage["registers"],
            "spill_bytes": usage["spill_bytes"], "spill_instructions": sum(opcode(t).split(".")[0] in ("LDL", "STL")
                                                                           for t in lines),
            "setmaxnreg": [f"{d} {v}" for d, v in targets], "consumer_loop_registers": loop_regs,
            "registers_by_role": registers_by_role(targets, kw["maxnreg"], kw["CONSUMER_REGS"], kw["PRODUCER_REGS"]),
            "shared_bytes": int(kernel.metadata.shared), "ptxas_advisories": advisories,
            "kernel_ops": count_ops(lines), "loop_ops": count_ops(body),
            "main_loop_instructions": len(body), "instructions_per_element": round(len(body) * 4 / scores, 4),
            "loop_global_loads": {"LDG": sum(o.startswith("LDG") for o in body_ops),
                                  "LDG.64": sum(o.startswith("LDG") and ".64" in o for o in body_ops)},
            "mufu_per_element": round(units["mufu"] / scores, 4), "lsu_per_element": round(units["lsu"] / scores, 4),
            "hgmma_in_loop": units["hgmma"], "waits_per_hgmma": round(units["waits"] / units["hgmma"], 2),
            "cycles_per_element": cycles_per_score(units, scores)}


def structure_ok(row) -> list[str]:
    """What the shipped kernel lacks of the FA3 structure (the backward: and its atomic dQ), or spills."""
    problems = []
    for op in ("UTMALDG", "HGMMA", "USETMAXREG", "SYNCS") + (("REDG", ) if row.get("kernel") == "bwd" else ()):
        if not row["kernel_ops"].get(op):
            problems.append(f"no {op}")
    if row["spill_bytes"] or row["spill_instructions"]:
        problems.append(f"spills ({row['spill_bytes']} B, {row['spill_instructions']} LDL/STL)")
    roles = row["registers_by_role"]
    if not (roles["consumer_worker"] and roles["producer_worker"] and roles["consumer_default_partition"]):
        problems.append(f"setmaxnreg targets not as planned: {row['setmaxnreg']}")
    if row["consumer_loop_registers"] > (row["registers_by_role"]["consumer_worker"] or 255):
        problems.append(f"the consumer loop uses {row['consumer_loop_registers']} registers, over its setmaxnreg")
    if "C7515" in row["ptxas_advisories"]:
        problems.append("C7515: wgmma serialised")
    return problems


def comparisons(triton_version: str) -> dict:
    """The fused Triton forward's and flash-attn-4's sm90 forward's figures from their results files, if present."""
    import json

    out = {}
    path = RESULTS / f"kernel_sass_sm90_triton{'.'.join(triton_version.split('.')[:2])}.json"
    if path.is_file():
        data = json.loads(path.read_text())
        for r in data.get("rows", []):
            if r["kernel"] == "fwd" and r["default"] and r.get("bias_mode", "table") == "table":
                key = f"triton_fused|{r['head_dim']}|{r['dtype']}|{r['slopes']}|{r['variant']}"
                out[key] = {"instructions_per_element": r["instructions_per_element"],
                            "bound_serial": r["cycles_per_element"]["bound_serial"],
                            "bound_overlap": r["cycles_per_element"]["bound_overlap"],
                            "registers": r["registers"], "source": path.name}
    path = RESULTS / "fa4_sass_sm90.json"
    if path.is_file():
        data = json.loads(path.read_text())
        for r in data.get("rows", []):
            if r["kernel"] == "fwd":
                key = f"fa4|{r['head_dim']}|{r['dtype']}|{r['slopes'] or 'none'}|{r['variant']}"
                out[key] = {"instructions_per_element": r["instructions_per_element"],
                            "bound_serial": r["cycles_per_element"]["bound_serial"],
                            "bound_overlap": r["cycles_per_element"]["bound_overlap"], "source": path.name}
            if r["kernel"] == "bwd":
                key = f"fa4_bwd|{r['head_dim']}|{r['dtype']}|{r['slopes'] or 'none'}|{r['variant']}"
                out[key] = {"instructions_per_element": r["instructions_per_element"],
                            "bound_serial": r["cycles_per_element"]["bound_serial"],
                            "bound_overlap": r["cycles_per_element"]["bound_overlap"], "source": path.name}
    path = RESULTS / f"kernel_sass_sm90_triton{'.'.join(triton_version.split('.')[:2])}.json"
    if path.is_file():
        for r in json.loads(path.read_text()).get("rows", []):
            if (r["kernel"] == "bwd_dkdv" and r["default"] and r.get("atomic_dq")
                    and r.get("bias_mode", "table") == "table"):
                key = f"triton_fused_bwd|{r['head_dim']}|{r['dtype']}|{r['slopes']}|{r['variant']}"
                out[key] = {"instructions_per_element": r["instructions_per_element"],
                            "bound_serial": r["cycles_per_element"]["bound_serial"],
                            "bound_overlap": r["cycles_per_element"]["bound_overlap"],
                            "registers": r["registers"], "source": path.name}
    return out


def markdown(meta, rows, comp) -> list[str]:
    bwd_rows = [r for r in rows if r.get("kernel") == "bwd"]
    rows = [r for r in rows if r.get("kernel", "fwd") == "fwd"]
    lines = [f"# Gluon FA3-structured ALiBi forward and backward: static sm_90a analysis (Triton {meta['triton']})",
             "", "## Forward", "",
             f"`{meta['command']}` — {meta['date']}, torch {meta['torch']}. Compile only, no GPU ran. "
             f"Grid {GRID[0]}×{GRID[1]} + {PREFIX} prefix tokens (518 px, patch 14), ViT-B heads.", "",
             "Per consumer loop iteration = one 64 × BLOCK_N tile of one consumer warpgroup. Cycles: SM-cycles per "
             "score at H100 per-SM rates (bench_kernel_sass's proxy; a bound, not a timing).", "",
             "| head_dim | dtype | consumer | slopes | variant | compiled | BLOCK_N | stages | regs (cap) | setmaxnreg: consumer / "
             "consumer / producer (idle); used by the consumer loop | spills | UTMALDG | HGMMA (loop) | SYNCS (loop) | USETMAXREG | "
             "instr/score | LDG (64-bit) in loop | MUFU/score | serial | overlap | shared B |",
             "|" + "---|" * 21]
    for r in rows:
        if not r.get("compiled"):
            lines.append(f"| {r['head_dim']} | {r['dtype']} | {r['consumer']} | {r['slopes']} | {r['variant']} | "
                         f"**no**: {r['error']} |" + " |" * 15)
            continue
        roles = r["registers_by_role"]
        c = r["cycles_per_element"]
        lines.append(
            f"| {r['head_dim']} | {r['dtype']} | {r['consumer']} | {r['slopes']} | {r['variant']} | "
            f"yes ({r['compile_seconds']} s) | "
            f"{r['block_n']} | {r['stages']} | {r['launch_registers']} ({r['maxnreg']}) | "
            f"{roles['consumer_default_partition']} / {roles['consumer_worker']} / {roles['producer_worker']} "
            f"({', '.join(map(str, roles['workers_idle'])) or '-'}); {r['consumer_loop_registers']} | {r['spill_bytes']} B | "
            f"{r['kernel_ops']['UTMALDG']} | {r['kernel_ops']['HGMMA']} ({r['loop_ops']['HGMMA']}) | "
            f"{r['kernel_ops']['SYNCS']} ({r['loop_ops']['SYNCS']}) | {r['kernel_ops']['USETMAXREG']} | "
            f"{r['instructions_per_element']} | {r['loop_global_loads']['LDG']} ({r['loop_global_loads']['LDG.64']}) | "
            f"{r['mufu_per_element']} | {c['bound_serial']} | {c['bound_overlap']} | {r['shared_bytes']} |")
    lines += ["", "## Beside the other kernels (instructions per score; serial / overlap bound)", "",
              "| head_dim | dtype | consumer | slopes | Gluon ALiBi | Gluon bias-free | Gluon ALiBi / bias-free | "
              "fused Triton ALiBi (default fwd) | fused Triton bias-free | flash-attn-4 sm90 bias-free |",
              "|" + "---|" * 10]
    by = {(r["head_dim"], r["dtype"], r["consumer"], r["slopes"], r["variant"]): r for r in rows if r.get("compiled")}
    first_slopes = {}
    for r in rows:
        first_slopes.setdefault((r["head_dim"], r["dtype"], r["consumer"]), r["slopes"])
    for (d, dt, cons, sl, var), r in sorted(by.items()):
        if var != "alibi":
            continue
        nb = by.get((d, dt, cons, first_slopes[(d, dt, cons)], "nobias"))

        def fmt(x):
            if x is None:
                return "-"
            return f"{x['instructions_per_element']} ({x['bound_serial']} / {x['bound_overlap']})"

        def g(x):
            return None if x is None else {"instructions_per_element": x["instructions_per_element"],
                                           "bound_serial": x["cycles_per_element"]["bound_serial"],
                                           "bound_overlap": x["cycles_per_element"]["bound_overlap"]}
        ratio = f"{r['instructions_per_element'] / nb['instructions_per_element']:.3f}×" if nb else "-"
        lines.append(f"| {d} | {dt} | {cons} | {sl} | {fmt(g(r))} | {fmt(g(nb))} | {ratio} | "
                     f"{fmt(comp.get(f'triton_fused|{d}|{dt}|{sl}|alibi'))} | "
                     f"{fmt(comp.get(f'triton_fused|{d}|{dt}|{sl}|nobias'))} | "
                     f"{fmt(comp.get(f'fa4|{d}|{dt}|none|nobias'))} |")
    lines += ["", "The fused Triton kernel's figures count two heads per program at head_dim 64 (one gathered bias "
              "tile serves both); the Gluon kernel computes one head per CTA, 128 query rows over two consumer "
              "warpgroups.", ""]
    lines += markdown_bwd(bwd_rows, comp)
    if meta.get("problems"):
        lines += ["## Problems", ""] + [f"- {p}" for p in meta["problems"]]
    return lines


def _fmt(x):
    if x is None:
        return "-"
    return f"{x['instructions_per_element']} ({x['bound_serial']} / {x['bound_overlap']})"


def markdown_bwd(rows, comp) -> list[str]:
    if not rows:
        return []
    lines = ["## Backward (dK/dV per key tile, dQ by fp32 atomic adds)", "",
             "Per consumer loop iteration = one 64-row query tile against one consumer warpgroup's 64 keys (Sᵀ = K Qᵀ, "
             "dPᵀ = V dOᵀ, dV += Pᵀ dO, dK += dSᵀ Q, dQ = dS K: five wgmma, dQ added with RED). Learned: the slope "
             "gradient Σ dS·B compiled in (per-head table path).", "",
             "| head_dim | dtype | slopes | variant | compiled | keys / CTA | query tile | stages | regs (cap) | "
             "setmaxnreg: consumer / consumer / producer (idle); used by the loop | spills | UTMALDG | HGMMA (loop) | "
             "SYNCS (loop) | USETMAXREG | RED (loop) | instr/score | LDG (64-bit) in loop | MUFU/score | serial | "
             "overlap | shared B | advisories |",
             "|" + "---|" * 23]
    for r in rows:
        if not r.get("compiled"):
            lines.append(f"| {r['head_dim']} | {r['dtype']} | {r['slopes']} | {r['variant']} | **no**: {r['error']} |"
                         + " |" * 18)
            continue
        roles = r["registers_by_role"]
        c = r["cycles_per_element"]
        lines.append(
            f"| {r['head_dim']} | {r['dtype']} | {r['slopes']} | {r['variant']} | yes ({r['compile_seconds']} s) | "
            f"{r['block_m']} | {r['block_n']} | {r['stages']} | {r['launch_registers']} ({r['maxnreg']}) | "
            f"{roles['consumer_default_partition']} / {roles['consumer_worker']} / {roles['producer_worker']} "
            f"({', '.join(map(str, roles['workers_idle'])) or '-'}); {r['consumer_loop_registers']} | "
            f"{r['spill_bytes']} B | {r['kernel_ops']['UTMALDG']} | {r['kernel_ops']['HGMMA']} ({r['loop_ops']['HGMMA']}) | "
            f"{r['kernel_ops']['SYNCS']} ({r['loop_ops']['SYNCS']}) | {r['kernel_ops']['USETMAXREG']} | "
            f"{r['kernel_ops']['REDG']} ({r['loop_ops']['REDG']}) | {r['instructions_per_element']} | "
            f"{r['loop_global_loads']['LDG']} ({r['loop_global_loads']['LDG.64']}) | {r['mufu_per_element']} | "
            f"{c['bound_serial']} | {c['bound_overlap']} | {r['shared_bytes']} | "
            f"{', '.join(r['ptxas_advisories']) or '-'} |")
    lines += ["", "### Beside the other backward kernels (instructions per score; serial / overlap bound)", "",
              "| head_dim | dtype | slopes | Gluon ALiBi | Gluon bias-free | Gluon ALiBi / bias-free | "
              "fused Triton ALiBi (default atomic-dQ dK/dV) | fused Triton bias-free | flash-attn-4 sm90 bwd bias-free "
              "| flash-attn-4 sm90 bwd score_mod (slopes) |", "|" + "---|" * 10]
    by = {(r["head_dim"], r["dtype"], r["slopes"], r["variant"]): r for r in rows if r.get("compiled")}

    def g(x):
        return None if x is None else {"instructions_per_element": x["instructions_per_element"],
                                       "bound_serial": x["cycles_per_element"]["bound_serial"],
                                       "bound_overlap": x["cycles_per_element"]["bound_overlap"]}
    for (d, dt, sl, var), r in sorted(by.items()):
        if var != "alibi":
            continue
        nb = by.get((d, dt, sl, "nobias"))
        ratio = f"{r['instructions_per_element'] / nb['instructions_per_element']:.3f}×" if nb else "-"
        fa4_sl = sl if sl in ("constant", "per-head") else "per-head"
        lines.append(f"| {d} | {dt} | {sl} | {_fmt(g(r))} | {_fmt(g(nb))} | {ratio} | "
                     f"{_fmt(comp.get(f'triton_fused_bwd|{d}|{dt}|{sl}|alibi'))} | "
                     f"{_fmt(comp.get(f'triton_fused_bwd|{d}|{dt}|{sl}|nobias'))} | "
                     f"{_fmt(comp.get(f'fa4_bwd|{d}|{dt}|none|nobias'))} | "
                     f"{_fmt(comp.get(f'fa4_bwd|{d}|{dt}|{fa4_sl}|alibi'))} |")
    lines += ["", "Instructions per score count one consumer loop iteration (the unmasked copy) × 4 warps over its "
              "64 × 64 scores. The fused Triton dK/dV kernel's tile is 64 × 64 keys × queries (32 query rows with "
              "learned slopes); flash-attn-4's sm90 backward's figures are from fa4_sass_sm90.md (bias-free, and its "
              "generic score_mod ALiBi with constant / per-head slopes).", ""]
    return lines


def main(argv=None):
    args = parse_args(argv)
    import triton

    from kernels import alibi_gluon as ag

    meta = {"command": command_line("bench_gluon_sass.py", argv if argv is not None else sys.argv[1:]),
            **environment(), "target": "cuda sm_90a (compile only)", "grid": list(GRID),
            "num_prefix_tokens": PREFIX, "width": WIDTH, "smoke": args.smoke,
            "kernel": "kernels/alibi_gluon.py::_gluon_alibi_fwd_kernel, _gluon_alibi_bwd_kernel",
            "gluon_available": ag.gluon_available(), "gluon_error": None if ag.gluon_available() else str(ag.GLUON_ERROR)}
    name = stem(triton.__version__)
    out_dir = args.out_dir
    rows, problems = [], []
    comp = comparisons(triton.__version__)

    def write(complete):
        meta["complete"] = complete
        meta["problems"] = problems
        return write_report(out_dir, name, {**meta, "rows": rows, "comparisons": comp}, markdown(meta, rows, comp),
                            smoke=args.smoke)

    if not ag.gluon_available():
        problems.append(f"this Triton ({triton.__version__}) lacks Gluon's Hopper API: {ag.GLUON_ERROR}")
        md, js = write(True)
        print(f"wrote {md} and {js}: nothing compiled ({problems[0]})")
        return 1
    def record(label, analyse_args, failed_row):
        try:
            row = analyse(*analyse_args)
        except Exception as err:  # noqa: BLE001 — record the failure, keep going
            msg = str(err).splitlines()[-1][:300] if str(err) else ""
            row = {**failed_row, "compiled": False, "error": f"{type(err).__name__}: {msg}"}
            problems.append(f"{label}: does not compile: {row['error']}")
        else:
            if row["variant"] == "alibi":
                problems.extend(f"{label}: {p}" for p in structure_ok(row))
        rows.append(row)
        print(f"{label}: " + (
            f"instr/score {row['instructions_per_element']}, regs {row['launch_registers']} "
            f"(setmaxnreg {row['registers_by_role']}), spills {row['spill_bytes']} B, "
            f"UTMALDG {row['kernel_ops']['UTMALDG']}, HGMMA {row['kernel_ops']['HGMMA']}, "
            f"USETMAXREG {row['kernel_ops']['USETMAXREG']}, SYNCS {row['kernel_ops']['SYNCS']}, "
            f"RED {row['kernel_ops']['REDG']}, advisories {row['ptxas_advisories']}" if row["compiled"]
            else row["error"]), flush=True)
        write(False)

    with tempfile.TemporaryDirectory() as workdir:
        if "bwd" in args.kernels:  # first: the new kernel's evidence
            for d in [d for d in args.head_dims if d in ag.BWD_SUPPORTED_HEAD_DIMS]:
                for dt in args.dtypes:
                    for sl in BWD_SLOPES:
                        for variant in ("alibi", "nobias"):
                            label = f"bwd d={d} {dt} {sl} {variant}"
                            record(label, (d, dt, sl, variant, workdir, "-", "bwd"),
                                   {"kernel": "bwd", "head_dim": d, "dtype": dt, "slopes": sl, "variant": variant,
                                    "consumer": "-"})
        for d in (args.head_dims if "fwd" in args.kernels else []):
            for dt in args.dtypes:
                for consumer in args.consumers:
                    for sl in args.slopes:
                        for variant in ("alibi", "nobias"):
                            if variant == "nobias" and sl != args.slopes[0]:
                                continue  # the bias-free build does not depend on the slopes
                            label = f"d={d} {dt} {consumer} {sl} {variant}"
                            record(label, (d, dt, sl, variant, workdir, consumer),
                                   {"kernel": "fwd", "head_dim": d, "dtype": dt, "slopes": sl, "variant": variant,
                                    "consumer": consumer})
    md, js = write(True)
    print(f"wrote {md} and {js}")
    if problems:
        print("problems:\n  " + "\n  ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
