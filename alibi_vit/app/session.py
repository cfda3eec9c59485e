"""The app's session folder: classes, images, labels and strokes, kept on disk as they change.

Layout (human-readable, so a user can leave the app and go on with ``alibi-vit segment``)::

    session.json          classes (value, name, colour), images (id, source file, page, pixel kind,
                          whether it is read chunk by chunk), settings, the intensity range fitted
                          on the session's images
    labels/<id>.png       the label image: 0 = unlabelled, 1..K = class values (Weka/ilastik convention)
    labels/<id>.zarr      ... of a big image (read chunk by chunk): a zarr array of which only the
                          512² blocks that hold a label exist (:mod:`~alibi_vit.app.labels`)
    strokes/<id>.json     the strokes drawn on the image, in order, and those undone (for redo)
    uploads/              images uploaded through the page
    model/                the last trained model (written by the engine)
    cache/                display levels and predictions of big images (the engine's; disposable)
    export/               what Save writes (unless the app was given --out)

Every change is written before it takes effect: a change whose file cannot be written (a full
disk) is refused with 507 and leaves the session as it was, in memory and on disk, so nothing the
page was told is saved can vanish on a restart. Each file is replaced atomically (a temporary file
renamed over the old one), so a closed tab or a stopped server never leaves a half-written file,
and is created with the permissions the user's umask gives any new file (as exports are).

Files are read only from the folders the app was given, the session folder and ``--out``: a
symbolic link inside them that points elsewhere is not followed, and a file whose path has come to
point elsewhere since it was added is not read. Each real file is one image, however many links
or folders given lead to it. One session holds images of one pixel kind (one bit depth, grey or
colour; :mod:`~alibi_vit.app.imagefiles`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
import unicodedata
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..trainable.output_folder import image_stem
from .errors import SessionError
from .imagefiles import DEFAULT_MAX_PIXELS, describe_kind, inspect_file, open_chunked, pixel_kind, read_images
from .labels import SparseLabels

__all__ = ["DEFAULT_COLOURS", "ImageEntry", "Session", "SessionError", "not_saved", "painted", "png_bytes",
           "rasterise_stroke", "remember", "stroke_footprint", "stroke_work", "write_atomic"]

FORMAT = 1
MAX_CLASSES = 255  # label images are 8-bit
MAX_NAME = 60  # characters of a class name
MAX_RADIUS = 256
MAX_POINTS = 20_000  # points of one stroke
MAX_COORDINATE = 1e6  # px: stroke points farther from the image are refused
MAX_STROKE_WORK = 1 << 26  # pixel-distance evaluations one stroke may cost (~2-3 s on one core)
MAX_UPLOAD_STEM = 100  # characters kept of an uploaded file's name (the file system allows 255 bytes)
KEEP_READ = 8  # images kept in memory as read (training reads every labelled image after each stroke)
INTENSITY_SAMPLE = 16  # images the session's intensity range is fitted on, evenly spaced
# Default class colours (the masks' palette of alibi_vit.trainable.io, as #rrggbb).
DEFAULT_COLOURS = ("#e6194b", "#3cb44b", "#0082c8", "#ffe119", "#911eb4", "#46f0f0", "#f58231", "#f032e6",
                   "#d2f53c", "#fabebe")
_COLOUR = re.compile(r"^#[0-9a-fA-F]{6}$")
_CONTROL = {"Cc", "Cf", "Cs", "Co"}  # control, format (e.g. right-to-left override), surrogate, private use


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically. The file is created like any new file (the umask
    applies), not 0600 as ``tempfile.mkstemp`` would make it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def not_saved(what: str, folder: Path, err: OSError) -> SessionError:
    """The 507 answer for a write that failed (a full disk, a read-only folder)."""
    return SessionError(f"{what} was not saved: cannot write to {folder} ({err.strerror or err}); free some space "
                        "or fix the folder's permissions, then try again", status=507)


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


def _segments(points):
    pts = np.asarray(points, np.float64).reshape(-1, 2)
    return list(zip(pts, pts[1:])) if len(pts) > 1 else [(pts[0], pts[0])]


def _segment_box(a, b, radius: float, shape) -> tuple[int, int, int, int]:
    """Rows r0:r1 and columns c0:c1 of the image that a segment's capsule can reach."""
    h, w = shape
    c0 = max(int(np.floor(min(a[0], b[0]) - radius)), 0)
    c1 = min(int(np.ceil(max(a[0], b[0]) + radius)) + 1, w)
    r0 = max(int(np.floor(min(a[1], b[1]) - radius)), 0)
    r1 = min(int(np.ceil(max(a[1], b[1]) + radius)) + 1, h)
    return r0, r1, c0, c1


def stroke_work(shape, points, radius: float) -> int:
    """Pixels :func:`rasterise_stroke` evaluates for a stroke (the sum of its segments' boxes)."""
    total = 0
    for a, b in _segments(points):
        r0, r1, c0, c1 = _segment_box(a, b, radius, shape)
        total += max(r1 - r0, 0) * max(c1 - c0, 0)
    return total


def stroke_footprint(shape, points, radius: float) -> list[tuple[int, int, np.ndarray]]:
    """The pixels of an image of ``shape`` whose centre lies within ``radius`` of the polyline
    through ``points`` ((x, y) = (column, row) in pixels; one point paints a disc), as pieces
    (row, column, boolean mask placed there), one per segment: a long stroke across a big image
    costs its segments' boxes, not the box around it all."""
    pieces = []
    for a, b in _segments(points):
        r0, r1, c0, c1 = _segment_box(a, b, radius, shape)
        if c0 >= c1 or r0 >= r1:
            continue
        yy, xx = np.mgrid[r0:r1, c0:c1]
        d = b - a
        length2 = float(d @ d)
        t = np.zeros(xx.shape) if length2 == 0 else np.clip(((xx - a[0]) * d[0] + (yy - a[1]) * d[1]) / length2, 0, 1)
        dist2 = (xx - a[0] - t * d[0]) ** 2 + (yy - a[1] - t * d[1]) ** 2
        pieces.append((r0, c0, dist2 <= radius * radius))
    return pieces


def painted(labels, pieces, value: int):
    """A copy of ``labels`` (an array or :class:`~alibi_vit.app.labels.SparseLabels`) with ``value``
    painted on the pieces of :func:`stroke_footprint`; ``labels`` itself is left as it is."""
    if isinstance(labels, SparseLabels):
        return labels.painted(pieces, value)
    out = labels.copy()
    for row, col, mask in pieces:
        out[row:row + mask.shape[0], col:col + mask.shape[1]][mask] = value
    return out


def rasterise_stroke(labels: np.ndarray, points, radius: float, value: int) -> None:
    """Paint ``value`` into ``labels`` on every pixel whose centre lies within ``radius`` of the
    polyline through ``points`` ((x, y) = (column, row) in pixels; one point paints a disc)."""
    for row, col, mask in stroke_footprint(labels.shape, points, radius):
        labels[row:row + mask.shape[0], col:col + mask.shape[1]][mask] = value


@dataclass
class ImageEntry:
    """One image of the session: a file, or one page of a multi-page TIFF. ``chunked``: a big image
    (a zarr store, a BigTIFF), read chunk by chunk and never whole."""
    id: str
    source: Path
    page: int | None = None
    shape: tuple = ()  # (H, W) or (H, W, C)
    kind: str | None = None  # pixel kind, e.g. "uint16 grey" (imagefiles.pixel_kind)
    chunked: bool = False
    strokes: list = field(default_factory=list)
    undone: list = field(default_factory=list)
    version: int = 0

    @property
    def name(self) -> str:
        return self.source.name + (f" [page {self.page}]" if self.page is not None else "")

    def record(self) -> dict:
        return {"id": self.id, "source": str(self.source), "page": self.page, "shape": list(self.shape),
                "kind": self.kind, "chunked": self.chunked}


def _check_number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SessionError(f"{what} must be a number, got {value!r}")
    return float(value)



def unique_id(stem: str, taken, fallback: str = "image") -> str:
    """An id made of ``stem``'s safe characters (``fallback`` if none), numbered ``_2``, ``_3``, …
    until it is not in ``taken``."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", stem).strip(".") or fallback
    candidate, n = base, 2
    while candidate in taken:
        candidate, n = f"{base}_{n}", n + 1
    return candidate


def refuse_relinked(source: Path, what: str) -> None:
    """A 403 :class:`SessionError` naming ``what`` when ``source``, or a folder above it, became a symbolic
    link since it was added (sources are stored resolved)."""
    if source.resolve() != source:
        raise SessionError(f"{what} is not read: {source} now leads to {source.resolve()} (a symbolic link)",
                           status=403)


class Session:
    """The state of one app session, mirrored to its folder on every change (thread-safe).

    sources: image files and folders added at start; a file that cannot be read, is too large, is
    a link out of the folders given, or is of another pixel kind than the majority is skipped and
    named in ``skipped``. allowed_roots: the folders ``add_path`` may read from (with the session
    folder). max_pixels: the largest image read (:mod:`~alibi_vit.app.imagefiles`). volume_claim:
    ``claim(path, ids)`` of the volume mode (:class:`~alibi_vit.app.volume.Volumes`), which takes a
    file that is a volume (returns its id) before it is read as 2D images.
    """

    def __init__(self, folder, sources=(), allowed_roots=(), max_pixels: int = DEFAULT_MAX_PIXELS, volume_claim=None):
        self.folder = Path(folder).resolve()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise SessionError(f"cannot create the session folder {self.folder}: {err.strerror}") from None
        if not os.access(self.folder, os.W_OK):
            raise SessionError(f"session folder {self.folder} is not writable")
        self.max_pixels = int(max_pixels)
        self.lock = threading.RLock()
        self.classes: list[dict] = []
        self.images: dict[str, ImageEntry] = {}
        self.settings = {"backbone": None, "crf": False, "live": False}
        self.intensity_range = None
        self.colour = None  # "channels", or "grey" in sessions made before images had to share one kind
        self.kind = None  # the pixel kind every image shares (imagefiles.pixel_kind)
        self.skipped: list[str] = []  # files given at start that were not added, each with the reason
        self.labels: dict[str, np.ndarray] = {}  # in memory, loaded on first use
        self._read: OrderedDict[str, np.ndarray] = OrderedDict()
        self._counts: dict[str, tuple[int, dict]] = {}  # id → (label version, counts)
        given = [Path(s) if Path(s).is_dir() else Path(s).parent for s in sources]
        self.allowed_roots = [Path(r).resolve() for r in [*allowed_roots, *given]] + [self.folder]
        if (self.folder / "session.json").is_file():
            self._load()
        self.volume_claim = volume_claim
        self.skipped = self._add_sources(sources)
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
            self.kind = state.get("kind")
            for rec in state["images"]:
                entry = ImageEntry(rec["id"], Path(rec["source"]), rec.get("page"), tuple(rec.get("shape") or ()),
                                   rec.get("kind"), bool(rec.get("chunked", False)))
                strokes = self.folder / "strokes" / f"{entry.id}.json"
                if strokes.is_file():
                    saved = json.loads(strokes.read_text())
                    entry.strokes, entry.undone = saved["strokes"], saved["undone"]
                    entry.version = int(saved.get("version", len(entry.strokes)))
                self.images[entry.id] = entry
        except (ValueError, KeyError, TypeError) as err:
            raise SessionError(f"{path} cannot be read ({err}); start a new session with --session NEW_DIR") from None

    def _save(self, what: str = "the change", **changes) -> None:
        """Write session.json as it is with ``changes`` (classes, settings, images, intensity_range,
        colour, kind) applied; the caller applies them in memory once this returned."""
        state = {"format": FORMAT, "classes": self.classes, "settings": self.settings,
                 "intensity_range": self.intensity_range, "colour": self.colour, "kind": self.kind,
                 "images": list(self.images.values())}
        state.update(changes)
        state["images"] = [e.record() for e in state["images"]]
        try:
            write_atomic(self.folder / "session.json", (json.dumps(state, indent=2) + "\n").encode())
        except OSError as err:
            raise not_saved(what, self.folder, err) from None

    def _write_label_copy(self, entry: ImageEntry, labels, before) -> None:
        """The label image in the folder: a PNG, or for a big image the blocks that changed since
        ``before`` in its zarr store."""
        if isinstance(labels, SparseLabels):
            labels.write(self.folder / "labels" / f"{entry.id}.zarr", before)
        else:
            write_atomic(self.folder / "labels" / f"{entry.id}.png", png_bytes(labels))

    def _commit_labels(self, entry: ImageEntry, strokes: list, undone: list, labels, what: str) -> None:
        """Write an image's new labels and strokes, then make them the session's (version + 1).

        The label image goes first: the strokes file is what a restart replays, so when the label
        image cannot be written nothing has changed, and when the strokes file cannot be, the old
        label image is put back."""
        version = entry.version + 1
        before = self.labels.get(entry.id)
        try:
            self._write_label_copy(entry, labels, before)
            try:
                write_atomic(self.folder / "strokes" / f"{entry.id}.json",
                             json.dumps({"version": version, "strokes": strokes, "undone": undone}).encode())
            except OSError:
                if before is not None:
                    try:
                        self._write_label_copy(entry, before, labels)
                    except OSError:
                        pass  # the strokes file, not this copy, is what a restart reads
                raise
        except OSError as err:
            raise not_saved(what, self.folder, err) from None
        entry.strokes, entry.undone, entry.version = strokes, undone, version
        self.labels[entry.id] = labels

    # ---- images ---------------------------------------------------------------------------
    def _inside(self, path: Path) -> bool:
        return any(path == root or path.is_relative_to(root) for root in self.allowed_roots)

    def check_allowed(self, path: Path) -> Path:
        """``path`` resolved, or a 403 SessionError when it lies outside the folders given and the session."""
        path = Path(path).resolve()
        if not self._inside(path):
            raise SessionError(f"{path} is outside the folders this app was started with", status=403)
        return path

    def _inspect(self, path: Path) -> tuple[list[tuple[tuple, str]], bool]:
        """([(shape, pixel kind)] of each image in a file, whether it is read chunk by chunk): a file
        read whole is read in full (an unreadable one fails here), a big one only opened."""
        return inspect_file(path, self.max_pixels)

    def _session_kind(self) -> str | None:
        """The kind the session's images share (that of its first image in sessions that did not record it)."""
        if self.kind is None and self.images:
            entry = next(iter(self.images.values()))
            try:
                self.kind = entry.kind or pixel_kind(self.read(entry.id))
            except SessionError:
                return None
        return self.kind

    def _kind_refusal(self, name: str, kind: str, session_kind: str, chosen: bool) -> SessionError | None:
        """Why an image of ``kind`` cannot join images of ``session_kind`` (None: it can). ``chosen``:
        that kind is the majority of the images being added, not yet the session's."""
        if (kind.split()[0] == session_kind.split()[0]) if self.colour == "grey" else kind == session_kind:
            return None
        whose = "most images given are" if chosen else "this session's images are"
        return SessionError(f"{name} is {describe_kind(kind)} but {whose} {describe_kind(session_kind)}: one session "
                            "segments images of one kind (one intensity scale is fitted on them); open it in a session "
                            "of its own (alibi-vit app … --session OTHER_DIR)")

    def _admit(self, found: list[tuple[Path, tuple]]) -> tuple[list[str], list[SessionError]]:
        """Add the inspected files ``found`` [(path, ([(shape, kind), ...], chunked))] whose kind fits
        the session; returns (new ids, why the others were refused). Caller holds the lock."""
        entries, refused = {}, []
        known = {(e.source, e.page) for e in self.images.values()}
        kind = self._session_kind()
        chosen = kind is None
        if chosen and found:  # a new session takes the kind most of its first images share
            kind = Counter(k for _, (pages, _) in found for _, k in pages).most_common(1)[0][0]
        for path, (pages, chunked) in found:
            if (path, None) in known or (path, 0) in known:
                continue
            known.add((path, None))  # a file listed twice (through a link, a folder given twice) is one image
            reason = self._kind_refusal(path.name, pages[0][1], kind, chosen)
            if reason:
                refused.append(reason)
                continue
            for i, (shape, page_kind) in enumerate(pages):
                stem = image_stem(path) if len(pages) == 1 else f"{image_stem(path)}_z{i:03d}"
                entry = ImageEntry(unique_id(stem, {**self.images, **entries}), path,
                                   None if len(pages) == 1 else i, shape, page_kind, chunked)
                entries[entry.id] = entry
        if entries:
            images = {**self.images, **entries}
            self._save("the new images", images=list(images.values()), kind=kind)
            self.images, self.kind = images, kind
        return list(entries), refused

    def _inspect_files(self, files, explicit: Path | None = None,
                       seen: set | None = None) -> tuple[list, list[SessionError]]:
        """Inspect image files; a file other than ``explicit`` must lie in the allowed folders once
        its links are followed. Returns ([(resolved path, pages)], why the others were skipped).
        ``seen``: resolved paths met before (updated): each real file is inspected once, however many
        links or folders given lead to it."""
        found, skipped = [], []
        seen = set() if seen is None else seen
        for f in files:
            real = f.resolve()
            if real in seen:
                continue
            seen.add(real)
            if f != explicit and not self._inside(real):
                skipped.append(SessionError(f"{f.name} is a link to {real}, outside the folders this app was started "
                                            "with: not added", status=403))
                continue
            try:
                if self.volume_claim is not None and self.volume_claim(real, self.images):  # a volume's entry
                    continue
                found.append((real, self._inspect(real)))
            except SessionError as err:
                skipped.append(err)
            except (OSError, ValueError) as err:
                skipped.append(SessionError(f"{f.name} cannot be read as an image ({err}): not added"))
        return found, skipped

    def _add_sources(self, sources) -> list[str]:
        """Add the files and folders given at start; returns why files were skipped."""
        from ..trainable.io import list_image_files

        found, skipped, seen = [], [], set()
        for src in sources:
            src = Path(src)
            inspected, why = self._inspect_files(list_image_files([src]), explicit=src if src.is_file() else None,
                                                 seen=seen)
            found += inspected
            skipped += why
        with self.lock:
            skipped += self._admit(found)[1]
        return [str(err) for err in skipped]

    def add_path(self, path) -> tuple[list[str], list[str]]:
        """Add an image file, or every image of a folder, from inside the allowed folders; returns
        (new ids, why files of the folder were skipped). One image (a file, a zarr store) that cannot be
        added is an error; a file already in the session is not added twice."""
        from ..trainable.io import list_image_files

        try:
            path = self.check_allowed(Path(path))
            files = list_image_files([path])
        except FileNotFoundError as err:
            raise SessionError(str(err), status=404) from None
        except OSError as err:
            raise SessionError(f"cannot use this path: {err.strerror or err}") from None
        found, skipped = self._inspect_files(files)
        with self.lock:
            ids, refused = self._admit(found)
        skipped += refused
        if skipped and files == [path]:  # one image (a file, a zarr store), not a folder of them
            raise skipped[0]
        return ids, [str(err) for err in skipped]

    def add_upload(self, name: str, data: bytes) -> list[str]:
        """Store an uploaded file under uploads/ and add it; a file that is no readable image (or too
        large, or of another pixel kind) is removed again and named in the error."""
        from ..trainable.io import IMAGE_SUFFIXES

        base = Path(name or "").name
        suffix = Path(base).suffix.lower()
        if suffix not in IMAGE_SUFFIXES:
            shown = base if len(base) <= 80 else base[:77] + "…"
            raise SessionError(f"{shown or 'the upload'} is not an image file name: expected one of "
                               f"{', '.join(IMAGE_SUFFIXES)}")
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(base).stem)[:MAX_UPLOAD_STEM] or "upload"
        folder = self.folder / "uploads"
        with self.lock:  # two uploads of one name at once get two files
            target, n = folder / f"{stem}{suffix}", 2
            while target.exists():
                target, n = folder / f"{stem}_{n}{suffix}", n + 1
            try:
                write_atomic(target, data)
            except OSError as err:
                raise not_saved(f"the upload {target.name}", folder, err) from None
        try:
            if self.volume_claim is not None and self.volume_claim(target, self.images):  # a volume's entry
                return []
            inspected = self._inspect(target)
            with self.lock:
                ids, refused = self._admit([(target, inspected)])
            if refused:
                raise refused[0]
        except SessionError:
            target.unlink(missing_ok=True)
            raise
        except (OSError, ValueError) as err:
            target.unlink(missing_ok=True)
            raise SessionError(f"{target.name} cannot be read as an image: {err}") from None
        except BaseException:
            target.unlink(missing_ok=True)
            raise
        return ids

    def entry(self, image_id: str) -> ImageEntry:
        if not isinstance(image_id, str) or image_id not in self.images:
            raise SessionError(f"no image {image_id!r} in this session", status=404)
        return self.images[image_id]

    def read(self, image_id: str):
        """The image's pixels as stored (one page of a stack), the last few read kept in memory; for
        a big image its chunked view (:class:`~alibi_vit.chunked.ChunkedImage`: nothing read yet)."""
        entry = self.entry(image_id)
        with self.lock:
            if image_id in self._read:
                self._read.move_to_end(image_id)
                return self._read[image_id]
        refuse_relinked(entry.source, f"image {entry.name}")
        try:
            image = open_chunked(entry.source, self.max_pixels) if entry.chunked else \
                read_images(entry.source, self.max_pixels)[entry.page or 0]
        except SessionError:
            raise
        except (OSError, ValueError) as err:
            raise SessionError(f"image {entry.name} cannot be read: {err}", status=409) from None
        with self.lock:
            return remember(self._read, image_id, image, KEEP_READ)

    # ---- classes --------------------------------------------------------------------------
    def _check_name(self, name, value=None) -> str:
        name = name.strip() if isinstance(name, str) else ""
        if not name:
            raise SessionError("a class needs a name")
        if len(name) > MAX_NAME:
            raise SessionError(f"class names are at most {MAX_NAME} characters; this one has {len(name)}")
        if any(unicodedata.category(ch) in _CONTROL for ch in name):
            raise SessionError("class names may not contain control or invisible formatting characters")
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
            classes = self.classes + [cls]
            self._save("the new class", classes=classes)
            self.classes = classes
            return cls

    def class_by_value(self, value) -> dict:
        for c in self.classes:
            if c["value"] == value:
                return c
        raise SessionError(f"no class {value}", status=404)

    def update_class(self, value: int, name=None, color=None) -> dict:
        with self.lock:
            old = self.class_by_value(value)
            cls = dict(old)
            if name is not None:
                cls["name"] = self._check_name(name, value)
            if color is not None:
                cls["color"] = self._check_colour(color)
            classes = [cls if c is old else c for c in self.classes]
            self._save("the class change", classes=classes)
            self.classes = classes
            return cls

    # ---- labels ---------------------------------------------------------------------------
    def label_image(self, image_id: str):
        """The image's labels (uint8, 0 = unlabelled), replayed from its strokes on first use: an
        array, or for a big image :class:`~alibi_vit.app.labels.SparseLabels` (only the blocks that
        hold a label). Replaced on every change, never written in place."""
        with self.lock:
            if image_id not in self.labels:
                entry = self.entry(image_id)
                if not entry.shape:
                    entry.shape = tuple(self.read(image_id).shape)
                self.labels[image_id] = self._replay(entry, entry.strokes)
            return self.labels[image_id]

    @staticmethod
    def _replay(entry: ImageEntry, strokes):
        if entry.chunked:
            labels = SparseLabels(entry.shape[:2])
            for s in strokes:
                labels = labels.painted(stroke_footprint(entry.shape[:2], s["points"], s["radius"]),
                                        0 if s["erase"] else s["class"])
            return labels
        labels = np.zeros(entry.shape[:2], np.uint8)
        for s in strokes:
            rasterise_stroke(labels, s["points"], s["radius"], 0 if s["erase"] else s["class"])
        return labels

    def labels_and_version(self, image_id: str) -> tuple:
        """(labels, label version) read together (a stroke may be committing on another thread)."""
        with self.lock:
            return self.label_image(image_id), self.entry(image_id).version

    def label_png(self, image_id: str) -> tuple[bytes, int]:
        """The label image as PNG and the label version it shows (encoded outside the lock: a 4096²
        label image takes a while, and the state the page polls needs the lock)."""
        labels, version = self.labels_and_version(image_id)
        if isinstance(labels, SparseLabels):
            raise SessionError(f"{self.entry(image_id).name} is read chunk by chunk: its labels are sent as tiles "
                               "(/api/images/{id}/tiles/labels/...)", status=413)
        return png_bytes(labels), version

    def counts(self, image_id: str) -> dict:
        """Labelled pixels per class value ({"1": n, ...}); kept per label version (the page polls
        the state while features are computed)."""
        entry = self.images[image_id]
        if image_id not in self.labels and not entry.strokes:
            return {}
        cached = self._counts.get(image_id)
        if cached is not None and cached[0] == entry.version:  # without the lock: a stroke may be committing
            return cached[1]
        with self.lock:
            cached = self._counts.get(image_id)
            if cached is None or cached[0] != entry.version:
                labels = self.label_image(image_id)
                counts = labels.counts() if isinstance(labels, SparseLabels) else \
                    np.bincount(labels.ravel(), minlength=MAX_CLASSES + 1)
                cached = self._counts[image_id] = (entry.version, {str(v): int(n) for v, n in enumerate(counts) if v and n})
            return cached[1]

    def check_stroke(self, shape, cls, radius, points, erase: bool) -> dict:
        """A stroke's request checked against the session's classes and the limits, on a plane of
        ``shape`` ((H, W, …): an image, or a volume's slice); the stroke as stored."""
        if not erase:
            if isinstance(cls, bool) or not isinstance(cls, int) or not any(c["value"] == cls for c in self.classes):
                raise SessionError(f"no class {cls!r}: add the class first (or draw with the eraser)")
        radius = _check_number(radius, "radius")
        if not 1 <= radius <= MAX_RADIUS:
            raise SessionError(f"radius must be between 1 and {MAX_RADIUS} px, got {radius:g}")
        if not isinstance(points, list) or not points:
            raise SessionError("a stroke needs at least one [x, y] point")
        if len(points) > MAX_POINTS:
            raise SessionError(f"a stroke has at most {MAX_POINTS} points, got {len(points)}: split it")
        if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in points):
            raise SessionError("points must be a list of [x, y] pairs")
        pts = np.array([[_check_number(v, "a point coordinate") for v in p] for p in points], np.float64)
        if not np.isfinite(pts).all() or np.abs(pts).max() > MAX_COORDINATE:
            raise SessionError(f"stroke points must be finite pixel coordinates within ±{MAX_COORDINATE:,.0f}")
        work = stroke_work(shape[:2], pts, radius)
        if work > MAX_STROKE_WORK:
            raise SessionError(f"this stroke ({len(pts)} points of radius {radius:g}) is too large to paint at once "
                               f"({work / 1e6:.0f} M pixel tests, at most {MAX_STROKE_WORK / 1e6:.0f} M): split it "
                               "into shorter strokes")
        return {"class": 0 if erase and not isinstance(cls, int) else int(cls), "radius": radius,
                "points": pts.round(2).tolist(), "erase": bool(erase)}

    def add_stroke(self, image_id: str, cls, radius, points, erase: bool = False) -> int:
        entry = self.entry(image_id)
        self.label_image(image_id)  # the image's shape is known from here on
        stroke = self.check_stroke(entry.shape, cls, radius, points, erase)
        # Rasterised outside the lock (a long stroke does not hold up other requests); painting
        # the footprint does not depend on the labels, so strokes arriving meanwhile commute with it.
        footprint = stroke_footprint(entry.shape[:2], stroke["points"], stroke["radius"])
        with self.lock:
            labels = painted(self.label_image(image_id), footprint, 0 if stroke["erase"] else stroke["class"])
            self._commit_labels(entry, entry.strokes + [stroke], [], labels, "the stroke")
            return entry.version

    def undo(self, image_id: str, redo: bool = False, expected_version: int | None = None) -> int:
        """Undo (or redo) the image's last stroke. ``expected_version``: the label version the caller
        shows; when the labels have changed since (another tab drew), nothing is undone (409)."""
        entry = self.entry(image_id)
        which = "redo" if redo else "undo"
        with self.lock:
            if expected_version is not None and expected_version != entry.version:
                raise SessionError(f"{entry.name} was changed in another tab or window since this page showed it "
                                   f"(labels version {entry.version}, the page shows {expected_version}): nothing "
                                   f"was undone; the page now shows the current labels, {which} again if you want "
                                   "to", status=409)
            source, target = (entry.undone, entry.strokes) if redo else (entry.strokes, entry.undone)
            if not source:
                raise SessionError(f"nothing to {which} on {entry.name}", status=409)
            source, target = source[:-1], target + [source[-1]]
            strokes, undone = (target, source) if redo else (source, target)
            self.label_image(image_id)
            self._commit_labels(entry, strokes, undone, self._replay(entry, strokes), f"the {which}")
            return entry.version

    def labelled_ids(self) -> list[str]:
        return [i for i, e in self.images.items() if e.strokes and self.label_image(i).any()]

    def versions(self) -> dict[str, int]:
        """The label version of every image (what a model was trained on, to tell when it is stale)."""
        return {i: e.version for i, e in self.images.items()}

    # ---- settings -------------------------------------------------------------------------
    def update_settings(self, **changes) -> dict:
        with self.lock:
            settings = {**self.settings, **changes}
            self._save("the settings", settings=settings)
            self.settings = settings
            return dict(settings)

    def fix_intensity(self) -> tuple[float, float]:
        """The session's intensity range and colour handling, fitted once on its images (at most
        INTENSITY_SAMPLE of them, evenly spaced; of a big image, a seeded sample of its tiles of about
        a megapixel): what the features of every image are computed with, so opening an image can
        compute them at once."""
        from ..chunked import ChunkedImage, sample_tiles
        from ..images import fit_intensity_range

        with self.lock:
            if self.intensity_range is None:
                if not self.images:
                    raise SessionError("the session has no images: add or upload one", status=409)
                ids = list(self.images)
                ids = [ids[i] for i in np.linspace(0, len(ids) - 1, min(len(ids), INTENSITY_SAMPLE)).round().astype(int)]
                arrays = [self.read(i) for i in ids]
                arrays = [sample_tiles(a)[0] if isinstance(a, ChunkedImage) else a for a in arrays]
                colour = "channels" if len({a.ndim for a in arrays}) == 1 else "grey"
                intensity_range = list(fit_intensity_range(arrays, colour=colour == "channels"))
                self._save("the intensity range", intensity_range=intensity_range, colour=colour)
                self.intensity_range, self.colour = intensity_range, colour
            return tuple(self.intensity_range)
