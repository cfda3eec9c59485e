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


def test_the_thread_budget_is_omp_num_threads_when_set_else_the_usable_cores(monkeypatch):
    """Dask sets OMP_NUM_THREADS=1 in its workers: the process's own pools (overlay bands, threshold sorts, the
    next tile's filters) then keep to one thread, as XGBoost and OpenCV do."""
    from alibi_vit.runtime import omp_threads, thread_budget

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert omp_threads() is None and thread_budget() == cores
    for value in ("0", "-2", "two", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", value)
        assert omp_threads() is None and thread_budget() == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert omp_threads() == 3 and thread_budget() == 3


def test_a_one_thread_process_predicts_without_the_next_tile_thread(monkeypatch):
    """With a thread budget of one (a Dask worker) the next tile's filters are not computed ahead on a thread of
    their own, and the probabilities are the same as with it."""
    import threading

    import numpy as np

    from alibi_vit.trainable.segmenter import TrainableSegmenter

    rng = np.random.default_rng(0)
    image = rng.random((96, 96)).astype(np.float32)
    image[:, 48:] += 1.0
    labels = np.zeros((96, 96), np.uint8)
    labels[10:80, 5:30], labels[10:80, 60:90] = 1, 2
    seg = TrainableSegmenter(tile=42, classifier_params={"n_estimators": 3}).fit([image], [labels])
    started = []
    original = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), original(self))[1])
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    ahead = seg.predict_proba([image])[0]
    assert any(name.startswith("alibi-vit-features") for name in started)
    started.clear()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    alone = seg.predict_proba([image])[0]
    assert not any(name.startswith("alibi-vit-features") for name in started)
    np.testing.assert_array_equal(alone, ahead)
