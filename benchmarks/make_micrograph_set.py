"""Build the labelled micrograph set shipped in ``alibi_vit/trainable/micrographs/`` from its sources.

    python benchmarks/make_micrograph_set.py --nasa PATH/pretrained-microscopy-models \
        --isb PATH/interactive-seg-backend [--out alibi_vit/trainable/micrographs]

Both sources are MIT-licensed GitHub repositories; give their checkouts (work trees):

- NASA's ``pretrained-microscopy-models``, ``benchmark_segmentation_data/``: Ni-based superalloy
  SEM images ("Super", 512², masks are colour overlays: the image's own grey where the matrix is,
  pure blue and pure red over the two precipitate phases) and environmental barrier coatings
  ("EBC", 1024², masks hold 0 background / 1 oxide / 2 crack).
- tldr-group's ``interactive-seg-backend``, ``tests/data/``: an SEM image (``0.tif``, 3 phases) and
  a TEM image (``1.tif``, 2 phases) with ground truth and the authors' own scribbles. Its SEM image
  is NASA's 16-bit "45kx_SE_15kV-etched_0" scaled to 8 bits, with the same ground truth (the
  script checks both): the set keeps NASA's 16-bit original once, with the authors' scribbles.

Every image is stored as a single-channel PNG at its own bit depth (the sources repeat grey in
three channels; the script checks they are equal); ground truths become label PNGs with classes
1..K (the Weka/ilastik convention this project uses: 0 would mean "unlabelled"), and the authors'
scribbles label PNGs with 0 = unlabelled. A colour the overlay conversion does not know is an error,
not a guess. The script writes ``manifest.json`` (image, mask, split, class names, source path)
and copies both licences.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import tifffile
from PIL import Image

NASA = "benchmark_segmentation_data"
# (name in the set, split, source image relative to NASA, source mask relative to NASA)
SUPER = [
    ("super_spot3_0d_3", "train", "Super1/train/spot3_0d_3.tif", "Super1/train_annot/spot3_0d_3_mask.tif"),
    ("super_spot5_180d_2", "train", "Super1/train/spot5_180d_2.tif", "Super1/train_annot/spot5_180d_2_mask.tif"),
    ("super_spot2_0d_0", "test", "Super1/test/spot2_0d_0.tif", "Super1/test_annot/spot2_0d_0_mask.tif"),
    ("super_spot2_180d_3", "test", "Super1/test/spot2_180d_3.tif", "Super1/test_annot/spot2_180d_3_mask.tif"),
    # another alloy, 16-bit (the Super2-4 "different_test" image)
    ("super_45kx_etched", "test", "Super4/test/45kx_SE_15kV-etched_0.tif",
     "Super4/test_annot/45kx_SE_15kV-etched_0_mask.tif"),
]
SUPER_CLASSES = ["matrix", "large precipitates", "small precipitates"]
EBC = [
    ("ebc_010417_4_S2480009", "train", "EBC1/train/010417#4_S2480009.tif", "EBC1/train_annot/010417#4_S2480009.tif"),
    ("ebc_040617_2_S127_2_0015", "test", "EBC1/test/040617#2_S127(2)0015.tif",
     "EBC1/test_annot/040617#2_S127(2)0015.tif"),
    ("ebc_050317_3_S0440016", "test", "EBC1/test/050317#3_S0440016.tif", "EBC1/test_annot/050317#3_S0440016.tif"),
]
EBC_CLASSES = ["background", "oxide", "crack"]
ISB_SEM = ("super_45kx_etched", "0.tif", "0_ground_truth.tif", "0_labels.tif")  # in tests/data/
ISB_TEM = ("isb_tem", "test", "1.tif", "1_ground_truth.tif", "1_labels.tif")
LICENCES = {"nasa": ("LICENSE.txt", "LICENCE-pretrained-microscopy-models.txt"),
            "isb": ("LICENSE", "LICENCE-interactive-seg-backend.txt")}


def grey(array: np.ndarray, source) -> np.ndarray:
    """One channel of an image whose channels are all equal (an error otherwise)."""
    array = np.squeeze(array)
    if array.ndim == 3:
        if not all(np.array_equal(array[..., 0], array[..., c]) for c in range(1, 3)):
            raise ValueError(f"{source}: channels differ, not a grey image")
        array = array[..., 0]
    if array.ndim != 2:
        raise ValueError(f"{source}: shape {array.shape} is not an image")
    return array


def overlay_to_labels(image: np.ndarray, overlay: np.ndarray, source) -> np.ndarray:
    """Classes 1..3 from a colour-overlay mask: 1 where the mask shows the image's own grey, 2 pure
    blue, 3 pure red (full scale of the mask's dtype)."""
    rgb = overlay[..., :3]
    full = np.iinfo(rgb.dtype).max
    r, g, b = (rgb[..., c].astype(np.int64) for c in range(3))
    labels = np.zeros(image.shape, np.uint8)
    is_grey = (r == g) & (g == b)
    if not np.array_equal(r[is_grey], image[is_grey].astype(np.int64)):
        raise ValueError(f"{source}: grey pixels of the overlay are not the image's own values")
    labels[is_grey] = 1
    labels[(r == 0) & (g == 0) & (b == full)] = 2
    labels[(r == full) & (g == 0) & (b == 0)] = 3
    if (labels == 0).any():
        odd = np.unique(rgb[labels == 0].reshape(-1, 3), axis=0)[:5]
        raise ValueError(f"{source}: {int((labels == 0).sum())} pixels of unknown overlay colours, e.g. {odd.tolist()}")
    return labels


def values_to_labels(mask: np.ndarray, values, source, unlabelled=None) -> np.ndarray:
    """Classes 1..K from the K given mask values in order (``unlabelled`` → 0); other values are an error."""
    labels = np.zeros(mask.shape, np.uint8)
    known = np.zeros(mask.shape, bool)
    for k, v in enumerate(values, start=1):
        labels[mask == v] = k
        known |= mask == v
    if unlabelled is not None:
        known |= mask == unlabelled
    if not known.all():
        raise ValueError(f"{source}: unexpected values {np.unique(mask[~known]).tolist()}")
    return labels


def save_png(array: np.ndarray, path: Path) -> None:
    Image.fromarray(array).save(path, optimize=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nasa", type=Path, required=True, help="checkout of nasa/pretrained-microscopy-models")
    p.add_argument("--isb", type=Path, required=True, help="checkout of tldr-group/interactive-seg-backend")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "alibi_vit/trainable/micrographs")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    nasa_repo, isb_repo = "github.com/nasa/pretrained-microscopy-models", "github.com/tldr-group/interactive-seg-backend"
    isb_data = args.isb / "tests/data"

    def isb_labels(truth_file, scribble_file):
        truth = grey(tifffile.imread(isb_data / truth_file), truth_file)
        values = [int(v) for v in np.unique(truth)]
        scribbles = grey(tifffile.imread(isb_data / scribble_file), scribble_file)
        return values_to_labels(truth, values, truth_file), values_to_labels(scribbles, values, scribble_file, 0)

    entries = []
    for group, classes in ((SUPER, SUPER_CLASSES), (EBC, EBC_CLASSES)):
        for name, split, im, mk in group:
            image = grey(tifffile.imread(args.nasa / NASA / im), im)
            mask = tifffile.imread(args.nasa / NASA / mk)
            labels = (overlay_to_labels(image, mask, mk) if group is SUPER
                      else values_to_labels(grey(mask, mk), (0, 1, 2), mk))
            entries.append(dict(name=name, sets=["super" if group is SUPER else "ebc"], split=split, image=image,
                                labels=labels, classes=classes, source=f"{nasa_repo}: {NASA}/{im}",
                                licence=[LICENCES["nasa"][1]]))
    # The authors' SEM image is NASA's, 8-bit: attach their scribbles to NASA's 16-bit original.
    name, im, gt, scr = ISB_SEM
    sem = next(e for e in entries if e["name"] == name)
    isb_image = grey(tifffile.imread(isb_data / im), im).astype(np.int64)
    truth, scribbles = isb_labels(gt, scr)
    if np.abs(np.round(sem["image"] / 257.0) - isb_image).max() > 1 or not np.array_equal(truth, sem["labels"]):
        raise ValueError(f"{isb_data / im} is no longer {sem['source']} in 8 bits: update this script")
    sem.update(sets=["super", "isb"], scribbles=scribbles, licence=[LICENCES["nasa"][1], LICENCES["isb"][1]],
               source=sem["source"] + f"; the same image in 8 bits with these scribbles: {isb_repo}: tests/data/{im}")
    name, split, im, gt, scr = ISB_TEM
    truth, scribbles = isb_labels(gt, scr)
    entries.append(dict(name=name, sets=["isb"], split=split, image=grey(tifffile.imread(isb_data / im), im),
                        labels=truth, classes=[f"phase {k}" for k in range(1, int(truth.max()) + 1)],
                        source=f"{isb_repo}: tests/data/{im}", licence=[LICENCES["isb"][1]], scribbles=scribbles))

    manifest = []
    for e in entries:
        save_png(e["image"], args.out / f"{e['name']}.png")
        save_png(e["labels"], args.out / f"{e['name']}_mask.png")
        item = {k: e[k] for k in ("name", "sets", "split", "classes", "source", "licence")}
        item.update(image=f"{e['name']}.png", mask=f"{e['name']}_mask.png")
        if "scribbles" in e:
            save_png(e["scribbles"], args.out / f"{e['name']}_authors.png")
            item["authors_scribbles"] = f"{e['name']}_authors.png"
        manifest.append(item)
        counts = np.bincount(e["labels"].ravel(), minlength=len(e["classes"]) + 1)[1:]
        print(f"{e['name']}: {e['image'].shape} {e['image'].dtype}, class fractions "
              + ", ".join(f"{c} {n / e['labels'].size:.4f}" for c, n in zip(e["classes"], counts)))
    for key, (src, dst) in LICENCES.items():
        shutil.copyfile((args.nasa if key == "nasa" else args.isb) / src, args.out / dst)
    (args.out / "manifest.json").write_text(json.dumps({"images": manifest}, indent=1) + "\n")
    total = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {len(manifest)} images to {args.out} ({total / 2**20:.2f} MiB in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
