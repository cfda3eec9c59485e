"""Forward throughput and memory of whole ViTs as users run them: ALiBi-Dv2 on every attention path
against DINOv2 with its learned position embedding.

Feature extraction (the trainable segmentation, the probes, the app) is a forward of the backbone.
Per model (ViT-S/B/L/14 with 4 registers, random init: weights do not change the speed), image size
and variant, one row records:

- ``img_per_s``: images per second of ``model.forward_features`` on a batch of random images
  (two batches, alternated), median of ``--rounds`` rounds of about ``--seconds`` each after one
  warm-up call; on the CPU also ``s_per_mpx``, seconds per megapixel of image;
- ``first_call_s``: the first forward of a freshly built model (Triton compiles, cuDNN plans,
  ``torch.compile``): what a user's first image costs beyond the steady state;
- ``peak_gib``: peak device memory of a steady forward (weights, batch, activations, and the
  materialised bias of ``alibi-sdpa``, built once per grid and shared by all layers), ``bias_mib`` the
  size of that bias (N² elements; the fused kernel and Flex keep none);
- ``kernel``: the attention kernels that ran (torch profiler: CUDA kernels on a GPU, aten ops on
  the CPU) and ``attention_share``, their part of the forward's device time (GPU only);
- ``ran``: the attention backend the ALiBi model's layers used (``alibi-auto`` resolves here).

Variants: ``dinov2`` (timm's DINOv2, learned position embedding interpolated to the grid, timm's
fused SDPA: what users would otherwise run), ``alibi-triton`` (the fused kernel, bias from token
coordinates), ``alibi-auto`` (the model's default backend), ``alibi-sdpa`` (SDPA with the
materialised bias), ``alibi-flex`` (FlexAttention, compiled), ``alibi-eager`` (explicit scores: the
reference). With ``--compile-top K``, the K fastest variants of each (model, size) are timed again
under ``torch.compile`` after every uncompiled row has run (their first call includes the compile), at
the sizes of ``--compile-sizes``.

Rows run in order of ``--sizes``, then ``--models``, then the variants; a row that would start after
``--time-limit`` seconds is recorded as skipped. The results
(``benchmarks/results/model_<device>[_<tag>].{json,md}``) are rewritten after every row.

    python benchmarks/bench_model.py                                        # GPU: ViT-S and B, 4 sizes, bf16
    python benchmarks/bench_model.py --device cpu --models small --sizes 224 518   # what a laptop waits for
    python benchmarks/bench_model.py --smoke                                # CPU dry run of the script
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import command_line, environment, error_status, load_average, slug, write_report  # noqa: E402

MODELS = ("small", "base", "large")
# Each variant: (timm name pattern, model kwargs). The ALiBi models take their attention backend by name.
VARIANTS = {
    "dinov2": ("vit_{size}_patch14_reg4_dinov2", {"dynamic_img_size": True}),
    "alibi-triton": ("alibi_vit_{size}_patch14_reg4_dinov2", {"backend": "triton"}),
    "alibi-auto": ("alibi_vit_{size}_patch14_reg4_dinov2", {"backend": "auto"}),
    "alibi-sdpa": ("alibi_vit_{size}_patch14_reg4_dinov2", {"backend": "sdpa"}),
    "alibi-flex": ("alibi_vit_{size}_patch14_reg4_dinov2", {"backend": "flex"}),
    "alibi-eager": ("alibi_vit_{size}_patch14_reg4_dinov2", {"backend": "eager"}),
}
GPU_VARIANTS = ("dinov2", "alibi-triton", "alibi-auto", "alibi-sdpa", "alibi-flex")
CPU_VARIANTS = ("dinov2", "alibi-auto", "alibi-sdpa", "alibi-eager")
PATCH, PREFIX = 14, 5
TINY = {"depth": 2, "embed_dim": 64, "num_heads": 2}  # --smoke: head_dim 32, a size the fused kernel takes
# Names of the kernels (CUDA) or ops (CPU) that do the attention, as the profiler lists them.
# (cuDNN's attention kernels say "sdpa"; a bare "cudnn" would also catch the patch embedding's convolution.)
ATTENTION_KEYS = ("flash", "fmha", "sdpa", "efficient", "attention", "alibi", "flex", "triton_tem", "softmax")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when there is one")
    p.add_argument("--models", nargs="+", choices=MODELS, default=["small", "base"])
    p.add_argument("--sizes", type=int, nargs="+", default=[518, 1022, 224, 2044],
                   help="image sides in px, multiples of 14, in the order to run them")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=None,
                   help=f"default on a GPU: {' '.join(GPU_VARIANTS)}; on the CPU: {' '.join(CPU_VARIANTS)}")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="weights and activations (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--tokens", type=int, default=90_000,
                   help="patch tokens per batch: batch = round(tokens / N), at least 1, at most --max-batch "
                        "(default 90000: 64 images at 518 px)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--batch", type=int, default=None, help="one batch for every size (default: from --tokens; "
                                                          "1 on the CPU)")
    p.add_argument("--seconds", type=float, default=1.0, help="about how long each timed round lasts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compile-top", type=int, default=0, metavar="K",
                   help="time the K fastest variants of each (model, size) again under torch.compile")
    p.add_argument("--compile-sizes", type=int, nargs="+", default=None, metavar="PX",
                   help="the sizes that get --compile-top rows (default: every size)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="start no row after S seconds (its row says skipped)")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--tag", default=None, help="results file suffix")
    p.add_argument("--smoke", action="store_true",
                   help="CPU dry run: a 2-block width-64 model, 28 and 56 px, one short round; checks the script")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.device, args.models, args.sizes = "cpu", ["small"], [56, 28]
        args.seconds, args.rounds, args.batch = 0.05, 1, args.batch or 2
        if args.variants is None:
            # The fused kernel runs on the CPU only under the interpreter.
            interp = os.environ.get("TRITON_INTERPRET") == "1"
            args.variants = ["dinov2", "alibi-sdpa", "alibi-eager"] + (["alibi-triton"] if interp else [])
    for size in args.sizes:
        if size <= 0 or size % PATCH:
            p.error(f"--sizes: {size} px is not a positive multiple of the patch size {PATCH}")
    for name in ("tokens", "max_batch", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.batch is not None and args.batch < 1:
        p.error("--batch must be at least 1")
    return args


def tokens(size: int) -> int:
    return PREFIX + (size // PATCH) ** 2


def batch_for(args, size: int) -> int:
    if args.batch is not None:
        return args.batch
    if args.device == "cpu":
        return 1
    return max(1, min(args.max_batch, round(args.tokens / tokens(size))))


def build(variant: str, model: str, device, dtype, smoke: bool):
    import timm
    import torch

    import alibi_vit  # noqa: F401  (registers the ALiBi models with timm)

    name, kwargs = VARIANTS[variant]
    kwargs = {**kwargs, **(TINY if smoke else {})}
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a ViT-L built on the CPU takes seconds
        net = timm.create_model(name.format(size=model), pretrained=False, **kwargs)
    return net.eval().to(dtype)


def attention_ran(net, device, dtype, tokens: int, batch: int, compiled: bool) -> str:
    """The backend the model's attention layers took after a first call: ``auto`` resolved (what it chose for
    calls of this batch and token count, and how), or timm's own SDPA."""
    from kernels import backend_choice
    from kernels.attention import auto_backend

    backend = getattr(net.blocks[0].attn, "backend", None)
    if backend is None:
        return "timm sdpa"
    if backend != "auto":
        return backend
    if compiled:  # torch.compile traces the rule's backend
        return f"auto → {auto_backend(device.type, net.blocks[0].attn.head_dim, dtype)} (rule, compiled)"
    picks = sorted({f"{c.backend} ({c.how})" for kind, c in backend_choice.chooser().choices.items()
                    if kind.shape[0] == batch and kind.shape[2] == tokens})
    return "auto → " + ", ".join(picks) if picks else "auto"


def profile_attention(call, device_type: str) -> tuple[list[str], float | None]:
    """(attention kernels or ops of one call by device time, their share of the call's device time)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device_type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        call()
    events = prof.key_averages()
    if device_type == "cuda":
        from torch.autograd import DeviceType

        # Kernels only: an aten op's device time repeats its kernels'.
        timed = [(e.key, e.device_time_total) for e in events if e.device_type == DeviceType.CUDA]
    else:
        timed = [(e.key, e.self_cpu_time_total) for e in events]
    total = sum(t for _, t in timed)
    found = sorted(((t, k) for k, t in timed if any(s in k.lower() for s in ATTENTION_KEYS)), reverse=True)
    names = [k[:90] for _, k in found[:3]]
    share = round(sum(t for t, _ in found) / total, 3) if total and device_type == "cuda" else None
    return names, share


class Clock:
    """Wall seconds of ``fn`` calls, synchronised on a GPU."""

    def __init__(self, device_type: str):
        import torch

        self.sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)

    def __call__(self, fn, times: int = 1) -> float:
        self.sync()
        start = time.perf_counter()
        for _ in range(times):
            fn()
        self.sync()
        return time.perf_counter() - start


def measure(args, variant: str, model: str, size: int, compiled: bool = False) -> dict:
    """One row: build, first call, kernels, memory, throughput; errors and OOM become the row's status."""
    import torch

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    n, batch = tokens(size), batch_for(args, size)
    row = {"model": model, "variant": variant, "compiled": compiled, "image_px": size, "tokens": n, "batch": batch,
           "dtype": args.dtype, "status": "ok", "img_per_s": None, "ms_per_batch": None, "s_per_mpx": None,
           "first_call_s": None, "peak_gib": None, "weights_gib": None,
           "bias_mib": round(n * n * dtype.itemsize / 2**20, 1) if variant in ("alibi-sdpa", "alibi-eager") else 0.0,
           "kernel": None, "attention_share": None, "ran": None, "load_average": load_average()}
    clock = Clock(device.type)
    net = None
    try:
        from kernels.alibi_bias import cached_alibi_bias

        cached_alibi_bias.cache_clear()
        if compiled or variant == "alibi-flex":
            # A fresh compile cache: Flex specialises on every grid and head count, and past torch's
            # recompile limit it would silently run unfused.
            torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        net = build(variant, model, device, dtype, args.smoke)
        if device.type == "cuda":
            row["weights_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
        gen = torch.Generator(device="cpu").manual_seed(size)
        inputs = [torch.randn(batch, 3, size, size, generator=gen).to(device, dtype) for _ in range(2)]
        forward = torch.compile(net.forward_features) if compiled else net.forward_features
        turn = [0]

        def call():
            turn[0] += 1
            with torch.inference_mode():
                return forward(inputs[turn[0] % 2])

        row["first_call_s"] = round(clock(call), 3)
        row["ran"] = attention_ran(net, device, dtype, n, batch, compiled)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        once = clock(call)  # the steady state: caches built, kernels compiled
        if device.type == "cuda":
            row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        row["kernel"], row["attention_share"] = profile_attention(call, device.type)
        times = max(1, min(50, round(args.seconds / max(once, 1e-6))))
        rounds = [clock(call, times) / times for _ in range(args.rounds)]
        per_batch = statistics.median(rounds)
        row.update(ms_per_batch=round(per_batch * 1e3, 3), img_per_s=round(batch / per_batch, 2),
                   s_per_mpx=round(per_batch / (batch * size * size / 1e6), 4), timed_calls=times * args.rounds)
    except torch.cuda.OutOfMemoryError:
        row["status"] = "out of memory"
    except Exception as exc:  # one failing variant must not end the sweep
        row["status"] = error_status(exc, 240)
    finally:
        del net
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def plan(args):
    """(variant, model, size) of the uncompiled rows, in the order they run."""
    return [(variant, model, size) for size in args.sizes for model in args.models for variant in args.variants]


def fastest(rows, model, size, k):
    done = [r for r in rows if r["model"] == model and r["image_px"] == size and not r["compiled"]
            and r["img_per_s"] is not None and r["variant"] != "alibi-auto"]  # auto repeats one of the others
    return [r["variant"] for r in sorted(done, key=lambda r: -r["img_per_s"])[:k]]


def run(args, progress=lambda rows: None):
    start = time.monotonic()
    rows = []

    def add(variant, model, size, compiled=False):
        if args.time_limit is not None and time.monotonic() - start > args.time_limit:
            row = {"model": model, "variant": variant, "compiled": compiled, "image_px": size,
                   "tokens": tokens(size), "batch": batch_for(args, size), "status": "skipped: time limit"}
        else:
            row = measure(args, variant, model, size, compiled)
        rows.append(row)
        label = f"{model:6s} {size:5d}px B={row['batch']:4d} {variant:13s}{' compiled' if compiled else '':9s}"
        speed = f"{row['img_per_s']:9.2f} img/s" if row.get("img_per_s") else " " * 15
        print(f"{label} {speed}  first {row.get('first_call_s')} s  peak {row.get('peak_gib')} GiB  "
              f"{row.get('ran')}  {row.get('kernel')}  {row['status']}", flush=True)
        progress(rows)

    for variant, model, size in plan(args):
        add(variant, model, size)
    if args.compile_top:
        for size in args.compile_sizes or args.sizes:
            for model in args.models:
                for variant in fastest(rows, model, size, args.compile_top):
                    add(variant, model, size, compiled=True)
    return rows


def device_label(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or platform.machine()
    try:  # Linux names the processor model here; platform.processor() is often empty
        with open("/proc/cpuinfo") as info:
            name = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU {name}, {torch.get_num_threads()} threads"


def _fmt(value, nd=2):
    return "" if value is None else f"{value:.{nd}f}" if isinstance(value, float) else str(value)


def markdown(args, rows, meta) -> list[str]:
    gpu = args.device == "cuda"
    lines = [f"# Whole-model forward on {meta['device']}{' (smoke: not a measurement)' if args.smoke else ''}", "",
             f"Command: `{meta['command']}`", "",
             f"`forward_features` of random-init ViT-{{S,B,L}}/14-reg4, {args.dtype}, inference mode; torch "
             f"{meta['torch']}, triton {meta['triton']}; {meta['date']}; load average at the start "
             f"{meta['load_average']}. img/s: median of {args.rounds} rounds of about {args.seconds} s after a "
             "warm-up call; first call: a fresh model's first forward (kernel compiles, `torch.compile`); peak: "
             "device memory of a steady forward; bias: the materialised (N, N) bias SDPA reads (none for the "
             "fused kernel and Flex); ALiBi ÷ DINOv2: throughput against `dinov2` at the same size.", ""]
    if meta.get("incomplete"):
        lines += ["**Incomplete**: the run was still going when this was written.", ""]
    head = ["model", "px", "tokens", "batch", "variant", "compiled", "ran", "img/s",
            "s/MPx" if not gpu else "ms/batch", "÷ DINOv2", "first call s", "peak GiB", "bias MiB",
            "attention kernel", "attn share", "status"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = {(r["model"], r["image_px"]): r["img_per_s"] for r in rows
            if r["variant"] == "dinov2" and not r["compiled"] and r.get("img_per_s")}
    for r in sorted(rows, key=lambda r: (MODELS.index(r["model"]), r["image_px"], r["compiled"])):
        ref = base.get((r["model"], r["image_px"]))
        ratio = f"{r['img_per_s'] / ref:.2f}" if ref and r.get("img_per_s") else ""
        kernel = "; ".join(f"`{k}`" for k in (r.get("kernel") or [])[:2])
        lines.append("| " + " | ".join([
            r["model"], str(r["image_px"]), str(r["tokens"]), str(r["batch"]), r["variant"],
            "yes" if r["compiled"] else "", r.get("ran") or "", _fmt(r.get("img_per_s")),
            _fmt(r.get("s_per_mpx"), 3) if not gpu else _fmt(r.get("ms_per_batch"), 1), ratio,
            _fmt(r.get("first_call_s")), _fmt(r.get("peak_gib")), _fmt(r.get("bias_mib"), 1), kernel,
            _fmt(r.get("attention_share")), r["status"]]) + " |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_model: --device cuda but no CUDA device here; use --device cpu or --smoke", file=sys.stderr)
        return 2
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.variants = args.variants or list(GPU_VARIANTS if args.device == "cuda" else CPU_VARIANTS)
    name = "cpu-smoke" if args.smoke else slug(torch.cuda.get_device_name()) if args.device == "cuda" else "cpu"
    stem = f"model_{name}" + (f"_{args.tag}" if args.tag else "")
    meta = {"command": command_line("bench_model.py", args.argv), "device": device_label(args.device),
            "load_average": load_average(), "cpu_count": os.cpu_count(), **environment()}

    def write(rows, incomplete=True):
        write_report(args.out_dir, stem, {"meta": {**meta, "incomplete": incomplete}, "rows": rows},
                     markdown(args, rows, {**meta, "incomplete": incomplete}), smoke=args.smoke)

    rows = run(args, progress=write)
    write(rows, incomplete=False)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
