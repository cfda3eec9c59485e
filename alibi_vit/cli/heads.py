"""``alibi-vit heads``: attention-head diagnostics of several models on the same images.

For every model, layer and head: prefix mass (attention of patch queries on CLS + registers),
self mass, normalised entropy, mean attention distance in patches (on the torus for wrapped
ALiBi layers), the head's ALiBi slope or how else position enters, and the flags ``sink``
(prefix mass ≥ ``--threshold``), ``self`` (self mass ≥ 0.9) and ``local`` (mean distance ≤ 1
patch); see :mod:`alibi_vit.analysis.heads`. Writes one CSV row per model × layer × head to
``--out``, prints how many heads carry each flag per model, and draws layers × heads heatmaps of
prefix mass and mean distance, a column per model, to ``<out>.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import add_figure_arguments, add_image_arguments, add_model_arguments, at_least

    add_model_arguments(parser)
    add_image_arguments(parser, default_size=224)
    parser.add_argument("--threshold", type=float, default=0.9,
                        help="a head is a sink when its prefix mass is at least this (default %(default)s)")
    parser.add_argument("--batch-size", type=at_least(1), default=4,
                        help="images per forward pass (the attention of one layer at a time is held in memory)")
    parser.add_argument("--out", type=Path, default=Path("heads.csv"),
                        help="CSV to write (default %(default)s); the figure goes next to it as <out>.png "
                             "(or .svg/.pdf: --figure-format)")
    add_figure_arguments(parser)


def run(args) -> int:
    import torch

    from ..analysis.heads import DEFAULT_LOCAL, DEFAULT_SELF, head_statistics, plot_head_maps
    from ..images import load_image_set, normalize, resize_center_crop
    from .options import build_models, check_image_size, figure_path, weights_of, write_csv

    check_image_size(args.size)
    if not 0.0 < args.threshold <= 1.0:
        raise ValueError(f"--threshold is a prefix mass in (0, 1], got {args.threshold}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    args.out.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after the work
    weights = weights_of(args)
    # Native sizes first: an image smaller than a patch has no patch of its own to resize from.
    native = load_image_set(args.images, None if args.images != "noise" else args.size,
                            noise_count=args.noise_count, intensity=args.intensity)
    images = [normalize(resize_center_crop(img, args.size)) for _, img in native]
    rows, stats = [], {}
    for name, model in build_models(args):
        ph, pw = model.patch_embed.patch_size
        small = [(n, tuple(img.shape[-2:])) for n, img in native if img.shape[-2] < ph or img.shape[-1] < pw]
        if small:
            n, (h, w) = small[0]
            raise ValueError(f"image {n!r} of --images {args.images} is {h}×{w} px, smaller than one {ph}×{pw}-px "
                             f"patch of {name}" + (f" ({len(small) - 1} more such images)" if len(small) > 1 else "")
                             + ": remove it or give larger images")
        s = head_statistics(model, torch.stack(images), batch_size=args.batch_size, progress=True)
        label = name + (" (random init)" if weights[name] == "random init" else "")
        stats[label] = s
        for row in s.rows(sink=args.threshold):
            rows.append({"model": name, "weights": weights[name], **row, "images": args.images,
                         "num_images": len(images), "size": args.size})
        del model
    _print_summary(rows, stats, args, len(images), DEFAULT_SELF, DEFAULT_LOCAL)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    fig = plot_head_maps(stats, sink=args.threshold)
    fig.suptitle(f"attention heads on {args.images} ({len(images)} images at {args.size} px)", fontsize="medium")
    path = figure_path(args.out, args)
    fig.savefig(path, dpi=args.dpi)
    print(f"wrote {path}")
    return 0


def _print_summary(rows, stats, args, num_images, self_threshold, local_threshold):
    models = list(dict.fromkeys(r["model"] for r in rows))
    names = [m + (" *" if rows[[r["model"] for r in rows].index(m)]["weights"] == "random init" else "")
             for m in models]
    width = max(len("model"), *(len(n) for n in names))
    print(f"attention heads on {args.images}, {num_images} images at {args.size} px: sink = prefix mass ≥ "
          f"{args.threshold:g}, self = self mass ≥ {self_threshold:g}, local = mean distance ≤ {local_threshold:g} "
          "patch")
    header = f"{'model':<{width}}  {'heads':>9}  {'sink':>5}  {'self':>5}  {'local':>5}  position"
    print(header)
    print("-" * len(header))
    for model, name, s in zip(models, names, stats.values()):
        mine = [r for r in rows if r["model"] == model]
        layers, heads = s.shape
        counts = [sum(r[flag] for r in mine) for flag in ("sink", "self", "local")]
        positions = ", ".join(dict.fromkeys(s.position))
        print(f"{name:<{width}}  {f'{layers}×{heads}':>9}  " + "  ".join(f"{c:>5}" for c in counts)
              + f"  {positions}")
    for model, s in zip(models, stats.values()):
        sinks = [r for r in rows if r["model"] == model and r["sink"]]
        if sinks:
            listed = ", ".join(f"{r['layer']}.{r['head']} ({r['prefix_mass']:.2f})" for r in sinks[:12])
            more = f" and {len(sinks) - 12} more" if len(sinks) > 12 else ""
            print(f"sink heads of {model} (layer.head (prefix mass)): {listed}{more}")
    if any(r["weights"] == "random init" for r in rows):
        print("* randomly initialised (no --pretrained or --checkpoint): these heads say nothing about a trained model")
