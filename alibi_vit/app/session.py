"""The app's session folder: classes, images, labels and strokes, kept on disk as they change.

Layout (human-readable, so a user can leave the app and go on with ``alibi-vit segment``)::

    session.json          classes (value, name, colour), images (id, source file, page), settings,
                          the intensity range fitted on the session's images
    labels/<id>.png       the label image: 0 = unlabelled, 1..K = class values (Weka/ilastik convention)
    strokes/<id>.json     the strokes drawn on the image, in order, and those undone (for redo)
    uploads/              images uploaded through the page
    export/               what Save writes (unless the app was given --out)

Every change is written at once, each file atomically (a temporary file renamed over the old one),
so a closed tab or a stopped server loses nothing and a second tab on the same session cannot leave
a half-written file: the last write wins.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["DEFAULT_COLOURS", "ImageEntry", "Session", "SessionError", "rasterise_stroke", "remember"]

FORMAT = 1
MAX_CLASSES = 255  # label images are 8-bit
MAX_RADIUS = 256
KEEP_READ = 8  # images kept in memory as read (training reads every labelled image after each stroke)
INTENSITY_SAMPLE = 16  # images the session's intensity range is fitted on, evenly spaced
# Default class colours (the masks' palette of alibi_vit.trainable.io, as #rrggbb).
DEFAULT_COLOURS = ("#e6194b", "#3cb44b", "#0082c8", "#ffe119", "#911eb4", "#46f0f0", "#f58231", "#f032e6",
                   "#d2f53c", "#fabebe")
_COLOUR = re.compile(r"^#[0-9a-fA-F]{6}$")


class SessionError(ValueError):
    """Bad input from the page or the command line; ``status`` is the HTTP status it deserves."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remember(recent: OrderedDict, key, value, keep: int):
    """Store ``value`` as the most recent entry of ``recent``, dropping the oldest beyond ``keep``; returns it."""
    recent[key] = value
    recent.move_to_end(key)
    while len(recent) > keep:
        recent.popitem(last=False)
    return value


def png_bytes(array: np.ndarray, mode: str | None = None, palette=None) -> bytes:
    """An array as PNG bytes (fast compression: these are written and sent after every stroke)."""
    import io

    from PIL import Image

    img = Image.fromarray(np.ascontiguousarray(array), mode) if mode is None else \
        Image.frombytes(mode, (array.shape[1], array.shape[0]), np.ascontiguousarray(array).tobytes())
    if palette is not None:
        img.putpalette(palette)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def rasterise_stroke(labels: np.ndarray, points, radius: float, value: int) -> None:
    """Paint ``value`` into ``labels`` on every pixel whose centre lies within ``radius`` of the
    polyline through ``points`` ((x, y) = (column, row) in pixels; one point paints a disc)."""
    pts = np.asarray(points, np.float64).reshape(-1, 2)
    h, w = labels.shape
    segments = zip(pts, pts[1:]) if len(pts) > 1 else [(pts[0], pts[0])]
    for a, b in segments:
        c0 = max(int(np.floor(min(a[0], b[0]) - radius)), 0)
        c1 = min(int(np.ceil(max(a[0], b[0]) + radius)) + 1, w)
        r0 = max(int(np.floor(min(a[1], b[1]) - radius)), 0)
        r1 = min(int(np.ceil(max(a[1], b[1]) + radius)) + 1, h)
        if c0 >= c1 or r0 >= r1:
            continue
        yy, xx = np.mgrid[r0:r1, c0:c1]
        d = b - a
        length2 = float(d @ d)
        t = np.zeros(xx.shape) if length2 == 0 else np.clip(((xx - a[0]) * d[0] + (yy - a[1]) * d[1]) / length2, 0, 1)
        dist2 = (xx - a[0] - t * d[0]) ** 2 + (yy - a[1] - t * d[1]) ** 2
        labels[r0:r1, c0:c1][dist2 <= radius * radius] = value


@dataclass
class ImageEntry:
    """One image of the session: a file, or one page of a multi-page TIFF."""
    id: str
    source: Path
    page: int | None = None
    shape: tuple = ()  # (H, W) or (H, W, C), filled when first read
    strokes: list = field(default_factory=list)
    undone: list = field(default_factory=list)
    version: int = 0

    @property
    def name(self) -> str:
        return self.source.name + (f" [page {self.page}]" if self.page is not None else "")

    def record(self) -> dict:
        return {"id": self.id, "source": str(self.source), "page": self.page, "shape": list(self.shape)}


def _read_pages(path: Path) -> list[np.ndarray]:
    """The image(s) in a file: one array, or one per page of a multi-page TIFF; a clear ValueError
    for anything unreadable."""
    from ..trainable.io import as_grayscale, read_array, read_slices

    pages = read_slices(path)
    if pages is None:
        pages = [read_array(path)]
    for i, page in enumerate(pages):
        as_grayscale(page, f"{path.name}" + (f" page {i}" if len(pages) > 1 else ""))
    return pages


class Session:
    """The state of one app session, mirrored to its folder on every change (thread-safe)."""

    def __init__(self, folder, sources=(), allowed_roots=()):
        self.folder = Path(folder).resolve()
        self.folder.mkdir(parents=True, exist_ok=True)
        if not os.access(self.folder, os.W_OK):
            raise SessionError(f"session folder {self.folder} is not writable")
        self.lock = threading.RLock()
        self.classes: list[dict] = []
        self.images: dict[str, ImageEntry] = {}
        self.settings = {"backbone": None, "crf": False, "live": False}
        self.intensity_range = None
        self.colour = None  # "channels" (all images colour or all grey) or "grey" (a mix), fixed at first need
        self.labels: dict[str, np.ndarray] = {}  # in memory, loaded on first use
        self._read: OrderedDict[str, np.ndarray] = OrderedDict()
        self._counts: dict[str, tuple[int, dict]] = {}  # id → (label version, counts)
        self.allowed_roots = [Path(r).resolve() for r in allowed_roots] + [self.folder]
        if (self.folder / "session.json").is_file():
            self._load()
        for src in sources:
            self.add_path(src, check_allowed=False)
        self._save()

    # ---- persistence ----------------------------------------------------------------------
    def _load(self) -> None:
        path = self.folder / "session.json"
        try:
            state = json.loads(path.read_text())
            if state.get("format") != FORMAT:
                raise ValueError(f"format {state.get('format')}, this version reads {FORMAT}")
            self.classes = [{"value": int(c["value"]), "name": str(c["name"]), "color": str(c["color"])}
                            for c in state["classes"]]
            self.settings.update(state.get("settings", {}))
            self.intensity_range = state.get("intensity_range")
            self.colour = state.get("colour")
            for rec in state["images"]:
                entry = ImageEntry(rec["id"], Path(rec["source"]), rec.get("page"), tuple(rec.get("shape") or ()))
                strokes = self.folder / "strokes" / f"{entry.id}.json"
                if strokes.is_file():
                    saved = json.loads(strokes.read_text())
                    entry.strokes, entry.undone = saved["strokes"], saved["undone"]
                    entry.version = int(saved.get("version", len(entry.strokes)))
                self.images[entry.id] = entry
        except (ValueError, KeyError, TypeError) as err:
            raise SessionError(f"{path} cannot be read ({err}); start a new session with --session NEW_DIR") from None

    def _save(self) -> None:
        state = {"format": FORMAT, "classes": self.classes, "settings": self.settings,
                 "intensity_range": self.intensity_range, "colour": self.colour,
                 "images": [e.record() for e in self.images.values()]}
        _write_atomic(self.folder / "session.json", (json.dumps(state, indent=2) + "\n").encode())

    def _save_labels(self, entry: ImageEntry) -> None:
        strokes = {"version": entry.version, "strokes": entry.strokes, "undone": entry.undone}
        _write_atomic(self.folder / "strokes" / f"{entry.id}.json", json.dumps(strokes).encode())
        _write_atomic(self.folder / "labels" / f"{entry.id}.png", png_bytes(self.labels[entry.id]))

    # ---- images ---------------------------------------------------------------------------
    def check_allowed(self, path: Path) -> Path:
        """``path`` resolved, or a 403 SessionError when it lies outside the folders given and the session."""
        path = Path(path).resolve()
        if not any(path == root or path.is_relative_to(root) for root in self.allowed_roots):
            raise SessionError(f"{path} is outside the folders this app was started with", status=403)
        return path

    def _unique_id(self, stem: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", stem).strip(".") or "image"
        candidate, n = base, 2
        while candidate in self.images:
            candidate, n = f"{base}_{n}", n + 1
        return candidate

    def add_path(self, path, check_allowed: bool = True) -> list[str]:
        """Add an image file, or every image of a folder; returns the new ids (a file already in the
        session is not added twice)."""
        from ..trainable.io import list_image_files

        path = Path(path)
        if check_allowed:
            path = self.check_allowed(path)
        try:
            files = list_image_files([path])
        except FileNotFoundError as err:
            raise SessionError(str(err), status=404) from None
        ids = []
        with self.lock:
            known = {(e.source, e.page) for e in self.images.values()}
            for f in files:
                f = f.resolve()
                if (f, None) in known or (f, 0) in known:
                    continue
                ids += self._add_file(f)
            self._save()
        return ids

    def _add_file(self, path: Path) -> list[str]:
        pages = _read_pages(path)
        ids = []
        for i, page in enumerate(pages):
            stem = path.stem if len(pages) == 1 else f"{path.stem}_z{i:03d}"
            entry = ImageEntry(self._unique_id(stem), path, None if len(pages) == 1 else i, tuple(page.shape))
            self.images[entry.id] = entry
            ids.append(entry.id)
        return ids

    def add_upload(self, name: str, data: bytes) -> list[str]:
        """Store an uploaded file under uploads/ and add it; a file that is no readable image is
        removed again and named in the error."""
        from ..trainable.io import IMAGE_SUFFIXES

        base = Path(name or "").name
        if Path(base).suffix.lower() not in IMAGE_SUFFIXES:
            raise SessionError(f"{base or 'the upload'} is not an image file name: expected one of "
                               f"{', '.join(IMAGE_SUFFIXES)}")
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", base)
        folder = self.folder / "uploads"
        folder.mkdir(exist_ok=True)
        target, n = folder / safe, 2
        while target.exists():
            target, n = folder / f"{Path(safe).stem}_{n}{Path(safe).suffix}", n + 1
        target.write_bytes(data)
        try:
            with self.lock:
                ids = self._add_file(target)
                self._save()
        except ValueError as err:
            target.unlink(missing_ok=True)
            raise SessionError(f"{base} cannot be read as an image: {err}") from None
        return ids

    def entry(self, image_id: str) -> ImageEntry:
        if image_id not in self.images:
            raise SessionError(f"no image {image_id!r} in this session", status=404)
        return self.images[image_id]

    def read(self, image_id: str) -> np.ndarray:
        """The image's pixels as stored (one page of a stack); the last few read stay in memory."""
        entry = self.entry(image_id)
        with self.lock:
            if image_id in self._read:
                self._read.move_to_end(image_id)
                return self._read[image_id]
        try:
            pages = _read_pages(entry.source)
        except (FileNotFoundError, ValueError) as err:
            raise SessionError(f"image {entry.name} cannot be read: {err}", status=409) from None
        with self.lock:
            return remember(self._read, image_id, pages[entry.page or 0], KEEP_READ)

    # ---- classes --------------------------------------------------------------------------
    def _check_name(self, name, value=None) -> str:
        name = (name or "").strip() if isinstance(name, str) else ""
        if not name:
            raise SessionError("a class needs a name")
        if any(c["name"].lower() == name.lower() and c["value"] != value for c in self.classes):
            raise SessionError(f"there is already a class named {name!r}")
        return name

    @staticmethod
    def _check_colour(colour) -> str:
        if not isinstance(colour, str) or not _COLOUR.match(colour):
            raise SessionError(f"colour must be #rrggbb, got {colour!r}")
        return colour.lower()

    def add_class(self, name, color=None) -> dict:
        with self.lock:
            name = self._check_name(name)
            value = max((c["value"] for c in self.classes), default=0) + 1
            if value > MAX_CLASSES:
                raise SessionError(f"at most {MAX_CLASSES} classes")
            colour = self._check_colour(color or DEFAULT_COLOURS[(value - 1) % len(DEFAULT_COLOURS)])
            cls = {"value": value, "name": name, "color": colour}
            self.classes.append(cls)
            self._save()
            return cls

    def class_by_value(self, value) -> dict:
        for c in self.classes:
            if c["value"] == value:
                return c
        raise SessionError(f"no class {value}", status=404)

    def update_class(self, value: int, name=None, color=None) -> dict:
        with self.lock:
            cls = self.class_by_value(value)
            if name is not None:
                cls["name"] = self._check_name(name, value)
            if color is not None:
                cls["color"] = self._check_colour(color)
            self._save()
            return cls

    # ---- labels ---------------------------------------------------------------------------
    def label_image(self, image_id: str) -> np.ndarray:
        """The image's labels (uint8, 0 = unlabelled), replayed from its strokes on first use."""
        with self.lock:
            if image_id not in self.labels:
                entry = self.entry(image_id)
                if not entry.shape:
                    entry.shape = tuple(self.read(image_id).shape)
                self.labels[image_id] = self._replay(entry)
            return self.labels[image_id]

    def _replay(self, entry: ImageEntry) -> np.ndarray:
        labels = np.zeros(entry.shape[:2], np.uint8)
        for s in entry.strokes:
            rasterise_stroke(labels, s["points"], s["radius"], 0 if s["erase"] else s["class"])
        return labels

    def counts(self, image_id: str) -> dict:
        """Labelled pixels per class value ({"1": n, ...}); kept per label version (the page polls
        the state while features are computed)."""
        entry = self.images[image_id]
        if image_id not in self.labels and not entry.strokes:
            return {}
        with self.lock:
            cached = self._counts.get(image_id)
            if cached is None or cached[0] != entry.version:
                counts = np.bincount(self.label_image(image_id).ravel(), minlength=MAX_CLASSES + 1)
                cached = self._counts[image_id] = (entry.version, {str(v): int(n) for v, n in enumerate(counts) if v and n})
            return cached[1]

    def add_stroke(self, image_id: str, cls, radius, points, erase: bool = False) -> int:
        entry = self.entry(image_id)
        if not erase and not any(c["value"] == cls for c in self.classes):
            raise SessionError(f"no class {cls!r}: add the class first (or draw with the eraser)")
        if not isinstance(radius, (int, float)) or not 1 <= radius <= MAX_RADIUS:
            raise SessionError(f"radius must be between 1 and {MAX_RADIUS} px, got {radius!r}")
        try:
            pts = np.asarray(points, np.float64).reshape(-1, 2)
        except (TypeError, ValueError):
            raise SessionError("points must be a list of [x, y] pairs") from None
        if len(pts) == 0 or not np.isfinite(pts).all():
            raise SessionError("a stroke needs at least one finite [x, y] point")
        stroke = {"class": int(cls or 0), "radius": float(radius), "points": pts.round(2).tolist(), "erase": bool(erase)}
        with self.lock:
            labels = self.label_image(image_id)
            rasterise_stroke(labels, stroke["points"], stroke["radius"], 0 if erase else stroke["class"])
            entry.strokes.append(stroke)
            entry.undone.clear()
            entry.version += 1
            self._save_labels(entry)
            return entry.version

    def undo(self, image_id: str, redo: bool = False) -> int:
        entry = self.entry(image_id)
        with self.lock:
            source, target = (entry.undone, entry.strokes) if redo else (entry.strokes, entry.undone)
            if not source:
                raise SessionError(f"nothing to {'redo' if redo else 'undo'} on {entry.name}", status=409)
            target.append(source.pop())
            self.label_image(image_id)
            self.labels[image_id] = self._replay(entry)
            entry.version += 1
            self._save_labels(entry)
            return entry.version

    def labelled_ids(self) -> list[str]:
        return [i for i, e in self.images.items() if e.strokes and self.label_image(i).any()]

    # ---- settings -------------------------------------------------------------------------
    def update_settings(self, **changes) -> dict:
        with self.lock:
            self.settings.update(changes)
            self._save()
            return dict(self.settings)

    def fix_intensity(self) -> tuple[float, float]:
        """The session's intensity range and colour handling, fitted once on its images (at most
        INTENSITY_SAMPLE of them, evenly spaced): what the features of every image are computed with,
        so opening an image can compute them at once."""
        from ..images import fit_intensity_range

        with self.lock:
            if self.intensity_range is None:
                if not self.images:
                    raise SessionError("the session has no images: add or upload one", status=409)
                ids = list(self.images)
                ids = [ids[i] for i in np.linspace(0, len(ids) - 1, min(len(ids), INTENSITY_SAMPLE)).round().astype(int)]
                arrays = [self.read(i) for i in ids]
                kinds = {a.ndim for a in arrays}
                self.colour = "channels" if len(kinds) == 1 else "grey"
                self.intensity_range = list(fit_intensity_range(arrays, colour=self.colour == "channels"))
                self._save()
            return tuple(self.intensity_range)
