"""Checkpoints that are complete or absent: written under a temporary name in their folder, then renamed.

Lightning's own writer serialises into memory and writes through ``fsspec``, whose local files go to
a temporary file in the system's temp folder and are then moved; where that folder is on another
disk, the move copies into the final name, so a disk that fills up leaves a truncated ``last.ckpt``
that ``--ckpt_path=last`` later picks up. :class:`AtomicCheckpointIO` writes each checkpoint to
``.<name>.partial-<pid>`` beside its final name, flushes it to disk and renames it (atomic within a
file system), so the final name holds the previous checkpoint or the new one, never part of one. A
failed write removes the partial file and raises :class:`CheckpointWriteError`, whose message is
one line naming the checkpoint and the cause. Remote paths (``s3://``...) keep Lightning's writer.

``lightning fit`` (lit_modules/cli.py) installs it unless the config names a CheckpointIO plugin.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "CheckpointWriteError"]


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (a full disk, a read-only folder); nothing partial is left.
    ``CheckpointWriteError(errno, message)``: ``str()`` is the message alone."""

    def __str__(self) -> str:
        return str(self.args[-1])


class AtomicCheckpointIO(TorchCheckpointIO):
    """:class:`~lightning.pytorch.plugins.io.TorchCheckpointIO` whose local saves are atomic (module docstring)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = os.fspath(path)
        folder, name = os.path.split(os.path.abspath(path))
        partial = os.path.join(folder, f".{name}.partial-{os.getpid()}")
        try:
            os.makedirs(folder, exist_ok=True)
            with open(partial, "wb") as f:
                torch.save(checkpoint, f)  # streamed to the file: no second copy of the checkpoint in memory
                f.flush()
                os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
            os.replace(partial, path)
        except OSError as err:
            try:
                os.unlink(partial)
            except OSError:
                pass
            reason = err.strerror or str(err) or type(err).__name__
            raise CheckpointWriteError(err.errno, f"cannot write checkpoint {path}: {reason}; the checkpoints "
                                                  "written before are kept") from err
