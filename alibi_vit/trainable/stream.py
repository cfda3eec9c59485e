"""Segmenting an image larger than memory: prediction streamed tile by tile into files.

:func:`segment_to_files` runs a trained :class:`~alibi_vit.trainable.TrainableSegmenter` over an
image tile by tile and writes its class mask, an overlay and (optionally) the class probabilities
as they are computed: OME-Zarr images with a multiscale pyramid, or tiled pyramidal BigTIFF
(OME-TIFF) files (:mod:`~alibi_vit.trainable.writers`). The per-class pixel counts (the area
fractions) are summed over the streamed mask.

Post-processing that looks past a tile runs as further passes over what the pass before wrote to
a temporary zarr store in the output folder (removed at the end): the dense CRF (tiles of the
segmenter's ``tile`` px with 128 px of overlap, as :func:`~alibi_vit.trainable.crf.dense_crf_tiled`
cuts the whole image) and the modal filter (its window's half-width of context). Each pass equals
the whole-image computation, so the streamed outputs are those of
:meth:`~alibi_vit.trainable.TrainableSegmenter.predict_proba` and ``predict``.
Memory holds a few tiles' data, whatever the image size.

The work is laid out by a :class:`StreamLayout`, a small picklable description (input, scaling,
output names, passes), so that each tile of each pass can run on its own, in another process or
on another machine (``segment apply --scheduler``): every pass's tiles have the outputs' chunk
size and are aligned to it, so each tile writes whole chunks that no other tile writes, and no
locking is needed. A pass reads what the pass before wrote, so it starts once that pass is done.

Volumes (a :class:`~alibi_vit.trainable.volumes.VolumeSegmenter`) stream block by block the same
way into (z, y, x) outputs: OME-Zarr (``ome-zarr``, the voxel spacing as its scale), or a
multi-page TIFF stack (``tif``; ``bigtiff``: an OME-TIFF stack), converted from the zarr staging
page by page; no overlays (view the mask over the volume in napari or Fiji).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .crf import dense_crf
from .io import overlay, palette
from .segmenter import CRF_OVERLAP, modal_filter
from .sources import ChunkedSource
from .tiles import TileGrid
from .writers import ZarrOutput, zarr_to_tiff, zarr_to_tiff_stack

__all__ = ["OUT_FORMATS", "StreamLayout", "StreamResult", "passes", "segment_to_files"]

OUT_FORMATS = ("ome-zarr", "bigtiff")
VOLUME_FORMATS = ("ome-zarr", "bigtiff", "tif")


@dataclass
class StreamResult:
    """What :func:`segment_to_files` wrote: files, and per class value its pixel count."""

    counts: np.ndarray
    size: int
    paths: list = field(default_factory=list)
    note: str = ""  # how the intensity statistics were sampled, for per-image modes


def _display(src, core) -> np.ndarray:
    """The pixels an overlay shows: colour images in their own colours (integers by their type's
    maximum), grayscale as the model scaled it."""
    if isinstance(src, ChunkedSource) and src.colour and src.image.dtype.kind in "iu":
        from ..images import scale_to_range

        region = src.image.read(*core, src.plane)
        return scale_to_range(region, 0.0, float(np.iinfo(src.image.dtype).max), src.name, colour=True)
    return src.read(*core)


def passes(shape, tile: int, halo: int, crf: bool, modal: int) -> list[tuple[str, TileGrid]]:
    """The passes over an image in order, (name, tile grid): the classifier (tiles with the features'
    halo), the CRF (its overlap) and the modal filter (its half-window); every grid's cores are the
    outputs' chunks."""
    steps = [("classify", TileGrid(shape, tile, halo))]
    if crf:
        steps.append(("crf", TileGrid(shape, tile, CRF_OVERLAP)))
    if modal:
        steps.append(("modal", TileGrid(shape, tile, modal // 2)))
    return steps


@dataclass
class StreamLayout:
    """One streamed image: where its outputs go, its passes and tiles, and (for a chunked input) how
    a worker reopens and scales it. Built by :meth:`plan` from a segmenter and a source."""

    folder: Path
    stem: str
    out_format: str
    proba: bool
    overlays: bool
    shape: tuple
    tile: int
    classes: tuple
    halo: tuple  # the segmenter's feature halo per axis (the classifier pass reads its tiles with it)
    crf: bool
    modal: int
    input: str | None = None  # a chunked input's path; None for an in-memory image
    scaling: tuple = ()  # (lo, hi, colour) of the chunked input's ChunkedSource
    note: str = ""
    volume: bool = False  # (z, y, x) outputs: no overlay; TIFF outputs are stacks
    spacing: tuple | None = None  # a volume's voxel spacing, the OME-Zarr scale of level 0
    colours: object = None  # the class colours (a palette table), None: the default palette

    @classmethod
    def plan(cls, seg, src, folder, stem: str, out_format: str, *, proba: bool = False,
             overlays: bool = True, input_path=None, colours=None) -> "StreamLayout":
        volume = getattr(seg, "dims", 2) == 3
        formats = VOLUME_FORMATS if volume else OUT_FORMATS
        if out_format not in formats:
            raise ValueError(f"out_format must be one of {', '.join(formats)}, got {out_format!r}")
        scaling = (src.lo, src.hi, src.colour) if isinstance(src, ChunkedSource) else ()
        k = int(max(seg.classes_))
        colours = palette(k) if colours is None else np.asarray(colours, np.uint8)[:k + 1]
        spacing = getattr(src, "spacing", None)
        return cls(Path(folder), stem, out_format, proba, overlays and not volume, tuple(src.shape), seg.tile,
                   tuple(int(c) for c in seg.classes_), seg.tile_grid(src).halos, bool(seg.crf), int(seg.modal),
                   str(input_path) if input_path is not None and scaling and not volume else None, scaling,
                   getattr(src, "note", ""), volume, tuple(spacing) if spacing is not None else None, colours)

    # -- names -------------------------------------------------------------------------------------------
    @property
    def staging(self) -> Path:
        return self.folder / f".{self.stem}.partial"

    @property
    def zarr_dir(self) -> Path:
        return self.folder if self.out_format == "ome-zarr" else self.staging

    def _outputs(self) -> dict:
        """name → (path, dtype, channels, nearest) of the stores the last pass writes."""
        k = max(self.classes)
        out = {"mask": (self.zarr_dir / f"{self.stem}_mask.ome.zarr", np.uint8 if k < 256 else np.uint16, 1, True)}
        if self.overlays:
            out["overlay"] = (self.zarr_dir / f"{self.stem}_overlay.ome.zarr", np.uint8, 3, False)
        if self.proba:
            out["proba"] = (self.zarr_dir / f"{self.stem}_proba.ome.zarr", np.float32, len(self.classes), False)
        return out

    def _scratch(self) -> list:
        """The probability stores the passes before the last one write (raw, then after the CRF)."""
        names = (["raw"] if self.crf or self.modal else []) + (["crf"] if self.crf and self.modal else [])
        return [self.staging / f"proba_{n}.zarr" for n in names]

    def steps(self) -> list[tuple[str, TileGrid]]:
        return passes(self.shape, self.tile, self.halo, self.crf, self.modal)

    def final_paths(self) -> list[Path]:
        """The files (and OME-Zarr folders) :meth:`finish` leaves, in a fixed order."""
        names = list(self._outputs())
        if self.out_format == "ome-zarr":
            return [self._outputs()[n][0] for n in names]
        ext = ".tif" if self.out_format == "tif" else ".ome.tif"
        paths = [self.folder / f"{self.stem}_mask{ext}"]
        if self.overlays:
            paths.append(self.folder / f"{self.stem}_overlay{ext}")
        if self.proba:
            paths += [self.folder / f"{self.stem}_proba_{c}{ext}" for c in self.classes]
        return paths

    # -- the work ---------------------------------------------------------------------------------------
    def source(self):
        """The input as a worker reads it: the chunked image reopened (metadata only) and scaled."""
        if self.input is None:
            raise ValueError(f"{self.stem}: an in-memory image or a volume has no path to reopen; run it in one piece")
        from ..chunked import open_image

        lo, hi, colour = self.scaling
        return ChunkedSource(open_image(self.input), lo, hi, colour)

    def create(self) -> None:
        """Create the empty output and scratch stores (metadata only), replacing any earlier ones."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, (path, dtype, channels, nearest) in self._outputs().items():
            ZarrOutput(path, self.shape, dtype, self.tile, channels, pyramid=True, nearest=nearest,
                       colours=self.colours if name == "mask" else None, spacing=self.spacing,
                       channel_classes=self.classes if name == "proba" else None, channel_colours=self.colours)
        for path in self._scratch():
            ZarrOutput(path, self.shape, np.float32, self.tile, len(self.classes), pyramid=False, spacing=self.spacing)

    def run_tile(self, seg, src, step: int, index) -> np.ndarray | None:
        """Compute tile ``index`` of pass ``step`` and write its chunks; the class pixel counts of its
        core when this is the last pass (the one that writes the mask), else None."""
        name, grid = self.steps()[step]
        tile = grid.tile_at(index)
        last = step == len(self.steps()) - 1
        scratch = [ZarrOutput.reopen(p) for p in self._scratch()]
        classes = np.asarray(self.classes)
        if name == "classify":
            p = seg.tile_proba(src, tile)
        elif name == "crf":
            p = dense_crf(scratch[0].read(*tile.outer), src.read(*tile.outer), seg.crf, **seg.crf_params)[tile.inner]
        else:
            p_outer = scratch[-1].read(*tile.outer)
            mask = modal_filter(classes[p_outer.argmax(-1)], self.modal)[tile.inner]
            p = p_outer[tile.inner]
        if not last:
            scratch[step].write(tile.core, p)
            return None
        if name != "modal":
            mask = classes[p.argmax(-1)]
        outputs = {n: ZarrOutput.reopen(v[0]) for n, v in self._outputs().items()}
        outputs["mask"].write(tile.core, mask.astype(outputs["mask"].array.dtype))
        if "overlay" in outputs:
            outputs["overlay"].write(tile.core, overlay(_display(src, tile.core), mask, 0.4, max(self.classes),
                                                      colours=self.colours))
        if "proba" in outputs:
            outputs["proba"].write(tile.core, p)
        return np.array([(mask == c).sum() for c in classes], np.int64)

    def finish(self) -> list[Path]:
        """Build the pyramids, convert to BigTIFF when asked, remove the scratch stores; the paths written."""
        outputs = {n: ZarrOutput.reopen(v[0]) for n, v in self._outputs().items()}
        for out in outputs.values():
            out.finish()
        if self.volume and self.out_format != "ome-zarr":
            mask, *probas = self.final_paths()
            ome = self.out_format == "bigtiff"
            zarr_to_tiff_stack(outputs["mask"], mask, ome=ome)
            if "proba" in outputs:
                zarr_to_tiff_stack(outputs["proba"], probas, ome=ome)
        elif self.out_format == "bigtiff":
            paths = zarr_to_tiff(outputs["mask"], self.folder / f"{self.stem}_mask.ome.tif")
            if "overlay" in outputs:
                paths += zarr_to_tiff(outputs["overlay"], self.folder / f"{self.stem}_overlay.ome.tif",
                                      photometric="rgb")
            if "proba" in outputs:
                paths += zarr_to_tiff(outputs["proba"],
                                      [self.folder / f"{self.stem}_proba_{c}.ome.tif" for c in self.classes])
        shutil.rmtree(self.staging, ignore_errors=True)
        return self.final_paths()

    def discard(self) -> None:
        """Remove whatever this image wrote (after a failure: no half-written outputs stay)."""
        for path, *_ in self._outputs().values():
            shutil.rmtree(path, ignore_errors=True)
        for path in self.final_paths():
            if path.is_file():
                path.unlink(missing_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)


def segment_to_files(seg, image, folder, stem: str, out_format: str = "ome-zarr", *, proba: bool = False,
                     overlays: bool = True, progress: bool = True, colours=None, on_tile=None) -> StreamResult:
    """Segment ``image`` (an array, a :class:`~alibi_vit.chunked.ChunkedImage` or a source) with the
    trained ``seg`` tile by tile, writing ``<stem>_mask``, ``<stem>_overlay`` and with ``proba`` the
    probabilities into ``folder``: ``.ome.zarr`` images (probabilities one image with a channel per
    class) or ``.ome.tif`` files (probabilities ``<stem>_proba_<class>.ome.tif``). A volume (with a
    volume segmenter) also takes ``tif``: ``<stem>_mask.tif`` and ``<stem>_proba_<class>.tif`` stacks;
    volumes get no overlay. Raises :class:`~alibi_vit.trainable.writers.OutputError` when an output
    cannot be written.

    colours: the class colours of overlays and of the mask's OME-Zarr metadata, a (max class + 1, 3)
    uint8 table indexed by class value (default :func:`~alibi_vit.trainable.io.palette`).
    on_tile(done, total): called after each tile of each pass; an exception it raises stops the
    segmentation there and removes the outputs of this image (as any failure does)."""
    seg._check_fitted()
    with seg._call():
        src = seg.source(image, stem)
        layout = StreamLayout.plan(seg, src, folder, stem, out_format, proba=proba, overlays=overlays,
                                   colours=colours)
        return run_layout(seg, src, layout, progress=progress, on_tile=on_tile)


def run_layout(seg, src, layout: StreamLayout, progress: bool = False, on_tile=None) -> StreamResult:
    """Every pass of ``layout`` in this process, tile after tile, then :meth:`StreamLayout.finish`;
    on any failure (or an interrupt) what was written is removed. on_tile(done, total): called after
    each tile of each pass."""
    counts = np.zeros(len(layout.classes), np.int64)
    steps = layout.steps()
    total, done = sum(len(grid) for _, grid in steps), 0  # (a disabled tqdm counts nothing)
    bar = tqdm(total=total, desc=f"{layout.stem} tiles", disable=not progress, leave=False)
    try:
        layout.create()
        for step, (_, grid) in enumerate(steps):
            for tile in grid:
                tile_counts = layout.run_tile(seg, src, step, tile.index)
                if tile_counts is not None:
                    counts += tile_counts
                bar.update()
                done += 1
                if on_tile is not None:
                    on_tile(done, total)
        paths = layout.finish()
    except BaseException:  # a damaged tile, a full disk, an interrupt: no half-written outputs
        layout.discard()
        raise
    finally:
        bar.close()
    return StreamResult(counts, int(np.prod(layout.shape)), paths, layout.note)
