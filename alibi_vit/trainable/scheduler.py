"""Where ``segment apply`` runs its units of work: in this process, or on a Dask cluster.

A scheduler is named by a SPEC (:func:`parse_scheduler`):

- ``threads``: in this process, one unit after the other, each using the machine's cores through
  its libraries' threads (PyTorch, XGBoost): what ``segment apply`` always did.
- ``local:N``: a Dask ``LocalCluster`` of N worker processes on this machine, one thread each.
- ``tcp://HOST:PORT``: an existing Dask cluster (``dask scheduler`` plus ``dask worker`` processes
  that see the same files).
- ``slurm``: a ``dask_jobqueue.SLURMCluster``: worker jobs submitted with ``sbatch``, their resources
  from :class:`SlurmOptions` (the ``--slurm-*`` options or a YAML file); needs the ``slurm`` extra.

Every scheduler is used through one small interface (:class:`Executor`): ``submit`` a function
with its arguments, ``broadcast`` a value every worker needs (the model, sent once per worker), and
``completed`` to take results as they come, more units being added while it runs. On Dask a unit
that raises is retried ``retries`` times and one whose worker dies is rescheduled on another
(Dask's ``allowed-failures``, a bounded count too); on ``threads`` a unit runs once.

:func:`parse_shard` reads ``--shard I/N`` (or SLURM's array variables): the deterministic share of
the inputs that one job of a SLURM array takes, without Dask.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Executor", "SchedulerSpec", "SlurmOptions", "open_executor", "parse_scheduler", "parse_shard",
           "shard_from_environment"]

CONNECT_TIMEOUT_S = 5  # an unreachable scheduler is reported after this long (the goal: within 10 s)
RETRIES = 2  # a unit that raises runs at most 1 + RETRIES times
ALLOWED_FAILURES = 2  # a unit whose worker died this many times more is given up (KilledWorker)


@dataclass(frozen=True)
class SchedulerSpec:
    kind: str  # "threads", "local", "address", "slurm"
    workers: int = 0  # local:N
    address: str = ""  # tcp://HOST:PORT

    def __str__(self) -> str:
        return {"threads": "threads", "local": f"local:{self.workers}", "address": self.address,
                "slurm": "slurm"}[self.kind]


def parse_scheduler(text: str) -> SchedulerSpec:
    """A :class:`SchedulerSpec` from ``threads``, ``local:N``, ``tcp://HOST:PORT`` or ``slurm``; else a
    one-line ValueError."""
    text = text.strip()
    if text in ("threads", "slurm"):
        return SchedulerSpec(text)
    match = re.fullmatch(r"local:(\d+)", text)
    if match:
        workers = int(match.group(1))
        if workers < 1:
            raise ValueError(f"--scheduler {text}: a local cluster needs at least 1 worker")
        return SchedulerSpec("local", workers=workers)
    match = re.fullmatch(r"(tcp|tls)://([^:/\s]+|\[[0-9a-fA-F:]+\]):(\d+)/?", text)
    if match:
        return SchedulerSpec("address", address=text.rstrip("/"))
    raise ValueError(f"--scheduler {text}: expected threads, local:N (N worker processes here), "
                     "tcp://HOST:PORT (a running Dask scheduler) or slurm")


def parse_shard(text: str) -> tuple[int, int]:
    """(I, N) from ``I/N`` with 0 <= I < N; else a one-line ValueError (before any work)."""
    match = re.fullmatch(r"\s*(-?\d+)\s*/\s*(-?\d+)\s*", text)
    if not match:
        raise ValueError(f"--shard {text}: expected I/N, the share I (0..N-1) of N, e.g. 0/4")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1:
        raise ValueError(f"--shard {text}: N must be at least 1")
    if not 0 <= index < count:
        raise ValueError(f"--shard {text}: the share I must be in 0..{count - 1}")
    return index, count


def shard_from_environment(environ=None) -> tuple[int, int] | None:
    """(I, N) of this task of a SLURM job array, or None outside one.

    The array's tasks are numbered SLURM_ARRAY_TASK_MIN, MIN + STEP, ... (``--array=1-8`` starts at
    1, ``--array=0-30:10`` steps by 10): I = (SLURM_ARRAY_TASK_ID - MIN) / STEP, N =
    SLURM_ARRAY_TASK_COUNT, the same arithmetic as configs/slurm/segment_apply.sbatch. An array
    given as a list (``--array=1,5,6``) has no such numbering: an error asking for ``--shard``."""
    env = os.environ if environ is None else environ
    if "SLURM_ARRAY_TASK_ID" not in env:
        return None
    try:
        task, count = int(env["SLURM_ARRAY_TASK_ID"]), int(env["SLURM_ARRAY_TASK_COUNT"])
        first, step = int(env.get("SLURM_ARRAY_TASK_MIN", 0)), int(env.get("SLURM_ARRAY_TASK_STEP", 1) or 1)
    except (KeyError, ValueError) as err:
        raise ValueError(f"the SLURM array variables cannot give a shard ({err}): give --shard I/N") from None
    index, rest = divmod(task - first, step)
    if rest or not 0 <= index < count:
        raise ValueError(f"SLURM array task {task} (first {first}, step {step}, {count} tasks) is not on an evenly "
                         "stepped range, e.g. --array=0-7 or 1-8: give --shard I/N")
    return index, count


@dataclass
class SlurmOptions:
    """Resources of the worker jobs of ``--scheduler slurm``: ``jobs`` jobs, each ``cores`` single-threaded
    Dask worker processes sharing ``memory`` for at most ``walltime``. ``config``: a YAML file of
    ``SLURMCluster`` keyword arguments; the options given here (not None) override it, and it
    overrides :attr:`DEFAULTS`."""

    DEFAULTS = {"cores": 4, "memory": "16GB", "walltime": "01:00:00"}

    jobs: int = 1
    cores: int | None = None
    memory: str | None = None
    walltime: str | None = None
    queue: str | None = None
    account: str | None = None
    config: Path | None = None

    def cluster_kwargs(self) -> dict:
        """The ``SLURMCluster`` keyword arguments: the defaults, then the YAML file's, then these options."""
        kwargs = dict(self.DEFAULTS)
        if self.config is not None:
            import yaml

            try:
                loaded = yaml.safe_load(Path(self.config).read_text()) or {}
            except OSError as err:
                raise ValueError(f"--slurm-config {self.config}: {err.strerror or err}") from None
            except yaml.YAMLError as err:
                raise ValueError(f"--slurm-config {self.config} is not valid YAML ({str(err).splitlines()[0]})") from None
            if not isinstance(loaded, dict):
                raise ValueError(f"--slurm-config {self.config}: expected a mapping of SLURMCluster arguments "
                                 "(cores: 8, memory: 32GB, ...)")
            kwargs.update(loaded)
        given = {"cores": self.cores, "memory": self.memory, "walltime": self.walltime, "queue": self.queue,
                 "account": self.account}
        kwargs.update({k: v for k, v in given.items() if v is not None})
        kwargs.setdefault("processes", kwargs["cores"])  # one thread per worker process, as local:N
        return kwargs


class _SerialFuture:
    """A unit of ``threads``: run when the loop reaches it, in this process."""

    def __init__(self, fn, args):
        self._call = (fn, args)
        self._result = self._error = None
        self.done = False

    def run(self) -> None:
        fn, args = self._call
        try:
            self._result = fn(*args)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - handed to the caller like a Dask future's error
            self._error = err
        self.done, self._call = True, None

    def result(self):
        if self._error is not None:
            raise self._error
        return self._result


class Executor:
    """The interface :func:`open_executor` yields; see the module docstring."""

    dashboard: str | None = None  # the Dask dashboard's address, when there is one

    def broadcast(self, value):
        """A handle to ``value`` for every unit to take as an argument (sent to each worker once)."""
        return value

    def submit(self, fn, *args, follow_up: bool = False):
        """Run ``fn(*args)`` as a unit; ``follow_up``: it continues work already under way (runs first)."""
        raise NotImplementedError

    def completed(self, futures):
        """Yield each future once it has finished (its ``result()`` returns or raises); units added to
        the returned iterator with ``add`` while iterating are waited for too."""
        raise NotImplementedError


class _Completed:
    """A queue of serial futures that runs each as the loop asks for it: :meth:`Executor.completed` of
    threads. Units added while it runs (an image's next pass) go first, so one image is finished before
    the next is started, as a single process always did."""

    def __init__(self, futures):
        self._queue, self._added = deque(futures), []

    def add(self, future) -> None:
        self._added.append(future)

    def __iter__(self):
        while self._queue or self._added:
            self._queue.extendleft(reversed(self._added))
            self._added = []
            future = self._queue.popleft()
            future.run()
            yield future


class SerialExecutor(Executor):
    def submit(self, fn, *args, follow_up: bool = False):
        return _SerialFuture(fn, args)

    def completed(self, futures):
        return _Completed(futures)


class DaskExecutor(Executor):
    def __init__(self, client, local: bool):
        import importlib.util

        self.client = client
        served = "dashboard" in client.scheduler_info().get("services", {})
        # Without bokeh a scheduler started here serves only a page asking for it; a remote one may have it.
        if served and (not local or importlib.util.find_spec("bokeh") is not None):
            self.dashboard = client.dashboard_link

    def broadcast(self, value):
        # A task that returns the value, not scattered data: if every worker holding it dies, Dask makes it
        # again from the task (scattered data would be lost, and every unit needing it cancelled).
        handle = self.client.submit(_value, value, pure=False)
        self.client.replicate([handle])
        return handle

    def submit(self, fn, *args, follow_up: bool = False):
        return self.client.submit(fn, *args, pure=False, retries=RETRIES, priority=1 if follow_up else 0)

    def completed(self, futures):
        from distributed import as_completed

        return as_completed(list(futures))


def _value(value):
    return value


def _dask_config():
    import dask

    # A worker that dies (killed, out of memory) while running a unit: the unit goes to another worker,
    # at most ALLOWED_FAILURES more times; then it fails with KilledWorker and is reported. A unit's memory
    # is its own arrays, not Dask's data, so spilling to disk or pausing a worker cannot free any (a paused
    # worker would only stop taking units): a worker over 95% of its limit is restarted instead.
    return dask.config.set({"distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
                            "distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
                            "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": 0.95})


@contextmanager
def open_executor(spec: SchedulerSpec, *, worker_memory: str | None = None, slurm: SlurmOptions | None = None):
    """An :class:`Executor` for ``spec`` (a cluster started here is stopped on leaving); a scheduler that
    cannot be reached, or a SLURM without ``sbatch``, is a one-line ValueError before any work."""
    if spec.kind == "threads":
        yield SerialExecutor()
        return
    if spec.kind == "slurm":  # before importing Dask: the machine may have no SLURM at all
        if shutil.which("sbatch") is None:
            raise ValueError("--scheduler slurm: sbatch is not on PATH, so no SLURM job can be submitted from this "
                             "machine: run on a SLURM login node, or use --shard with a job array "
                             "(configs/slurm/segment_apply.sbatch)")
        try:
            import dask_jobqueue  # noqa: F401
        except ImportError:
            raise ValueError("--scheduler slurm needs dask-jobqueue: pip install 'alibi-vit[slurm]'") from None
    import logging

    from distributed import Client, LocalCluster

    with _dask_config():
        cluster = None
        try:
            if spec.kind == "local":
                cluster = LocalCluster(n_workers=spec.workers, threads_per_worker=1, processes=True,
                                       memory_limit=worker_memory or "auto", dashboard_address=":0",
                                       silence_logs=logging.CRITICAL)  # failures are listed by the run
                client = Client(cluster)
            elif spec.kind == "slurm":
                from dask_jobqueue import SLURMCluster

                options = slurm or SlurmOptions()
                kwargs = options.cluster_kwargs()
                if worker_memory and options.memory is None:
                    kwargs["memory"] = worker_memory
                cluster = SLURMCluster(**kwargs)
                cluster.scale(jobs=options.jobs)
                client = Client(cluster)
                print(f"waiting for the first of {options.jobs} SLURM worker job(s) to start", file=sys.stderr)
                client.wait_for_workers(1)
            else:
                try:
                    client = Client(spec.address, timeout=CONNECT_TIMEOUT_S)
                except (OSError, TimeoutError) as err:
                    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
                    raise ValueError(f"--scheduler {spec.address}: cannot reach a Dask scheduler there within "
                                     f"{CONNECT_TIMEOUT_S} s ({reason}): start one (dask scheduler) or check the "
                                     "address") from None
            try:
                yield DaskExecutor(client, local=cluster is not None)
            finally:
                client.close()
        finally:
            if cluster is not None:
                cluster.close()
