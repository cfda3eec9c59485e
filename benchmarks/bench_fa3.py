"""The Gluon FA3-structured ALiBi forward and backward (kernels/alibi_gluon.py) on a Hopper GPU: checked, timed.

1. **Checks** (in a child process with a time limit, so a kernel that hangs cannot stall the phase):
   the Gluon forward against a float64 softmax reference (``kernels.alibi_bias.alibi_bias``) at 224,
   518 and 1022 px (patch 14, 5 prefix tokens) and on odd grids with 0, 1 and 5 prefix tokens, for
   constant and per-head slopes, bf16, head_dim 64, each consumer form (serial, the default; pipelined;
   ping-pong), q/k/v as views of a fused qkv projection: O as
   max |error| / max |reference| under 4e-2 (bf16), the base-2 logsumexp within 2e-2; and the
   bias-free build against plain softmax attention. Then the backward (dK/dV per key tile, dQ by atomic adds)
   after the serial forward, against float64 autograd through ``kernels.attention.eager_alibi_attention``, on
   the same cases for constant, per-head and learned slopes (dq, dk, dv, and dslopes when learned, each as
   max |error| / max |reference|), and its bias-free build against float64 plain attention's gradients.
   A failed or hung check fails the run loudly
   (exit status 1, ``FAILED`` in the report) and keeps the Gluon rows out of the timing.
2. **Timing** (forward only, bf16, ViT-B: 12 heads, d = 64, B = round(65536 / N)), at 518, 1022 and
   224 px in that order, constant slopes first, then per-head: the Gluon kernel (each consumer form)
   and its bias-free build beside cuDNN's bias-free SDPA, SDPA with the materialised bias pinned to cuDNN
   (``kernels.attention.sdpa_alibi_attention``), flash's bias-free SDPA, and the fused Triton
   kernel (``kernels.alibi_triton.triton_alibi_attention``) with its bias-free build. Every backend's
   output is first checked on one image and two heads against an fp32 reference (with or without the
   bias as it should have it); then ``triton.testing.do_bench`` medians (20/80 % quantiles) in
   ``--repeats`` interleaved rounds; TFLOP/s (4·B·H·N²·D) and the ratio to cuDNN bias-free of the same size.
3. **Timing, forward + backward** (after every forward row; ``torch.autograd.grad`` of O with a fixed upstream
   gradient): the Gluon forward and backward (:func:`kernels.alibi_gluon.gluon_alibi_attention`) and its
   bias-free build beside cuDNN's bias-free SDPA, SDPA with the bias on cuDNN and the fused Triton kernel (with
   its bias-free build), for constant, per-head and learned slopes (learned: the slope gradient too; SDPA's
   bias has none, so it sits out), each first checked on one image and two heads (O and the gradients against
   fp32 autograd); TFLOP/s count 3.5 × 4·B·H·N²·D.

Every row is written as it is measured to ``fa3_<device-slug>.{json,md}`` (``--out-dir``, e.g. ``$OUT``);
rows not started before ``--time-limit`` seconds are listed as skipped (the forward rows come first).

``--smoke`` runs on a CPU: the Gluon kernels cannot launch there, so the checks run the NumPy models of the
forward and the backward (``tests/test_alibi_gluon.py``) against float64 references at small sizes, the
kernels are compiled for sm_90a, the GPU rows are written as skipped, and the files go to
``benchmarks/results/smoke/``.

    ALIBI_TRITON_AUTOTUNE=0 python benchmarks/bench_fa3.py --out-dir "$OUT"
    python benchmarks/bench_fa3.py --smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import command_line, environment, error_status, load_average, slug, write_report  # noqa: E402

PATCH, PREFIX, HEADS, HEAD_DIM = 14, 5, 12, 64
SIZES = (518, 1022, 224)
# (grid, prefix tokens, batch, heads) of the checks: 224/518/1022 px, then odd grids with 0/1/5 prefix tokens.
CHECK_CASES = [((16, 16), 5, 2, 2), ((37, 37), 5, 2, 2), ((73, 73), 5, 1, 2), ((7, 9), 0, 3, 2),
               ((13, 11), 1, 2, 2), ((9, 15), 5, 2, 2), ((1, 1), 1, 2, 2)]
SMOKE_CHECK_CASES = [((4, 5), 0, 2, 2), ((3, 3), 1, 1, 2), ((7, 9), 5, 1, 1), ((16, 16), 5, 1, 1)]
TOLERANCE = {"bfloat16": 4e-2, "float16": 1e-2}
LSE_TOLERANCE = 2e-2
# Backends per slope kind, in timing order; the first is what every ratio divides by.
BASELINE = "sdpa-nobias-cudnn"
# Gluon backends: "gluon[-nobias][-<consumer form>]", the serial consumer (the default) without a suffix.
TIMED = {"constant": (BASELINE, "gluon", "gluon-pipelined", "gluon-pingpong", "gluon-nobias", "gluon-nobias-pipelined",
                      "sdpa-bias-cudnn", "triton", "triton-nobias", "sdpa-nobias-flash"),
         "per-head": (BASELINE, "gluon", "gluon-pipelined", "gluon-pingpong", "sdpa-bias-cudnn", "triton")}
NOBIAS = ("sdpa-nobias-cudnn", "sdpa-nobias-flash", "gluon-nobias", "gluon-nobias-pipelined", "triton-nobias")
# Forward + backward: the Gluon forward (serial consumer) and backward through its autograd Function.
TIMED_BWD = {"constant": (BASELINE, "gluon", "gluon-nobias", "sdpa-bias-cudnn", "triton", "triton-nobias"),
             "per-head": (BASELINE, "gluon", "sdpa-bias-cudnn", "triton"),
             "learned": (BASELINE, "gluon", "triton")}
SLOPE_KINDS = ("constant", "per-head", "learned")
MODES = ("fwd", "fwd+bwd")
SMOKE_BWD_CHECK_CASES = [((4, 5), 0, 2, 2, 8, 8), ((3, 3), 1, 1, 2, 64, 64), ((7, 9), 5, 1, 1, 16, 16)]


def gluon_variant(name):
    """(has_bias, consumer form) of a Gluon backend name."""
    form = name.rsplit("-", 1)[1] if name.endswith(("-pipelined", "-pingpong")) else "serial"
    return "nobias" not in name, form


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="image side in px (patch 14)")
    p.add_argument("--slopes", nargs="+", choices=SLOPE_KINDS, default=list(SLOPE_KINDS),
                   help="learned: forward + backward only (its forward is per-head's)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--tokens", type=int, default=65536, help="tokens per batch: B = max(1, round(tokens / N))")
    p.add_argument("--dtype", choices=tuple(TOLERANCE), default="bfloat16")
    p.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100, help="do_bench measurement per round, ms")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the backends")
    p.add_argument("--check-timeout", type=float, default=300, help="seconds the check child may take")
    p.add_argument("--time-limit", type=float, default=float(os.environ.get("GPU_SUITE_LIMIT_FA3", 420)),
                   help="seconds after which no new timing row starts (default: $GPU_SUITE_LIMIT_FA3 or 420)")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="CPU: the NumPy model's checks, compile only, rows skipped")
    p.add_argument("--checks-only", type=Path, default=None, metavar="JSON", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def tokens(size):
    return PREFIX + (size // PATCH) ** 2


def alibi_slopes(heads):
    import torch

    return torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------

def reference64(q, k, v, grid, prefix, slopes, with_bias=True):
    """float64 softmax(q kᵀ/√D + m_h·B) v and the base-2 logsumexp, on q's device."""
    import torch

    from kernels.alibi_bias import alibi_bias

    q, k, v = (t.double() for t in (q, k, v))
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if with_bias:
        bias = alibi_bias(grid, prefix, device=q.device, dtype=torch.float64)
        m = torch.ones(q.shape[1], device=q.device, dtype=torch.float64) if slopes is None else slopes.double()
        logits = logits + m.view(1, -1, 1, 1) * bias
    lse = torch.logsumexp(logits, dim=-1) * 1.4426950408889634
    return logits.softmax(-1) @ v, lse


def gluon_checks(dtype_name, progress=lambda rows: None):
    """Every check case on the GPU, for each consumer form (``gluon``: the serial default, ``gluon-pipelined``,
    ``gluon-pingpong``) and the bias-free build: rows with the errors and a status."""
    import torch

    from kernels import alibi_gluon

    dtype = getattr(torch, dtype_name)
    rows = []
    cases = [(g, p, b, h, sl, True) for g, p, b, h in CHECK_CASES for sl in ("constant", "per-head")]
    cases.append(((37, 37), 5, 2, 2, "constant", False))
    for case_index, (grid, prefix, bsz, heads, slope_kind, with_bias) in enumerate(cases):
        n = prefix + grid[0] * grid[1]
        g = torch.Generator().manual_seed(case_index)
        qkv = torch.randn(bsz, n, 3, heads, HEAD_DIM, generator=g).to("cuda", dtype)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        sl = None if slope_kind == "constant" else torch.linspace(0.5, 2.5, heads, device="cuda")
        ref, ref_lse = reference64(q, k, v, grid, prefix, sl, with_bias)
        for form in alibi_gluon.CONSUMER_FORMS:
            name = ("gluon" if with_bias else "gluon-nobias") + ("" if form == "serial" else f"-{form}")
            row = {"check": name, "grid": list(grid), "prefix": prefix, "batch": bsz, "heads": heads,
                   "slopes": slope_kind, "dtype": dtype_name, "head_dim": HEAD_DIM}
            try:
                out, lse = alibi_gluon.gluon_alibi_attention_fwd(q, k, v, grid, prefix, sl, True, True,
                                                                 has_bias=with_bias, consumer=form)
                torch.cuda.synchronize()
                err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                lse_err = (lse.double() - ref_lse).abs().max().item()
                row.update(error=round(err, 6), lse_error=round(lse_err, 6))
                ok = err <= TOLERANCE[dtype_name] and lse_err <= LSE_TOLERANCE
                row["status"] = "ok" if ok else (f"wrong: max relative error {err:.3g} (limit {TOLERANCE[dtype_name]}), "
                                                 f"lse error {lse_err:.3g} (limit {LSE_TOLERANCE})")
            except Exception as err:  # noqa: BLE001 — recorded, and the run fails
                row["status"] = error_status(err)
            rows.append(row)
            progress(rows)
            print(f"check {name} grid {grid} prefix {prefix} {slope_kind}: {row['status']}", flush=True)
        del qkv, q, k, v, ref, ref_lse
        torch.cuda.empty_cache()
    return rows


def reference64_grads(q, k, v, do, grid, prefix, slopes, with_bias=True):
    """dq, dk, dv (and dslopes for a slopes tensor) by float64 autograd through
    ``kernels.attention.eager_alibi_attention`` (plain softmax attention without the bias), on q's device."""
    import torch

    from kernels.attention import eager_alibi_attention

    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    s64 = None if slopes is None else slopes.detach().double().requires_grad_(True)
    if with_bias:
        out = eager_alibi_attention(q64, k64, v64, grid, prefix, s64, True, True)
    else:
        out = torch.softmax(q64 @ k64.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v64
    leaves = [q64, k64, v64] + ([s64] if s64 is not None and with_bias else [])
    return torch.autograd.grad(out, leaves, do.double())


def gluon_bwd_checks(dtype_name, rows, progress=lambda rows: None):
    """The backward on every check case after the serial forward, for constant, per-head and learned slopes, and
    its bias-free build once: rows (appended to ``rows``) with the gradients' errors and a status."""
    import torch

    from kernels import alibi_gluon

    dtype = getattr(torch, dtype_name)
    cases = [(g, p, b, h, sl, True) for g, p, b, h in CHECK_CASES for sl in SLOPE_KINDS]
    cases.append(((37, 37), 5, 2, 2, "constant", False))
    for case_index, (grid, prefix, bsz, heads, slope_kind, with_bias) in enumerate(cases):
        n = prefix + grid[0] * grid[1]
        g = torch.Generator().manual_seed(1000 + case_index)
        qkv = torch.randn(bsz, n, 3, heads, HEAD_DIM, generator=g).to("cuda", dtype)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        do = torch.randn(bsz, n, heads, HEAD_DIM, generator=g).to("cuda", dtype).transpose(1, 2)
        sl = None if slope_kind == "constant" else torch.linspace(0.5, 2.5, heads, device="cuda")
        learned = slope_kind == "learned"
        name = "gluon-bwd" if with_bias else "gluon-nobias-bwd"
        row = {"check": name, "grid": list(grid), "prefix": prefix, "batch": bsz, "heads": heads,
               "slopes": slope_kind, "dtype": dtype_name, "head_dim": HEAD_DIM}
        try:
            out, lse = alibi_gluon.gluon_alibi_attention_fwd(q, k, v, grid, prefix, sl, has_bias=with_bias)
            grads = alibi_gluon.gluon_alibi_attention_bwd(do, q, k, v, out, lse, grid, prefix, sl,
                                                          need_dslopes=learned and with_bias, has_bias=with_bias)
            torch.cuda.synchronize()
            refs = reference64_grads(q, k, v, do, grid, prefix, sl, with_bias)[:4 if learned and with_bias else 3]
            errors = {}
            for label, got, ref in zip(("dq", "dk", "dv", "dslopes"), grads, refs):
                errors[label] = round(((got.double() - ref).abs().max() / ref.abs().max()).item(), 6)
            row["grad_errors"] = errors
            row["error"] = max(errors.values())
            ok = row["error"] <= TOLERANCE[dtype_name]
            row["status"] = "ok" if ok else (f"wrong: max relative error {row['error']:.3g} "
                                             f"(limit {TOLERANCE[dtype_name]}): {errors}")
        except Exception as err:  # noqa: BLE001 — recorded, and the run fails
            row["status"] = error_status(err)
        rows.append(row)
        progress(rows)
        print(f"check {name} grid {grid} prefix {prefix} {slope_kind}: {row['status']}", flush=True)
        del qkv, q, k, v, do
        torch.cuda.empty_cache()
    return rows


def run_checks_in_child(args):
    """gluon_checks in a child process under --check-timeout: (rows, problem or None)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "checks.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--checks-only", str(out), "--dtype", args.dtype,
               "--modes", *args.modes]
        start = time.time()
        try:
            proc = subprocess.run(cmd, timeout=args.check_timeout, capture_output=True, text=True, check=False)
        except subprocess.TimeoutExpired as exc:
            rows = json.loads(out.read_text()) if out.is_file() else []  # the rows checked before it stopped
            tail = (exc.stdout or b"")[-1500:]
            return rows, (f"the Gluon checks did not finish in {args.check_timeout:.0f} s (a hang?); "
                          f"last output: {tail.decode() if isinstance(tail, bytes) else tail}")
        sys.stdout.write(proc.stdout)
        rows = json.loads(out.read_text()) if out.is_file() else []
        if proc.returncode != 0:
            return rows, (f"the Gluon check process failed (status {proc.returncode}) after {len(rows)} checks: "
                          f"{proc.stderr[-1500:]}")
        print(f"checks took {time.time() - start:.0f} s", flush=True)
        bad = [r for r in rows if r["status"] != "ok"]
        return rows, (f"{len(bad)} of {len(rows)} Gluon checks failed ({', '.join(sorted({r['check'] for r in bad}))})"
                      if bad else None)


def smoke_checks():
    """CPU: the NumPy model of the kernel against the float64 reference (the kernel cannot launch here)."""
    import importlib.util

    import numpy as np

    spec = importlib.util.spec_from_file_location("test_alibi_gluon", ROOT / "tests" / "test_alibi_gluon.py")
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    rows = []
    for grid, prefix, bsz, heads in SMOKE_CHECK_CASES:
        for slope_kind in ("constant", "per-head"):
            n = prefix + grid[0] * grid[1]
            q, k, v = model._inputs(bsz, heads, n, HEAD_DIM, seed=len(rows))
            sl = None if slope_kind == "constant" else [0.5 + i for i in range(heads)]
            out, lse = model.model_forward(q, k, v, grid, prefix, sl, block_n=32)
            ref, ref_lse = model.reference(q, k, v, grid, prefix, sl)
            err = float(np.abs(out - ref).max() / np.abs(ref).max())
            lse_err = float(np.abs(lse - ref_lse).max())
            ok = err <= TOLERANCE["bfloat16"] and lse_err <= LSE_TOLERANCE
            rows.append({"check": "numpy-model", "grid": list(grid), "prefix": prefix, "batch": bsz, "heads": heads,
                         "slopes": slope_kind, "dtype": "bfloat16", "head_dim": HEAD_DIM, "error": round(err, 6),
                         "lse_error": round(lse_err, 6),
                         "status": "ok" if ok else f"wrong: max relative error {err:.3g}, lse error {lse_err:.3g}"})
    for grid, prefix, bsz, heads, key_rows, block_m in SMOKE_BWD_CHECK_CASES:
        for slope_kind in SLOPE_KINDS:
            n = prefix + grid[0] * grid[1]
            q, k, v = model._inputs(bsz, heads, n, HEAD_DIM, seed=len(rows))
            do = model._inputs(bsz, heads, n, HEAD_DIM, seed=100 + len(rows))[0]
            sl = None if slope_kind == "constant" else [0.5 + i for i in range(heads)]
            got = model.model_backward(q, k, v, do, grid, prefix, sl, key_rows=key_rows, block_m=block_m,
                                       learned=slope_kind == "learned")
            want = model.reference_grads(q, k, v, do, grid, prefix, sl)
            errors = {label: round(float(model._rel(g, r)), 6) for label, g, r in
                      zip(("dq", "dk", "dv", "dslopes"), got, want) if g is not None and r is not None
                      and (label != "dslopes" or slope_kind == "learned")}
            err = max(errors.values())
            rows.append({"check": "numpy-model-bwd", "grid": list(grid), "prefix": prefix, "batch": bsz,
                         "heads": heads, "slopes": slope_kind, "dtype": "bfloat16", "head_dim": HEAD_DIM,
                         "error": err, "grad_errors": errors,
                         "status": "ok" if err <= TOLERANCE["bfloat16"] else f"wrong: {errors}"})
    return rows


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------

def backend_fn(name, grid, mode="fwd"):
    """name -> f(q, k, v, slopes) returning O (``fwd``: the Gluon forward alone; ``fwd+bwd``: the Gluon forward
    and backward through their autograd Function)."""
    from bench_attention import backend_fns

    if name.startswith("gluon") and mode == "fwd+bwd":
        from kernels.alibi_gluon import gluon_alibi_attention

        bias, _ = gluon_variant(name)
        return lambda q, k, v, s: gluon_alibi_attention(q, k, v, grid, PREFIX, s, True, True, has_bias=bias)
    if name.startswith("gluon"):
        from kernels.alibi_gluon import gluon_alibi_attention_fwd

        bias, form = gluon_variant(name)
        return lambda q, k, v, s: gluon_alibi_attention_fwd(q, k, v, grid, PREFIX, s, True, True, has_bias=bias,
                                                            consumer=form)[0]
    return backend_fns([name], grid)[name]


def attention_kernels(call):
    from bench_attention import attention_kernels as kernels

    try:
        return kernels(call)
    except Exception as err:  # noqa: BLE001 — the profiler is a nicety
        return [error_status(err)]


def time_rows(args, rows, meta, write, deadline, gluon_failed, mode="fwd"):
    """gluon_failed: the Gluon backends whose checks failed (not timed). ``mode``: "fwd" or "fwd+bwd"."""
    import torch
    import triton.testing
    from bench_attention import backend_context, check

    dtype = getattr(torch, args.dtype)
    timed = TIMED if mode == "fwd" else TIMED_BWD
    flops = 4 if mode == "fwd" else 14  # 3.5 × the forward's for forward + backward
    for slope_kind in [s for s in args.slopes if s in timed]:
        for size in args.sizes:
            n = tokens(size)
            grid = (size // PATCH, size // PATCH)
            bsz = max(1, round(args.tokens / n))
            group = []
            for name in timed[slope_kind]:
                row = {"backend": name, "slopes": slope_kind, "size": size, "tokens": n, "batch": bsz, "heads": HEADS,
                       "head_dim": HEAD_DIM, "dtype": args.dtype, "mode": mode}
                if time.time() > deadline:
                    row["status"] = "skipped: time limit"
                elif name in gluon_failed:
                    row["status"] = "skipped: its Gluon checks failed"
                else:
                    row["status"] = "pending"
                rows.append(row)
                group.append(row)
            live = [r for r in group if r["status"] == "pending"]
            if not live:
                write()
                continue
            g = torch.Generator().manual_seed(size)
            qkv = torch.randn(bsz, n, 3, HEADS, HEAD_DIM, generator=g).to("cuda", dtype)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            slopes = None if slope_kind == "constant" else alibi_slopes(HEADS).cuda()
            if slope_kind == "learned":
                slopes.requires_grad_(True)
            dout = torch.randn(bsz, n, HEADS, HEAD_DIM, generator=g).to("cuda", dtype).transpose(1, 2)
            calls = {}
            for row in live:
                name = row["backend"]
                try:
                    fn = backend_fn(name, grid, mode)
                    err, _ = check(name, fn, q, k, v, slopes, grid, dout, mode != "fwd", args.dtype,
                                   with_bias=name not in NOBIAS)
                    row["error"] = round(err, 6)
                    if not err <= TOLERANCE[args.dtype]:
                        row["status"] = f"wrong: max relative error {err:.3g} > {TOLERANCE[args.dtype]}"
                        continue

                    if mode == "fwd":
                        def call(fn=fn, name=name, q=q, k=k, v=v, slopes=slopes):
                            with backend_context(name), torch.no_grad():
                                return fn(q, k, v, slopes)
                    else:
                        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                        inputs = leaves + ([slopes] if slope_kind == "learned" and name not in NOBIAS else [])

                        def call(fn=fn, name=name, leaves=leaves, slopes=slopes, inputs=inputs, dout=dout):
                            with backend_context(name):
                                return torch.autograd.grad(fn(*leaves, slopes), inputs, dout)
                    call()
                    torch.cuda.synchronize()
                    row["kernel"] = attention_kernels(call)
                    calls[name] = call
                    row["ms_rounds"] = []
                except torch.cuda.OutOfMemoryError:
                    row["status"] = "OOM"
                    torch.cuda.empty_cache()
                except Exception as err:  # noqa: BLE001 — a row that fails is recorded, the sweep goes on
                    row["status"] = error_status(err)
                write()
            for _ in range(args.repeats):
                for row in live:
                    if row["backend"] in calls:
                        try:
                            ms, lo, hi = triton.testing.do_bench(calls[row["backend"]], warmup=args.warmup,
                                                                 rep=args.rep, quantiles=[0.5, 0.2, 0.8])
                        except Exception as err:  # noqa: BLE001
                            row["status"] = error_status(err)
                            del calls[row["backend"]]
                            continue
                        row["ms_rounds"].append([round(ms, 5), round(lo, 5), round(hi, 5)])
            base = None
            for row in live:
                if row["backend"] in calls:
                    meds = sorted(r[0] for r in row["ms_rounds"])
                    row["ms"] = meds[len(meds) // 2]
                    row["ms_q20"] = min(r[1] for r in row["ms_rounds"])
                    row["ms_q80"] = max(r[2] for r in row["ms_rounds"])
                    row["tflops"] = round(flops * bsz * HEADS * n * n * HEAD_DIM / (row["ms"] * 1e-3) / 1e12, 1)
                    row["status"] = "ok"
                    row["load_average"] = load_average()
                    if row["backend"] == BASELINE:
                        base = row["ms"]
            for row in live:
                if base and row.get("ms"):
                    row["vs_cudnn_nobias"] = round(row["ms"] / base, 3)
                print(f"{mode:7s} {slope_kind:8s} {size:5d} px {row['backend']:18s} {row['status']:10.60s} "
                      f"{row.get('ms', '-')} ms  ×cuDNN {row.get('vs_cudnn_nobias', '-')}", flush=True)
            del qkv, q, k, v, dout, calls
            torch.cuda.empty_cache()
            write()


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

def markdown(meta, checks, rows):
    lines = [f"# FA3-structured Gluon ALiBi forward and backward on {meta['device']}", "",
             f"`{meta['command']}` — {meta['date']}; torch {meta['torch']}, Triton {meta['triton']}, CUDA "
             f"{meta['cuda']}." + (" **Smoke run on a CPU: not a measurement.**" if meta["smoke"] else ""), ""]
    if meta.get("failed"):
        lines += [f"**FAILED: {meta['failed']}**", ""]
    lines += ["## Checks against the float64 reference", "",
              "Forward rows: the max relative error of O and the logsumexp's error; backward rows (``-bwd``): the "
              "worst of the gradients' max relative errors, each listed.", "",
              "| check | grid | prefix | batch × heads | slopes | max rel. error | lse error | gradients | status |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in checks:
        grads = ", ".join(f"{key} {val}" for key, val in r.get("grad_errors", {}).items()) or "-"
        lines.append(f"| {r['check']} | {r['grid'][0]}×{r['grid'][1]} | {r['prefix']} | {r['batch']} × {r['heads']} | "
                     f"{r['slopes']} | {r.get('error', '-')} | {r.get('lse_error', '-')} | {grads} | {r['status']} |")
    if meta.get("compile"):
        lines += ["", f"Compiled for sm_90a on this machine: {meta['compile']}"]
    for mode, title in (("fwd", "Forward"), ("fwd+bwd", "Forward + backward")):
        lines += table(mode, title, [r for r in rows if r.get("mode", "fwd") == mode])
    return lines


def table(mode, title, rows):
    if not rows:
        return []
    lines = ["", f"## {title} times (bf16, ViT-B 12 heads, d = 64, B = round(65536 / N))", "",
             "| slopes | px | N | B | backend | ms (q20–q80) | TFLOP/s | × cuDNN bias-free | check error | kernels | "
             "status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['ms']:.4f} ({r['ms_q20']:.4f}–{r['ms_q80']:.4f})" if r.get("ms") else "-"
        lines.append(f"| {r['slopes']} | {r['size']} | {r['tokens']} | {r['batch']} | {r['backend']} | {ms} | "
                     f"{r.get('tflops', '-')} | {r.get('vs_cudnn_nobias', '-')} | {r.get('error', '-')} | "
                     f"{', '.join(r.get('kernel', [])) or '-'} | {r['status']} |")
    return lines


def main(argv=None):
    args = parse_args(argv)
    if args.checks_only is not None:  # the child of run_checks_in_child
        def progress(rows):
            args.checks_only.write_text(json.dumps(rows))
        rows = gluon_checks(args.dtype, progress=progress) if "fwd" in args.modes else []
        if "fwd+bwd" in args.modes:
            gluon_bwd_checks(args.dtype, rows, progress=progress)
        return 0
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench_fa3.py needs a CUDA device (a Hopper GPU); use --smoke on a CPU", file=sys.stderr)
        return 2
    device = torch.cuda.get_device_name() if cuda else "cpu"
    meta = {"command": command_line("bench_fa3.py", argv if argv is not None else sys.argv[1:]), **environment(),
            "device": device, "device_slug": slug("cpu-smoke" if args.smoke else device), "smoke": args.smoke,
            "patch": PATCH, "num_prefix_tokens": PREFIX, "heads": HEADS, "head_dim": HEAD_DIM,
            "tokens_per_batch": args.tokens, "tolerance": TOLERANCE, "lse_tolerance": LSE_TOLERANCE,
            "launch_configs_pinned": os.environ.get("ALIBI_TRITON_AUTOTUNE") == "0", "complete": False}
    if cuda:
        meta["capability"] = list(torch.cuda.get_device_capability())
    checks, rows = [], []
    name = f"fa3_{meta['device_slug']}"

    def write():
        return write_report(args.out_dir, name, {**meta, "checks": checks, "rows": rows}, markdown(meta, checks, rows),
                            smoke=args.smoke)

    start = time.time()
    deadline = start + args.time_limit
    if args.smoke or not cuda:
        from kernels import alibi_gluon

        checks += smoke_checks()
        try:
            t0 = time.time()
            for form in alibi_gluon.CONSUMER_FORMS:
                alibi_gluon.compile_for_sm90(HEAD_DIM, consumer=form)
            alibi_gluon.compile_bwd_for_sm90(HEAD_DIM)
            meta["compile"] = (f"ok ({time.time() - t0:.1f} s; head_dim {HEAD_DIM}, constant slopes, forward consumers "
                               f"{', '.join(alibi_gluon.CONSUMER_FORMS)}, and the backward)")
        except Exception as err:  # noqa: BLE001
            meta["compile"] = error_status(err)
        for mode in args.modes:
            timed = TIMED if mode == "fwd" else TIMED_BWD
            for slope_kind in [s for s in args.slopes if s in timed]:
                for size in args.sizes:
                    n = tokens(size)
                    for backend in timed[slope_kind]:
                        rows.append({"backend": backend, "slopes": slope_kind, "size": size, "tokens": n,
                                     "batch": max(1, round(args.tokens / n)), "heads": HEADS, "head_dim": HEAD_DIM,
                                     "dtype": args.dtype, "mode": mode, "status": "skipped: no CUDA device"})
        bad = [c for c in checks if c["status"] != "ok"]
        if bad:
            meta["failed"] = f"{len(bad)} NumPy-model checks failed"
    else:
        write()
        checks_rows, problem = run_checks_in_child(args)
        checks += checks_rows
        if problem:
            meta["failed"] = problem
            print(f"\n*** FAILED: {problem} ***\n", flush=True)
        write()
        failed = {r["check"] for r in checks_rows if r["status"] != "ok"}
        if problem and not problem.endswith("checks failed)"):  # the child hung or died: no Gluon row is timed
            failed = {b for kind in (*TIMED.values(), *TIMED_BWD.values()) for b in kind if b.startswith("gluon")}
        # A failed backward check keeps the Gluon rows out of the forward + backward timing.
        failed_bwd = ({b for kind in TIMED_BWD.values() for b in kind if b.startswith("gluon")}
                      if any(c.endswith("-bwd") for c in failed) else set()) | {c for c in failed if not c.endswith("-bwd")}
        for mode in args.modes:  # the forward rows first
            time_rows(args, rows, meta, write, deadline, failed if mode == "fwd" else failed_bwd, mode)
        wrong = [f"{r['backend']} {r['slopes']} {r['size']} px" for r in rows if r["status"].startswith("wrong")]
        if wrong and not meta.get("failed"):
            meta["failed"] = "wrong outputs: " + "; ".join(wrong)
    meta["complete"] = True
    meta["seconds"] = round(time.time() - start, 1)
    md, js = write()
    print(f"wrote {md} and {js} in {meta['seconds']} s")
    if meta.get("failed"):
        print(f"FAILED: {meta['failed']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
