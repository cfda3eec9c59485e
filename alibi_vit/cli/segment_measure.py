"""``alibi-vit segment measure``: the numbers a segmented microstructure is reported with (docs/measure.md).

    alibi-vit segment measure MASKS... [--out DIR] [--spacing Z,Y,X] [--metrics ...] [--probabilities ...]

Masks are PNG/TIFF images, multi-page TIFF stacks, or zarr/OME-Zarr mosaics and volumes (what ``segment
apply`` writes); folders are searched for ``*_mask.*`` files. Local metrics run block by block in bounded
memory; chords, local thickness and tortuosity hold the (``--region``) region in memory and say first how much.
Parsing the options imports nothing heavy; the measurement imports scipy and, for the metrics that need them,
porespy or TauFactor (``pip install "alibi-vit[measure]"``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import at_least
from .scheduler_options import add_scheduler_arguments

# The library's metric names (alibi_vit.measure.analysis), named here so that building the parser of any
# `segment` action imports nothing more; tests/test_measure_cli.py checks that they agree.
METRICS = ("fractions", "surfaces", "s2", "objects", "percolation", "chords", "thickness", "tortuosity")
DEFAULT_METRICS = ("fractions", "surfaces", "s2", "objects", "percolation", "chords")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("masks", nargs="+", metavar="MASKS",
                   help="mask files (PNG, TIFF, multi-page TIFF volumes), zarr/OME-Zarr stores, or folders of "
                        "<name>_mask.* files; values 0..255 are phases")
    p.add_argument("--out", type=Path, default=Path("measure"), metavar="DIR",
                   help="output folder: fractions.csv, interfaces.csv, s2.csv, objects_summary.csv, rve.csv, ... "
                        "over all masks, <name>_measure.json, <name>_objects.csv, plots (PNG and SVG), report.md "
                        "(default %(default)s)")
    p.add_argument("--metrics", nargs="+", choices=METRICS + ("all",), default=list(DEFAULT_METRICS),
                   metavar="NAME",
                   help=f"what to measure: {', '.join(METRICS)}, or all (default: {' '.join(DEFAULT_METRICS)}; "
                        "thickness needs porespy, tortuosity TauFactor: pip install 'alibi-vit[measure]')")
    p.add_argument("--spacing", default=None, metavar="[Z,]Y,X",
                   help="pixel or voxel size, one number or one per axis (default: a volume's metadata, else 1)")
    p.add_argument("--unit", default=None, metavar="NAME",
                   help="unit of --spacing, written beside lengths, e.g. um (default: px without --spacing, else "
                        "'unit')")
    p.add_argument("--probabilities", nargs="+", default=None, metavar="FILE_OR_DIR",
                   help="probability maps from 'segment apply --proba' (<name>_proba_<class>.tif per class, or "
                        "<name>_proba.ome.zarr), or folders of them, for the classifier's view of each fraction")
    p.add_argument("--intensity-images", nargs="+", default=None, metavar="FILE_OR_DIR",
                   help="the grey images the masks segment (a.tif for a_mask.png), for each object's mean intensity")
    p.add_argument("--region", default=None, metavar="[Z0:Z1,]Y0:Y1,X0:X1",
                   help="measure this box only (e.g. a sub-volume for tortuosity); empty bounds mean the edge")
    p.add_argument("--radius", type=at_least(1), default=32, metavar="R",
                   help="S2(r) up to R voxels along each axis (default %(default)s)")
    p.add_argument("--min-size", type=at_least(0), default=0, metavar="N",
                   help="objects under N voxels are left out of the object table and the instance labels")
    p.add_argument("--instance-labels", action="store_true",
                   help="also write <name>_objects.tif (or .zarr when large): one id per object, 0 for dropped ones")
    p.add_argument("--tile", type=at_least(1), default=None, metavar="PX",
                   help="side of the tiles whose variation gives the fractions' confidence interval (default: the "
                        "largest giving 4 tiles a side)")
    p.add_argument("--block", type=at_least(8), default=None, metavar="PX",
                   help="side of the blocks read at a time (default 1024 in 2D, 128 in 3D)")
    p.add_argument("--max-memory", default="2GB", metavar="SIZE",
                   help="memory chords, local thickness and tortuosity may take on the region held whole (default "
                        "%(default)s); larger regions are refused, naming --region")
    p.add_argument("--device", default=None,
                   help="where TauFactor solves (default: cuda if available, else cpu)")
    p.add_argument("--no-plots", action="store_true", help="write the tables only, no figures")
    p.add_argument("--dpi", type=at_least(10), default=150, help="resolution of the PNG figures (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_scheduler_arguments(p.add_argument_group(
        "scale-out", "where the blocks of the local metrics (fractions, interfaces, S2, objects) are measured: "
                     "a Dask cluster or SLURM worker jobs whose workers see the same files; the global metrics "
                     "and the instance labels run in this process"))


def _probability_files(items) -> list[Path]:
    from ..chunked import is_zarr_path
    from ..measure.masks import MeasureError, is_probability_map

    files = []
    for item in map(Path, items or []):
        if item.is_dir() and not is_zarr_path(item):
            files += sorted(p for p in item.iterdir() if is_probability_map(p))
        elif item.exists():
            files.append(item)
        else:
            raise MeasureError(f"--probabilities {item}: no such file or folder")
    return files


def _intensity_for(stem: str, items, mask: Path) -> Path | None:
    """The image among ``items`` (files, folders) whose name without suffixes is ``stem``, other than ``mask``."""
    from ..chunked import is_zarr_path
    from ..measure.masks import MASK_SUFFIXES, _stem

    for item in map(Path, items):
        candidates = [item] if item.is_file() or is_zarr_path(item) else sorted(item.glob(f"{stem}*"))
        for path in candidates:
            if (_stem(path) == stem and path.resolve() != mask.resolve()
                    and (is_zarr_path(path) or path.suffix.lower() in MASK_SUFFIXES + (".jpg", ".jpeg"))):
                return path
    return None


def _unique_stems(paths) -> list[str]:
    from ..measure.masks import mask_stem

    stems, seen = [], {}
    for path in paths:
        stem = mask_stem(path)
        seen[stem] = seen.get(stem, 0) + 1
        stems.append(stem if seen[stem] == 1 else f"{stem}_{seen[stem]}")
    return stems


def measure_folder(folder: Path, spacing=None, executor=None) -> int:
    """``segment apply --measure``: the masks (and probability maps) below ``folder`` measured with the default
    metrics into ``folder/measure``; ``executor``: apply's open scheduler (None: this process)."""
    from ..chunked import is_zarr_path
    from ..measure.masks import MASK_SUFFIXES, _stem, is_probability_map

    folder = Path(folder)
    found = [p for p in sorted(folder.rglob("*_mask*")) if "measure" not in p.relative_to(folder).parts[:1]
             and _stem(p).endswith("_mask") and (is_zarr_path(p) or p.suffix.lower() in MASK_SUFFIXES)]
    if not found:
        print(f"alibi-vit segment: warning: no masks to measure in {folder}", file=sys.stderr)
        return 0
    probabilities = [str(p) for p in sorted(folder.rglob("*_proba*")) if is_probability_map(p)
                     and (is_zarr_path(p) or p.suffix.lower() in (".tif", ".tiff"))]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [str(p) for p in found] + ["--out", str(folder / "measure")]
    argv += ["--spacing", ",".join(str(v) for v in spacing)] if spacing else []
    argv += ["--probabilities", *probabilities] if probabilities else []
    return run(parser.parse_args(argv), executor)


def run(args, executor=None) -> int:
    """The command; ``executor``: a scheduler already open (None: the one ``args`` names is opened here)."""
    if executor is None and args.scheduler != "threads":
        from .scheduler_options import open_scheduler

        with open_scheduler(args) as opened:
            if opened.dashboard:
                print(f"Dask dashboard: {opened.dashboard}", file=sys.stderr)
            return _measure_all(args, opened)
    return _measure_all(args, executor)


def _measure_all(args, executor) -> int:
    from ..files import require_writable_folder
    from ..measure.analysis import MeasureOptions, measure_mask
    from ..measure.masks import (
        MeasureError,
        find_masks,
        open_intensity,
        open_mask,
        open_probabilities,
        parse_memory,
        parse_region,
        parse_spacing,
    )
    from ..measure.masks import _stem
    from ..measure.report import write_mask_outputs, write_tables

    spacing = parse_spacing(args.spacing) if args.spacing else None
    metrics = METRICS if "all" in args.metrics else tuple(dict.fromkeys(args.metrics))
    max_memory = parse_memory(args.max_memory)
    masks = find_masks(args.masks)
    sources = [open_mask(path, spacing) for path in masks]  # every mask checked before any is measured
    regions = [parse_region(args.region, source) for source in sources]
    probability_files = _probability_files(args.probabilities)
    out = require_writable_folder(args.out)
    results = []
    for path, stem, source, region in zip(masks, _unique_stems(masks), sources, regions):
        mine = [p for p in probability_files if p.name.startswith(f"{stem}_proba_") or _stem(p) == f"{stem}_proba"]
        if args.probabilities and not mine:
            print(f"alibi-vit segment measure: warning: no probability map <{stem}_proba_K> for {path}",
                  file=sys.stderr)
        probabilities = open_probabilities(mine, source) if mine else None
        intensity = None
        if args.intensity_images:
            image = _intensity_for(stem, args.intensity_images, path)
            if image is None:
                print(f"alibi-vit segment measure: warning: no intensity image {stem}.* for {path}", file=sys.stderr)
            else:
                intensity = open_intensity(image, source)
        unit = args.unit or ("px" if spacing is None and source.spacing == (1.0, 1.0, 1.0) else "unit")
        options = MeasureOptions(metrics=metrics, radius=args.radius, block=args.block, tile=args.tile,
                                 min_size=args.min_size, max_memory=max_memory, unit=unit,
                                 instance_labels=out / f"{stem}_objects" if args.instance_labels else None,
                                 device=args.device, progress=not args.quiet)
        result = measure_mask(source.with_region(region), options, probabilities, intensity, executor=executor)
        if not result["fractions"]["voxels"]:
            raise MeasureError(f"{path}: no voxels to measure")
        written = write_mask_outputs(out, stem, result)
        if not args.no_plots:
            from ..measure.plots import write_plots

            written += write_plots(out, stem, result, args.dpi)
        results.append(result)
        phases = ", ".join(f"{p}: {e['fraction']:.4f}" for p, e in result["fractions"]["phases"].items())
        print(f"{path}: {result['seconds']:.1f} s; fractions {phases}")
    tables = write_tables(out, results)
    print(tables[-1].read_text())
    print(f"wrote {len(tables)} tables and the per-mask files to {out}")
    return 0
