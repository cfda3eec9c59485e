"""An output folder that ``alibi-vit segment apply`` can write safely: what it holds always agrees with itself.

Five rules, each against a way outputs were lost or mixed:

- **Unique names.** :func:`output_names` gives every image its own output names: ``x.png`` and
  ``x.tif`` side by side become ``x_png_mask.png`` and ``x_tif_mask.png``, and ``x.png`` found in two
  ``--images`` folders goes to a subfolder named after each folder (``a/x_mask.png``, ``b/x_mask.png``),
  so no mask overwrites another and no two CSV rows share a name.
- **One run at a time.** :class:`OutputFolder` holds a lock file, ``.segment.lock``, naming the host and
  process that write the folder; a second run is refused while that process lives. A lock left by a
  process that died (same host, no such process) is taken over, with a warning. The jobs of a SLURM
  array (``--shard I/N``) each lock their own share (``.segment.shard-I-of-N.lock``), so the shares
  of one split run side by side, while a second run of the same share, a share of another split, or a
  whole run is refused.
- **One model and setting per folder.** The run manifest, ``segment_run.json``, names the model (its
  folder and a SHA-256 digest of its files) and the settings that change masks (CRF, modal filter). A
  run whose model or settings differ is refused with the differences named, so masks of two models are
  never mixed; so is a folder with masks that no manifest accounts for (written before manifests existed).
- **Masks and CSV agree.** Each image's files are written into its own staging folder (several images
  are written at once on a cluster), then moved into place together with signals held off, and only
  then recorded. The manifest lists every image's files and area-fraction rows, and the CSV is written
  from it (atomically, by renaming a complete file) when the run ends, however it ends: finished,
  failed, Ctrl-C or SIGTERM. An image re-segmented replaces its earlier files; an image of an earlier
  run with the same model stays, with its row. Rows are in the order of the images' names, so a table
  does not depend on which image finished first.
- **Every image has its own manifest**, ``.manifests/<image>.json``, written atomically once its files
  are in place: the model digest, the input's SHA-256, the settings, its files and its CSV rows. A run
  killed outright (SIGKILL, power loss) between two saves of the run manifest loses no record: the next
  run takes them from there. ``--resume`` (:meth:`OutputFolder.finished`) skips an image whose
  manifest matches the model, the settings and the input's digest and whose files are all there.

A share of a split run writes its own run manifest and CSV (``segment_run.shard-I-of-N.json``,
``area_fractions.shard-I-of-N.csv``); :func:`merge_shards` (``alibi-vit segment merge``) checks that
every share finished and writes the folder's ``segment_run.json`` and ``area_fractions.csv``, the
same files one run over all the images writes.
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

__all__ = ["CSV_NAME", "LOCK_NAME", "MANIFEST_NAME", "OutputFolder", "OutputName", "input_digest", "merge_shards",
           "model_digest", "output_names", "written_outputs"]

LOCK_NAME = ".segment.lock"
MANIFEST_NAME = "segment_run.json"
CSV_NAME = "area_fractions.csv"
STAGING_NAME = ".segment.partial"
MANIFEST_FORMAT = 1
SAVE_EVERY_S = 30.0  # manifest and CSV are rewritten at most this often during a run (and always at its end)
_OUTPUT_MARKERS = ("_mask.", CSV_NAME)  # files that only a segment run writes
COMPARED = ("model_digest", "crf", "modal")  # settings two runs must share to write one folder; others are recorded
# What an image's outputs depend on besides the model and its input: --resume redoes an image when one differs.
RESUME_KEYS = ("model_digest", "crf", "modal", "format", "proba", "overlay")
IMAGE_MANIFESTS = ".manifests"  # <row>.json per image
IMAGE_MANIFEST_FORMAT = 1
IMAGE_NOTES = ("voxel_spacing",)  # what a run may record of an image besides its files (OutputFolder.notes)


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
    stems = [image_stem(f) for f in files]
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


def image_stem(path: Path) -> str:
    """The name outputs are named after: the file name without its image suffixes (``a.ome.zarr`` and
    ``a.ome.tif`` → ``a``)."""
    path = Path(path)
    name = path.name[:-len(".zarr")] if path.name.lower().endswith(".zarr") else path.stem
    return name[:-len(".ome")] if name.lower().endswith(".ome") and len(name) > 4 else name


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
    return _tree_digest(Path(folder))


def input_digest(path: Path) -> str:
    """SHA-256 of an input image: the file's bytes, or a zarr folder's files (names and contents)."""
    path = Path(path)
    return _tree_digest(path) if path.is_dir() else _tree_digest(path.parent, [path])


def _tree_digest(folder: Path, files=None) -> str:
    sha = hashlib.sha256()
    for path in sorted(files or (p for p in folder.rglob("*") if p.is_file())):
        if files is None:
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


def _scope_suffix(shard: tuple[int, int] | None) -> str:
    return "" if shard is None else f".shard-{shard[0]}-of-{shard[1]}"


def _shard_of(name: str, prefix: str, suffix: str) -> tuple[int, int] | None:
    """(I, N) of a file named ``<prefix>.shard-I-of-N<suffix>``; None for other names."""
    middle = name[len(prefix):len(name) - len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else ""
    parts = middle.split("-")
    if len(parts) == 4 and parts[0] == ".shard" and parts[2] == "of" and parts[1].isdigit() and parts[3].isdigit():
        return int(parts[1]), int(parts[3])
    return None


def _write_json(path: Path, data) -> None:
    """``data`` as JSON at ``path``, complete or not at all (written under a temporary name, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    _replace_with(path, temporary, lambda: temporary.write_text(json.dumps(data, indent=1) + "\n"))


def _replace_with(path: Path, temporary: Path, write) -> None:
    """``write()`` ``temporary``, then rename it to ``path``; a failed write (a full disk) removes it and is an
    :class:`~alibi_vit.trainable.writers.OutputError` naming ``path``."""
    from .writers import OutputError, output_error

    try:
        write()
        os.replace(temporary, path)
    except OutputError:
        raise
    except OSError as err:
        temporary.unlink(missing_ok=True)
        raise output_error(path, err) from err


def _record(manifest: dict) -> dict:
    """What the run manifest records of an image, from its own manifest: its source, outputs and CSV rows, and
    what the run noted for it (a volume's voxel spacing)."""
    return {**{key: manifest[key] for key in ("source", "outputs", "rows")},
            **{key: manifest[key] for key in IMAGE_NOTES if key in manifest}}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _move_into_place(source: Path, target: Path) -> None:
    """Rename ``source`` (a file or a folder such as an OME-Zarr store) to ``target``, replacing it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir() and target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
        os.replace(source, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(source, target)


def _staged_outputs(root: Path) -> list[Path]:
    """The outputs below ``root``: files, and ``.zarr`` folders as one output each; relative, sorted."""
    found = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if any(part.endswith(".zarr") for part in relative.parts[:-1]):
            continue  # inside a store: moved with it
        if path.is_file() or (path.is_dir() and path.name.endswith(".zarr")):
            found.append(relative)
    return found


class OutputFolder:
    """The output folder of one ``segment apply`` run; use as a context manager (see the module docstring).

    ``settings``: what makes two runs' masks comparable (the model's digest, CRF, modal filter...); a folder
    whose manifest records other settings is refused. ``write_csv(path, names, counts)`` writes the
    area-fraction table from ``names`` (CSV rows) and ``counts`` ((class pixel counts, pixels) per row).
    ``shard``: (I, N) for share I of a run split in N (its own lock, run manifest and CSV).
    """

    def __init__(self, path: Path, settings: dict, write_csv, option: str = "--out",
                 shard: tuple[int, int] | None = None):
        self.path, self.settings, self.option, self.shard = Path(path), dict(settings), option, shard
        self._write_csv = write_csv
        suffix = _scope_suffix(shard)
        self.lock_path = self.path / f".segment{suffix}.lock"
        self.manifest_path = self.path / MANIFEST_NAME.replace(".json", f"{suffix}.json")
        self.csv_path = self.path / CSV_NAME.replace(".csv", f"{suffix}.csv")
        self.staging = self.path / STAGING_NAME.replace(".partial", f"{suffix}.partial")
        self.images: dict[str, dict] = {}
        self.notes: dict[str, dict] = {}  # row → what to record with the image (IMAGE_NOTES: its voxel spacing)
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
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self._take(self.lock_path, me)
        try:
            for other in sorted(self.path.glob(".segment*.lock")):
                shard = None if other.name == LOCK_NAME else _shard_of(other.name, ".segment", ".lock")
                if other == self.lock_path or (other.name != LOCK_NAME and shard is None):
                    continue
                # Shares of one split run side by side; anything else overlaps this run's images.
                if self.shard is None or shard is None or shard[1] != self.shard[1]:
                    holder = self._live_holder(other)
                    if holder is not None:
                        raise self._held(other, holder)
        except BaseException:
            self._unlock()
            raise

    def _take(self, lock: Path, me: dict) -> None:
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._live_holder(lock)
                if holder is None:
                    continue
                raise self._held(lock, holder) from None
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f)
            except OSError as err:  # a full disk: no lock is left behind that the next run would take as held
                lock.unlink(missing_ok=True)
                raise OSError(err.errno, err.strerror or str(err), str(lock)) from err
            self._locked = True
            return
        raise ValueError(f"{self.option} {self.path}: could not take the lock {lock}")

    def _live_holder(self, lock: Path) -> dict | None:
        """Who holds ``lock`` (an empty dict when it cannot be told), or None when its process on this
        host has ended: such a lock is removed, with a warning."""
        holder = _read_json(lock)
        holder = holder if isinstance(holder, dict) else {}  # being written right now, or damaged: held
        if holder.get("host") == socket.gethostname() and not _process_alive(int(holder.get("pid", -1))):
            warnings.warn(f"{self.option} {self.path}: taking over the lock of process {holder['pid']}, "
                          "which ended without releasing it")
            lock.unlink(missing_ok=True)
            return None
        return holder

    def _held(self, lock: Path, holder: dict) -> ValueError:
        who = (f"process {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}"
               if holder else "another run")
        shard = _shard_of(lock.name, ".segment", ".lock")
        what = f" (share {shard[0]}/{shard[1]})" if shard else ""
        return ValueError(f"{self.option} {self.path} is being written by {who}{what}: wait for it to finish or "
                          f"give another {self.option} (if no such run exists, delete {lock})")

    def _run_manifests(self) -> dict[Path, dict]:
        """Every run manifest in the folder (the whole run's and the shares'), read."""
        found = {}
        for path in sorted(self.path.glob("segment_run*.json")):
            if path.name != MANIFEST_NAME and _shard_of(path.name, "segment_run", ".json") is None:
                continue
            manifest = _read_json(path)
            if not (isinstance(manifest, dict) and isinstance(manifest.get("settings"), dict)
                    and isinstance(manifest.get("images"), dict)):
                raise ValueError(f"{path} is damaged: give a new or empty {self.option}")
            found[path] = manifest
        return found

    def _image_manifests(self) -> dict[str, dict]:
        """Every image manifest in the folder, by row."""
        root = self.path / IMAGE_MANIFESTS
        found = {}
        for path in sorted(root.rglob("*.json")) if root.is_dir() else []:
            manifest = _read_json(path)
            if isinstance(manifest, dict) and isinstance(manifest.get("image"), str):
                found[manifest["image"]] = manifest
        return found

    def _differences(self, earlier: dict) -> list[str]:
        differences = [f"{key} {earlier.get(key)} there, {value} now" for key, value in self.settings.items()
                       if key in COMPARED and key != "model_digest" and earlier.get(key) != value]
        if earlier.get("model_digest") != self.settings.get("model_digest"):
            differences.insert(0, f"model {earlier.get('model')} (SHA-256 {str(earlier.get('model_digest'))[:12]}…) "
                                  f"there, {self.settings.get('model')} ({self.settings.get('model_digest', '')[:12]}…) now")
        return differences

    def _read_manifest(self) -> None:
        manifests = self._run_manifests()
        images = self._image_manifests()
        if not manifests and not images:
            ours = sorted(p.name for p in self.path.rglob("*")
                          if p.is_file() and any(m in p.name for m in _OUTPUT_MARKERS))
            if ours:
                raise ValueError(f"{self.option} {self.path} holds segmentation outputs that no {MANIFEST_NAME} "
                                 f"accounts for ({', '.join(ours[:3])}{' …' if len(ours) > 3 else ''}), so they "
                                 f"may come from another model: give a new or empty {self.option}")
            return
        for earlier in [m["settings"] for m in manifests.values()] + [m.get("settings", {}) for m in images.values()]:
            differences = self._differences(earlier)
            if differences:
                raise ValueError(f"{self.option} {self.path} holds the outputs of a run with another model or settings ("
                                 + "; ".join(differences) + f"): give a new or empty {self.option}")
        own = manifests.get(self.manifest_path)
        if own is not None:
            if not own.get("complete", False):
                warnings.warn(f"{self.option} {self.path}: the run that wrote it before did not finish; its images "
                              f"recorded ({len(own['images'])}) are kept and the CSV rewritten")
            self.images = dict(own["images"])
        if self.shard is None:  # the whole folder's table: every image with a manifest of its own
            for row, manifest in images.items():
                self.images.setdefault(row, _record(manifest))

    # -- during the run ------------------------------------------------------------------------------------
    def _image_manifest_path(self, row: str) -> Path:
        return self.path / IMAGE_MANIFESTS / f"{row}.json"

    def stage(self, row: str, folder: Path) -> Path:
        """Where to write image ``row``'s outputs meant for ``folder`` (a folder inside the output folder)
        until :meth:`commit`: a staging folder of this image's own."""
        root = self.staging / hashlib.sha1(row.encode()).hexdigest()[:16]
        staged = root / Path(folder).resolve().relative_to(self.path.resolve())
        staged.mkdir(parents=True, exist_ok=True)
        return staged

    def finished(self, row: str) -> dict | None:
        """The manifest of image ``row`` when an earlier run wrote its outputs with this model and these
        settings and they are all still there (``--resume`` then compares its ``input_sha256``); else None."""
        manifest = _read_json(self._image_manifest_path(row))
        if not isinstance(manifest, dict) or manifest.get("format") != IMAGE_MANIFEST_FORMAT:
            return None
        settings = manifest.get("settings", {})
        if any(settings.get(key) != self.settings.get(key) for key in RESUME_KEYS):
            return None
        if not all((self.path / name).exists() for name in manifest.get("outputs", [])):
            return None
        return manifest

    def keep(self, row: str, manifest: dict) -> None:
        """Record image ``row`` as written by an earlier run (its :meth:`finished` manifest), files untouched."""
        self.images[row] = _record(manifest)
        self._save_now_and_then()

    def commit(self, row: str, source: Path, rows: list[tuple[str, list[int], int]], sha256: str = "") -> None:
        """Move image ``row``'s staged files into place, record them with its CSV ``rows`` ((name, class
        pixel counts, pixels) per mask) and write its manifest (``sha256``: the input's digest). Ctrl-C and
        SIGTERM wait until the image is recorded."""
        root = self.staging / hashlib.sha1(row.encode()).hexdigest()[:16]
        staged = _staged_outputs(root) if root.is_dir() else []
        names = [p.as_posix() for p in staged]
        blocked = {signal.SIGINT, signal.SIGTERM}
        held = threading.current_thread() is threading.main_thread()
        if held:
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            for relative in staged:
                _move_into_place(root / relative, self.path / relative)
            shutil.rmtree(root, ignore_errors=True)
            earlier = self.images.get(row, {})
            for old in set(earlier.get("outputs", [])) - set(names):  # e.g. --format changed
                old_path = self.path / old
                shutil.rmtree(old_path, ignore_errors=True) if old_path.is_dir() else old_path.unlink(missing_ok=True)
            source = str(Path(source).resolve())
            if earlier and earlier.get("source") != source:
                warnings.warn(f"{row}: the outputs of {earlier.get('source')} (an earlier run) are replaced by those "
                              f"of {source}")
            record = {"source": source, "outputs": names,
                      "rows": [[name, [int(c) for c in counts], int(size)] for name, counts, size in rows],
                      **self.notes.get(row, {})}
            _write_json(self._image_manifest_path(row),
                        {"format": IMAGE_MANIFEST_FORMAT, "image": row, "input_sha256": sha256,
                         "settings": {k: v for k, v in self.settings.items() if k != "model"}, **record})
            self.images[row] = record
        finally:
            if held:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        self._save_now_and_then()

    def discard(self, row: str) -> None:
        """Remove what image ``row`` staged (it failed)."""
        shutil.rmtree(self.staging / hashlib.sha1(row.encode()).hexdigest()[:16], ignore_errors=True)

    def discard_staged(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def _save_now_and_then(self) -> None:
        if time.monotonic() - self._saved_at > SAVE_EVERY_S:
            self._save(complete=False)

    # -- leaving: CSV, manifest, lock ----------------------------------------------------------------------
    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.discard_staged()
            try:
                self._save(complete=exc_type is None)
            except OSError as err:
                if exc_type is None:
                    raise
                # Already failing (often the same full disk): that error is the one to show. The images'
                # own manifests hold their records, so the next run writes the CSV.
                warnings.warn(str(err))
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._unlock()

    def _save(self, complete: bool) -> None:
        self.images = dict(sorted(self.images.items()))  # by name: the same table whatever finished first
        rows = [row for image in self.images.values() for row in image["rows"]]
        if rows:
            temporary = self.path / f".{self.csv_path.name}.tmp"
            _replace_with(self.csv_path, temporary,
                          lambda: self._write_csv(temporary, [r[0] for r in rows], [(r[1], r[2]) for r in rows]))
        else:
            self.csv_path.unlink(missing_ok=True)
        if not self.images and self.shard is None:  # nothing written: no model claims the folder
            self.manifest_path.unlink(missing_ok=True)
            return  # (a share keeps its manifest, empty or not: segment merge must see that it ran)
        manifest = {"format": MANIFEST_FORMAT, "command": "alibi-vit segment apply", "complete": complete,
                    "settings": self.settings, "images": self.images}
        if self.shard is not None:
            manifest["shard"] = list(self.shard)
        _write_json(self.manifest_path, manifest)
        self._saved_at = time.monotonic()

    def _unlock(self) -> None:
        if self._locked:
            self.lock_path.unlink(missing_ok=True)
            self._locked = False


def written_outputs(path: Path) -> set[Path]:
    """The files and stores earlier runs wrote in output folder ``path`` (resolved): the outputs its run and
    image manifests record, and its colour key; empty for a folder no run wrote."""
    path = Path(path)
    if not path.is_dir():
        return set()
    records = [m.get("images", {}) for p in path.glob("segment_run*.json") for m in [_read_json(p)]
               if isinstance(m, dict) and isinstance(m.get("images"), dict)]
    images = [image for record in records for image in record.values()]
    root = path / IMAGE_MANIFESTS
    images += [m for p in (root.rglob("*.json") if root.is_dir() else []) for m in [_read_json(p)]]
    found = {(path / name).resolve() for image in images if isinstance(image, dict)
             for name in image.get("outputs", []) if isinstance(name, str)}
    if found:
        found.add((path / "colour_key.png").resolve())
    return found


def merge_shards(path: Path, write_csv_for) -> tuple[int, int]:
    """Combine the shares of a split run in folder ``path`` into its ``segment_run.json`` and
    ``area_fractions.csv`` (what one run over all the images writes), then remove the shares' run
    manifests and CSVs. ``write_csv_for(classes)`` gives the CSV writer for the model's classes.
    Refused, naming them, when shares are missing, unfinished or of other settings, or still running.
    Returns (shares, images)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a folder")
    shards = {}
    for manifest_path in sorted(path.glob("segment_run.shard-*.json")):
        shard = _shard_of(manifest_path.name, "segment_run", ".json")
        manifest = _read_json(manifest_path)
        if shard is None:
            continue
        if not (isinstance(manifest, dict) and isinstance(manifest.get("settings"), dict)):
            raise ValueError(f"{manifest_path} is damaged: run that share again with --resume")
        shards[shard] = (manifest_path, manifest)
    if not shards:
        raise ValueError(f"{path} holds no share of a split run (segment_run.shard-I-of-N.json): nothing to merge")
    counts = sorted({n for _, n in shards})
    if len(counts) > 1:
        raise ValueError(f"{path} holds shares of runs split in {' and '.join(map(str, counts))}: "
                         "keep the shares of one split")
    count = counts[0]
    missing = [f"{i}/{count}" for i in range(count) if (i, count) not in shards]
    unfinished = [f"{i}/{n}" for (i, n), (_, m) in sorted(shards.items()) if not m.get("complete")]
    if missing or unfinished:
        parts = ([f"share(s) {', '.join(missing)} never ran"] if missing else []) + \
                ([f"share(s) {', '.join(unfinished)} did not finish"] if unfinished else [])
        raise ValueError(f"{path}: {'; '.join(parts)}: run them (again, with --resume), then merge")
    settings = shards[(0, count)][1]["settings"]
    classes = settings.get("classes")
    if not classes:
        raise ValueError(f"{shards[(0, count)][0]} names no classes: run the shares again with this version")
    with OutputFolder(path, settings, write_csv_for(classes), option="segment merge") as folder:
        for (_, _), (_, manifest) in sorted(shards.items()):
            folder.images.update(manifest["images"])
    for manifest_path, _ in shards.values():
        manifest_path.unlink(missing_ok=True)
        shard = _shard_of(manifest_path.name, "segment_run", ".json")
        (path / CSV_NAME.replace(".csv", f"{_scope_suffix(shard)}.csv")).unlink(missing_ok=True)
    return count, len(folder.images)
