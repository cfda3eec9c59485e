"""Volumes: 3D features against slice-by-slice 2D on generated microstructures with ground truth (issue 30).

    pip install -e ".[bench]"                                   # porespy, the generator
    python benchmarks/bench_volumes.py accuracy --size 256      # 3D vs 2D: mIoU, volume-fraction error
    python benchmarks/bench_volumes.py accuracy --backbone NAME --checkpoint FILE   # + triplanar ViT, 3 ways
    python benchmarks/bench_volumes.py strokes --draws 5        # the same volume, other stroke draws
    python benchmarks/bench_volumes.py speed --sizes 256 512    # `segment train/apply`: time, peak RSS
    python benchmarks/bench_volumes.py report                   # → benchmarks/results/volumes_cpu.*
    python benchmarks/bench_volumes.py smoke                    # all of it at a toy size

The volume: three phases from porespy's generators, a porous medium with inclusions — pores
(``blobs``: Gaussian-filtered noise thresholded at the porosity, 35 %, blobiness 1.5), a matrix,
and inclusions (``overlapping_spheres`` of radius 6 voxels, 15 % of the volume, where no pore is).
Grey values 0.2 / 0.5 / 0.8, then a 3D Gaussian blur (σ 1.5 voxels, the instrument's point spread)
and Gaussian noise (σ 0.25: adjacent phases differ by 1.2 noise σ, so a single voxel is ambiguous
and averaging over a neighbourhood decides), stored as uint16. Larger sizes tile the 256³ volume
(blobs are periodic), so every size has the same texture.

Scribbles: two strokes per class (``alibi_vit.trainable.scribbles``) on each of 3 XY slices (z at a
quarter, half and three quarters of the depth): the same label voxels train both segmenters.
(Before a fix to ``scribbles``, the inclusions' strokes were dots of 1-5 voxels at the very centres
of the grains, 30 voxels in all: the inclusions' cross-sections are at most 6 voxels deep, and only
isolated pixels lay beyond the strokes' 5-voxel margin; the forest then called most inclusion
voxels matrix, which gave the 5-19 pp fraction errors of earlier results.)
3D: ``VolumeSegmenter`` (the 3D filter bank, defaults). 2D: ``TrainableSegmenter`` (the 2D default
filter set) trained on the 3 labelled slices and applied to every slice, the behaviour of
``--features 2d``. Both use the default classifier. "3d dense": the 3D segmenter trained on the
same 3 slices labelled completely (every voxel), to tell the scribbles' sparsity from the
features' limits. "ideal threshold": no classifier, each voxel of the noise-free blurred volume
given the phase of the nearest grey value, which shows what the blur alone does to a hard mask (the
partial-volume floor of a segmenter not taught where blurred boundaries lie). Scores against the
truth over every voxel: mean IoU over the three phases, and
per phase the volume fraction's error in percentage points; to say where that error comes from,
the confusion matrix and the signed error split between the boundary band (voxels within 2 voxels
of another phase, where the blur mixes phases; strokes keep away from it) and the rest.

strokes: the volume of ``accuracy`` scribbled again with other seeds (draw d takes the scribble
generator's seeds 3d, 3d+1, 3d+2 on the 3 slices: draw 0 is ``accuracy``'s strokes for seed 0), 3D
and 2D trained on each draw; mIoU, 3D − 2D and the volume-fraction errors per draw, to show how much of
a result is the strokes' chance placement.

speed: ``alibi-vit segment train`` and ``segment apply`` (mask as a TIFF stack) on the volume file
as subprocesses under ``/usr/bin/time -v``: peak RSS of the process, wall time, CPU time, and the
load average before and after each (the machine is shared); time per 10⁸ voxels from the apply
command's own segmentation time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import load_average  # noqa: E402
BASE = 256
PHASES = {1: "pore", 2: "matrix", 3: "inclusion"}
GREY = {1: 0.2, 2: 0.5, 3: 0.8}
BLUR, NOISE = 1.5, 0.25
BOUNDARY_REACH = 2  # voxels: the band where the blur (σ 1.5) mixes neighbouring phases


def microstructure(n: int = BASE, seed: int = 0, noise: float = NOISE) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 volume, uint8 truth 1|2|3) of side ``n`` (see the module docstring)."""
    import porespy as ps

    base = min(n, BASE)
    pores = ps.generators.blobs([base] * 3, porosity=0.35, blobiness=1.5, seed=seed)
    solid_spheres = ~ps.generators.overlapping_spheres([base] * 3, r=6, porosity=0.85, seed=seed + 1)
    truth = np.full(pores.shape, 2, np.uint8)
    truth[solid_spheres] = 3
    truth[pores] = 1
    reps = -(-n // base)
    truth = np.tile(truth, (reps,) * 3)[:n, :n, :n]
    grey = blurred(truth)
    grey += np.random.default_rng(seed).standard_normal(grey.shape, dtype=np.float32) * noise
    volume = np.clip((grey + 0.5) * 20000, 0, 65535).astype(np.uint16)
    return volume, truth


def blurred(truth: np.ndarray) -> np.ndarray:
    """The noise-free image: each phase's grey value, blurred by the point spread (float32)."""
    from scipy import ndimage as ndi

    grey = np.zeros(truth.shape, np.float32)
    for c, g in GREY.items():
        grey[truth == c] = g
    return ndi.gaussian_filter(grey, BLUR, mode="wrap")


def ideal_threshold(truth: np.ndarray) -> np.ndarray:
    """Each voxel of the noise-free blurred image given the phase whose grey value is nearest: what a
    perfect intensity classifier makes of the blur alone, the partial-volume floor of any hard mask that
    is not taught where the blurred boundaries lie."""
    grey = blurred(truth)
    values = np.array(list(GREY.values()), np.float32)
    nearest = np.abs(grey[..., None] - values).argmin(-1)
    return np.array(list(GREY), np.uint8)[nearest]


def label_slices(n: int) -> list[int]:
    return [n // 4, n // 2, 3 * n // 4]


def scribble_volume(truth: np.ndarray, seed: int = 0) -> np.ndarray:
    """Sparse labels: two strokes per phase on each of 3 XY slices."""
    from alibi_vit.trainable import scribbles

    labels = np.zeros(truth.shape, np.uint8)
    for i, z in enumerate(label_slices(truth.shape[0])):
        labels[z] = scribbles(truth[z], 2, rng=seed + i)
    return labels


def near_boundary(truth: np.ndarray, reach: float = BOUNDARY_REACH) -> np.ndarray:
    """Voxels within ``reach`` voxels of a voxel of another phase: where the blur mixes phases."""
    from scipy import ndimage as ndi

    near = np.zeros(truth.shape, bool)
    for c in PHASES:
        inside = truth == c
        near |= inside & (ndi.distance_transform_edt(inside) <= reach)
    return near


def scores(pred: np.ndarray, truth: np.ndarray, near: np.ndarray | None = None) -> dict:
    """mIoU, per phase the volume fraction (true, predicted) and its error; the confusion matrix
    (rows: true phase, columns: predicted, each row sums to 1); with ``near`` (near_boundary), the
    signed fraction error (pp) made within the boundary band and beyond it."""
    from alibi_vit.trainable import mean_iou

    fractions = {PHASES[c]: (round(float((truth == c).mean()), 4), round(float((pred == c).mean()), 4)) for c in PHASES}
    errors = {k: round(100 * abs(p - t), 2) for k, (t, p) in fractions.items()}
    k = len(PHASES) + 1
    counts = np.bincount(truth.ravel().astype(np.int64) * k + pred.ravel(), minlength=k * k).reshape(k, k)[1:, 1:]
    out = {"miou": round(mean_iou(pred, truth), 4), "fraction_true_pred": fractions, "fraction_error_pp": errors,
           "max_fraction_error_pp": max(errors.values()),
           "confusion": (counts / counts.sum(1, keepdims=True)).round(4).tolist()}
    if near is not None:
        for name, band in (("boundary", near), ("interior", ~near)):
            signed = [100 * (int(((pred == c) & band).sum()) - int(((truth == c) & band).sum())) / truth.size
                      for c in PHASES]
            out[f"signed_fraction_error_pp_{name}"] = dict(zip(PHASES.values(), np.round(signed, 2).tolist()))
    return out


def accuracy(size: int, seed: int = 0, noise: float = NOISE, backbone: str | None = None,
             checkpoint: str | None = None, combines=()) -> dict:
    from alibi_vit.trainable import TrainableSegmenter, VolumeSegmenter

    volume, truth = microstructure(size, seed, noise)
    labels = scribble_volume(truth, seed)
    zs = label_slices(size)
    near = near_boundary(truth)
    rows = {"size": size, "seed": seed, "noise": noise, "blur": BLUR, "labelled_voxels": int((labels > 0).sum()),
            "labelled_voxels_per_phase": {PHASES[c]: int((labels == c).sum()) for c in PHASES},
            "boundary_band_share": round(float(near.mean()), 4), "load_before": load_average()}
    t = time.perf_counter()
    seg3 = VolumeSegmenter(seed=seed).fit(volume, labels)
    fit3 = time.perf_counter() - t
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # streamed, as `segment apply` does
        from alibi_vit.trainable.stream import segment_to_files
        import tifffile

        segment_to_files(seg3, volume, tmp, "v", "tif", progress=False)
        pred3 = tifffile.imread(Path(tmp) / "v_mask.tif")
    rows["3d"] = {**scores(pred3, truth, near), "fit_seconds": round(fit3, 1),
                  "predict_seconds": round(time.perf_counter() - t, 1)}
    # The same 3 slices labelled completely: how much of the error is the scribbles' sparsity
    dense = np.zeros_like(labels)
    dense[zs] = truth[zs]
    t = time.perf_counter()
    pred = VolumeSegmenter(seed=seed).fit(volume, dense).predict([volume])[0]
    rows["3d dense"] = {**scores(pred, truth, near), "seconds": round(time.perf_counter() - t, 1)}
    rows["ideal threshold"] = scores(ideal_threshold(truth), truth, near)
    t = time.perf_counter()
    seg2 = TrainableSegmenter(seed=seed).fit([volume[z] for z in zs], [labels[z] for z in zs])
    fit2 = time.perf_counter() - t
    t = time.perf_counter()
    pred2 = np.stack([seg2.predict([s])[0] for s in volume])
    rows["2d"] = {**scores(pred2, truth, near), "fit_seconds": round(fit2, 1),
                  "predict_seconds": round(time.perf_counter() - t, 1)}
    rows["miou_gain_3d_over_2d"] = round(rows["3d"]["miou"] - rows["2d"]["miou"], 4)
    for combine in combines:  # the 3D filters plus the backbone's features on XY, XZ, YZ slices, combined
        t = time.perf_counter()
        seg = VolumeSegmenter(backbone, checkpoint=checkpoint, vit_combine=combine, seed=seed).fit(volume, labels)
        pred = seg.predict([volume])[0]
        rows[f"3d+vit {combine}"] = {**scores(pred, truth, near), "backbone": backbone, "checkpoint": checkpoint,
                                     "seconds": round(time.perf_counter() - t, 1)}
    rows["load_after"] = load_average()
    return rows


def stroke_draws(size: int, seed: int = 0, noise: float = NOISE, draws=range(5)) -> dict:
    """3D and 2D segmenters trained on several stroke draws on the same volume (module docstring)."""
    from alibi_vit.trainable import TrainableSegmenter, VolumeSegmenter

    volume, truth = microstructure(size, seed, noise)
    zs = label_slices(size)
    out = {"size": size, "seed": seed, "noise": noise, "load_before": load_average(), "draws": []}
    for d in draws:
        labels = scribble_volume(truth, 3 * d)
        pred3 = VolumeSegmenter(seed=seed).fit(volume, labels).predict([volume])[0]
        seg2 = TrainableSegmenter(seed=seed).fit([volume[z] for z in zs], [labels[z] for z in zs])
        pred2 = np.stack([seg2.predict([s])[0] for s in volume])
        row = {"draw": d, "labelled_voxels": int((labels > 0).sum()), "3d": scores(pred3, truth), "2d": scores(pred2, truth)}
        row["miou_gain_3d_over_2d"] = round(row["3d"]["miou"] - row["2d"]["miou"], 4)
        out["draws"].append(row)
        print(f"draw {d}: 3D {row['3d']['miou']:.4f} ({row['3d']['max_fraction_error_pp']} pp), "
              f"2D {row['2d']['miou']:.4f} ({row['2d']['max_fraction_error_pp']} pp)", flush=True)
    out["load_after"] = load_average()
    return out


def _stroke_lines(runs: list[dict]) -> list[str]:
    if not runs:
        return []
    lines = ["", "## Other stroke draws (`strokes`)", "",
             "The same volumes scribbled again (two strokes per phase on the same 3 slices, other seeds); per draw the "
             "3D and 2D segmenters' mIoU and the 3D segmenter's volume-fraction errors.", "",
             "| noise σ | seed | draw | labelled voxels | mIoU 3D | mIoU 2D | 3D − 2D | 3D fraction error (pp): pore / "
             "matrix / inclusion, signed |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        for r in run["draws"]:
            signed = " / ".join(f"{100 * (p - t):+.2f}" for t, p in r["3d"]["fraction_true_pred"].values())
            lines.append(f"| {run['noise']} | {run['seed']} | {r['draw']} | {r['labelled_voxels']} | "
                         f"{r['3d']['miou']:.4f} | {r['2d']['miou']:.4f} | {r['miou_gain_3d_over_2d']:+.4f} | {signed} |")
    rows = [r for run in runs for r in run["draws"]]
    gains = sorted(r["miou_gain_3d_over_2d"] for r in rows)
    worst = sorted(r["3d"]["max_fraction_error_pp"] for r in rows)
    lines += ["", f"- {len(rows)} draws: 3D − 2D from {gains[0]:+.4f} to {gains[-1]:+.4f} mIoU (median "
                  f"{np.median(gains):+.4f}); the 3D segmenter's worst volume-fraction error from {worst[0]:.2f} to "
                  f"{worst[-1]:.2f} pp (median {np.median(worst):.2f}); load {runs[0]['load_before'][0]} → "
                  f"{runs[-1]['load_after'][0]}"]
    return lines


def _timed(cmd: list[str]) -> dict:
    load_before = load_average()
    t = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                          env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - t
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    err = proc.stderr
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1))
    cpu = sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", err).group(1)) for kind in ("User", "System"))
    own = re.search(r"in ([\d.]+) s \(", err)
    return {"peak_rss_gb": round(rss_kb / 2**20, 3), "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
            "segment_seconds": float(own.group(1)) if own else None, "load_before": load_before,
            "load_after": load_average()}


def speed(folder: Path, sizes, seed: int = 0) -> list[dict]:
    import tifffile

    folder.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "alibi_vit.cli.main", "segment"]
    rows = []
    for n in sizes:
        image, lab = folder / f"vol{n}.tif", folder / f"vol{n}_labels.tif"
        if not image.is_file():
            volume, truth = microstructure(n, seed)
            tifffile.imwrite(image, volume, photometric="minisblack")
            tifffile.imwrite(lab, scribble_volume(truth, seed), photometric="minisblack")
            del volume, truth
        model, out = folder / f"model{n}", folder / f"out{n}"
        train = _timed([*cli, "train", "--images", str(image), "--labels", str(lab), "--out", str(model)])
        apply = _timed([*cli, "apply", "--model", str(model), "--images", str(image), "--out", str(out)])
        voxels = n ** 3
        row = {"size": n, "voxels": voxels, "train": train, "apply": apply,
               "apply_seconds_per_1e8_voxels": round((apply["segment_seconds"] or apply["wall_seconds"]) * 1e8 / voxels, 1),
               "apply_cpu_seconds_per_1e8_voxels": round(apply["cpu_seconds"] * 1e8 / voxels, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(folder / "speed_runs.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return rows


def report(folder: Path, stem: str = "volumes_cpu") -> None:
    from report import environment, write_report

    accs = [json.loads(p.read_text()) for p in sorted(folder.glob("accuracy_*.json"))]
    strokes = [json.loads(p.read_text()) for p in sorted(folder.glob("strokes_*.json"))]
    runs = [json.loads(line) for line in open(folder / "speed_runs.jsonl")]
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores (shared with other jobs)"
    lines = [f"# Volumes: 3D features vs slice-by-slice 2D ({machine})", "",
             "Generated three-phase microstructure (porespy `blobs` pores, `overlapping_spheres` inclusions, matrix; "
             f"grey values 0.2 / 0.5 / 0.8, blur σ {BLUR} voxels, Gaussian noise), two scribbles per phase on 3 XY "
             "slices, default classifier; `python benchmarks/bench_volumes.py` (its docstring describes the set-up).",
             "", "## Accuracy", "",
             "| size | noise σ | seed | labelled voxels | features | mIoU | volume fraction error (pp): pore / matrix / "
             "inclusion | fit (s) | predict (s) | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for acc in accs:
        for kind in ["3d", "2d"] + [k for k in acc if k.startswith(("3d ", "3d+vit", "ideal"))]:
            r = acc[kind]
            errs = " / ".join(f"{r['fraction_error_pp'][p]:.2f}" for p in PHASES.values())
            lines.append(f"| {acc['size']}³ | {acc['noise']} | {acc['seed']} | {acc['labelled_voxels']} | {kind} | "
                         f"{r['miou']:.4f} | {errs} | {r.get('fit_seconds', '–')} | {r.get('predict_seconds', r.get('seconds', '–'))} | "
                         f"{acc['load_before'][0]} → {acc['load_after'][0]} |")
    lines += [""] + [f"- {a['size']}³, noise σ {a['noise']}, seed {a['seed']}: 3D − 2D = "
                     f"{a['miou_gain_3d_over_2d']:+.4f} mIoU; true volume fractions (pore, matrix, inclusion) "
                     + ", ".join(f"{t:.3f}" for t, _ in a["3d"]["fraction_true_pred"].values()) for a in accs]
    lines += ["", "## Where the volume-fraction error comes from", "",
              f"Boundary band: voxels within {BOUNDARY_REACH} voxels of another phase (where the blur mixes phases). "
              "Signed fraction error (pp, predicted − true) made in the band and beyond it, per phase pore / matrix / "
              "inclusion; confusion rows: the true phase's share predicted pore / matrix / inclusion.", "",
              "| noise σ | seed | labelled voxels (pore / matrix / inclusion) | band share | features | error in band | "
              "error beyond | confusion pore | confusion matrix | confusion inclusion |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for a in accs:
        if "signed_fraction_error_pp_boundary" not in a["3d"]:
            continue
        per_phase = " / ".join(str(a["labelled_voxels_per_phase"][p]) for p in PHASES.values())
        for kind in ("3d", "2d", "3d dense", "ideal threshold"):
            if kind not in a:
                continue
            r = a[kind]
            band, beyond = (" / ".join(f"{r[f'signed_fraction_error_pp_{b}'][p]:+.2f}" for p in PHASES.values())
                            for b in ("boundary", "interior"))
            conf = " | ".join(" / ".join(f"{v:.3f}" for v in row) for row in r["confusion"])
            lines.append(f"| {a['noise']} | {a['seed']} | {per_phase} | {a['boundary_band_share']:.3f} | {kind} | "
                         f"{band} | {beyond} | {conf} |")
    lines += _stroke_lines(strokes)
    lines += ["",
              "## Time and memory (`segment train`, `segment apply` → mask stack; 16-bit TIFF input)", "",
              "| size | command | peak RSS (GB) | wall (s) | segment (s) | CPU (s) | wall s per 10⁸ voxels | "
              "CPU s per 10⁸ voxels | load |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for cmd in ("train", "apply"):
            c = r[cmd]
            per = (r["apply_seconds_per_1e8_voxels"], r["apply_cpu_seconds_per_1e8_voxels"]) if cmd == "apply" \
                else ("–", "–")
            lines.append(f"| {r['size']}³ | {cmd} | {c['peak_rss_gb']:.2f} | {c['wall_seconds']} | "
                         f"{c['segment_seconds'] or '–'} | {c['cpu_seconds']} | {per[0]} | {per[1]} | "
                         f"{c['load_before'][0]} → {c['load_after'][0]} |")
    notes = sorted({r["note"] for r in runs if r.get("note")})  # e.g. rows kept from an earlier run
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    payload = {"machine": machine, "environment": environment(), "accuracy": accs, "strokes": strokes, "speed": runs,
               "command": "python benchmarks/bench_volumes.py accuracy|strokes|speed|report --folder DIR"}
    for path in write_report(None, stem, payload, lines):
        print(f"wrote {path}")
    print("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("accuracy", "strokes", "speed", "report", "smoke"))
    p.add_argument("--folder", type=Path, default=Path("volumes_bench"))
    p.add_argument("--size", type=int, default=BASE)
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draws", type=int, default=5, help="strokes: how many stroke draws (0, 1, …)")
    p.add_argument("--noise", type=float, default=NOISE, help=f"accuracy: noise σ (grey values 0.2/0.5/0.8; default {NOISE})")
    p.add_argument("--backbone", default=None, help="accuracy: also 3D filters + this backbone's triplanar features")
    p.add_argument("--checkpoint", default=None, help="the backbone's weights (a file)")
    p.add_argument("--vit-combine", nargs="+", default=["mean", "concat", "xy"],
                   help="with --backbone: the ways of combining the three orientations to compare")
    args = p.parse_args(argv)
    if args.action == "smoke":
        acc = accuracy(48, args.seed)
        assert 0 < acc["3d"]["miou"] <= 1 and 0 < acc["2d"]["miou"] <= 1, acc
        draws = stroke_draws(48, args.seed, draws=range(2))["draws"]
        assert [d["draw"] for d in draws] == [0, 1] and all(0 < d["3d"]["miou"] <= 1 for d in draws)
        rows = speed(Path(tempfile.mkdtemp()), (48,), args.seed)
        assert rows[0]["apply"]["peak_rss_gb"] > 0
        print("smoke ok")
        return 0
    if args.action == "accuracy":
        args.folder.mkdir(parents=True, exist_ok=True)
        acc = accuracy(args.size, args.seed, args.noise, args.backbone, args.checkpoint,
                       args.vit_combine if args.backbone else ())
        name = f"accuracy_{args.size}_noise{args.noise:g}_seed{args.seed}.json"
        (args.folder / name).write_text(json.dumps(acc, indent=2) + "\n")
        print(json.dumps(acc, indent=2))
    elif args.action == "strokes":
        args.folder.mkdir(parents=True, exist_ok=True)
        run = stroke_draws(args.size, args.seed, args.noise, range(args.draws))
        (args.folder / f"strokes_{args.size}_noise{args.noise:g}_seed{args.seed}.json").write_text(
            json.dumps(run, indent=2) + "\n")
    elif args.action == "speed":
        speed(args.folder, args.sizes, args.seed)
    else:
        report(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
