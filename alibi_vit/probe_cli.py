"""``alibi-vit probe``: the positional-bias probe of several models on the same images.

Prints a table (models × targets) of held-out R² and writes it as CSV. ``--per-layer`` adds
one row per block (the per-layer fingerprint) and a per-channel CSV.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .cli_options import add_image_arguments, add_model_arguments, build_models, images_from_args
from .images import normalize
from .probe import TARGETS, per_channel_r2, positional_r2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_image_arguments(parser, default_size=224)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--fraction", type=float, default=0.025, help="share of patches the probe is fitted on")
    parser.add_argument("--repeats", type=int, default=10, help="random samplings per image")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-layer", action="store_true", help="probe every block's output too")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("probe_results.csv"), help="CSV file to write")


@torch.no_grad()
def _features(model, images, batch_size, device, layers):
    from .features import patch_features

    out = {}
    for start in tqdm(range(0, len(images), batch_size), desc="features", leave=False):
        batch = torch.stack(images[start:start + batch_size]).to(device)
        feats = patch_features(model, batch, layers=layers)
        # The last block's output through the final norm is the final feature map: no second forward.
        feats = {"final": feats} if layers is None else {**feats, "final": feats[layers[-1]]}
        for key, value in feats.items():
            out.setdefault(key, []).append(value.float().cpu())
    return {key: torch.cat(chunks) for key, chunks in out.items()}


def run(args) -> int:
    images = [normalize(img) for _, img in images_from_args(args)]
    rows, channel_rows = [], []
    for name, model in build_models(args):
        layers = list(range(len(model.blocks))) if args.per_layer else None
        feats = _features(model, images, args.batch_size, args.device, layers)
        for layer, f in tqdm(feats.items(), desc=f"probe {name}", leave=False):
            row = {"model": name, "layer": layer, "images": args.images, "num_images": len(images), "size": args.size}
            for target in args.targets:
                row[target] = positional_r2(f, target, args.fraction, args.repeats, args.seed)
            rows.append(row)
            if args.per_layer:
                for c, r2 in enumerate(per_channel_r2(f, "xy", args.fraction, args.repeats, args.seed)):
                    channel_rows.append({"model": name, "layer": layer, "channel": c, "xy": r2})
        del model
    _print_table(rows, args.targets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _write_csv(args.out, rows)
    print(f"wrote {args.out}")
    if channel_rows:
        channel_path = args.out.with_name(args.out.stem + "_channels.csv")
        _write_csv(channel_path, channel_rows)
        print(f"wrote {channel_path}")
    return 0


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _print_table(rows, targets):
    name_width = max(len("model"), *(len(r["model"]) for r in rows))
    header = f"{'model':<{name_width}}  {'layer':>5}  " + "  ".join(f"{t:>7}" for t in targets)
    print(f"positional R² (held-out; 1 = position fully readable, ≤ 0 = none) on {rows[0]['images']}, "
          f"{rows[0]['num_images']} images at {rows[0]['size']} px")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:<{name_width}}  {str(r['layer']):>5}  " + "  ".join(f"{r[t]:7.3f}" for t in targets))
