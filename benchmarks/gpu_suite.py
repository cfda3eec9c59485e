"""The GPU measurements, in phases that fit how a GPU machine is lent: ``bash benchmarks/gpu_suite.sh PHASE``.

The lent machine (one H100 or H200, 16 CPU cores) runs one command at a time for at most 10 minutes,
may be a fresh machine each time (nothing installed beyond its image, nothing compiled, an empty
Triton cache), and gives back only what the command wrote under ``$OUT``, at most 8 files. So each
phase finishes within ``GPU_SUITE_LIMIT`` seconds (default 530) counted from its start, even cold;
writes its results into ``$OUT`` when that is set, else ``benchmarks/results/``, as it goes (the
benchmarks rewrite their files after every group of rows, so a phase cut short keeps what it
measured); writes one log per phase and one status file for the machine, at most 6 files in all;
and streams every child's output line by line (``PYTHONUNBUFFERED``), so a killed step leaves its log.

Phases, in the order to run them (one command each):

    env         versions, the GPU, which optional modules the image has, one fused forward+backward
                checked against the eager reference (gpu_env_<device>.json)
    tests       the GPU test files (the kernel and attention tests) in several pytest processes side by
                side, so their cold kernel compiles share the CPU cores; pinned launch configs
                (ALIBI_TRITON_AUTOTUNE=0) (gpu_tests_<device>.json)
    fair        benchmarks/bench_attention.py, ViT-B at 518 and 1022 px, every slope kind, fwd and fwd+bwd: the
                default (auto) and the fused kernel (and its bias-free build) beside cuDNN without the bias and
                with it (2-D mask for constant slopes, 4-D per head), torch's own SDPA pick and the
                memory-efficient fallback; each row names the kernel that ran (attention_<device>_fair.{json,md})
    auto        auto against each of its candidates (the fused kernel, SDPA with the bias) at 224, 518, 1022 and
                2072 px, every slope kind and pass; what auto chose and its time over the fastest
                (attention_<device>_auto.{json,md})
    learned-ab  benchmarks/bench_backward_kernels.py: every kernel of one fwd+bwd timed apart per slope kind at
                518 and 1022 px (backward_kernels_<device>.{json,md}); with Nsight Compute on the image, ncu's
                full report of the dK/dV kernel for constant and learned slopes at 518 px
                (ncu_dkdv_{constant,learned}_<device>.txt)
    model       benchmarks/bench_model.py: forward throughput and peak memory of ViT-S and ViT-B at 518, 1022,
                2044 and 224 px, bf16: DINOv2 (learned position embedding, SDPA) against ALiBi on the fused
                kernel, auto, SDPA with the materialised bias and Flex; the two fastest again under
                torch.compile; each row names the attention kernel that ran (model_<device>.{json,md})
    train       benchmarks/bench_distill_throughput.py: one distillation optimizer step (frozen teacher,
                student forward and backward, AdamW, bf16 autocast) at 518 and 224 px, the student on the
                fused kernel, on SDPA with the materialised bias and on Flex; whether Lightning runs 2-process
                DDP on the machine's GPUs (distill_throughput_<device>.{json,md})
    seg         benchmarks/bench_vit_segment.py: segment train, then segment apply with ViT features
                (random-init backbone) on a 4096² image and a 16384² OME-Zarr mosaic, on the GPU and on the
                CPU, and the app's Train -> overlay; zarr comes from wheels carried in .whl/
                (vit_segment_<device>.{json,md})
    sweep-518   benchmarks/bench_attention.py, ViT-B at 224 and 518 px: the fused kernel (default
                backward, two-kernel backward, bias compiled out) against SDPA per kernel, with and
                without the bias, constant / per-head / learned slopes (attention_<device>_518.{json,md})
    sweep-1022  the same at 1022 px
    sweep-2072  the same at 2072 px
    flex        the fused kernel against FlexAttention (sqrt and table score_mods, and without bias),
                each compiled with max-autotune, at 518 px (attention_<device>_flex-518.{json,md})
    flex-1022   the same at 1022 px
    flex-learned  the same with learned slopes at 518 px, flex compiled without autotuning (on an H100 one
                max-autotune step of flex's learned-slope backward took 191 s: the flex phases time constant and
                per-head slopes within their limit, never learned ones) (attention_<device>_flex-learned-518.*)
    flex-dense  Flex reading the materialised bias (flex-dense) beside the table score_mod and the fused kernel,
                constant and per-head slopes, max-autotune, at 518 px (attention_<device>_flex-dense-518.*)
    flex-dense-1022  the same at 1022 px
    configs     the fused kernel and its bias-free build autotuned on the timed shapes
                (ALIBI_TRITON_AUTOTUNE=1) at 518 and 1022 px; the JSON keeps the configs the autotuner chose
                (attention_<device>_configs.{json,md})
    sqrt-offsets  the sqrt mode's offsets and wraps in int32 (the default) and in fp16 halves
                (ALIBI_TRITON_SQRT_OFFSETS), one process each: the default and the sqrt forward at 518 and 1022 px,
                constant and learned slopes (attention_<device>_sqrt-{int32,fp16}.{json,md})
    fa3         benchmarks/bench_fa3.py: the FA3-structured Gluon kernel (kernels/alibi_gluon.py) checked against
                the float64 reference (224/518/1022 px, odd grids, prefix 0/1/5; in a child process with its own
                timeout), forward and backward, then timed (forward, then fwd+bwd) beside cuDNN with and without the
                bias and the fused Triton kernel
                (fa3_<device>.{json,md})
    sass        benchmarks/bench_kernel_sass.py with the machine's Triton (3.6 there): every config,
                head_dim 64 and 128, bf16, compiled on all CPU cores (kernel_sass_sm90_triton<v>.{json,md})
    all         every phase above in order, for a machine without the 10-minute limit

A phase's time limit is ``GPU_SUITE_LIMIT`` or, for one phase, ``GPU_SUITE_LIMIT_<PHASE>`` (``-`` as
``_``), so several phases can share one 10-minute command:
``GPU_SUITE_LIMIT_MODEL=300 GPU_SUITE_LIMIT_TRAIN=120 bash benchmarks/gpu_suite.sh model train``.

Launch configs are pinned (``ALIBI_TRITON_AUTOTUNE=0``: the SASS proxy's first choice per kernel), so
no phase spends its minutes autotuning and the timed configs are the proxy's. ``--smoke`` runs a phase
on the CPU (Triton's interpreter, tiny shapes, forward-only Flex, one SASS compile) into ``$OUT`` or
``benchmarks/results/smoke/``: not a measurement, a check that every phase's commands, arguments
and files work (tests/test_bench_gpu_suite.py does that with the GPU image's missing modules blocked).
When the image lacks pytest, the tests phase installs it from wheels carried in ``.whl/``
(``pip download pytest -d .whl`` beforehand, and carry ``.whl``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ElementTree
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from report import RESULTS, SMOKE_RESULTS, missing_modules, slug  # noqa: E402

PHASE_LIMIT = int(os.environ.get("GPU_SUITE_LIMIT", "530"))
# The test files that exercise the GPU: the kernel tests and the attention backends.
# (tests/test_alibi_gluon.py's GPU tests are left to their own command: the fa3 phase checks the same kernels.)
GPU_TEST_FILES = ("tests/test_triton_attention.py", "tests/test_flex_attention.py", "tests/test_attention_backends.py",
                  "tests/test_alibi_bias.py", "tests/test_backend_choice.py")
SWEEP_BACKENDS = ("triton", "triton-two-kernel", "triton-nobias", "sdpa-bias", "sdpa-bias-cudnn",
                  "sdpa-bias-efficient", "sdpa-nobias-flash", "sdpa-nobias-cudnn", "sdpa-nobias-efficient")
FLEX_BACKENDS = ("triton", "flex", "flex-table", "flex-nobias")
# The fair baselines of one run: the default (auto) and the fused kernel beside cuDNN with and without the bias
# (2-D mask for constant slopes, 4-D per head), torch's own pick and the memory-efficient fallback.
FAIR_BACKENDS = ("auto", "triton", "triton-nobias", "sdpa-bias", "sdpa-bias-cudnn", "sdpa-bias-efficient",
                 "sdpa-nobias-cudnn", "sdpa-nobias-flash")
# auto against each of its candidates.
AUTO_BACKENDS = ("auto", "triton", "sdpa-bias")
# Flex reading the materialised bias, beside its best score_mod so far and the fused kernel.
FLEX_DENSE_BACKENDS = ("triton", "flex-table", "flex-dense")
# What the GPU image has and lacks (the env phase reports each).
OPTIONAL_MODULES = ("pytest", "lightning", "timm", "skimage", "tifffile", "jsonargparse", "fastapi", "uvicorn",
                    "xgboost", "pycocotools", "pydensecrf2", "playwright")
PHASES = ("env", "tests", "fair", "auto", "learned-ab", "model", "train", "seg", "sweep-518", "sweep-1022",
          "sweep-2072", "flex", "flex-1022", "flex-learned", "flex-dense", "flex-dense-1022", "configs", "sqrt-offsets",
          "fa3", "measure", "sass")
# What a benchmark keeps of a phase's time for writing its results after its last row starts.
ROW_RESERVE = {"model": 45, "train": 40, "seg": 30}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phases", nargs="+", choices=(*PHASES, "all"), metavar="PHASE",
                   help=f"one or more of {', '.join(PHASES)}, or all")
    p.add_argument("--smoke", action="store_true", help="CPU dry run: interpreter, tiny shapes; not a measurement")
    p.add_argument("--env-json", type=Path, help=argparse.SUPPRESS)  # the env phase's own child process
    return p.parse_args(argv)


class Phase:
    """One phase: its deadline, its log (every child's output, line by line) and the commands it ran."""

    def __init__(self, name, dest, device, smoke):
        self.name, self.dest, self.device, self.smoke = name, dest, device, smoke
        self.limit = phase_limit(name)
        self.start = time.monotonic()
        self.log_path = dest / f"gpu_suite_{name}_{device}.log"
        self.log = open(self.log_path, "w", buffering=1)
        self.commands = []
        self.lock = threading.Lock()

    def remaining(self):
        return self.limit - (time.monotonic() - self.start)

    def row_budget(self):
        """Seconds a benchmark may go on starting rows: what is left of the phase, less time to write up."""
        return str(max(1, int(self.remaining() - ROW_RESERVE.get(self.name, 30))))

    def say(self, line):
        with self.lock:
            print(line, flush=True)
            self.log.write(line + "\n")

    def env(self, **extra):
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
        if self.smoke:
            env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        env.update(extra)
        return {k: v for k, v in env.items() if v is not None}

    def start_command(self, cmd, env, prefix=""):
        """Start ``cmd`` and copy its output into the log as it comes; returns (process, reader thread, record)."""
        record = {"command": " ".join(str(c) for c in cmd), "started_s": round(time.monotonic() - self.start, 1)}
        self.say(f"== {prefix}{record['command']}")
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)

        def copy():
            for line in proc.stdout:
                self.say(prefix + line.rstrip("\n"))

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        return proc, reader, record

    def finish(self, proc, reader, record):
        """Wait for a started command until the phase's deadline; a command still running then is killed."""
        try:
            proc.wait(timeout=max(1.0, self.remaining()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            record["timed_out"] = True
        reader.join(timeout=10)
        record["returncode"] = proc.returncode
        record["seconds"] = round(time.monotonic() - self.start - record["started_s"], 1)
        self.say(f"== exit {proc.returncode}{' (phase time limit)' if record.get('timed_out') else ''} after "
                 f"{record['seconds']} s")
        self.commands.append(record)
        return record

    def run(self, cmd, env=None, prefix=""):
        return self.finish(*self.start_command(cmd, env or self.env(), prefix))


def python():
    return sys.executable


def phase_limit(name: str) -> int:
    return int(os.environ.get(f"GPU_SUITE_LIMIT_{name.upper().replace('-', '_')}", PHASE_LIMIT))


# --------------------------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------------------------

def env_phase(phase):
    out = phase.dest / f"gpu_env_{phase.device}.json"
    phase.run([python(), "benchmarks/gpu_suite.py", "env", "--env-json", out] + (["--smoke"] if phase.smoke else []))
    return [out]


def env_report(path: Path, smoke: bool):
    """Versions, device, optional modules, and one fused forward+backward against the eager reference."""
    import math
    import platform

    import numpy
    import torch
    import triton

    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
              "torch": torch.__version__, "triton": triton.__version__, "numpy": numpy.__version__,
              "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
              "settings": {k: v for k, v in os.environ.items() if k.startswith(("ALIBI_TRITON_", "TRITON_"))}}
    missing = missing_modules(OPTIONAL_MODULES)
    report["modules"] = {name: name not in missing for name in OPTIONAL_MODULES}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        report["device"] = {"name": props.name, "capability": list(torch.cuda.get_device_capability(0)),
                            "memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count}
        smi = shutil.which("nvidia-smi")
        if smi:
            report["nvidia_smi"] = subprocess.run([smi, "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                                                   "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    path.write_text(json.dumps(report, indent=2) + "\n")  # before the kernel runs: versions survive a crash

    from kernels.alibi_triton import atomic_dq_enabled, triton_alibi_attention
    from kernels.attention import eager_alibi_attention

    device = "cpu" if smoke else "cuda"
    dtype, d = (torch.float16, 32) if smoke else (torch.bfloat16, 64)  # the interpreter's bf16 dot is wrong
    grid, prefix, heads = ((3, 3) if smoke else (16, 16)), 5, 4
    n = prefix + grid[0] * grid[1]
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, heads, n, d, generator=gen).to(device, dtype) for _ in range(4))
    slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)], device=device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, slopes)]
    out = triton_alibi_attention(*leaves[:3], grid, prefix, leaves[3], True, True)
    grads = torch.autograd.grad(out, leaves, do)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, slopes)]
    ref = eager_alibi_attention(*ref_leaves[:3], grid, prefix, ref_leaves[3], True, True)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.double())

    def rel(a, b):
        return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-12))

    errors = {"out": rel(out, ref), **{name: rel(g, r) for name, g, r in zip(("dq", "dk", "dv", "dslopes"), grads,
                                                                           ref_grads)}}
    report["first_call"] = {"shape": [2, heads, n, d], "dtype": str(dtype).split(".")[-1], "grid": list(grid),
                            "slopes": "learned", "atomic_dq": atomic_dq_enabled(q),
                            "max_relative_error": {k: round(e, 6) for k, e in errors.items()},
                            "finite": all(math.isfinite(e) for e in errors.values())}
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if not report["first_call"]["finite"] or max(errors.values()) > 5e-2:
        raise SystemExit(f"the fused kernel's first call is off: {errors}")


def tests_phase(phase):
    out = phase.dest / f"gpu_tests_{phase.device}.json"
    if not _have_pytest(phase):
        out.write_text(json.dumps({"error": "pytest is not installed and no wheels were carried in .whl/"}) + "\n")
        return [out]
    shards = 2 if phase.smoke else min(8, max(2, (os.cpu_count() or 2) // 2))
    summary = {"files": list(GPU_TEST_FILES), "shards": []}
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        for i in range(shards):
            junit = Path(tmp) / f"shard{i}.xml"
            cmd = [python(), "-m", "pytest", "-q", "-p", "pytest_shard", "--shard", f"{i}/{shards}", "-p",
                   "no:cacheprovider", *(["--collect-only"] if phase.smoke else ["-rfE", f"--junitxml={junit}"]),
                   *GPU_TEST_FILES]
            running.append((i, junit, phase.start_command(cmd, phase.env(ALIBI_TRITON_AUTOTUNE="0"), f"[{i}] ")))
        for i, junit, started in running:
            record = phase.finish(*started)
            summary["shards"].append({"shard": f"{i}/{shards}", **record, **_junit_counts(junit)})
    counts = ("tests", "failures", "errors", "skipped")
    summary["total"] = {c: sum(s.get(c, 0) for s in summary["shards"]) for c in counts}
    if phase.smoke:  # collect-only: count what each share collected from the log
        summary["collected"] = _collected(phase.log_path, shards)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    return [out]


def _have_pytest(phase):
    try:
        import pytest  # noqa: F401
        return True
    except ImportError:
        pass
    wheels = ROOT / ".whl"
    if not wheels.is_dir():
        phase.say("pytest is not installed here and no wheels were carried: run `pip download pytest -d .whl` "
                  "on a machine with a registry and carry .whl")
        return False
    return phase.run([python(), "-m", "pip", "install", "--no-index", "--find-links", wheels, "pytest"])[
        "returncode"] == 0


def _junit_counts(path: Path) -> dict:
    if not path.is_file():
        return {}
    root = ElementTree.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {c: int(suite.get(c, 0)) for c in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in suite.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or "").splitlines()
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                               "message": message[0][:300] if message else ""})
    return {**counts, "seconds": float(suite.get("time", 0)), "failed": failed}


def _collected(log_path: Path, shards: int) -> dict:
    """``{share: tests collected}`` from the log of collect-only shares ("[i] N tests collected")."""
    import re

    found = {}
    for line in log_path.read_text().splitlines():
        m = re.match(r"\[(\d+)\] (\d+)(?:/\d+)? tests? collected", line)
        if m:
            found[f"{m.group(1)}/{shards}"] = int(m.group(2))
    return found


def sweep_phase(phase, sizes, tag, backends=SWEEP_BACKENDS, smoke_args=("--slopes", "constant", "--modes", "fwd+bwd"),
                gpu_args=(), args=(), settings=None):
    cmd = [python(), "benchmarks/bench_attention.py", "--models", "vit-b", "--sizes", *map(str, sizes), "--repeats",
           "3", "--rep", "50", "--backends", *backends, "--out-dir", phase.dest, "--tag", tag]
    cmd += [*args, *(("--smoke", *smoke_args) if phase.smoke else gpu_args)]
    phase.run(cmd, phase.env(ALIBI_TRITON_AUTOTUNE="0", **(settings or {})))
    name = f"attention_{'cpu-smoke' if phase.smoke else phase.device}_{tag}"
    return [phase.dest / f"{name}.json", phase.dest / f"{name}.md"]


def flex_phase(phase, size, learned=False):
    # On the CPU flex has no backward: the smoke run times forwards only.
    if learned:
        # No flex-nobias: bias-free rows come with constant slopes (the flex phase). The smoke run times
        # per-head slopes: learned ones differ only in the backward, which it lacks.
        return sweep_phase(phase, [size], f"flex-learned-{size}", FLEX_BACKENDS[:-1], ("--slopes", "per-head", "--modes", "fwd"),
                           ("--slopes", "learned"), ("--flex-mode", "default"))
    return sweep_phase(phase, [size], f"flex-{size}", FLEX_BACKENDS, ("--slopes", "constant", "--modes", "fwd"))


def learned_ab_phase(phase):
    """Every kernel of one fwd+bwd timed apart per slope kind (why the learned-slope backward ran faster), then,
    where the image has Nsight Compute, ncu's report of the dK/dV kernel with constant and with learned slopes."""
    stem = f"backward_kernels_{phase.device}"
    cmd = [python(), "benchmarks/bench_backward_kernels.py", "--out-dir", phase.dest]
    phase.run(cmd + (["--smoke"] if phase.smoke else []), phase.env(ALIBI_TRITON_AUTOTUNE="0"))
    files = [phase.dest / f"{stem}.json", phase.dest / f"{stem}.md"]
    ncu = shutil.which("ncu") or next((str(p) for p in (Path("/usr/local/cuda/bin/ncu"),) if p.is_file()), None)
    if phase.smoke or ncu is None:
        phase.say("ncu: " + ("not run in a smoke run" if phase.smoke else "not on this image; the profiler rows stand "
                             "alone"))
        return files
    for slopes in ("constant", "learned"):
        report = phase.dest / f"ncu_dkdv_{slopes}_{phase.device}.txt"
        phase.run([ncu, "--profile-from-start", "off", "--kernel-name", "regex:dkdv", "--launch-count", "1",
                   "--set", "full", "--log-file", report, python(), "benchmarks/bench_backward_kernels.py", "--ncu",
                   "--sizes", "518", "--slopes", slopes], phase.env(ALIBI_TRITON_AUTOTUNE="0"))
        files.append(report)
    return files


def sqrt_offsets_phase(phase):
    """The sqrt mode's offsets in int32 (the default) and in fp16 halves (ALIBI_TRITON_SQRT_OFFSETS, read on
    import: one process each, int32 first): the default (table forward, sqrt backward) and the sqrt forward, at
    518 and 1022 px, constant and learned slopes."""
    files = []
    for offsets in ("int32", "fp16"):
        files += sweep_phase(phase, [518, 1022], f"sqrt-{offsets}", ("triton", "triton-sqrt"),
                             gpu_args=("--slopes", "constant", "learned"),
                             settings={"ALIBI_TRITON_SQRT_OFFSETS": offsets})
    return files


def configs_phase(phase):
    """The fused kernel autotuned on the timed shapes (ALIBI_TRITON_AUTOTUNE=1): its times beside the pinned
    configs' (the fair phase) and the configs the autotuner chose, to pin from the GPU rather than the proxy."""
    cmd = [python(), "benchmarks/bench_attention.py", "--models", "vit-b", "--sizes", "518", "1022", "--repeats", "3",
           "--rep", "50", "--backends", "triton", "triton-nobias", "--out-dir", phase.dest, "--tag", "configs"]
    cmd += ["--smoke", "--slopes", "constant", "--modes", "fwd"] if phase.smoke else []
    phase.run(cmd, phase.env(ALIBI_TRITON_AUTOTUNE="1"))
    name = f"attention_{'cpu-smoke' if phase.smoke else phase.device}_configs"
    return [phase.dest / f"{name}.json", phase.dest / f"{name}.md"]


def fa3_phase(phase):
    """The FA3-structured Gluon kernel (kernels/alibi_gluon.py): checked against the float64 reference in a child
    process (a hung kernel cannot stall the phase), then timed beside cuDNN and the fused Triton kernel."""
    cmd = [python(), "benchmarks/bench_fa3.py", "--out-dir", phase.dest, "--time-limit", phase.row_budget()]
    phase.run(cmd + (["--smoke"] if phase.smoke else []), phase.env(ALIBI_TRITON_AUTOTUNE="0"))
    stem = f"fa3_{phase.device}"
    return [phase.dest / f"{stem}.json", phase.dest / f"{stem}.md"]


def sass_phase(phase):
    import triton

    cmd = [python(), "benchmarks/bench_kernel_sass.py", "--dtypes", "bfloat16", "--out-dir", phase.dest]
    if phase.smoke:
        cmd += ["--kernels", "fwd", "--head-dims", "64", "--slopes", "constant", "--default-only"]
    else:
        cmd += ["--head-dims", "64", "128", "--jobs", str(os.cpu_count() or 1)]
    # Compiles for sm_90 without launching anything: never under the interpreter.
    phase.run(cmd, phase.env(TRITON_INTERPRET=None))
    stem = f"kernel_sass_sm90_triton{'.'.join(triton.__version__.split('.')[:2])}"
    return [phase.dest / f"{stem}.json", phase.dest / f"{stem}.md"]


def model_phase(phase):
    cmd = [python(), "benchmarks/bench_model.py", "--out-dir", phase.dest, "--time-limit", phase.row_budget()]
    if phase.smoke:
        cmd += ["--smoke"]
    else:
        cmd += ["--models", "small", "base", "--sizes", "518", "1022", "2044", "224", "--compile-top", "2",
                "--compile-sizes", "518", "1022", "--seconds", "0.5"]
    phase.run(cmd, phase.env(ALIBI_TRITON_AUTOTUNE="0"))
    stem = f"model_{phase.device}"
    return [phase.dest / f"{stem}.json", phase.dest / f"{stem}.md"]


def train_phase(phase):
    cmd = [python(), "benchmarks/bench_distill_throughput.py", "--out-dir", phase.dest, "--ddp-check",
           "--time-limit", phase.row_budget()]
    if phase.smoke:
        cmd += ["--smoke", "--backends", "triton", "sdpa"]
    else:
        # The paper's batches (stage 2 at 518 px, stage 1 at 224 px); 518 first: the goal is stated there.
        cmd += ["--sizes", "518", "224", "--batch", "32", "256", "--backends", "triton", "sdpa", "flex",
                "--steps", "10", "--warmup", "3"]
    phase.run(cmd, phase.env(ALIBI_TRITON_AUTOTUNE="0"))
    stem = f"distill_throughput_{phase.device}"
    return [phase.dest / f"{stem}.json", phase.dest / f"{stem}.md"]


def carried_wheels(phase, modules):
    """Install the wheels carried in ``.whl/`` into a folder of their own when ``modules`` are missing here (the
    GPU image lacks zarr and xgboost); returns the environment's PYTHONPATH addition, or None."""
    missing = missing_modules(modules)
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not missing or not wheels:
        if missing:
            phase.say(f"{', '.join(missing)} missing and no wheels carried in .whl/: their rows will be skipped")
        return None
    target = Path(tempfile.mkdtemp(prefix="gpu_suite_wheels_"))
    phase.run([python(), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile", "--target", target,
               *wheels])
    return str(target)


def seg_phase(phase):
    extra = carried_wheels(phase, ("zarr", "xgboost"))
    env = phase.env(ALIBI_TRITON_AUTOTUNE="0")
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([extra, env["PYTHONPATH"]])
    cmd = [python(), "benchmarks/bench_vit_segment.py", "--out-dir", phase.dest, "--budget", phase.row_budget()]
    if phase.smoke:
        cmd += ["--smoke"]
    else:
        # The mosaic's ViT features first; the CPU rows last (a 10-minute command seldom reaches them).
        cmd += ["--device", "cuda", "cpu", "--rows", "vit", "image", "app", "mosaic"]
    phase.run(cmd, env)
    stem = f"vit_segment_{phase.device}"
    return [phase.dest / f"{stem}.json", phase.dest / f"{stem}.md"]


def measure_phase(phase):
    """`segment measure`'s tortuosity factor on the GPU (TauFactor's device) beside TauFactor called directly."""
    extra = carried_wheels(phase, ("zarr", "taufactor"))
    env = phase.env()
    if extra:
        env["PYTHONPATH"] = os.pathsep.join([extra, env["PYTHONPATH"]])
    devices = ["cpu"] if phase.smoke else ["cuda", "cpu"]
    cmd = [python(), "benchmarks/bench_measure.py", "--tortuosity-on", *devices, "--sides", "128", "256",
           "--out-dir", phase.dest, "--folder", Path(tempfile.mkdtemp(prefix="gpu_suite_measure_"))]
    phase.run(cmd + (["--smoke"] if phase.smoke else []), env)
    return sorted(Path(phase.dest).glob("measure_tortuosity_*"))


RUNNERS = {
    "env": env_phase,
    "tests": tests_phase,
    "fair": lambda phase: sweep_phase(phase, [518, 1022], "fair", FAIR_BACKENDS),
    "auto": lambda phase: sweep_phase(phase, [224, 518, 1022, 2072], "auto", AUTO_BACKENDS),
    "learned-ab": learned_ab_phase,
    "configs": configs_phase,
    "sqrt-offsets": sqrt_offsets_phase,
    "fa3": fa3_phase,
    "flex-dense": lambda phase: sweep_phase(phase, [518], "flex-dense-518", FLEX_DENSE_BACKENDS,
                                            ("--slopes", "constant", "--modes", "fwd"),
                                            ("--slopes", "constant", "per-head")),
    "flex-dense-1022": lambda phase: sweep_phase(phase, [1022], "flex-dense-1022", FLEX_DENSE_BACKENDS,
                                                 ("--slopes", "constant", "--modes", "fwd"),
                                                 ("--slopes", "constant", "per-head")),
    "sweep-518": lambda phase: sweep_phase(phase, [224, 518], "518"),
    "sweep-1022": lambda phase: sweep_phase(phase, [1022], "1022"),
    "sweep-2072": lambda phase: sweep_phase(phase, [2072], "2072"),
    "flex": lambda phase: flex_phase(phase, 518),
    "flex-1022": lambda phase: flex_phase(phase, 1022),
    "flex-learned": lambda phase: flex_phase(phase, 518, learned=True),
    "sass": sass_phase,
    "model": model_phase,
    "train": train_phase,
    "seg": seg_phase,
    "measure": measure_phase,
}


def device_name(smoke):
    if smoke:
        return "cpu-smoke"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device here; `bash benchmarks/gpu_suite.sh --smoke PHASE` dry-runs a "
                         "phase on the CPU")
    return slug(torch.cuda.get_device_name())


def write_status(dest: Path, device: str, name: str, entry: dict):
    """Merge one phase's entry into gpu_suite_<device>.json (earlier phases' entries in the same folder stay)."""
    path = dest / f"gpu_suite_{device}.json"
    try:
        status = json.loads(path.read_text())
    except (OSError, ValueError):
        status = {}
    status[name] = entry
    path.write_text(json.dumps(status, indent=2) + "\n")
    return path


def main(argv=None):
    args = parse_args(argv)
    if args.env_json:
        env_report(args.env_json, args.smoke)
        return 0
    if "OUT" in os.environ and os.environ["OUT"]:
        dest = Path(os.environ["OUT"])
    else:
        dest = SMOKE_RESULTS if args.smoke else RESULTS
    dest.mkdir(parents=True, exist_ok=True)
    device = device_name(args.smoke)
    phases = PHASES if "all" in args.phases else args.phases
    failed = []
    for name in phases:
        phase = Phase(name, dest, device, args.smoke)
        phase.say(f"== phase {name} on {device}{' (smoke: CPU, not a measurement)' if args.smoke else ''}, "
                  f"{phase.limit} s limit, results in {dest}")
        try:
            files = RUNNERS[name](phase)
        except Exception as err:  # a phase that cannot start is reported; the next phase still runs
            phase.say(f"== phase {name} failed: {type(err).__name__}: {err}")
            files = []
            phase.commands.append({"error": f"{type(err).__name__}: {err}"})
        ok = all(c.get("returncode") == 0 and not c.get("timed_out") for c in phase.commands) and bool(phase.commands)
        seconds = round(time.monotonic() - phase.start, 1)
        phase.say(f"== phase {name}: {'ok' if ok else 'FAILED'} after {seconds} s")
        phase.log.close()
        written = [str(f.relative_to(dest)) for f in (*files, phase.log_path) if f.is_file()]
        write_status(dest, device, name, {"ok": ok, "seconds": seconds, "limit_s": phase.limit, "smoke": args.smoke,
                                          "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                          "commands": phase.commands, "files": written})
        if not ok:
            failed.append(name)
    if failed:
        print(f"gpu_suite: {', '.join(failed)} did not finish cleanly (see the logs in {dest})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
