"""A user feature hook for the scale-out tests (tests/test_segment_scale_out.py), imported by name on Dask
workers: the image's grey values as one extra feature, and two ways to misbehave, switched on by files in
the folder named by ``ALIBI_VIT_TEST_HOOK_DIR``:

- ``hang``: the first call (across all processes) writes its pid to ``pid`` and sleeps, so a test can kill
  the worker running it mid-task; later calls do not sleep.
- ``fail_flat``: every call on a flat image (one grey value) raises RuntimeError and appends a line to
  ``calls_flat``, so a test can count the attempts.
"""

import os
import time
from pathlib import Path

import numpy as np

HANG_S = 120


def features(image01):
    folder = Path(os.environ.get("ALIBI_VIT_TEST_HOOK_DIR", "/nonexistent"))
    grey = image01 if image01.ndim == 2 else image01.mean(-1)
    if (folder / "fail_flat").exists() and grey.max() == grey.min():
        with open(folder / "calls_flat", "a") as f:
            f.write(f"{os.getpid()}\n")
        raise RuntimeError("the test hook refuses flat images")
    if (folder / "hang").exists():
        try:
            fd = os.open(folder / "pid", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            pass
        else:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            time.sleep(HANG_S)  # killed long before
    return grey[..., None].astype(np.float32)
