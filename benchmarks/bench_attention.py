"""Benchmark ALiBi attention backends on a CUDA device.

For ViT-S/B/L head counts (6/12/16 heads, head_dim 64), 5 prefix tokens (CLS + 4 registers)
and patch 14, images of 224/518/1022/2072 px give N = 261, 1374, 5334, 21909 tokens. The
batch per size is ``B = max(1, round(tokens / N))`` (``--tokens``, default 65536), so every
size moves about the same number of tokens and fills the GPU.

Per (model, size, mode, slopes) every backend first passes a correctness check on the call it is
timed with (same shapes, so compiled and autotuned kernels are the timed ones): output and gradients
(q, k, v, and the slopes when learned; the upstream gradient is zero outside the slice) of one batch
element and two heads against an fp32 reference (explicit softmax, with the materialised bias for
biased backends, without for the bias-free baselines), as max |error| / max |reference| under a dtype
threshold (``TOLERANCE``); a backend that fails is reported as ``wrong`` and not timed. Then it records:

- time: ``triton.testing.do_bench`` medians with 20/80% quantiles, in ``--repeats`` rounds that
  interleave the backends (round r times every backend once), so drift in clocks or temperature
  hits all of them alike; ``ms`` is the median over rounds of the round medians, ``ms_rounds``
  lists them. do_bench flushes L2 before every call and includes host launch overhead; beside it
  ``ms_cudagraph`` (``triton.testing.do_bench_cudagraph``) replays the call from a CUDA graph, which
  removes host overhead (it matters at 224 px), or records why the call could not be captured;
- TFLOP/s (4·B·H·N²·D for the forward, 3.5× that for forward+backward);
- steady-state memory: ``resident_mib``, what a first call leaves allocated (the materialised
  bias of ``sdpa-bias``/``eager``, built once per grid and shared by all layers), and
  ``extra_mib``, the peak of a later call above the memory before the first (resident caches
  included, their one-time float64 build not);
- ``kernel``: the CUDA kernels a call launched whose names say which attention kernel ran
  (flash, cuDNN, memory-efficient, the fused ``_alibi_*`` kernels), from the torch profiler, for
  every SDPA and triton row.

Slopes (``--slopes``): ``constant`` (``slopes=None``: slope 1 for all heads, the paper's choice),
``per-head`` (the ALiBi geometric sequence, fixed) and ``learned`` (the same, requiring a gradient:
forward+backward also computes dL/dslope). Bias-free backends run once per size and mode.

Backends: ``triton`` (fused kernel, difference-table bias, the backward kernels.alibi_triton
picks by default), ``triton-atomic-dq`` and ``triton-two-kernel`` (the same forced to the atomic-dQ
or to the deterministic two-kernel backward), ``triton-sqrt`` (fused kernel, per-element sqrt),
``triton-sqrt-bwd`` and ``triton-table-bwd`` (difference-table forward; the backward forced to the
per-element sqrt or to the table gather, whatever the default picks),
``triton-nobias`` (the same fused kernels with the bias compiled out: the like-for-like ceiling),
``flex`` (FlexAttention with the sqrt score_mod), ``flex-table`` (with the difference-table
gather score_mod) and ``flex-dense`` (reading the materialised (N, N) bias), all compiled with ``mode="max-autotune-no-cudagraphs"`` so they are tuned like
the autotuned Triton kernels (``--flex-mode default``: without autotuning), ``flex-flash`` (the
sqrt score_mod on flex's FLASH backend, where the installed torch and flash-attn-4 have it), ``flex-nobias`` (flex without score_mod), ``sdpa-bias``
(SDPA with the materialised bias as the production ``sdpa`` backend passes it: (N, N) for constant
slopes, (1, H, N, N) per head, the shapes cuDNN takes), ``sdpa-nobias`` (SDPA without bias), each SDPA
also pinned to one kernel (``sdpa-nobias-flash``, ``-cudnn``, ``-efficient``; ``sdpa-bias-cudnn``,
``-efficient``, ``-math``), ``eager`` (explicit softmax, where it fits), and ``auto`` (the model's
default: on a GPU it times the fused kernel against SDPA with the bias once per kind of call,
:mod:`kernels.backend_choice`; its row says what it chose, and a table compares it with the fastest
other backend with the bias). A backend the device, dtype or
torch lacks is reported as an error row; out-of-memory as "OOM".

Results go to ``benchmarks/results/attention_<device-slug>[_<tag>].{md,json}`` (``--out-dir``,
``--tag``), rewritten after every (model, size, mode, slopes) group and marked incomplete until the
run ends, so a run stopped by a time limit keeps what it measured.

    python benchmarks/bench_attention.py                      # full sweep, bf16
    python benchmarks/bench_attention.py --models vit-s --sizes 518 --modes fwd
    python benchmarks/bench_attention.py --smoke              # CPU, tiny shapes: checks the script runs
    python benchmarks/bench_attention.py --smoke --backends triton flex flex-table --modes fwd  # Flex: eager, fwd
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from report import command_line, environment, error_status, slug, write_report  # noqa: E402

MODELS = {"vit-s": 6, "vit-b": 12, "vit-l": 16}
SIZES = (224, 518, 1022, 2072)
# SDPA pinned to one kernel with torch.nn.attention.sdpa_kernel (the unpinned names let torch choose;
# the row's `kernel` says what ran). Flash takes no arbitrary mask, hence no sdpa-bias-flash.
SDPA_PINNED = {"sdpa-nobias-flash": "FLASH_ATTENTION", "sdpa-nobias-cudnn": "CUDNN_ATTENTION",
               "sdpa-nobias-efficient": "EFFICIENT_ATTENTION", "sdpa-bias-cudnn": "CUDNN_ATTENTION",
               "sdpa-bias-efficient": "EFFICIENT_ATTENTION", "sdpa-bias-math": "MATH"}
# Variants that differ from "triton" in the backward only (their forward rows would repeat triton's).
BACKWARD_VARIANTS = ("triton-atomic-dq", "triton-two-kernel", "triton-sqrt-bwd", "triton-table-bwd")
TRITON_VARIANTS = ("triton", "triton-atomic-dq", "triton-two-kernel", "triton-sqrt", "triton-sqrt-bwd", "triton-table-bwd",
                   "triton-nobias")
FLEX_VARIANTS = ("flex", "flex-table", "flex-dense", "flex-flash", "flex-nobias")
BACKENDS = ("auto", *TRITON_VARIANTS, *FLEX_VARIANTS, "sdpa-bias", "sdpa-nobias", *SDPA_PINNED, "eager")
NOBIAS = ("triton-nobias", "flex-nobias", "sdpa-nobias", "sdpa-nobias-flash", "sdpa-nobias-cudnn",
          "sdpa-nobias-efficient")
SMOKE_BACKENDS = ("triton", "triton-atomic-dq", "triton-nobias", "sdpa-bias", "sdpa-nobias", "eager")
# What --smoke can run on the CPU when --backends names it: Flex eagerly and forward only (torch has no CPU
# flex backward); not the SDPA kernels pinned to CUDA implementations.
SMOKE_CAPABLE = ("auto", *TRITON_VARIANTS, "flex", "flex-table", "flex-dense", "flex-nobias", "sdpa-bias", "sdpa-nobias",
                 "sdpa-bias-math", "eager")
MODES = ("fwd", "fwd+bwd")
SLOPES = ("constant", "per-head", "learned")
PATCH, PREFIX, HEAD_DIM = 14, 5, 64
# Correctness threshold on max |error| / max |reference| (outputs and every gradient), by input dtype.
TOLERANCE = {"bfloat16": 4e-2, "float16": 1e-2, "float32": 1e-4}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="image side in px (patch 14)")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per batch: B = max(1, round(tokens / N))")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--slopes", nargs="+", choices=SLOPES, default=list(SLOPES))
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=None)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench measurement per round, ms")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the backends")
    p.add_argument("--no-cudagraph", action="store_true", help="skip the CUDA-graph timing")
    p.add_argument("--flex-mode", choices=FLEX_COMPILE_MODES, default=FLEX_COMPILE_MODES[0],
                   help="torch.compile mode of the flex backends (default: %(default)s; on an H100 one "
                        "autotuning step of the learned-slope backward took 191 s, so `default` is how those "
                        "rows fit a 10-minute command)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the .md and .json go (default: benchmarks/results/, smoke runs: benchmarks/results/smoke/)")
    p.add_argument("--tag", default=None, help="appended to the results' name: attention_<device>_<tag>.{md,json}")
    p.add_argument("--smoke", action="store_true",
                   help="CPU only, tiny shapes, eager/sdpa/triton (interpreter), fp32: checks that the script runs")
    return p.parse_args(argv)


def alibi_slopes(heads):
    """The ALiBi geometric sequence 2^(-8h/heads), h = 1..heads."""
    import torch

    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


_FLEX = {}


FLEX_COMPILE_MODES = ("max-autotune-no-cudagraphs", "default")


def _flex_compiled(variant, mode=FLEX_COMPILE_MODES[0]):
    """flex_attention as the benchmark runs it, compiled in ``mode`` (None: eager, as on a smoke run's CPU):
    "bias" (the sqrt score_mod), "table" (the difference-table score_mod), "flash" (the sqrt score_mod on
    flex's FLASH backend), "nobias" (no score_mod)."""
    import torch

    if (variant, mode) not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        from kernels.alibi_flex import _alibi_flex, _alibi_flex_dense, _alibi_flex_table

        if variant == "nobias":
            fn = lambda q, k, v: flex_attention(q, k, v)  # noqa: E731
        elif variant == "flash":
            def fn(q, k, v, head_scale, h, w, prefix, wrap):
                return _alibi_flex(q, k, v, head_scale, h, w, prefix, wrap, kernel_options={"BACKEND": "FLASH"})
        elif variant == "table":
            fn = _alibi_flex_table
        elif variant == "dense":
            fn = _alibi_flex_dense
        else:
            fn = _alibi_flex
        _FLEX[variant, mode] = torch.compile(fn, dynamic=False, mode=mode) if mode else fn
    return _FLEX[variant, mode]


def backend_fns(names, grid, flex_mode=FLEX_COMPILE_MODES[0]):
    """name -> f(q, k, v, slopes) for the requested backends (imports lazily: triton reads its env on import).
    ``slopes`` (heads,) or None is passed per call, so learned slopes receive a gradient. ``flex_mode``: how
    the flex backends are compiled (None: eager)."""
    import torch
    import torch.nn.functional as F

    from kernels.attention import eager_alibi_attention, sdpa_alibi_attention

    fns = {}
    for name in names:
        if name in TRITON_VARIANTS:
            from kernels.alibi_triton import triton_alibi_attention
            mode = "sqrt" if name == "triton-sqrt" else "table"
            fns[name] = (lambda q, k, v, s, _m=mode: triton_alibi_attention(q, k, v, grid, PREFIX, s, True, True,
                                                                            bias_mode=_m))
        elif name in ("flex", "flex-flash"):
            from kernels.alibi_bias import max_distance

            norm = 1.0 / max_distance(grid, True)

            def fn(q, k, v, s, _v="flash" if name == "flex-flash" else "bias"):
                scale = (torch.ones(q.shape[1], device=q.device) if s is None else s.float()) * norm
                return _flex_compiled(_v, flex_mode)(q, k, v, scale, grid[0], grid[1], PREFIX, True)
            fns[name] = fn
        elif name == "flex-table":
            from kernels.alibi_flex import table_arguments

            def fn(q, k, v, s):
                scale = torch.ones(q.shape[1], device=q.device) if s is None else s.float()
                return _flex_compiled("table", flex_mode)(q, k, v, scale,
                                                             *table_arguments(grid, PREFIX, True, True, q.device))
            fns[name] = fn
        elif name == "flex-dense":
            from kernels.attention import _shared_bias

            def fn(q, k, v, s):
                scale = torch.ones(q.shape[1], device=q.device) if s is None else s.float()
                bias = _shared_bias(grid, PREFIX, True, True, q.device, q.dtype)
                return _flex_compiled("dense", flex_mode)(q, k, v, scale, bias)
            fns[name] = fn
        elif name == "auto":
            from kernels.attention import alibi_attention

            fns[name] = lambda q, k, v, s: alibi_attention(q, k, v, grid, PREFIX, s)
        elif name == "flex-nobias":
            fns[name] = lambda q, k, v, s: _flex_compiled("nobias", flex_mode)(q, k, v)
        elif name == "sdpa-bias":
            fns[name] = lambda q, k, v, s: sdpa_alibi_attention(q, k, v, grid, PREFIX, s, True, True)
        elif name == "sdpa-nobias":
            fns[name] = lambda q, k, v, s: F.scaled_dot_product_attention(q, k, v)
        elif name in SDPA_PINNED:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            kernel = getattr(SDPBackend, SDPA_PINNED[name])
            if name.startswith("sdpa-bias"):
                def fn(q, k, v, s, _kernel=kernel):
                    with sdpa_kernel(_kernel):
                        return sdpa_alibi_attention(q, k, v, grid, PREFIX, s, True, True)
            else:
                def fn(q, k, v, s, _kernel=kernel):
                    with sdpa_kernel(_kernel):
                        return F.scaled_dot_product_attention(q, k, v)
            fns[name] = fn
        elif name == "eager":
            fns[name] = lambda q, k, v, s: eager_alibi_attention(q, k, v, grid, PREFIX, s, True, True)
    return fns


def backend_context(name):
    """The context a backend's calls (backward included) run in: atomic dQ on for ``triton-atomic-dq``, off for
    ``triton-two-kernel``, the default choice for the other triton variants, the bias compiled out for
    ``triton-nobias``, the backward's bias mode for ``triton-sqrt-bwd``/``triton-table-bwd``, nothing for the rest."""
    if name not in TRITON_VARIANTS:
        return contextlib.nullcontext()
    from kernels.alibi_triton import atomic_dq, backward_bias, bias_compiled_out

    stack = contextlib.ExitStack()
    stack.enter_context(atomic_dq({"triton-atomic-dq": True, "triton-two-kernel": False}.get(name)))
    if name == "triton-nobias":
        stack.enter_context(bias_compiled_out())
    if name in ("triton-sqrt-bwd", "triton-table-bwd"):
        stack.enter_context(backward_bias(name.split("-")[1]))
    return stack


def relative_error(got, ref):
    return ((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def check(name, fn, q, k, v, slopes, grid, dout, with_grad, dtype_name, with_bias=None):
    """Max relative error of the output and gradients of one batch element and two heads of the timed call
    (the full inputs) against an fp32 explicit-softmax reference on that slice; the upstream gradient is
    zero elsewhere, so the slopes' gradient is the slice's too. Returns (worst error, per-tensor errors).
    with_bias: whether the reference has the bias (default: unless ``name`` is one of NOBIAS)."""
    import torch

    from kernels.alibi_bias import alibi_bias

    sl = (lambda t: t[:1, :2].detach())  # noqa: E731
    # Forward only: the very tensors the timed call gets (their strides too); with gradients, leaves of their own.
    leaves = [t.detach().clone().requires_grad_() if with_grad else t.detach() for t in (q, k, v)]
    s = None if slopes is None else slopes.detach().clone().requires_grad_(slopes.requires_grad)
    ref_leaves = [sl(t).float().clone().requires_grad_(with_grad) for t in (q, k, v)]
    s_ref = None if s is None else s[:2].detach().float().clone().requires_grad_(s.requires_grad)
    with backend_context(name), torch.set_grad_enabled(with_grad):
        out = fn(*leaves, s)
        scores = ref_leaves[0] @ ref_leaves[1].transpose(-2, -1) / math.sqrt(q.shape[-1])
        if with_bias is None:
            with_bias = name not in NOBIAS
        if with_bias:
            bias = alibi_bias(grid, PREFIX, wrap=True, normalize=True, device=q.device, dtype=torch.float32)
            m = torch.ones(2, device=q.device) if s_ref is None else s_ref
            scores = scores + m.view(1, -1, 1, 1) * bias
        ref = scores.softmax(-1) @ ref_leaves[2]
        errors = {"out": relative_error(sl(out), ref)}
        if with_grad:
            inputs, ref_inputs = list(leaves), list(ref_leaves)
            if s is not None and s.requires_grad and with_bias:
                inputs.append(s)
                ref_inputs.append(s_ref)
            upstream = torch.zeros_like(dout)
            upstream[:1, :2] = dout[:1, :2]
            grads = torch.autograd.grad(out, inputs, upstream)
            ref_grads = torch.autograd.grad(ref, ref_inputs, sl(dout).float())
            for label, g, r in zip(("dq", "dk", "dv", "dslopes"), grads, ref_grads):
                errors[label] = relative_error(g[:2] if label == "dslopes" else sl(g), r)
    return max(errors.values()), {key: round(val, 6) for key, val in errors.items()}


def attention_kernels(call):
    """Names of the CUDA kernels one call launched that look like attention kernels (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
    names = {e.key for e in prof.key_averages()}
    keys = ("flash", "fmha", "cudnn", "efficient", "mem_eff", "attention", "triton", "sdpa", "alibi")
    return sorted(n for n in names if any(k in n.lower() for k in keys))[:6]


def auto_choice_of(shape, slope_kind, mode):
    """What ``backend="auto"`` chose for calls of this shape, slope kind and mode, and why."""
    from kernels import backend_choice

    for kind, choice in reversed(list(backend_choice.chooser().choices.items())):
        if kind.shape == tuple(shape) and kind.slopes == slope_kind and kind.backward == (mode == "fwd+bwd"):
            return {"backend": choice.backend, "how": choice.how, "reason": choice.reason,
                    "times_ms": choice.times_ms, "excluded": choice.excluded}
    return None


def gpu_timer(warmup, rep):
    import triton.testing

    return lambda fn: tuple(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8]))


def cpu_timer(fn, iters=1):
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    t = (time.perf_counter() - start) / iters * 1e3
    return t, t, t


def cudagraph_time(fn, rep):
    import torch
    import triton.testing

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # do_bench_cudagraph captures on a side stream
        return triton.testing.do_bench_cudagraph(fn, rep=rep, quantiles=[0.5, 0.2, 0.8])


def run(args, progress=lambda rows: None):
    """Every row of the sweep; ``progress(rows)`` after each (model, size, mode, slopes) group."""
    import torch

    from kernels.alibi_bias import cached_alibi_bias

    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else getattr(torch, args.dtype)
    dtype_name = "float32" if args.smoke else args.dtype
    names = args.backends or (SMOKE_BACKENDS if args.smoke else BACKENDS)
    if args.smoke:
        names = [n for n in names if n in SMOKE_CAPABLE]
        models = {"tiny": 2}
        sizes, head_dim, batch_of = (70,), 32, (lambda n: 2)
        timer, repeats = cpu_timer, 1
    else:
        models = {m: MODELS[m] for m in args.models}
        sizes, head_dim = args.sizes, HEAD_DIM
        batch_of = lambda n: max(1, round(args.tokens / n))  # noqa: E731
        timer, repeats = gpu_timer(args.warmup, args.rep), max(1, args.repeats)

    rows = []
    for model, heads in models.items():
        for px in sizes:
            side = px // PATCH
            grid, n = (side, side), PREFIX + side * side
            bsz = batch_of(n)
            gen = torch.Generator(device="cpu").manual_seed(0)
            q, k, v, dout = (torch.randn(bsz, heads, n, head_dim, generator=gen).to(device, dtype) for _ in range(4))
            # Compiled flex specialises on every shape: without a reset the sweep would pass torch's
            # recompile limit and time flex's unfused eager fallback instead.
            torch._dynamo.reset()
            _FLEX.clear()
            fns = backend_fns(names, grid, flex_mode=None if args.smoke else args.flex_mode)
            for mode in args.modes:
                for slope_kind in args.slopes:
                    if slope_kind == "learned" and mode == "fwd":
                        continue  # a forward does not know whether slopes are learned
                    slopes = None if slope_kind == "constant" else alibi_slopes(heads).to(device)
                    learned = slope_kind == "learned"
                    entries, first = [], len(rows)
                    for name, fn in fns.items():
                        if ((mode == "fwd" and name in BACKWARD_VARIANTS)
                                or (name in NOBIAS and slope_kind != "constant")):
                            continue  # their forward is triton's; bias-free backends ignore slopes
                        row = dict(model=model, heads=heads, image_px=px, grid=list(grid), N=n, batch=bsz, mode=mode,
                                   slopes=slope_kind if name not in NOBIAS else None, backend=name, ms=None,
                                   ms_p20=None, ms_p80=None, ms_rounds=[], ms_cudagraph=None, cudagraph_status=None,
                                   tflops=None, resident_mib=None, extra_mib=None, errors=None, status="ok",
                                   sdpa_backend=(SDPA_PINNED.get(name, "default") if name.startswith("sdpa") else None),
                                   kernel=None, auto_choice=None)
                        leaves = [t.detach().requires_grad_(mode == "fwd+bwd") for t in (q, k, v)]
                        sl = None if slopes is None else slopes.detach().clone().requires_grad_(learned)
                        if mode == "fwd":
                            def call(fn=fn, leaves=leaves, sl=sl, name=name):
                                with torch.no_grad(), backend_context(name):
                                    return fn(*leaves, sl)
                        else:
                            inputs = leaves + ([sl] if learned and name not in NOBIAS else [])

                            def call(fn=fn, leaves=leaves, sl=sl, name=name, inputs=inputs):
                                with backend_context(name):
                                    return torch.autograd.grad(fn(*leaves, sl), inputs, dout)
                        try:
                            worst, row["errors"] = check(name, fn, q, k, v, sl, grid, dout, mode == "fwd+bwd",
                                                         dtype_name)
                            if not worst <= TOLERANCE[dtype_name]:
                                row["status"] = f"wrong: max relative error {worst:.3g} > {TOLERANCE[dtype_name]}"
                            else:
                                if device == "cuda":
                                    cached_alibi_bias.cache_clear()
                                    torch.cuda.synchronize()
                                    torch.cuda.empty_cache()
                                    base = torch.cuda.memory_allocated()
                                call()  # compile / autotune / build tables and caches
                                if device == "cuda":
                                    torch.cuda.synchronize()
                                    row["resident_mib"] = round((torch.cuda.memory_allocated() - base) / 2**20, 1)
                                    torch.cuda.reset_peak_memory_stats()
                                    call()  # steady state: caches in place, their one-time build not counted
                                    torch.cuda.synchronize()
                                    row["extra_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
                                    if name.startswith("sdpa") or name in ("triton", "triton-nobias", "auto"):
                                        row["kernel"] = attention_kernels(call)
                                if name == "auto":
                                    row["auto_choice"] = auto_choice_of(q.shape, slope_kind, mode)
                                entries.append((row, call))
                        except torch.cuda.OutOfMemoryError:
                            row["status"] = "OOM"
                        except Exception as exc:  # one failing backend must not end the sweep
                            row["status"] = error_status(exc)
                        rows.append(row)
                    # Interleaved rounds: round r times every backend once.
                    for _ in range(repeats):
                        for row, call in entries:
                            if not row["status"] == "ok":
                                continue
                            try:
                                row["ms_rounds"].append([round(x, 4) for x in timer(call)])
                            except torch.cuda.OutOfMemoryError:
                                row["status"] = "OOM"
                            except Exception as exc:
                                row["status"] = error_status(exc)
                    for row, call in entries:
                        if row["ms_rounds"] and row["status"] == "ok":
                            row["ms"] = statistics.median(r[0] for r in row["ms_rounds"])
                            row["ms_p20"] = statistics.median(r[1] for r in row["ms_rounds"])
                            row["ms_p80"] = statistics.median(r[2] for r in row["ms_rounds"])
                            flops = 4.0 * bsz * heads * n * n * head_dim * (3.5 if mode == "fwd+bwd" else 1.0)
                            row["tflops"] = round(flops / (row["ms"] * 1e-3) / 1e12, 2)
                            if device == "cuda" and not args.no_cudagraph:
                                try:
                                    row["ms_cudagraph"] = round(cudagraph_time(call, args.rep)[0], 4)
                                    row["cudagraph_status"] = "ok"
                                except Exception as exc:
                                    row["cudagraph_status"] = error_status(exc)
                    for row in rows[first:]:
                        print(f"{model:6s} {px:5d}px N={n:6d} B={bsz:4d} {mode:8s} {row['slopes'] or '-':8s} "
                              f"{row['backend']:18s} {row['ms'] if row['ms'] is not None else '-':>10} ms "
                              f"(graph {row['ms_cudagraph'] if row['ms_cudagraph'] is not None else '-'})  "
                              f"{row['tflops'] if row['tflops'] is not None else '-':>8} TFLOP/s  "
                              f"extra {row['extra_mib'] if row['extra_mib'] is not None else '-'} MiB  "
                              f"{row['status']}", flush=True)
                    progress(rows)
                    if device == "cuda":
                        cached_alibi_bias.cache_clear()
                        torch.cuda.empty_cache()
    return rows


def ratios(rows):
    """Per size, mode and slopes: each baseline's time divided by the triton variant's (> 1: triton is
    faster), memory against the fastest bias-free SDPA kernel."""
    keyed = {}
    for r in rows:
        if r["ms"] is not None:
            keyed[(r["model"], r["image_px"], r["mode"], r["slopes"], r["backend"])] = r
    groups = []
    for r in rows:
        key = (r["model"], r["image_px"], r["mode"], r["slopes"])
        if r["slopes"] is not None and key not in groups:
            groups.append(key)
    out = []
    for model, px, mode, slopes in groups:
        def get(backend, _s=slopes):
            return keyed.get((model, px, mode, None if backend in NOBIAS else _s, backend))
        for variant in (v for v in TRITON_VARIANTS if v not in NOBIAS):
            t = get(variant)
            if t is None:
                continue
            entry = dict(model=model, image_px=px, mode=mode, slopes=slopes, triton_variant=variant)
            for other in ("triton-nobias", "flex", "flex-table", "flex-flash", "sdpa-bias", "sdpa-nobias"):
                o = get(other)
                entry[f"speed_vs_{other}"] = round(o["ms"] / t["ms"], 3) if o else None
            # Flex at its best: the faster of its biased variants.
            flex = [get(b) for b in ("flex", "flex-table", "flex-flash") if get(b)]
            best_flex = min(flex, key=lambda r: r["ms"]) if flex else None
            entry["best_flex"] = best_flex and best_flex["backend"]
            entry["speed_vs_best_flex"] = round(best_flex["ms"] / t["ms"], 3) if best_flex else None
            nobias = [get(b) for b in NOBIAS if b.startswith("sdpa-nobias") and get(b)]
            best = min(nobias, key=lambda r: r["ms"]) if nobias else None
            entry["best_sdpa_nobias"] = best and best["backend"]
            entry["speed_vs_best_sdpa_nobias"] = round(best["ms"] / t["ms"], 3) if best else None
            entry["memory_vs_best_sdpa_nobias"] = (round(t["extra_mib"] / best["extra_mib"], 3)
                                                   if best and t["extra_mib"] and best["extra_mib"] else None)
            out.append(entry)
    return out


def launch_configs():
    """The launch config each fused kernel ran per autotuning key so far (what an autotuned run chose, to pin)."""
    module = sys.modules.get("kernels.alibi_triton")
    found = {}
    for name in ("_fwd_kernel", "_dkdv_kernel", "_dq_kernel"):
        cache = getattr(getattr(module, name, None), "cache", None) or {}
        if cache:
            found[name.strip("_")] = {str(key): str(config) for key, config in cache.items()}
    return found


def auto_summary(rows):
    """Per size, mode and slopes with an ``auto`` row: its time against the fastest other backend with the
    bias (> 1: auto lost by that factor), and what it chose."""
    out = []
    for r in rows:
        if r["backend"] != "auto" or r["ms"] is None:
            continue
        others = [o for o in rows if o["ms"] is not None and o["backend"] not in (*NOBIAS, "auto", "eager")
                  and (o["model"], o["image_px"], o["mode"], o["slopes"]) == (r["model"], r["image_px"], r["mode"],
                                                                             r["slopes"])]
        best = min(others, key=lambda o: o["ms"]) if others else None
        choice = r["auto_choice"] or {}
        out.append(dict(model=r["model"], image_px=r["image_px"], mode=r["mode"], slopes=r["slopes"], auto_ms=r["ms"],
                        chose=choice.get("backend"), how=choice.get("how"), fastest_other=best and best["backend"],
                        fastest_other_ms=best and best["ms"],
                        auto_vs_fastest=round(r["ms"] / best["ms"], 3) if best else None))
    return out


def write_reports(args, rows, ratio_rows, meta):
    def fmt(x, nd=2):
        return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    lines = [f"# Attention benchmark: {meta['device']}", "",
             f"- command: `{meta['command']}`",
             f"- torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, python {meta['python']}",
             f"- dtype {meta['dtype']}, head_dim {meta['head_dim']}, prefix tokens {PREFIX}, patch {PATCH}, "
             f"batch rule: {meta['batch_rule']}, {meta['repeats']} interleaved rounds, triton launch configs "
             f"{'autotuned' if meta.get('autotune', True) else 'pinned (ALIBI_TRITON_AUTOTUNE=0)'}",
             f"- settings: {', '.join(f'{k}={v}' for k, v in meta.get('settings', {}).items()) or 'defaults'}",
             *([] if meta.get("complete", True) else ["- **incomplete**: the run was still going or was stopped"]),
             "- ms: median over rounds of do_bench medians (p20-p80 beside it); graph ms: CUDA-graph replay "
             "(no host overhead). TFLOP/s counts 4·B·H·N²·D for the forward and 3.5× that for forward+backward. "
             "resident MiB: what a first call leaves allocated (materialised bias); extra MiB: steady-state peak "
             "beyond the inputs. error: worst relative error of output and gradients against fp32 (threshold "
             f"{TOLERANCE[meta['dtype']]}).",
             "",
             "| model | px | N | B | mode | slopes | backend | kernel | ms | p20-p80 | graph ms | TFLOP/s | "
             "resident MiB | extra MiB | error | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernel = r["sdpa_backend"] or "-"
        if r["kernel"]:
            kernel += ": " + ", ".join(k[:40] for k in r["kernel"][:2])
        err = max(r["errors"].values()) if r["errors"] else None
        spread = f"{fmt(r['ms_p20'], 3)}-{fmt(r['ms_p80'], 3)}" if r["ms_p20"] is not None else "-"
        lines.append(f"| {r['model']} | {r['image_px']} | {r['N']} | {r['batch']} | {r['mode']} | "
                     f"{r['slopes'] or '-'} | {r['backend']} | {kernel} | {fmt(r['ms'], 3)} | {spread} | "
                     f"{fmt(r['ms_cudagraph'], 3)} | {fmt(r['tflops'])} | {fmt(r['resident_mib'], 1)} | "
                     f"{fmt(r['extra_mib'], 1)} | {fmt(err, 4)} | {r['status']} |")
    lines += ["", "Speed ratios (other backend's time / triton's time; > 1 means triton is faster) and memory "
              "(triton's extra MiB / the fastest bias-free SDPA kernel's):", "",
              "| model | px | mode | slopes | triton variant | vs triton-nobias | vs fastest sdpa-nobias (which) | "
              "memory vs it | vs fastest flex (which) | vs sdpa-bias |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for e in ratio_rows:
        lines.append(f"| {e['model']} | {e['image_px']} | {e['mode']} | {e['slopes']} | {e['triton_variant']} | "
                     f"{fmt(e['speed_vs_triton-nobias'], 3)} | {fmt(e['speed_vs_best_sdpa_nobias'], 3)} "
                     f"({e['best_sdpa_nobias'] or '-'}) | {fmt(e['memory_vs_best_sdpa_nobias'], 3)} | "
                     f"{fmt(e['speed_vs_best_flex'], 3)} ({e['best_flex'] or '-'}) | "
                     f"{fmt(e['speed_vs_sdpa-bias'], 3)} |")
    auto_rows = auto_summary(rows)
    if auto_rows:
        lines += ["", "`auto` against the fastest other backend with the bias (auto ms / its ms; ≤ 1 means auto "
                  "lost nothing):", "",
                  "| model | px | mode | slopes | auto chose (how) | auto ms | fastest other (ms) | auto / fastest |",
                  "|---|---|---|---|---|---|---|---|"]
        for e in auto_rows:
            lines.append(f"| {e['model']} | {e['image_px']} | {e['mode']} | {e['slopes']} | {e['chose'] or '-'} "
                         f"({e['how'] or '-'}) | {fmt(e['auto_ms'], 3)} | {e['fastest_other'] or '-'} "
                         f"({fmt(e['fastest_other_ms'], 3)}) | {fmt(e['auto_vs_fastest'], 3)} |")
    name = f"attention_{meta['device_slug']}" + (f"_{args.tag}" if args.tag else "")
    return write_report(args.out_dir, name, {**meta, "rows": rows, "ratios": ratio_rows, "auto": auto_rows,
                                             "launch_configs": launch_configs()}, lines, smoke=args.smoke)


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
        repeats=1 if args.smoke else max(1, args.repeats),
        autotune=os.environ.get("ALIBI_TRITON_AUTOTUNE", "1") != "0",
        settings={k: v for k, v in sorted(os.environ.items()) if k.startswith(("ALIBI_TRITON_", "ALIBI_VIT_ATTENTION_"))},
        smoke=bool(args.smoke), complete=False,
    )
    rows = run(args, progress=lambda done: write_reports(args, done, ratios(done), meta))
    meta["complete"] = True
    md, js = write_reports(args, rows, ratios(rows), meta)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
