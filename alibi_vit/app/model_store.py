"""The session's last trained model on disk, so a restarted app has it again.

Layout inside the session folder::

    model/current.json   the model's record (id, classes, training time, the label versions it was
                         trained on, the settings it belongs to) and the folder holding it
    model/<id>/          the model as TrainableSegmenter.save writes it (what ``segment apply`` reads)

A model folder is written whole under a temporary name and renamed, then ``current.json`` is
replaced atomically, then older folders are removed: at every moment ``current.json`` names a
complete model.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

from .session import write_atomic

__all__ = ["ModelStore"]


class ModelStore:
    """Saves and loads the current model of a session's ``model/`` folder (thread-safe)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.lock = threading.Lock()

    def save(self, segmenter, record: dict) -> Path:
        """Write ``segmenter`` as the current model with ``record`` (which has its ``id``); a model
        of that id already saved is kept as it is."""
        with self.lock:
            name = f"{int(record['id']):06d}"
            target = self.folder / name
            if not target.is_dir():
                tmp = self.folder / f".{name}.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    segmenter.save(tmp)
                    tmp.rename(target)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            write_atomic(self.folder / "current.json",
                         (json.dumps({**record, "folder": name}, indent=2) + "\n").encode())
            for old in self.folder.iterdir():
                if old.is_dir() and old.name != name:
                    shutil.rmtree(old, ignore_errors=True)
            return target

    def record(self) -> dict | None:
        """The current model's record, or None when there is none (or it cannot be read)."""
        try:
            record = json.loads((self.folder / "current.json").read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and (self.folder / str(record.get("folder"))).is_dir() else None

    def load(self, device=None):
        """(segmenter, record) of the current model, or None; a model that cannot be loaded is a ValueError."""
        from ..trainable import TrainableSegmenter

        with self.lock:
            record = self.record()
            if record is None:
                return None
            return TrainableSegmenter.load(self.folder / record["folder"], device=device), record

    def copy_current(self, dest: Path) -> dict:
        """Copy the current model to ``dest`` (replacing it); returns its record."""
        with self.lock:
            record = self.record()
            if record is None:
                raise FileNotFoundError(f"no model is saved in {self.folder}: press Train")
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(self.folder / record["folder"], dest)
            return record
