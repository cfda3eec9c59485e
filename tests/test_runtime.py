"""alibi_vit.runtime: OpenMP threads wait passively when the machine is busy, and only then."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_CHECK = ("import os\nos.getloadavg = lambda: ({load}, 0.0, 0.0)\nfrom alibi_vit.runtime import "
          "prefer_passive_threads_when_busy as prefer\nprint(prefer(), os.environ.get('OMP_WAIT_POLICY'))\n")


def _run(load, **env):
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _CHECK.format(load=load)], env={**base, **env}, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.split()


def test_passive_waiting_only_on_a_busy_machine_and_never_over_the_users_choice():
    cores = len(os.sched_getaffinity(0))
    assert _run(cores + 0.5) == ["True", "PASSIVE"]
    assert _run(max(cores - 1.5, 0.0)) == ["False", "None"]
    assert _run(cores * 10, OMP_WAIT_POLICY="ACTIVE") == ["False", "ACTIVE"]


def test_both_commands_set_it_before_pytorch_loads():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lightning"] == "lit_modules.launch:main"
    launch = (ROOT / "lit_modules" / "launch.py").read_text()
    assert "import torch" not in launch and "prefer_passive_threads_when_busy()" in launch
