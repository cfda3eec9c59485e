"""One mask measured: a pass over its blocks for the local metrics, then the global ones on the region in memory.

Local metrics (fractions, interfaces, S2 up to a radius, objects and percolation) read the mask block by
block with a halo, so memory is a few blocks whatever the mask's size. Global metrics (chord lengths, local
thickness, tortuosity) need the whole region at once: their size and memory are printed before they start,
and a region larger than ``max_memory`` is refused with a message naming ``--region``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import chunks
from .correlation import PairCorrelation, pair_counts
from .fractions import FractionCounts, cell_counts, cell_probability, cell_side, settles, tile_side
from .masks import MAX_PHASES, MaskSource, MeasureError
from .objects import ObjectLabels, block_objects
from .sizes import (
    CHORD_BYTES_PER_VOXEL,
    THICKNESS_BASE_BYTES,
    THICKNESS_BYTES_PER_VOXEL,
    chord_lengths,
    import_porespy,
    local_thickness,
    size_histogram,
)
from .surfaces import InterfaceCounts, face_counts, specific_surface
from .transport import TORTUOSITY_BASE_BYTES, TORTUOSITY_BYTES_PER_VOXEL, import_taufactor, percolation, tortuosity

__all__ = ["DEFAULT_METRICS", "GLOBAL_METRICS", "LOCAL_METRICS", "METRICS", "BlockJob", "MeasureOptions",
           "measure_block", "measure_mask"]

LOCAL_METRICS = ("fractions", "surfaces", "s2", "objects", "percolation")
GLOBAL_METRICS = ("chords", "thickness", "tortuosity")
METRICS = LOCAL_METRICS + GLOBAL_METRICS
DEFAULT_METRICS = LOCAL_METRICS + ("chords",)  # thickness and tortuosity need an extra and take long: on request
INSTANCE_TIFF_VOXELS = 1 << 26  # instance labels up to this size go to one TIFF, larger ones to zarr


@dataclass
class MeasureOptions:
    metrics: tuple[str, ...] = DEFAULT_METRICS
    radius: int = 32  # S2 up to this many voxels
    block: int | None = None  # core side of the blocks (default per dimensionality)
    tile: int | None = None  # bootstrap tile side (default: ≥ 4 tiles a side)
    min_size: int = 0  # objects smaller than this (voxels) are dropped
    max_memory: int = 2 * 10**9  # bytes a global metric may take
    unit: str = "px"
    instance_labels: Path | None = None  # where to write the objects' instance labels (None: not written)
    device: str | None = None  # TauFactor's device (default: cuda if available)
    progress: bool = True
    log: object = field(default=print, repr=False)


def _checked(values: np.ndarray, name: str) -> np.ndarray:
    """A block's values as uint8 phase values, or a :class:`MeasureError` naming the value out of range."""
    if values.dtype == np.uint8:
        return values
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= MAX_PHASES:
        bad = low if low < 0 else high
        raise MeasureError(f"{name}: holds the value {bad}; a phase mask holds class values 0..{MAX_PHASES - 1} "
                           "(is it an instance-label image?)")
    return values.astype(np.uint8)


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="block", disable=not enabled or total <= 1, leave=False)


@dataclass(frozen=True)
class BlockJob:
    """Everything a block's local metrics need besides the block: sent once to each of a scheduler's workers."""

    source: MaskSource
    cell: int
    radius: int  # S2 up to this many voxels; 0 with no S2
    surfaces: bool
    s2: bool
    objects: bool
    probabilities: dict | None = None
    intensity: MaskSource | None = None

    @property
    def axes(self) -> tuple[int, ...]:
        return (0, 1, 2) if self.source.ndim == 3 else (1, 2)


def measure_block(job: BlockJob, block: chunks.Block) -> dict:
    """One block's share of every local metric (a unit of work, run here or on a scheduler's worker)."""
    source = job.source
    values = _checked(source.read(block.read), source.name)
    core = chunks.core_view(values, block)
    cell_z = 1 if source.ndim == 2 else job.cell
    share = {"counts": cell_counts(core, cell_z, job.cell)}
    share["probability"] = {phase: cell_probability(source_read(proba, source, block.core), cell_z, job.cell)
                            for phase, proba in (job.probabilities or {}).items()}
    if job.surfaces:
        share["faces"] = face_counts(values, block.core_shape, job.axes)
    if job.s2:
        share["pairs"] = pair_counts(values, block.core_shape, job.axes, job.radius,
                                     np.flatnonzero(np.bincount(values.ravel())))
    if job.objects:
        grey = source_read(job.intensity, source, block.core, scale=False) if job.intensity is not None else None
        share["objects"] = block_objects(np.ascontiguousarray(core), [s.start for s in block.core], job.axes, grey)
    return share


def _block_shares(job: BlockJob, grid: list, executor):
    """``(block, share)`` of every block, in raster order here or as a scheduler's workers finish them."""
    if executor is None:
        for block in grid:
            yield block, measure_block(job, block)
        return
    handle = executor.broadcast(job)
    futures = {executor.submit(measure_block, handle, block): block for block in grid}
    for future in executor.completed(list(futures)):
        yield futures.pop(future), future.result()  # dropped once added up: the cluster frees the share


def measure_mask(source: MaskSource, options: MeasureOptions, probabilities: dict | None = None,
                 intensity: MaskSource | None = None, executor=None) -> dict:
    """The chosen metrics of ``source`` (already restricted to its region) as a dict of plain values and
    arrays; see the package docstring for the families. ``probabilities``: ``{class: map}`` for the
    fractions' probability view; ``intensity``: the image the mask segments, for the objects' mean intensity.
    ``executor``: where the blocks' local metrics run (``submit``/``broadcast``/``completed``, as
    :mod:`alibi_vit.trainable.scheduler` gives for a Dask cluster); None: one after the other in this process."""
    metrics = set(options.metrics) | {"fractions"}
    if "percolation" in metrics:
        metrics.add("objects")
    started = time.perf_counter()
    ndim, shape, spacing = source.ndim, source.shape, source.spacing
    cell = cell_side(ndim, shape)
    tile = tile_side(ndim, shape, cell, options.tile)
    side = chunks.block_side(ndim, cell, options.block)
    radius = min(options.radius, max(shape[3 - ndim:]) - 1) if "s2" in metrics else 0
    halo = max(radius, 1 if "surfaces" in metrics else 0)
    counts = FractionCounts(shape, ndim, cell)
    interfaces = InterfaceCounts(ndim) if "surfaces" in metrics else None
    correlation = PairCorrelation(ndim, radius) if "s2" in metrics else None
    objects = ObjectLabels(shape, ndim, chunks.grid_shape(shape, side)) if "objects" in metrics else None
    job = BlockJob(source, cell, radius, interfaces is not None, correlation is not None, objects is not None,
                   probabilities, intensity)
    grid = list(chunks.blocks(shape, side, halo))
    with _bar(len(grid), f"{Path(source.name).name}: local metrics", options.progress) as bar:
        for block, share in _block_shares(job, grid, executor):
            counts.add(block.core, share["counts"])
            for phase, (sums, variance) in share["probability"].items():
                counts.add_probability(phase, block.core, sums, variance)
            if interfaces is not None:
                interfaces.add(share["faces"])
            if correlation is not None:
                correlation.add(share["pairs"])
            if objects is not None:
                objects.add(block.index, share["objects"])
            bar.update()
    result = {"mask": source.name, "shape": list(shape[3 - ndim:]), "ndim": ndim, "axes": source.axes,
              "spacing": [spacing[a] for a in range(3 - ndim, 3)], "unit": options.unit,
              "origin": list(source.origin[3 - ndim:]), "cell": cell, "block": side}
    fractions = counts.summary(tile)
    for phase, entry in fractions["phases"].items():
        entry.update(settles(fractions["windows"], phase, entry["fraction"]))
    result["fractions"] = fractions
    phase_voxels = {p: e["voxels"] for p, e in fractions["phases"].items()}
    voxel_size = float(np.prod([spacing[a] for a in range(3 - ndim, 3)]))
    if interfaces is not None:
        rows = interfaces.summary(spacing, fractions["voxels"])
        result["interfaces"] = rows
        result["specific_surface"] = {p: specific_surface(rows, p, n, voxel_size) for p, n in phase_voxels.items()}
    if correlation is not None:
        result["s2"] = correlation.summary(spacing)
    if objects is not None:
        table, mapping = objects.resolve(spacing, options.min_size)
        result["objects_dropped_small"] = table.pop("dropped_small")
        result["objects"] = table
        if "percolation" in metrics:
            result["percolation"] = percolation(table, phase_voxels, ndim)
        if options.instance_labels is not None:
            result["instance_labels"] = str(_write_instances(source, objects, mapping, grid, options))
    result["seconds_local"] = time.perf_counter() - started
    wanted = [m for m in GLOBAL_METRICS if m in metrics]
    if wanted:
        _global_metrics(source, options, wanted, phase_voxels, result)
    result["seconds"] = time.perf_counter() - started
    return result


def source_read(other: MaskSource, mask: MaskSource, core, scale: bool = True) -> np.ndarray:
    """The values of ``other`` (a probability map, an intensity image) on a block's core, restricted like the
    mask; 8-bit probabilities are scaled to 0..1."""
    shifted = tuple(slice(o + s.start, o + s.stop) for o, s in zip(mask.origin, core))
    values = np.asarray(other.reader(shifted), np.float64)
    return values / 255.0 if scale and other.dtype == np.uint8 else values


def _write_instances(source, objects, mapping, grid, options) -> Path:
    """The object id of every voxel (0: objects under the minimum size), in a second pass over the blocks."""
    path = Path(options.instance_labels)
    dtype = np.uint32 if mapping.max(initial=0) < 2**32 else np.uint64
    squeeze = source.ndim == 2
    if source.size <= INSTANCE_TIFF_VOXELS:
        import tifffile

        out = np.zeros(source.shape, dtype)
        target = path.with_suffix(".tif")
    else:
        import zarr

        target = path.with_suffix(".zarr")
        chunk = tuple(min(n, s) for n, s in zip(source.shape, (1 if squeeze else grid[0].core_shape[0],) +
                                                grid[0].core_shape[1:]))
        out = zarr.create_array(str(target), shape=source.shape[1:] if squeeze else source.shape,
                                chunks=chunk[1:] if squeeze else chunk, dtype=dtype, overwrite=True)
    with _bar(len(grid), f"{Path(source.name).name}: instance labels", options.progress) as bar:
        for block in grid:
            core = chunks.core_view(_checked(source.read(block.read), source.name), block)
            ids = mapping[objects.block_ids(np.ascontiguousarray(core), block.index)]
            if squeeze and not isinstance(out, np.ndarray):
                out[block.core[1:]] = ids[0].astype(dtype)
            else:
                out[block.core] = ids.astype(dtype)
            bar.update()
    if isinstance(out, np.ndarray):
        tifffile.imwrite(target, out[0] if squeeze else out, compression="zlib")
    return target


def _gigabytes(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e7 else f"{nbytes / 1e6:.2f} MB"


def _describe(shape, nbytes: float) -> str:
    return f"{'×'.join(str(n) for n in shape)} voxels, about {_gigabytes(nbytes)}"


def _global_metrics(source: MaskSource, options: MeasureOptions, wanted, phase_voxels, result) -> None:
    """Chords, local thickness and tortuosity on the region in memory, after checking what they take."""
    voxels = source.size
    costs = {"chords": (0, 1 + CHORD_BYTES_PER_VOXEL),
             "thickness": (THICKNESS_BASE_BYTES, 1 + THICKNESS_BYTES_PER_VOXEL),
             "tortuosity": (TORTUOSITY_BASE_BYTES, 1 + TORTUOSITY_BYTES_PER_VOXEL)}
    # The libraries stay imported once loaded, so their bases add up within one run.
    bases = sum(costs[metric][0] for metric in wanted)
    need = {metric: bases + voxels * per_voxel for metric, (_, per_voxel) in costs.items()}
    shape = source.shape[3 - source.ndim:]
    for metric in wanted:
        if need[metric] > options.max_memory:
            per_voxel = costs[metric][1]
            fits = (options.max_memory - bases) / per_voxel
            limit = f"over --max-memory {_gigabytes(options.max_memory)}"
            if fits < 8 ** source.ndim:
                raise MeasureError(f"{source.name}: {metric} needs {_describe(shape, need[metric])}, {limit}, "
                                   f"which leaves no room for it (the libraries alone take {_gigabytes(bases)}); "
                                   "raise --max-memory")
            side = int(fits ** (1 / source.ndim))
            example = ",".join(f"0:{min(n, side)}" for n in shape)
            raise MeasureError(f"{source.name}: {metric} works on the whole region at once: "
                               f"{_describe(shape, need[metric])}, {limit}; measure a sub-volume with --region "
                               f"{example} (or raise --max-memory)")
    if "thickness" in wanted:
        import_porespy("local thickness")
    if "tortuosity" in wanted:
        import_taufactor()
    values = np.zeros(source.shape, np.uint8)
    for block in chunks.blocks(source.shape, chunks.block_side(source.ndim, 1, options.block), 0):
        values[block.core] = _checked(source.read(block.core), source.name)
    spacing = source.spacing
    axes = (0, 1, 2) if source.ndim == 3 else (1, 2)
    phases = sorted(phase_voxels)
    if "chords" in wanted:
        rows = []
        for phase in phases:
            for axis in axes:
                lengths = chord_lengths(values, phase, axis) * spacing[axis]
                rows.append({"phase": phase, "axis": "zyx"[axis], "chords": len(lengths),
                             "mean": float(lengths.mean()) if len(lengths) else float("nan"),
                             "histogram": size_histogram(lengths, step=spacing[axis])})
        result["chords"] = rows
    if "thickness" in wanted:
        options.log(f"{source.name}: local thickness (porespy) of {len(phases)} phases on "
                    f"{_describe(shape, need['thickness'])}")
        thickness = {}
        for phase in phases:
            radii = local_thickness(values, phase, spacing) * spacing[2]
            diameters = 2 * radii
            thickness[phase] = size_histogram(diameters, step=2 * spacing[2])  # per voxel: volume-weighted
        result["thickness"] = thickness
    if "tortuosity" in wanted:
        import torch

        device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        options.log(f"{source.name}: tortuosity factor (TauFactor, {device}) of {len(phases)} phases × {len(axes)} "
                    f"axes on {_describe(shape, need['tortuosity'])}; on 2 CPU cores TauFactor took 119 s for one "
                    "256³ solve, and the time grows faster than the voxel count")
        rows = []
        bar = _bar(len(phases) * len(axes), f"{Path(source.name).name}: tortuosity", options.progress)
        with bar:
            for phase in phases:
                for axis in axes:
                    solved = tortuosity(values, phase, axis, spacing, device)
                    rows.append({"phase": phase, "axis": "zyx"[axis], **solved})
                    bar.update()
        result["tortuosity"] = rows
