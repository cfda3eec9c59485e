"""Process settings the ``alibi-vit`` and ``lightning`` commands make before PyTorch loads.

OpenMP threads (PyTorch's intra-op pool) that wait for work spin for a while before they sleep. When
other processes keep every core busy (a shared workstation, a CI runner, a login node), a spinning
thread takes the CPU from the very thread it waits for. Measured on the 2-core build machine at load
18-21 (``benchmarks/results/command_times_cpu.md``): the demo distillation took 29.6 s of CPU with the
default policy and 8.7 s with ``OMP_WAIT_POLICY=PASSIVE`` (wall 92 s against 27 s), the probe demo with
``robustness`` 27.6 s against 12.0 s. So when the load average at start is at least the number of usable
cores, the commands set ``OMP_WAIT_POLICY=PASSIVE``; one the user set is kept, and on a machine with
cores to spare nothing changes.
"""

from __future__ import annotations

import os
import sys

__all__ = ["omp_threads", "prefer_passive_threads_when_busy", "thread_budget", "usable_cores"]


def prefer_passive_threads_when_busy() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` if the machine is busy, the user did not choose a policy and PyTorch has
    not loaded yet (OpenMP reads the variable once, when it starts); whether it was set."""
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules or not hasattr(os, "getloadavg"):
        return False
    if os.getloadavg()[0] < usable_cores():
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` when set to a positive number, else None. XGBoost and PyTorch size their pools by it,
    and Dask sets it to 1 in its worker processes so that N single-threaded workers use N cores."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    return int(threads) if threads.isdigit() and int(threads) > 0 else None


def thread_budget() -> int:
    """Threads this process's own pools may keep busy: :func:`omp_threads` when set, else :func:`usable_cores`."""
    return omp_threads() or usable_cores()
