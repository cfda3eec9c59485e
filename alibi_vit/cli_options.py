"""Options shared by the ``alibi-vit`` subcommands that run backbones on images (probe, show)."""

from __future__ import annotations

import argparse
import ast
import sys

import torch

from .images import BUNDLED_SETS, load_image_set

__all__ = ["add_image_arguments", "add_model_arguments", "build_models", "images_from_args"]


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
                        help="architecture override passed to timm for every model, e.g. depth=2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def add_image_arguments(parser: argparse.ArgumentParser, default_size: int) -> None:
    parser.add_argument("--images", required=True, metavar="DIR|SET|noise",
                        help=f"a folder of images, a bundled set ({', '.join(BUNDLED_SETS)}) or 'noise'")
    parser.add_argument("--noise-count", type=int, default=8, help="number of images for --images noise")
    parser.add_argument("--size", type=int, default=default_size,
                        help="images are resized and centre-cropped to SIZE px")


def images_from_args(args) -> list[tuple[str, torch.Tensor]]:
    return load_image_set(args.images, args.size, noise_count=args.noise_count, seed=getattr(args, "seed", 0))


def _model_kwargs(items):
    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--model-arg expects KEY=VALUE, got {item!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def _checkpoints(items, models):
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


def build_models(args):
    """Yield (name, model in eval mode on args.device) one at a time, so only one is in memory."""
    from .checkpoint import create_backbone

    model_kwargs = _model_kwargs(args.model_arg)
    checkpoints = _checkpoints(args.checkpoint, args.models)
    for name in args.models:
        checkpoint = checkpoints.get(name)
        if checkpoint is None and not args.pretrained:
            print(f"note: {name} is randomly initialised (give --pretrained or --checkpoint for real features)",
                  file=sys.stderr)
        model = create_backbone(name, pretrained=args.pretrained and checkpoint is None, checkpoint=checkpoint,
                                **model_kwargs)
        yield name, model.to(args.device).eval()
