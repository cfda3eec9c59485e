"""Static sm_90 (H100/H200) analysis of the fused ALiBi kernels, on a machine without a GPU.

Every fused kernel of ``kernels/alibi_triton.py`` (the forward, and the backward's dK/dV and dQ
kernels) is compiled for sm_90 with Triton's own ptxas, once as shipped (``alibi``) and once
with the bias compiled out by the kernels' ``HAS_BIAS`` constexpr (``nobias``), so the
comparison is like for like: same tiles, same loads, same softmax, only the bias differs. The
arguments are built by the same helpers the real launches use, with q, k, v as views of a
fused qkv projection (as in the model), so the compiler sees the same specialisations.

The SASS depends on the Triton version (its passes and its bundled ptxas), so results are named
by it: ``benchmarks/results/kernel_sass_sm90_triton<major.minor>.{md,json}``. Measure with the
Triton the GPU machines run (3.6); a second environment gives it on any CPU machine::

    python3 -m venv /work/venv36 && /work/venv36/bin/pip install torch==2.13.0 triton==3.6.0
    PYTHONPATH=. /work/venv36/bin/python benchmarks/bench_kernel_sass.py --head-dims 64 --dtypes bfloat16

(pip resolves ``torch==2.13.0`` to its CPU build, ``2.13.0+cpu``, which compiles for sm_90
through Triton without a GPU). A results file of another Triton version in the same folder is
read as a second column of the summary (``--compare`` names one explicitly).

For each kernel, variant and launch config it records, from the SASS listing (``cuobjdump``
bundled with Triton) of the kernel's steady-state loop over key (forward, dQ) or query (dK/dV)
tiles (the shortest loop that holds tensor-core instructions):

- ``main_loop_instructions`` (per warp) and ``instructions_per_element``: that × num_warps /
  (BLOCK_M × BLOCK_N × heads_per_program), warp-instructions per score element; the backward's
  figure is the sum over its kernels. ``heads_per_program`` is 2 where a forward or dQ program
  computes two heads from one gathered bias tile (constant slopes, head_dim <= 64), else 1;
- tensor-core path: ``hgmma`` (warpgroup wgmma, sm_90's fast path) and ``hmma`` (mma.sync, the
  slow path) per loop iteration, and ``waits_per_hgmma``: ``WARPGROUP.DEPBAR`` waits per HGMMA
  (about one per HGMMA means every wgmma is waited for before the next is issued);
- ``ptxas_advisories``: the codes ptxas prints for the kernel's PTX (``-v``); C7515 says the
  wgmma pipeline is serialised, and any C7515 makes the run exit with status 1 after writing;
- ``spill_instructions_in_loop`` (LDL/STL inside the loop), ``registers``, ``spill_bytes``,
  ``shared_bytes`` and ``ctas_per_sm`` (sm_90: 64K registers, 228 KiB shared memory with 1 KiB
  reserved per CTA, 64 warps and 32 CTAs per SM);
- ``loop_global_loads``: global loads in the loop by kind, ``LDG`` (a plain load: the warp waits
  for it where the value is used) or ``LDGSTS`` (an asynchronous copy into shared memory, issued
  stages ahead by Triton's pipeliner). The summary calls the bias gather pipelined when the loads
  that ``alibi`` adds over ``nobias`` are all ``LDGSTS``;
- SM-cycles per score from per-unit work in the loop at public H100 per-SM rates per clock:
  tensor core 4096 dense 16-bit FLOPs (HGMMA shapes; HMMA counted at the same rate, so
  optimistic), MUFU 16 ops, issue 4 warp-instructions, LSU 1 warp-instruction. Two bounds:
  ``bound_overlap`` = the busiest unit (perfect overlap of units), ``bound_serial`` = tensor
  core + max(issue, MUFU) (softmax and matmuls not overlapped inside a warpgroup). Neither is a
  timing; the GPU decides.

``default`` marks the config used when autotuning is off (``ALIBI_TRITON_AUTOTUNE=0``). The opt-in
atomic-dQ backward (``ALIBI_TRITON_ATOMIC_DQ=1``: the dK/dV kernel also adds dS·K into dQ, no dQ
kernel) is compiled at the default dK/dV config with the fp32 dQ buffer it runs with, and reported
apart, under ``atomic_dq``.

    python benchmarks/bench_kernel_sass.py                   # d=64 and 128, bf16 and fp16, all configs
    python benchmarks/bench_kernel_sass.py --head-dims 64 --dtypes bfloat16 --default-only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import RESULTS, command_line, environment, write_report  # noqa: E402

STEM = "kernel_sass_sm90"
# ViT-S/B/L keep head_dim 64; at 518 px with patch 14 and 5 prefix tokens N = 5 + 37·37.
GRID, PREFIX, WIDTH = (37, 37), 5, 768
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
# sm_90 per-SM limits (CUDA occupancy rules).
SM90 = dict(regs=65536, reg_unit=256, max_warps=64, max_ctas=32, smem=228 * 1024, smem_reserved=1024)
# H100 per-SM throughput per clock: dense 16-bit tensor-core FLOPs, MUFU ops (32 lanes = 1 op each),
# issued warp-instructions (4 schedulers), LSU warp-instructions.
RATES = dict(tensor=4096.0, mufu=16.0, issue=4.0, lsu=1.0)
GOALS = {"fwd": 1.25, "bwd": 1.35, "serial": 1.2}
LSU_OPS = ("LDG", "LDGSTS", "LDS", "STS", "STG", "RED", "REDG", "ATOM", "ATOMG", "ATOMS", "LDSM", "STSM",
           "UTMALDG", "UTMASTG", "LDL", "STL")


def stem(triton_version: str) -> str:
    """Results file stem for one Triton version: kernel_sass_sm90_triton3.6."""
    return f"{STEM}_triton{'.'.join(triton_version.split('.')[:2])}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], choices=(16, 32, 64, 128))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=("bfloat16", "float16"))
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--bias-mode", choices=("table", "sqrt"), default="table")
    p.add_argument("--default-only", action="store_true", help="only the config used when autotuning is off")
    p.add_argument("--no-atomic-dq", action="store_true",
                   help="skip the opt-in atomic-dQ variant of the dK/dV kernel (reported apart from `rows`)")
    p.add_argument("--compare", type=Path, default=None,
                   help="results JSON of another Triton version, shown as a second column (default: the other "
                        f"{STEM}_triton*.json in the output folder, if any)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help=f"where {STEM}_triton<version>.{{md,json}} go (default: benchmarks/results/)")
    p.add_argument("--smoke", action="store_true", help="not a measurement: write under benchmarks/results/smoke/")
    return p.parse_args(argv)


def _tool(name):
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: this Triton build ships no {name} (needed for SASS)")
    return str(path)


def _sample_call(kind, head_dim, dtype, table, atomic_dq=False):
    """(raw jit function, positional args, constexpr kwargs) of one real launch, on CPU tensors. With
    ``atomic_dq`` the dK/dV kernel gets the fp32 dQ buffer the atomic-dQ backward adds into."""
    import torch

    from kernels import alibi_triton as at
    from kernels.alibi_bias import device_bias_lookup

    heads, n = WIDTH // head_dim, PREFIX + GRID[0] * GRID[1]
    geometry = GRID, device_bias_lookup(*GRID, PREFIX, True, True, table, torch.device("cpu"))
    qkv = torch.empty(1, n, 3, heads, head_dim, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # as timm's fused qkv projection hands them over
    slopes = torch.ones(1)  # constant slopes (slopes=None, the paper's choice): one slope for all heads
    if kind == "fwd":
        args, kw = at._fwd_args(q, k, v, at._new_bnhd(q), torch.empty(1, heads, n), slopes, geometry, True, table)
        return at._alibi_fwd_kernel, args, kw
    do, dk, dv = (at._new_bnhd(q) for _ in range(3))
    dq = at._new_bnhd(q, torch.float32 if atomic_dq else None)
    lse, delta = torch.empty(2, 1, heads, at.stat_stride(n)).unbind(0)  # the backward's padded statistics rows
    dkdv_args, dq_args, kw, pair = at._bwd_args(do, q, k, v, dq, dk, dv, lse, delta, torch.empty(1), slopes,
                                                geometry, True, table)
    kw = {**kw, "COMPUTE_DSLOPE": False}  # constant slopes (the paper's choice): no slope gradient
    if kind == "bwd_dkdv":
        return at._alibi_bwd_dkdv_kernel, dkdv_args, {**kw, "ATOMIC_DQ": atomic_dq}
    return at._alibi_bwd_dq_kernel, dq_args, {**kw, "HEAD_PAIR": pair}


def compile_sm90(fn, args, kwargs):
    """Compile a ``@triton.jit`` function for sm_90 as a launch with these arguments would, without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    # The JIT's own binder: the same type, alignment and ==1 specialisations as a real launch.
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")
_ADVISORY = re.compile(r"\b(C\d{4})\b")


def main_loop_body(sass: str) -> list[str]:
    """Instructions of the shortest loop (backward branch) that holds tensor-core (HGMMA/HMMA) instructions."""
    insns = [(int(a, 16), text) for a, text in _INSN.findall(sass)]
    best = None
    for i, (addr, text) in enumerate(insns):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= addr:
            body = [t for a, t in insns[:i + 1] if a >= int(m.group(1), 16)]
            if any("GMMA" in t or "HMMA" in t for t in body) and (best is None or len(body) < len(best)):
                best = body
    if best is None:
        raise ValueError("no loop with tensor-core instructions found in the SASS")
    return best


def sass_main_loop(sass: str) -> int:
    """Instructions in the shortest loop (backward branch) that holds tensor-core (HGMMA/HMMA) instructions."""
    return len(main_loop_body(sass))


def opcode(text: str) -> str:
    """The opcode with its modifiers, predicate dropped: '@!P0 LDG.E.64 R2, ...' → 'LDG.E.64'."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0]


def unit_counts(body: list[str], num_warps: int) -> dict:
    """Per-unit work of one loop iteration of a whole program (all its warps)."""
    ops = [opcode(t) for t in body]
    base = [o.split(".")[0] for o in ops]
    flops = 0
    for o in ops:
        m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", o)
        if m:  # one warpgroup (4 warps) issues it together
            mm, nn, kk = map(int, m.groups())
            flops += 2 * mm * nn * kk * (num_warps // 4)
        m = re.match(r"HMMA\.(16816|1688)", o)
        if m:  # per warp: HMMA.16816 is m16 n8 k16, HMMA.1688 m16 n8 k8
            flops += 2 * 16 * 8 * (16 if m.group(1) == "16816" else 8) * num_warps
    loads = {"LDG": sum(b == "LDG" for b in base), "LDGSTS": sum(b == "LDGSTS" for b in base)}
    return {"hgmma": sum(b == "HGMMA" for b in base), "hmma": sum(b == "HMMA" for b in base),
            "waits": sum(o.startswith("WARPGROUP.DEPBAR") for o in ops),
            "mufu": sum(b == "MUFU" for b in base) * num_warps * 32,
            "lsu": sum(b in LSU_OPS for b in base) * num_warps,
            "spill": sum(b in ("LDL", "STL") for b in base),
            "issue": len(body) * num_warps, "flops": flops, "loads": loads}


def cycles_per_score(units: dict, scores: int) -> dict:
    """SM-cycles per score element per unit at H100 per-SM rates, and the overlap and serial bounds."""
    # MUFU: 16 lanes per clock per SM, so one warp-wide op (32 lanes) occupies it for 2 clocks.
    per = {"tensor": units["flops"] / scores / RATES["tensor"], "mufu": units["mufu"] / scores / RATES["mufu"],
           "issue": units["issue"] / scores / RATES["issue"], "lsu": units["lsu"] / scores / RATES["lsu"]}
    out = {u: round(v, 5) for u, v in per.items()}
    out["bound_overlap"] = round(max(per.values()), 5)
    out["bound_serial"] = round(per["tensor"] + max(per["issue"], per["mufu"]), 5)
    return out


def ptxas_advisories(ptx: str, workdir: Path) -> list[str]:
    """Advisory and warning codes ptxas prints for this PTX (e.g. C7515: wgmma serialised)."""
    src = Path(workdir) / "kernel.ptx"
    src.write_text(ptx)
    out = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", str(src), "-o", str(Path(workdir) / "ptxas.cubin")],
                         capture_output=True, text=True)
    return sorted(set(_ADVISORY.findall(out.stderr + out.stdout)))


def resource_usage(cubin: Path) -> dict:
    out = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    if not m:
        raise ValueError(f"unexpected cuobjdump -res-usage output: {out[-500:]}")
    regs, stack, local = map(int, m.groups())
    return {"registers": regs, "spill_bytes": max(stack, local)}


def ctas_per_sm(registers: int, num_warps: int, shared: int) -> int:
    per_warp = -(-registers * 32 // SM90["reg_unit"]) * SM90["reg_unit"]
    by_regs = (SM90["regs"] // per_warp) // num_warps
    by_smem = SM90["smem"] // (shared + SM90["smem_reserved"])
    return min(by_regs, by_smem, SM90["max_warps"] // num_warps, SM90["max_ctas"])


def analyse(kind, variant, head_dim, dtype_name, cfg, default, bias_mode, workdir, atomic_dq=False):
    import torch

    fn, args, kw = _sample_call(kind, head_dim, getattr(torch, dtype_name), bias_mode == "table", atomic_dq)
    kw = {**kw, **cfg.kwargs, "HAS_BIAS": variant == "alibi", "num_warps": cfg.num_warps,
          "num_stages": cfg.num_stages, "enable_fp_fusion": True}
    kernel = compile_sm90(fn, args, kw)
    cubin = Path(workdir) / f"{kind}_{variant}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    body = main_loop_body(sass)
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    heads_per_program = 2 if kw.get("HEAD_PAIR") else 1
    scores = bm * bn * heads_per_program
    units = unit_counts(body, cfg.num_warps)
    usage = resource_usage(cubin)
    shared = int(kernel.metadata.shared)
    advisories = ptxas_advisories(kernel.asm["ptx"], workdir)
    return {"kernel": kind, "variant": variant, "bias_mode": bias_mode, "head_dim": head_dim, "dtype": dtype_name,
            "block_m": bm, "block_n": bn, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "heads_per_program": heads_per_program, "default": default, "main_loop_instructions": len(body),
            "instructions_per_element": round(len(body) * cfg.num_warps / scores, 4),
            "hgmma": units["hgmma"], "hmma": units["hmma"],
            "waits_per_hgmma": round(units["waits"] / units["hgmma"], 2) if units["hgmma"] else None,
            "ptxas_advisories": advisories, "serialized_wgmma": "C7515" in advisories,
            "spill_instructions_in_loop": units["spill"], "loop_global_loads": units["loads"],
            "mufu_per_element": round(units["mufu"] / scores, 4), "lsu_per_element": round(units["lsu"] / scores, 4),
            "cycles_per_element": cycles_per_score(units, scores),
            **usage, "shared_bytes": shared, "ctas_per_sm": ctas_per_sm(usage["registers"], cfg.num_warps, shared),
            **({"atomic_dq": True} if atomic_dq else {})}


def gather_pipelined(alibi: dict, nobias: dict):
    """Whether the loads the bias adds to the loop are all asynchronous copies (LDGSTS), None if it adds none."""
    extra = {k: alibi["loop_global_loads"][k] - nobias["loop_global_loads"][k] for k in ("LDG", "LDGSTS")}
    if extra["LDG"] <= 0 and extra["LDGSTS"] <= 0:
        return None
    return extra["LDG"] <= 0


def summarise(rows):
    """Per (head_dim, dtype): default-config alibi/nobias ratios, forward and backward (kernels summed),
    in instructions and in the serial and overlap cycle bounds."""
    out = []
    keys = sorted({(r["head_dim"], r["dtype"]) for r in rows})
    for d, dt in keys:
        sel = {(r["kernel"], r["variant"]): r for r in rows if r["default"] and (r["head_dim"], r["dtype"]) == (d, dt)}
        entry = {"head_dim": d, "dtype": dt}
        for part, kinds in (("fwd", ["fwd"]), ("bwd", ["bwd_dkdv", "bwd_dq"])):
            if all((k, v) in sel for k in kinds for v in ("alibi", "nobias")):
                ipe = {v: sum(sel[(k, v)]["instructions_per_element"] for k in kinds) for v in ("alibi", "nobias")}
                ratio = ipe["alibi"] / ipe["nobias"]
                entry[part] = {"alibi": round(ipe["alibi"], 4), "nobias": round(ipe["nobias"], 4),
                               "ratio": round(ratio, 3), "goal": GOALS[part], "meets_goal": ratio <= GOALS[part]}
                for bound in ("bound_serial", "bound_overlap"):
                    cyc = {v: sum(sel[(k, v)]["cycles_per_element"][bound] for k in kinds) for v in ("alibi", "nobias")}
                    entry[part][bound] = {"alibi": round(cyc["alibi"], 5), "nobias": round(cyc["nobias"], 5),
                                          "ratio": round(cyc["alibi"] / cyc["nobias"], 3)}
                entry[part]["serial_meets_goal"] = entry[part]["bound_serial"]["ratio"] <= GOALS["serial"]
        for k in KERNELS:
            if (k, "alibi") in sel and (k, "nobias") in sel:
                entry.setdefault("gather_pipelined", {})[k] = gather_pipelined(sel[(k, "alibi")], sel[(k, "nobias")])
        if ("fwd", "alibi") in sel:
            entry["fwd_ctas_per_sm"] = sel[("fwd", "alibi")]["ctas_per_sm"]
        entry["spills"] = any(sel[key]["spill_bytes"] > 0 for key in sel if key[1] == "alibi")
        entry["serialized_wgmma"] = sorted(f"{k}/{v}" for (k, v), r in sel.items() if r["serialized_wgmma"])
        out.append(entry)
    return out


def summarise_atomic_dq(rows, atomic_rows):
    """Per (head_dim, dtype): the opt-in atomic-dQ backward (one dK/dV kernel that also adds dS·K into dQ)
    against the default two-kernel backward, both as alibi and nobias, warp-instructions per score element
    and serial-bound cycles per score element."""
    out = []
    for a in atomic_rows:
        if a["variant"] != "alibi":
            continue
        same = [r for r in rows if r["default"] and (r["head_dim"], r["dtype"]) == (a["head_dim"], a["dtype"])
                and r["kernel"] in ("bwd_dkdv", "bwd_dq")]
        two_kernel = {v: sum(r["instructions_per_element"] for r in same if r["variant"] == v)
                      for v in ("alibi", "nobias")}
        nobias = next((r for r in atomic_rows if r["variant"] == "nobias"
                       and (r["head_dim"], r["dtype"]) == (a["head_dim"], a["dtype"])), None)
        entry = {"head_dim": a["head_dim"], "dtype": a["dtype"], "atomic_alibi": a["instructions_per_element"],
                 "atomic_nobias": nobias and nobias["instructions_per_element"],
                 "two_kernel_alibi": round(two_kernel["alibi"], 4), "two_kernel_nobias": round(two_kernel["nobias"], 4)}
        if two_kernel["nobias"]:
            entry["atomic_alibi_vs_two_kernel_nobias"] = round(a["instructions_per_element"] / two_kernel["nobias"], 3)
        serial_nobias = sum(r["cycles_per_element"]["bound_serial"] for r in same
                            if r["variant"] == "nobias" and "cycles_per_element" in r)
        if serial_nobias and "cycles_per_element" in a:
            entry["serial_atomic_alibi_vs_two_kernel_nobias"] = round(
                a["cycles_per_element"]["bound_serial"] / serial_nobias, 3)
        out.append(entry)
    return out


def find_comparison(out_dir: Path, version: str, explicit: Path | None):
    """The results payload of another Triton version: ``explicit``, or the other file in ``out_dir``."""
    if explicit is not None:
        return json.loads(Path(explicit).read_text())
    mine = stem(version)
    for path in sorted(Path(out_dir).glob(f"{STEM}_triton*.json")):
        if path.stem != mine:
            return json.loads(path.read_text())
    return None


def _fmt(x, nd=3):
    return "" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def markdown(payload):
    other = payload.get("comparison")
    other_summary = {(s["head_dim"], s["dtype"]): s for s in (other or {}).get("summary", [])}
    ot = f"triton {other['triton']}" if other else None
    lines = ["# Fused ALiBi kernels: static sm_90 SASS analysis", "",
             f"`{payload['command']}`", "",
             f"**triton {payload['triton']}** (torch {payload['torch']}), {payload['date']}. Compiled for sm_90 "
             "without a GPU (Triton's ptxas); counts are per warp, cycles are bounds at H100 per-SM rates, not "
             "timings. `nobias` is the same kernel with the bias compiled out. Bias mode "
             f"`{payload['bias_mode']}`; constant slopes (no slope gradient).", ""]
    if other:
        lines += [f"Second column: {ot} (torch {other['torch']}, {other['date']}), read from its own results file.", ""]
    lines += ["## Default configs: alibi / nobias", "",
              "Warp-instructions per score element (goal: forward ≤ 1.25×, backward ≤ 1.35×) and serial-bound "
              "SM-cycles per score element (goal ≤ 1.2×); the backward sums its dK/dV and dQ kernels.", "",
              "| head_dim | dtype | fwd alibi | fwd nobias | fwd ratio | bwd alibi | bwd nobias | bwd ratio | "
              "fwd serial ratio | bwd serial ratio | fwd overlap ratio | bwd overlap ratio | C7515 | spills | "
              "fwd CTAs/SM |" + (f" {ot}: fwd / bwd ratio | {ot}: fwd / bwd serial |" if other else ""),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if other else "")]
    for s in payload["summary"]:
        f, b = s.get("fwd", {}), s.get("bwd", {})
        cells = [s["head_dim"], s["dtype"], f.get("alibi"), f.get("nobias"), f.get("ratio"), b.get("alibi"),
                 b.get("nobias"), b.get("ratio"), f.get("bound_serial", {}).get("ratio"),
                 b.get("bound_serial", {}).get("ratio"), f.get("bound_overlap", {}).get("ratio"),
                 b.get("bound_overlap", {}).get("ratio"), ", ".join(s.get("serialized_wgmma", [])) or "none",
                 "yes" if s["spills"] else "no", s.get("fwd_ctas_per_sm")]
        if other:
            o = other_summary.get((s["head_dim"], s["dtype"]), {})
            of, ob = o.get("fwd", {}), o.get("bwd", {})
            cells += [f"{_fmt(of.get('ratio'))} / {_fmt(ob.get('ratio'))}",
                      f"{_fmt(of.get('bound_serial', {}).get('ratio'))} / {_fmt(ob.get('bound_serial', {}).get('ratio'))}"]
        lines.append("| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in cells) + " |")
    lines += ["", "Bias gather pipelined (the loads the bias adds are asynchronous copies): " + "; ".join(
        f"d={s['head_dim']} {s['dtype']}: " + ", ".join(f"{k} {'yes' if v else ('no' if v is False else '-')}"
                                                       for k, v in s.get("gather_pipelined", {}).items())
        for s in payload["summary"]) + ".", ""]
    lines += ["## Every kernel and config", "",
              "Per loop iteration: HGMMA / HMMA count, waits per HGMMA, ptxas advisories, spill instructions in the "
              "loop, global loads (LDG plain / LDGSTS asynchronous). Per score element: instructions, MUFU and LSU "
              "operations, and SM-cycles (tensor core, MUFU, issue, LSU; overlap and serial bounds).", "",
              "| kernel | variant | head_dim | dtype | tile (M×N) | heads | warps | stages | default | loop insts | "
              "insts/element | HGMMA | HMMA | waits/HGMMA | advisories | loop spills | LDG / LDGSTS | MUFU/el | "
              "LSU/el | tc | mufu | issue | lsu | overlap | serial | regs | spill B | smem B | CTAs/SM |",
              "|" + "---|" * 29]
    for r in payload["rows"] + payload.get("atomic_dq", []):
        c = r["cycles_per_element"]
        kernel = r["kernel"] + (" (atomic dQ)" if r.get("atomic_dq") else "")
        lines.append(f"| {kernel} | {r['variant']} | {r['head_dim']} | {r['dtype']} | "
                     f"{r['block_m']}×{r['block_n']} | {r['heads_per_program']} | {r['num_warps']} | "
                     f"{r['num_stages']} | {'yes' if r['default'] else ''} | "
                     f"{r['main_loop_instructions']} | {r['instructions_per_element']} | {r['hgmma']} | {r['hmma']} | "
                     f"{_fmt(r['waits_per_hgmma'], 2)} | {', '.join(r['ptxas_advisories']) or '-'} | "
                     f"{r['spill_instructions_in_loop']} | {r['loop_global_loads']['LDG']} / "
                     f"{r['loop_global_loads']['LDGSTS']} | {r['mufu_per_element']} | {r['lsu_per_element']} | "
                     f"{c['tensor']:.4f} | {c['mufu']:.4f} | {c['issue']:.4f} | {c['lsu']:.4f} | "
                     f"{c['bound_overlap']:.4f} | {c['bound_serial']:.4f} | {r['registers']} | "
                     f"{r['spill_bytes']} | {r['shared_bytes']} | {r['ctas_per_sm']} |")
    if payload.get("atomic_dq"):
        lines += ["", "## Opt-in atomic dQ (`ALIBI_TRITON_ATOMIC_DQ=1`), default dK/dV config", "",
                  "One dK/dV kernel that also adds dS·K into the fp32 dQ buffer with atomic adds (compiled with that "
                  "buffer), against the default backward (dK/dV kernel + dQ kernel). Atomic adds are memory traffic "
                  "that these counts do not weigh: only a GPU timing can say which is faster.",
                  "", "| head_dim | dtype | atomic alibi | atomic nobias | two-kernel alibi | two-kernel nobias | "
                  "atomic alibi / two-kernel nobias (insts) | (serial bound) | regs | spill B | CTAs/SM |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in payload["atomic_dq_summary"]:
            r = next(r for r in payload["atomic_dq"] if r["variant"] == "alibi"
                     and (r["head_dim"], r["dtype"]) == (s["head_dim"], s["dtype"]))
            lines.append(f"| {s['head_dim']} | {s['dtype']} | {s['atomic_alibi']} | {s['atomic_nobias']} | "
                         f"{s['two_kernel_alibi']} | {s['two_kernel_nobias']} | "
                         f"{s.get('atomic_alibi_vs_two_kernel_nobias', '')} | "
                         f"{s.get('serial_atomic_alibi_vs_two_kernel_nobias', '')} | {r['registers']} | "
                         f"{r['spill_bytes']} | {r['ctas_per_sm']} |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("bench_kernel_sass.py compiles real kernels: unset TRITON_INTERPRET")
    os.environ["ALIBI_TRITON_AUTOTUNE"] = "0"  # only the config lists are read; nothing is launched
    try:
        _tool("cuobjdump")
        _tool("ptxas")
        import triton

        from kernels import alibi_triton as at
    except (FileNotFoundError, ImportError) as err:
        raise SystemExit(f"bench_kernel_sass.py: {err}") from None
    kinds = {"fwd": "fwd", "bwd_dkdv": "dkdv", "bwd_dq": "dq"}
    rows, atomic_rows = [], []

    def show(label, row):
        print(f"{label:22s} {row['variant']:6s} d={row['head_dim']} {row['dtype']:8s} {row['block_m']}x{row['block_n']} "
              f"w{row['num_warps']} s{row['num_stages']}: {row['main_loop_instructions']} insts, "
              f"{row['instructions_per_element']}/elem, HGMMA {row['hgmma']} HMMA {row['hmma']}, "
              f"waits/HGMMA {row['waits_per_hgmma']}, advisories {row['ptxas_advisories'] or '-'}, "
              f"serial {row['cycles_per_element']['bound_serial']}, {row['registers']} regs, "
              f"spill {row['spill_bytes']}, smem {row['shared_bytes']}, {row['ctas_per_sm']} CTA/SM", flush=True)

    with tempfile.TemporaryDirectory() as workdir:
        for d in args.head_dims:
            for dtype in args.dtypes:
                for kind in args.kernels:
                    configs = at.gpu_launch_configs(kinds[kind], d, args.bias_mode == "table")
                    for i, cfg in enumerate(configs[:1] if args.default_only else configs):
                        for variant in ("alibi", "nobias"):
                            row = analyse(kind, variant, d, dtype, cfg, i == 0, args.bias_mode, workdir)
                            rows.append(row)
                            show(kind, row)
                if "bwd_dkdv" in args.kernels and not args.no_atomic_dq:
                    cfg = at.gpu_launch_configs("dkdv", d, args.bias_mode == "table")[0]
                    for variant in ("alibi", "nobias"):
                        row = analyse("bwd_dkdv", variant, d, dtype, cfg, True, args.bias_mode, workdir,
                                      atomic_dq=True)
                        atomic_rows.append(row)
                        show("bwd_dkdv+atomic dQ", row)
    out_dir = args.out_dir if args.out_dir is not None else (RESULTS / "smoke" if args.smoke else RESULTS)
    comparison = find_comparison(out_dir, triton.__version__, args.compare)
    payload = {"command": command_line("bench_kernel_sass.py", sys.argv[1:] if argv is None else argv),
               **environment(), "target": "sm_90", "bias_mode": args.bias_mode, "smoke": args.smoke,
               "grid": list(GRID), "num_prefix_tokens": PREFIX, "rates_per_sm_clock": RATES,
               "summary": summarise(rows), "rows": rows,
               "atomic_dq": atomic_rows, "atomic_dq_summary": summarise_atomic_dq(rows, atomic_rows)}
    lines = markdown({**payload, "comparison": comparison})
    if comparison:
        payload["comparison"] = {k: comparison[k] for k in ("triton", "torch", "date", "summary") if k in comparison}
    md, js = write_report(args.out_dir, stem(triton.__version__), payload, lines, smoke=args.smoke)
    print(f"wrote {md} and {js}")
    serialised = sorted({f"{r['kernel']}{' (atomic dQ)' if r.get('atomic_dq') else ''} {r['block_m']}x{r['block_n']}"
                         f"w{r['num_warps']}s{r['num_stages']} d={r['head_dim']}"
                         for r in rows + atomic_rows if r["serialized_wgmma"]})
    if serialised:
        raise SystemExit("ptxas advisory C7515 (serialised wgmma) in: " + "; ".join(serialised))
    return payload


if __name__ == "__main__":
    main()
