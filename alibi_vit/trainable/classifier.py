"""Pixel classifiers: a random forest (default) or XGBoost gradient boosting, saved as XGBoost JSON.

The random forest is XGBoost's own random-forest mode (as ``XGBRFClassifier`` sets it: many trees
on bootstrap rows and random feature subsets per split, averaged), so both options save to
XGBoost's JSON model format and load without pickle. Both are trained through XGBoost's own API
(:class:`PixelClassifier`), not its scikit-learn classes, so that XGBoost can be imported without
scikit-learn: 1.4 s of a first segmentation's start on a 2-core CPU (:func:`import_xgboost`).

Why a forest by default: on the labelled micrograph set's training split (sparse strokes, three
seeds; docs/segmentation.md) the forest beat boosting with either filter set and varied less from
seed to seed. Strokes drawn inside regions are separated by one or two thresholds, so every
boosted tree fits the same few thresholds and the ensemble follows the strokes' chance placement;
trees on random row and feature subsets average that out. 25 trees on 30% of the rows scored as
well as 50 or 100, and prediction (every tree on every pixel) is most of a first segmentation; 15 trees
then score as 25 on the nine micrographs (sparse strokes 0.5262 against 0.5258 over three seeds, dense
labels 0.807 against 0.809) and predict in 0.6-0.7 of the time, while shallower trees lose 0.06-0.10 with
dense labels (benchmarks/bench_tree_caps.py): 15 trees of depth 12 are the default.
With ten seeds per training image no other setting tried (histogram bins, exact splits, row and
feature fractions, leaf regularisation, 50-100 trees) nor scikit-learn's forest scored better
beyond the strokes' noise (benchmarks/bench_trainable_sparse_diagnosis.py).

Thresholds midway between labelled values: XGBoost's histogram method splits ``x < cut`` where
each cut is one of the training values, so every value between the largest labelled value below
the cut and the cut itself goes to the left. Sparse strokes leave wide gaps there (the boundary
between two phases is never stroked), and the boundary then sits on one class's stroked extreme,
moving with each tree's row sample. After the fit every threshold is moved to the middle of its
gap, where an exact tree learner would put it: the training rows fall exactly as before (the
fitted model is unchanged on them), unseen values in the gap are shared between the two sides.
"""

from __future__ import annotations

import copyreg
import json
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..runtime import thread_budget

__all__ = ["CLASSIFIERS", "DEFAULT_CLASSIFIER", "PRIVATE_XGBOOST", "PendingClassifier", "PixelClassifier",
           "balanced_weights", "fit_classifier", "import_in_background", "import_xgboost", "load_classifier",
           "load_classifier_in_background", "make_classifier", "midpoint_thresholds"]

CLASSIFIERS = ("xgboost", "random_forest")
DEFAULT_CLASSIFIER = "random_forest"
# XGBoost's defaults are those of earlier versions (30 rounds: fit on 100k pixels in seconds). Override any
# value with ``classifier_params``.
DEFAULTS = {
    "xgboost": dict(n_estimators=30, max_depth=6, learning_rate=0.5, tree_method="hist", max_bin=128),
    "random_forest": dict(n_estimators=15, max_depth=12, subsample=0.3, colsample_bynode=0.3,
                          tree_method="hist", max_bin=128),
}


_IMPORT_LOCK = threading.Lock()  # one import of XGBoost at a time: a background one and a fit's own
_IMPORTER: list = []  # the background import's thread, once started
_XGBOOST: list = []  # the module PixelClassifier uses, once imported
# The name XGBoost's package is loaded under without scikit-learn (import_xgboost).
PRIVATE_XGBOOST = "alibi_vit.trainable._xgboost"


class _NoScikitLearnInThisThread:
    """A meta-path finder that refuses scikit-learn to one thread (the one importing XGBoost), and only there."""

    def __init__(self):
        self.thread = threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if threading.get_ident() == self.thread and name.partition(".")[0] == "sklearn":
            raise ModuleNotFoundError(f"{name} is not imported with XGBoost in this process", name=name)
        return None


def _import_private_xgboost():
    """XGBoost's package executed as :data:`PRIVATE_XGBOOST`, scikit-learn refused to this thread.

    Its modules import one another relatively, so every one of them loads under the private name; the
    process's own ``xgboost`` stays unimported, and imports later as usual, with its scikit-learn classes."""
    import importlib.util

    found = importlib.util.find_spec("xgboost")
    if found is None or found.origin is None or not found.submodule_search_locations:
        raise ImportError("XGBoost is not a package of files here")
    spec = importlib.util.spec_from_file_location(PRIVATE_XGBOOST, found.origin,
                                                  submodule_search_locations=found.submodule_search_locations)
    module = importlib.util.module_from_spec(spec)
    finder = _NoScikitLearnInThisThread()
    sys.modules[PRIVATE_XGBOOST] = module
    # New lists, not one changed in place: another thread's import may be going through the old one.
    sys.meta_path = [finder, *sys.meta_path]
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == PRIVATE_XGBOOST or n.startswith(PRIVATE_XGBOOST + ".")]:
            del sys.modules[name]
        raise
    finally:
        sys.meta_path = [f for f in sys.meta_path if f is not finder]
    # Its boosters and errors pickle as those of whichever XGBoost the unpickling process uses, since no
    # other process knows the private name (a Dask worker's booster, or its error sent back).
    copyreg.pickle(module.core.Booster, _reduce_booster)
    copyreg.pickle(module.core.XGBoostError, _reduce_xgboost_error)
    return module


def _booster_from_state(state: dict):
    booster_class = import_xgboost().Booster
    booster = booster_class.__new__(booster_class)
    booster.__setstate__(state)
    return booster


def _reduce_booster(booster):
    return _booster_from_state, (booster.__getstate__(),)


def _xgboost_error(*args):
    return import_xgboost().core.XGBoostError(*args)


def _reduce_xgboost_error(error):
    return _xgboost_error, error.args


def import_xgboost():
    """The XGBoost module :class:`PixelClassifier` uses, imported once per process; the background import and
    a fit's own wait for each other on one lock (two threads importing it at once could leave it half made).

    XGBoost imports scikit-learn whenever it can, for its scikit-learn classes: about 1.4 s of its 1.9 s
    import on a 2-core CPU, and :class:`PixelClassifier` needs none of it. Unless the process has imported
    ``xgboost`` or ``sklearn`` already (then the import costs little, and that module is used), XGBoost's
    package is loaded under a private name (:data:`PRIVATE_XGBOOST`) without scikit-learn. ``import xgboost``
    elsewhere in the process is unaffected: it imports the package as usual, scikit-learn classes and all (a
    second copy of its Python modules; the library is loaded once). The private copy's boosters and errors
    are not instances of ``xgboost.Booster`` and ``xgboost.core.XGBoostError`` (an ``except`` of the latter
    does not catch them); they save, load and predict as any other (with that copy's own ``DMatrix``), and
    pickle as those of the unpickling process's XGBoost. Should the private import fail (an XGBoost laid out otherwise), the ordinary one is
    used."""
    with _IMPORT_LOCK:
        if not _XGBOOST:
            xgboost = None
            if "xgboost" not in sys.modules and "sklearn" not in sys.modules:
                try:
                    xgboost = _import_private_xgboost()
                except Exception:  # an XGBoost laid out otherwise: the ordinary import, which reports real errors
                    xgboost = None
            if xgboost is None:
                import xgboost
            _XGBOOST.append(xgboost)
    return _XGBOOST[0]


def import_in_background() -> None:
    """Start importing XGBoost in a daemon thread, once per process (:func:`import_xgboost`: 0.3-0.5 s on a
    2-core CPU), spent while the features are computed. :func:`import_xgboost` then finds the module loaded, or waits for the thread to finish it; a
    failed background import is ignored, that import raises the error itself."""
    if _IMPORTER or _XGBOOST:
        return

    def load():
        try:
            import_xgboost()
        except Exception:  # import_xgboost's next call reports it
            pass

    thread = threading.Thread(target=load, name="alibi-vit-import-xgboost", daemon=True)
    _IMPORTER.append(thread)
    thread.start()


class PixelClassifier:
    """An XGBoost model of ``kind`` over pixel rows, trained and saved through XGBoost's own API
    (``xgboost.train``, ``Booster``), which needs no scikit-learn. The random forest is XGBoost's
    random-forest mode, set as ``xgboost.XGBRFClassifier`` sets it (one round of ``n_estimators`` parallel
    trees, learning rate 1, row and feature subsamples, L2 1e-5); boosting is ``n_estimators`` rounds, as
    ``xgboost.XGBClassifier`` sets it. Model files are XGBoost's JSON, read and written by both.

    params: XGBoost's parameters, by their scikit-learn names or their own (``n_estimators`` is the tree
    count: trees of the forest, rounds of boosting). n_jobs: threads (None: XGBoost's default, every core
    or ``OMP_NUM_THREADS``)."""

    _FOREST = {"learning_rate": 1.0, "reg_lambda": 1e-5, "subsample": 0.8, "colsample_bynode": 0.8}

    def __init__(self, kind: str = DEFAULT_CLASSIFIER, seed: int = 0, n_jobs: int | None = None, **params):
        if kind not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {CLASSIFIERS}, got {kind!r}")
        self.kind, self.seed, self.n_jobs = kind, int(seed), n_jobs
        self.params = {**DEFAULTS[kind], **params}
        self.booster = None
        self.n_classes_ = None

    def _training_params(self, n_classes: int) -> tuple[dict, int]:
        params = dict(self.params)
        trees = int(params.pop("n_estimators"))
        if self.kind == "random_forest":
            params, rounds = {**self._FOREST, **params, "num_parallel_tree": trees}, 1
        else:
            rounds = trees
        params.update(objective="multi:softprob" if n_classes > 2 else "binary:logistic", random_state=self.seed)
        if n_classes > 2:
            params["num_class"] = n_classes
        if self.n_jobs is not None:
            params["n_jobs"] = self.n_jobs
        return params, rounds

    def fit(self, X: np.ndarray, y: np.ndarray, sample_weight: np.ndarray | None = None) -> "PixelClassifier":
        """Fit on rows ``X`` and classes ``y`` (0..K-1, K ≥ 2, each present); returns self."""
        xgb = import_xgboost()
        y = np.asarray(y)
        classes = np.unique(y)
        if len(classes) < 2 or not np.array_equal(classes, np.arange(len(classes))):
            raise ValueError(f"classes must be 0..K-1 with K >= 2, each present; got {classes.tolist()}")
        params, rounds = self._training_params(len(classes))
        # QuantileDMatrix for the histogram method, as XGBoost's scikit-learn interface builds it.
        if params.get("tree_method", "hist") in ("hist", "auto"):
            data = xgb.QuantileDMatrix(X, label=y, weight=sample_weight, nthread=self.n_jobs,
                                       max_bin=params.get("max_bin"))
        else:
            data = xgb.DMatrix(X, label=y, weight=sample_weight, nthread=self.n_jobs)
        self.booster = xgb.train(params, data, rounds)
        self.n_classes_ = len(classes)
        return self

    def get_booster(self):
        if self.booster is None:
            raise ValueError("the classifier is not fitted")
        return self.booster

    def set_threads(self, n_jobs: int | None) -> None:
        """Threads for what follows (None: XGBoost's default, every core or ``OMP_NUM_THREADS``)."""
        self.n_jobs = n_jobs
        self.get_booster().set_param({"nthread": 0 if n_jobs is None else n_jobs})

    def predict_proba(self, X: np.ndarray) -> np.ndarray:
        """(n, K) float32 class probabilities of rows ``X``."""
        p = self.get_booster().inplace_predict(X)
        return p if p.ndim == 2 else np.stack([1 - p, p], axis=1)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """(n,) the most probable class of each row."""
        return self.predict_proba(X).argmax(1)

    def save_model(self, path) -> None:
        """XGBoost's JSON model file, marked as a classifier for ``xgboost.XGBClassifier.load_model``."""
        booster = self.get_booster()
        booster.set_attr(scikit_learn=json.dumps({"_estimator_type": "classifier"}))
        try:
            booster.save_model(os.fspath(path))
        finally:
            booster.set_attr(scikit_learn=None)

    def load_model(self, raw) -> "PixelClassifier":
        """Load from a model file's bytes (or path); returns self."""
        xgb = import_xgboost()
        booster = xgb.Booster({"nthread": self.n_jobs} if self.n_jobs is not None else None)
        booster.load_model(raw if isinstance(raw, (bytes, bytearray)) else os.fspath(raw))
        booster.set_attr(scikit_learn=None)
        config = json.loads(booster.save_config())["learner"]["learner_model_param"]
        self.booster, self.n_classes_ = booster, max(int(config["num_class"]), 2)
        return self


def make_classifier(kind: str = DEFAULT_CLASSIFIER, seed: int = 0, n_jobs: int | None = None, **params):
    """An unfitted :class:`PixelClassifier` of ``kind`` ("xgboost" or "random_forest")."""
    return PixelClassifier(kind, seed=seed, n_jobs=n_jobs, **params)


# Fits on fewer rows run on one thread: on a busy machine, OpenMP threads waiting on each other made
# fits of a few thousand rows 10-100x slower than one thread.
SINGLE_THREAD_ROWS = 50_000


def fit_classifier(kind: str, X: np.ndarray, y: np.ndarray, seed: int = 0, params: dict | None = None):
    """A classifier of ``kind`` fitted on rows ``X`` and classes ``y`` (0..K-1), classes balanced, its
    thresholds moved midway between labelled values (:func:`midpoint_thresholds`).

    Unless ``params`` sets ``n_jobs``, the fit uses one thread below :data:`SINGLE_THREAD_ROWS` rows
    and all cores above, and prediction (whole images: many rows) uses all cores."""
    params = dict(params or {})
    threads = params.pop("n_jobs", "auto")
    clf = make_classifier(kind, seed=seed, n_jobs=(1 if len(y) < SINGLE_THREAD_ROWS else None)
                          if threads == "auto" else threads, **params)
    clf.fit(X, y, sample_weight=balanced_weights(y))
    midpoint_thresholds(clf, X)
    if threads == "auto":
        clf.set_threads(None)
    return clf


def midpoint_thresholds(clf, X: np.ndarray):
    """Move every split threshold of the fitted XGBoost ``clf`` midway between the largest value of
    its feature in ``X`` below it and itself; returns ``clf``, changed in place.

    A split sends ``x < t`` left. Each threshold ``t`` of the histogram method is a value of ``X``,
    so the rows of ``X`` fall on the same side of ``t`` and of the new threshold: predictions on
    ``X`` do not change, only those on values no row of ``X`` has. A threshold with no value below
    it, or whose gap is too narrow for a float32 in between, stays where it is."""
    booster = clf.get_booster()
    model = json.loads(booster.save_raw("json"))
    trees = model["learner"]["gradient_booster"]["model"]["trees"]
    features = np.concatenate([np.asarray(t["split_indices"], np.int64) for t in trees])
    thresholds = np.concatenate([np.asarray(t["split_conditions"], np.float32) for t in trees])
    inner = np.concatenate([np.asarray(t["left_children"]) != -1 for t in trees])

    def move(f):
        nodes = np.flatnonzero(inner & (features == f))
        values = np.sort(X[:, f].astype(np.float32, copy=False))
        t = thresholds[nodes]
        k = np.searchsorted(values, t, side="left")  # values[k - 1] < t <= values[k]
        below = values[np.maximum(k - 1, 0)]
        middle = below + (t - below) / np.float32(2)
        moved = (k > 0) & (middle > below) & (middle <= t)
        thresholds[nodes[moved]] = middle[moved]

    # The sorts (a few tenths of a second on 500 000 rows) release the GIL: one feature per thread.
    with ThreadPoolExecutor(max_workers=thread_budget()) as pool:
        list(pool.map(move, np.unique(features[inner])))
    start = 0
    for tree in trees:
        n = len(tree["split_conditions"])
        tree["split_conditions"] = thresholds[start:start + n].tolist()
        start += n
    booster.load_model(bytearray(json.dumps(model).encode()))
    return clf


def balanced_weights(y: np.ndarray) -> np.ndarray:
    """Per-sample weights n / (K·n_k): every class weighs the same in total, whatever its pixel count."""
    counts = np.bincount(y)
    present = counts > 0
    weights = np.zeros(len(counts))
    weights[present] = len(y) / (present.sum() * counts[present])
    return weights[y].astype(np.float32)


def _damaged(path: Path, reason: str) -> ValueError:
    return ValueError(f"{path} is not a readable XGBoost model ({reason[:200]}): the model folder is damaged; "
                      "train it again")


def load_classifier(kind: str, path) -> object:
    """A classifier of ``kind`` from XGBoost's JSON model file ``path``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"classifier model {path} does not exist")
    return _classifier_from(kind, path.read_bytes(), path)


def _classifier_from(kind: str, raw: bytes, path: Path) -> PixelClassifier:
    """A classifier of ``kind`` from the bytes of its model file ``path`` (named in errors)."""
    xgb = import_xgboost()
    clf = make_classifier(kind)
    try:
        clf.load_model(bytearray(raw))
    except (xgb.core.XGBoostError, KeyError, ValueError) as err:  # its message is a C++ stack trace: the first line says what failed
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        reason = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", reason)  # "[08:19:02] src/json.cc:409: " prefix
        raise _damaged(path, reason) from None
    return clf


class PendingClassifier:
    """A classifier that a background thread is loading: importing XGBoost (:func:`import_xgboost`) is part
    of a first ``segment apply``'s start, spent while the image is read and its features computed. Any attribute waits for the load and is the loaded classifier's; a load that
    failed raises its error there. Pickles as the loaded classifier (Dask workers get a plain one)."""

    def __init__(self, kind: str, raw: bytes, path: Path):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._load, args=(kind, raw, path), name="alibi-vit-load-classifier",
                                        daemon=True)
        self._thread.start()

    def _load(self, kind, raw, path):
        try:
            self._result = _classifier_from(kind, raw, path)
        except BaseException as err:  # noqa: BLE001 - re-raised in the thread that uses the classifier
            self._error = err

    def loaded(self):
        """The classifier, once loaded (waits for it)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def __getattr__(self, name):
        if name.startswith("_"):  # the thread's own state, and copy/pickle probes before __init__ ran
            raise AttributeError(name)
        return getattr(self.loaded(), name)

    def __reduce__(self):
        return self.loaded().__reduce__()


def load_classifier_in_background(kind: str, path) -> PendingClassifier:
    """A :class:`PendingClassifier` of ``kind`` from ``path``, read now (the folder may be gone by the time the
    thread loads it: a Dask worker's temporary copy is). What can be checked at once is checked here, so that a
    missing or damaged file is reported before any image is read: the file exists and is JSON."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"classifier model {path} does not exist")
    raw = path.read_bytes()
    try:
        json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise _damaged(path, f"not valid JSON: {err}") from None
    return PendingClassifier(kind, raw, path)
