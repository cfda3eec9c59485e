"""Segmenting many images, on one machine or many: the units of work of ``segment apply``.

A unit is one image, or one tile of one pass over an image read lazily in chunks (a mosaic larger
than memory, :mod:`~alibi_vit.trainable.stream`), plus that image's first unit (its digest, its
scaling, its empty output stores) and last (pyramids, BigTIFF). Units run wherever the
:mod:`~alibi_vit.trainable.scheduler` sends them; each writes only below its image's staging folder
(:meth:`~alibi_vit.trainable.output_folder.OutputFolder.stage`, on the shared file system), and a
tile only its own chunks. :func:`run_jobs`, in the process that started the run, hands out the
units, shows one progress bar over all of them, and moves each image's files into place once its
last unit is done (:meth:`~alibi_vit.trainable.output_folder.OutputFolder.commit`).

The model travels as its folder's files (:class:`ModelPackage`, no pickle of the model itself),
sent to each worker once and loaded there once per process. A unit's result depends only on the
model and the image, never on where or when it ran, so outputs are byte-identical whatever the
scheduler, the number of workers, the shard split or the order of completion.

Failures: an input that cannot be read (a damaged file, a damaged tile) makes its unit return the
error rather than raise it, so it is not retried; its image is skipped and listed. A unit that
raises anything else is retried by the scheduler a bounded number of times, and rescheduled on
another worker when its worker dies (killed, out of memory); past those bounds its image is skipped
and listed too. A failed write (a full disk) stops the run: no later image could be written either.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .output_folder import input_digest
from .writers import OutputError, output_error

__all__ = ["ImageJob", "ModelPackage", "run_jobs"]

_MODELS: dict = {}  # a worker's loaded model: (digest, crf, modal, device, spacing) → TrainableSegmenter


@dataclass(frozen=True)
class ModelPackage:
    """A model folder's files and the apply-time settings (CRF, modal filter, device) that change it."""

    digest: str
    files: dict
    crf: object
    modal: int
    device: str | None = None
    spacing: tuple | None = None  # a volume model's --spacing (None: each volume's own)

    @classmethod
    def from_folder(cls, folder, digest: str, crf, modal: int, device=None, spacing=None) -> "ModelPackage":
        folder = Path(folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return cls(digest, files, crf, int(modal), device, tuple(spacing) if spacing is not None else None)


def resolve_model(model):
    """The segmenter a unit runs: ``model`` itself in the process that loaded it, or, on a worker, the
    one :class:`ModelPackage` loaded once per process."""
    if not isinstance(model, ModelPackage):
        return model
    key = (model.digest, model.crf, model.modal, model.device, model.spacing)
    seg = _MODELS.get(key)
    if seg is None:
        from .segmenter import TrainableSegmenter

        _threads_as_the_worker_says()

        with tempfile.TemporaryDirectory(prefix="alibi-vit-model-") as folder:
            for name, data in model.files.items():
                (Path(folder) / name).parent.mkdir(parents=True, exist_ok=True)
                (Path(folder) / name).write_bytes(data)
            seg = TrainableSegmenter.load(folder, device=model.device)
        seg.crf, seg.modal = model.crf, model.modal
        if model.spacing is not None:
            seg.spacing = model.spacing
        _MODELS.clear()  # one model per worker at a time
        _MODELS[key] = seg
    return seg


def _threads_as_the_worker_says() -> None:
    """Size OpenCV's thread pool by ``OMP_NUM_THREADS``, as XGBoost and PyTorch are. Dask sets it to 1 in
    its worker processes so that N single-threaded workers use N cores; OpenCV would otherwise start a
    thread per core in every worker (16 workers on a 16-core node: 256 threads fighting for 16 cores)."""
    from ..runtime import omp_threads

    threads = omp_threads()
    if threads is not None:
        import cv2

        cv2.setNumThreads(threads)


@dataclass(frozen=True)
class ImageJob:
    """One input image and where and how its outputs are written.

    staged: this image's staging folder (its outputs' folder, mirrored); fmt: png, tif, ome-zarr or
    bigtiff (the last two streamed tile by tile); chunked: read lazily, so its tiles are units of their
    own; units: how many units it takes (the progress bar's share); resume_sha256: with --resume, the
    input digest an earlier run recorded (equal: the image is kept, not redone); volume: a volume
    model's input, segmented on 3D features block by block in one unit (its blocks are not spread
    over workers), into a TIFF stack (tif, bigtiff) or OME-Zarr, one CSV row per volume."""

    path: str
    row: str
    stem: str
    staged: str
    fmt: str
    proba: bool
    overlays: bool
    chunked: bool = False
    units: int = 1
    resume_sha256: str | None = None
    volume: bool = False


@dataclass
class Result:
    """What a unit sends back: the image's CSV rows, its input digest, or why it failed."""

    rows: list = field(default_factory=list)
    sha256: str = ""
    kept: bool = False  # --resume: the earlier outputs are kept
    error: str = ""  # the input could not be read: the image is skipped
    notes: list = field(default_factory=list)  # warnings raised while segmenting, shown by the driver
    cpu: float = 0.0
    layout: object = None  # a chunked image's StreamLayout (its first unit)
    counts: object = None  # a tile's class pixel counts (last pass only)


def _caught(fn):
    """Run ``fn()`` into a :class:`Result`: the warnings it raised as notes, an unreadable input as error."""
    cpu = time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn()
        except OutputError:
            raise
        except (OSError, ValueError) as err:  # a damaged file or tile: this image is skipped, not retried
            result = Result(error=str(err) or type(err).__name__)
    result.notes = list(dict.fromkeys(str(w.message) for w in caught))
    result.cpu = time.process_time() - cpu
    return result


def segment_image(model, job: ImageJob) -> Result:
    """Unit: one whole image (or an in-memory image streamed in one piece) into its staging folder."""
    seg = resolve_model(model)

    def work():
        sha256 = input_digest(job.path)
        if job.resume_sha256 == sha256:
            return Result(sha256=sha256, kept=True)
        if job.volume or job.fmt in ("ome-zarr", "bigtiff"):
            from ..chunked import open_volume
            from ..images import read_array
            from .stream import segment_to_files

            image = open_volume(job.path) if job.volume else read_array(job.path)
            result = segment_to_files(seg, image, job.staged, job.stem, job.fmt, proba=job.proba,
                                      overlays=job.overlays, progress=False)
            if result.note:
                warnings.warn(f"note: {result.note}")
            return Result(rows=[(job.row, result.counts.tolist(), result.size)], sha256=sha256)
        return Result(rows=_segment_whole(seg, job), sha256=sha256)

    return _caught(work)


def read_stack(path) -> list | None:
    """The slices of a stack (a multi-page TIFF, or a folder of numbered slices), or None for one image."""
    from ..chunked import is_zarr_path, open_slice_folder
    from .io import read_slices

    path = Path(path)
    if path.is_dir() and not is_zarr_path(path):
        return list(open_slice_folder(path).read_box(slice(None), slice(None), slice(None)))
    return read_slices(path)


def _segment_whole(seg, job: ImageJob) -> list:
    """Segment an image read whole (or a TIFF stack, slice by slice) and write its files; its CSV rows."""
    from ..images import read_array, scale_colour
    from .io import area_fractions, overlay, write_mask, write_overlay, write_proba

    path, dest, k = Path(job.path), Path(job.staged), int(seg.classes_.max())
    stack = read_stack(path)
    arrays, is_stack = (stack, True) if stack is not None else ([read_array(path)], False)
    seg.check_channels(arrays[0], str(path))
    scaled = [seg.scale(a, f"{path} slice {z}" if is_stack else str(path)) for z, a in enumerate(arrays)]
    probas = [seg.predict_proba([x], scaled=True)[0] for x in scaled]
    masks = [seg.mask_from_proba(p) for p in probas]
    rows = [(f"{job.row}[{z}]" if is_stack else job.row, area_fractions(mask, seg.classes_)[0].tolist(), mask.size)
            for z, mask in enumerate(masks)]
    if is_stack:  # written back as a stack: TIFF whatever the format; no overlays
        with _writing(dest / f"{job.stem}_mask.tif"):
            write_mask(dest / f"{job.stem}_mask.tif", np.stack(masks), k)
        if job.proba:
            with _writing(dest / f"{job.stem}_proba_*.tif"):
                write_proba(dest, job.stem, np.stack(probas), seg.classes_)
        return rows
    with _writing(dest / f"{job.stem}_mask.{job.fmt}"):
        write_mask(dest / f"{job.stem}_mask.{job.fmt}", masks[0], k)
    if job.proba:
        with _writing(dest / f"{job.stem}_proba_*.tif"):
            write_proba(dest, job.stem, probas[0], seg.classes_)
    if job.overlays:
        # Colour images are shown in their own colours (by dtype), grayscale as the model scaled it.
        shown = scale_colour(arrays[0], "auto", str(path)) if scaled[0].ndim == 3 else scaled[0]
        with _writing(dest / f"{job.stem}_overlay.png"):
            write_overlay(dest / f"{job.stem}_overlay.png", overlay(shown, masks[0], 0.4, k))
    return rows


@contextmanager
def _writing(target: Path):
    """An OSError while writing ``target`` (a full disk) becomes an :class:`OutputError` naming it: the run
    stops there, rather than skipping every later image for the same reason (the staged part is discarded)."""
    try:
        yield
    except OutputError:
        raise
    except OSError as err:
        raise output_error(target, err) from err


def prepare_chunked(model, job: ImageJob) -> Result:
    """First unit of an image read in chunks: its digest (and --resume check), its scaling (a sample of
    tiles for per-image intensity modes) and its empty output stores; the layout its tiles follow."""
    seg = resolve_model(model)

    def work():
        from ..chunked import open_image
        from .stream import StreamLayout

        sha256 = input_digest(job.path)
        if job.resume_sha256 == sha256:
            return Result(sha256=sha256, kept=True)
        with seg._call():
            src = seg.source(open_image(job.path), job.stem)
        layout = StreamLayout.plan(seg, src, job.staged, job.stem, job.fmt, proba=job.proba, overlays=job.overlays,
                                   input_path=job.path)
        layout.create()
        return Result(sha256=sha256, layout=layout)

    return _caught(work)


def segment_tile(model, layout, step: int, index) -> Result:
    """Unit: tile ``index`` of pass ``step`` of a chunked image, written into its stores."""
    seg = resolve_model(model)

    def work():
        with seg._call():
            counts = layout.run_tile(seg, layout.source(), step, index)
        return Result(counts=counts)

    return _caught(work)


def finish_chunked(layout) -> Result:
    """Last unit of a chunked image: its pyramids (and BigTIFF files)."""

    def work():
        layout.finish()
        return Result()

    return _caught(work)


def chunked_units(shape, seg) -> int:
    """Units of a chunked image: its first, its tiles in every pass, its last."""
    from .stream import passes

    return 2 + sum(len(grid) for _, grid in passes(shape, seg.tile, seg.halo, bool(seg.crf), int(seg.modal)))


@dataclass
class _Chunked:
    """The driver's state of one chunked image between its units."""

    job: ImageJob
    started: float
    sha256: str = ""
    layout: object = None
    step: int = 0
    units_done: int = 0
    waiting: int = 0
    counts: object = None
    cpu: float = 0.0


@dataclass
class Outcome:
    """What :func:`run_jobs` did: images written, kept (--resume) and failed (name, reason)."""

    written: int = 0
    kept: int = 0
    failed: list = field(default_factory=list)


def run_jobs(executor, model, jobs: list[ImageJob], folder, progress: bool = True) -> Outcome:
    """Run every unit of ``jobs`` on ``executor`` (model: a segmenter, or a handle
    :meth:`~alibi_vit.trainable.scheduler.Executor.broadcast` gave), committing each image into
    ``folder`` (an :class:`~alibi_vit.trainable.output_folder.OutputFolder`) once its units are done."""
    outcome = Outcome()
    bar = tqdm(total=sum(job.units for job in jobs), desc="segment", unit="unit", disable=not progress)
    pending = executor.completed([])
    what: dict = {}  # future → (job, kind, chunked state)
    failed_images: set = set()

    def submit(fn, job, kind, state, *args):
        future = executor.submit(fn, *args, follow_up=kind in ("tile", "finish"))
        what[future] = (job, kind, state)
        pending.add(future)

    def fail(job: ImageJob, reason: str, state=None) -> None:
        """Skip the image (its other units are ignored as they come), and count all its units as done."""
        warnings.warn(f"skipped {job.path}: {reason}")
        outcome.failed.append((Path(job.path).name, reason))
        failed_images.add(job.row)
        folder.discard(job.row)
        bar.update(1 if state is None else job.units - state.units_done)

    for job in jobs:
        if job.chunked:
            state = _Chunked(job, time.perf_counter())
            submit(prepare_chunked, job, "prepare", state, model, job)
        else:
            submit(segment_image, job, "image", None, model, job)
    try:
        for future in pending:
            job, kind, state = what.pop(future)
            if job.row in failed_images:  # a unit of an image that failed already: nothing to do
                continue
            try:
                result = future.result()
            except OutputError:
                raise
            except Exception as err:  # noqa: BLE001 - raised again after the retries, or its worker kept dying
                fail(job, f"{type(err).__name__}: {err}" if str(err) else type(err).__name__, state)
                continue
            for note in result.notes:
                warnings.warn(note)
            if result.error:
                fail(job, result.error, state)
                continue
            if state is None:  # a whole image: done
                _finish_image(folder, job, result, outcome)
                bar.update()
                continue
            state.units_done += 1
            state.cpu += result.cpu
            bar.update()
            if kind == "prepare":
                state.sha256 = result.sha256
                if result.kept:
                    _finish_image(folder, job, result, outcome)
                    bar.update(job.units - state.units_done)
                    continue
                state.layout, state.counts = result.layout, np.zeros(len(result.layout.classes), np.int64)
                if result.layout.note:
                    tqdm.write(f"note: {result.layout.note}", file=sys.stderr)
                _submit_step(state, submit, model)
            elif kind == "tile":
                if result.counts is not None:
                    state.counts += result.counts
                state.waiting -= 1
                if state.waiting == 0:  # the pass is done: the next one reads what it wrote
                    state.step += 1
                    if state.step < len(state.layout.steps()):
                        _submit_step(state, submit, model)
                    else:
                        submit(finish_chunked, job, "finish", state, state.layout)
            else:  # finish
                size = state.layout.shape[0] * state.layout.shape[1]
                seconds = time.perf_counter() - state.started
                _finish_image(folder, job, Result(rows=[(job.row, state.counts.tolist(), size)], sha256=state.sha256),
                              outcome)
                names = ", ".join(p.name for p in state.layout.final_paths())
                tqdm.write(f"{job.row}: {size / 1e6:.1f} MP in {seconds:.1f} s ({size / 1e6 / seconds:.2f} MP/s, "
                           f"{state.cpu:.0f} CPU s) → {names}", file=sys.stderr)
    finally:
        bar.close()
    return outcome


def _submit_step(state: _Chunked, submit, model) -> None:
    _, grid = state.layout.steps()[state.step]
    state.waiting = len(grid)
    for tile in grid:
        submit(segment_tile, state.job, "tile", state, model, state.layout, state.step, tile.index)


def _finish_image(folder, job: ImageJob, result: Result, outcome: Outcome) -> None:
    if result.kept:
        manifest = folder.finished(job.row)
        if manifest is None:  # its files went away during the run
            warnings.warn(f"skipped {job.path}: its earlier outputs were removed during the run; run again")
            outcome.failed.append((Path(job.path).name, "outputs removed"))
            return
        folder.keep(job.row, manifest)
        outcome.kept += 1
        return
    folder.commit(job.row, Path(job.path), result.rows, result.sha256)
    outcome.written += 1
