"""What every benchmark records: the device and software it ran on, and its results as JSON + Markdown."""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# --smoke runs check that a script works; their figures are not measurements and stay out of git.
SMOKE_RESULTS = RESULTS / "smoke"


def slug(name: str) -> str:
    """File-name form of a device name: 'NVIDIA H100 80GB HBM3' → 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def command_line(script: str, argv) -> str:
    """The command that reproduces a run, as a user would type it from the project folder."""
    return " ".join(shlex.quote(a) for a in ["python", f"benchmarks/{script}", *argv])


def environment() -> dict:
    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def missing_modules(names) -> list[str]:
    """The modules of ``names`` this Python cannot import, found without importing them."""
    import importlib.util

    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a meta-path blocker raises rather than answering None
            found = False
        if not found:
            missing.append(name)
    return missing


def error_status(exc: BaseException, width: int = 200) -> str:
    """A benchmark row's status for a failure: the exception's type and the start of its first line."""
    first_line = str(exc).splitlines()[0][:width] if str(exc) else ""
    return f"error: {type(exc).__name__}: {first_line}"


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded: what a benchmark row records beside its times."""
    return [round(v, 2) for v in os.getloadavg()]


def write_report(out_dir: Path | None, stem: str, payload: dict, markdown: list[str], *,
                 smoke: bool = False) -> tuple[Path, Path]:
    """Write ``stem.json`` (the payload) and ``stem.md`` (the lines) into ``out_dir``.

    Without an ``out_dir``, real runs go to ``benchmarks/results/`` (committed) and smoke runs to
    ``benchmarks/results/smoke/`` (ignored by git).
    """
    out_dir = Path(out_dir) if out_dir is not None else (SMOKE_RESULTS if smoke else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    md_path.write_text("\n".join(markdown) + "\n")
    return md_path, json_path
