"""The options naming where ``segment apply`` and ``segment measure`` run their units of work (a Dask scheduler,
SLURM worker jobs), parsed without importing Dask; :func:`open_scheduler` opens what they name."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from .options import at_least

__all__ = ["add_scheduler_arguments", "memory_size", "open_scheduler"]


def memory_size(text: str) -> str:
    """A memory size such as 2GB, 512MiB, 1.5G or 4000000000 (bytes), as given; an argparse type, so a value
    that is not one is a one-line error naming the option, before any worker starts."""
    if not re.fullmatch(r"\s*\d+(\.\d+)?\s*([kKmMgGtTpP]i?[bB]?|[bB])?\s*", text):
        raise argparse.ArgumentTypeError(f"expected a size such as 2GB, 512MiB or 1.5G, got {text!r}")
    return text.strip()


def add_scheduler_arguments(g) -> None:
    """``--scheduler``, ``--worker-memory`` and the ``--slurm-*`` options, into the argument group ``g``."""
    g.add_argument("--scheduler", default="threads", metavar="SPEC",
                   help="threads (default: this process), local:N (N worker processes on this machine), "
                        "tcp://HOST:PORT (a running Dask scheduler whose workers see the same files) or slurm "
                        "(Dask workers as SLURM jobs; pip install 'alibi-vit[slurm]')")
    g.add_argument("--worker-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory limit per worker of local:N or per SLURM job, e.g. 2GB (default: local:N shares "
                        "the machine's memory; slurm: --slurm-memory)")
    g.add_argument("--slurm-jobs", type=at_least(1), default=1, metavar="N", help="SLURM worker jobs (default 1)")
    g.add_argument("--slurm-cores", type=at_least(1), default=None, metavar="N",
                   help="cores per SLURM job, one single-threaded worker process each (default 4)")
    g.add_argument("--slurm-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory per SLURM job (default 16GB)")
    g.add_argument("--slurm-walltime", default=None, metavar="HH:MM:SS",
                   help="time limit per SLURM job (default 01:00:00)")
    g.add_argument("--slurm-queue", default=None, metavar="PARTITION", help="SLURM partition (default: the site's)")
    g.add_argument("--slurm-account", default=None, metavar="ACCOUNT", help="SLURM account to charge")
    g.add_argument("--slurm-config", type=Path, default=None, metavar="YAML",
                   help="a YAML mapping of further dask_jobqueue.SLURMCluster arguments (job_extra_directives, "
                        "job_script_prologue, ...); the --slurm-* options given override it")


def open_scheduler(args):
    """The executor context of the parsed ``args`` (:func:`alibi_vit.trainable.scheduler.open_executor`)."""
    from ..trainable.scheduler import SlurmOptions, open_executor, parse_scheduler

    slurm = SlurmOptions(jobs=args.slurm_jobs, cores=args.slurm_cores, memory=args.slurm_memory,
                         walltime=args.slurm_walltime, queue=args.slurm_queue, account=args.slurm_account,
                         config=args.slurm_config)
    return open_executor(parse_scheduler(args.scheduler), worker_memory=args.worker_memory, slurm=slurm)
