"""Epoch time of segmentation-probe training with the backbone feature cache, at 518 px.

The probe (``SegmentationProbeModule`` with ``feature_cache_dir``) trains for several epochs
on synthetic data written in the Pascal VOC layout (JPEG images of VOC-like sizes, palette
PNG labels) through ``VOCSegmentation`` and the real loader workers. Epoch 1 decodes every
image, runs the frozen backbone and writes the features; later epochs read the cached
features in the workers and train only the head. Target: later epochs ≤ 20 % of the first.
For reference it also times one epoch of the same training without a cache.

Epoch time is wall time between consecutive ends of training epochs (the first from the
start of training), so it includes loader start-up; validation is off.

Results go to ``benchmarks/results/probe_cache_<device>.{md,json}``.

    python benchmarks/bench_probe_cache.py                 # ViT-S/14 at 518 px, 512 images, batch 64
    python benchmarks/bench_probe_cache.py --model base --images 1024
    python benchmarks/bench_probe_cache.py --smoke         # CPU: tiny backbone, 518 px, 24 images
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from report import command_line, environment, slug, write_report  # noqa: E402
TINY = {"depth": 2, "embed_dim": 48, "num_heads": 2}
TARGET = 0.20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=["small", "base", "large", "giant"],
                   help="ALiBi-Dv2 backbone size (random weights: they do not change the timing)")
    p.add_argument("--size", type=int, default=518, help="probe input size in px")
    p.add_argument("--images", type=int, default=512, help="synthetic training images")
    p.add_argument("--batch", type=int, default=64, help="batch size (the paper's VOC batch)")
    p.add_argument("--epochs", type=int, default=4, help="epochs with the cache (the first one fills it)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="loader workers")
    p.add_argument("--no-baseline", action="store_true", help="skip the uncached reference epoch")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="where the synthetic dataset and the cache go (default: a temporary folder, removed after)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the .md and .json go (default: benchmarks/results/, smoke runs: benchmarks/results/smoke/)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU run with a tiny 2-block backbone and 24 images: checks the script, not a GPU timing")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:
        args.images, args.batch, args.epochs = min(args.images, 24), min(args.batch, 8), 3
        args.workers = min(args.workers, 2)
    return args


class EpochClock:
    """Wall time of each training epoch: from the previous epoch's end (or the start of training)."""

    def __init__(self):
        import lightning as L

        clock = self

        class Callback(L.Callback):
            def on_train_start(self, trainer, module):
                clock._sync(module)
                clock.last = time.perf_counter()

            def on_train_epoch_end(self, trainer, module):
                clock._sync(module)
                now = time.perf_counter()
                clock.times.append(now - clock.last)
                clock.last = now

        self.times: list[float] = []
        self.last = 0.0
        self.callback = Callback()

    @staticmethod
    def _sync(module):
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)


def train(args, data_root: Path, cache_dir: Path | None, epochs: int, device: torch.device) -> list[float]:
    import lightning as L

    from datamodules.segmentation import VOCSegmentation
    from lit_modules.segmentation_probe import SegmentationProbeModule

    L.seed_everything(0, verbose=False)
    module = SegmentationProbeModule(f"alibi_vit_{args.model}_patch14_reg4_dinov2", num_classes=21,
                                     backbone_kwargs=TINY if args.smoke else None, allow_random_init=True,
                                     feature_cache_dir=str(cache_dir) if cache_dir else None)
    datamodule = VOCSegmentation(str(data_root), image_size=args.size, batch_size=args.batch,
                                 num_workers=args.workers)
    clock = EpochClock()
    trainer = L.Trainer(accelerator=device.type, devices=1, max_epochs=epochs, limit_val_batches=0,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=True, callbacks=[clock.callback])
    trainer.fit(module, datamodule=datamodule)
    return clock.times


def write_cache_report(result: dict, args, device_name: str, device_slug: str) -> tuple[Path, Path]:
    command = command_line("bench_probe_cache.py", args.argv)
    meta = {"command": command, "device": device_name, "backbone": result["backbone"], "image_size": args.size,
            "images": args.images, "batch": args.batch, "epochs": args.epochs, "workers": args.workers,
            "cpu_count": os.cpu_count(), **environment()}

    times = result["cached_epoch_s"]
    lines = [f"# Segmentation probe: feature-cache epoch times on {device_name}", "",
             f"Command: `{command}`", "",
             f"{result['backbone']} (frozen, bf16 autocast on CUDA) + BatchNorm/1×1-conv head, "
             f"{args.size}×{args.size} px, "
             f"{args.images} synthetic VOC-layout images (JPEG 375–500 px, palette PNG labels), batch {args.batch}, "
             f"{args.workers} loader worker{'s' if args.workers != 1 else ''}; validation off; "
             f"torch {meta['torch']}; {meta['date']}.", "",
             "| run | epoch | time (s) | images/s | ratio to first cached epoch |", "|---|---:|---:|---:|---:|"]
    if result.get("uncached_epoch_s") is not None:
        t = result["uncached_epoch_s"]
        lines.append(f"| no cache | 1 | {t:.2f} | {args.images / t:.1f} | {t / times[0]:.2f} |")
    for epoch, t in enumerate(times, 1):
        lines.append(f"| cache | {epoch} | {t:.2f} | {args.images / t:.1f} | {t / times[0]:.3f} |")
    verdict = "meets" if result["later_to_first"] <= TARGET else "misses"
    lines += ["", f"Later cached epochs take {100 * result['later_to_first']:.1f} % of the first (mean of epochs "
              f"2–{len(times)}); the target is ≤ {100 * TARGET:.0f} %: {verdict} it. Cache on disk: "
              f"{result['cache_mib']:.0f} MiB ({result['cache_mib'] / args.images:.2f} MiB per image)."]
    return write_report(args.out_dir, f"probe_cache_{device_slug}", {"meta": meta, "results": result}, lines,
                        smoke=args.smoke)


def main(argv=None) -> int:
    args = parse_args(argv)
    from datamodules.segmentation import write_synthetic_voc

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    device_name = "CPU (smoke)" if args.smoke else (torch.cuda.get_device_name(device) if device.type == "cuda"
                                                    else f"CPU ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory(prefix="bench_probe_cache_") as tmp:
        work = args.work_dir or Path(tmp)
        data_root, cache_dir = work / "voc", work / "cache"
        if cache_dir.exists():  # a cache left by an earlier run would make the first epoch a cached one
            shutil.rmtree(cache_dir)
        start = time.perf_counter()
        write_synthetic_voc(data_root, n_train=args.images, n_val=1, height=(375, 375), width=(500, 500),
                            n_classes=7, seed=0)
        print(f"wrote {args.images} synthetic VOC images in {time.perf_counter() - start:.1f} s", flush=True)
        uncached = None if args.no_baseline else train(args, data_root, None, 1, device)[0]
        times = train(args, data_root, cache_dir, args.epochs, device)
        cache_mib = sum(p.stat().st_size for p in cache_dir.rglob("*.pt")) / 2**20
    later = sum(times[1:]) / max(len(times) - 1, 1)
    backbone = f"alibi_vit_{args.model}_patch14_reg4_dinov2" + (" (tiny: 2 blocks, width 48)" if args.smoke else "")
    result = {"backbone": backbone,
              "uncached_epoch_s": uncached, "cached_epoch_s": times, "later_to_first": later / times[0],
              "cache_mib": cache_mib, "target": TARGET}
    print(json.dumps(result), flush=True)
    device_slug = "cpu-smoke" if args.smoke else slug(torch.cuda.get_device_name(device) if device.type == "cuda"
                                                      else "cpu")
    md, js = write_cache_report(result, args, device_name, device_slug)
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
