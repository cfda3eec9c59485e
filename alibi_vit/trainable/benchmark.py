"""The scribble benchmark (docs/method.md §7; paper S8.3, Fig. S16).

Training images with ground truth get scribbles generated from that ground truth in rounds (one
scribble per class per training image per round, accumulating); after each round a segmenter is
trained on all scribbles so far and scored on the test images. Every method (classical features
alone, classical + each backbone) sees the very same scribbles. No CRF, as in the paper.

The composition-shift case (:func:`composition_shift_data`, :func:`compare_intensity`): training
images hold three phases, test images lack one (the brightest), as a field of view without
precipitates does; run once per intensity mode, it shows what scaling each image by its own
content costs when the content differs.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..synthetic import brightest_phase, synthetic_micrograph
from .io import as_label_image, overlay, to_unit_float
from .classifier import DEFAULT_CLASSIFIER
from .scribbles import scribbles
from .segmenter import TrainableSegmenter

__all__ = ["INTENSITY_COMPARISON", "compare_intensity", "composition_shift_data", "mean_iou", "pixel_accuracy",
           "remap_masks", "scribble_benchmark", "write_outputs"]

# The intensity modes the composition-shift case compares ("auto" is "percentile" for grayscale).
INTENSITY_COMPARISON = ("training", "percentile", "minmax", "dtype")


def remap_masks(masks) -> tuple[list[np.ndarray], np.ndarray]:
    """Ground-truth masks → classes 1..K, K the number of distinct values in all masks together.

    Every distinct value is a class (0 included: a ground truth labels every pixel), mapped in
    sorted order, so masks saved as 0/1/2 or 0/128/255 both work. Returns (masks, original values).
    """
    masks = [as_label_image(m, source=f"ground-truth mask {i}") for i, m in enumerate(masks)]
    values = np.unique(np.concatenate([np.unique(m) for m in masks]))
    if len(values) < 2:
        raise ValueError(f"the ground-truth masks hold a single value ({values[0]}): nothing to segment")
    return [np.searchsorted(values, m) + 1 for m in masks], values


def mean_iou(pred: np.ndarray, truth: np.ndarray) -> float:
    """Class-averaged IoU of one image over the classes present in its ground truth or prediction."""
    if pred.shape != truth.shape:
        raise ValueError(f"prediction {pred.shape} and ground truth {truth.shape} differ in shape")
    ious = []
    for c in np.union1d(np.unique(pred), np.unique(truth)):
        p, t = pred == c, truth == c
        ious.append((p & t).sum() / (p | t).sum())
    return float(np.mean(ious))


def pixel_accuracy(pred: np.ndarray, truth: np.ndarray) -> float:
    """Fraction of pixels whose predicted class is the true one."""
    if pred.shape != truth.shape:
        raise ValueError(f"prediction {pred.shape} and ground truth {truth.shape} differ in shape")
    return float((pred == truth).mean())


def composition_shift_data(n_train: int = 5, n_test: int = 5, size: int = 256, seed: int = 0, phases: int = 3,
                           missing: int | None = None):
    """((train images, masks), (test images, masks)) of :func:`~alibi_vit.synthetic.synthetic_micrograph`:
    training images with ``phases`` phases in equal areas, test images without phase ``missing``
    (default: the brightest) and the others in equal areas. Seeded."""
    missing = brightest_phase(phases) if missing is None else int(missing)
    if not 1 <= missing <= phases:
        raise ValueError(f"missing must be a phase 1..{phases}, got {missing}")
    fractions = np.full(phases, 1.0 / (phases - 1))
    fractions[missing - 1] = 0.0
    train = [synthetic_micrograph(size, phases, seed=(seed, i)) for i in range(n_train)]
    test = [synthetic_micrograph(size, phases, seed=(seed, n_train + i), fractions=fractions) for i in range(n_test)]
    return ([p[0] for p in train], [p[1] for p in train]), ([p[0] for p in test], [p[1] for p in test])


def compare_intensity(train_images, train_masks, test_images, test_masks, backbones=None, *,
                      modes=INTENSITY_COMPARISON, segmenter_kwargs=None, progress: bool = False, **kwargs):
    """:func:`scribble_benchmark` once per intensity mode, on the very same scribbles (same seed).

    Returns (rows, predictions, test masks) as it does, methods named "<method> [intensity=<mode>]".
    """
    rows, predictions, masks = [], {}, None
    for mode in tqdm(modes, desc="intensity modes", disable=not progress):
        seg_kwargs = {**(segmenter_kwargs or {}), "intensity": mode}
        r, p, masks = scribble_benchmark(train_images, train_masks, test_images, test_masks, backbones,
                                         segmenter_kwargs=seg_kwargs, **kwargs)
        rows += [{**row, "method": f"{row['method']} [intensity={mode}]"} for row in r]
        predictions.update({f"{m} [intensity={mode}]": v for m, v in p.items()})
    return rows, predictions, masks


def scribble_benchmark(train_images, train_masks, test_images, test_masks, backbones=None, *, rounds: int = 5,
                       per_class: int = 1, seed: int = 0, classifier: str = DEFAULT_CLASSIFIER, segmenter_kwargs=None,
                       progress: bool = False):
    """Run the benchmark; returns (rows, predictions, test masks as classes 1..K).

    backbones: {method name: backbone} where backbone is None (classical features only), a model
        name or an nn.Module (see :class:`TrainableSegmenter`); default {"classical": None}.
    rows: one dict per method and round: method, round (1-based), scribbled_pixels, miou (the mean
        over test images of :func:`mean_iou`), pixel_accuracy (the mean of :func:`pixel_accuracy`). predictions: {method: masks of the test images after
        the last round}. Seeded: the same arguments give the same numbers.
    """
    backbones = {"classical": None} if backbones is None else dict(backbones)
    if len(train_images) != len(train_masks) or len(test_images) != len(test_masks):
        raise ValueError("each image needs exactly one ground-truth mask")
    if not train_images or not test_images:
        raise ValueError("the benchmark needs at least one training and one test image")
    masks, _ = remap_masks(list(train_masks) + list(test_masks))
    train_masks, test_masks = masks[:len(train_masks)], masks[len(train_masks):]
    for i, (im, m) in enumerate(zip(list(train_images) + list(test_images), masks)):
        if np.asarray(im).shape[:2] != m.shape:
            raise ValueError(f"image {i} is {np.asarray(im).shape[:2]} but its mask is {m.shape}")
    rng = np.random.default_rng(seed)
    labels = [np.zeros_like(m) for m in train_masks]
    rows, predictions = [], {}
    kwargs = dict(segmenter_kwargs or {})
    bar = tqdm(total=rounds * len(backbones), desc="benchmark", disable=not progress)
    for r in range(1, rounds + 1):
        for i, m in enumerate(train_masks):  # the same new scribbles for every method
            new = scribbles(m, per_class, rng)
            labels[i] = np.where(new > 0, new, labels[i])
        n_scribbled = int(sum((lab > 0).sum() for lab in labels))
        for method, backbone in backbones.items():
            seg = TrainableSegmenter(backbone, classifier, crf=False, seed=seed, **kwargs).fit(train_images, labels)
            preds = seg.predict(test_images)
            rows.append({"method": method, "round": r, "scribbled_pixels": n_scribbled,
                         "miou": float(np.mean([mean_iou(p, t) for p, t in zip(preds, test_masks)])),
                         "pixel_accuracy": float(np.mean([pixel_accuracy(p, t) for p, t in zip(preds, test_masks)]))})
            predictions[method] = preds
            bar.update()
    bar.close()
    return rows, predictions, test_masks


def write_outputs(out_dir, rows, predictions, test_images, test_masks, intensity: str = "auto",
                  n_examples: int = 2, figure_format: str = "png", dpi: int | None = None) -> list[Path]:
    """benchmark.csv, miou_vs_round.png (Fig. S16b) and examples.png (S16c) in ``out_dir``; the figures in
    ``figure_format`` (png, svg, pdf) at ``dpi`` (None: each figure's own)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "benchmark.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_path = out / f"miou_vs_round.{figure_format}"
    plot_miou_vs_round(rows).savefig(plot_path, dpi=dpi or "figure")
    examples_path = out / f"examples.{figure_format}"
    plot_examples(predictions, test_images, test_masks, intensity, n_examples).savefig(examples_path,
                                                                                      dpi=dpi or "figure")
    return [csv_path, plot_path, examples_path]


def plot_miou_vs_round(rows):
    """Test mIoU against the scribble round, one line per method (Fig. S16b): a matplotlib Figure."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5, 3.5), dpi=100)
    ax = fig.add_subplot()
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["round"], r["miou"]) for r in rows if r["method"] == method]
        ax.plot(*zip(*pts), marker="o", label=method)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_xlabel("scribble round")
    ax.set_ylabel("test mIoU")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


# Panel titles wrap at this many characters: model names run long, and titles must not overlap.
TITLE_WIDTH = 24


def plot_examples(predictions, test_images, test_masks, intensity: str = "auto", n_examples: int = 2):
    """Image, ground truth and each method's prediction for the first test images (Fig. S16c): a Figure."""
    import textwrap

    from matplotlib.figure import Figure

    n = min(n_examples, len(test_images))
    k = int(max(m.max() for m in test_masks))
    cols = 2 + len(predictions)
    fig = Figure(figsize=(2.2 * cols, 2.6 * n), dpi=80)
    for i in range(n):
        # Display only: a "training" range belongs to a trained model, so show each image by itself.
        image01 = to_unit_float(test_images[i], "auto" if intensity == "training" else intensity)
        panels = [("image", np.repeat((image01 * 255).astype(np.uint8)[..., None], 3, -1)),
                  ("ground truth", overlay(image01, test_masks[i], 0.5, k))]
        panels += [(textwrap.fill(name, TITLE_WIDTH, break_on_hyphens=False) +
                    f"\nmIoU {mean_iou(p[i], test_masks[i]):.2f}", overlay(image01, p[i], 0.5, k))
                   for name, p in predictions.items()]
        for j, (title, panel) in enumerate(panels):
            ax = fig.add_subplot(n, cols, i * cols + j + 1)
            ax.imshow(panel)
            ax.set_axis_off()
            ax.set_title(title, fontsize=8)
    fig.tight_layout()
    return fig
