"""Training throughput of the distillation step: the student on each attention path.

One optimizer step of ``DistillationModule`` exactly as training runs it (frozen teacher
forward + student forward/backward + AdamW), on synthetic images, bf16 autocast on CUDA.
The student's attention backend is ``triton`` (the fused kernel: bias from token coordinates,
O(N) memory), ``sdpa`` (SDPA with the materialised (N, N) bias), ``flex`` (FlexAttention,
compiled) or ``eager`` (explicit scores); the teacher is the same in every row. Reports images/s
per GPU, the first step's seconds (kernel compiles) and peak memory at 224 and 518 px, and writes
``benchmarks/results/distill_throughput_<device>.{md,json}`` after every row (a run stopped by a
time limit keeps its rows). ``--ddp-check`` records whether Lightning can run a 2-process DDP step
on the GPUs this machine has.

    python benchmarks/bench_distill_throughput.py                 # CUDA: the real measurement
    python benchmarks/bench_distill_throughput.py --smoke         # tiny CPU check of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from report import command_line, environment, error_status, load_average, slug, write_report
TINY = {"depth": 2, "embed_dim": 32, "num_heads": 2}  # head_dim 16: a size the Triton kernel takes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=["small", "base", "large", "giant"],
                   help="DINOv2 size of teacher and student (default: small, the paper's)")
    p.add_argument("--sizes", type=int, nargs="+", default=[224, 518], help="image sizes in px")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 16],
                   help="per-GPU batch for each size (one value per --sizes entry)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="student attention backends (default: triton sdpa flex; with --smoke on CPU: sdpa eager, or "
                        "triton eager under TRITON_INTERPRET=1)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (autotuning, allocator)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the .md and .json go (default: benchmarks/results/, smoke runs: benchmarks/results/smoke/)")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="start no row after S seconds (its row says skipped)")
    p.add_argument("--ddp-check", action="store_true",
                   help="also record whether Lightning runs a 2-process DDP step on this machine's GPUs")
    p.add_argument("--smoke", action="store_true",
                   help="tiny CPU run (2-block width-32 models, 28/56 px, fp32) that checks the script, not speed")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.sizes, args.batch, args.steps, args.warmup = [28, 56], [4, 4], 2, 1
        if args.backends is None:
            # On CPU the Triton kernel runs only in the interpreter: slow, and no speed measurement.
            args.backends = ["triton", "eager"] if os.environ.get("TRITON_INTERPRET") == "1" else ["sdpa", "eager"]
    elif args.backends is None:
        args.backends = ["triton", "sdpa", "flex"]
    if len(args.batch) != len(args.sizes):
        p.error(f"--batch needs one value per size: {len(args.sizes)} sizes, {len(args.batch)} batches")
    return args


def build(model: str, backend: str, smoke: bool, device: torch.device):
    from lit_modules.distillation import DistillationModule

    torch.manual_seed(0)
    module = DistillationModule(
        teacher=f"vit_{model}_patch14_reg4_dinov2", student=f"alibi_vit_{model}_patch14_reg4_dinov2",
        teacher_pretrained=False,  # weights do not change the speed; no download needed
        model_kwargs=TINY if smoke else None, student_kwargs={"backend": backend},
        blank_channels=[] if smoke or model != "small" else (47, 113, 117, 359), init_from="teacher")
    module.to(device)
    module.train()
    return module, module.configure_optimizers()


def measure(model: str, backend: str, size: int, batch: int, steps: int, warmup: int, smoke: bool,
            device: torch.device) -> dict:
    row = {"backend": backend, "image_size": size, "batch_per_gpu": batch, "tokens": 5 + (size // 14) ** 2,
           "load_average": load_average()}
    module, optimizer = build(model, backend, smoke, device)
    gen = torch.Generator(device=device).manual_seed(0)
    images = torch.randn(batch, 3, size, size, device=device, generator=gen)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> float:
        with autocast:
            loss = module.distillation_loss(images)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    try:
        start = time.perf_counter()
        first = float(step())  # waits for the step: kernel compiles, autotuning, Flex's torch.compile
        row["first_step_s"] = round(time.perf_counter() - start, 2)
        for _ in range(warmup - 1):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        float(loss)  # waits for the last step
        elapsed = time.perf_counter() - start
    except torch.cuda.OutOfMemoryError:
        row.update(status="out of memory")
        return row
    except Exception as exc:  # one failing backend must not end the run
        row.update(status=error_status(exc, 240))
        return row
    finally:
        del module, optimizer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row.update(status="ok", img_per_s=batch * steps / elapsed, ms_per_step=1000 * elapsed / steps,
               first_step_loss=first)
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def ddp_check() -> dict:
    """Whether Lightning starts a 2-process DDP run on this machine's GPUs, and its message if not.

    Lightning runs one process per device; with fewer than two GPUs it refuses ``devices=2`` before
    any process starts."""
    import lightning as L

    gpus = torch.cuda.device_count()
    try:
        L.Trainer(accelerator="gpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False)
    except Exception as exc:
        return {"gpus": gpus, "runs": False, "message": f"{type(exc).__name__}: {str(exc).strip()[:400]}"}
    return {"gpus": gpus, "runs": True, "message": "Lightning accepts devices=2 here; time it with lightning fit"}


def write_distill_report(rows: list, args, device_name: str, ddp: dict | None = None,
                         incomplete: bool = False) -> tuple[Path, Path]:
    command = command_line("bench_distill_throughput.py", args.argv)
    meta = {"command": command, "device": device_name, "model": args.model, "steps": args.steps,
            "warmup": args.warmup, "precision": "fp32 (smoke)" if args.smoke else "bf16-mixed",
            "incomplete": incomplete, **environment()}
    # The baseline the fused kernel must beat: the materialised bias on SDPA (else eager, which also materialises it).
    reference = next((b for b in ("sdpa", "eager") if b in args.backends), None)
    lines = [f"# Distillation training throughput on {device_name}", "",
             f"Command: `{command}`", "",
             f"ViT-{args.model[0].upper()}/14-reg4 teacher (frozen) + ALiBi student, one AdamW step per batch, "
             f"synthetic images, {meta['precision']}, {args.steps} timed steps after {args.warmup} warm-up steps; "
             f"torch {meta['torch']}" + (f", triton {meta['triton']}" if meta["triton"] else "") + f"; {meta['date']}.",
             *(["", "**Incomplete**: the run was still going when this was written."] if incomplete else []),
             "", "| size (px) | tokens | batch/GPU | student attention | img/s per GPU | ms/step | first step s | "
             "peak GiB | speed-up |", "|---|---|---|---|---|---|---|---|---|"]
    for size in args.sizes:
        by_backend = {r["backend"]: r for r in rows if r["image_size"] == size}
        base = by_backend.get(reference, {}).get("img_per_s")
        for r in by_backend.values():
            if r["status"] != "ok":
                lines.append(f"| {size} | {r['tokens']} | {r['batch_per_gpu']} | {r['backend']} | {r['status']} "
                             "| | | | |")
                continue
            speedup = f"{r['img_per_s'] / base:.2f}×" if base else ""
            peak = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else ""
            lines.append(f"| {size} | {r['tokens']} | {r['batch_per_gpu']} | {r['backend']} | {r['img_per_s']:.1f} "
                         f"| {r['ms_per_step']:.1f} | {r.get('first_step_s', '')} | {peak} | {speedup} |")
    if reference:
        lines += ["", f"Speed-up is relative to the student on `{reference}` (the materialised (N, N) bias) at the "
                      "same size."]
    if ddp is not None:
        lines += ["", f"2-process DDP on this machine ({ddp['gpus']} GPU): "
                      + ("Lightning accepts it." if ddp["runs"] else f"refused before any step: `{ddp['message']}`")]
    stem = f"distill_throughput_{'cpu-smoke' if args.smoke else slug(device_name)}"
    return write_report(args.out_dir, stem, {"meta": meta, "results": rows, "ddp": ddp}, lines, smoke=args.smoke)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_distill_throughput: no CUDA device. This benchmark measures GPU training throughput in bf16 "
              "with the fused Triton kernel; run it on a GPU node, or pass --smoke for a tiny CPU check of the "
              "script.", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
    device_name = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name(device)
    started, rows, ddp = time.monotonic(), [], None
    for size, batch in zip(args.sizes, args.batch):
        for backend in args.backends:
            if args.time_limit is not None and time.monotonic() - started > args.time_limit:
                row = {"backend": backend, "image_size": size, "batch_per_gpu": batch,
                       "tokens": 5 + (size // 14) ** 2, "status": "skipped: time limit"}
            else:
                row = measure(args.model, backend, size, batch, args.steps, args.warmup, args.smoke, device)
            print(json.dumps(row), flush=True)
            rows.append(row)
            write_distill_report(rows, args, device_name, incomplete=True)
    if args.ddp_check:
        ddp = ddp_check()
        print(json.dumps({"ddp": ddp}), flush=True)
    md, js = write_distill_report(rows, args, device_name, ddp)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
