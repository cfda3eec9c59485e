"""An output folder that ``alibi-vit segment apply`` can write safely: what it holds always agrees with itself.

Four rules, each against a way outputs were lost or mixed:

- **Unique names.** :func:`output_names` gives every image its own output names: ``x.png`` and
  ``x.tif`` side by side become ``x_png_mask.png`` and ``x_tif_mask.png``, and ``x.png`` found in two
  ``--images`` folders goes to a subfolder named after each folder (``a/x_mask.png``, ``b/x_mask.png``),
  so no mask overwrites another and no two CSV rows share a name.
- **One run at a time.** :class:`OutputFolder` holds a lock file, ``.segment.lock``, naming the host and
  process that write the folder; a second run is refused while that process lives. A lock left by a
  process that died (same host, no such process) is taken over, with a warning.
- **One model and setting per folder.** The run manifest, ``segment_run.json``, names the model (its
  folder and a SHA-256 digest of its files) and the settings that change masks (CRF, modal filter). A
  run whose model or settings differ is refused with the differences named, so masks of two models are
  never mixed; so is a folder with masks that no manifest accounts for (written before manifests existed).
- **Masks and CSV agree.** Each image's files are written into a staging folder, then moved into place
  together with signals held off, and only then recorded. The manifest lists every image's files and
  area-fraction rows, and the CSV is written from it (atomically, by renaming a complete file) when the
  run ends, however it ends: finished, failed, Ctrl-C or SIGTERM. An image re-segmented replaces its
  earlier files; an image of an earlier run with the same model stays, with its row. Only a process
  killed outright (SIGKILL, power loss) can leave up to ``SAVE_EVERY_S`` seconds of images written but
  not yet listed; the manifest then says ``"complete": false``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CSV_NAME", "LOCK_NAME", "MANIFEST_NAME", "OutputFolder", "OutputName", "model_digest", "output_names"]

LOCK_NAME = ".segment.lock"
MANIFEST_NAME = "segment_run.json"
CSV_NAME = "area_fractions.csv"
STAGING_NAME = ".segment.partial"
MANIFEST_FORMAT = 1
SAVE_EVERY_S = 30.0  # manifest and CSV are rewritten at most this often during a run (and always at its end)
_OUTPUT_MARKERS = ("_mask.", CSV_NAME)  # files that only a segment run writes
COMPARED = ("model_digest", "crf", "modal")  # settings two runs must share to write one folder; others are recorded


@dataclass(frozen=True)
class OutputName:
    folder: Path  # relative to the output folder
    stem: str  # outputs are <stem>_mask.png, <stem>_overlay.png, ...
    row: str  # the image's name in the CSV


def output_names(files: list[Path], sources: list[Path], relative: list[Path]) -> tuple[list[OutputName], list[str]]:
    """Unique output names for ``files`` (found in ``sources[i]`` at path ``relative[i]`` below it), and notes
    saying which names were changed and why."""
    rows = [rel.as_posix() for rel in relative]
    folders = [rel.parent for rel in relative]
    notes = []
    # The same relative path from several --images folders: each goes below a folder named after its source.
    for row in sorted({r for r in rows if rows.count(r) > 1}):
        clashing = [i for i, r in enumerate(rows) if r == row]
        prefixes = _distinct_names([Path(sources[i]).resolve().name or "images" for i in clashing])
        for i, prefix in zip(clashing, prefixes):
            folders[i], rows[i] = Path(prefix) / folders[i], f"{prefix}/{row}"
        notes.append(f"{row} is in several --images folders: its outputs go to " + ", ".join(f"{p}/" for p in prefixes))
    stems = [f.stem for f in files]
    keys = [(folder, stem) for folder, stem in zip(folders, stems)]
    # Names that differ only in their extension (x.png, x.tif): the extension joins the stem.
    for key in sorted({k for k in keys if keys.count(k) > 1}, key=str):
        clashing = [i for i, k in enumerate(keys) if k == key]
        for i in clashing:
            stems[i] = f"{stems[i]}_{files[i].suffix.lstrip('.').lower()}"
        notes.append(f"{', '.join(files[i].name for i in clashing)} share the name {key[1]}: their outputs are named "
                     + ", ".join(f"{stems[i]}_mask" for i in clashing))
    # Whatever still clashes (x.tif beside x_tif.png) is numbered.
    taken = set()
    for i, key in enumerate(zip(folders, stems)):
        if key in taken:
            stems[i] = next(f"{key[1]}-{n}" for n in range(2, len(files) + 2) if (key[0], f"{key[1]}-{n}") not in taken)
            notes.append(f"{rows[i]}: outputs named {stems[i]} (another image's outputs have its name)")
        taken.add((folders[i], stems[i]))
    return [OutputName(folder, stem, row) for folder, stem, row in zip(folders, stems, rows)], notes


def _distinct_names(names: list[str]) -> list[str]:
    out = []
    for name in names:
        candidate, n = name, 2
        while candidate in out:
            candidate, n = f"{name}-{n}", n + 1
        out.append(candidate)
    return out


def model_digest(folder: Path) -> str:
    """SHA-256 of a model folder's files (names and contents): two folders with equal digests segment alike."""
    sha = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        sha.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                sha.update(chunk)
    return sha.hexdigest()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class OutputFolder:
    """The output folder of one ``segment apply`` run; use as a context manager (see the module docstring).

    ``settings``: what makes two runs' masks comparable (the model's digest, CRF, modal filter...); a folder
    whose manifest records other settings is refused. ``write_csv(path, names, counts)`` writes the
    area-fraction table from ``names`` (CSV rows) and ``counts`` ((class pixel counts, pixels) per row).
    """

    def __init__(self, path: Path, settings: dict, write_csv, option: str = "--out"):
        self.path, self.settings, self.option = Path(path), dict(settings), option
        self._write_csv = write_csv
        self.staging = self.path / STAGING_NAME
        self.images: dict[str, dict] = {}
        self._locked = False
        self._saved_at = 0.0

    # -- entering: lock, manifest, staging ---------------------------------------------------------------
    def __enter__(self) -> "OutputFolder":
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            self._read_manifest()
            shutil.rmtree(self.staging, ignore_errors=True)  # what a killed run left half-written
            self._save(complete=False)
            self._saved_at = time.monotonic()
        except BaseException:
            self._unlock()
            raise
        self._previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (scancel, kill) ends the run like Ctrl-C: __exit__ still writes the CSV and frees the lock.
            self._previous_sigterm = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        return self

    def _lock(self) -> None:
        lock = self.path / LOCK_NAME
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._lock_holder(lock)
                if holder and holder.get("host") == me["host"] and not _process_alive(int(holder.get("pid", -1))):
                    warnings.warn(f"{self.option} {self.path}: taking over the lock of process {holder['pid']}, "
                                  "which ended without releasing it")
                    lock.unlink(missing_ok=True)
                    continue
                who = (f"process {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"
                       if holder else "another run")
                raise ValueError(f"{self.option} {self.path} is being written by {who}: wait for it to finish or "
                                 f"give another {self.option} (if no such run exists, delete {lock})") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self._locked = True
            return
        raise ValueError(f"{self.option} {self.path}: could not take the lock {lock}")

    @staticmethod
    def _lock_holder(lock: Path) -> dict | None:
        try:
            holder = json.loads(lock.read_text())
            return holder if isinstance(holder, dict) else None
        except (OSError, ValueError):  # being written right now, or damaged: treat as held
            return None

    def _read_manifest(self) -> None:
        manifest_path = self.path / MANIFEST_NAME
        if not manifest_path.is_file():
            ours = sorted(p.name for p in self.path.rglob("*")
                          if p.is_file() and any(m in p.name for m in _OUTPUT_MARKERS))
            if ours:
                raise ValueError(f"{self.option} {self.path} holds segmentation outputs that no {MANIFEST_NAME} "
                                 f"accounts for ({', '.join(ours[:3])}{' …' if len(ours) > 3 else ''}), so they "
                                 f"may come from another model: give a new or empty {self.option}")
            return
        try:
            manifest = json.loads(manifest_path.read_text())
            earlier, images = manifest["settings"], manifest["images"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{manifest_path} is damaged: give a new or empty {self.option}") from None
        differences = [f"{key} {earlier.get(key)} there, {value} now" for key, value in self.settings.items()
                       if key in COMPARED and key != "model_digest" and earlier.get(key) != value]
        if earlier.get("model_digest") != self.settings.get("model_digest"):
            differences.insert(0, f"model {earlier.get('model')} (SHA-256 {str(earlier.get('model_digest'))[:12]}…) "
                                  f"there, {self.settings.get('model')} ({self.settings.get('model_digest', '')[:12]}…) now")
        if differences:
            raise ValueError(f"{self.option} {self.path} holds the outputs of a run with another model or settings ("
                             + "; ".join(differences) + f"): give a new or empty {self.option}")
        if not manifest.get("complete", False):
            warnings.warn(f"{self.option} {self.path}: the run that wrote it before did not finish; its images "
                          f"recorded ({len(images)}) are kept and the CSV rewritten")
        self.images = images

    # -- during the run ------------------------------------------------------------------------------------
    def stage(self, folder: Path) -> Path:
        """Where to write the outputs meant for ``folder`` (a folder inside the output folder) until commit."""
        staged = self.staging / Path(folder).resolve().relative_to(self.path.resolve())
        staged.mkdir(parents=True, exist_ok=True)
        return staged

    def commit(self, row: str, source: Path, rows: list[tuple[str, list[int], int]]) -> None:
        """Move the staged files of image ``row`` into place and record them with its CSV ``rows`` ((name,
        class pixel counts, pixels) per mask). Ctrl-C and SIGTERM wait until the image is recorded."""
        staged = sorted(p for p in self.staging.rglob("*") if p.is_file())
        names = [p.relative_to(self.staging).as_posix() for p in staged]
        blocked = {signal.SIGINT, signal.SIGTERM}
        held = threading.current_thread() is threading.main_thread()
        if held:
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            for path, name in zip(staged, names):
                target = self.path / name
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
            earlier = self.images.get(row, {})
            for old in set(earlier.get("outputs", [])) - set(names):  # e.g. --format changed
                (self.path / old).unlink(missing_ok=True)
            source = str(Path(source).resolve())
            if earlier and earlier.get("source") != source:
                warnings.warn(f"{row}: the outputs of {earlier.get('source')} (an earlier run) are replaced by those "
                              f"of {source}")
            self.images[row] = {"source": source, "outputs": names,
                                "rows": [[name, [int(c) for c in counts], int(size)] for name, counts, size in rows]}
        finally:
            if held:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        if time.monotonic() - self._saved_at > SAVE_EVERY_S:
            self._save(complete=False)

    def discard_staged(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    # -- leaving: CSV, manifest, lock ----------------------------------------------------------------------
    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.discard_staged()
            self._save(complete=exc_type is None)
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._unlock()

    def _save(self, complete: bool) -> None:
        rows = [row for image in self.images.values() for row in image["rows"]]
        csv_path = self.path / CSV_NAME
        if rows:
            temporary = self.path / f".{CSV_NAME}.tmp"
            self._write_csv(temporary, [r[0] for r in rows], [(r[1], r[2]) for r in rows])
            os.replace(temporary, csv_path)
        else:
            csv_path.unlink(missing_ok=True)
        if not self.images:  # nothing written: nothing to account for, and no model claims the folder
            (self.path / MANIFEST_NAME).unlink(missing_ok=True)
            return
        manifest = {"format": MANIFEST_FORMAT, "command": "alibi-vit segment apply", "complete": complete,
                    "settings": self.settings, "images": self.images}
        temporary = self.path / f".{MANIFEST_NAME}.tmp"
        temporary.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(temporary, self.path / MANIFEST_NAME)
        self._saved_at = time.monotonic()

    def _unlock(self) -> None:
        if self._locked:
            (self.path / LOCK_NAME).unlink(missing_ok=True)
            self._locked = False

