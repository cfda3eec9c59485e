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

__all__ = ["OUT_FORMATS", "StreamResult", "segment_to_files"]

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
    volume = seg.dims == 3
    formats = VOLUME_FORMATS if volume else OUT_FORMATS
    if out_format not in formats:
        raise ValueError(f"out_format must be one of {', '.join(formats)}, got {out_format!r}")
    overlays = overlays and not volume
    seg._check_fitted()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    classes, k = seg.classes_, int(seg.classes_.max())
    colours = palette(k) if colours is None else np.asarray(colours, np.uint8)[:k + 1]
    mask_dtype = np.uint8 if k < 256 else np.uint16
    staging = folder / f".{stem}.partial"
    zarr_dir = folder if out_format == "ome-zarr" else staging
    with seg._call():
        src = seg.source(image, stem)
        shape, chunk = tuple(src.shape), seg.tile
        grid = seg.tile_grid(src)

        def store(name, dtype, channels=1, pyramid=False, **kw):
            return ZarrOutput(name, shape, dtype, chunk, channels, pyramid=pyramid, spacing=getattr(src, "spacing", None),
                              **kw)

        mask_out = overlay_out = proba_out = None
        counts = np.zeros(len(classes), np.int64)
        steps, done = len(grid) * (1 + bool(seg.crf) + bool(seg.modal)), [0]  # (a disabled tqdm counts nothing)
        bar = tqdm(total=steps, desc=f"{stem} tiles", disable=not progress, leave=False)

        def tile_done():
            bar.update()
            done[0] += 1
            if on_tile is not None:
                on_tile(done[0], steps)

        def finish_tile(core, p, mask):
            counts[:] += [(mask == c).sum() for c in classes]
            mask_out.write(core, mask.astype(mask_dtype))
            if overlay_out is not None:
                overlay_out.write(core, overlay(_display(src, core), mask, 0.4, k, colours=colours))
            if proba_out is not None:
                proba_out.write(core, p)

        try:
            mask_out = store(zarr_dir / f"{stem}_mask.ome.zarr", mask_dtype, pyramid=True, nearest=True,
                             colours=colours)
            if overlays:
                overlay_out = store(zarr_dir / f"{stem}_overlay.ome.zarr", np.uint8, 3, pyramid=True)
            if proba:
                proba_out = store(zarr_dir / f"{stem}_proba.ome.zarr", np.float32, len(classes), pyramid=True)
            post = bool(seg.crf) or bool(seg.modal)
            raw = store(staging / "proba_raw.zarr", np.float32, len(classes)) if post else None
            for tile in grid:  # pass 1: the classifier
                p = seg.tile_proba(src, tile)
                if raw is not None:
                    raw.write(tile.core, p)
                else:
                    finish_tile(tile.core, p, classes[p.argmax(-1)])
                tile_done()
            if seg.crf:  # pass 2: the CRF, on the CRF tiles of the whole-image path
                refined = store(staging / "proba_crf.zarr", np.float32, len(classes)) if seg.modal else None
                for tile in TileGrid(shape, seg.tile, CRF_OVERLAP):
                    q = dense_crf(raw.read(*tile.outer), src.read(*tile.outer), seg.crf, **seg.crf_params)[tile.inner]
                    if refined is not None:
                        refined.write(tile.core, q)
                    else:
                        finish_tile(tile.core, q, classes[q.argmax(-1)])
                    tile_done()
                raw = refined if refined is not None else raw
            if seg.modal:  # pass 3: the modal filter, with its half-window of context
                for tile in TileGrid(shape, chunk, seg.modal // 2):
                    p_outer = raw.read(*tile.outer)
                    mask = modal_filter(classes[p_outer.argmax(-1)], seg.modal)[tile.inner]
                    finish_tile(tile.core, p_outer[tile.inner], mask)
                    tile_done()
            bar.close()
            outputs = [o for o in (mask_out, overlay_out, proba_out) if o is not None]
            for out in outputs:
                out.finish()
            if out_format == "ome-zarr":
                paths = [o.path for o in outputs]
            elif volume:
                ext = ".ome.tif" if out_format == "bigtiff" else ".tif"
                paths = zarr_to_tiff_stack(mask_out, folder / f"{stem}_mask{ext}", ome=out_format == "bigtiff")
                if proba_out is not None:
                    paths += zarr_to_tiff_stack(proba_out, [folder / f"{stem}_proba_{int(c)}{ext}" for c in classes],
                                                ome=out_format == "bigtiff")
            else:
                paths = zarr_to_tiff(mask_out, folder / f"{stem}_mask.ome.tif")
                if overlay_out is not None:
                    paths += zarr_to_tiff(overlay_out, folder / f"{stem}_overlay.ome.tif", photometric="rgb")
                if proba_out is not None:
                    paths += zarr_to_tiff(proba_out, [folder / f"{stem}_proba_{int(c)}.ome.tif" for c in classes])
        except BaseException:  # a damaged tile, a full disk, an interrupt: no half-written outputs
            for name in ("mask", "overlay", "proba"):
                shutil.rmtree(zarr_dir / f"{stem}_{name}.ome.zarr", ignore_errors=True)
            for name in ("mask", "overlay", *(f"proba_{int(c)}" for c in classes)):
                for ext in (".ome.tif", ".tif"):
                    (folder / f"{stem}_{name}{ext}").unlink(missing_ok=True)
            raise
        finally:
            bar.close()
            shutil.rmtree(staging, ignore_errors=True)
    return StreamResult(counts, int(np.prod(shape)), paths, getattr(src, "note", ""))

