"""A first segmentation as a user meets it: each tool in a fresh process, on images of different character.

    python benchmarks/bench_first_segmentation.py                     # 1024² images; results in benchmarks/results/
    python benchmarks/bench_first_segmentation.py --sizes 1024 4096   # the texture-only grey image also at 4096²
    python benchmarks/bench_first_segmentation.py --smoke             # 128² crops, one run each: checks the script

Every run is a fresh Python process (interpreter start, imports, reading the files, writing the
result all count), timed by this script around it; CPU time (user + sys) and peak resident memory
come from ``os.wait4`` of the child. Runs are interleaved (repeat 1 of every tool on every image,
then repeat 2, ...) and the median of ``--repeats`` is reported, with the 1-minute load at the
start of each run.

Tools, all on the very same image file and the very same stroke file:
- ``cli``: ``alibi-vit segment train`` then ``alibi-vit segment apply`` (its defaults; two
  processes, times and CPU summed, memory the larger peak);
- ``api``: a script calling ``TrainableSegmenter().fit([image], [labels]).predict([image])``;
- ``skimage``: scikit-image's trainable-segmentation gallery pipeline as a script:
  ``multiscale_basic_features(img, intensity=True, edges=False, texture=True, sigma_min=1,
  sigma_max=16)`` + ``RandomForestClassifier(n_estimators=50, n_jobs=-1, max_depth=10,
  max_samples=0.05)`` fitted on the stroked pixels, predicting every pixel.

Images: ``texture`` (generated 3-phase grey, 8-bit, phases equal in mean grey level so only their
texture tells them apart), ``uint16`` (generated 3-phase, 12 bits in a 16-bit image, phases differing
in grey level and texture), ``micrograph`` (a shipped labelled SEM micrograph,
``ebc_040617_2_S127_2_0015``, 1024², 8-bit; subsampled for smaller sizes, never enlarged) and ``colour`` (scikit-image's immunohistochemistry image,
resized; its "ground truth" is a 3-level split of its luma, from which its strokes are drawn too).
Strokes: ``alibi_vit.trainable.scribbles.scribbles(truth, 5, rng=seed)``: 5 per class.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import command_line, load_average, write_report  # noqa: E402

TOOLS = ("cli", "api", "skimage")
IMAGES = ("texture", "uint16", "micrograph", "colour")
MICROGRAPH = "ebc_040617_2_S127_2_0015"

# The child scripts: argv = image file, stroke file, output .npy (the predicted class per pixel).
READ = """
import sys
import numpy as np
import tifffile
from PIL import Image
image = tifffile.imread(sys.argv[1])
labels = np.asarray(Image.open(sys.argv[2]))
"""
API_SCRIPT = READ + """
from alibi_vit.trainable.segmenter import TrainableSegmenter
mask = TrainableSegmenter().fit([image], [labels]).predict([image])[0]
np.save(sys.argv[3], mask)
"""
SKIMAGE_SCRIPT = READ + """
from skimage.feature import multiscale_basic_features
from sklearn.ensemble import RandomForestClassifier
features = multiscale_basic_features(image, intensity=True, edges=False, texture=True, sigma_min=1, sigma_max=16,
                                     channel_axis=-1 if image.ndim == 3 else None)
clf = RandomForestClassifier(n_estimators=50, n_jobs=-1, max_depth=10, max_samples=0.05)
clf.fit(features[labels > 0], labels[labels > 0])
mask = clf.predict(features.reshape(-1, features.shape[-1])).reshape(labels.shape)
np.save(sys.argv[3], mask)
"""


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs"


def make_image(kind: str, size: int, seed: int):
    """(image, ground truth 1..K) of ``kind`` at ``size``² px."""
    import numpy as np

    from alibi_vit.synthetic import synthetic_micrograph

    if kind in ("texture", "uint16"):
        image, truth = synthetic_micrograph(size, 3, seed=seed)
        if kind == "texture":  # every phase at the image's mean grey level: only texture separates them
            f = image.astype(np.float64)
            target = f.mean()
            for c in np.unique(truth):
                f[truth == c] += target - f[truth == c].mean()
            lo, hi = np.percentile(f, [0.1, 99.9])
            image = np.clip((f - lo) / (hi - lo) * 255, 0, 255).round().astype(np.uint8)
        return image, truth
    if kind == "micrograph":
        from alibi_vit.trainable.datasets import load_micrographs

        item = load_micrographs("ebc", names=[MICROGRAPH])[0]
        step = max(item.mask.shape[0] // size, 1)  # smaller sizes: every step-th pixel (a crop may hold one class)
        return item.image[::step, ::step], item.mask[::step, ::step]
    if kind == "colour":
        import skimage.data
        from skimage.transform import resize

        rgb = (resize(skimage.data.immunohistochemistry(), (size, size), order=1) * 255).round().astype(np.uint8)
        luma = rgb @ np.array([0.299, 0.587, 0.114])
        return rgb, np.digitize(luma, np.quantile(luma, [1 / 3, 2 / 3])).astype(np.int64) + 1
    raise ValueError(f"unknown image kind {kind!r}")


def prepare(case: dict, folder: Path, seed: int) -> dict:
    """Write the case's image (TIFF), strokes (PNG) and truth (.npy) into ``folder``; add their paths."""
    import numpy as np
    import tifffile
    from PIL import Image

    from alibi_vit.trainable.scribbles import scribbles

    image, truth = make_image(case["image"], case["size"], seed)
    strokes = scribbles(truth, 5, rng=seed)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{case['image']}_{case['size']}"
    paths = {"image_file": folder / "images" / f"{stem}.tif", "strokes_file": folder / "labels" / f"{stem}.png",
             "truth_file": folder / f"{stem}_truth.npy"}
    for p in paths.values():
        p.parent.mkdir(parents=True, exist_ok=True)
    tifffile.imwrite(paths["image_file"], image)
    Image.fromarray(strokes.astype(np.uint8)).save(paths["strokes_file"])
    np.save(paths["truth_file"], truth)
    return {**case, **{k: str(v) for k, v in paths.items()}, "shape": list(image.shape), "dtype": str(image.dtype),
            "stroked_pixels": int((strokes > 0).sum())}


# Children are started by this small process, started before any image is made: a child's peak RSS as the kernel
# reports it (ru_maxrss) includes what the process that forked it held, so this script, holding the images,
# would lend every child its own peak.
LAUNCHER = """
import json, os, subprocess, sys, time
for line in sys.stdin:
    job = json.loads(line)
    with open(job["log"], "a") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(job["argv"], stdout=log, stderr=subprocess.STDOUT, env=job["env"])
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
    print(json.dumps({"status": os.waitstatus_to_exitcode(status), "wall_s": wall,
                      "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}), flush=True)
"""


class Launcher:
    """A small process that runs each child and reports its wall, CPU and peak RSS (from ``os.wait4``)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", LAUNCHER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str], log: Path, env=None) -> dict:
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log), "env": env}) + "\n")
        self.proc.stdin.flush()
        result = json.loads(self.proc.stdout.readline())
        if result.pop("status") != 0:
            raise RuntimeError(f"{' '.join(argv)} failed; its output is in {log}")
        return result

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def alibi_vit_command() -> list[str]:
    """``alibi-vit`` as installed beside this Python (its console script), else ``python -m alibi_vit.cli``."""
    script = Path(sys.executable).with_name("alibi-vit")
    return [str(script)] if script.exists() else [sys.executable, "-m", "alibi_vit.cli"]


def run_tool(launcher: Launcher, tool: str, case: dict, work: Path, log: Path, before: str | None = None) -> tuple[dict, "object"]:
    """One run of ``tool`` on ``case``: its measurements and its predicted mask. A tool ending in
    ``_before`` runs with ``PYTHONPATH=before`` (another version of alibi_vit, e.g. an export of the last
    commit beside a ``sitecustomize`` that sets the editable install's import hook aside)."""
    import numpy as np
    from PIL import Image

    env = None
    if tool.endswith("_before"):
        tool, env = tool[:-len("_before")], {**os.environ, "PYTHONPATH": before}
    out = work / f"{tool}{'_before' if env else ''}_{Path(case['image_file']).stem}"
    if tool == "cli":
        model, seg = out / "model", out / "masks"
        train = launcher.run(alibi_vit_command() + ["segment", "train", "--images", case["image_file"], "--labels",
                                                 case["strokes_file"], "--out", str(model)], log, env)
        apply = launcher.run(alibi_vit_command() + ["segment", "apply", "--model", str(model), "--images",
                                                 case["image_file"], "--out", str(seg)], log, env)
        m = {"wall_s": train["wall_s"] + apply["wall_s"], "cpu_s": train["cpu_s"] + apply["cpu_s"],
             "peak_rss_mb": max(train["peak_rss_mb"], apply["peak_rss_mb"]),
             "train_wall_s": train["wall_s"], "apply_wall_s": apply["wall_s"]}
        mask = np.asarray(Image.open(seg / f"{Path(case['image_file']).stem}_mask.png"))
    else:
        script = work / f"{tool}_script.py"
        out.mkdir(parents=True, exist_ok=True)
        script.write_text({"api": API_SCRIPT, "skimage": SKIMAGE_SCRIPT}[tool])
        m = launcher.run([sys.executable, str(script), case["image_file"], case["strokes_file"], str(out / "mask.npy")],
                      log, env)
        mask = np.load(out / "mask.npy")
    m["strokes_given"] = case["strokes_file"]  # the stroke file this run's command lines named
    return m, mask


def median_row(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float)) and k != "repeat"]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def benchmark(cases: list[dict], tools, repeats: int, work: Path, seed: int = 0, progress: bool = True,
              before: str | None = None, launcher: Launcher | None = None) -> dict:
    """Prepare every case, run every tool ``repeats`` times interleaved; rows with runs and medians."""
    import numpy as np

    from alibi_vit.trainable.benchmark import mean_iou

    own = launcher is None
    launcher = launcher or Launcher()
    prepared = [prepare(c, work / "data", seed) for c in cases]
    runs = {(c["image"], c["size"], t): [] for c in prepared for t in tools}
    log = work / "children.log"
    try:
        for r in range(repeats):
            for case in prepared:
                truth = np.load(case["truth_file"])
                for tool in tools:
                    load = load_average()[0]
                    m, mask = run_tool(launcher, tool, case, work / "runs", log, before)
                    m.update(repeat=r, load_1min=load, miou=mean_iou(mask.astype(np.int64), truth))
                    runs[(case["image"], case["size"], tool)].append(m)
                    if progress:
                        print(f"repeat {r + 1}/{repeats} {case['image']} {case['size']}² {tool}: "
                              f"{m['wall_s']:.2f} s wall, {m['cpu_s']:.2f} s CPU, {m['peak_rss_mb']:.0f} MB, "
                              f"mIoU {m['miou']:.3f}, load {load}", flush=True)
    finally:
        if own:
            launcher.close()
    rows = []
    for case in prepared:
        for tool in tools:
            rr = runs[(case["image"], case["size"], tool)]
            rows.append({"image": case["image"], "size": case["size"], "shape": case["shape"], "dtype": case["dtype"],
                         "tool": tool, "image_file": case["image_file"], "strokes_file": case["strokes_file"],
                         "stroked_pixels": case["stroked_pixels"], "runs": rr, "median": median_row(rr)})
    return {"rows": rows}


def accuracy(images, size: int, seeds, progress: bool = True) -> list[dict]:
    """mIoU of the API's defaults and of scikit-image's pipeline (its forest seeded) on each image (generated with
    seed 0) with the strokes of each seed, in this process: accuracy only, paired per stroke draw."""
    import numpy as np
    from skimage.feature import multiscale_basic_features
    from sklearn.ensemble import RandomForestClassifier

    from alibi_vit.trainable.benchmark import mean_iou
    from alibi_vit.trainable.scribbles import scribbles
    from alibi_vit.trainable.segmenter import TrainableSegmenter

    rows = []
    for kind in images:
        image, truth = make_image(kind, size, 0)
        feats = multiscale_basic_features(image, intensity=True, edges=False, texture=True, sigma_min=1, sigma_max=16,
                                          channel_axis=-1 if image.ndim == 3 else None)
        for seed in seeds:
            labels = scribbles(truth, 5, rng=seed)
            ours = TrainableSegmenter().fit([image], [labels]).predict([image])[0]
            sel = labels > 0
            forest = RandomForestClassifier(n_estimators=50, n_jobs=-1, max_depth=10, max_samples=0.05,
                                            random_state=seed).fit(feats[sel], labels[sel])
            theirs = forest.predict(feats.reshape(-1, feats.shape[-1])).reshape(labels.shape)
            rows.append({"image": kind, "size": size, "seed": seed,
                         "ours": mean_iou(ours.astype(np.int64), truth), "skimage": mean_iou(theirs.astype(np.int64), truth)})
            if progress:
                print(f"{kind} seed {seed}: ours {rows[-1]['ours']:.3f}, scikit-image {rows[-1]['skimage']:.3f}", flush=True)
    return rows


def accuracy_markdown(payload: dict) -> list[str]:
    import numpy as np

    lines = [f"# First-segmentation images: mIoU paired over stroke draws ({payload['machine']})", "",
             f"`{payload['command']}` — {payload['date']}; each image generated once (seed 0), 5 strokes per class "
             "drawn with each seed (`scribbles(truth, 5, rng=seed)`); scikit-image's forest seeded with the same seed.",
             "", "| image | size | seeds | ours | scikit-image | ours − scikit-image (paired, ± s.e.) | ours ≥ |",
             "|---|---|---|---|---|---|---|"]
    for kind in dict.fromkeys(r["image"] for r in payload["rows"]):
        rr = [r for r in payload["rows"] if r["image"] == kind]
        ours, theirs = np.array([r["ours"] for r in rr]), np.array([r["skimage"] for r in rr])
        d = ours - theirs
        se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
        lines.append(f"| {kind} | {rr[0]['size']}² | {len(rr)} | {ours.mean():.3f} | {theirs.mean():.3f} | "
                     f"{d.mean():+.3f} ± {se:.3f} | {int((d >= 0).sum())} of {len(d)} |")
    return lines


def markdown(payload: dict) -> list[str]:
    lines = [f"# First segmentation in a fresh process ({payload['machine']})", "",
             f"`{payload['command']}` — {payload['date']}; median of {payload['repeats']} interleaved runs; "
             "wall and CPU (user+sys) in s, peak RSS in MB; ratio = wall ÷ scikit-image's gallery pipeline's "
             "wall on the same image and strokes; load = 1-minute load at the runs' starts (min–max).", "",
             "| image | size | tool | wall s | ratio | CPU s | peak MB | mIoU | load |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = {(r["image"], r["size"]): r["median"]["wall_s"] for r in payload["rows"] if r["tool"] == "skimage"}
    for r in payload["rows"]:
        m, loads = r["median"], [x["load_1min"] for x in r["runs"]]
        ratio = m["wall_s"] / base[(r["image"], r["size"])] if (r["image"], r["size"]) in base else float("nan")
        lines.append(f"| {r['image']} ({r['dtype']}{', RGB' if len(r['shape']) == 3 else ''}) | {r['size']}² | "
                     f"{r['tool']} | {m['wall_s']:.2f} | {ratio:.2f}× | {m['cpu_s']:.2f} | {m['peak_rss_mb']:.0f} | "
                     f"{m['miou']:.3f} | {min(loads):.2f}–{max(loads):.2f} |")
    lines += ["", "cli = `alibi-vit segment train` + `segment apply` (two processes); api = "
              "`TrainableSegmenter().fit` + `predict` in one fresh process; skimage = `multiscale_basic_features"
              "(intensity, texture, σ 1–16)` + `RandomForestClassifier(50, max_depth=10, max_samples=0.05, "
              "n_jobs=-1)`. The colour image's mIoU is against a 3-level split of its luma (no true labels)."]
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024],
                   help="sizes of the texture-only grey image (default 1024); the other images use the smallest")
    p.add_argument("--images", nargs="+", choices=IMAGES, default=list(IMAGES))
    p.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the generated images and the strokes")
    p.add_argument("--before", default=None, metavar="PYTHONPATH",
                   help="also run cli and api with this PYTHONPATH (tools cli_before, api_before), interleaved: "
                        "before/after figures of a change in one run")
    p.add_argument("--accuracy-seeds", type=int, default=0, metavar="N",
                   help="instead of timing: mIoU of the API and scikit-image's pipeline with the strokes of seeds "
                        "0..N-1 on every image at the smallest size, paired (stem + _accuracy)")
    p.add_argument("--smoke", action="store_true", help="128² images, one run: checks the script in seconds")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--stem", default="first_segmentation_cpu")
    args = p.parse_args(argv)
    sizes, repeats = ([128], 1) if args.smoke else (sorted(args.sizes), args.repeats)
    if args.accuracy_seeds:
        from datetime import datetime, timezone

        rows = accuracy(args.images, sizes[0], range(args.accuracy_seeds))
        payload = {"command": command_line("bench_first_segmentation.py", argv), "machine": machine(),
                   "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows}
        md, js = write_report(args.out_dir, f"{args.stem}_accuracy", payload, accuracy_markdown(payload),
                              smoke=args.smoke)
        print("\n".join(accuracy_markdown(payload)))
        print(f"wrote {md} and {js}")
        return payload
    cases = [{"image": "texture", "size": s} for s in sizes if "texture" in args.images]
    cases += [{"image": k, "size": sizes[0]} for k in args.images if k != "texture"]
    launcher = Launcher()  # before any image exists in this process
    with tempfile.TemporaryDirectory(prefix="first_seg_") as tmp:
        tools = [v for t in args.tools for v in ((f"{t}_before", t) if args.before and t in ("cli", "api") else (t,))]
        result = benchmark(cases, tools, repeats, Path(tmp), seed=args.seed, before=args.before,
                           launcher=launcher)
    launcher.close()
    from datetime import datetime, timezone

    payload = {"command": command_line("bench_first_segmentation.py", argv), "machine": machine(),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
               "repeats": repeats, "seed": args.seed, "before": args.before, **result}
    for r in payload["rows"]:  # temporary paths: kept as names only
        r["image_file"], r["strokes_file"] = Path(r["image_file"]).name, Path(r["strokes_file"]).name
        for run in r["runs"]:
            run["strokes_given"] = Path(run["strokes_given"]).name
    md, js = write_report(args.out_dir, args.stem, payload, markdown(payload), smoke=args.smoke)
    print("\n".join(markdown(payload)))
    print(f"wrote {md} and {js}")
    return payload


if __name__ == "__main__":
    main()
