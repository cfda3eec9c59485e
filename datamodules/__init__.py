"""Lightning DataModules: image folders and COCO for distillation, segmentation datasets for the probes."""

import os
import warnings

_WARNED_WORKERS: set[tuple[int, int]] = set()


def usable_workers(requested: int) -> int:
    """DataLoader worker processes: at most the CPU cores this process may use (more would only queue).

    A cut is said once per process and setting, not once per loader (a command builds several).
    """
    requested = int(requested)
    if requested < 0:
        raise ValueError(f"num_workers must be 0 or more, got {requested}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if requested <= cores:
        return requested
    if (requested, cores) not in _WARNED_WORKERS:
        _WARNED_WORKERS.add((requested, cores))
        warnings.warn(f"num_workers={requested} exceeds the {cores} CPU cores available here: using {cores}",
                      stacklevel=3)
    return cores


class DatasetLayoutError(FileNotFoundError):
    """A dataset root that does not have the documented layout; the message shows the layout expected.

    The ``lightning`` command prints it as an error message (no traceback), whichever datamodule raised it.
    """
