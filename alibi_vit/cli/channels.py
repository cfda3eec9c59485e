"""``alibi-vit channels``: a teacher's most positional channels, ranked by per-channel positional R².

For each model, the patch features of the images (the final map, or block ``--layer``) are
probed one channel at a time (docs/method.md §5: held-out R² of a fit of the position
target from that channel alone — standardised, ridge α = 1 as the authors' notebook, or
``--fit lstsq`` — averaged over samplings and images). The images are probed at their native size
(centre-cropped to a multiple of the patch size), as the authors' notebook does, and noise at 518
px (512 for patch-16 models); ``--size N`` resizes them all to N px instead. By default
(``--target ramps``) the channels are ranked once per ramp (``--ramps``: x, y, diag, radial) and the
rule's list is the union of each ramp's top ``--top`` (2); ``--target xy`` (or any one target)
ranks once and takes its top ``--top``. The command prints the rule and its list as found, and the
list sorted as ``blank_channels`` for a distillation teacher (docs/method.md §4); every
channel's rank per target goes to ``--out`` (CSV).

Which rule gives which of the authors' blanked lists: :mod:`alibi_vit.analysis.channels` and
docs/probe.md ("Most positional channels").
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
    for action in parser._actions:  # None: native size, as the authors' notebook
        if action.dest == "size":
            action.default = None
            action.help = ("images are resized and centre-cropped to SIZE px (default: each image at its native size, "
                           "centre-cropped to a multiple of the patch size, as the authors' notebook; noise at 518 "
                           "px, 512 for patch-16 models)")
    parser.add_argument("--top", type=int, default=2,
                        help="channels taken from each ranking (default %(default)s: each ramp's top 2)")
    parser.add_argument("--target", default="ramps", choices=("ramps", *TARGETS),
                        help="ramps (default): rank per ramp (--ramps) and take the union of their tops, as the "
                             "authors' notebook; or one position target")
    parser.add_argument("--ramps", nargs="+", default=list(RAMPS), choices=RAMPS,
                        help="the ramps of --target ramps (default: " + " ".join(RAMPS) + ")")
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
    parser.add_argument("--seed", type=int, default=0, help="seed of the patch samplings and of noise images")
    parser.add_argument("--batch-size", type=int, default=8, help="images per forward pass")
    parser.add_argument("--out", type=Path, default=Path("channels.csv"),
                        help="CSV of every channel's rank and R² (default %(default)s)")


def rule_lines(r2_by_target: dict, top: int) -> list[str]:
    """The rule applied to per-target R², as printed: its list in the order found, then sorted for distillation."""
    from ..analysis.channels import union_of_tops

    chosen = union_of_tops(r2_by_target, top)
    targets = ", ".join(r2_by_target)
    rule = f"union of each ramp's top {top} ({targets})" if len(r2_by_target) > 1 else f"top {top} of {targets}"
    return [f"{rule}: {chosen}", f"blank_channels: [{', '.join(map(str, sorted(chosen)))}]"]


def _features(model, args, cache: dict) -> list:
    """The model's feature maps: one (B, C, h, w) batch at ``--size``, else one map per image at its own size."""
    from .options import model_features
    from .probe import paper_images

    images = paper_images(args, model.patch_embed.patch_size[0], cache)
    layers = None if args.layer is None else [args.layer]
    key = "final" if args.layer is None else args.layer
    if args.size is not None:
        return model_features(model, images, args.batch_size, layers)[key]
    return [model_features(model, [image], 1, layers)[key] for image in images]


def run(args) -> int:
    import warnings

    from ..analysis.channels import rank_channels, rank_per_ramp
    from .options import build_models, check_image_size, weights_of, write_csv
    from .probe import paper_images

    if args.size is not None:
        check_image_size(args.size)
    if args.top < 1:
        raise ValueError(f"--top must be at least 1, got {args.top}")
    if args.alpha < 0:
        raise ValueError(f"--alpha must be at least 0, got {args.alpha}")
    if args.target != "ramps" and list(args.ramps) != list(RAMPS):
        raise ValueError(f"--ramps chooses the ramps of --target ramps; with --target {args.target} drop it")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after the work
    weights = weights_of(args)
    cache: dict = {}
    paper_images(args, 14, cache)  # a bad --images fails before any model is built
    targets = tuple(dict.fromkeys(args.ramps)) if args.target == "ramps" else (args.target,)
    rows = []
    for name, model in build_models(args):
        width = model.num_features
        if args.top > width:
            raise ValueError(f"--top {args.top} exceeds the {width} feature channels of {name}")
        feats = _features(model, args, cache)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="positional probe:")  # the fraction note; see alibi-vit probe
            r2_by_target = rank_per_ramp(feats, targets, fraction=args.fraction, repeats=args.repeats, seed=args.seed,
                                         min_train=args.min_train, fit=args.fit, alpha=args.alpha)
        layer = "final" if args.layer is None else args.layer
        tops = {}
        for target, r2 in r2_by_target.items():
            mine = [{"model": name, "weights": weights[name], "layer": layer, "target": target, "fit": args.fit,
                     "rank": rank + 1, "channel": c, "r2": float(r2[c])} for rank, c in enumerate(rank_channels(r2))]
            rows.extend(mine)
            tops[target] = mine[:args.top]
        size = f"{args.size} px" if args.size is not None else "native size"
        _print_top(tops, rule_lines(r2_by_target, args.top), len(feats), size)
        del model
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    return 0


def _print_top(tops: dict, rule: list[str], num_images, size: str):
    first = next(iter(tops.values()))[0]
    random = " (randomly initialised: ranks say nothing about a trained model)" if first["weights"] == "random init" \
        else ""
    print(f"{first['model']}{random}: most positional channels by per-channel R² ({first['fit']} fit, "
          f"layer {first['layer']}, {num_images} images at {size})")
    print(f"{'target':>6}  {'rank':>4}  {'channel':>7}  {'R²':>7}")
    for target, rows in tops.items():
        for r in rows:
            print(f"{target:>6}  {r['rank']:>4}  {r['channel']:>7}  {r['r2']:7.3f}")
    print("\n".join(rule))
