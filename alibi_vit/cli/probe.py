"""``alibi-vit probe``: the positional-bias probe of several models on the same images.

Prints a table (models × targets) of held-out R² and writes it as CSV (``--out``: a folder, default
``probe_results/``, that gets ``probe.csv``, or a ``.csv`` file; ``<out>`` below is that file); the ``weights`` column
says where each model's weights came from (``random init`` when neither ``--pretrained`` nor
``--checkpoint`` was given: such numbers say nothing about trained features). ``--per-layer``
adds one row per block and writes the per-channel R² (the "positional fingerprint", target
``--fingerprint-target``) to ``<out>_channels.csv``. ``--plot`` (implies ``--per-layer``) draws
R² per layer, one panel per target (paper Fig. 2), to ``<out>_layers.png`` (``--figure-format svg|pdf``
for vector files) and the fingerprint
as a layers × channels heatmap per model (paper Fig. 3 uses ``--fingerprint-target x``) to
``<out>_fingerprint.png``.

``--paper-table`` runs the models of the paper's Tab. 1–2 instead of ``--model`` (DINOv2-S,
DINOv2-S blanked, DINOv2-B, DINOv3-S+, NoPE, ALiBi-Dv2, ALiBi-Dv3, transform-averaged, sin-cos;
:data:`PAPER_ROWS`) and prints each one's (x, y) R² beside the paper's on micrographs, textures
and uniform noise (docs/method.md §5). Each model loads its own pretrained weights (timm's
hub or cache, or ``--checkpoint NAME=PATH`` with the row's model name); a model whose weights
cannot be had, or that cannot be built, is listed as skipped with the reason.

The paper table probes as the reference code does: noise at 518 px (512 px for patch-16 models
such as DINOv3), other images at their native size (centre-cropped to a multiple of the patch
size, not resized), fitting (h·w)//36 patches, 6 repeats per image; ``--size N`` resizes
everything to N px instead (``--fraction``, ``--min-train`` and ``--repeats`` do not apply). The
score stays held-out R² (the reference also scored the fitted patches, which flatters the fit),
so the table's own column is not the paper's score: the paper column of the same image kind
(``--paper-set``, guessed from ``--images``) is the one the settings match.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..analysis.probe import MIN_TRAIN, TARGETS, fitted_patches

# The paper's Tab. 1–2 rows this project can build: (row, model name[.tag], paper (x, y) R² on
# micrographs / textures / uniform noise, or None where docs/method.md §5 gives none).
PAPER_ROWS = (
    ("DINOv2-S", "vit_small_patch14_reg4_dinov2", (0.83, 0.71, 0.89)),
    ("DINOv2-S blanked", "blanked_vit_small_patch14_reg4_dinov2", (0.78, 0.67, 0.89)),  # blanks PAPER_BLANKED
    ("DINOv2-B", "vit_base_patch14_reg4_dinov2", (0.68, 0.58, 0.89)),
    ("DINOv3-S+", "vit_small_plus_patch16_dinov3", (0.97, 0.90, 0.98)),
    ("NoPE", "nope_vit_small_patch14_reg4_dinov2.dinosaw_coco", None),
    ("ALiBi-Dv2", "alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco", (-0.23, 0.32, -0.85)),
    ("ALiBi-Dv3", "alibi_vit_small_plus_patch16_dinov3.dinosaw_coco", None),
    ("transform-averaged", "tavg_vit_small_patch14_reg4_dinov2", None),
    ("sin-cos", "sincos_vit_small_patch14_reg4_dinov2", None),
)
PAPER_SETS = ("micrographs", "textures", "noise")
# The channels the authors' wrapper blanks for the "DINOv2-S blanked" row (three of the four distillation
# targets blank: 113 is left in).
PAPER_BLANKED = (47, 117, 359)
PAPER_REPEATS = 6  # the reference's samplings per image; it fits (h·w)//36 patches
PAPER_NOISE_SIZE = {14: 518, 16: 512}  # noise images per patch size


def paper_set_of(images: str) -> str:
    """The paper column the image set compares with: noise, textures, else micrographs."""
    return images if images in ("noise", "textures") else "micrographs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .options import add_figure_arguments, add_image_arguments, add_model_arguments, at_least, fraction

    add_model_arguments(parser)
    for action in parser._actions:  # --paper-table names its own models
        if action.dest == "models":
            action.required = False
    parser.add_argument("--paper-table", action="store_true",
                        help="run the paper's Tab. 1-2 models (no --model; pretrained weights, or --checkpoint "
                             "NAME=PATH per model) and print their (x, y) R² beside the paper's; models without "
                             "weights are skipped with the reason (offline, HF_HUB_OFFLINE=1 skips without retries)")
    add_image_arguments(parser, default_size=224)
    for action in parser._actions:  # None: 224, or with --paper-table the reference's sizes
        if action.dest == "size":
            action.default = None
            action.help = ("images are resized and centre-cropped to SIZE px (default 224); with --paper-table the "
                           "default is the reference's: noise at 518 px, 512 for patch-16 models, other images at "
                           "native size")
    parser.add_argument("--paper-set", choices=PAPER_SETS, default=None,
                        help="--paper-table: the paper column these images compare with (default: noise for noise, "
                             "textures for textures, else micrographs)")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS,
                        help="position ramps to predict: x, y, diagonal, radial and the joint xy (default: all)")
    parser.add_argument("--fraction", type=fraction, default=0.025, help="share of patches the probe is fitted on")
    parser.add_argument("--min-train", type=at_least(0), default=MIN_TRAIN,
                        help="fit on at least this many patches (at most half the grid), raising --fraction on "
                             "small images (default %(default)s; 0 keeps --fraction as given)")
    parser.add_argument("--repeats", type=at_least(1), default=10, help="random samplings per image")
    parser.add_argument("--seed", type=int, default=0, help="seed of the patch samplings and of noise images")
    parser.add_argument("--per-layer", action="store_true", help="probe every block's output too")
    parser.add_argument("--fingerprint-target", default="xy", choices=TARGETS,
                        help="target of the per-channel fingerprint (default %(default)s; paper Fig. 3: x)")
    parser.add_argument("--plot", action="store_true",
                        help="draw R² per layer and the per-channel fingerprint heatmap next to --out "
                             "(implies --per-layer; --figure-format, --dpi)")
    add_figure_arguments(parser)
    parser.add_argument("--batch-size", type=at_least(1), default=8, help="images per forward pass")
    parser.add_argument("--out", type=Path, default=Path("probe_results"), metavar="DIR|FILE.csv",
                        help="output folder (made if needed) for probe.csv and, with --per-layer/--plot, "
                             "probe_channels.csv and the figures; or a .csv file, the others named after it "
                             "(default %(default)s/)")


def run(args) -> int:
    import warnings

    import numpy as np
    from tqdm.auto import tqdm

    from ..analysis.probe import per_channel_r2, positional_r2
    from ..images import normalize
    from .options import (build_models, check_image_size, figure_path, images_from_args, model_features, weights_of,
                          write_csv)

    args.out = csv_path(args.out)
    if args.paper_table:
        return run_paper_table(args)
    if args.size is None:
        args.size = 224
    check_image_size(args.size)
    if not args.models:
        raise ValueError("give --model NAME [NAME ...], or --paper-table")
    if args.plot:
        _figure()  # without matplotlib, fail before the work
        args.per_layer = True
    args.out.parent.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after the work
    weights = weights_of(args)
    images = [normalize(img) for _, img in images_from_args(args)]
    rows, channel_rows, fingerprints = [], [], {}
    for name, model in build_models(args):
        layers = list(range(len(model.blocks))) if args.per_layer else None
        feats = model_features(model, images, args.batch_size, layers)
        h, w = feats["final"].shape[-2:]
        n_train = fitted_patches(h * w, args.fraction, args.min_train)
        for layer, f in tqdm(feats.items(), desc=f"probe {name}", leave=False):
            row = {"model": name, "weights": weights[name], "layer": layer, "images": args.images,
                   "num_images": len(images), "size": args.size, "fitted_patches": n_train, "patches": h * w}
            with warnings.catch_warnings():
                # The fraction note is printed once below the table, not once per layer and target.
                warnings.filterwarnings("ignore", message="positional probe:")
                for target in args.targets:
                    row[target] = positional_r2(f, target, args.fraction, args.repeats, args.seed,
                                                min_train=args.min_train)
                rows.append(row)
                if args.per_layer:
                    r2 = per_channel_r2(f, args.fingerprint_target, args.fraction, args.repeats, args.seed,
                                        min_train=args.min_train)
                    if layer != "final":
                        fingerprints.setdefault(name, []).append(r2)
                    for c, value in enumerate(r2):
                        channel_rows.append({"model": name, "layer": layer, "channel": c,
                                             args.fingerprint_target: value})
        del model
    _print_table(rows, args.targets, args.fraction)
    write_csv(args.out, rows)
    print(f"wrote {args.out}")
    if channel_rows:
        channel_path = args.out.with_name(args.out.stem + "_channels.csv")
        write_csv(channel_path, channel_rows)
        print(f"wrote {channel_path}")
    if args.plot:
        layer_rows = [r for r in rows if r["layer"] != "final"]
        figures = {"_layers": plot_r2_per_layer(layer_rows, args.targets),
                   "_fingerprint": plot_fingerprints({k: np.stack(v) for k, v in fingerprints.items()},
                                                     args.fingerprint_target)}
        for suffix, fig in figures.items():
            path = figure_path(args.out.with_name(args.out.stem + suffix), args)
            fig.savefig(path, dpi=args.dpi)
            print(f"wrote {path}")
    return 0


def csv_path(out) -> Path:
    """The table ``--out`` names: a ``.csv`` path is the file itself; anything else is a folder that gets
    ``probe.csv`` (with the channel table and figures beside it). A file in a folder's way is an error now."""
    from ..files import check_folder_path

    out = Path(out)
    if out.suffix.lower() == ".csv" and not out.is_dir():
        check_folder_path(out.parent)
        return out
    check_folder_path(out)
    return out / "probe.csv"


def _crop_to_patch(image, patch: int):
    """Centre crop (3, H, W) to the largest multiple of ``patch`` in each direction (no resizing)."""
    H, W = image.shape[-2:]
    h, w = H // patch * patch, W // patch * patch
    if not (h and w):
        raise ValueError(f"an image of {H}×{W} px is smaller than one {patch}-px patch")
    top, left = (H - h) // 2, (W - w) // 2
    return image[..., top:top + h, left:left + w]


def paper_images(args, patch: int, cache: dict) -> list:
    """The normalised images one model of the paper table sees: ``--size`` px, or the reference's sizes."""
    from ..images import load_image_set, normalize, noise_images

    key = patch if args.size is None else "fixed"
    if key not in cache:
        if args.size is not None:
            named = load_image_set(args.images, args.size, args.noise_count, args.seed, args.intensity)
        elif args.images == "noise":
            named = noise_images(args.noise_count, PAPER_NOISE_SIZE.get(patch, 518), args.seed)
        else:
            named = [(n, _crop_to_patch(img, patch))
                     for n, img in load_image_set(args.images, None, args.noise_count, args.seed, args.intensity)]
        cache[key] = [normalize(img) for _, img in named]
    return cache[key]


def paper_r2(feats: list, seed: int) -> tuple[float, int]:
    """(x, y) held-out R² with the reference's fit: (h·w)//36 patches, 6 repeats per image, averaged over images
    (image b seeded as :func:`positional_r2` seeds it), and the patches fitted on the first image."""
    import numpy as np

    from ..analysis.probe import positional_r2, reference_fitted_patches

    scores, fitted = [], None
    for b, f in enumerate(feats):
        n = reference_fitted_patches(f.shape[-2] * f.shape[-1])
        fitted = n if fitted is None else fitted
        scores.append(positional_r2(f, "xy", repeats=PAPER_REPEATS, seed=seed + 7919 * b, n_train=n))
    return float(np.mean(scores)), fitted


def run_paper_table(args) -> int:
    """``--paper-table``: the (x, y) R² of every :data:`PAPER_ROWS` model that can be built, beside the paper's."""
    from ..features import patch_features
    from ..models.checkpoint import create_backbone
    from .options import check_image_size, checkpoints_by_model, parse_model_args, write_csv

    if args.models:
        raise ValueError("--paper-table runs its own models; drop --model (use --checkpoint NAME=PATH for their "
                         "weights, NAME one of: " + ", ".join(name for _, name, _ in PAPER_ROWS) + ")")
    if args.per_layer or args.plot:
        raise ValueError("--paper-table reports the final feature map only; drop --per-layer/--plot")
    if args.size is not None:
        check_image_size(args.size)
        if args.size % 14 or args.size % 16:
            raise ValueError(f"--paper-table runs patch-14 and patch-16 models: --size must be a multiple of 112 "
                             f"(e.g. 224, 448), got {args.size}")
    import torch

    names = [name for _, name, _ in PAPER_ROWS]
    checkpoints = checkpoints_by_model(args.checkpoint, names)
    model_kwargs = parse_model_args(args.model_arg)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    compare = args.paper_set or paper_set_of(args.images)
    cache: dict = {}
    paper_images(args, 14, cache)  # a bad --images fails before any model is built
    rows = []
    for label, name, paper in PAPER_ROWS:
        row = {"row": label, "model": name, "weights": checkpoints.get(name, "pretrained"), "xy": None,
               **{f"paper_{s}": (None if paper is None else value) for s, value in
                  zip(PAPER_SETS, paper or (None,) * 3)}, "compare_with": f"paper_{compare}",
               "size": None, "fitted_patches": None, "repeats": PAPER_REPEATS, "skipped": ""}
        rows.append(row)
        extra = {"channels": list(PAPER_BLANKED)} if name.startswith("blanked_") else {}
        try:
            model = create_backbone(name, pretrained=name not in checkpoints, checkpoint=checkpoints.get(name),
                                    **extra, **model_kwargs)
        except (OSError, ValueError) as err:  # weights not on this machine / not reachable, or not buildable
            row["skipped"] = _one_line(err)
            continue
        model = model.to(device).eval()
        patch = model.patch_embed.patch_size[0]
        images = paper_images(args, patch, cache)
        sizes = sorted({tuple(img.shape[-2:]) for img in images})
        row["size"] = "×".join(map(str, sizes[0])) if len(sizes) == 1 else "native"
        with torch.no_grad():
            feats = [patch_features(model, img[None].to(device)).float().cpu() for img in images]
        row["xy"], row["fitted_patches"] = paper_r2(feats, args.seed)
        del model
    _print_paper_table(rows, args, len(cache[next(iter(cache))]), compare)
    write_csv(args.out, [{**r, "images": args.images, "num_images": len(cache[next(iter(cache))]),
                          "score": "held-out R² (paper: R² with the fitted patches scored too)"} for r in rows])
    print(f"wrote {args.out}")
    return 0


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, OSError):  # the hub's messages run long: their first sentence says it
        return f"weights unavailable here ({type(err).__name__}: {text.split('. ')[0][:200]})"
    return f"{type(err).__name__}: {text[:300]}"


def _print_paper_table(rows, args, num_images, compare: str):
    def num(v):
        return f"{v:7.2f}" if v is not None else f"{'—':>7}"

    label_w = max(len(r["row"]) for r in rows)
    how = f"{args.size} px" if args.size is not None else "the reference's sizes (noise 518/512 px, images native)"
    print(f"positional R² (x, y) on {args.images}: {num_images} images at {how}; fitted (h·w)//36 patches, "
          f"{PAPER_REPEATS} repeats per image, as the reference code")
    print(f"ours = held-out R² (scored on the patches not fitted); paper = Tab. 1–2, whose R² also scores the "
          f"fitted patches. These images compare with the paper's {compare} column (marked *); scoring the fitted "
          f"patches too usually gives a higher R².")
    cols = {s: ("*" if s == compare else "") + {"micrographs": "micro", "textures": "texture", "noise": "noise"}[s]
            for s in PAPER_SETS}
    header = (f"{'row':<{label_w}}  {'ours':>7}  {'paper:':>7} " + " ".join(f"{cols[s]:>7}" for s in PAPER_SETS)
              + "  size      weights")
    print(header)
    print("-" * len(header))
    for r in rows:
        measured = f"{r['xy']:7.3f}" if r["xy"] is not None else f"{'skipped':>7}"
        paper = " ".join(num(r[f"paper_{s}"]) for s in PAPER_SETS)
        print(f"{r['row']:<{label_w}}  {measured}  {'':>7} {paper}  {(r['size'] or ''):<9} "
              f"{r['weights'] if not r['skipped'] else ''}")
    skipped = [r for r in rows if r["skipped"]]
    if skipped:
        print("skipped (give --checkpoint NAME=PATH, or go online / fill the hub cache):")
        for r in skipped:
            print(f"  {r['row']} ({r['model']}): {r['skipped']}")
    print(f"— : the paper gives no number for this row; DINOv2-S blanked zeroes channels "
          f"{', '.join(map(str, PAPER_BLANKED))}, as the authors' wrapper")


def _print_table(rows, targets, fraction):
    names = [r["model"] + (" *" if r["weights"] == "random init" else "") for r in rows]
    name_width = max(len("model"), *(len(n) for n in names))
    header = f"{'model':<{name_width}}  {'layer':>5}  " + "  ".join(f"{t:>7}" for t in targets)
    first = rows[0]
    print(f"positional R² (held-out; 1 = position fully readable, ≤ 0 = none) on {first['images']}, "
          f"{first['num_images']} images at {first['size']} px")
    print(header)
    print("-" * len(header))
    for name, r in zip(names, rows):
        print(f"{name:<{name_width}}  {str(r['layer']):>5}  " + "  ".join(f"{r[t]:7.3f}" for t in targets))
    if any(r["weights"] == "random init" for r in rows):
        print("* randomly initialised (no --pretrained or --checkpoint): these numbers say nothing about a trained "
              "model")
    for n, total in sorted({(r["fitted_patches"], r["patches"]) for r in rows}):
        if n != round(fraction * total):
            print(f"note: fitted on {n} of {total} patches per sampling ({n / total:.1%}), not --fraction "
                  f"{fraction:.1%} = {round(fraction * total)}, too few for a stable fit; see --min-train")


# ---- plots (matplotlib, without pyplot: no global backend state) -------------------------------

def _figure(**kwargs):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    return Figure(**kwargs)


_MARKERS = ("o", "s", "^", "D", "v", "P")
_LINESTYLES = ("-", "--", "-.", ":")


def plot_r2_per_layer(rows, targets):
    """R² against block index, one panel per target and one line per model (paper Fig. 2): a matplotlib Figure.

    ``rows`` are the probe's per-layer rows (``model``, ``weights``, integer ``layer``, one value per target).
    The y axis spans −1 to 1; lower values are drawn at −1 (held-out R² is unbounded below), and the
    panel's title says so.
    """
    import numpy as np

    fig = _figure(figsize=(3.6 * len(targets), 3.6), layout="constrained")
    axes = fig.subplots(1, len(targets), squeeze=False)[0]
    models = list(dict.fromkeys(r["model"] for r in rows))
    # Models with equal values would hide each other: each gets its own marker and line style and a
    # small sideways offset (a fraction of one layer, so the layer each point belongs to stays clear).
    offsets = np.linspace(-0.15, 0.15, len(models)) if len(models) > 1 else [0.0]
    for ax, target in zip(axes, targets):
        for m, name in enumerate(models):
            mine = [r for r in rows if r["model"] == name]
            label = name + (" (random init)" if mine[0]["weights"] == "random init" else "")
            # Very negative R² would squash the informative range [0, 1]: draw it at −1.
            ax.plot([r["layer"] + offsets[m] for r in mine], [max(r[target], -1.0) for r in mine],
                    marker=_MARKERS[m % len(_MARKERS)], linestyle=_LINESTYLES[m % len(_LINESTYLES)], markersize=4,
                    label=label)
        ax.axhline(0.0, color="0.6", linewidth=0.8)
        ax.set_ylim(-1.05, 1.05)
        clipped = any(r[target] < -1.0 for r in rows)
        ax.set_title(f"target {target}" + (" (values < −1 drawn at −1)" if clipped else ""), fontsize="medium")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("layer (block)")
        ax.set_ylabel("held-out R²")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(models), 3), fontsize="small")
    return fig


def plot_fingerprints(fingerprints, target):
    """Per-channel R² as a layers × channels heatmap per model (paper Fig. 3): a matplotlib Figure.

    ``fingerprints`` maps a model name to its (layers, channels) array; colours span R² 0 → 1
    (negative values show as 0).
    """
    fig = _figure(figsize=(10, 0.4 + 2.6 * len(fingerprints)), layout="constrained")
    axes = fig.subplots(len(fingerprints), 1, squeeze=False)[:, 0]
    for ax, (name, values) in zip(axes, fingerprints.items()):
        im = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"{name}: per-channel R², target {target}")
        ax.set_xlabel("channel")
        ax.set_ylabel("layer")
        ax.yaxis.get_major_locator().set_params(integer=True)
        fig.colorbar(im, ax=ax, label="R² (≤ 0 shown as 0)")
    return fig
