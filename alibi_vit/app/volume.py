"""The app's volume mode: a volume (a multi-page TIFF stack, a zarr/OME-Zarr with a z axis, a folder
of numbered slices) as one entry, shown a slice at a time in XY, XZ or YZ, labelled in any of them,
trained on 3D features and predicted a slice at a time.

- **Opening** reads metadata only (:func:`~alibi_vit.chunked.open_volume`) and a few XY slices for
  the display range (the 0.5 and 99.5 percentiles): a 512³ volume opens without being read.
- **A slice** is read as a box of the stored volume (:meth:`~alibi_vit.chunked.ChunkedImage.read_box`)
  and sent as an 8-bit PNG: XY is perpendicular to z (axis 0; rows y, columns x), XZ to y (axis 1;
  rows z, columns x), YZ to x (axis 2; rows z, columns y).
- **Labels** are one sparse label volume per volume (:mod:`~alibi_vit.app.volume_labels`): a stroke
  drawn in a view paints the voxels of the slice shown, e.g. in XZ those at y = the shown index.
- **Train** fits a :class:`~alibi_vit.trainable.VolumeSegmenter` (the 3D filter bank) on the labelled
  voxels of every labelled volume; it featurises the labelled planes only, not the volumes.
- **The overlay** of a slice is predicted from the 3D features of that plane only
  (:meth:`~alibi_vit.trainable.VolumeSegmenter.plane_proba`: the blocks it crosses, with their halos),
  never the whole volume; the last few slices predicted are kept per model.
- **Save** writes the label volume as ``labels/<stem>_labels.zarr`` (what ``segment train`` pairs with
  the volume), the model, and the volume's mask as ``segment apply`` writes it (a TIFF stack for a TIFF
  or slice folder, OME-Zarr for a zarr), streamed block by block. It is a background job (with
  progress and Cancel) on a thread of its own, with its own copy of the model: slices and their
  overlays are shown meanwhile.

Session folder: ``volumes.json`` lists the volumes (source, shape); ``volumes/<id>/labels.zarr`` holds
the labels (only the 64³ blocks holding a label exist), ``volumes/<id>/strokes.json`` the strokes (for
undo and a restart), ``volumes/model/`` the last trained volume model. Train and overlays run on the
engine's worker (:mod:`~alibi_vit.app.scheduler`), so they never compete with the 2D images' compute.
"""

from __future__ import annotations

import json
import secrets
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import SessionError
from .imagefiles import DEFAULT_MAX_PIXELS, STACK_IMAGES, check_chunked, confined
from .session import not_saved, png_bytes, refuse_relinked, remember, stroke_footprint, unique_id, write_atomic
from .volume_labels import SparseVolumeLabels

__all__ = ["AXES", "VolumeEntry", "Volumes", "is_volume_path"]

FORMAT = 1
AXES = ("xy", "xz", "yz")  # the views, by the axis they are perpendicular to (z, y, x)
DISPLAY_SLICES = 3  # XY slices the display range is taken from
KEEP_OVERLAYS = 64  # predicted slices kept as PNGs (per model)
KEEP_PLANES = 4  # ... and as class arrays (a slice can have tens of Mpx): what the overlay and Measure share


def is_volume_path(path: Path) -> bool:
    """Whether ``path`` is a volume the app opens as one entry: a TIFF or zarr whose planes lie along
    z (from its metadata: as ``segment`` decides), in one channel. A multi-page TIFF written page by
    page (pages of unrelated images) is not one."""
    from ..chunked import TIFF_SUFFIXES, is_zarr_path, open_image
    from ..images import ImageReadError

    path = Path(path)
    if not (is_zarr_path(path) or (path.is_file() and path.suffix.lower() in TIFF_SUFFIXES)):
        return False
    try:
        image = open_image(path)
    except ImageReadError:
        return False
    return image.is_volume and image.channels == 1


@dataclass
class VolumeEntry:
    """One volume of the session, its strokes and the label version they make."""
    id: str
    source: Path
    shape: tuple = ()  # (z, y, x)
    strokes: list = field(default_factory=list)  # each with "axis" and "index": the slice it was drawn on
    undone: list = field(default_factory=list)
    version: int = 0

    @property
    def name(self) -> str:
        return self.source.name

    def record(self) -> dict:
        return {"id": self.id, "source": str(self.source), "shape": list(self.shape)}

    def plane_shape(self, axis: int) -> tuple[int, int]:
        return tuple(n for a, n in enumerate(self.shape) if a != axis)


def _axis(view) -> int:
    if view not in AXES:
        raise SessionError(f"view must be one of {', '.join(AXES)}, got {view!r}")
    return AXES.index(view)


class Volumes:
    """The volumes of one session folder (see the module docstring); thread-safe."""

    def __init__(self, folder, max_pixels: int = DEFAULT_MAX_PIXELS):
        self.folder = Path(folder).resolve()
        self.max_pixels = int(max_pixels)  # the largest slice, in any view
        self.lock = threading.RLock()
        self.volumes: dict[str, VolumeEntry] = {}
        self.labels: dict[str, SparseVolumeLabels] = {}
        self._opened: dict[str, object] = {}  # id → ChunkedImage
        self._display: dict[str, tuple[float, float]] = {}
        self.model = None  # {"id", "classes", "seconds", "voxels"} of the trained volume model
        self._seg = None
        self._overlays: OrderedDict = OrderedDict()
        self._planes: OrderedDict = OrderedDict()
        self._load()

    # ---- persistence --------------------------------------------------------------------------
    def _dir(self, volume_id: str) -> Path:
        return self.folder / "volumes" / volume_id

    def _load(self) -> None:
        path = self.folder / "volumes.json"
        if not path.is_file():
            return
        try:
            state = json.loads(path.read_text())
            if state.get("format") != FORMAT:
                raise ValueError(f"format {state.get('format')}, this version reads {FORMAT}")
            for rec in state["volumes"]:
                entry = VolumeEntry(rec["id"], Path(rec["source"]), tuple(rec["shape"]))
                strokes = self._dir(entry.id) / "strokes.json"
                if strokes.is_file():
                    saved = json.loads(strokes.read_text())
                    entry.strokes, entry.undone, entry.version = saved["strokes"], saved["undone"], saved["version"]
                self.volumes[entry.id] = entry
        except (ValueError, KeyError, TypeError) as err:
            raise SessionError(f"{path} cannot be read ({err}); start a new session with --session NEW_DIR") from None
        if (self.folder / "volumes" / "model").is_dir():
            self._restore_model()

    def _save(self, volumes: dict) -> None:
        state = {"format": FORMAT, "volumes": [e.record() for e in volumes.values()]}
        try:
            write_atomic(self.folder / "volumes.json", (json.dumps(state, indent=2) + "\n").encode())
        except OSError as err:
            raise not_saved("the new volume", self.folder, err) from None

    def claim(self, path, taken=(), slice_folder: bool = False) -> str | None:
        """Add ``path`` as a volume when it is one (:func:`is_volume_path`, or with ``slice_folder`` a
        folder of numbered slices): its id (also when it was added before), else None. ``taken``: ids
        of the session's 2D images, not reused. A file that claims to be a volume but cannot be read
        as one (pages of different sizes) is a ValueError; one whose largest slice in any view has
        more than ``max_pixels`` pixels, or that is stored in chunks of more than ``STACK_IMAGES`` ×
        ``max_pixels`` voxels (each decoded whole), a 413 SessionError. A zarr volume is read
        :func:`~alibi_vit.app.imagefiles.confined` to its store."""
        from ..chunked import open_volume
        from ..images import ImageReadError
        from ..trainable.output_folder import image_stem

        path = Path(path).resolve()
        if not (is_volume_path(path) or (slice_folder and path.is_dir())):
            return None
        with self.lock:
            for entry in self.volumes.values():
                if entry.source == path:
                    return entry.id
            try:
                image = open_volume(path)
            except ImageReadError as err:
                raise ValueError(str(err)) from None
            nz, ny, nx = image.volume_shape
            if max(ny * nx, nz * nx, nz * ny) > self.max_pixels:
                raise SessionError(f"{path.name} is a volume of {nx}×{ny}×{nz} voxels whose largest slice has "
                                   f"{max(ny * nx, nz * nx, nz * ny) / 1e6:.1f} Mpx, over the app's limit of "
                                   f"{self.max_pixels / 1e6:.1f} Mpx per image (--max-megapixels)", status=413)
            check_chunked(image, path.name, self.max_pixels, chunk_pixels=STACK_IMAGES * self.max_pixels)
            volume_id = unique_id(image_stem(path), {*self.volumes, *taken}, fallback="volume")
            entry = VolumeEntry(volume_id, path, tuple(int(n) for n in image.volume_shape))
            volumes = {**self.volumes, volume_id: entry}
            self._save(volumes)
            self.volumes = volumes
            self._opened[volume_id] = confined(image)
            return volume_id

    # ---- reading ------------------------------------------------------------------------------
    def entry(self, volume_id: str) -> VolumeEntry:
        if not isinstance(volume_id, str) or volume_id not in self.volumes:
            raise SessionError(f"no volume {volume_id!r} in this session", status=404)
        return self.volumes[volume_id]

    def image(self, volume_id: str):
        """The volume's chunked view (:class:`~alibi_vit.chunked.ChunkedImage`; nothing read)."""
        entry = self.entry(volume_id)
        with self.lock:
            if volume_id not in self._opened:
                self._opened[volume_id] = self._open(entry)
        _warm_up_classifier()  # a volume is being looked at: Train may follow
        return self._opened[volume_id]

    def _open(self, entry: VolumeEntry):
        """A new chunked view of a volume's file, checked as when it was added."""
        from ..chunked import open_volume
        from ..images import ImageReadError

        refuse_relinked(entry.source, f"volume {entry.name}")
        try:
            image = open_volume(entry.source)
        except (ImageReadError, OSError) as err:
            raise SessionError(f"volume {entry.name} cannot be read: {err}", status=409) from None
        check_chunked(image, entry.name, self.max_pixels, chunk_pixels=STACK_IMAGES * self.max_pixels)
        if tuple(image.volume_shape) != entry.shape:
            raise SessionError(f"volume {entry.name} is {image.volume_shape} now but was {entry.shape} when it was "
                               "added: add it to a new session", status=409)
        return confined(image)

    def _display_range(self, volume_id: str) -> tuple[float, float]:
        if volume_id not in self._display:
            image, (nz, _, _) = self.image(volume_id), self.entry(volume_id).shape
            zs = sorted({int(z) for z in np.linspace(0, nz - 1, DISPLAY_SLICES + 2)[1:-1].round()})
            sample = np.concatenate([image.read_box(slice(z, z + 1), slice(None), slice(None)).ravel() for z in zs])
            lo, hi = np.percentile(sample, [0.5, 99.5]).astype(float)
            self._display[volume_id] = (lo, hi if hi > lo else lo + 1)
        return self._display[volume_id]

    def check_slice(self, volume_id: str, view, index) -> tuple[int, int]:
        """(axis, index) of a slice of the volume, or a 4xx SessionError naming the problem."""
        entry, axis = self.entry(volume_id), _axis(view)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < entry.shape[axis]:
            raise SessionError(f"slice {index!r} is outside {entry.name}: {view.upper()} slices are 0 to "
                               f"{entry.shape[axis] - 1}", status=404)
        return axis, index

    def plane(self, volume_id: str, axis: int, index: int) -> np.ndarray:
        """The voxels of one slice (rows, cols) as stored."""
        box = [slice(None)] * 3
        box[axis] = slice(index, index + 1)
        return np.take(self.image(volume_id).read_box(*box), 0, axis=axis)

    def slice_png(self, volume_id: str, view, index) -> bytes:
        axis, index = self.check_slice(volume_id, view, index)
        lo, hi = self._display_range(volume_id)
        pixels = (self.plane(volume_id, axis, index).astype(np.float32) - lo) * (255 / (hi - lo))
        return png_bytes(np.clip(pixels, 0, 255).astype(np.uint8))

    # ---- labels -------------------------------------------------------------------------------
    def label_volume(self, volume_id: str) -> SparseVolumeLabels:
        """The volume's labels, replayed from its strokes on first use; replaced on every change."""
        with self.lock:
            if volume_id not in self.labels:
                entry = self.entry(volume_id)
                self.labels[volume_id] = self._replay(entry, entry.strokes)
            return self.labels[volume_id]

    @staticmethod
    def _replay(entry: VolumeEntry, strokes) -> SparseVolumeLabels:
        labels = SparseVolumeLabels(entry.shape)
        for s in strokes:
            labels = labels.painted(s["axis"], s["index"], stroke_footprint(entry.plane_shape(s["axis"]), s["points"],
                                                                             s["radius"]),
                                    0 if s["erase"] else s["class"])
        return labels

    def labels_png(self, volume_id: str, view, index, classes) -> tuple[bytes, int]:
        """The labels of a slice in the class colours (RGBA, transparent where unlabelled)."""
        axis, index = self.check_slice(volume_id, view, index)
        with self.lock:
            labels, version = self.label_volume(volume_id), self.entry(volume_id).version
        return png_bytes(_colour(labels.plane(axis, index), classes)), version

    def counts(self, volume_id: str) -> dict:
        counts = self.label_volume(volume_id).counts()
        return {str(v): int(n) for v, n in enumerate(counts) if v and n}

    def _commit(self, entry: VolumeEntry, strokes: list, undone: list, labels: SparseVolumeLabels,
                what: str) -> int:
        """Write the labels that changed, then the strokes; then make them the volume's (version + 1)."""
        version, before = entry.version + 1, self.labels.get(entry.id)
        folder = self._dir(entry.id)
        try:
            labels.write(folder / "labels.zarr", before)
            write_atomic(folder / "strokes.json",
                         json.dumps({"version": version, "strokes": strokes, "undone": undone}).encode())
        except OSError as err:
            if before is not None:
                try:
                    before.write(folder / "labels.zarr", labels)
                except OSError:
                    pass  # the strokes file, not this copy, is what a restart reads
            raise not_saved(what, folder, err) from None
        entry.strokes, entry.undone, entry.version = strokes, undone, version
        self.labels[entry.id] = labels
        return version

    def add_stroke(self, volume_id: str, view, index, stroke: dict) -> int:
        """Paint a checked ``stroke`` (class, radius, points in the slice's (x, y) = (column, row), erase)
        on slice ``index`` of ``view``; returns the new label version."""
        axis, index = self.check_slice(volume_id, view, index)
        entry = self.entry(volume_id)
        footprint = stroke_footprint(entry.plane_shape(axis), stroke["points"], stroke["radius"])
        stroke = {**stroke, "axis": axis, "index": index}
        with self.lock:
            labels = self.label_volume(volume_id).painted(axis, index, footprint,
                                                          0 if stroke["erase"] else stroke["class"])
            return self._commit(entry, entry.strokes + [stroke], [], labels, "the stroke")

    def undo(self, volume_id: str, redo: bool = False, expected_version: int | None = None) -> int:
        entry, which = self.entry(volume_id), "redo" if redo else "undo"
        with self.lock:
            if expected_version is not None and expected_version != entry.version:
                raise SessionError(f"{entry.name} was changed in another tab since this page showed it: nothing was "
                                   f"{which}ne", status=409)
            source, target = (entry.undone, entry.strokes) if redo else (entry.strokes, entry.undone)
            if not source:
                raise SessionError(f"nothing to {which} on {entry.name}", status=409)
            source, target = source[:-1], target + [source[-1]]
            strokes, undone = (target, source) if redo else (source, target)
            self.label_volume(volume_id)
            return self._commit(entry, strokes, undone, self._replay(entry, strokes), f"the {which}")

    def _training_labels(self, volume_id: str):
        """The sparse labels seen as a chunked image (read block by block, like a label store on disk)."""
        from ..chunked import ChunkedImage

        labels = self.label_volume(volume_id)
        return ChunkedImage(f"labels of {self.entry(volume_id).name}", "zyx", [labels],
                            f"volume-labels|{volume_id}|{self.entry(volume_id).version}", labels.chunks[1:])

    # ---- train and predict (run on the engine's worker) -----------------------------------------
    def train(self) -> dict:
        """Fit a volume segmenter on every labelled volume and save it; returns the model's record."""
        import time

        from ..trainable import VolumeSegmenter

        with self.lock:
            ids = [i for i in self.volumes if self.label_volume(i).any()]
            if not ids:
                raise SessionError("no volume has labels: draw scribbles of at least two classes first", status=409)
            pairs = [(self.image(i), self._training_labels(i)) for i in ids]
        start = time.perf_counter()
        seg = VolumeSegmenter()
        try:
            seg.fit([p[0] for p in pairs], [p[1] for p in pairs])
        except ValueError as err:
            raise SessionError(str(err), status=409) from None
        model = {"id": (self.model or {}).get("id", 0) + 1, "classes": [int(c) for c in seg.classes_],
                 "seconds": round(time.perf_counter() - start, 2), "volumes": ids,
                 "voxels": {str(k): v for k, v in seg.label_counts_.items()}}
        folder = self.folder / "volumes" / "model"
        with self.lock:  # a Save copies this folder under the lock: never half written
            try:
                seg.save(folder)
                write_atomic(folder / "app-model.json", json.dumps(model).encode())
            except OSError as err:
                raise not_saved("the volume model", folder, err) from None
            self._seg, self.model = seg, model
            self._overlays.clear()
            self._planes.clear()
        return model

    def _restore_model(self) -> None:
        from ..trainable import VolumeSegmenter

        folder = self.folder / "volumes" / "model"
        try:
            self._seg = VolumeSegmenter.load(folder)
            self.model = json.loads((folder / "app-model.json").read_text())
        except Exception:  # noqa: BLE001 - a model that cannot be restored is trained again
            self._seg, self.model = None, None

    def trained(self):
        if self._seg is None:
            raise SessionError("no volume model yet: label at least two classes and press Train", status=409)
        return self._seg

    def predicted_plane(self, volume_id: str, view, index) -> tuple[np.ndarray, int]:
        """(the predicted class of every voxel of one slice, (rows, cols) uint8; the model's id), from the 3D
        features of that plane only; kept for the last few slices of the current model."""
        axis, index = self.check_slice(volume_id, view, index)
        seg, model = self.trained(), self.model["id"]
        key = (volume_id, axis, index, model)
        with self.lock:
            if key in self._planes:
                return self._planes[key], model
        proba = seg.plane_proba(self.image(volume_id), axis, index)
        predicted = seg.classes_[np.argmax(proba, axis=-1)].astype(np.uint8)
        with self.lock:
            return remember(self._planes, key, predicted, KEEP_PLANES), model

    def prediction_png(self, volume_id: str, view, index, classes) -> tuple[bytes, dict]:
        """The predicted classes of one slice in the class colours (opaque), from the 3D features of
        that plane only, and the share of the slice in each class ({"1": 0.4, ...}); kept for the
        last few slices of the current model."""
        axis, index = self.check_slice(volume_id, view, index)
        seg = self.trained()
        key = (volume_id, axis, index, self.model["id"], tuple((c["value"], c["color"]) for c in classes))
        with self.lock:
            if key in self._overlays:
                return self._overlays[key]
        predicted, _ = self.predicted_plane(volume_id, view, index)
        counts = np.bincount(predicted.ravel(), minlength=256)
        fractions = {str(v): round(float(counts[v]) / predicted.size, 6) for v in seg.classes_}
        with self.lock:
            return remember(self._overlays, key, (png_bytes(_colour(predicted, classes)), fractions), KEEP_OVERLAYS)

    def check_save(self, volume_id: str, what) -> list[str]:
        """``what`` a Save of a volume writes, checked before it starts: 404 for no such volume, 400
        for anything but labels, model and masks, 409 for a model or masks without a trained model."""
        self.entry(volume_id)
        what = list(dict.fromkeys(what or []))
        unknown = sorted(set(map(str, what)) - {"labels", "model", "masks"})
        if unknown or not what:
            raise SessionError(f"a volume saves labels, model and masks; got {', '.join(unknown) or 'nothing'}")
        if {"model", "masks"} & set(what):
            self.trained()
        return what

    def save(self, volume_id: str, out: Path, what, on_progress=None, written: dict | None = None) -> dict:
        """Write ``what`` of a volume into ``out``: "labels" (``labels/<stem>_labels.zarr``), "model"
        (``model_volume/``), "masks" (``masks/<stem>_mask.tif`` or ``.ome.zarr``, block by block); returns
        (and fills ``written`` as it goes) {kind: path(s)}.

        Made for a thread of its own (a Save job), not the worker: the volume is read through a view of
        its own and the mask predicted by a copy of the trained model (taken before the mask is begun),
        so slices shown and a Train go on meanwhile. on_progress(done, total): steps done (labels, model, each
        block of each pass of the mask); an exception it raises (a Cancel) stops the Save there, and
        removes the mask begun."""
        from ..chunked import is_zarr_path
        from ..trainable import VolumeSegmenter
        from ..trainable.output_folder import image_stem
        from ..trainable.stream import segment_to_files

        what = self.check_save(volume_id, what)
        entry = self.entry(volume_id)
        steps = len({"labels", "model"} & set(what))
        report = on_progress or (lambda done, total: None)
        stem, written, private = image_stem(entry.source), ({} if written is None else written), None
        try:
            report(0, steps + ("masks" in what))
            if "labels" in what:
                labels = self.label_volume(volume_id)
                (out / "labels").mkdir(parents=True, exist_ok=True)
                written["labels"] = str(labels.export(out / "labels" / f"{stem}_labels.zarr"))
                report(1, steps + ("masks" in what))
            if "model" in what or "masks" in what:
                model = out / "model_volume" if "model" in what else \
                    self.folder / "volumes" / f".save-{secrets.token_hex(4)}"
                private = None if "model" in what else model
                with self.lock:  # Train writes the folder under the lock: this copy is one whole model
                    shutil.rmtree(model, ignore_errors=True)
                    shutil.copytree(self.folder / "volumes" / "model", model,
                                    ignore=shutil.ignore_patterns("app-model.json"))
                if "model" in what:
                    written["model"] = str(model)
                    report(steps, steps + ("masks" in what))
            if "masks" in what:
                seg = VolumeSegmenter.load(model)
                kind = "ome-zarr" if is_zarr_path(entry.source) else "tif"
                result = segment_to_files(seg, self._open(entry), out / "masks", stem, kind, progress=False,
                                          on_tile=lambda done, total: report(steps + done, steps + total))
                written["masks"] = [str(p) for p in result.paths]
        except OSError as err:
            raise not_saved(f"the export of {entry.name}", out, err) from None
        finally:
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)
        return written

    def record(self, volume_id: str) -> dict:
        entry = self.entry(volume_id)
        return {"id": volume_id, "name": entry.name, "file": entry.source.name, "shape": list(entry.shape),
                "version": entry.version, "labelled": self.counts(volume_id)}


def _warm_up_classifier() -> None:
    """Import the classifier's library (XGBoost: about 0.5 s of CPU, seconds on a busy 2-core
    machine) in the background once a volume is opened, so the first Train does not wait for it; by
    the app's one background import (see :class:`~alibi_vit.app.engine.Engine`)."""
    from ..trainable.classifier import import_in_background

    import_in_background()


def _colour(values: np.ndarray, classes) -> np.ndarray:
    """(rows, cols, 4) uint8: each class value in its colour, opaque; 0 transparent."""
    table = np.zeros((256, 4), np.uint8)
    for c in classes:
        colour = c["color"]
        table[c["value"]] = [int(colour[i:i + 2], 16) for i in (1, 3, 5)] + [255]
    return table[values]
