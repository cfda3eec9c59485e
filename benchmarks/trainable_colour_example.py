"""The colour example of docs/segmentation.md: a stained micrograph segmented per channel and as grey.

    python benchmarks/trainable_colour_example.py   # writes benchmarks/results/trainable_seg_colour_example.png

The image is scikit-image's bundled immunohistochemistry image (a real IHC-stained tissue
micrograph, offline). Scribbles are small disks placed where colour deconvolution (skimage's
``rgb2hed``) is unambiguous: brown DAB stain, blue haematoxylin, pale background. They are
placed by this script, not drawn by a person, and there is no ground truth: the figure shows what
per-channel features keep that grey features lose, it does not score it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "trainable_seg_colour_example.png"
NAMES = ["DAB (brown)", "haematoxylin (blue)", "background"]


def scribble_labels(rgb: np.ndarray, per_class: int = 8, radius: int = 4, seed: int = 0) -> np.ndarray:
    from skimage.color import rgb2hed

    hed = rgb2hed(rgb)
    grey = rgb.mean(-1)
    confident = [hed[..., 2] > np.percentile(hed[..., 2], 97),                       # strong DAB
                 (hed[..., 0] > np.percentile(hed[..., 0], 95)) & (hed[..., 2] < np.percentile(hed[..., 2], 50)),
                 grey > np.percentile(grey, 97)]                                     # pale background
    rng = np.random.default_rng(seed)
    labels = np.zeros(rgb.shape[:2], np.uint8)
    rows, cols = np.mgrid[-radius:radius + 1, -radius:radius + 1]
    disk = rows ** 2 + cols ** 2 <= radius ** 2
    for c, where in enumerate(confident, start=1):
        r, q = np.nonzero(where[radius:-radius, radius:-radius])
        for i in rng.choice(len(r), per_class, replace=False):
            window = labels[r[i]:r[i] + 2 * radius + 1, q[i]:q[i] + 2 * radius + 1]
            window[disk] = c
    return labels


def main() -> int:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from skimage import data

    from alibi_vit.trainable import TrainableSegmenter
    from alibi_vit.trainable.io import overlay, palette

    rgb = data.immunohistochemistry()
    labels = scribble_labels(rgb)
    kw = dict(classifier_params={"n_jobs": 2})
    panels = [("image + scribbles (disks)", overlay(rgb / 255.0, labels, 1.0, 3))]
    for colour in ("channels", "grey"):
        seg = TrainableSegmenter(colour=colour, **kw).fit([rgb], [labels])
        mask = seg.predict([rgb])[0]
        fractions = ", ".join(f"{(mask == c).mean():.2f}" for c in (1, 2, 3))
        panels.append((f"colour={colour!r}\narea fractions {fractions}", overlay(rgb / 255.0, mask, 0.5, 3)))
    fig = Figure(figsize=(10, 4.4), dpi=90)
    for i, (title, panel) in enumerate(panels):
        ax = fig.add_subplot(1, 3, i + 1)
        ax.imshow(panel)
        ax.set_axis_off()
        ax.set_title(title, fontsize=9)
    key = [Patch(color=palette(3)[c] / 255.0, label=f"{c}: {n}") for c, n in enumerate(NAMES, start=1)]
    fig.legend(handles=key, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
