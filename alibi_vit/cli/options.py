"""What several ``alibi-vit`` subcommands share: the model and image options, building the models they name,
their patch features in batches, and writing result tables."""

from __future__ import annotations

import argparse
import ast
import csv
import sys
from typing import TYPE_CHECKING

from ..images import BUNDLED_SETS, load_image_set

if TYPE_CHECKING:
    from pathlib import Path

    import torch

__all__ = ["FIGURE_FORMATS", "add_figure_arguments", "add_image_arguments", "add_model_arguments", "at_least",
           "build_models", "check_image_size", "checkpoints_by_model", "figure_path", "fraction", "images_from_args",
           "model_features", "parse_model_args", "weights_of", "write_csv"]

FIGURE_FORMATS = ("png", "svg", "pdf")


def at_least(minimum: int):
    """An argparse ``type``: a whole number of at least ``minimum``, so a 0 is refused while parsing, before any
    work or heavy import, with a message naming the bound."""
    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    whole_number.__name__ = f"whole number >= {minimum}"
    return whole_number


def fraction(text: str) -> float:
    """An argparse ``type``: a number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {value:g}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "--models", dest="models", nargs="+", required=True, metavar="NAME",
                        help="timm model names, e.g. vit_small_patch14_reg4_dinov2 alibi_vit_small_patch14_reg4_dinov2")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="[NAME=]PATH",
                        help="plain timm state_dict for model NAME, loaded strictly (repeatable; NAME= may be "
                             "omitted with one model)")
    parser.add_argument("--pretrained", action="store_true",
                        help="timm's pretrained weights (DINOv2's, from the hub or its cache) for models "
                             "without --checkpoint; without either a model is randomly initialised")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="architecture override passed to timm for every model, e.g. depth=2; a checkpoint "
                             "exported by 'alibi-vit export' brings its own, which these override")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")


def add_image_arguments(parser: argparse.ArgumentParser, default_size: int) -> None:
    from ..images import INTENSITY_MODES, PERCENTILES

    parser.add_argument("--images", required=True, metavar="DIR|FILE|SET|noise",
                        help=f"a folder of images (searched recursively), one image file, a bundled set "
                             f"({', '.join(BUNDLED_SETS)}) or 'noise'")
    parser.add_argument("--noise-count", type=at_least(1), default=8, help="number of images for --images noise")
    parser.add_argument("--size", type=at_least(1), default=default_size,
                        help="images are resized and centre-cropped to SIZE px (default %(default)s)")
    parser.add_argument("--intensity", choices=INTENSITY_MODES, default="auto",
                        help="how pixel values become [0, 1]: 'dtype' divides integers by their type's maximum "
                             "(255, 65535); 'minmax' maps the image's min/max to 0/1; 'percentile' maps its "
                             f"{PERCENTILES[0]:g}th/{PERCENTILES[1]:g}th percentiles to 0/1 and clips; 'auto' "
                             "(default): percentile for single-channel images, dtype for colour ones")


def add_figure_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--figure-format", choices=FIGURE_FORMATS, default="png",
                        help="file format of the plots: png (default), or svg/pdf (vector: sharp at any size, "
                             "editable in Inkscape or Illustrator)")
    parser.add_argument("--dpi", type=at_least(10), default=150,
                        help="resolution of png plots in dots per inch (default %(default)s; svg/pdf are vector)")


def figure_path(path, args) -> "Path":
    """``path`` with the suffix of ``--figure-format``."""
    from pathlib import Path

    return Path(path).with_suffix(f".{args.figure_format}")


def images_from_args(args) -> list[tuple[str, torch.Tensor]]:
    return load_image_set(args.images, args.size, noise_count=args.noise_count, seed=getattr(args, "seed", 0),
                          intensity=getattr(args, "intensity", "auto"))


def parse_model_args(items):
    """``--model-arg KEY=VALUE`` items as keyword arguments, values read as Python literals where they parse."""
    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"--model-arg expects KEY=VALUE with KEY a keyword argument name, got {item!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def checkpoints_by_model(items, models):
    """``--checkpoint [NAME=]PATH`` items as ``{model name: path}``; NAME may be left out with one model."""
    found = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep:
            if len(models) != 1:
                raise ValueError("with several models, write --checkpoint NAME=PATH")
            name, path = models[0], item
        if name not in models:
            raise ValueError(f"--checkpoint names {name!r}, which is not among --model {' '.join(models)}")
        found[name] = path
    return found


def weights_of(args) -> dict[str, str]:
    """Where each model's weights come from: its checkpoint path, 'pretrained' or 'random init'."""
    checkpoints = checkpoints_by_model(args.checkpoint, args.models)
    return {name: str(checkpoints[name]) if name in checkpoints else "pretrained" if args.pretrained else "random init"
            for name in args.models}


def check_image_size(size: int, model=None) -> None:
    """``size`` must be positive and, given a model, a multiple of its patch size: a clear error otherwise."""
    if size < 1:
        raise ValueError(f"--size must be a positive number of pixels, got {size}")
    if model is not None:
        ph, pw = model.patch_embed.patch_size
        if size % ph or size % pw:
            lower, upper = (size // ph) * ph, (size // ph + 1) * ph
            near = f"{lower} or {upper}" if lower else f"{upper}"
            raise ValueError(f"--size {size} is not a multiple of the patch size {ph} px; use e.g. {near}")


def build_models(args):
    """Yield (name, model in eval mode on args.device) one at a time, so only one is in memory.

    A model without --checkpoint or --pretrained is randomly initialised: a note says so.
    """
    import torch

    from ..models.checkpoint import check_model_name, create_backbone

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_kwargs = parse_model_args(args.model_arg)
    checkpoints = checkpoints_by_model(args.checkpoint, args.models)
    for name in args.models:  # every name checked before the first model is built
        check_model_name(name)
    for name in args.models:
        checkpoint = checkpoints.get(name)
        model = create_backbone(name, pretrained=args.pretrained and checkpoint is None, checkpoint=checkpoint,
                                **model_kwargs)
        if getattr(args, "size", None) is not None:  # None: native sizes, cropped to the patch size
            check_image_size(args.size, model)
        if checkpoint is None and not args.pretrained:
            print(f"note: {name} is randomly initialised (give --pretrained or --checkpoint for real features)",
                  file=sys.stderr)
        yield name, model.to(device).eval()


def model_features(model, images, batch_size, layers):
    """Patch features of a list of (3, H, W) images, computed in batches, as float32 on the CPU.

    Returns ``{"final": (B, C, h, w)}`` plus ``{layer: (B, C, h, w)}`` for each of ``layers``
    (block outputs through the final norm).
    """
    import torch
    from tqdm.auto import tqdm

    from ..features import patch_features

    device = next(model.parameters()).device
    out = {}
    with torch.no_grad():
        for start in tqdm(range(0, len(images), batch_size), desc="features", leave=False):
            batch = torch.stack(images[start:start + batch_size]).to(device)
            feats = patch_features(model, batch, layers=layers)
            # The last block's output through the final norm is the final feature map: no second forward.
            feats = {"final": feats} if layers is None else {**feats, "final": feats[layers[-1]]}
            for key, value in feats.items():
                out.setdefault(key, []).append(value.float().cpu())
    return {key: torch.cat(chunks) for key, chunks in out.items()}


def write_csv(path, rows):
    """``rows`` (dicts with the same keys) as a CSV file with a header."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
