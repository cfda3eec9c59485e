"""Images larger than memory: `segment apply` on 16-bit BigTIFF and OME-Zarr of growing size (issue 26 goals).

    python benchmarks/bench_bigimage.py make --folder /scratch/big              # images + model, once
    python benchmarks/bench_bigimage.py equality --folder /scratch/big          # tiles = whole image, 2048²
    python benchmarks/bench_bigimage.py apply --folder /scratch/big             # peak RSS and throughput
    python benchmarks/bench_bigimage.py report --folder /scratch/big            # → benchmarks/results/
    python benchmarks/bench_bigimage.py smoke                                    # all of it at toy sizes

make: a 2048² generated 3-phase micrograph (uint16, alibi_vit.synthetic) mirrored out to each size
(so every size has the same texture), written tile by tile as a tiled BigTIFF (512² tiles, zlib) and
an OME-Zarr (512² chunks, with its pyramid); a model trained on the 2048² image with three scribbles
per class (classical features: XGBoost and the `weka` filter set, the defaults when the committed
results were taken; pinned so that they reproduce).

equality: the model applied to the 2048² image whole (one tile holding the whole image: every
filter on the whole image at once) against `segment_to_files` on the BigTIFF and the OME-Zarr with
the default 1036-px tiles and with 518-px tiles: labels identical? largest probability difference?

apply: `alibi-vit segment apply --out-format bigtiff|ome-zarr` (mask + overlay, the defaults) as a
subprocess under `/usr/bin/time -v`: peak RSS of the process, wall time, and the command's own
per-image time (its throughput line, without the interpreter's start-up); the load average
before and after each run is recorded, since the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import load_average  # noqa: E402
BASE = 2048
SIZES = (2048, 8192, 16384)
FORMATS = ("bigtiff", "ome-zarr")
CHUNK = 512


def _mirror_index(n: int, period: int) -> np.ndarray:
    """Indices 0..n-1 folded into 0..period-1 by mirroring (0 1 … p-1 p-1 … 1 0 0 1 …)."""
    i = np.arange(n) % (2 * period)
    return np.where(i < period, i, 2 * period - 1 - i)


def write_mirrored_zarr(path: Path, image: np.ndarray, n: int, chunk: int = CHUNK, name: str | None = None) -> None:
    """An n² OME-Zarr of ``image`` mirrored out to n px, written chunk by chunk (never whole in memory)."""
    from alibi_vit.trainable.writers import ZarrOutput

    idx = _mirror_index(n, image.shape[0])
    out = ZarrOutput(path, (n, n), image.dtype, chunk, name=name)
    for r in range(0, n, chunk):
        for c in range(0, n, chunk):
            out.write((slice(r, min(r + chunk, n)), slice(c, min(c + chunk, n))),
                      image[np.ix_(idx[r:r + chunk], idx[c:c + chunk])])
    out.finish()


def make(folder: Path, sizes, base: int = BASE) -> None:
    import tifffile

    from alibi_vit.trainable import TrainableSegmenter, scribbles, synthetic_micrograph

    folder.mkdir(parents=True, exist_ok=True)
    image, truth = synthetic_micrograph(base, seed=0)
    np.save(folder / "base.npy", image)
    labels = scribbles(truth, 3, rng=0)
    model = folder / "model"
    if not (model / "config.json").is_file():
        TrainableSegmenter(classifier="xgboost", filters="weka").fit([image], [labels]).save(model)
    for n in sizes:
        idx = _mirror_index(n, base)
        tif, zr = folder / f"img{n}.tif", folder / f"img{n}.ome.zarr"
        if not tif.is_file():
            def tiles():
                for r in range(0, n, CHUNK):
                    for c in range(0, n, CHUNK):
                        yield image[np.ix_(idx[r:r + CHUNK], idx[c:c + CHUNK])]
            tifffile.imwrite(tif.with_suffix(".part"), tiles(), shape=(n, n), dtype=np.uint16, tile=(CHUNK, CHUNK),
                             bigtiff=True, compression="zlib", photometric="minisblack")
            os.replace(tif.with_suffix(".part"), tif)
        if not zr.is_dir():
            write_mirrored_zarr(zr, image, n)
        print(f"made {tif} and {zr}", flush=True)


def equality(folder: Path, size: int = BASE) -> dict:
    import tempfile

    from alibi_vit.chunked import open_image
    from alibi_vit.trainable import TrainableSegmenter
    from alibi_vit.trainable.stream import segment_to_files

    image = np.load(folder / "base.npy")[:size, :size]
    whole = TrainableSegmenter.load(folder / "model")
    whole.tile = max(size, whole.tile)  # one tile: the whole image's features at once
    t = time.perf_counter()
    p_whole = whole.predict_proba([image])[0]
    rows = {"size": size, "whole_seconds": round(time.perf_counter() - t, 1), "cases": []}
    mask_whole = whole.classes_[p_whole.argmax(-1)]
    for fmt, name in (("bigtiff", f"img{size}.tif"), ("ome-zarr", f"img{size}.ome.zarr")):
        for tile in (1036, 518):
            seg = TrainableSegmenter.load(folder / "model")
            seg.tile = tile
            with tempfile.TemporaryDirectory(dir=folder) as out:
                t = time.perf_counter()
                segment_to_files(seg, open_image(folder / name), out, "x", "ome-zarr", proba=True, overlays=False,
                                 progress=False)
                seconds = time.perf_counter() - t
                mask = open_image(Path(out) / "x_mask.ome.zarr").read()
                proba = open_image(Path(out) / "x_proba.ome.zarr").read()
            case = {"input": fmt, "tile": tile, "labels_identical": bool(np.array_equal(mask, mask_whole)),
                    "differing_labels": int((mask != mask_whole).sum()),
                    "max_abs_proba_diff": float(np.abs(proba - p_whole).max()), "seconds": round(seconds, 1)}
            rows["cases"].append(case)
            print(case, flush=True)
    return rows


def apply_runs(folder: Path, sizes, formats, repeat: int = 1) -> list[dict]:
    rows = []
    for n in sizes:
        for fmt in formats:
            image = folder / (f"img{n}.tif" if fmt == "bigtiff" else f"img{n}.ome.zarr")
            for _ in range(repeat):
                out = folder / f"out_{fmt}_{n}"
                load_before = load_average()
                cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "alibi_vit.cli.main", "segment", "apply",
                       "--model", str(folder / "model"), "--images", str(image), "--out", str(out),
                       "--out-format", fmt]
                t = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
                wall = time.perf_counter() - t
                err = proc.stderr
                if proc.returncode:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
                rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1))
                own = re.search(r"in ([\d.]+) s \(", err)
                cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", err).group(1))
                          for kind in ("User", "System"))  # the whole process, start-up included
                own_cpu = re.search(r"MP/s, (\d+) CPU s\)", err)
                row = {"size": n, "format": fmt, "megapixels": round(n * n / 1e6, 2),
                       "peak_rss_gb": round(rss_kb / 2**20, 3),
                       "wall_seconds": round(wall, 1), "segment_seconds": float(own.group(1)) if own else None,
                       "process_cpu_seconds": round(cpu, 1),
                       "segment_cpu_seconds": float(own_cpu.group(1)) if own_cpu else None,
                       "load_before": load_before, "load_after": load_average()}
                row["mp_per_s"] = round(row["megapixels"] / (row["segment_seconds"] or wall), 3)
                if row["segment_cpu_seconds"]:  # load-independent: megapixels per CPU second
                    row["mp_per_cpu_s"] = round(row["megapixels"] / row["segment_cpu_seconds"], 3)
                rows.append(row)
                print(row, flush=True)
                with open(folder / "apply_runs.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
    return rows


def report(folder: Path, stem: str = "bigimage_cpu") -> None:
    from report import environment, write_report

    runs = [json.loads(line) for line in open(folder / "apply_runs.jsonl")]
    eq = json.loads((folder / "equality.json").read_text()) if (folder / "equality.json").is_file() else None
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores (shared with other jobs)"
    lines = [f"# `segment apply` on images larger than memory ({machine})", "",
             "Classical features (`weka` set), XGBoost; mask and overlay written tile by tile (1036-px tiles); inputs 16-bit "
             "tiled BigTIFF (512² tiles, zlib) and OME-Zarr (512² chunks); `python benchmarks/bench_bigimage.py`. "
             "Load: the 1-minute load average before → after each run (the machine is shared). Segment time: the "
             "command's own time for the image (no interpreter start-up); MP/s from it. CPU s: the CPU time of "
             "the image's segmentation (all threads), which the load of other jobs hardly changes.", "",
             "| size | input → output | MP | peak RSS (GB) | segment time (s) | MP/s | CPU s | MP per CPU s | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['size']}² | {r['format']} | {r['megapixels']} | {r['peak_rss_gb']:.2f} | "
                     f"{r['segment_seconds']} | {r['mp_per_s']} | {r.get('segment_cpu_seconds', '–')} | "
                     f"{r.get('mp_per_cpu_s', '–')} | {r['load_before'][0]} → {r['load_after'][0]} |")
    notes = [f"- {r['size']}² {r['format']}: {r['note']}" for r in runs if r.get("note")]
    if notes:
        lines += [""] + notes
    if eq:
        lines += ["", f"Tiles against the whole image ({eq['size']}²; whole-image pass: one tile holding the image, "
                  f"{eq['whole_seconds']} s):", "",
                  "| input | tile | labels identical | differing labels | max abs. probability difference |",
                  "|---|---|---|---|---|"]
        for c in eq["cases"]:
            lines.append(f"| {c['input']} | {c['tile']} | {c['labels_identical']} | {c['differing_labels']} | "
                         f"{c['max_abs_proba_diff']:.2e} |")
    payload = {"machine": machine, "environment": environment(), "apply": runs, "equality": eq,
               "command": "python benchmarks/bench_bigimage.py make|equality|apply|report --folder DIR"}
    for path in write_report(None, stem, payload, lines):
        print(f"wrote {path}")
    print("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("make", "equality", "apply", "report", "smoke"))
    p.add_argument("--folder", type=Path, default=Path("bigimage_bench"))
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    args = p.parse_args(argv)
    if args.action == "smoke":
        import tempfile

        folder = Path(tempfile.mkdtemp())
        make(folder, (256, 512), base=256)
        eq = equality(folder, 256)
        assert all(c["labels_identical"] for c in eq["cases"]), eq
        rows = apply_runs(folder, (256,), FORMATS)
        assert all(r["peak_rss_gb"] > 0 for r in rows)
        print("smoke ok")
        return 0
    if args.action == "make":
        make(args.folder, args.sizes)
    elif args.action == "equality":
        (args.folder / "equality.json").write_text(json.dumps(equality(args.folder), indent=2) + "\n")
    elif args.action == "apply":
        apply_runs(args.folder, args.sizes, args.formats)
    else:
        report(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
