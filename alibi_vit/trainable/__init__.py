"""Trainable (Weka/ilastik-style) segmentation of micrographs on classical ⊕ ViT features (docs/method.md §7).

- :func:`classical_features`: the Weka filter set per pixel.
- :class:`ViTFeatures`: backbone patch features, standardised, PCA-reduced, upsampled to pixels.
- :class:`TrainableSegmenter`: fit on sparse labels (0 = unlabelled, 1..K), predict, save/load;
  :class:`VolumeSegmenter`: the same for volumes, on 3D features.
- :func:`scribbles`, :func:`synthetic_micrograph`, :func:`scribble_benchmark`: the benchmark.
- :func:`load_micrographs`: the labelled real micrographs shipped with the package;
  :func:`~alibi_vit.trainable.micrograph_benchmark.micrograph_benchmark` scores configurations on them.
- :func:`dense_crf`: optional clean-up of the probabilities.
"""

from .classical import classical_feature_names, classical_features, membrane_kernels
from .io import read_grayscale, read_labels, to_unit_float
from .scribbles import scribbles  # eager: a lazy name equal to its submodule's would return the module
from .segmenter import TrainableSegmenter
from .volumes import VolumeSegmenter  # (registers the 3D models TrainableSegmenter.load opens)

# Imported on first use (PEP 562), so that `segment train` and `apply` do not pay for them: the ViT parts
# need PyTorch, which classical features on the CPU do not; the benchmark's parts need scipy.ndimage (about
# a second of a first segmentation's imports on a 2-core machine).
_LAZY = {"ViTFeatures": ".vit", "vit_patch_features": ".vit", "synthetic_dataset": "..synthetic",
         "synthetic_micrograph": "..synthetic", "mean_iou": ".benchmark", "scribble_benchmark": ".benchmark",
         "dense_crf": ".crf", "load_micrographs": ".datasets"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["TrainableSegmenter", "ViTFeatures", "VolumeSegmenter", "classical_feature_names", "classical_features",
           "dense_crf", "load_micrographs", "mean_iou", "membrane_kernels", "read_grayscale", "read_labels", "scribble_benchmark",
           "scribbles", "synthetic_dataset", "synthetic_micrograph", "to_unit_float", "vit_patch_features"]
