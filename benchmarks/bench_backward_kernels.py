"""Each kernel of the fused attention's forward+backward, timed apart, per slope kind.

On an H100 the learned-slope backward ran 9-14 % faster than the constant- and per-head-slope ones
although it does more work (it also sums dL/dslope). Whole-call timings cannot say which kernel
differs; this driver times every kernel of one fwd+bwd with the torch profiler (CUDA time per call,
averaged over ``--calls`` calls after ``--warmup``), for each size and slope kind, in one process so
all rows share clocks and caches. ``--ncu`` instead runs exactly one fwd+bwd between
``cudaProfilerStart``/``Stop`` after the warm-up, for ``ncu --profile-from-start off`` to capture only
that call's kernels (benchmarks/gpu_suite.py's ``learned-ab`` phase runs both).

ViT-B heads (12), head_dim 64, 5 prefix tokens, patch 14, bf16, the batch rule of
benchmarks/bench_attention.py (``B = max(1, round(--tokens / N))``); the backward is the default
(``kernels.alibi_triton``'s atomic-dQ choice and backward bias mode), or as ``ALIBI_TRITON_*`` set it.

    python benchmarks/bench_backward_kernels.py                        # 518 and 1022 px, every slope kind
    python benchmarks/bench_backward_kernels.py --ncu --sizes 518 --slopes learned   # under ncu
    python benchmarks/bench_backward_kernels.py --smoke                # CPU, interpreter: checks the script
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import command_line, environment, slug, write_report  # noqa: E402

SLOPES = ("constant", "per-head", "learned")
PATCH, PREFIX, HEADS, HEAD_DIM = 14, 5, 12, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=int, default=[518, 1022], help="image side in px (patch 14)")
    p.add_argument("--slopes", nargs="+", choices=SLOPES, default=list(SLOPES))
    p.add_argument("--tokens", type=int, default=65536, help="tokens per batch: B = max(1, round(tokens / N))")
    p.add_argument("--warmup", type=int, default=3, help="untimed fwd+bwd calls first (compile, caches)")
    p.add_argument("--calls", type=int, default=20, help="profiled fwd+bwd calls per row")
    p.add_argument("--ncu", action="store_true",
                   help="one fwd+bwd per row between cudaProfilerStart/Stop, for ncu --profile-from-start off")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes: not a measurement")
    return p.parse_args(argv)


def make_call(px, slope_kind, args):
    """(one fwd+bwd call, batch, N) for an image side and slope kind."""
    import torch

    from kernels.alibi_triton import triton_alibi_attention

    device, dtype = ("cpu", torch.float16) if args.smoke else ("cuda", torch.bfloat16)
    side = px // PATCH
    grid, n = (side, side), PREFIX + side * side
    heads, head_dim = (2, 16) if args.smoke else (HEADS, HEAD_DIM)
    batch = 1 if args.smoke else max(1, round(args.tokens / n))
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, heads, n, head_dim, generator=gen).to(device, dtype) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    slopes = None
    if slope_kind != "constant":
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)
        slopes.requires_grad_(slope_kind == "learned")
    inputs = leaves + ([slopes] if slope_kind == "learned" else [])

    def call():
        out = triton_alibi_attention(*leaves, grid, PREFIX, slopes, True, True)
        return torch.autograd.grad(out, inputs, dout)
    return call, batch, n


def profile_kernels(call, calls, cuda):
    """{kernel name: (ms per call, launches per call)} over ``calls`` calls, by the torch profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        if cuda:  # kernels only: a CPU op's entry would count its kernels' time again
            if event.device_type != torch.autograd.DeviceType.CUDA or not event.device_time_total:
                continue
            total_us = event.device_time_total
        else:  # the interpreter's kernels run inside the ops' CPU time
            if not event.key.startswith("alibi_vit::"):
                continue
            total_us = event.cpu_time_total
        kernels[event.key] = (round(total_us / 1e3 / calls, 4), round(event.count / calls, 2))
    return dict(sorted(kernels.items(), key=lambda kv: -kv[1][0]))


def run(args):
    import torch

    cuda = not args.smoke
    rows = []
    for px in args.sizes:
        for slope_kind in args.slopes:
            call, batch, n = make_call(px, slope_kind, args)
            for _ in range(args.warmup):
                call()
            if cuda:
                torch.cuda.synchronize()
            row = dict(image_px=px, N=n, batch=batch, slopes=slope_kind)
            if args.ncu:
                if cuda:
                    torch.cuda.cudart().cudaProfilerStart()
                call()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.cudart().cudaProfilerStop()
                row["ncu"] = "one fwd+bwd profiled"
            else:
                row["kernels"] = {name: {"ms": ms, "launches": count}
                                  for name, (ms, count) in profile_kernels(call, args.calls, cuda).items()}
                row["total_ms"] = round(sum(k["ms"] for k in row["kernels"].values()), 4)
            print(f"{px:5d}px N={n:6d} B={batch:3d} {slope_kind:8s} "
                  + (row.get("ncu") or ", ".join(f"{name[:40]} {k['ms']:.3f} ms"
                                                 for name, k in list(row["kernels"].items())[:4])), flush=True)
            rows.append(row)
    return rows


def write_reports(args, rows, meta):
    lines = [f"# Fused attention kernels per slope kind: {meta['device']}", "",
             f"- command: `{meta['command']}`",
             f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; bf16, {HEADS} heads, head_dim "
             f"{HEAD_DIM}, prefix {PREFIX}; {args.calls} profiled fwd+bwd calls per row after {args.warmup} untimed",
             f"- settings: {meta['settings'] or 'defaults'}",
             "- ms: the kernel's CUDA time per fwd+bwd call (torch profiler); launches: per call", "",
             "| px | N | B | slopes | kernel | ms | launches | share |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for name, k in r.get("kernels", {}).items():
            share = k["ms"] / r["total_ms"] if r["total_ms"] else 0
            lines.append(f"| {r['image_px']} | {r['N']} | {r['batch']} | {r['slopes']} | {name[:70]} | {k['ms']:.4f} | "
                         f"{k['launches']} | {share:.0%} |")
    name = f"backward_kernels_{meta['device_slug']}"
    return write_report(args.out_dir, name, {**meta, "rows": rows}, lines, smoke=args.smoke)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        args.sizes, args.calls, args.warmup = [42], 1, 0
    import torch

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_backward_kernels.py needs a CUDA device; run with --smoke for a CPU check of the script.")
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    meta = dict(command=command_line("bench_backward_kernels.py", argv or sys.argv[1:]), device=device,
                device_slug=slug("cpu-smoke" if args.smoke else device), **environment(),
                settings={k: v for k, v in os.environ.items() if k.startswith("ALIBI_TRITON_")}, smoke=bool(args.smoke))
    rows = run(args)
    if args.ncu:
        return 0  # ncu writes the report
    md, js = write_reports(args, rows, meta)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
