"""Benchmark ALiBi attention backends on a CUDA device.

For ViT-S/B/L head counts (6/12/16 heads, head_dim 64), 5 prefix tokens (CLS + 4 registers)
and patch 14, images of 224/518/1036/2072 px give N = 261, 1374, 5334, 21909 tokens. The
batch per size is ``B = max(1, round(tokens / N))`` (``--tokens``, default 65536), so every
size moves about the same number of tokens and fills the GPU. For each backend, mode
(``fwd``, ``fwd+bwd``) and size it records the time (``triton.testing.do_bench``, after a
warm-up that also covers compilation and autotuning), TFLOP/s (4·B·H·N²·D for the forward,
3.5× that for forward+backward) and peak memory beyond the inputs, and the largest absolute
difference of the forward output from SDPA with the materialised bias (a sanity check).

Backends: ``triton`` (fused kernel, difference-table bias), ``triton-atomic-dq`` (the same with
the opt-in atomic dQ backward), ``triton-sqrt`` (fused kernel, per-element sqrt), ``flex`` (compiled FlexAttention with the score_mod), ``sdpa-bias``
(SDPA with the materialised (N, N) bias), ``sdpa-nobias`` (SDPA without bias: the ceiling),
each also pinned to one SDPA kernel (``sdpa-nobias-flash``, ``-cudnn``, ``-efficient``;
``sdpa-bias-cudnn``, ``-efficient``; the row's ``sdpa_backend`` names it, "default" where torch
chose), and ``eager`` (explicit softmax, where it fits). A pinned kernel the device or dtype
lacks is reported as an error row. Out-of-memory is reported as "OOM".

Results go to ``benchmarks/results/attention_<device-slug>.{md,json}``.

    python benchmarks/bench_attention.py                      # full sweep, bf16
    python benchmarks/bench_attention.py --models vit-s --sizes 518 --modes fwd
    python benchmarks/bench_attention.py --smoke              # CPU, tiny shapes: checks the script runs
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import command_line, environment, slug, write_report  # noqa: E402

MODELS = {"vit-s": 6, "vit-b": 12, "vit-l": 16}
SIZES = (224, 518, 1036, 2072)
# SDPA pinned to one kernel with torch.nn.attention.sdpa_kernel (the unpinned names let torch choose;
# on Hopper torch >= 2.10 may choose cuDNN). Flash takes no arbitrary mask, hence no sdpa-bias-flash.
SDPA_PINNED = {"sdpa-nobias-flash": "FLASH_ATTENTION", "sdpa-nobias-cudnn": "CUDNN_ATTENTION",
               "sdpa-nobias-efficient": "EFFICIENT_ATTENTION", "sdpa-bias-cudnn": "CUDNN_ATTENTION",
               "sdpa-bias-efficient": "EFFICIENT_ATTENTION"}
TRITON_VARIANTS = ("triton", "triton-atomic-dq", "triton-sqrt")
BACKENDS = (*TRITON_VARIANTS, "flex", "sdpa-bias", "sdpa-nobias", *SDPA_PINNED, "eager")
SMOKE_BACKENDS = ("triton", "triton-atomic-dq", "sdpa-bias", "sdpa-nobias", "eager")
MODES = ("fwd", "fwd+bwd")
PATCH, PREFIX, HEAD_DIM = 14, 5, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="image side in px (patch 14)")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per batch: B = max(1, round(tokens / N))")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench measurement, ms")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the .md and .json go (default: benchmarks/results/, smoke runs: benchmarks/results/smoke/)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU only, tiny shapes, eager/sdpa/triton (interpreter), fp32: checks that the script runs")
    return p.parse_args(argv)


def backend_fns(names, grid, slopes=None):
    """name -> f(q, k, v) for the requested backends (imports lazily: triton reads its env on import)."""
    import torch.nn.functional as F

    from kernels.attention import eager_alibi_attention, sdpa_alibi_attention

    fns = {}
    for name in names:
        if name in TRITON_VARIANTS:
            from kernels.alibi_triton import triton_alibi_attention
            mode = "sqrt" if name == "triton-sqrt" else "table"
            fns[name] = (lambda q, k, v, _m=mode: triton_alibi_attention(q, k, v, grid, PREFIX, slopes, True, True,
                                                                         bias_mode=_m))
        elif name == "flex":
            from kernels.alibi_flex import flex_alibi_attention
            fns[name] = lambda q, k, v: flex_alibi_attention(q, k, v, grid, PREFIX, slopes, True, True)
        elif name == "sdpa-bias":
            fns[name] = lambda q, k, v: sdpa_alibi_attention(q, k, v, grid, PREFIX, slopes, True, True)
        elif name == "sdpa-nobias":
            fns[name] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
        elif name in SDPA_PINNED:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernel = getattr(SDPBackend, SDPA_PINNED[name])
            if name.startswith("sdpa-bias"):
                def fn(q, k, v, _kernel=kernel):
                    with sdpa_kernel(_kernel):
                        return sdpa_alibi_attention(q, k, v, grid, PREFIX, slopes, True, True)
            else:
                def fn(q, k, v, _kernel=kernel):
                    with sdpa_kernel(_kernel):
                        return F.scaled_dot_product_attention(q, k, v)
            fns[name] = fn
        elif name == "eager":
            fns[name] = lambda q, k, v: eager_alibi_attention(q, k, v, grid, PREFIX, slopes, True, True)
    return fns


def backend_context(name):
    """The context a backend's calls (backward included) run in: atomic dQ on for ``triton-atomic-dq``, off
    for the other triton variants, nothing for the rest."""
    if name not in TRITON_VARIANTS:
        return contextlib.nullcontext()
    from kernels.alibi_triton import atomic_dq

    return atomic_dq(name == "triton-atomic-dq")


def cuda_timer(warmup, rep):
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=warmup, rep=rep)


def cpu_timer(fn, iters=1):
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def run(args):
    import torch

    from kernels.alibi_bias import cached_alibi_bias

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    names = args.backends or (SMOKE_BACKENDS if args.smoke else BACKENDS)
    if args.smoke:
        names = [n for n in names if n in SMOKE_BACKENDS]
        models = {"tiny": 2}
        sizes, head_dim, batch_of = (70,), 32, (lambda n: 2)
        timer = cpu_timer
    else:
        models = {m: MODELS[m] for m in args.models}
        sizes, head_dim = args.sizes, HEAD_DIM
        batch_of = lambda n: max(1, round(args.tokens / n))  # noqa: E731
        timer = cuda_timer(args.warmup, args.rep)

    rows = []
    for model, heads in models.items():
        for px in sizes:
            side = px // PATCH
            grid, n = (side, side), PREFIX + side * side
            bsz = batch_of(n)
            gen = torch.Generator(device="cpu").manual_seed(0)
            q, k, v, dout = (torch.randn(bsz, heads, n, head_dim, generator=gen).to(device, dtype) for _ in range(4))
            # Compiled flex specialises on every shape: without a reset the sweep (3 models × 4 sizes)
            # would pass torch's recompile limit and time flex's unfused eager fallback instead.
            torch._dynamo.reset()
            fns = backend_fns(names, grid)
            reference = None
            if "fwd" in args.modes:
                try:  # the sanity reference every backend's forward output is compared with
                    with torch.no_grad():
                        reference = backend_fns(["sdpa-bias"], grid)["sdpa-bias"](q, k, v).float()
                except torch.cuda.OutOfMemoryError:
                    reference = None
                finally:
                    cached_alibi_bias.cache_clear()
            for mode in args.modes:
                for name, fn in fns.items():
                    if mode == "fwd" and name == "triton-atomic-dq":
                        continue  # its forward is triton's
                    row = dict(model=model, heads=heads, image_px=px, grid=list(grid), N=n, batch=bsz, mode=mode,
                               backend=name, ms=None, tflops=None, peak_mib=None, extra_mib=None,
                               max_abs_diff_vs_sdpa_bias=None, status="ok",
                               sdpa_backend=(SDPA_PINNED.get(name, "default") if name.startswith("sdpa") else None))
                    leaves = [t.detach().requires_grad_(mode == "fwd+bwd") for t in (q, k, v)]
                    if mode == "fwd":
                        def call(fn=fn, leaves=leaves):
                            with torch.no_grad():
                                return fn(*leaves)
                    else:
                        def call(fn=fn, leaves=leaves, name=name):
                            with backend_context(name):
                                return torch.autograd.grad(fn(*leaves), leaves, dout)
                    try:
                        first = call()  # compile / autotune / build tables before anything is measured
                        if mode == "fwd" and reference is not None:
                            row["max_abs_diff_vs_sdpa_bias"] = (first.float() - reference).abs().max().item()
                        del first
                        if device == "cuda":
                            cached_alibi_bias.cache_clear()  # count the materialised bias in the peak
                            torch.cuda.synchronize()
                            torch.cuda.empty_cache()
                            torch.cuda.reset_peak_memory_stats()
                            base = torch.cuda.memory_allocated()
                            call()
                            torch.cuda.synchronize()
                            peak = torch.cuda.max_memory_allocated()
                            row["peak_mib"] = round(peak / 2**20, 1)
                            row["extra_mib"] = round((peak - base) / 2**20, 1)
                        ms = timer(call)
                        flops = 4.0 * bsz * heads * n * n * head_dim * (3.5 if mode == "fwd+bwd" else 1.0)
                        row.update(ms=round(ms, 4), tflops=round(flops / (ms * 1e-3) / 1e12, 2))
                    except torch.cuda.OutOfMemoryError:
                        row["status"] = "OOM"
                    except Exception as exc:  # one failing backend must not end the sweep
                        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
                        row["status"] = f"error: {type(exc).__name__}: {first_line}"
                    finally:
                        if device == "cuda":
                            cached_alibi_bias.cache_clear()
                            torch.cuda.empty_cache()
                    rows.append(row)
                    print(f"{model:6s} {px:5d}px N={n:6d} B={bsz:4d} {mode:8s} {name:12s} "
                          f"{row['ms'] if row['ms'] is not None else '-':>10} ms  "
                          f"{row['tflops'] if row['tflops'] is not None else '-':>8} TFLOP/s  "
                          f"peak {row['peak_mib'] if row['peak_mib'] is not None else '-'} MiB  {row['status']}",
                          flush=True)
            del reference
    return rows


def ratios(rows):
    """Per size and mode: time of each other backend divided by the triton variant's time."""
    out = []
    keyed = {}
    for r in rows:
        if r["ms"] is not None:
            keyed[(r["model"], r["image_px"], r["mode"], r["backend"])] = r["ms"]
    seen = []
    for r in rows:
        key = (r["model"], r["image_px"], r["mode"])
        if key not in seen:
            seen.append(key)
    for model, px, mode in seen:
        for variant in TRITON_VARIANTS:
            t = keyed.get((model, px, mode, variant))
            if t is None:
                continue
            entry = dict(model=model, image_px=px, mode=mode, triton_variant=variant)
            for other in ("sdpa-nobias", "flex", "sdpa-bias"):
                t_other = keyed.get((model, px, mode, other))
                # > 1: triton is faster; for sdpa-nobias this is the fraction of the no-bias ceiling.
                entry[f"speed_vs_{other}"] = round(t_other / t, 3) if t_other is not None else None
            # The true ceiling: the fastest SDPA kernel without bias, pinned or not.
            nobias = {b: keyed[(model, px, mode, b)] for b in ("sdpa-nobias", *SDPA_PINNED)
                      if b.startswith("sdpa-nobias") and (model, px, mode, b) in keyed}
            best = min(nobias, key=nobias.get) if nobias else None
            entry["best_sdpa_nobias"] = best
            entry["speed_vs_best_sdpa_nobias"] = round(nobias[best] / t, 3) if best else None
            out.append(entry)
    return out


def write_reports(args, rows, ratio_rows, meta):
    def fmt(x, nd=2):
        return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    lines = [f"# Attention benchmark: {meta['device']}", "",
             f"- command: `{meta['command']}`",
             f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, python {meta['python']}",
             f"- dtype {meta['dtype']}, head_dim {meta['head_dim']}, prefix tokens {PREFIX}, patch {PATCH}, "
             f"batch rule: {meta['batch_rule']}",
             "- TFLOP/s counts 4·B·H·N²·D for the forward and 3.5× that for forward+backward; "
             "extra MiB is peak memory beyond the inputs (includes the materialised bias for sdpa-bias/eager).",
             "",
             "| model | px | N | B | mode | backend | SDPA kernel | ms | TFLOP/s | peak MiB | extra MiB "
             "| max abs diff vs sdpa-bias | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['image_px']} | {r['N']} | {r['batch']} | {r['mode']} | {r['backend']} | "
                     f"{r['sdpa_backend'] or '-'} | {fmt(r['ms'], 3)} | {fmt(r['tflops'])} | {fmt(r['peak_mib'], 1)} | "
                     f"{fmt(r['extra_mib'], 1)} | "
                     f"{fmt(r['max_abs_diff_vs_sdpa_bias'], 4)} | {r['status']} |")
    lines += ["", "Speed ratios (other backend's time / triton's time; > 1 means triton is faster; "
              "against sdpa-nobias it is the fraction of the no-bias flash ceiling):", "",
              "| model | px | mode | triton variant | vs sdpa-nobias | vs fastest sdpa-nobias (which) | vs flex "
              "| vs sdpa-bias |",
              "|---|---|---|---|---|---|---|---|"]
    for e in ratio_rows:
        lines.append(f"| {e['model']} | {e['image_px']} | {e['mode']} | {e['triton_variant']} | "
                     f"{fmt(e['speed_vs_sdpa-nobias'], 3)} | {fmt(e['speed_vs_best_sdpa_nobias'], 3)} "
                     f"({e['best_sdpa_nobias'] or '-'}) | {fmt(e['speed_vs_flex'], 3)} | "
                     f"{fmt(e['speed_vs_sdpa-bias'], 3)} |")
    return write_report(args.out_dir, f"attention_{meta['device_slug']}",
                        {**meta, "rows": rows, "ratios": ratio_rows}, lines, smoke=args.smoke)


def main(argv=None):
    args = parse_args(argv)
    if args.smoke:
        # The interpreter must be chosen before triton is imported (first use of the triton backend).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA device; run with --smoke for a CPU check of the script.")
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    meta = dict(
        command=command_line("bench_attention.py", argv or sys.argv[1:]),
        device=device, device_slug=slug("cpu-smoke" if args.smoke else device), **environment(),
        dtype="float32" if args.smoke else args.dtype, head_dim=32 if args.smoke else HEAD_DIM,
        batch_rule="B = 2" if args.smoke else f"B = max(1, round({args.tokens} / N))",
        smoke=bool(args.smoke),
    )
    rows = run(args)
    ratio_rows = ratios(rows)
    md, js = write_reports(args, rows, ratio_rows, meta)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
