"""``alibi-vit show``: feature maps (PCA, k-means, similarity) of several models side by side.

One PNG per image, one row per model; the panels are described in :mod:`alibi_vit.analysis.feature_maps`.
Heavy modules load inside :func:`run`, so ``alibi-vit show --help`` answers at once.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from .options import add_image_arguments, add_model_arguments, at_least, build_models, images_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_image_arguments(parser, default_size=448)
    parser.add_argument("--out", required=True, help="output folder for one PNG per image")
    parser.add_argument("--k", type=at_least(1), default=4, help="k-means clusters")
    parser.add_argument("--n-init", type=at_least(1), default=None,
                        help="k-means initialisations (default: 15, the paper's; alibi_vit.analysis.feature_maps.N_INIT)")
    parser.add_argument("--pca", choices=("joint", "per-image"), default="joint",
                        help="fit each model's PCA once on all images' patches, so colours mean the same in every "
                             "image (joint, default; paper Fig. S13), or on each image alone (per-image)")
    parser.add_argument("--query", nargs=2, type=int, default=None, metavar=("Y", "X"),
                        help="query pixel for the similarity map in the resized image (default: centre)")
    parser.add_argument("--tensorboard", default=None, metavar="DIR", help="also write the figures to TensorBoard")


def run(args) -> int:
    from ..files import check_folder_path

    check_folder_path(args.out)  # a file given as --out: "give a folder", before any model is built
    if args.query is not None and not all(0 <= q < args.size for q in args.query):  # before any slow import
        raise ValueError(f"--query {args.query[0]} {args.query[1]} is outside the {args.size}×{args.size} px image "
                         f"(--size {args.size}): give Y and X from 0 to {args.size - 1}")
    import numpy as np
    import torch
    from PIL import Image
    from tqdm.auto import tqdm

    from ..analysis.feature_maps import N_INIT, PCAColouring, feature_map_grid
    from ..features import patch_features
    from ..images import normalize
    from .options import check_image_size, weights_of

    check_image_size(args.size)
    images = images_from_args(args)
    weights = weights_of(args)
    # Row labels say when a model is randomly initialised: its maps show an untrained network.
    models = {name + (" (random init)" if weights[name] == "random init" else ""): model
              for name, model in build_models(args)}
    for name, model in models.items():  # what depends on the patch grid, before any feature is computed
        ph, pw = model.patch_embed.patch_size
        if args.k > (args.size // ph) * (args.size // pw):
            raise ValueError(f"--k {args.k} is more clusters than the {args.size // ph}×{args.size // pw} = "
                             f"{(args.size // ph) * (args.size // pw)} patches of {name} at --size {args.size}")
    pcas, features = None, [None] * len(images)
    if args.pca == "joint":  # every image's features first: one PCA per model over all of them
        pcas, features = {}, [{} for _ in images]
        for name, model in models.items():
            device = next(model.parameters()).device
            with torch.no_grad():
                feats = [patch_features(model, normalize(img)[None].to(device))[0].cpu() for _, img in images]
            pcas[name] = (PCAColouring(feats), PCAColouring(feats, standardise=True))
            for i, f in enumerate(feats):
                features[i][name] = f

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    writer = None
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)
    for (name, image), feats in tqdm(zip(images, features), total=len(images), desc="feature maps", unit="image"):
        grid = feature_map_grid(models, image, k=args.k, query=args.query, n_init=args.n_init or N_INIT,
                                pcas=pcas, features=feats)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        Image.fromarray((grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(out / f"{safe}.png")
        if writer is not None:
            writer.add_image(f"feature_maps/{safe}", grid, dataformats="CHW")
    if writer is not None:
        writer.close()
    print(f"wrote {len(images)} figure(s) to {out}")
    return 0
