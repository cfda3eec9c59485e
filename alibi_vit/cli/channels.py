"""``alibi-vit channels``: a teacher's most positional channels, ranked by per-channel positional R².

For each model, the patch features of the images (the final map, or block ``--layer``) are
probed one channel at a time (docs/method.md §5: held-out R² of a fit of the position
target from that channel alone — standardised, ridge α = 1 as the authors' notebook, or
``--fit lstsq`` — averaged over samplings and images). By default (``--target ramps``) the
channels are ranked once per ramp (x, y, diag, radial) and the list to pass as a distillation
teacher's ``blank_channels`` (docs/method.md §4) is the union of each ramp's top ``--top``
(2), as the authors' notebook does; ``--target xy`` (or any one target) ranks once and blanks its
top ``--top``. Every channel's rank per target goes to ``--out`` (CSV). The authors' stored output
for DINOv2-S/14-reg4: x 117 359 …, y 359 117 …, diag 117 345 …, radial 47 113 …, hence
47, 113, 117, 359 (a single ``xy`` ranking cannot find the radial 47 and 113).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis.channels import RAMPS
from ..analysis.probe import MIN_TRAIN, PER_CHANNEL_FITS, TARGETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import add_image_arguments, add_model_arguments

    add_model_arguments(parser)
    add_image_arguments(parser, default_size=224)
    parser.add_argument("--top", type=int, default=2,
                        help="channels taken from each ranking (default %(default)s: each ramp's top 2)")
    parser.add_argument("--target", default="ramps", choices=("ramps", *TARGETS),
                        help="ramps (default): rank per ramp (" + ", ".join(RAMPS) + ") and blank the union of "
                             "their tops, as the authors' notebook; or one position target")
    parser.add_argument("--fit", default="ridge", choices=PER_CHANNEL_FITS,
                        help="per-channel fit: ridge on the standardised channel (default, the authors' notebook) "
                             "or plain least squares")
    parser.add_argument("--alpha", type=float, default=1.0, help="ridge penalty (default %(default)s)")
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

    from ..analysis.channels import rank_channels, rank_per_ramp, union_of_tops
    from ..images import normalize
    from .options import build_models, check_image_size, images_from_args, model_features, weights_of, write_csv

    check_image_size(args.size)
    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    if args.alpha < 0:
        raise ValueError(f"--alpha must be at least 0, got {args.alpha}")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after the work
    weights = weights_of(args)
    images = [normalize(img) for _, img in images_from_args(args)]
    targets = RAMPS if args.target == "ramps" else (args.target,)
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
            r2_by_target = rank_per_ramp(f, targets, fraction=args.fraction, repeats=args.repeats, seed=args.seed,
                                         min_train=args.min_train, fit=args.fit, alpha=args.alpha)
        layer = "final" if args.layer is None else args.layer
        tops = {}
        for target, r2 in r2_by_target.items():
            mine = [{"model": name, "weights": weights[name], "layer": layer, "target": target, "fit": args.fit,
                     "rank": rank + 1, "channel": c, "r2": float(r2[c])} for rank, c in enumerate(rank_channels(r2))]
            rows.extend(mine)
            tops[target] = mine[:args.top]
        _print_top(tops, union_of_tops(r2_by_target, args.top), len(images), args.size)
        del model
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return 0


def _print_top(tops: dict, chosen: list[int], num_images, size):
    first = next(iter(tops.values()))[0]
    random = " (randomly initialised: ranks say nothing about a trained model)" if first["weights"] == "random init" \
        else ""
    how = "union of each ramp's top" if len(tops) > 1 else "top"
    print(f"{first['model']}{random}: most positional channels by per-channel R² ({first['fit']} fit, "
          f"layer {first['layer']}, {num_images} images at {size} px)")
    print(f"{'target':>6}  {'rank':>4}  {'channel':>7}  {'R²':>7}")
    for target, rows in tops.items():
        for r in rows:
            print(f"{target:>6}  {r['rank']:>4}  {r['channel']:>7}  {r['r2']:7.3f}")
    print(f"{how} {len(next(iter(tops.values())))}: {chosen}")
    print(f"blank_channels: [{', '.join(map(str, sorted(chosen)))}]")
