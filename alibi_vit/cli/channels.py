"""``alibi-vit channels``: a teacher's most positional channels, ranked by per-channel positional R².

For each model, the patch features of the images (the final map, or block ``--layer``) are
probed one channel at a time (README.md "Method" §5: held-out R² of a linear fit of the
position target from that channel alone, averaged over samplings and images). The top
``--top`` channels are printed with their R², followed by the list to pass as a distillation
teacher's ``blank_channels`` (README.md "Method" §4); every channel's rank goes to ``--out``
(CSV). For DINOv2-S/14-reg4 the paper's list is 47, 113, 117, 359.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis.probe import MIN_TRAIN, TARGETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import add_image_arguments, add_model_arguments

    add_model_arguments(parser)
    add_image_arguments(parser, default_size=224)
    parser.add_argument("--top", type=int, default=4, help="how many channels to print (default %(default)s)")
    parser.add_argument("--target", default="xy", choices=TARGETS,
                        help="position target of the per-channel fit (default %(default)s, the joint (x, y))")
    parser.add_argument("--layer", type=int, default=None,
                        help="rank the channels of this block's output (through the final norm; negative counts "
                             "from the end) instead of the final feature map")
    parser.add_argument("--fraction", type=float, default=0.025, help="share of patches each fit uses")
    parser.add_argument("--min-train", type=int, default=MIN_TRAIN,
                        help="fit on at least this many patches (default %(default)s; see alibi-vit probe)")
    parser.add_argument("--repeats", type=int, default=10, help="random samplings per image")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("channels.csv"),
                        help="CSV of every channel's rank and R² (default %(default)s)")


def run(args) -> int:
    import warnings

    from ..analysis.channels import rank_channels
    from ..analysis.probe import per_channel_r2
    from ..images import normalize
    from .options import build_models, check_image_size, images_from_args, model_features, weights_of, write_csv

    check_image_size(args.size)
    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after the work
    weights = weights_of(args)
    images = [normalize(img) for _, img in images_from_args(args)]
    rows = []
    for name, model in build_models(args):
        width = model.num_features
        if args.top > width:
            raise ValueError(f"--top {args.top} exceeds the {width} feature channels of {name}")
        layers = None if args.layer is None else [args.layer]
        feats = model_features(model, images, args.batch_size, layers)
        f = feats["final"] if args.layer is None else feats[args.layer]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="positional probe:")  # the fraction note; see alibi-vit probe
            r2 = per_channel_r2(f, args.target, args.fraction, args.repeats, args.seed, min_train=args.min_train)
        order = rank_channels(r2)
        layer = "final" if args.layer is None else args.layer
        mine = [{"model": name, "weights": weights[name], "layer": layer, "target": args.target, "rank": rank + 1,
                 "channel": c, "r2": float(r2[c])} for rank, c in enumerate(order)]
        rows.extend(mine)
        _print_top(mine[:args.top], len(images), args.size)
        del model
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return 0


def _print_top(rows, num_images, size):
    first = rows[0]
    random = " (randomly initialised: ranks say nothing about a trained model)" if first["weights"] == "random init" \
        else ""
    print(f"{first['model']}{random}: most positional channels by per-channel R² (target {first['target']}, "
          f"layer {first['layer']}, {num_images} images at {size} px)")
    print(f"{'rank':>4}  {'channel':>7}  {'R²':>7}")
    for r in rows:
        print(f"{r['rank']:>4}  {r['channel']:>7}  {r['r2']:7.3f}")
    channels = sorted(r["channel"] for r in rows)
    print(f"blank_channels: [{', '.join(map(str, channels))}]")
