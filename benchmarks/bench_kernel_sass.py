"""Static sm_90 (H100/H200) analysis of the fused ALiBi kernels, on a machine without a GPU.

Every fused kernel of ``kernels/alibi_triton.py`` (the forward, the backward's dK/dV and dQ kernels,
and the dK/dV kernel of the atomic-dQ backward) is compiled for sm_90 with Triton's own ptxas, once
as shipped (``alibi``) and once with the bias compiled out by the kernels' ``HAS_BIAS`` constexpr
(``nobias``), so the comparison is like for like: same tiles, same loads, same softmax, only the
bias differs. The arguments are built by the same helpers the real launches use, with q, k, v as
views of a fused qkv projection (as in the model), so the compiler sees the same specialisations,
for each slope kind (``--slopes``): ``constant`` (``slopes=None``: one scaled table, two heads per
forward and dQ program at head_dim <= 64), ``per-head`` (a fixed slope per head: the unscaled table
times each head's factor, head pairs as well) and ``learned`` (per-head slopes with the slope
gradient accumulated in the dK/dV kernel; its forward is the per-head one).

The SASS depends on the Triton version (its passes and its bundled ptxas), so results are named
by it: ``benchmarks/results/kernel_sass_sm90_triton<major.minor>.{md,json}``. Measure with the
Triton the GPU machines run (3.6); a second environment gives it on any CPU machine::

    python3 -m venv ~/venvs/t36 && ~/venvs/t36/bin/pip install torch==2.13.0 triton==3.6.0 numpy
    PYTHONPATH=. ~/venvs/t36/bin/python benchmarks/bench_kernel_sass.py --head-dims 64 128 --dtypes bfloat16

(pip resolves ``torch==2.13.0`` to its CPU build, ``2.13.0+cpu``, which compiles for sm_90
through Triton without a GPU). A results file of another Triton version in the same folder is
read as a second column of the summary (``--compare`` names one explicitly).

For each kernel, slope kind, variant and launch config it records, from the SASS listing
(``cuobjdump`` bundled with Triton) of the kernel's steady-state loop over key (forward, dQ) or
query (dK/dV) tiles (the shortest loop that holds tensor-core instructions):

- ``main_loop_instructions`` (per warp) and ``instructions_per_element``: that × num_warps /
  (BLOCK_M × BLOCK_N × heads_per_program), warp-instructions per score element; a backward's
  figure is the sum over its kernels. ``heads_per_program`` is 2 where a forward or dQ program
  computes two heads from one gathered bias tile (head_dim <= 64, even head count), else 1;
- tensor-core path: ``hgmma`` (warpgroup wgmma, sm_90's fast path) and ``hmma`` (mma.sync, the
  slow path) per loop iteration, and ``waits_per_hgmma``: ``WARPGROUP.DEPBAR`` waits per HGMMA;
- ``ptxas_advisories``: the codes ptxas prints for the kernel's PTX (``-v``); C7515 says the
  wgmma pipeline is serialised;
- ``spill_instructions_in_loop`` (LDL/STL inside the loop), ``registers`` (of the 255 a thread may
  have; ``maxnreg`` is the config's cap where it sets one), ``spill_bytes``, ``shared_bytes`` and
  ``ctas_per_sm`` (sm_90: 64K registers, 228 KiB shared memory with 1 KiB reserved per CTA, 64 warps
  and 32 CTAs per SM);
- ``loop_global_loads``: global loads in the loop by kind, ``LDG`` (a plain load) or ``LDGSTS`` (an
  asynchronous copy into shared memory, issued stages ahead by Triton's pipeliner);
- SM-cycles per score from per-unit work in the loop at public H100 per-SM rates per clock:
  tensor core 4096 dense 16-bit FLOPs (HGMMA shapes; HMMA counted at the same rate, so
  optimistic), MUFU 16 ops, issue 4 warp-instructions, LSU 1 warp-instruction. Two bounds:
  ``bound_overlap`` = the busiest unit (perfect overlap of units), ``bound_serial`` = tensor
  core + max(issue, MUFU) (softmax and matmuls not overlapped inside a warpgroup). Neither is a
  timing; the GPU decides.

The summary, per head_dim, dtype and slope kind, holds the default configs' (``ALIBI_TRITON_AUTOTUNE=0``)
ALiBi / bias-free ratios of the forward and of both backwards (atomic dQ: one dK/dV kernel; two-kernel:
dK/dV + dQ kernels), which backward ``kernels.alibi_triton.atomic_dq_default`` picks, and the goals:
forward <= 1.25x, backward <= 1.35x (both forms), no C7515, no spills, at least 8 registers under 255
in every default ALiBi kernel. A run that misses a goal, or meets a C7515, writes its results and exits
with status 1. A run never replaces a results file that covers more than it would (more head dims,
dtypes, slope kinds, kernels or configs): give it another ``--out-dir`` then, and ``--merge-from`` puts
its rows in place of the same cells of the full file (which notes what was merged, by which command and
when). The results files are rewritten after every head_dim and dtype, marked incomplete until the run ends.

    python benchmarks/bench_kernel_sass.py                   # d=64 and 128, bf16 and fp16, all configs
    python benchmarks/bench_kernel_sass.py --head-dims 64 --dtypes bfloat16 --default-only --slopes constant
    python benchmarks/bench_kernel_sass.py --slopes learned --kernels bwd_dkdv --out-dir /tmp/sass   # after a change
    python benchmarks/bench_kernel_sass.py --merge-from /tmp/sass/kernel_sass_sm90_triton3.8.json
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
SLOPES = ("constant", "per-head", "learned")
# A backward's kernels: (kernel, atomic dQ) pairs.
BACKWARDS = {"atomic": (("bwd_dkdv", True),), "two-kernel": (("bwd_dkdv", False), ("bwd_dq", False))}
# sm_90 per-SM limits (CUDA occupancy rules); a thread may hold at most 255 registers.
SM90 = dict(regs=65536, reg_unit=256, max_warps=64, max_ctas=32, smem=228 * 1024, smem_reserved=1024)
MAX_REGISTERS = 255
# H100 per-SM throughput per clock: dense 16-bit tensor-core FLOPs, MUFU ops (32 lanes = 1 op each),
# issued warp-instructions (4 schedulers), LSU warp-instructions.
RATES = dict(tensor=4096.0, mufu=16.0, issue=4.0, lsu=1.0)
GOALS = {"fwd": 1.25, "bwd": 1.35, "serial": 1.2, "register_headroom": 8}
LSU_OPS = ("LDG", "LDGSTS", "LDS", "STS", "STG", "RED", "REDG", "ATOM", "ATOMG", "ATOMS", "LDSM", "STSM",
           "UTMALDG", "UTMASTG", "LDL", "STL")
_KERNEL_OF = {"fwd": "fwd", "bwd_dkdv": "dkdv", "bwd_dq": "dq"}


def stem(triton_version: str) -> str:
    """Results file stem for one Triton version: kernel_sass_sm90_triton3.6."""
    return f"{STEM}_triton{'.'.join(triton_version.split('.')[:2])}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], choices=(16, 32, 64, 128))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=("bfloat16", "float16"))
    p.add_argument("--slopes", nargs="+", default=list(SLOPES), choices=SLOPES)
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--bias-mode", choices=("table", "sqrt"), default="table")
    p.add_argument("--default-only", action="store_true", help="only the config used when autotuning is off")
    p.add_argument("--no-atomic-dq", action="store_true", help="skip the dK/dV kernel of the atomic-dQ backward")
    p.add_argument("--compare", type=Path, default=None,
                   help="results JSON of another Triton version, shown as a second column (default: the other "
                        f"{STEM}_triton*.json in the output folder, if any)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help=f"where {STEM}_triton<version>.{{md,json}} go (default: benchmarks/results/)")
    p.add_argument("--jobs", type=int, default=1, help="compile this many kernels at once (processes)")
    p.add_argument("--rerender", action="store_true",
                   help="compile nothing: rewrite the Markdown of this Triton's results file in --out-dir from its JSON, "
                        "with the other Triton's file as the second column (after that file changed)")
    p.add_argument("--merge-from", type=Path, default=None, metavar="JSON",
                   help="compile nothing: put the rows of JSON (a smaller run of the same Triton, e.g. one kernel "
                        "after a change to it) in place of the same cells of this Triton's results file in --out-dir, "
                        "keeping its other rows, and recompute the summary")
    p.add_argument("--smoke", action="store_true", help="not a measurement: write under benchmarks/results/smoke/")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be at least 1")
    return args


def _tool(name):
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: this Triton build ships no {name} (needed for SASS)")
    return str(path)


def slope_tensor(slopes: str, heads: int):
    """What a call with this slope kind hands the launch helpers: the cached unit slope of ``slopes=None``,
    or the ALiBi geometric sequence 2^(-8h/heads)."""
    import torch

    from kernels import alibi_triton as at

    if slopes == "constant":
        return at.unit_slope(torch.device("cpu"))
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


def _sample_call(kind, head_dim, dtype, table, slopes="constant", atomic_dq=False):
    """(raw jit function, positional args, constexpr kwargs) of one real launch, on CPU tensors. With
    ``atomic_dq`` the dK/dV kernel gets the fp32 dQ buffer the atomic-dQ backward adds into."""
    import torch

    from kernels import alibi_triton as at
    from kernels.alibi_bias import device_bias_lookup

    heads, n = WIDTH // head_dim, PREFIX + GRID[0] * GRID[1]
    geometry = GRID, device_bias_lookup(*GRID, PREFIX, True, True, table, torch.device("cpu"))
    qkv = torch.empty(1, n, 3, heads, head_dim, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # as timm's fused qkv projection hands them over
    slope = slope_tensor(slopes, heads)
    if kind == "fwd":
        args, kw = at._fwd_args(q, k, v, at._new_bnhd(q), torch.empty(1, heads, n), slope, geometry, True, table)
        return at._alibi_fwd_kernel, args, kw
    do, dk, dv = (at._new_bnhd(q) for _ in range(3))
    dq = at._new_bnhd(q, torch.float32 if atomic_dq else None)
    lse, delta = torch.empty(2, 1, heads, at.stat_stride(n)).unbind(0)  # the backward's padded statistics rows
    dkdv_args, dq_args, kw, pair = at._bwd_args(do, q, k, v, dq, dk, dv, lse, delta, torch.empty(1, heads, n), slope,
                                                geometry, True, table)
    kw = {**kw, "COMPUTE_DSLOPE": slopes == "learned" and kind == "bwd_dkdv"}
    if kind == "bwd_dkdv":
        return at._alibi_bwd_dkdv_kernel, dkdv_args, {**kw, "ATOMIC_DQ": atomic_dq}
    return at._alibi_bwd_dq_kernel, dq_args, {**kw, "HEAD_PAIR": pair}


def launch_configs(kind, head_dim, table, slopes, atomic_dq=False):
    """The configs the kernels offer this call, first the default (kernels.alibi_triton.gpu_launch_configs)."""
    from kernels import alibi_triton as at

    return at.gpu_launch_configs(_KERNEL_OF[kind], head_dim, table, atomic_dq=atomic_dq, learned=slopes == "learned")


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


def analyse(kind, variant, head_dim, dtype_name, cfg, default, bias_mode, workdir, slopes="constant",
            atomic_dq=False):
    import torch

    from kernels.compile_sm90 import compile_sm90

    fn, args, kw = _sample_call(kind, head_dim, getattr(torch, dtype_name), bias_mode == "table", slopes, atomic_dq)
    kw = {**kw, **cfg.kwargs, "HAS_BIAS": variant == "alibi", "num_warps": cfg.num_warps,
          "num_stages": cfg.num_stages, "enable_fp_fusion": True}
    if cfg.maxnreg is not None:
        kw["maxnreg"] = cfg.maxnreg
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
    return {"kernel": kind, "atomic_dq": atomic_dq, "slopes": slopes, "variant": variant, "bias_mode": bias_mode,
            "head_dim": head_dim, "dtype": dtype_name, "block_m": bm, "block_n": bn, "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "maxnreg": cfg.maxnreg, "table_mode": kw["TABLE"],
            "slope_gradient": bool(kw.get("COMPUTE_DSLOPE")), "heads_per_program": heads_per_program,
            "default": default, "main_loop_instructions": len(body),
            "instructions_per_element": round(len(body) * cfg.num_warps / scores, 4),
            "hgmma": units["hgmma"], "hmma": units["hmma"],
            "waits_per_hgmma": round(units["waits"] / units["hgmma"], 2) if units["hgmma"] else None,
            "ptxas_advisories": advisories, "serialized_wgmma": "C7515" in advisories,
            "spill_instructions_in_loop": units["spill"], "loop_global_loads": units["loads"],
            "mufu_per_element": round(units["mufu"] / scores, 4), "lsu_per_element": round(units["lsu"] / scores, 4),
            "cycles_per_element": cycles_per_score(units, scores),
            **usage, "shared_bytes": shared, "ctas_per_sm": ctas_per_sm(usage["registers"], cfg.num_warps, shared)}


def gather_pipelined(alibi: dict, nobias: dict):
    """Whether the loads the bias adds to the loop are all asynchronous copies (LDGSTS), None if it adds none."""
    extra = {k: alibi["loop_global_loads"][k] - nobias["loop_global_loads"][k] for k in ("LDG", "LDGSTS")}
    if extra["LDG"] <= 0 and extra["LDGSTS"] <= 0:
        return None
    return extra["LDG"] <= 0


def _pass_entry(rows_by_variant, goal):
    """One pass (the forward, or a backward's kernels summed): alibi / nobias of instructions per element and of
    the cycle bounds, and what the goals ask of its ALiBi kernels: no C7515, no spills, register headroom."""
    ipe = {v: sum(r["instructions_per_element"] for r in rows) for v, rows in rows_by_variant.items()}
    ratio = ipe["alibi"] / ipe["nobias"]
    alibi = rows_by_variant["alibi"]
    entry = {"alibi": round(ipe["alibi"], 4), "nobias": round(ipe["nobias"], 4), "ratio": round(ratio, 3),
             "goal": goal, "serialized_wgmma": sorted(_label(r) for r in alibi if r["serialized_wgmma"]),
             "spills": sorted(_label(r) for r in alibi if r["spill_bytes"] > 0),
             "register_headroom": MAX_REGISTERS - max(r["registers"] for r in alibi)}
    for bound in ("bound_serial", "bound_overlap"):
        cyc = {v: sum(r["cycles_per_element"][bound] for r in rows) for v, rows in rows_by_variant.items()}
        entry[bound] = {"alibi": round(cyc["alibi"], 5), "nobias": round(cyc["nobias"], 5),
                        "ratio": round(cyc["alibi"] / cyc["nobias"], 3)}
    entry["meets_goals"] = bool(ratio <= goal and not entry["serialized_wgmma"] and not entry["spills"]
                                and entry["register_headroom"] >= GOALS["register_headroom"])
    return entry


def summarise(rows, atomic_default=None):
    """Per (head_dim, dtype, slope kind): the default configs' alibi/nobias ratios of the forward and of both
    backwards (kernels summed) in instructions and in the serial and overlap cycle bounds, and the goals. The
    goals are judged on what runs without settings: the forward and the backward ``atomic_default(head_dim,
    dtype_name)`` picks (None: kernels.alibi_triton.atomic_dq_default); the two-kernel backward, the
    deterministic one, is judged apart. The learned slopes' forward is the per-head forward."""
    if atomic_default is None:
        import torch

        from kernels.alibi_triton import atomic_dq_default

        def atomic_default(d, dt):
            return atomic_dq_default(d, getattr(torch, dt))

    sel = {(r["head_dim"], r["dtype"], r["slopes"], r["kernel"], r["atomic_dq"], r["variant"]): r
           for r in rows if r["default"]}
    out = []
    for d, dt, sl in sorted({k[:3] for k in sel}, key=lambda k: (k[0], k[1], SLOPES.index(k[2]))):
        def get(kernel, atomic, variant, _sl=sl):
            fwd_slopes = "per-head" if (kernel == "fwd" and _sl == "learned") else _sl
            return (sel.get((d, dt, _sl, kernel, atomic, variant))
                    or sel.get((d, dt, fwd_slopes, kernel, atomic, variant)))

        entry = {"head_dim": d, "dtype": dt, "slopes": sl,
                 "default_backward": "atomic" if atomic_default(d, dt) else "two-kernel"}
        passes = {"fwd": (("fwd", False),), **{f"bwd_{name}": kernels for name, kernels in BACKWARDS.items()}}
        for part, kernels in passes.items():
            found = {v: [get(k, a, v) for k, a in kernels] for v in ("alibi", "nobias")}
            if all(r is not None for rs in found.values() for r in rs):
                entry[part] = _pass_entry(found, GOALS["fwd" if part == "fwd" else "bwd"])
        if "bwd_atomic" in entry and "bwd_two-kernel" in entry:
            entry["atomic_vs_two_kernel_serial"] = round(entry["bwd_atomic"]["bound_serial"]["alibi"]
                                                         / entry["bwd_two-kernel"]["bound_serial"]["alibi"], 3)
        judged = [entry[p] for p in ("fwd", "bwd_" + entry["default_backward"]) if p in entry]
        entry["judged"] = [p for p in ("fwd", "bwd_" + entry["default_backward"]) if p in entry]
        entry["serialized_wgmma"] = sorted({x for p in judged for x in p["serialized_wgmma"]})
        entry["spills"] = sorted({x for p in judged for x in p["spills"]})
        entry["register_headroom"] = min((p["register_headroom"] for p in judged), default=None)
        entry["meets_goals"] = bool(judged) and all(p["meets_goals"] for p in judged)
        if "bwd_two-kernel" in entry:
            entry["deterministic_meets_goals"] = entry["bwd_two-kernel"]["meets_goals"]
        pipelined = {}
        for kernel, atomic in (("fwd", False), *BACKWARDS["atomic"], *BACKWARDS["two-kernel"]):
            alibi, nobias = get(kernel, atomic, "alibi"), get(kernel, atomic, "nobias")
            if alibi is not None and nobias is not None:
                pipelined[_label(alibi)] = gather_pipelined(alibi, nobias)
        entry["gather_pipelined"] = pipelined
        fwd_row = get("fwd", False, "alibi")
        if fwd_row is not None:
            entry["fwd_ctas_per_sm"] = fwd_row["ctas_per_sm"]
        out.append(entry)
    return out


def _label(r):
    return f"{r['kernel']}{' (atomic dQ)' if r['atomic_dq'] else ''}"


def _cell(r) -> tuple:
    """The (head_dim, dtype, slopes, kernel, atomic dQ) a row measures, over all its launch configs."""
    return r["head_dim"], r["dtype"], r.get("slopes", "constant"), r["kernel"], bool(r.get("atomic_dq", False))


def coverage(rows_or_plan) -> set:
    """What a run covers: (head_dim, dtype, slopes, kernel, atomic dQ, "all" or "default" configs) of its rows or
    plan. Which configs a kernel offers changes with the kernel; the scope of a run does not."""
    groups = {}
    for r in rows_or_plan:
        key = _cell(r)
        groups[key] = groups.get(key, False) or not r["default"]
    return {(*key, "all" if every else "default") for key, every in groups.items()}


def plan(args):
    """The (kernel, atomic dQ, head_dim, dtype, slopes, config, is default) cells a run compiles, in order."""
    table = args.bias_mode == "table"
    cells = []
    for d in args.head_dims:
        for dtype in args.dtypes:
            for slopes in args.slopes:
                for kind in args.kernels:
                    if kind == "fwd" and slopes == "learned" and "per-head" in args.slopes:
                        continue  # the same kernel as the per-head forward
                    forms = (False, True) if kind == "bwd_dkdv" and not args.no_atomic_dq else (False,)
                    for atomic in forms:
                        configs = launch_configs(kind, d, table, slopes, atomic)
                        for i, cfg in enumerate(configs[:1] if args.default_only else configs):
                            cells.append((kind, atomic, d, dtype, slopes, cfg, i == 0))
    return cells


def _plan_rows(cells):
    return [{"kernel": k, "atomic_dq": a, "head_dim": d, "dtype": dt, "slopes": sl, "block_m": c.kwargs["BLOCK_M"],
             "block_n": c.kwargs["BLOCK_N"], "num_warps": c.num_warps, "num_stages": c.num_stages, "maxnreg": c.maxnreg,
             "default": default}
            for k, a, d, dt, sl, c, default in cells]


def smaller_than_existing(path: Path, cells) -> set:
    """What the results file at ``path`` covers that the planned run would not (empty: nothing is lost)."""
    if not path.is_file():
        return set()
    try:
        existing = coverage(json.loads(path.read_text())["rows"])
    except (ValueError, KeyError):
        return set()
    planned = coverage(_plan_rows(cells))
    return {c for c in existing if (*c[:5], "all") not in planned and c not in planned}


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


def _yes(flag):
    return "yes" if flag else "no"


def markdown(payload):
    other = payload.get("comparison")
    other_summary = {(s["head_dim"], s["dtype"], s.get("slopes", "constant")): s
                     for s in (other or {}).get("summary", [])}
    ot = f"triton {other['triton']}" if other else None
    state = "" if payload.get("complete", True) else " **Incomplete: the run was still going or was stopped.**"
    lines = ["# Fused ALiBi kernels: static sm_90 SASS analysis", "",
             f"`{payload['command']}`", "",
             f"**triton {payload['triton']}** (torch {payload['torch']}), {payload['date']}. Compiled for sm_90 "
             "without a GPU (Triton's ptxas); counts are per warp, cycles are bounds at H100 per-SM rates, not "
             "timings. `nobias` is the same kernel with the bias compiled out. Bias mode "
             f"`{payload['bias_mode']}`.{state}", ""]
    for m in payload.get("merged", []):
        cells = "; ".join(f"d={d} {dt} {sl} {k}{' (atomic dQ)' if a else ''}{'' if scope == 'all' else ' (default config)'}"
                          for d, dt, sl, k, a, scope in m["cells"])
        lines += [f"Re-measured later and merged in (`--merge-from`): {cells}, by `{m['command']}` (torch {m['torch']}, "
                  f"{m['date']}); the rest is from the run above.", ""]
    if other:
        lines += [f"Second column: {ot} (torch {other['torch']}, {other['date']}), read from its own results file.", ""]
    lines += ["## Default configs: alibi / nobias", "",
              "Warp-instructions per score element, ALiBi over the same kernels without bias (goals: forward ≤ "
              f"{GOALS['fwd']}×, backward ≤ {GOALS['bwd']}×; a backward sums its kernels: atomic dQ = one dK/dV "
              "kernel, two-kernel = dK/dV + dQ), the backward used by default and its serial bound against the "
              "other's. The goals (those ratios, no C7515, no spills, at least "
              f"{GOALS['register_headroom']} registers left under 255) are judged on the forward and the default "
              "backward; the two-kernel backward (the deterministic one) is judged apart.", "",
              "| head_dim | dtype | slopes | fwd | bwd atomic dQ | bwd two-kernel | default bwd | atomic / two-kernel "
              "(serial) | fwd / default bwd serial | C7515 | spills | register headroom | goals met | two-kernel "
              "goals met |" + (f" {ot}: fwd / atomic / two-kernel | {ot}: headroom, goals met |" if other else ""),
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if other else "")]

    def ratio(entry, part):
        return _fmt(entry.get(part, {}).get("ratio"))

    for s in payload["summary"]:
        default = s.get("bwd_" + s["default_backward"], {})
        cells = [s["head_dim"], s["dtype"], s["slopes"], ratio(s, "fwd"), ratio(s, "bwd_atomic"),
                 ratio(s, "bwd_two-kernel"), s["default_backward"], _fmt(s.get("atomic_vs_two_kernel_serial")),
                 f"{_fmt(s.get('fwd', {}).get('bound_serial', {}).get('ratio'))} / "
                 f"{_fmt(default.get('bound_serial', {}).get('ratio'))}",
                 ", ".join(s["serialized_wgmma"]) or "none", ", ".join(s["spills"]) or "none",
                 s["register_headroom"], _yes(s["meets_goals"]),
                 _yes(s["deterministic_meets_goals"]) if "deterministic_meets_goals" in s else ""]
        if other:
            o = other_summary.get((s["head_dim"], s["dtype"], s["slopes"]), {})
            cells += [f"{ratio(o, 'fwd')} / {ratio(o, 'bwd_atomic')} / {ratio(o, 'bwd_two-kernel')}",
                      f"{_fmt(o.get('register_headroom'))}, {_yes(o['meets_goals']) if 'meets_goals' in o else ''}"]
        lines.append("| " + " | ".join(_fmt(c) if not isinstance(c, str) else c for c in cells) + " |")
    lines += ["", "Bias gather pipelined (the loads the bias adds are asynchronous copies): " + "; ".join(
        f"d={s['head_dim']} {s['dtype']} {s['slopes']}: " + ", ".join(
            f"{k} {'yes' if v else ('no' if v is False else '-')}" for k, v in s["gather_pipelined"].items())
        for s in payload["summary"]) + ".", ""]
    lines += ["## Every kernel and config", "",
              "Per loop iteration: HGMMA / HMMA count, waits per HGMMA, ptxas advisories, spill instructions in the "
              "loop, global loads (LDG plain / LDGSTS asynchronous). Per score element: instructions, MUFU and LSU "
              "operations, and SM-cycles (tensor core, MUFU, issue, LSU; overlap and serial bounds). maxnreg: the "
              "config's register cap, if any.", "",
              "| kernel | slopes | variant | head_dim | dtype | tile (M×N) | heads | warps | stages | maxnreg | default | "
              "loop insts | insts/element | HGMMA | HMMA | waits/HGMMA | advisories | loop spills | LDG / LDGSTS | "
              "MUFU/el | LSU/el | tc | mufu | issue | lsu | overlap | serial | regs | spill B | smem B | CTAs/SM |",
              "|" + "---|" * 31]
    for r in payload["rows"]:
        c = r["cycles_per_element"]
        lines.append(f"| {_label(r)} | {r['slopes']} | {r['variant']} | {r['head_dim']} | {r['dtype']} | "
                     f"{r['block_m']}×{r['block_n']} | {r['heads_per_program']} | {r['num_warps']} | "
                     f"{r['num_stages']} | {r['maxnreg'] or '-'} | {'yes' if r['default'] else ''} | "
                     f"{r['main_loop_instructions']} | {r['instructions_per_element']} | {r['hgmma']} | {r['hmma']} | "
                     f"{_fmt(r['waits_per_hgmma'], 2)} | {', '.join(r['ptxas_advisories']) or '-'} | "
                     f"{r['spill_instructions_in_loop']} | {r['loop_global_loads']['LDG']} / "
                     f"{r['loop_global_loads']['LDGSTS']} | {r['mufu_per_element']} | {r['lsu_per_element']} | "
                     f"{c['tensor']:.4f} | {c['mufu']:.4f} | {c['issue']:.4f} | {c['lsu']:.4f} | "
                     f"{c['bound_overlap']:.4f} | {c['bound_serial']:.4f} | {r['registers']} | "
                     f"{r['spill_bytes']} | {r['shared_bytes']} | {r['ctas_per_sm']} |")
    return lines


def rerender(out_dir: Path, version: str, compare: Path | None):
    path = Path(out_dir) / f"{stem(version)}.json"
    if not path.is_file():
        raise SystemExit(f"bench_kernel_sass.py: no {path} to rerender")
    return _write_finished(out_dir, version, json.loads(path.read_text()), compare)


def _write_finished(out_dir: Path, version: str, payload: dict, compare: Path | None):
    """Write a payload that compiles nothing more, with the other Triton's results file as its second column."""
    comparison = find_comparison(out_dir, version, compare)
    lines = markdown({**payload, "comparison": comparison})
    if comparison:
        payload["comparison"] = {k: comparison[k] for k in ("triton", "torch", "date", "summary") if k in comparison}
    md, js = write_report(out_dir, stem(version), payload, lines)
    print(f"wrote {md} and {js}")
    return payload


def merge_rows(rows, new_rows):
    """``rows`` with the cells ``new_rows`` covers (head_dim, dtype, slopes, kernel, atomic dQ) replaced by those rows,
    each in the place of the first row it replaces; cells new to ``rows`` go at the end. A cell whose configs
    ``rows`` covers and ``new_rows`` does not (all configs there, the default only here) is an error."""
    old_scope = {c[:5]: c[5] for c in coverage(rows)}
    new_scope = {c[:5]: c[5] for c in coverage(new_rows)}
    narrower = sorted((c for c in new_scope if old_scope.get(c) == "all" and new_scope[c] == "default"), key=str)
    if narrower:
        raise ValueError(f"the new rows cover only the default config of {len(narrower)} cell(s) that the results "
                         f"file covers with all configs (e.g. {narrower[0]})")
    by_cell = {}
    for r in new_rows:
        by_cell.setdefault(_cell(r), []).append(r)
    out, placed = [], set()
    for r in rows:
        c = _cell(r)
        if c not in by_cell:
            out.append(r)
        elif c not in placed:  # the first row of a replaced cell: its new rows go here
            out += by_cell[c]
            placed.add(c)
    return out + [r for c, group in by_cell.items() if c not in placed for r in group]


def merge(out_dir: Path, version: str, source: Path, compare: Path | None):
    path = Path(out_dir) / f"{stem(version)}.json"
    if not path.is_file():
        raise SystemExit(f"bench_kernel_sass.py: no {path} to merge into")
    try:
        new = json.loads(Path(source).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"bench_kernel_sass.py: cannot read --merge-from {source}: {err}") from None
    payload = json.loads(path.read_text())
    for field in ("triton", "bias_mode", "target"):
        if new.get(field) != payload.get(field):
            raise SystemExit(f"bench_kernel_sass.py: {source} has {field} {new.get(field)!r}, {path} has "
                             f"{payload.get(field)!r}: only runs of the same setup merge")
    if not new.get("complete"):
        raise SystemExit(f"bench_kernel_sass.py: {source} is an incomplete run")
    try:
        payload["rows"] = merge_rows(payload["rows"], new["rows"])
    except ValueError as err:
        raise SystemExit(f"bench_kernel_sass.py: {err}") from None
    payload["summary"] = summarise(payload["rows"])
    payload.setdefault("merged", []).append(
        {**{k: new[k] for k in ("command", "torch", "date")}, "cells": sorted(map(list, coverage(new["rows"])))})
    return _write_finished(out_dir, version, payload, compare)


class _Inline:
    """An executor that runs each task when it is submitted (--jobs 1)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # re-raised by result(), as a pool would
            future.set_exception(err)
        return future


def _executor(jobs):
    if jobs == 1:
        return _Inline()
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=jobs)


def goal_failures(summary) -> list[str]:
    """One line per summary entry whose forward or default backward misses a goal."""
    out = []
    for s in summary:
        if s["meets_goals"]:
            continue
        if not s["judged"]:  # e.g. a run of one kernel, to merge into the full file
            out.append(f"d={s['head_dim']} {s['dtype']} {s['slopes']}: not judged, the run has neither the forward "
                       "nor every kernel of the default backward")
            continue
        why = []
        for part in s["judged"]:
            p = s[part]
            why += [f"{part} {p['ratio']} > {p['goal']}"] if p["ratio"] > p["goal"] else []
            why += [f"C7515 in {', '.join(p['serialized_wgmma'])}"] if p["serialized_wgmma"] else []
            why += [f"spills in {', '.join(p['spills'])}"] if p["spills"] else []
            if p["register_headroom"] < GOALS["register_headroom"]:
                why.append(f"{part}: {MAX_REGISTERS - p['register_headroom']} registers")
        out.append(f"d={s['head_dim']} {s['dtype']} {s['slopes']}: " + "; ".join(why))
    return out


def main(argv=None):
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("bench_kernel_sass.py compiles real kernels: unset TRITON_INTERPRET")
    os.environ["ALIBI_TRITON_AUTOTUNE"] = "0"  # only the config lists are read; nothing is launched
    try:
        _tool("cuobjdump")
        _tool("ptxas")
        import torch
        import triton
    except (FileNotFoundError, ImportError) as err:
        raise SystemExit(f"bench_kernel_sass.py: {err}") from None
    out_dir = args.out_dir if args.out_dir is not None else (RESULTS / "smoke" if args.smoke else RESULTS)
    if args.rerender:
        return rerender(out_dir, triton.__version__, args.compare)
    if args.merge_from is not None:
        return merge(out_dir, triton.__version__, args.merge_from, args.compare)
    cells = plan(args)
    lost = smaller_than_existing(Path(out_dir) / f"{stem(triton.__version__)}.json", cells)
    if lost:
        raise SystemExit(f"bench_kernel_sass.py: {out_dir}/{stem(triton.__version__)}.json covers {len(lost)} "
                         "kernel/config cells this run would not (e.g. "
                         f"{sorted(lost, key=str)[0]}); write elsewhere with --out-dir")
    comparison = find_comparison(out_dir, triton.__version__, args.compare)
    payload = {"command": command_line("bench_kernel_sass.py", sys.argv[1:] if argv is None else argv),
               **environment(), "target": "sm_90", "bias_mode": args.bias_mode, "smoke": args.smoke,
               "grid": list(GRID), "num_prefix_tokens": PREFIX, "rates_per_sm_clock": RATES, "goals": GOALS,
               "complete": False, "summary": [], "rows": []}
    rows, memo = [], {}

    def write():
        payload["summary"] = summarise(rows)
        payload["rows"] = rows
        lines = markdown({**payload, "comparison": comparison})
        if comparison:
            payload["comparison"] = {k: comparison[k] for k in ("triton", "torch", "date", "summary") if k in comparison}
        return write_report(out_dir, stem(triton.__version__), payload, lines)

    def key(kind, atomic, variant, d, dtype, slopes, cfg):
        # The kernel a cell compiles: its constexprs and config (another slope kind may compile the same one,
        # e.g. every bias-free build).
        _, _, kw = _sample_call(kind, d, getattr(torch, dtype), args.bias_mode == "table", slopes, atomic)
        return (kind, atomic, variant, d, dtype, tuple(sorted(kw.items())),
                (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages, cfg.maxnreg))

    groups = {}  # (head_dim, dtype) -> cells, in plan order
    for cell in cells:
        groups.setdefault(cell[2:4], []).append(cell)
    with tempfile.TemporaryDirectory() as workdir, _executor(args.jobs) as pool:
        for n_group, group in enumerate(groups.values()):
            if n_group:
                write()  # after every head_dim and dtype: a stopped run keeps what it measured
            todo = {}
            for kind, atomic, d, dtype, slopes, cfg, default in group:
                for variant in ("alibi", "nobias"):
                    k = key(kind, atomic, variant, d, dtype, slopes, cfg)
                    if k not in memo and k not in todo:
                        todo[k] = pool.submit(analyse, kind, variant, d, dtype, cfg, default, args.bias_mode,
                                              tempfile.mkdtemp(dir=workdir), slopes, atomic)
            memo.update({k: future.result() for k, future in todo.items()})
            for kind, atomic, d, dtype, slopes, cfg, default in group:
                for variant in ("alibi", "nobias"):
                    row = {**memo[key(kind, atomic, variant, d, dtype, slopes, cfg)], "slopes": slopes,
                           "default": default}
                    rows.append(row)
                    c = row["cycles_per_element"]
                    print(f"{_label(row):20s} {slopes:8s} {variant:6s} d={d} {dtype:8s} {row['block_m']}x"
                          f"{row['block_n']} w{row['num_warps']} s{row['num_stages']}"
                          f"{' r' + str(cfg.maxnreg) if cfg.maxnreg else ''}: {row['main_loop_instructions']} insts, "
                          f"{row['instructions_per_element']}/elem, HGMMA {row['hgmma']} HMMA {row['hmma']}, "
                          f"advisories {row['ptxas_advisories'] or '-'}, serial {c['bound_serial']}, "
                          f"{row['registers']} regs, spill {row['spill_bytes']}, {row['ctas_per_sm']} CTA/SM", flush=True)
    payload["complete"] = True
    md, js = write()
    print(f"wrote {md} and {js}")
    failures = goal_failures(payload["summary"])
    for line in failures:
        print("goal missed:", line)
    if failures:
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    main()
