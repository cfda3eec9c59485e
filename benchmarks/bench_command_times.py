"""Wall and CPU time of the README's try-it commands: cold (first run after install) and warm, and with the
OpenMP threads waiting actively (the default) or passively.

"Cold" here is what a first run pays that a second does not and that can be reproduced without reinstalling:
the project's bytecode (a fresh copy of the sources, no ``__pycache__``) and matplotlib's font cache (an empty
``MPLCONFIGDIR``). The operating system's file cache of the 6 GB of libraries is not dropped (that needs
root on a machine others share): on a real first run, reading them from disk comes on top.

Every run records the 1-minute load average at its start: on a shared machine the wall time follows the
load, so compare the rows of one report (they ran one after another), and prefer the CPU columns.

    python benchmarks/bench_command_times.py            # all commands, about 10 minutes on 2 idle cores
    python benchmarks/bench_command_times.py --smoke    # one quick command, into benchmarks/results/smoke/
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import command_line, write_report

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {  # name → the README's command lines, run in one scratch folder
    "demo distillation": [["lightning", "fit", "--config", "configs/demo.yaml", "--trainer.enable_progress_bar=false"]],
    "probe demo + robustness": [
        ["lightning", "fit", "--config", "configs/probe_demo.yaml", "--trainer.enable_progress_bar=false"],
        ["alibi-vit", "robustness", "--checkpoint", "runs/probe_demo/checkpoints/last.ckpt", "--num-workers", "0",
         "--csv", "runs/probe_demo/robustness.csv"]],
    "segment benchmark --synthetic": [["alibi-vit", "segment", "benchmark", "--synthetic", "--out", "runs/bench"]],
}
SMOKE = {"alibi-vit --help": [["alibi-vit", "--help"]]}
ENTRY = {"lightning": "from lit_modules.launch import main", "alibi-vit": "from alibi_vit.cli.main import main"}


def _run(lines, source: Path, env: dict, policy: str | None) -> dict:
    """Run the command lines in a fresh scratch folder with the sources of ``source``; times summed. ``policy``
    None is OpenMP's default (torch is imported first, so the commands' own choice, alibi_vit.runtime, does
    not apply)."""
    env = {**env, "OMP_WAIT_POLICY": policy} if policy else env
    work = Path(tempfile.mkdtemp(prefix="bench_cmd_"))
    shutil.copytree(source / "configs", work / "configs")
    load = os.getloadavg()[0]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    for line in lines:
        code = f"import sys\n{'' if policy else 'import torch'}\n{ENTRY[line[0]]}\nsys.argv = {line!r}\nsys.exit(main())"
        subprocess.run([sys.executable, "-c", code], cwd=work, env={**env, "PYTHONPATH": str(source)}, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(work, ignore_errors=True)
    return {"wall_s": round(wall, 2), "user_s": round(after.ru_utime - before.ru_utime, 2),
            "sys_s": round(after.ru_stime - before.ru_stime, 2), "load_at_start": round(load, 2)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one quick command, results to benchmarks/results/smoke/")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    commands = SMOKE if args.smoke else COMMANDS
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "src"  # the sources without any bytecode: a first run compiles them
        shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns("__pycache__", ".git", ".venv", "runs", "site"))
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PYTHONPYCACHEPREFIX")}
        for name, lines in commands.items():
            env = {**base, "MPLCONFIGDIR": str(Path(scratch) / f"mpl_{len(rows)}")}
            rows.append({"command": name, "run": "cold", "omp_wait_policy": "default", **_run(lines, source, env, None)})
            for policy in (None, "PASSIVE"):
                rows.append({"command": name, "run": "warm", "omp_wait_policy": policy or "default",
                             **_run(lines, source, env, policy)})
    cores = len(os.sched_getaffinity(0))
    md = [f"# README commands: wall and CPU time, cold and warm ({cores} CPU cores, no GPU)", "",
          f"`{command_line('bench_command_times.py', argv or sys.argv[1:])}`", "",
          "cold: fresh bytecode and matplotlib font cache (the OS file cache is not dropped); warm: the same "
          "again. OMP_WAIT_POLICY default: OpenMP's (a waiting thread spins a while, then sleeps); PASSIVE: it "
          "sleeps at once, what the commands choose when the load average is at least the core count.", "",
          "| command | run | OMP_WAIT_POLICY | wall s | user s | sys s | load at start |", "|---|---|---|---:|---:|---:|---:|"]
    md += [f"| {r['command']} | {r['run']} | {r['omp_wait_policy']} | {r['wall_s']} | {r['user_s']} | {r['sys_s']} | "
           f"{r['load_at_start']} |" for r in rows]
    import platform

    payload = {"machine": {"cpu_cores": cores, "processor": platform.processor() or platform.machine()},
               "python": platform.python_version(), "rows": rows}
    for path in write_report(args.out_dir, "command_times_cpu", payload, md, smoke=args.smoke):
        print(f"wrote {path}")
    print("\n".join(md))


if __name__ == "__main__":
    main()
