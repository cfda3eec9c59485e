"""Pixel classifiers: a random forest (default) or XGBoost gradient boosting, saved as XGBoost JSON.

The random forest is XGBoost's own random-forest mode (``XGBRFClassifier``: many trees on
bootstrap rows and random feature subsets per split, averaged), so both options save to
XGBoost's JSON model format and load without pickle.

Why a forest by default: on the labelled micrograph set's training split (sparse strokes, three
seeds; docs/segmentation.md) the forest beat boosting with either filter set and varied less from
seed to seed. Strokes drawn inside regions are separated by one or two thresholds, so every
boosted tree fits the same few thresholds and the ensemble follows the strokes' chance placement;
trees on random row and feature subsets average that out. 25 trees on 30% of the rows scored as
well as 50 or 100, and prediction (every tree on every pixel) is most of a first segmentation.
With ten seeds per training image no other setting tried (histogram bins, exact splits, row and
feature fractions, leaf regularisation, 50-100 trees) nor scikit-learn's forest scored better
beyond the strokes' noise (benchmarks/bench_trainable_sparse_diagnosis.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

__all__ = ["CLASSIFIERS", "DEFAULT_CLASSIFIER", "balanced_weights", "fit_classifier", "load_classifier",
           "make_classifier"]

CLASSIFIERS = ("xgboost", "random_forest")
DEFAULT_CLASSIFIER = "random_forest"
# XGBoost's defaults are those of earlier versions (30 rounds: fit on 100k pixels in seconds). Override any
# value with ``classifier_params``.
DEFAULTS = {
    "xgboost": dict(n_estimators=30, max_depth=6, learning_rate=0.5, tree_method="hist", max_bin=128),
    "random_forest": dict(n_estimators=25, max_depth=12, subsample=0.3, colsample_bynode=0.3,
                          tree_method="hist", max_bin=128),
}


def make_classifier(kind: str = DEFAULT_CLASSIFIER, seed: int = 0, n_jobs: int | None = None, **params):
    """An unfitted XGBoost classifier of ``kind`` ("xgboost" or "random_forest")."""
    import xgboost as xgb

    if kind not in CLASSIFIERS:
        raise ValueError(f"classifier must be one of {CLASSIFIERS}, got {kind!r}")
    cls = xgb.XGBClassifier if kind == "xgboost" else xgb.XGBRFClassifier
    return cls(**{**DEFAULTS[kind], **params}, random_state=seed, n_jobs=n_jobs)


# Fits on fewer rows run on one thread: on a busy machine, OpenMP threads waiting on each other made
# fits of a few thousand rows 10-100x slower than one thread.
SINGLE_THREAD_ROWS = 50_000


def fit_classifier(kind: str, X: np.ndarray, y: np.ndarray, seed: int = 0, params: dict | None = None):
    """A classifier of ``kind`` fitted on rows ``X`` and classes ``y`` (0..K-1), classes balanced.

    Unless ``params`` sets ``n_jobs``, the fit uses one thread below :data:`SINGLE_THREAD_ROWS` rows
    and all cores above, and prediction (whole images: many rows) uses all cores."""
    params = dict(params or {})
    threads = params.pop("n_jobs", "auto")
    clf = make_classifier(kind, seed=seed, n_jobs=(1 if len(y) < SINGLE_THREAD_ROWS else None)
                          if threads == "auto" else threads, **params)
    clf.fit(X, y, sample_weight=balanced_weights(y))
    if threads == "auto":
        clf.set_params(n_jobs=None)
    return clf


def balanced_weights(y: np.ndarray) -> np.ndarray:
    """Per-sample weights n / (K·n_k): every class weighs the same in total, whatever its pixel count."""
    counts = np.bincount(y)
    present = counts > 0
    weights = np.zeros(len(counts))
    weights[present] = len(y) / (present.sum() * counts[present])
    return weights[y].astype(np.float32)


def load_classifier(kind: str, path) -> object:
    """A classifier of ``kind`` from XGBoost's JSON model file ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"classifier model {path} does not exist")
    import xgboost as xgb

    clf = make_classifier(kind)
    try:
        clf.load_model(path)
    except xgb.core.XGBoostError as err:  # its message is a C++ stack trace: the first line says what failed
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", reason)  # "[08:19:02] src/json.cc:409: " prefix
        raise ValueError(f"{path} is not a readable XGBoost model ({reason[:200]}): the model folder is damaged; "
                         "train it again") from None
    return clf
