"""The Measure panel's server side: the prediction the page shows, measured by :mod:`alibi_vit.measure` (the
computation of ``alibi-vit segment measure``), as JSON for the panel and a CSV of its table.

- **An image** read whole: the current model's whole prediction of it (what ``mask.png`` sends; the part not
  predicted yet is predicted first), in pixels: the app knows no pixel size of a 2D image.
- **A volume's slice**: the predicted slice shown (the app shows a volume's prediction a slice at a time), with
  the in-plane voxel spacing of the volume's metadata when it has one.
- **A whole volume**: predicted first into a mask file by the code of the volume's Save (block by block, with a
  copy of the model, into a scratch folder of the session removed afterwards), then that mask measured block
  by block, in the volume's voxel spacing. It takes the time of a Save of the mask, minutes for a big volume.
- **A big image** (read chunk by chunk) is refused: its prediction in the page fills in block by block and is
  never sent whole; its saved mask is what ``segment measure`` reads, block by block.

The metrics are the block-by-block families (fractions with their tile-bootstrap interval, interfaces, S2,
objects, percolation); chords, local thickness and tortuosity hold the region whole and stay with the command.
Measuring is a background job on a thread of its own, as a Save is (the worker stays free for Train and the
overlays): it waits for the prediction (on the worker; a whole volume's on the job's thread), then measures;
``done`` / ``total`` count the mask's pixels read (for a whole volume, the voxels predicted, then read: twice
its voxels in all), and Cancel stops it between blocks.
"""

from __future__ import annotations

import csv
import io
import secrets
import shutil
from pathlib import Path

import numpy as np

from .engine import NOW, Engine, Job
from .errors import SessionError
from .scheduler import Cancelled
from .volume import AXES, Volumes

__all__ = ["CSV_COLUMNS", "panel_result", "start_image_measurement", "start_slice_measurement",
           "start_volume_measurement"]

NOTHING_TO_MEASURE = "nothing to measure: there is no prediction of {name} yet. Train and predict first"
WAIT_S = 0.2  # how often a job waiting for the worker checks for Cancel
# The panel's table as a CSV: (key of a row of "classes", column header); {unit} is the measurement's unit,
# {cells} what it counts: "pixels" in a 2D mask, "voxels" in a volume.
CSV_COLUMNS = (
    ("measured", "measured"), ("phase", "phase"), ("name", "class"), ("{cells}", "{cells}"),
    ("fraction", "fraction"), ("tile_ci95_low", "tile_ci95_low"), ("tile_ci95_high", "tile_ci95_high"),
    ("tile_se", "tile_se"),
    ("specific_surface_isotropic", "specific_surface_isotropic_per_{unit}"),
    ("specific_surface_faces", "specific_surface_faces_per_{unit}"),
    ("objects", "objects"), ("border_objects", "border_objects"),
    ("mean_equivalent_diameter", "mean_equivalent_diameter_{unit}"),
    ("median_equivalent_diameter", "median_equivalent_diameter_{unit}"), ("diameters_of", "diameters_of"),
    ("percolates_along", "percolates_along"),
)


# ---- starting a measurement -------------------------------------------------------------------------
def start_image_measurement(engine: Engine, image_id: str) -> Job:
    """A job measuring the current model's prediction of an image read whole; 404 for no such image, 413 for a
    big one, 409 before there is a model to predict with."""
    entry = engine.session.entry(image_id)
    if entry.chunked:
        raise SessionError(f"{entry.name} is read chunk by chunk: its prediction is never whole in the app. Save its "
                           "mask and measure that with alibi-vit segment measure (block by block)", status=413)
    if engine.current_model() is None:
        raise SessionError(NOTHING_TO_MEASURE.format(name=entry.name), status=409)
    measured = {"kind": "image", "id": image_id, "name": entry.name}

    @_cancellable
    def run(job: Job) -> None:
        from ..measure.masks import array_source

        job.message = "predicting the rest of the image"
        store = _on_worker(engine, engine.submit_prediction(image_id), job)
        measured.update(model=store.model, crf=bool(store.crf))
        mask = engine.whole(store, "mask")
        _measure(engine, job, array_source(mask, name=measured["name"]), measured, axes=("y", "x"))

    return engine.start_job(1, None, run)


def start_slice_measurement(engine: Engine, volumes: Volumes, volume_id: str, view: str, index: int) -> Job:
    """A job measuring the prediction of one slice of a volume (``view``, ``index``: the slice shown); 404 for no
    such volume or slice, 409 before a volume model is trained."""
    axis, index = volumes.check_slice(volume_id, view, index)
    entry = volumes.entry(volume_id)
    if volumes.model is None:
        raise SessionError(NOTHING_TO_MEASURE.format(name=entry.name), status=409)
    stored = volumes.image(volume_id).spacing  # (z, y, x) from the metadata, or None
    spacing = None if stored is None else tuple(float(s) for a, s in enumerate(stored) if a != axis)
    axes = tuple(a for i, a in enumerate("zyx") if i != axis)  # the slice's rows and columns
    across = "zyx"[axis]
    measured = {"kind": "volume", "id": volume_id, "name": f"{entry.name} {view.upper()} {across} = {index}",
                "view": view, "index": index}

    def predict():
        return volumes.predicted_plane(volume_id, view, index)

    @_cancellable
    def run(job: Job) -> None:
        from ..measure.masks import array_source

        job.message = "predicting the slice"
        key = ("volume-plane", volume_id, AXES[axis], index, volumes.model["id"])
        mask, model = _on_worker(engine, engine.scheduler.submit(key, predict, NOW), job)
        measured.update(model=model, crf=False)
        _measure(engine, job, array_source(mask, spacing=spacing, name=measured["name"]), measured, axes=axes)

    return engine.start_job(1, None, run)


def start_volume_measurement(engine: Engine, volumes: Volumes, volume_id: str) -> Job:
    """A job measuring the prediction of a whole volume: predicted into a mask file by the volume's Save
    (:meth:`~alibi_vit.app.volume.Volumes.save`, in a scratch folder of the session removed afterwards), then that
    mask read block by block, in the volume's voxel spacing; 404 for no such volume, 409 before a volume model is
    trained."""
    from ..measure.masks import open_mask

    entry = volumes.entry(volume_id)
    if volumes.model is None:
        raise SessionError(NOTHING_TO_MEASURE.format(name=entry.name), status=409)
    stored = volumes.image(volume_id).spacing  # (z, y, x) from the metadata, or None
    # The volume's spacing, not the mask file's metadata: a volume without one is measured in voxels.
    spacing = (1.0, 1.0, 1.0) if stored is None else tuple(float(s) for s in stored)
    model_id = volumes.model["id"]
    measured = {"kind": "volume", "id": volume_id, "name": f"{entry.name} (whole volume)", "whole": True,
                "model": model_id, "crf": False}
    voxels = int(np.prod(entry.shape))
    scratch = volumes.folder / "volumes" / f".measure-{secrets.token_hex(4)}"

    @_cancellable
    def run(job: Job) -> None:
        copied = False  # whether the Save has begun its blocks: it copies the model before the first

        def predicted(done: int, total: int) -> None:
            """The Save's progress: its blocks predicted, as the first half of the job (the second: voxels read)."""
            nonlocal copied
            if job.cancelled.is_set():
                raise Cancelled("cancelled")  # the Save stops here and removes the mask begun
            if done and not copied:
                copied = True
                if (volumes.model or {}).get("id") != model_id:  # a Train finished before the copy: which model?
                    raise SessionError(f"a Train finished as the prediction of {entry.name} began: measure again",
                                       status=409)
            job.done = voxels * done // max(total, 1)

        try:
            job.message = "predicting the volume"
            written = volumes.save(volume_id, scratch, ["masks"], predicted)
            mask = Path(written["masks"][0])  # <stem>_mask.tif or .ome.zarr: the Save's only output
            _measure(engine, job, open_mask(mask, spacing), measured, axes=("z", "y", "x"), start=voxels)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    return engine.start_job(2 * voxels, None, run)


def _cancellable(run):
    """``run(job)`` finishing the job as cancelled when Cancel stopped it (any other error is the job's error)."""
    def cancellable(job: Job) -> None:
        try:
            run(job)
        except Cancelled:
            if not job.cancelled.is_set():
                raise  # the worker's own reason (the server stops, the backbone changed): the job's error
            job.finish("cancelled", f"cancelled while {job.message}")

    return cancellable


def _on_worker(engine: Engine, task, job: Job):
    """The result of a worker task, waited for on the job's thread; Cancel stops waiting (and drops the task if
    nobody else waits for it)."""
    try:
        while not task.future.done():
            if job.cancelled.wait(WAIT_S):
                raise Cancelled("cancelled")
        return task.future.result()
    finally:
        engine.scheduler.release(task)


def _measure(engine: Engine, job: Job, source, measured: dict, axes, start: int = 0) -> None:
    """Measure ``source`` (a :class:`~alibi_vit.measure.masks.MaskSource`: a 2D mask or a volume's) and finish
    ``job`` with the panel's result; the voxels read count from ``start`` (what the job did before)."""
    from ..measure.analysis import LOCAL_METRICS, MeasureOptions, measure_mask

    # What segment measure calls a spacing from metadata: lengths in the metadata's (unnamed) unit.
    unit = "px" if all(s == 1.0 for s in source.spacing) else "unit"
    job.total, job.done, job.message = start + source.size, start, "measuring"
    source.reader = _CountingReader(source.reader, job)
    result = measure_mask(source, MeasureOptions(metrics=LOCAL_METRICS, unit=unit, progress=False,
                                                 log=lambda text: None))
    job.done = job.total
    panel = panel_result(result, engine.session.classes, measured, axes)
    job.finish("done", f"measured {measured['name']} in {result['seconds']:.2f} s", panel)


class _CountingReader:
    """A mask source's reader that counts the voxels read into the job's progress (blocks carry a halo, so the
    count can reach the total a little early) and stops the measurement between blocks on Cancel."""

    def __init__(self, reader, job: Job):
        self.reader, self.job = reader, job

    def __call__(self, box):
        if self.job.cancelled.is_set():
            raise Cancelled("cancelled")
        values = self.reader(box)
        self.job.done = min(self.job.total, self.job.done + int(np.size(values)))
        return values


# ---- what the panel shows -------------------------------------------------------------------------------
def panel_result(result: dict, classes: list[dict], measured: dict, axes=None) -> dict:
    """The Measure panel's JSON from :func:`~alibi_vit.measure.analysis.measure_mask`'s ``result`` of a 2D mask or
    a volume: a table row per phase (``classes``: its pixels or voxels, fraction and its tile interval, specific
    surface, objects, percolation), the interfaces per phase pair, the S2 curves, the percolation rows and the
    table as CSV. ``classes``: the session's (value, name, color); ``axes``: what the mask's axes are, the names its
    per-axis numbers get (``("z", "x")`` for the rows and columns of an XZ slice; default: the mask's own, y x or
    z y x)."""
    from ..measure.report import object_summary, plain

    by_value = {c["value"]: c for c in classes}
    own_axes = tuple(result["axes"])  # "yx" for a 2D mask, "zyx" for a volume
    axes = own_axes if axes is None else tuple(axes)
    rename = dict(zip(own_axes, axes))
    rename["mean"] = "mean"
    cells = "voxels" if result["ndim"] == 3 else "pixels"

    def named(phase):
        cls = by_value.get(phase, {})
        return {"name": cls.get("name", f"class {phase}"), "color": cls.get("color")}

    phases = result["fractions"]["phases"]
    objects = {row["phase"]: row for row in object_summary(result)}
    spans = {}
    for row in result["percolation"]:
        if row["percolates"]:
            spans.setdefault(row["phase"], []).append(rename[row["axis"]])
    rows = []
    for phase, entry in sorted(phases.items()):
        surface = result["specific_surface"][phase]
        found = objects[phase]
        rows.append({"measured": measured["name"], "phase": phase, **named(phase), cells: entry["voxels"],
                     "fraction": entry["fraction"], "tile_ci95_low": entry["tile_ci95_low"],
                     "tile_ci95_high": entry["tile_ci95_high"], "tile_se": entry["tile_se"],
                     "specific_surface_isotropic": surface["isotropic"], "specific_surface_faces": surface["faces"],
                     **{k: found[k] for k in ("objects", "border_objects", "mean_equivalent_diameter",
                                              "median_equivalent_diameter", "diameters_of")},
                     "percolates_along": " ".join(spans.get(phase, []))})
    some = next(iter(phases.values()))
    curves = {}
    for row in result["s2"]:
        curve = curves.setdefault((row["phase"], row["axis"]), {"phase": row["phase"], "axis": rename[row["axis"]],
                                                                "r": [], "distance": [], "s2": []})
        for key in ("r", "distance", "s2"):
            curve[key].append(row[key])
    panel = {
        "measured": measured, "shape": result["shape"], "ndim": result["ndim"], "axes": list(axes), "cells": cells,
        "spacing": result["spacing"], "unit": result["unit"], "seconds": result["seconds"],
        "interval": {"name": "tile bootstrap", "level": 0.95, "tiles": some["tiles"], "tile_side": some["tile_side"]},
        "classes": rows,
        "interfaces": [{**{k: v for k, v in row.items() if k not in {f"faces_{a}" for a in own_axes}},
                        "names": [named(row["phase_a"])["name"], named(row["phase_b"])["name"]],
                        **{f"faces_{rename[a]}": row[f"faces_{a}"] for a in own_axes}}
                       for row in result["interfaces"]],
        "s2": list(curves.values()),
        "percolation": [{**row, "axis": rename[row["axis"]]} for row in result["percolation"]],
        "objects_dropped_small": result.get("objects_dropped_small", 0),
    }
    panel = plain(panel)
    panel["csv"] = table_csv(panel["classes"], panel["unit"], cells)
    return panel


def table_csv(rows: list[dict], unit: str, cells: str = "pixels") -> str:
    """The panel's table (its ``classes`` rows) as CSV text, every number at full precision; ``cells``: what the
    mask counts, "pixels" or "voxels"."""
    columns = [(key.format(cells=cells), header.format(unit=unit, cells=cells)) for key, header in CSV_COLUMNS]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([header for _, header in columns])
    for row in rows:
        writer.writerow(["" if row.get(key) is None else row[key] for key, _ in columns])
    return out.getvalue()
