"""``alibi-vit segment``: trainable segmentation of micrographs (docs/method.md §7).

    alibi-vit segment train --images DIR_OR_FILES --labels DIR_OR_FILES \
        [--backbone NAME --checkpoint PATH] --out MODEL_DIR
    alibi-vit segment apply --model MODEL_DIR --images DIR_OR_FILES --out DIR
    alibi-vit segment benchmark --dataset NAME [--protocol sparse dense authors] [--classifier ...] [--crf ...]
    alibi-vit segment benchmark (--synthetic | --train-images ... --train-masks ... --test-images ... --test-masks ...)

TIFFs above 16.8 megapixels and zarr/OME-Zarr stores are read lazily and segmented tile by tile,
their results written as OME-Zarr or tiled BigTIFF with pyramids (``--out-format``); training on
them reads only the tiles that hold labels.

Volumes (multi-page TIFF stacks, zarr/OME-Zarr with a z axis, and with ``--slice-folders``
folders of numbered slices) are segmented on 3D features (``--features 3d``, what ``auto`` picks
for them) block by block, with the voxel spacing from their metadata or ``--spacing Z,Y,X``, into
mask stacks or OME-Zarr and one CSV row per volume; ``--features 2d`` segments them slice by slice
with a model of 2D images, as before.

Label images hold 0 for unlabelled pixels and a value per class, usually 1..K (single-channel or
palette PNG/TIFF, the Weka/ilastik convention; JPEG is refused; multi-page TIFF stacks slice by slice); a label file pairs with the image of the same name, or of
the same name plus ``_labels``/``_label``/``_mask``/``_masks``/``_gt``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..files import check_folder_path
from .options import add_figure_arguments, at_least, checkpoints_by_model, parse_model_args
from .scheduler_options import add_scheduler_arguments

# The choices of the options, named here so that parsing them imports no torch; they are the
# library's (alibi_vit.trainable; tests/test_trainable_micrographs.py checks that they agree).
CLASSIFIERS, DEFAULT_CLASSIFIER = ("random_forest", "xgboost"), "random_forest"
FILTER_SETS, DEFAULT_FILTERS = ("compact", "weka"), "compact"
CRF_PRESETS, DEFAULT_CRF_PRESET = ("gentle", "paper", "library"), "gentle"
DATASETS = ("super", "ebc", "isb", "all")
PROTOCOLS = ("sparse", "dense", "authors")
ACTIONS = {
    "train": "train a pixel classifier from images and sparse label images",
    "apply": "segment images with a trained model; an unreadable image is skipped, named, and ends in exit status 1",
    "merge": "combine the shares of a run split with --shard into the folder's area_fractions.csv",
    "benchmark": "benchmarks: --dataset NAME scores configurations on the shipped labelled micrographs (mIoU, pixel "
                 "accuracy, spread over seeds); otherwise test mIoU per round of generated scribbles",
    "measure": "measure masks: phase fractions with confidence intervals, interfaces, S2(r), objects, percolation, "
               "chord lengths; local thickness and tortuosity on request (docs/measure.md)",
}
LABEL_SUFFIXES = ("", "_labels", "_label", "_mask", "_masks", "_gt", "-labels", "-mask")
FEATURE_MODES = ("auto", "2d", "3d")
OUT_FORMATS = ("auto", "png", "tif", "ome-zarr", "bigtiff")
STREAMED_FORMATS = ("ome-zarr", "bigtiff")
# Larger images (and zarr stores) are read lazily and segmented tile by tile; smaller ones are read whole.
WHOLE_PIXELS = 4096 * 4096
MIN_SYNTHETIC_SIZE = 64  # px: below it, the benchmark's generated images are warned about


def _add_backbone_arguments(p, several: bool):
    p.add_argument("--backbone", nargs="+" if several else None, default=[] if several else None, metavar="NAME",
                   help="timm backbone name(s) for ViT features, e.g. alibi_vit_small_patch14_reg4_dinov2 "
                        "(default: classical features only)")
    p.add_argument("--checkpoint", action="append", default=[], metavar="[NAME=]PATH",
                   help="plain timm state_dict for the backbone, loaded strictly" +
                        (" (repeatable; NAME= picks the backbone)" if several else ""))
    p.add_argument("--pretrained", action="store_true",
                   help="timm's pretrained weights for backbones without a checkpoint")
    p.add_argument("--allow-random-init", action="store_true",
                   help="let a backbone without --pretrained or --checkpoint run with random weights (drawn from "
                        "--seed; pipeline checks only: its features carry no meaning)")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="architecture override passed to timm, e.g. depth=2")
    p.add_argument("--device", default=None, help="where the backbone runs (default: cuda if available, else cpu)")


def _add_volume_arguments(p):
    p.add_argument("--spacing", type=_spacing, default=None, metavar="Z,Y,X",
                   help="voxel spacing of the volumes (any unit, e.g. 5,1,1 for slices five times thicker than their "
                        "pixels): the 3D filters' σ are scaled per axis; overrides the files' metadata (default: the "
                        "metadata, else the model's, else isotropic)")
    p.add_argument("--slice-folders", action="store_true",
                   help="each folder given to --images (and --labels) is one volume: its numbered image files "
                        "(TIFF, PNG, BMP) are the slices, in the order of the last number in their names")


def _spacing(text: str) -> tuple[float, float, float]:
    """``Z,Y,X`` → three positive floats (an argparse type: a bad value is a one-line error)."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three numbers Z,Y,X, got {text!r}") from None
    if len(values) != 3 or not all(np.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected three positive numbers Z,Y,X, got {text!r}")
    return values


def _add_common(p, several: bool = False):
    many = dict(nargs="+") if several else {}
    listed = (lambda v: [v]) if several else (lambda v: v)  # noqa: E731
    either = " (several: each is a configuration of --dataset)" if several else ""
    p.add_argument("--classifier", choices=CLASSIFIERS, default=listed(DEFAULT_CLASSIFIER), **many,
                   help=f"pixel classifier (default {DEFAULT_CLASSIFIER}; docs/segmentation.md gives the benchmark "
                        f"behind it){either}")
    p.add_argument("--filters", choices=FILTER_SETS, default=listed(DEFAULT_FILTERS), **many,
                   help=f"classical filter set: compact (default, 29 features) or weka (the paper's 63){either}")
    p.add_argument("--intensity", choices=("training", "auto", "percentile", "minmax", "dtype"),
                   default=listed("training"), **many,
                   help="how images are scaled to [0, 1]: training (default: black/white points fitted once on "
                        "the training images' pooled pixels, stored with the model, applied unchanged to every "
                        "image); or each image by itself: auto (0.5–99.5th percentiles for grayscale, dtype for "
                        "colour), percentile, minmax, dtype" + either)
    p.add_argument("--components", type=at_least(1), default=9, help="PCA components of the ViT features")
    p.add_argument("--trees", type=at_least(1), default=None,
                   help="number of trees (boosting rounds, or forest size) instead of the classifier's default")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the classifier, of the pixel sample it trains on and of random backbone weights")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    t = sub.add_parser("train", help=ACTIONS["train"], description=ACTIONS["train"])
    t.add_argument("--images", nargs="+", required=True, metavar="DIR_OR_FILE",
                   help="training images: folders (their PNG/TIFF/JPEG/BMP files) and/or files; multi-page TIFFs "
                        "are stacks")
    t.add_argument("--labels", nargs="+", required=True, metavar="DIR_OR_FILE",
                   help="label images: 0 = unlabelled, 1..K = classes, paired with the images by file name")
    _add_backbone_arguments(t, several=False)
    _add_common(t)
    t.add_argument("--features", default="auto", metavar="{auto,2d,3d}",
                   help="auto (default): volumes (multi-page TIFFs, zarr with a z axis, --slice-folders) on 3D "
                        "features, 2D images on 2D features; 3d: require volumes; 2d: volumes slice by slice with "
                        "2D features (the behaviour before volumes had 3D features)")
    t.add_argument("--feature-fn", default=None, metavar="MODULE:FUNCTION",
                   help="user feature hook for 2D images: a function taking the scaled image ((H, W) or (H, W, 3) "
                        "floats in [0, 1]) and returning (H, W, F) features; stored by import path, never pickled "
                        "(formerly --features MODULE:FUNCTION)")
    _add_volume_arguments(t)
    t.add_argument("--modal", type=at_least(0), default=0, metavar="N",
                   help="majority (modal) filter of odd window N px on the masks (default 0: none)")
    t.add_argument("--colour", choices=("channels", "grey"), default="channels",
                   help="colour images: featurised per channel (default; the model then takes colour images only) "
                        "or converted to grey (luma)")
    t.add_argument("--crf", nargs="?", const=DEFAULT_CRF_PRESET, choices=CRF_PRESETS, default=None,
                   help="refine predictions with a dense CRF when applying: preset gentle (chosen on the labelled "
                        "micrographs, keeps thin phases; the default of a bare --crf), paper (the paper notebook's "
                        "sxy values) or library (the authors' backend's defaults)")
    t.add_argument("--out", type=Path, required=True, metavar="MODEL_DIR",
                   help="folder to write the model to (config.json, classifier.json; what apply --model reads)")
    a = sub.add_parser("apply", help=ACTIONS["apply"], description=ACTIONS["apply"])
    a.add_argument("--model", type=Path, required=True, metavar="MODEL_DIR",
                   help="a model folder written by 'segment train' or the app's Save")
    a.add_argument("--images", nargs="+", required=True, metavar="DIR_OR_FILE",
                   help="images to segment: folders and/or files (several folders may hold the same names)")
    a.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="output folder: <name>_mask.png, <name>_overlay.png, area_fractions.csv, colour_key.png, "
                        "segment_run.json (one model per folder; a second run of the same model adds to it)")
    a.add_argument("--recursive", action="store_true",
                   help="also segment images in subfolders of the --images folders; outputs mirror the subfolders")
    a.add_argument("--out-format", choices=OUT_FORMATS, default="auto",
                   help="auto (default): PNG masks and overlays for images read whole, and images larger than "
                        f"{WHOLE_PIXELS // 2**20} megapixels or stored as zarr streamed tile by tile into OME-Zarr "
                        "(zarr inputs) or tiled BigTIFF (TIFF inputs); png or tif: masks as one file (images read "
                        "whole); ome-zarr or bigtiff: every image streamed, outputs with a multiscale pyramid")
    a.add_argument("--format", dest="out_format", choices=("png", "tif"), default=argparse.SUPPRESS,
                   help="the same as --out-format png|tif")
    a.add_argument("--no-overlay", action="store_true", help="write only the masks, no overlay PNGs")
    a.add_argument("--proba", action="store_true",
                   help="also write per-class probability TIFFs (<name>_proba_<class>.tif, float32)")
    a.add_argument("--measure", action="store_true",
                   help="then measure the masks in OUT with 'segment measure' (its default metrics, and the "
                        "probability view with --proba) into OUT/measure/ (docs/measure.md)")
    a.add_argument("--crf", choices=("model", "on", "off") + CRF_PRESETS, default="model",
                   help=f"dense-CRF clean-up: as the model was trained (default), on (preset {DEFAULT_CRF_PRESET}), "
                        f"off, or a preset ({', '.join(CRF_PRESETS)})")
    a.add_argument("--modal", type=at_least(0), default=None, metavar="N",
                   help="majority filter of odd window N px (0: none; default: as the model was trained)")
    a.add_argument("--device", default=None, help="where a ViT backbone runs (default: cuda if available, else cpu)")
    a.add_argument("--features", choices=FEATURE_MODES, default="auto",
                   help="auto (default): as the model was trained; 2d: a model of 2D images segments volumes slice "
                        "by slice (without it, giving it a volume is an error); 3d: require a volume model")
    _add_volume_arguments(a)
    _add_scale_out_arguments(a)
    m = sub.add_parser("merge", help=ACTIONS["merge"], description=ACTIONS["merge"])
    m.add_argument("out", type=Path, metavar="OUT",
                   help="the --out folder the shares wrote (segment_run.shard-I-of-N.json, area_fractions.shard-I-of-N.csv)")
    b = sub.add_parser("benchmark", help=ACTIONS["benchmark"], description=ACTIONS["benchmark"])
    for name, what in (("train-images", "training images"), ("train-masks", "their complete ground-truth masks"),
                       ("test-images", "test images"), ("test-masks", "their ground-truth masks")):
        b.add_argument(f"--{name}", nargs="+", metavar="DIR_OR_FILE",
                       help=f"{what}: folders and/or files, paired by name (without --synthetic)")
    b.add_argument("--synthetic", action="store_true",
                   help="use generated 3-phase micrographs (offline; not the paper's data)")
    b.add_argument("--composition-shift", action="store_true",
                   help="generated data whose test images lack the brightest of three phases, run once per "
                        "intensity mode (training, percentile, minmax, dtype; --intensity is not used)")
    b.add_argument("--synthetic-size", type=at_least(1), default=256,
                   help=f"side of the generated square images in px (default %(default)s; under {MIN_SYNTHETIC_SIZE} "
                        "is warned about)")
    b.add_argument("--synthetic-count", type=at_least(1), nargs=2, default=(5, 5), metavar=("TRAIN", "TEST"),
                   help="number of generated training and test images (default 5 5)")
    b.add_argument("--dataset", choices=DATASETS, default=None,
                   help="the labelled micrographs shipped with alibi-vit: super (Ni-superalloy SEM), ebc (barrier "
                        "coatings), isb (the interactive-seg-backend authors' test images), all. Per image and seed: "
                        "label by each --protocol, train on that image, segment it, score it; writes runs.csv, "
                        "summary.csv and summary.md")
    b.add_argument("--split", choices=("train", "test", "all"), default="all",
                   help="with --dataset: the images the defaults were chosen on (train), the others (test), or all")
    b.add_argument("--images", nargs="+", default=None, metavar="NAME", help="with --dataset: only these images")
    b.add_argument("--protocol", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS),
                   help="with --dataset: sparse (seeded strokes from the ground truth), dense (every pixel), authors "
                        "(the ISB authors' scribbles, where an image has them); default all three")
    b.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="with --dataset: seeds (default 0 1 2)")
    b.add_argument("--dense-seeds", type=int, nargs="+", default=None,
                   help="with --dataset: seeds of the dense protocol (default --seeds; only the classifier's "
                        "randomness varies there)")
    b.add_argument("--crf", nargs="+", choices=("off",) + CRF_PRESETS, default=None,
                   help="with --dataset: CRF settings to compare (default: the segmenter's default)")
    b.add_argument("--crop", type=int, default=None, metavar="PX",
                   help="with --dataset: score the central PX×PX of each image only (quick runs)")
    _add_backbone_arguments(b, several=True)
    _add_common(b, several=True)
    b.add_argument("--rounds", type=at_least(1), default=5,
                   help="scribble rounds: each adds --per-class scribbles per class per image and retrains (default 5)")
    b.add_argument("--per-class", type=at_least(1), default=1, help="scribbles per class per training image per round")
    b.add_argument("--out", type=Path, default=Path("segment_benchmark"), metavar="DIR",
                   help="output folder: benchmark.csv, miou_vs_round and examples figures (default %(default)s)")
    add_figure_arguments(b)
    from . import segment_measure  # its own module: measuring shares nothing with training

    segment_measure.add_arguments(sub.add_parser("measure", help=ACTIONS["measure"], description=ACTIONS["measure"]))


def _add_scale_out_arguments(a) -> None:
    """apply's options for running beyond one process: Dask schedulers, SLURM, shares and resuming."""
    g = a.add_argument_group("scale-out", "segmenting thousands of images or mosaics larger than a node: a Dask "
                                          "cluster, SLURM worker jobs, or a SLURM job array (--shard)")
    add_scheduler_arguments(g)
    g.add_argument("--shard", default=None, metavar="I/N",
                   help="segment only share I (0..N-1) of the inputs, every N-th image from the I-th (default in a "
                        "SLURM job array: from SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT); then 'segment merge OUT'")
    g.add_argument("--resume", action="store_true",
                   help="keep the outputs of an earlier run whose manifest names this model, these settings and "
                        "the same input (SHA-256), and segment the rest")


def _stems(path: Path) -> list[str]:
    """The names a label file may be named after: the file name without its last suffix, and without
    its image suffixes (``a.ome.zarr`` → ``a.ome``, ``a``: the app exports ``a_labels.zarr``)."""
    from ..trainable.output_folder import image_stem

    return list(dict.fromkeys([path.stem, image_stem(path)]))


def _pair(images, labels, what="labels"):
    """Pair image files with label files by name (see the module docstring)."""
    by_stem = {p.stem: p for p in labels}
    pairs, missing = [], []
    for img in images:
        match = next((by_stem[stem + s] for stem in _stems(img) for s in LABEL_SUFFIXES if stem + s in by_stem),
                     None)
        (pairs.append((img, match)) if match is not None else missing.append(img.name))
    if missing:
        raise ValueError(f"no {what} file for image(s) {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''} "
                         f"(expected the same name, optionally + {'/'.join(s for s in LABEL_SUFFIXES if s)})")
    return pairs


def _image_label_pairs(image_sources, label_sources, what="labels"):
    """(image, label file) pairs from the given folders/files; the two may be the same folder.

    A file given as both is a label when its name is another image file's name plus a label suffix
    (``m0.tif`` and ``m0_labels.png`` side by side), else an image.
    """
    from ..trainable.io import list_image_files

    label_files = list_image_files(label_sources)
    image_files = list_image_files(image_sources)
    shared = set(image_files) & set(label_files)
    stems = {stem for p in image_files for stem in _stems(p)}
    suffixes = [s for s in LABEL_SUFFIXES if s]

    def is_label(p):
        return any(p.stem.endswith(s) and p.stem[:-len(s)] in stems for s in suffixes)

    images = [p for p in image_files if not (p in shared and is_label(p))]
    labels = [p for p in label_files if p not in shared or is_label(p)]
    paired_stems = {stem + s for p in images for stem in _stems(p) for s in LABEL_SUFFIXES}
    orphans = [p.name for p in labels if p.stem not in paired_stems]
    if orphans:
        warnings.warn(f"{len(orphans)} {what} file(s) match no image and are not used: "
                      f"{', '.join(orphans[:5])}{' …' if len(orphans) > 5 else ''}")
    if not images or not labels:
        found = ", ".join(p.name for p in image_files[:5]) + (" …" if len(image_files) > 5 else "")
        raise ValueError(f"found no {'images' if not images else what} to pair among {len(image_files)} file(s) "
                         f"({found}): with images and {what} in one folder, name each {what[:-1]} file after its "
                         f"image plus {'/'.join(suffixes)} (m0.tif + m0{suffixes[0]}.png)")
    return _pair(images, labels, what)


def _check_backbone_weights(args, names):
    """Backbones need --pretrained, a checkpoint or --allow-random-init: random features must be asked for.
    An unknown name is said first (a misspelt name has no weights either, but that is not the problem)."""
    if names:
        from ..models.checkpoint import check_model_name

        for name in names:
            check_model_name(name)
    checkpoints = checkpoints_by_model(args.checkpoint, names) if args.checkpoint else {}
    random = [n for n in names if n not in checkpoints and not args.pretrained]
    if random and not args.allow_random_init:
        raise ValueError(f"--backbone {' '.join(random)} has no weights: give --pretrained (timm's weights), "
                         "--checkpoint PATH, or --allow-random-init for random weights (pipeline checks only)")
    for name in random:
        print(f"note: {name} is randomly initialised from --seed {args.seed} (features carry no meaning)",
              file=sys.stderr)
    return checkpoints


def _classifier_params(args):
    if args.trees is not None and args.trees < 1:
        raise ValueError(f"--trees must be at least 1, got {args.trees}")
    return {} if args.trees is None else {"n_estimators": args.trees}


def _feature_modes(args) -> str:
    """The --features mode; a MODULE:FUNCTION value is the user hook's former spelling (--feature-fn)."""
    if args.features not in FEATURE_MODES:
        if ":" not in args.features:
            raise ValueError(f"--features must be one of {', '.join(FEATURE_MODES)}, got {args.features!r}")
        if args.feature_fn is not None:
            raise ValueError("give the feature hook once: --feature-fn MODULE:FUNCTION")
        print(f"note: --features {args.features} is read as --feature-fn {args.features} (its name now)",
              file=sys.stderr)
        args.feature_fn, args.features = args.features, "auto"
    return args.features


def _is_volume_input(path: Path, slice_folders: bool) -> bool:
    """Whether an --images entry is a volume: a slice folder (with --slice-folders), or a TIFF or zarr
    whose planes lie along z (metadata only is read)."""
    from ..chunked import TIFF_SUFFIXES, is_zarr_path, open_image

    if path.is_dir() and not is_zarr_path(path):
        return slice_folders
    if is_zarr_path(path) or path.suffix.lower() in TIFF_SUFFIXES:
        return open_image(path).is_volume
    return False


def _volume_pairs(args):
    """(volume, labels) pairs with --slice-folders: every --images entry is one volume (a folder of
    slices, or a stack file); --labels entries (folders or files) pair with them by name."""
    images, labels = [Path(p) for p in args.images], [Path(p) for p in args.labels]
    for p in images + labels:
        if not p.exists():
            raise FileNotFoundError(f"{p} is neither an image file nor a folder")
    return _pair(images, labels)


def _train(args) -> int:
    from ..images import read_array
    from ..trainable import read_labels
    from ..trainable.io import as_label_image

    if args.backbone is None and args.checkpoint:
        raise ValueError("--checkpoint needs --backbone NAME")
    features = _feature_modes(args)
    backbone = backbone_kwargs(args)  # the weights checked before any image is read
    pairs = _volume_pairs(args) if args.slice_folders else _image_label_pairs(args.images, args.labels)
    check_folder_path(args.out)
    volumes = [_is_volume_input(img, args.slice_folders) for img, _ in pairs]
    if features == "auto" and any(volumes) and not all(volumes):
        flat = next(img for (img, _), v in zip(pairs, volumes) if not v)
        raise ValueError(f"the training set mixes volumes and 2D images ({flat.name} is 2D): train volumes and 2D "
                         "images separately, or segment the volumes slice by slice with --features 2d")
    if features == "3d" or (features == "auto" and any(volumes)):
        if not all(volumes):
            flat = next(img for (img, _), v in zip(pairs, volumes) if not v)
            raise ValueError(f"--features 3d trains on volumes, but {flat} is a 2D image")
        return _train_volumes(args, pairs, backbone)
    if args.spacing is not None:
        raise ValueError("--spacing is for volumes on 3D features; these images are trained on 2D features")
    images, labels = [], []
    for img, lab in tqdm(pairs, desc="read", disable=len(pairs) < 2):
        view = _image_format(img, "auto")[1]
        if view is not None:  # read lazily: only the tiles that hold labels are read
            images.append(view)
            labels.append(_lazy_labels(lab))
            continue
        stack, label_stack = _slices(img), _slices(lab)
        if stack is None and label_stack is None:
            images.append(read_array(img))  # as stored: the segmenter scales them (and fits the range)
            labels.append(read_labels(lab, images[-1].shape[:2]))
            continue
        if stack is None or label_stack is None or len(stack) != len(label_stack):
            what = lambda s: "a single image" if s is None else f"a stack of {len(s)} slices"  # noqa: E731
            raise ValueError(f"labels {lab} is {what(label_stack)} but image {img} is {what(stack)}: give one label "
                             "slice per image slice (all 0 for slices without labels)")
        for z, (image, label) in enumerate(zip(stack, label_stack)):  # slice by slice
            images.append(image)
            labels.append(as_label_image(label, image.shape[:2], source=f"labels {lab} slice {z}"))
    seg = segmenter_from_args(args, False, backbone, progress=True)
    seg.fit(images, labels)
    seg.save(args.out)
    if seg.intensity_note:
        print(f"note: {seg.intensity_note}", file=sys.stderr)
    counts = seg.label_counts_
    print(f"trained on {len(images)} image(s), {sum(counts.values())} labelled pixels in classes "
          + ", ".join(f"{c}: {n}" for c, n in counts.items()) + f"; model written to {args.out}")
    return 0


def _slices(path: Path):
    """The slices of a stack (a multi-page TIFF, or a folder of numbered slices), or None for one image."""
    from ..trainable.batch import read_stack

    return read_stack(path)


def backbone_kwargs(args) -> dict:
    """The segmenter's backbone arguments from ``segment train``'s options (checkpoint, model arguments,
    pretrained), its weights checked; empty without ``--backbone``."""
    if args.backbone is None:
        return {}
    checkpoints = _check_backbone_weights(args, [args.backbone])
    return dict(checkpoint=checkpoints.get(args.backbone), model_kwargs=parse_model_args(args.model_arg),
                pretrained=args.pretrained and args.backbone not in checkpoints)


def segmenter_from_args(args, volume: bool, backbone: dict, **runtime):
    """The segmenter ``segment train`` trains from its parsed options: a VolumeSegmenter on 3D features for
    volumes, else a TrainableSegmenter; ``backbone``: :func:`backbone_kwargs`; ``runtime``: arguments that
    change no result (progress, cache) or where it runs (device)."""
    from ..trainable import TrainableSegmenter, VolumeSegmenter

    common = dict(n_components=args.components, classifier_params=_classifier_params(args), intensity=args.intensity,
                  device=args.device, seed=args.seed, feature_fn=args.feature_fn, modal=args.modal, **backbone)
    common.update(runtime)
    if volume:
        return VolumeSegmenter(args.backbone, args.classifier, spacing=args.spacing, **common)
    return TrainableSegmenter(args.backbone, args.classifier, args.crf or False, filters=args.filters,
                              colour=args.colour, **common)


def _train_volumes(args, pairs, backbone) -> int:
    """segment train on volumes: a VolumeSegmenter on 3D features, the volumes and labels read lazily."""
    from ..chunked import open_volume

    if args.crf:
        raise ValueError("--crf (the dense CRF) is for 2D images; for volumes use --modal N (a 3D majority filter)")
    if args.filters != DEFAULT_FILTERS:
        print(f"note: --filters {args.filters} is a 2D filter set; volumes take the 3D filter bank", file=sys.stderr)
    images = [open_volume(img) for img, _ in tqdm(pairs, desc="open", disable=len(pairs) < 2)]
    labels = [open_volume(lab) for _, lab in pairs]
    seg = segmenter_from_args(args, True, backbone, progress=True)
    seg.fit(images, labels)
    seg.save(args.out)
    if seg.intensity_note:
        print(f"note: {seg.intensity_note}", file=sys.stderr)
    counts = seg.label_counts_
    spacings = ", ".join(f"{im.name}: {','.join(f'{v:g}' for v in seg.spacing_of(im))}" for im in images)
    print(f"trained on {len(images)} volume(s) (voxel spacing z,y,x {spacings}), {sum(counts.values())} labelled "
          "voxels in classes " + ", ".join(f"{c}: {n}" for c, n in counts.items()) + f"; model written to {args.out}")
    return 0


def _lazy_labels(path: Path):
    """A label image for a lazily read image: a chunked view of a TIFF or zarr, else read whole."""
    from ..chunked import TIFF_SUFFIXES, is_zarr_path, open_image
    from ..trainable import read_labels

    if is_zarr_path(path) or path.suffix.lower() in TIFF_SUFFIXES:
        return open_image(path)
    return read_labels(path)


def _image_format(path: Path, out_format: str):
    """(format of its outputs, its chunked view or None) of one input, reading metadata only: images
    read lazily (zarr stores, single-plane TIFFs above ``WHOLE_PIXELS``, any TIFF with a streamed
    ``out_format``) are segmented tile by tile; a PNG with a streamed format streams in one piece."""
    from ..chunked import TIFF_SUFFIXES, is_zarr_path, open_image

    zarr = is_zarr_path(path)
    image = open_image(path) if zarr or path.suffix.lower() in TIFF_SUFFIXES else None
    if image is not None and image.planes > 1 and not zarr:
        return "tif", None  # a TIFF stack of slices: read whole, slice by slice, written back as a TIFF stack
    big = image is not None and (zarr or image.shape[0] * image.shape[1] > WHOLE_PIXELS)
    if big and out_format in ("png", "tif"):
        raise ValueError(f"{path} is {image.shape[0]}×{image.shape[1]} px{' (zarr)' if zarr else ''}: "
                         f"it is segmented tile by tile, which --out-format {out_format} cannot write; use "
                         "--out-format auto, ome-zarr or bigtiff")
    if out_format in STREAMED_FORMATS:
        return out_format, image
    if big:
        return ("ome-zarr" if zarr else "bigtiff"), image
    return ("tif" if out_format == "tif" else "png"), None


def _apply_inputs(args):
    """Every input image and its output names (:func:`~alibi_vit.trainable.output_folder.output_names`)."""
    from ..trainable.io import list_image_files
    from ..trainable.output_folder import output_names, written_outputs

    files, sources, relative = [], [], []
    seen = {}  # resolved path → as first given: an image reached again (a link, a folder given twice) is segmented once
    ours = written_outputs(args.out)  # --out inside (or equal to) --images: earlier masks are not inputs
    skipped = []
    for src in args.images:
        for f in [Path(src)] if args.slice_folders else list_image_files([src], recursive=args.recursive):
            if not f.exists():
                raise FileNotFoundError(f"{f} is neither an image file nor a folder")
            if _earlier_output(f, args.out, ours) and Path(src).resolve() != f.resolve():  # (named itself: an input)
                skipped.append(f.name)
                continue
            if f.resolve() in seen:
                warnings.warn(f"{f} is the same file as {seen[f.resolve()]}: segmented once")
                continue
            seen[f.resolve()] = f
            files.append(f)
            sources.append(Path(src))
            relative.append(f.relative_to(src) if Path(src).is_dir() and f != Path(src) else Path(f.name))
    if skipped:
        print(f"note: {len(skipped)} file(s) in --out {args.out} are outputs of an earlier run, not inputs: "
              f"{', '.join(skipped[:3])}{' …' if len(skipped) > 3 else ''}", file=sys.stderr)
    if not files:
        raise ValueError(f"--images {' '.join(args.images)} holds no images besides the outputs in --out {args.out}")
    names, notes = output_names(files, sources, relative)  # over every input, so each share names alike
    for note in notes:
        warnings.warn(note)
    return files, names


def _earlier_output(path: Path, out: Path, written: set) -> bool:
    """Whether ``path`` is something segment runs wrote in ``out``: a recorded output, or a file in one of its
    hidden folders (the staging folder a killed run left, the image manifests)."""
    real = path.resolve()
    if real in written:
        return True
    try:
        inside = real.relative_to(Path(out).resolve())
    except ValueError:
        return False
    return any(part.startswith(".segment") or part == ".manifests" for part in inside.parts[:-1])


def _check_channels_once(seg, files, kinds) -> None:
    """A colour model given grayscale images (or the reverse) fails before any work: the first
    readable image is read for that (twice in all), so the error is one clean line."""
    from ..images import read_array

    for path in files:
        kind = kinds[path]
        if isinstance(kind, Exception):
            continue
        try:
            first = kind[1] if kind[1] is not None else (_slices(path) or [read_array(path)])[0]
        except (OSError, ValueError):
            continue  # reported when its turn comes
        if getattr(first, "planes", 1) > 1:
            continue
        seg.check_channels(first, str(path))
        return


def _apply(args) -> int:
    from contextlib import ExitStack
    from functools import partial

    from ..images import ImageReadError
    from ..trainable import TrainableSegmenter
    from ..trainable.batch import ImageJob, ModelPackage, chunked_units, run_jobs
    from ..trainable.io import write_colour_key, write_fractions_csv
    from ..trainable.output_folder import OutputFolder, model_digest
    from ..trainable.scheduler import parse_scheduler, parse_shard, shard_from_environment
    from .scheduler_options import open_scheduler

    scheduler = parse_scheduler(args.scheduler)
    shard = parse_shard(args.shard) if args.shard is not None else shard_from_environment()
    if args.modal is not None and args.modal % 2 == 0 and args.modal:
        raise ValueError(f"--modal must be 0 or an odd window size, got {args.modal}")
    files, names = _apply_inputs(args)
    check_folder_path(args.out)
    if shard is not None:
        index, count = shard
        files, names = files[index::count], names[index::count]
        print(f"share {index}/{count}: {len(files)} image(s)", file=sys.stderr)
    seg = TrainableSegmenter.load(args.model, device=args.device)
    volumes = _check_dimensions(args, seg, files)  # a volume model's inputs: their views (or why they can't open)
    kinds = {}  # image → (format of its outputs, its chunked view or None), or why it cannot be read
    for path in files:
        try:
            kinds[path] = ((volumes[path] if isinstance(volumes[path], Exception) else
                            (_volume_format(path, args.out_format), volumes[path])) if seg.dims == 3
                           else _image_format(path, args.out_format))
        except ImageReadError as err:  # reported as skipped below
            kinds[path] = err
    if args.modal is not None:
        seg.modal = args.modal
    if args.crf != "model":
        seg.crf = {"on": DEFAULT_CRF_PRESET, "off": False}.get(args.crf, args.crf)
    if seg.dims == 2:
        _check_channels_once(seg, files, kinds)
    k = int(seg.classes_.max())
    digest = model_digest(args.model)
    settings = {"model": str(Path(args.model).resolve()), "model_digest": digest, "crf": seg.crf or "off",
                "modal": seg.modal, "format": args.out_format, "proba": args.proba, "overlay": not args.no_overlay,
                "classes": [int(c) for c in seg.classes_],
                **({"spacing": list(args.spacing) if args.spacing else None} if seg.dims == 3 else {})}
    unreadable = [(p, kinds[p]) for p in files if isinstance(kinds[p], Exception)]
    spacings = _voxel_spacings(args, seg, files, names, kinds) if seg.dims == 3 else {}
    with ExitStack() as scale_out:  # the scheduler stays open for --measure, after the folder is final
        with OutputFolder(args.out, settings, partial(write_fractions_csv, classes=seg.classes_), shard=shard) as folder:
            folder.notes = {row: {"voxel_spacing": list(spacing)} for row, spacing in spacings.items()}
            jobs = []
            for path, name in zip(files, names):
                if isinstance(kinds[path], Exception):
                    continue
                fmt, view = kinds[path]
                earlier = folder.finished(name.row) if args.resume else None
                jobs.append(ImageJob(str(path), name.row, name.stem,
                                     str(folder.stage(name.row, args.out / name.folder)), fmt, args.proba,
                                     not args.no_overlay, chunked=view is not None and seg.dims == 2,
                                     units=chunked_units(view.shape, seg) if view is not None and seg.dims == 2 else 1,
                                     resume_sha256=earlier.get("input_sha256") if earlier else None,
                                     volume=seg.dims == 3))
            for path, err in unreadable:
                warnings.warn(f"skipped {path}: {err}")
            executor = scale_out.enter_context(open_scheduler(args))
            if executor.dashboard:
                print(f"Dask dashboard: {executor.dashboard}", file=sys.stderr)
            model = seg if scheduler.kind == "threads" else executor.broadcast(
                ModelPackage.from_folder(args.model, digest, seg.crf, seg.modal, args.device,
                                          spacing=args.spacing if seg.dims == 3 else None))
            outcome = run_jobs(executor, model, jobs, folder)
        part = args.out / ".colour_key.part.png"  # complete or absent: shares write it at the same time
        try:
            os.replace(write_colour_key(part, seg.classes_, k), args.out / "colour_key.png")
        except OSError as err:
            part.unlink(missing_ok=True)
            raise OSError(err.errno, err.strerror or str(err), str(args.out / "colour_key.png")) from err
        failed = sorted([p.name for p, _ in unreadable] + [name for name, _ in outcome.failed])  # not in completion order
        kept = f"; {outcome.kept} kept from an earlier run (--resume)" if args.resume else ""
        print(f"segmented {outcome.written} of {len(files)} image(s) into {args.out}{kept} "
              f"(area fractions per class in {folder.csv_path})")
        if args.measure:
            from . import segment_measure

            segment_measure.measure_folder(args.out, spacing=args.spacing if seg.dims == 3 else None,
                                           executor=None if scheduler.kind == "threads" else executor)
    if failed:
        print(f"alibi-vit segment: error: {len(failed)} image(s) could not be segmented: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0


def _check_dimensions(args, seg, files) -> dict:
    """A clear error when a model of 2D images is given volumes without --features 2d, or a volume
    model 2D images (or settings only one kind takes); a volume model's inputs opened as volumes."""
    from ..chunked import is_zarr_path, open_volume
    from ..images import ImageReadError

    kinds = {}
    for path in files:
        try:
            kinds[path] = _is_volume_input(path, args.slice_folders)
        except ImageReadError:
            kinds[path] = None  # unreadable: skipped and reported with the others
    if seg.dims == 2:
        if args.features == "3d":
            raise ValueError(f"--features 3d needs a volume model; {args.model} was trained on 2D images")
        if args.spacing is not None:
            raise ValueError(f"--spacing is for volume models; {args.model} was trained on 2D images")
        volumes = [p for p in files if kinds[p]]
        if volumes and args.features != "2d":
            raise ValueError(f"{volumes[0]} is a volume but the model {args.model} was trained on 2D images: segment "
                             "it slice by slice with --features 2d, or train a volume model (segment train on volumes)")
        stores = [p for p in volumes if is_zarr_path(p)]
        if stores:  # (read tile by tile, one plane per image)
            raise ValueError(f"{stores[0]} is a zarr volume: --features 2d segments TIFF stacks and slice folders slice "
                             "by slice, not zarr stores; segment it with a volume model (segment train on volumes)")
        return {}
    if args.features == "2d":
        raise ValueError(f"--features 2d segments volumes slice by slice with a model of 2D images; {args.model} is a "
                         "volume model (3D features)")
    flat = [p for p in files if kinds[p] is False]
    if flat:
        raise ValueError(f"{flat[0]} is {_not_a_volume(flat[0])} but the model {args.model} segments volumes (3D "
                         "features): give volumes, or a model trained on 2D images")
    if args.out_format == "png":
        raise ValueError("--out-format png cannot hold a volume: use tif (a mask stack), bigtiff or ome-zarr")
    if args.crf not in ("model", "off"):
        raise ValueError("--crf (the dense CRF) is for 2D images; volumes take --modal N")
    if args.spacing is not None:
        seg.spacing = args.spacing
    views = {}
    for path in files:
        try:
            views[path] = open_volume(path)
        except ImageReadError as err:
            views[path] = err
    return views


def _not_a_volume(path: Path) -> str:
    """What an input that is not a volume is, for the message that refuses it; a TIFF whose pages differ
    in size or dtype (which reads as its first page alone) is an error naming the first that differs."""
    from ..chunked import TIFF_SUFFIXES, check_tiff_pages, is_zarr_path, open_image

    if path.is_file() and path.suffix.lower() in TIFF_SUFFIXES:
        import tifffile

        with tifffile.TiffFile(path) as tif:
            if not tif.is_ome:
                check_tiff_pages(tif, str(path))
    if not (is_zarr_path(path) or path.suffix.lower() in TIFF_SUFFIXES):
        return "a 2D image"
    image = open_image(path)
    if image.planes > 1:
        return f"{image.planes} planes along {image.plane_axes} (axes {image.axes}), not z slices,"
    if image.channels > 1:
        kind = {3: "RGB", 4: "RGBA"}.get(image.channels, f"{image.channels}-channel")
        return f"one 2D {kind} image ({image.channels} samples per pixel, axes {image.axes}), not a grey volume,"
    return "a 2D image"


def _voxel_spacings(args, seg, files, names, kinds) -> dict:
    """Each volume's voxel spacing (z, y, x) as its 3D features will use it, by CSV row; said on stderr, one line
    per spacing and where it comes from (the run manifest records each volume's)."""
    spacings, groups = {}, {}
    for path, name in zip(files, names):
        if isinstance(kinds[path], Exception):
            continue
        view = kinds[path][1]
        spacing = tuple(float(v) for v in seg.spacing_of(view))
        origin = ("--spacing" if args.spacing is not None else "the file's metadata" if view.spacing is not None
                  else "the model's" if seg.default_spacing is not None else "isotropic: none in the file or model")
        spacings[name.row] = spacing
        groups.setdefault((spacing, origin), []).append(name.row)
    for (spacing, origin), rows in groups.items():
        print(f"voxel spacing z,y,x {','.join(f'{v:g}' for v in spacing)} ({origin}): {', '.join(rows[:5])}"
              f"{f' and {len(rows) - 5} more' if len(rows) > 5 else ''}", file=sys.stderr)
    return spacings


def _volume_format(path: Path, out_format: str) -> str:
    """The format of a volume's outputs: a TIFF stack like its input (auto, tif), OME-Zarr for a zarr
    input (auto) or when asked, an OME-TIFF stack (bigtiff)."""
    from ..chunked import is_zarr_path

    if out_format in ("auto", "tif"):
        return "ome-zarr" if is_zarr_path(path) and out_format == "auto" else "tif"
    return out_format


def _merge(args) -> int:
    from functools import partial

    from ..trainable.io import write_fractions_csv
    from ..trainable.output_folder import CSV_NAME, merge_shards

    shares, images = merge_shards(args.out, lambda classes: partial(write_fractions_csv, classes=classes))
    print(f"merged {shares} shares: {images} image(s); area fractions per class in {args.out / CSV_NAME}")
    return 0


def _read_set(image_sources, mask_sources, what):
    from ..trainable.io import read_array, read_labels

    if not image_sources or not mask_sources:
        raise ValueError(f"--{what}-images and --{what}-masks are required without --synthetic")
    pairs = _image_label_pairs(image_sources, mask_sources, what="masks")
    return [read_array(i) for i, _ in pairs], [read_labels(m) for _, m in pairs], [i.stem for i, _ in pairs]


def _benchmark(args) -> int:
    from ..synthetic import synthetic_dataset
    from ..trainable.benchmark import compare_intensity, composition_shift_data, scribble_benchmark, write_outputs

    if args.dataset is not None:
        return _dataset_benchmark(args)
    if args.crf or args.crop or args.images or args.split != "all":
        raise ValueError("--crf, --crop, --images and --split go with --dataset NAME")
    for option in ("classifier", "filters", "intensity"):
        if len(getattr(args, option)) > 1:
            raise ValueError(f"several --{option} values compare configurations of --dataset; the scribble-round "
                             "benchmark takes one")
        setattr(args, option, getattr(args, option)[0])
    if (args.synthetic or args.composition_shift) and args.synthetic_size < MIN_SYNTHETIC_SIZE:
        warnings.warn(f"--synthetic-size {args.synthetic_size}: images under {MIN_SYNTHETIC_SIZE} px are smaller "
                      "than the filters' reach (σ up to 16 px) and hold few scribbles: the scores mean little")
    checkpoints = _check_backbone_weights(args, args.backbone)
    check_folder_path(args.out)
    if args.composition_shift:
        if args.train_images or args.test_images:
            raise ValueError("--composition-shift generates its data: give no --train-images/--test-images")
        n_train, n_test = args.synthetic_count
        (tr, trm), (te, tem) = composition_shift_data(n_train, n_test, args.synthetic_size, seed=args.seed)
    elif args.synthetic:
        n_train, n_test = args.synthetic_count
        (tr, trm), (te, tem) = synthetic_dataset(n_train, n_test, args.synthetic_size, seed=args.seed)
    else:
        tr, trm, _ = _read_set(args.train_images, args.train_masks, "train")
        te, tem, _ = _read_set(args.test_images, args.test_masks, "test")
        unseen = sorted(set(np.unique(np.concatenate([m.ravel() for m in tem]))) - {0}
                        - set(np.unique(np.concatenate([m.ravel() for m in trm]))))
        if unseen:
            raise ValueError(f"the test masks hold class(es) {', '.join(map(str, unseen))} that no training mask "
                             "has: a classifier cannot predict them, so the scores would mean nothing")
    backbones = {"classical": None}
    if args.backbone:
        from ..models.checkpoint import create_backbone

        for name in args.backbone:
            ckpt = checkpoints.get(name)
            backbones[f"classical + {name}"] = create_backbone(
                name, pretrained=args.pretrained and ckpt is None, checkpoint=ckpt, seed=args.seed,
                **parse_model_args(args.model_arg))
    run_kwargs = dict(rounds=args.rounds, per_class=args.per_class, seed=args.seed, classifier=args.classifier,
                      progress=True)
    seg_kwargs = dict(n_components=args.components, classifier_params=_classifier_params(args), device=args.device,
                      filters=args.filters)
    if args.composition_shift:
        rows, preds, test_masks = compare_intensity(tr, trm, te, tem, backbones, segmenter_kwargs=seg_kwargs,
                                                    **run_kwargs)
    else:
        rows, preds, test_masks = scribble_benchmark(tr, trm, te, tem, backbones,
                                                     segmenter_kwargs={**seg_kwargs, "intensity": args.intensity},
                                                     **run_kwargs)
    paths = write_outputs(args.out, rows, preds, te, test_masks,
                          intensity="auto" if args.composition_shift else args.intensity,
                          figure_format=args.figure_format, dpi=args.dpi)
    methods = list(dict.fromkeys(r["method"] for r in rows))
    print("round  " + "  ".join(methods))
    for r in range(1, args.rounds + 1):
        vals = {row["method"]: row["miou"] for row in rows if row["round"] == r}
        print(f"{r:>5}  " + "  ".join(f"{vals[m]:>{len(m)}.3f}" for m in methods))
    last = [row for row in rows if row["round"] == args.rounds]
    width = max(len(row["method"]) for row in last)
    print(f"round {args.rounds}: {'method':<{width}}  mIoU   pixel accuracy")
    for row in last:
        print(f"{'':>{len(str(args.rounds)) + 8}}{row['method']:<{width}}  {row['miou']:.3f}  {row['pixel_accuracy']:.3f}")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _dataset_benchmark(args) -> int:
    """``segment benchmark --dataset NAME``: every configuration on the shipped labelled micrographs."""
    import itertools
    import os

    from ..trainable.datasets import load_micrographs
    from ..trainable.micrograph_benchmark import micrograph_benchmark, write_tables
    from ..trainable.segmenter import DEFAULT_CRF

    if args.synthetic or args.composition_shift or args.train_images or args.test_images:
        raise ValueError("--dataset brings its own images: give no --synthetic, --composition-shift or image folders")
    if args.crop is not None and args.crop < 16:
        raise ValueError(f"--crop must be at least 16 px, got {args.crop}")
    checkpoints = _check_backbone_weights(args, args.backbone)
    check_folder_path(args.out)
    items = load_micrographs(args.dataset, None if args.split == "all" else args.split, args.images)
    if not items:
        among = " among --images" if args.images else ""
        raise ValueError(f"dataset {args.dataset!r} has no {args.split} image{among}")
    if args.crop:
        items = [item.cropped(args.crop) for item in items]
    backbones = {"classical": None}
    for name in args.backbone:
        ckpt = checkpoints.get(name)
        backbones[name] = dict(backbone=name, checkpoint=ckpt, pretrained=args.pretrained and ckpt is None,
                               model_kwargs=parse_model_args(args.model_arg))
    features = {}
    for filters, intensity, (bname, bkwargs) in itertools.product(args.filters, args.intensity, backbones.items()):
        features[f"{filters}/{intensity}/{bname}"] = dict(filters=filters, intensity=intensity,
                                                          n_components=args.components, device=args.device,
                                                          **(bkwargs or {}))
    classifiers = {c: (c, _classifier_params(args)) for c in args.classifier}
    crfs = {c: (False if c == "off" else (c, {})) for c in (args.crf or ["off" if not DEFAULT_CRF else DEFAULT_CRF])}
    rows = micrograph_benchmark(items, features, classifiers, crfs, protocols=args.protocol, seeds=args.seeds,
                                dense_seeds=args.dense_seeds, progress=True)
    if not rows:
        raise ValueError(f"no run: protocol(s) {', '.join(args.protocol)} label none of the chosen images")
    load = os.getloadavg()[0]
    header = [f"# Segmentation benchmark on the labelled micrographs: dataset `{args.dataset}`", "",
              f"{len(items)} image(s){f' (central {args.crop} px)' if args.crop else ''}, seeds "
              f"{' '.join(map(str, args.seeds))}"
              + (f" (dense: {' '.join(map(str, args.dense_seeds))})" if args.dense_seeds else "") + "; per image: label by the protocol, train on that image, segment it, "
              f"score it against its ground truth. Load average at the end: {load:.1f} (scores do not depend on it).",
              ""]
    paths = write_tables(args.out, rows, header)
    print(paths[-1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def run(args) -> int:
    if args.action == "measure":
        from . import segment_measure

        return segment_measure.run(args)
    return {"train": _train, "apply": _apply, "merge": _merge, "benchmark": _benchmark}[args.action](args)
