"""Static sm_90 (H100/H200) analysis of the fused ALiBi kernels, on a machine without a GPU.

Every fused kernel of ``kernels/alibi_triton.py`` (the forward, and the backward's dK/dV and dQ
kernels) is compiled for sm_90 with Triton's own ptxas, once as shipped (``alibi``) and once
with the bias compiled out by the kernels' ``HAS_BIAS`` constexpr (``nobias``), so the
comparison is like for like: same tiles, same loads, same softmax, only the bias differs. The
arguments are built by the same helpers the real launches use, with q, k, v as views of a
fused qkv projection (as in the model), so the compiler sees the same specialisations.

For each kernel, variant and launch config it records, from the SASS listing (``cuobjdump``
bundled with Triton):

- ``main_loop_instructions``: SASS instructions per warp in one iteration of the kernel's
  steady-state loop over key (forward, dQ) or query (dK/dV) tiles: the shortest loop that
  holds tensor-core instructions (the other copy of the dK/dV loop is the masked tail path);
- ``instructions_per_element``: that × num_warps / (BLOCK_M × BLOCK_N × heads_per_program),
  warp-instructions per score element; the backward's figure is the sum over its kernels.
  ``heads_per_program`` is 2 where a forward or dQ program computes two heads from one
  gathered bias tile (constant slopes, head_dim <= 64), else 1;
- ``registers``, ``spill_bytes`` (local memory per thread, from ``cuobjdump -res-usage``),
  ``shared_bytes`` and ``ctas_per_sm`` at the launch config (sm_90: 64K registers, 228 KiB
  shared memory with 1 KiB reserved per CTA, 64 warps and 32 CTAs per SM).

``default`` marks the config used when autotuning is off (``ALIBI_TRITON_AUTOTUNE=0``). The opt-in
atomic-dQ backward (``ALIBI_TRITON_ATOMIC_DQ=1``: the dK/dV kernel also adds dS·K into dQ, no dQ
kernel) is compiled at the default dK/dV config and reported apart, under ``atomic_dq``. These
are instruction counts, not timings: they predict relative cost only where both variants are
bound by the same unit. Results go to ``benchmarks/results/kernel_sass_sm90.{md,json}``.

    python benchmarks/bench_kernel_sass.py                   # d=64 and 128, bf16 and fp16, all configs
    python benchmarks/bench_kernel_sass.py --head-dims 64 --dtypes bfloat16 --default-only
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import command_line, environment, write_report  # noqa: E402

STEM = "kernel_sass_sm90"
# ViT-S/B/L keep head_dim 64; at 518 px with patch 14 and 5 prefix tokens N = 5 + 37·37.
GRID, PREFIX, WIDTH = (37, 37), 5, 768
KERNELS = ("fwd", "bwd_dkdv", "bwd_dq")
# sm_90 per-SM limits (CUDA occupancy rules).
SM90 = dict(regs=65536, reg_unit=256, max_warps=64, max_ctas=32, smem=228 * 1024, smem_reserved=1024)
GOALS = {"fwd": 1.25, "bwd": 1.35}


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
    p.add_argument("--out-dir", type=Path, default=None,
                   help=f"where {STEM}.{{md,json}} go (default: benchmarks/results/)")
    p.add_argument("--smoke", action="store_true", help="not a measurement: write under benchmarks/results/smoke/")
    return p.parse_args(argv)


def _tool(name):
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: this Triton build ships no {name} (needed for SASS)")
    return str(path)


def _sample_call(kind, head_dim, dtype, table):
    """(raw jit function, positional args, constexpr kwargs) of one real launch, on CPU tensors."""
    import torch

    from kernels import alibi_triton as at
    from kernels.alibi_bias import device_bias_lookup

    heads, n = WIDTH // head_dim, PREFIX + GRID[0] * GRID[1]
    geometry = GRID, device_bias_lookup(*GRID, PREFIX, True, True, table, torch.device("cpu"))
    qkv = torch.empty(1, n, 3, heads, head_dim, dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # as timm's fused qkv projection hands them over
    slopes = torch.ones(1)  # constant slopes (slopes=None, the paper's choice): one slope for all heads
    lse, delta = (torch.empty(1, heads, n) for _ in range(2))
    if kind == "fwd":
        args, kw = at._fwd_args(q, k, v, at._new_bnhd(q), lse, slopes, geometry, True, table)
        return at._alibi_fwd_kernel, args, kw
    do, dq, dk, dv = (at._new_bnhd(q) for _ in range(4))
    dkdv_args, dq_args, kw, pair = at._bwd_args(do, q, k, v, dq, dk, dv, lse, delta, torch.empty(1), slopes,
                                                geometry, True, table)
    kw = {**kw, "COMPUTE_DSLOPE": False}  # constant slopes (the paper's choice): no slope gradient
    if kind == "bwd_dkdv":
        return at._alibi_bwd_dkdv_kernel, dkdv_args, kw
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


def sass_main_loop(sass: str) -> int:
    """Instructions in the shortest loop (backward branch) that holds tensor-core (HGMMA/HMMA) instructions."""
    insns = [(int(a, 16), text) for a, text in _INSN.findall(sass)]
    loops = []
    for i, (addr, text) in enumerate(insns):
        m = _BRANCH.search(text)
        if m and int(m.group(1), 16) <= addr:
            body = [t for a, t in insns[:i + 1] if a >= int(m.group(1), 16)]
            if any("GMMA" in t or "HMMA" in t for t in body):
                loops.append(len(body))
    if not loops:
        raise ValueError("no loop with tensor-core instructions found in the SASS")
    return min(loops)


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

    fn, args, kw = _sample_call(kind, head_dim, getattr(torch, dtype_name), bias_mode == "table")
    if atomic_dq:
        kw = {**kw, "ATOMIC_DQ": True}
    kw = {**kw, **cfg.kwargs, "HAS_BIAS": variant == "alibi", "num_warps": cfg.num_warps,
          "num_stages": cfg.num_stages, "enable_fp_fusion": True}
    kernel = compile_sm90(fn, args, kw)
    cubin = Path(workdir) / f"{kind}_{variant}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    loop = sass_main_loop(sass)
    bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    heads_per_program = 2 if kw.get("HEAD_PAIR") else 1
    usage = resource_usage(cubin)
    shared = int(kernel.metadata.shared)
    return {"kernel": kind, "variant": variant, "bias_mode": bias_mode, "head_dim": head_dim, "dtype": dtype_name,
            "block_m": bm, "block_n": bn, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
            "heads_per_program": heads_per_program, "default": default, "main_loop_instructions": loop,
            "instructions_per_element": round(loop * cfg.num_warps / (bm * bn * heads_per_program), 4),
            **usage, "shared_bytes": shared, "ctas_per_sm": ctas_per_sm(usage["registers"], cfg.num_warps, shared),
            **({"atomic_dq": True} if atomic_dq else {})}


def summarise(rows):
    """Per (head_dim, dtype): default-config alibi/nobias ratios, forward and backward (kernels summed)."""
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
        if ("fwd", "alibi") in sel:
            entry["fwd_ctas_per_sm"] = sel[("fwd", "alibi")]["ctas_per_sm"]
        entry["spills"] = any(sel[key]["spill_bytes"] > 0 for key in sel if key[1] == "alibi")
        out.append(entry)
    return out


def summarise_atomic_dq(rows, atomic_rows):
    """Per (head_dim, dtype): the opt-in atomic-dQ backward (one dK/dV kernel that also adds dS·K into dQ)
    against the default two-kernel backward, both as alibi and nobias, warp-instructions per score element."""
    out = []
    for a in atomic_rows:
        if a["variant"] != "alibi":
            continue
        same = [r for r in rows if r["default"] and (r["head_dim"], r["dtype"]) == (a["head_dim"], a["dtype"])]
        two_kernel = {v: sum(r["instructions_per_element"] for r in same
                             if r["variant"] == v and r["kernel"] in ("bwd_dkdv", "bwd_dq"))
                      for v in ("alibi", "nobias")}
        nobias = next((r for r in atomic_rows if r["variant"] == "nobias"
                       and (r["head_dim"], r["dtype"]) == (a["head_dim"], a["dtype"])), None)
        entry = {"head_dim": a["head_dim"], "dtype": a["dtype"], "atomic_alibi": a["instructions_per_element"],
                 "atomic_nobias": nobias and nobias["instructions_per_element"],
                 "two_kernel_alibi": round(two_kernel["alibi"], 4), "two_kernel_nobias": round(two_kernel["nobias"], 4)}
        if two_kernel["nobias"]:
            entry["atomic_alibi_vs_two_kernel_nobias"] = round(a["instructions_per_element"] / two_kernel["nobias"], 3)
        out.append(entry)
    return out


def markdown(payload):
    lines = ["# Fused ALiBi kernels: static sm_90 SASS analysis", "",
             f"`{payload['command']}`", "",
             f"torch {payload['torch']}, triton {payload['triton']}, {payload['date']}. Compiled for sm_90 without a "
             "GPU (Triton's ptxas); counts are per warp, not timings. `nobias` is the same kernel with the bias "
             f"compiled out. Bias mode `{payload['bias_mode']}`; constant slopes (no slope gradient).", "",
             "## Default configs: alibi / nobias warp-instructions per score element", "",
             "| head_dim | dtype | fwd alibi | fwd nobias | fwd ratio (goal ≤ 1.25) | bwd alibi | bwd nobias | "
             "bwd ratio (goal ≤ 1.35) | fwd CTAs/SM | spills |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in payload["summary"]:
        f, b = s.get("fwd", {}), s.get("bwd", {})
        lines.append(f"| {s['head_dim']} | {s['dtype']} | {f.get('alibi', '')} | {f.get('nobias', '')} | "
                     f"{f.get('ratio', '')} | {b.get('alibi', '')} | {b.get('nobias', '')} | {b.get('ratio', '')} | "
                     f"{s.get('fwd_ctas_per_sm', '')} | {'yes' if s['spills'] else 'no'} |")
    lines += ["", "## Every kernel and config", "",
              "| kernel | variant | head_dim | dtype | tile (M×N) | heads | warps | stages | default | loop insts | "
              "insts/element | regs | spill B | smem B | CTAs/SM |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        lines.append(f"| {r['kernel']} | {r['variant']} | {r['head_dim']} | {r['dtype']} | "
                     f"{r['block_m']}×{r['block_n']} | {r['heads_per_program']} | {r['num_warps']} | "
                     f"{r['num_stages']} | {'yes' if r['default'] else ''} | "
                     f"{r['main_loop_instructions']} | {r['instructions_per_element']} | {r['registers']} | "
                     f"{r['spill_bytes']} | {r['shared_bytes']} | {r['ctas_per_sm']} |")
    if payload.get("atomic_dq"):
        lines += ["", "## Opt-in atomic dQ (`ALIBI_TRITON_ATOMIC_DQ=1`), default dK/dV config", "",
                  "One dK/dV kernel that also adds dS·K into an fp32 dQ with atomic adds, against the default "
                  "backward (dK/dV kernel + dQ kernel), in warp-instructions per score element. Atomic adds are "
                  "memory traffic that instruction counts do not weigh: only a GPU timing can say which is faster.",
                  "", "| head_dim | dtype | atomic alibi | atomic nobias | two-kernel alibi | two-kernel nobias | "
                  "atomic alibi / two-kernel nobias | regs | spill B | CTAs/SM |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in payload["atomic_dq_summary"]:
            r = next(r for r in payload["atomic_dq"] if r["variant"] == "alibi"
                     and (r["head_dim"], r["dtype"]) == (s["head_dim"], s["dtype"]))
            lines.append(f"| {s['head_dim']} | {s['dtype']} | {s['atomic_alibi']} | {s['atomic_nobias']} | "
                         f"{s['two_kernel_alibi']} | {s['two_kernel_nobias']} | "
                         f"{s.get('atomic_alibi_vs_two_kernel_nobias', '')} | {r['registers']} | {r['spill_bytes']} | "
                         f"{r['ctas_per_sm']} |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("bench_kernel_sass.py compiles real kernels: unset TRITON_INTERPRET")
    os.environ["ALIBI_TRITON_AUTOTUNE"] = "0"  # only the config lists are read; nothing is launched
    try:
        _tool("cuobjdump")
        from kernels import alibi_triton as at
    except (FileNotFoundError, ImportError) as err:
        raise SystemExit(f"bench_kernel_sass.py: {err}") from None
    kinds = {"fwd": "fwd", "bwd_dkdv": "dkdv", "bwd_dq": "dq"}
    rows, atomic_rows = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for d in args.head_dims:
            for dtype in args.dtypes:
                for kind in args.kernels:
                    configs = at.gpu_launch_configs(kinds[kind], d, args.bias_mode == "table")
                    for i, cfg in enumerate(configs[:1] if args.default_only else configs):
                        for variant in ("alibi", "nobias"):
                            row = analyse(kind, variant, d, dtype, cfg, i == 0, args.bias_mode, workdir)
                            rows.append(row)
                            print(f"{kind:9s} {variant:6s} d={d} {dtype:8s} {row['block_m']}x{row['block_n']} "
                                  f"w{row['num_warps']} s{row['num_stages']}: {row['main_loop_instructions']} insts, "
                                  f"{row['instructions_per_element']}/elem, {row['registers']} regs, "
                                  f"spill {row['spill_bytes']}, {row['ctas_per_sm']} CTA/SM", flush=True)
                if "bwd_dkdv" in args.kernels and not args.no_atomic_dq:
                    cfg = at.gpu_launch_configs("dkdv", d, args.bias_mode == "table")[0]
                    for variant in ("alibi", "nobias"):
                        row = analyse("bwd_dkdv", variant, d, dtype, cfg, True, args.bias_mode, workdir,
                                      atomic_dq=True)
                        atomic_rows.append(row)
                        print(f"bwd_dkdv+atomic dQ {variant:6s} d={d} {dtype:8s}: {row['main_loop_instructions']} "
                              f"insts, {row['instructions_per_element']}/elem, {row['registers']} regs, "
                              f"spill {row['spill_bytes']}", flush=True)
    payload = {"command": command_line("bench_kernel_sass.py", sys.argv[1:] if argv is None else argv),
               **environment(), "target": "sm_90", "bias_mode": args.bias_mode, "smoke": args.smoke,
               "grid": list(GRID), "num_prefix_tokens": PREFIX, "summary": summarise(rows), "rows": rows,
               "atomic_dq": atomic_rows, "atomic_dq_summary": summarise_atomic_dq(rows, atomic_rows)}
    md, js = write_report(args.out_dir, STEM, payload, markdown(payload), smoke=args.smoke)
    print(f"wrote {md} and {js}")
    return payload


if __name__ == "__main__":
    main()
