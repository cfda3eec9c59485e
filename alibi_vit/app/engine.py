"""The app's compute side: features in the background, training, prediction, Save and Predict-all jobs.

Compute runs on one worker thread (:mod:`~alibi_vit.app.scheduler`) by priority: a Train and the
prediction of the region on screen first (``NOW``), then the features of the image on screen, the
rest of its prediction and saving the model (``SHOWN``), then the features of images opened
earlier and Predict all (``BACKGROUND``). Feature computations and predictions give way between
tiles to anything more urgent, so a Train waits only for the features of the tiles it trains on,
however large an image opened before is.

Images are predicted block by block (:mod:`~alibi_vit.app.predictions`): the blocks of the region
on screen first (Train, and each new view, answer once it is predicted: at most ``REGION_BUDGET``
pixels of it), then the rest of the shown image in the background, nearest the view first, while
the overlay fills in. Nothing waits for a whole image to be featurised. Features are cached (one
:class:`~alibi_vit.trainable.cache.FeatureCache`, bounded in bytes, keyed by image and tile): those
of images that take at most half the cache are computed in the background when the image is
opened; those of big images (read chunk by chunk) and larger ones only for the tiles trained on and
on screen, and a pass over a whole image reads the cache without filling it (:class:`PeekCache`),
so it does not evict what Train needs after each stroke. Memory is that cache plus a few tiles.

Each trained model is saved in the session folder (:mod:`~alibi_vit.app.model_store`) and restored
by a restarted app. Save jobs run on their own thread with a copy of that saved model (exactly what
``alibi-vit segment apply`` would load); they write label images first (the cheapest and most
valuable output) and the area-fraction CSV after every image, so a cancelled or interrupted Save
leaves everything done so far.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import threading
import time
import traceback
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .labels import SparseLabels, pooled_labels
from .model_store import ModelStore
from .predictions import PredictionStore
from .pyramid import Pyramid, level_shapes, tile_region
from .scheduler import Cancelled, Scheduler
from .session import Session, SessionError, png_bytes, remember, write_atomic

__all__ = ["APP_TILE", "BACKGROUND", "Engine", "Job", "NOW", "PeekCache", "REGION_BUDGET", "SHOWN"]

SAVE_KINDS = ("labels", "model", "masks", "overlays", "fractions")
DISPLAY_SAMPLE = 1 << 20  # pixels an image's display range is fitted on
KEEP_PREDICTIONS = 4  # images whose predictions (and scaled pixels, display levels) are kept
NOW, SHOWN, BACKGROUND = 0, 1, 2  # task priorities (lower runs first)
REGION_BUDGET = 4 << 20  # px of the region on screen predicted before Train or a new view is answered
PASS_SCRATCH_BYTES = 256 << 20  # features a whole-image pass keeps for itself (neighbouring tiles' ViT windows)
# The featurisation tile of the models the app trains (37 patches; the library's default is 1036): a Train
# featurises the whole tiles that hold labels and a view's prediction the tiles it overlaps, so smaller tiles
# compute less beyond what is labelled and on screen (on a 4096² image, labels and view across a tile corner:
# four 650² tile-plus-halo crops instead of four 1168² ones). Features do not depend on the tile size.
APP_TILE = 518


def _rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


class PeekCache:
    """The feature cache as a pass over a whole image uses it: what is cached is used, what is
    computed is not added (it would evict the features of the tiles on screen and labelled, which
    every retraining needs) but kept in a small cache of the pass's own: ``PASS_SCRATCH_BYTES`` with
    a backbone (whose window features neighbouring tiles share), none for classical features (a
    pass computes each tile's once)."""

    def __init__(self, cache, seg):
        from ..trainable.cache import FeatureCache

        self.cache, self.scratch = cache, FeatureCache(PASS_SCRATCH_BYTES if seg.vit is not None else 0)

    def get(self, key: str, compute):
        if key in self.cache:
            return self.cache.get(key, compute)
        return self.scratch.get(key, compute)


class Job:
    """A cancellable background job with progress; ``result``: what a job made for the page (a Measure
    job's measurement), in its record once it is done."""

    def __init__(self, job_id: str, total: int, folder: Path | None):
        self.id, self.total, self.folder = job_id, total, folder
        self.done, self.state, self.message = 0, "running", ""
        self.result = None
        self.cancelled = threading.Event()

    def finish(self, state: str, message: str, result=None) -> None:
        self.result = result  # before the state: a poll that sees "done" sees the result
        self.state, self.message = state, message

    def record(self) -> dict:
        record = {"job": self.id, "state": self.state, "progress": self.done / max(self.total, 1), "done": self.done,
                  "total": self.total, "message": self.message,
                  "folder": None if self.folder is None else str(self.folder)}
        if self.result is not None:
            record["result"] = self.result
        return record


class Engine:
    """Features, model and predictions of one session.

    backbone: the ViT the page may add to the classical features (None: classical only), with
    ``backbone_kwargs`` for :class:`~alibi_vit.trainable.TrainableSegmenter` (checkpoint, pretrained,
    model_kwargs, seed). cache_bytes: the feature cache's budget. out: where Save writes. feature_tile:
    the featurisation tile of the models Train makes (``APP_TILE``; stored with each model, so a model
    restored or saved keeps its own).
    """

    def __init__(self, session: Session, backbone: str | None = None, backbone_kwargs: dict | None = None,
                 cache_bytes: int = int(1.5 * 2**30), out: Path | None = None, device: str | None = None,
                 feature_tile: int = APP_TILE):
        from ..trainable.cache import FeatureCache

        self.session, self.backbone, self.backbone_kwargs = session, backbone, dict(backbone_kwargs or {})
        self.out = Path(out) if out else session.folder / "export"
        self.device, self.feature_tile = device, feature_tile
        self.cache = FeatureCache(cache_bytes)
        self.scheduler = Scheduler()
        self.features: dict[str, dict] = {}  # id → {"state", "progress", "error", "note"}
        self.shown: str | None = None  # the image last opened: the one on screen
        self._trainer = None  # the segmenter of the current settings, which Train fits
        self._trainer_key = None
        self._model_seg = None  # the fitted segmenter predictions come from (the trainer, or one restored)
        self.model = None  # record of the trained model: id, classes, seconds, images, pixels, versions, key
        self._model_ids = itertools.count(1)
        self.predictions: OrderedDict[str, PredictionStore] = OrderedDict()  # the latest of a few images
        self.predicted: dict[str, dict] = {}  # id → summary of the latest prediction of every image predicted
        self.focus: dict[str, tuple] = {}  # id → the region last on screen, whose prediction goes first
        self.jobs: dict[str, Job] = {}
        self._job_ids = itertools.count(1)
        self._lock = threading.Lock()  # the dicts below are read by request threads too
        self._sources: OrderedDict[str, object] = OrderedDict()
        self._pyramids: OrderedDict[str, Pyramid] = OrderedDict()
        self._display: OrderedDict[str, bytes] = OrderedDict()
        self._display_locks: dict[str, threading.Lock] = {}
        self._display_ranges: dict[str, tuple[float, float]] = {}  # id → the page's black and white points
        self.store = ModelStore(session.folder / "model")
        self.notes: list[str] = []  # shown in the page: what the engine could not do at start
        self._closed = False
        shutil.rmtree(session.folder / "cache" / "predictions", ignore_errors=True)  # of models gone
        # The classifier library takes a while to import (XGBoost pulls in SciPy): while
        # the user draws, not after the first click on Train. Through the same background import a fit starts:
        # a thread of our own importing xgboost while that one imports xgboost.sklearn left the module half made
        # (Python's import locks took the two for a deadlock), and a Train in the first seconds failed with
        # "module 'xgboost' has no attribute 'XGBRFClassifier'".
        from ..trainable.classifier import import_in_background

        import_in_background()
        self._restore_model()

    def close(self) -> None:
        """Stop: jobs and background work are cancelled; the last model is saved first."""
        if self._closed:
            return
        self._closed = True
        for job in self.jobs.values():
            job.cancelled.set()
        self.scheduler.cancel(lambda key: key[0] != "persist", "the server is shutting down")
        try:
            self._persist_now()
        except Exception:  # noqa: BLE001 - a model not saved is trained again; the labels are safe
            traceback.print_exc()
        self.scheduler.close()

    def _wait(self, task):
        """Wait on this thread for a worker task's result."""
        try:
            return task.future.result()
        finally:
            self.scheduler.release(task)

    # ---- the segmenter ----------------------------------------------------------------------
    def backbones(self) -> list:
        return [None] + ([self.backbone] if self.backbone else [])

    def backbone_weights(self) -> str | None:
        """What the --backbone's weights are, in words (None without one)."""
        if self.backbone is None:
            return None
        if self.backbone_kwargs.get("checkpoint"):
            return f"checkpoint {self.backbone_kwargs['checkpoint']}"
        if self.backbone_kwargs.get("pretrained"):
            return "timm's pretrained weights"
        return (f"random initialisation (seed {self.backbone_kwargs.get('seed', 0)}): its features carry no learned "
                "meaning; for checking the pipeline only")

    def _settings_key(self) -> tuple:
        return (self.session.settings.get("backbone"), self.session.fix_intensity(), self.session.colour)

    def segmenter(self):
        """The segmenter of the current settings (rebuilt when the backbone choice changes; a CRF
        change only switches its post-processing). Worker thread only."""
        from ..trainable import TrainableSegmenter

        key = self._settings_key()
        if self._trainer_key != key:
            backbone = key[0]
            kwargs = self.backbone_kwargs if backbone else {}
            self._trainer = TrainableSegmenter(backbone, intensity_range=key[1], colour=key[2], cache=self.cache,
                                               device=self.device, tile=self.feature_tile, **kwargs)
            self._trainer_key = key
        self._trainer.crf = self._crf()
        return self._trainer

    def _crf(self):
        from ..trainable.segmenter import DEFAULT_CRF_PRESET

        return DEFAULT_CRF_PRESET if self.session.settings.get("crf") else False

    def current_model(self) -> dict | None:
        """The trained model's record when it belongs to the current backbone choice, else None."""
        model = self.model
        return None if model is None or model["key"][0] != self.session.settings.get("backbone") else model

    def model_state(self) -> dict | None:
        """The model as /api/state shows it: its record and whether labels changed since it was trained."""
        model = self.current_model()
        if model is None:
            return None
        trained_on = model["versions"]
        changed = any(v != trained_on.get(i, 0) for i, v in self.session.versions().items())
        return {k: model[k] for k in ("id", "classes", "seconds", "images", "pixels")} | {"labels_changed": changed}

    def backbone_changed(self) -> None:
        """Drop the feature work of the old backbone (predictions are kept per model and CRF setting,
        and the model shows only with the backbone it was trained with)."""
        self.scheduler.cancel(lambda key: key[0] in ("features", "predict", "region", "fill"),
                              "cancelled: the backbone changed")
        self.features.clear()

    def _restore_model(self) -> None:
        try:
            restored = self.store.load(self.device)
        except Exception as err:  # noqa: BLE001 - the app starts without it; the labels are all there
            self._note(f"the last trained model could not be restored ({err}): press Train")
            return
        if restored is None:
            return
        seg, record = restored
        session = self.session
        if record["key"] != [session.settings.get("backbone"), session.intensity_range, session.colour]:
            self._note(f"the last trained model (#{record['id']}) belongs to other settings: not restored")
            return
        seg.cache = self.cache
        self._model_seg, self.model = seg, record
        self._model_ids = itertools.count(record["id"] + 1)

    def _note(self, text: str) -> None:
        self.notes.append(text)
        print(f"alibi-vit app: {text}", file=sys.stderr, flush=True)

    # ---- features ---------------------------------------------------------------------------
    def feature_state(self, image_id: str) -> dict:
        return self.features.get(image_id, {"state": "pending", "progress": 0.0, "error": None, "note": None})

    def _feature_bytes(self, image_id: str) -> int:
        """Memory the cached classical features of an image take (the current filter set's)."""
        from ..trainable.classical import classical_feature_names

        shape = self.session.entry(image_id).shape
        channels = shape[2] if len(shape) == 3 and self.session.colour == "channels" else 1
        seg = self.segmenter()
        return int(np.prod(shape[:2])) * channels * len(classical_feature_names(seg.sigmas, seg.filters)) * 4

    def _fits_cache(self, image_id: str) -> bool:
        """Whether an image's features are worth caching whole: at most half the cache, so that keeping
        them does not evict the features of every other image (those Train needs after each stroke)."""
        return self._feature_bytes(image_id) <= self.cache.max_bytes / 2

    def open(self, image_id: str) -> dict:
        """The image is on screen: its features are computed before those of images opened earlier
        (in the background; once), and the prediction filling in another image stops; returns its
        feature state. A big image, or one whose features would take more than half the cache, has
        its features computed tile by tile when trained on or predicted (what is on screen first)."""
        entry = self.session.entry(image_id)
        self.shown = image_id
        self.scheduler.reprioritise(lambda key: key[0] == "features" and key[1] != image_id, BACKGROUND)
        self.scheduler.cancel(lambda key: key[0] == "fill" and key[1] != image_id, "another image is shown")
        self._start_fill(image_id)  # a prediction begun before: the rest of it fills in
        state = self.feature_state(image_id)
        if state["state"] == "ready":
            return state
        if entry.chunked or not self._fits_cache(image_id):
            why = "it is read chunk by chunk" if entry.chunked else \
                f"its features ({self._feature_bytes(image_id) / 2**30:.1f} GB) would take more than half the " \
                f"feature cache ({self.cache.max_bytes / 2**30:.1f} GB, --cache-gb)"
            state = self.features[image_id] = {
                "state": "on demand", "progress": 0.0, "error": None,
                "note": f"{why}: its features are computed tile by tile when it is trained on or predicted (what is "
                        "on screen first), and those of the tiles on screen or labelled are kept in the cache"}
            return state
        if state["state"] != "running":
            state = self.features[image_id] = {"state": "running", "progress": 0.0, "error": None, "note": None}
        self.scheduler.submit(("features", image_id), lambda: self._compute_features(image_id), SHOWN, keep=True)
        return state

    def _compute_features(self, image_id: str) -> None:
        state = self.features.get(image_id)
        if state is None or state["state"] == "ready":
            return

        def progress(done, total):
            state["progress"] = done / total
            self.scheduler.checkpoint()

        try:
            self.segmenter().precompute(self.session.read(image_id), progress)
            state["state"], state["progress"] = "ready", 1.0
        except Cancelled:
            self.features.pop(image_id, None)
            raise
        except Exception as err:  # noqa: BLE001 - shown in the page; the server keeps running
            state["state"], state["error"] = "error", str(err) or type(err).__name__
            if not isinstance(err, ValueError):
                traceback.print_exc()

    def _source(self, image_id: str, seg):
        """What the features of an image are computed from, scaled by the session's intensity range (as
        every segmenter of the session scales it): the scaled image, or a big image's chunked view;
        kept for a few images."""
        with self._lock:
            if image_id in self._sources:
                return self._sources[image_id]
        src = seg.source(self.session.read(image_id), self.session.entry(image_id).name)
        with self._lock:
            return remember(self._sources, image_id, src, KEEP_PREDICTIONS)

    # ---- what the page shows: whole images, and tiles at display levels ------------------------
    def display_range(self, image_id: str) -> tuple[float, float]:
        """The black and white points the page shows an image with: its own, fitted as the session's
        range is but on this image alone (on every k-th row and column, about a megapixel; of a big
        image, on its coarsest display level: what the page shows zoomed out, read or built anyway,
        so the range costs no other read of its file). The classifier keeps the session's range (one
        scale for every image's features); only the page shows each image spanning 0-255, so an image
        of 1000-3000 beside one of 2000-53000 is not shown black."""
        from ..chunked import ChunkedImage
        from ..images import fit_intensity_range

        with self._lock:
            if image_id in self._display_ranges:
                return self._display_ranges[image_id]
        self.session.fix_intensity()  # decides the session's colour handling, which this range follows
        image = self.session.read(image_id)
        if isinstance(image, ChunkedImage):
            pyramid = self._pyramid(image_id)
            h, w = pyramid.shapes[-1]
            sample = pyramid.region(len(pyramid.shapes) - 1, slice(0, h), slice(0, w))
        else:  # a strided sample: a 4096² image's random one takes 0.3 s, this 0.04 s
            step = max(1, int(np.ceil(np.sqrt(image.shape[0] * image.shape[1] / DISPLAY_SAMPLE))))
            sample = image[::step, ::step]
        try:
            found = fit_intensity_range([sample], colour=self.session.colour == "channels")
        except ValueError:  # no finite pixel: the session's range (the image shows black)
            found = self.session.fix_intensity()
        with self._lock:
            self._display_ranges[image_id] = found
        return found

    def _to_display(self, pixels, image_id: str) -> np.ndarray:
        """8-bit pixels of an image (or of a region or display level of it) for the page, scaled by the
        image's own display range (:meth:`display_range`)."""
        from ..images import scale_to_range

        lo, hi = self.display_range(image_id)
        x = scale_to_range(pixels, lo, hi, source=self.session.entry(image_id).name,
                           colour=self.session.colour == "channels")
        return (np.clip(x[..., :3] if x.ndim == 3 else x, 0, 1) * 255).round().astype(np.uint8)

    def refuse_chunked(self, image_id: str, what: str) -> None:
        entry = self.session.entry(image_id)
        if entry.chunked:
            raise SessionError(f"{entry.name} is read chunk by chunk: its {what} is sent as tiles at display levels "
                               "(/api/images/{id}/tiles/...), never whole", status=413)

    def display_png(self, image_id: str) -> bytes:
        """8-bit PNG of an image read whole, for the page. Made on the request's thread: showing an image
        never waits for features."""
        self.refuse_chunked(image_id, "image")
        # Many requests for one image at once make its PNG once (a 4096² one takes GBs to make).
        with self._display_locks.setdefault(image_id, threading.Lock()):
            if image_id in self._display:
                return self._display[image_id]
            data = png_bytes(self._to_display(self.session.read(image_id), image_id))
            return remember(self._display, image_id, data, KEEP_PREDICTIONS)

    def _pyramid(self, image_id: str) -> Pyramid:
        with self._lock:
            if image_id in self._pyramids:
                return self._pyramids[image_id]
        entry = self.session.entry(image_id)
        pyramid = Pyramid(self.session.read(image_id),
                          self.session.folder / "cache" / "pyramids" / image_id if entry.chunked else None)
        with self._lock:
            return remember(self._pyramids, image_id, pyramid, KEEP_PREDICTIONS)

    def tile(self, image_id: str, layer: str, level: int, row: int, col: int) -> tuple[bytes, dict]:
        """(PNG, headers) of one display tile (:mod:`~alibi_vit.app.pyramid`) of a layer: ``image`` (8-bit,
        grey or RGB), ``labels`` (label values, each pixel the largest of its block; header
        X-Labels-Version), ``prediction`` (class values, 0 where not predicted yet) or ``uncertainty``
        (grey 1 − max probability with alpha 0 where not predicted); the last two of the latest
        prediction of the image (headers X-Model, X-CRF, X-Predicted), 409 before there is one."""
        entry = self.session.entry(image_id)
        rows, cols = tile_region(level_shapes(entry.shape[:2]), level, row, col)
        if layer == "image":
            return png_bytes(self._to_display(self._pyramid(image_id).region(level, rows, cols), image_id)), {}
        if layer == "labels":
            labels, version = self.session.labels_and_version(image_id)
            return png_bytes(pooled_labels(labels, level, rows, cols)), {"X-Labels-Version": str(version)}
        with self._lock:
            store = self.predictions.get(image_id)
        if store is None:
            raise SessionError(f"nothing is predicted for {entry.name} yet: press Train or Predict", status=409)
        headers = {"X-Model": str(store.model), "X-CRF": "true" if store.crf else "false",
                   "X-Predicted": f"{store.predicted:.4f}"}
        mask = store.read("mask", level, rows, cols)
        if layer == "prediction":
            return png_bytes(mask), headers
        alpha = np.where(mask > 0, 255, 0).astype(np.uint8)
        return png_bytes(np.stack([store.read("uncertainty", level, rows, cols), alpha], axis=-1), "LA"), headers

    # ---- training and prediction --------------------------------------------------------------
    def check_region(self, image_id: str, region) -> tuple[slice, slice] | None:
        """A region [top, left, bottom, right] in image pixels as (rows, cols), clipped to the image;
        a 400 SessionError when it is not one or holds no pixel of the image."""
        if region is None:
            return None
        h, w = self.session.entry(image_id).shape[:2]
        if not np.isfinite(np.asarray(region, np.float64)).all():  # JSON as Python reads it allows NaN, Infinity
            raise SessionError(f"region {list(region)} must be four finite numbers [top, left, bottom, right] in "
                               "image pixels")
        top, left, bottom, right = (int(np.floor(v)) for v in region)
        rows, cols = slice(max(top, 0), min(bottom, h)), slice(max(left, 0), min(right, w))
        if rows.stop <= rows.start or cols.stop <= cols.start:
            raise SessionError(f"region {list(region)} holds no pixel of the {w}×{h} px image")
        return rows, cols

    def submit_train(self, image_id: str | None = None, region=None):
        """Queue a Train, then the prediction of ``image_id`` (of ``region`` on screen first, the rest
        following in the background; the whole image without a region); a Train still queued is
        superseded."""
        if image_id is not None:
            self.session.entry(image_id)
            region = self.check_region(image_id, region)
            if region is not None:
                self.focus[image_id] = region
        return self.scheduler.submit(("train",), lambda: self._train(image_id, region), NOW, replace=True)

    def _labels_for_training(self, image_id: str, labels):
        """A label image as the segmenter reads it: an array, or a big image's sparse labels seen as a
        chunked image (read tile by tile, like a label store on disk)."""
        if not isinstance(labels, SparseLabels):
            return labels
        from ..chunked import ChunkedImage

        return ChunkedImage(f"labels of {self.session.entry(image_id).name}", "yx", [labels],
                            f"labels|{image_id}", labels.chunks)

    def _train(self, image_id, region=None):
        session = self.session
        ids = session.labelled_ids()
        present = sorted({int(v) for i in ids for v in session.counts(i)})  # counts kept per label version
        if len(present) < 2:
            names = [session.class_by_value(v)["name"] for v in present]
            have = f"only {names[0]!r} is labelled" if names else "nothing is labelled yet"
            raise SessionError(f"Train needs scribbles of at least two classes: {have}")
        with session.lock:  # the label versions trained on, to tell when the model is stale
            versions = session.versions()
            labels = {i: session.label_image(i) for i in ids}  # replaced on change, never written in place
        seg = self.segmenter()
        key = self._trainer_key
        start = time.perf_counter()
        # The images as the engine keeps them scaled (and hashed, for the cache's keys) for its predictions.
        seg.fit([self._source(i, seg) for i in ids], [self._labels_for_training(i, labels[i]) for i in ids])
        for i in ids:
            if not session.entry(i).chunked:
                self.features[i] = {"state": "ready", "progress": 1.0, "error": None, "note": None}
        self.model = {"id": next(self._model_ids), "classes": [int(c) for c in seg.classes_],
                      "seconds": round(time.perf_counter() - start, 3), "images": len(ids),
                      "pixels": int(sum(sum(session.counts(i).values()) for i in ids)),
                      "versions": versions, "key": [key[0], list(key[1]), key[2]]}
        self._model_seg = seg
        self.scheduler.cancel(lambda k: k[0] == "fill", "a newer model was trained")
        self.scheduler.submit(("persist",), self._persist, SHOWN, keep=True)
        result = {"model": self.model_state()}
        if image_id is not None:
            budget = REGION_BUDGET if region is not None else None
            self._predict_blocks(image_id, region, budget=budget,
                                 keep_features=region is not None or self._fits_cache(image_id))
            self._start_fill(image_id)
            result["prediction"] = self.prediction_record(image_id)
        return result

    def _persist(self) -> None:
        """Save the current model in the session folder (if it is not yet)."""
        model = self.model
        if model is not None and self._model_seg is not None:
            self.store.save(self._model_seg, model)

    def _persist_now(self) -> None:
        self._wait(self.scheduler.submit(("persist",), self._persist, NOW))

    def _crf_for(self, image_id: str):
        """The CRF preset an image's prediction uses: the setting's, except for a big image, predicted
        block by block in the page (the CRF looks past blocks): Save applies it there."""
        return False if self.session.entry(image_id).chunked else self._crf()

    def _store(self, image_id: str) -> PredictionStore:
        """The current model's prediction of an image (a new, empty one when the model or the CRF
        setting changed); the predictions of a few images are kept."""
        model = self.current_model()
        if model is None or self._model_seg is None:
            raise SessionError("no trained model yet: label at least two classes and press Train", status=409)
        crf = self._crf_for(image_id)
        with self._lock:
            store = self.predictions.get(image_id)
            if store is not None and store.model == model["id"] and store.crf == crf:
                self.predictions.move_to_end(image_id)
                return store
        entry = self.session.entry(image_id)
        folder = self.session.folder / "cache" / "predictions" / image_id if entry.chunked else None
        if store is not None:
            store.remove()
        store = PredictionStore(entry.shape[:2], self._model_seg.tile, self._model_seg.classes_, model["id"], crf,
                                folder)
        with self._lock:
            self.predictions[image_id] = store
            while len(self.predictions) > KEEP_PREDICTIONS:
                self.predictions.popitem(last=False)[1].remove()
        return store

    def _predict_blocks(self, image_id: str, region=None, budget: int | None = None, focus=None,
                        keep_features: bool = True) -> PredictionStore:
        """Predict the blocks of an image the current model has not predicted yet: those overlapping
        ``region`` ((rows, cols); None: all), tile by tile, the tiles nearest ``focus`` (default the
        region) first, until ``budget`` pixels are done (None: no limit). Gives way between tiles.
        ``keep_features``: the tiles' features are kept in the cache (what is on screen or labelled);
        else only read from it, so that a pass over a big image does not evict them."""
        store = self._store(image_id)
        seg = self._model_seg
        seg.crf = store.crf
        src = self._source(image_id, seg)
        if store.crf:  # the CRF looks past tiles: the whole image at once (only images read whole get it)
            if not store.complete:
                (proba,) = seg.predict_proba([src.pixels], scaled=True,
                                             on_progress=lambda *_: self.scheduler.checkpoint())
                store.write((slice(0, src.shape[0]), slice(0, src.shape[1])), proba)
                self._summarise(image_id, store)
            return store
        tiles = seg.tile_grid(src).covering(region) if region is not None else list(seg.tile_grid(src))
        centre = focus if focus is not None else region
        if centre is not None:
            cy, cx = ((s.start + s.stop) / 2 for s in centre)
            tiles.sort(key=lambda t: (((t.core[0].start + t.core[0].stop) / 2 - cy) ** 2
                                      + ((t.core[1].start + t.core[1].stop) / 2 - cx) ** 2))
        cache = seg.cache
        seg.cache = self.cache if keep_features else PeekCache(self.cache, seg)
        spent = 0
        try:
            for tile in tiles:
                if budget is not None and spent >= budget:
                    break
                part = store.pending(tile.core, region)
                if part is None:
                    continue
                store.write(part, seg.tile_proba(src, tile, part))
                spent += (part[0].stop - part[0].start) * (part[1].stop - part[1].start)
                self._summarise(image_id, store)
                self.scheduler.checkpoint()
        finally:
            seg.cache = cache
        return store

    def _start_fill(self, image_id: str) -> None:
        """The rest of the shown image's prediction, in the background, nearest the region on screen first."""
        with self._lock:
            store = self.predictions.get(image_id)
        if image_id == self.shown and store is not None and not store.complete:
            self.scheduler.submit(("fill", image_id), lambda: self._fill(image_id), SHOWN, keep=True)

    def _fill(self, image_id: str) -> None:
        if self.current_model() is not None and image_id == self.shown:
            self._predict_blocks(image_id, focus=self.focus.get(image_id), keep_features=False)

    def submit_region(self, image_id: str, region):
        """Queue the prediction of the region on screen ([top, left, bottom, right]; at most
        REGION_BUDGET pixels of it before the answer), the rest of the image following; a request
        still queued for the image is superseded."""
        self.session.entry(image_id)
        region = self.check_region(image_id, region)
        self.focus[image_id] = region

        def run():
            self._predict_blocks(image_id, region, budget=REGION_BUDGET)
            self._start_fill(image_id)
            return self.prediction_record(image_id)

        return self.scheduler.submit(("region", image_id), run, NOW if image_id == self.shown else SHOWN,
                                     replace=True)

    def _predict(self, image_id: str) -> PredictionStore:
        """The current model's whole prediction of an image (what is not predicted yet, computed now)."""
        return self._predict_blocks(image_id, keep_features=self._fits_cache(image_id))

    def submit_prediction(self, image_id: str):
        """Queue the whole prediction of an image (joining one queued or running): first for the image on screen."""
        self.session.entry(image_id)
        return self.scheduler.submit(("predict", image_id), lambda: self._predict(image_id),
                                     NOW if image_id == self.shown else SHOWN)

    def _summarise(self, image_id: str, store: PredictionStore) -> None:
        counts, total = store.fractions()
        self.predicted[image_id] = {
            "model": store.model, "crf": bool(store.crf), "predicted": round(store.predicted, 4),
            "complete": store.complete,
            "fractions": {str(int(c)): (float(n) / total if total else 0.0) for c, n in zip(store.classes, counts)}}

    def prediction_record(self, image_id: str) -> dict | None:
        """The latest prediction of an image as the page shows it: model, CRF, the share of the image
        predicted so far and the area fractions over that share (null before any)."""
        summary = self.predicted.get(image_id)
        if summary is None:
            return None
        names = {c["value"]: c for c in self.session.classes}
        fractions = [{"value": int(v), "name": names.get(int(v), {}).get("name", f"class {v}"),
                      "color": names.get(int(v), {}).get("color"), "fraction": f}
                     for v, f in summary["fractions"].items()]
        return {**summary, "fractions": fractions}

    def fractions_of(self, store: PredictionStore) -> list[dict]:
        """Pixels and area fraction of each class of the session in a (whole) prediction."""
        counts, total = store.fractions()
        by_value = dict(zip(store.classes.tolist(), counts.tolist()))
        return [{"value": c["value"], "name": c["name"], "color": c["color"], "pixels": int(by_value.get(c["value"], 0)),
                 "fraction": by_value.get(c["value"], 0) / total if total else 0.0} for c in self.session.classes]

    def colours(self) -> np.ndarray:
        """(256, 3) uint8: the colour of each label value (the session's class colours; 0 black)."""
        table = np.zeros((256, 3), np.uint8)
        for c in self.session.classes:
            table[c["value"]] = _rgb(c["color"])
        return table

    def whole(self, store: PredictionStore, kind: str) -> np.ndarray:
        """The full-resolution mask or uncertainty of a (complete) prediction."""
        h, w = store.shape
        return store.read(kind, 0, slice(0, h), slice(0, w))

    def prediction_png(self, store: PredictionStore) -> bytes:
        mask = self.whole(store, "mask")
        rgba = np.concatenate([self.colours()[mask], np.full(mask.shape + (1,), 255, np.uint8)], axis=-1)
        return png_bytes(rgba)

    def mask_png(self, store: PredictionStore) -> bytes:
        return png_bytes(self.whole(store, "mask"))

    def uncertainty_png(self, store: PredictionStore) -> bytes:
        """1 − max probability, 255 at the most uncertain possible (1 − 1/K)."""
        return png_bytes(self.whole(store, "uncertainty"))

    def predict_all(self) -> Job:
        """Start a job predicting every image with the current model (in the background: what the
        user waits for goes first); each image's area fractions then show in the image list."""
        model = self.current_model()
        if model is None:
            raise SessionError("no trained model yet: label at least two classes and press Train", status=409)
        ids = list(self.session.images)
        job = self._new_job(len(ids), None)

        def run():
            failed = []
            for image_id in ids:
                if job.cancelled.is_set():
                    return job.finish("cancelled", f"cancelled after {job.done} of {job.total} images")
                task = self.scheduler.submit(("predict", image_id), lambda i=image_id: self._predict(i), BACKGROUND)
                try:
                    while not task.future.done():
                        if job.cancelled.wait(0.2):
                            return job.finish("cancelled", f"cancelled after {job.done} of {job.total} images")
                    task.future.result()
                except Cancelled as err:  # the backbone changed, the server stops
                    return job.finish("cancelled", f"{err} after {job.done} of {job.total} images")
                except SessionError as err:  # this image (say, its file has gone): the others still
                    failed.append(f"{image_id}: {err}")
                finally:
                    self.scheduler.release(task)
                job.done += 1
            done = f"predicted {job.total - len(failed)} of {job.total} images with model #{model['id']}"
            job.finish("done" if not failed else "error", done + (f"; failed: {'; '.join(failed)}" if failed else ""))

        threading.Thread(target=self._guarded, args=(job, run), daemon=True).start()
        return job

    def start_job(self, total: int, folder: Path | None, run) -> Job:
        """Start ``run(job)`` as a background job on a thread of its own: it sets ``job.done`` and
        ``job.total`` as it goes, stops when ``job.cancelled`` is set and ends with ``job.finish``; an
        exception it raises is the job's error."""
        job = self._new_job(total, folder)
        threading.Thread(target=self._guarded, args=(job, lambda: run(job)), daemon=True).start()
        return job

    def _new_job(self, total: int, folder: Path | None) -> Job:
        job = Job(f"j{next(self._job_ids)}", total, folder)
        self.jobs[job.id] = job
        return job

    @staticmethod
    def _guarded(job: Job, run) -> None:
        try:
            run()
        except Exception as err:  # noqa: BLE001 - reported to the page
            job.state, job.message = "error", str(err) or type(err).__name__
            if not isinstance(err, (ValueError, OSError)):
                traceback.print_exc()

    # ---- saving -------------------------------------------------------------------------------
    def save(self, what, scope: str = "image", image_id: str | None = None) -> Job:
        """Start a Save job writing ``what`` (a subset of SAVE_KINDS) for one image or all."""
        what = list(dict.fromkeys(what or []))
        unknown = [w for w in what if w not in SAVE_KINDS]
        if not what or unknown:
            raise SessionError(f"choose what to save among {', '.join(SAVE_KINDS)}"
                               + (f" (unknown: {', '.join(map(str, unknown))})" if unknown else ""))
        if scope not in ("image", "all"):
            raise SessionError(f"scope must be 'image' or 'all', got {scope!r}")
        needs_model = [w for w in what if w != "labels"]
        model = self.current_model()
        if needs_model and model is None:
            raise SessionError(f"saving {', '.join(needs_model)} needs a trained model: press Train first", status=409)
        if scope == "image":
            self.session.entry(image_id)
        ids = list(self.session.images) if scope == "all" else [image_id]
        per_image = [w for w in what if w in ("masks", "overlays", "fractions")]
        job = self._new_job(len(ids) if per_image else 0, self.out)
        threading.Thread(target=self._guarded, args=(job, lambda: self._save_job(job, what, ids, model)),
                         daemon=True).start()
        return job

    def _save_job(self, job: Job, what, ids, model) -> None:
        """Labels first, then the model, then per image masks, overlays and fractions (the CSV is
        rewritten after each image), checking for Cancel between images (and between the tiles of a
        big image, whose outputs so far are then removed)."""
        from ..trainable import TrainableSegmenter

        written = []
        if "labels" in what:
            self._write_labels(ids)
            written.append("labels")
        seg = private = None
        if set(what) - {"labels"}:
            self._persist_now()
            folder = self.out / "model" if "model" in what else self.out / f".model-{job.id}"
            model = self.store.copy_current(folder)
            if "model" in what:
                self._name_classes(folder / "config.json")
                written.append(f"model #{model['id']}")
            else:
                private = folder
            if {"masks", "overlays", "fractions"} & set(what):
                seg = TrainableSegmenter.load(folder, device=self.device)
                seg.cache = self.cache  # same settings, same keys: open images are not featurised again
        try:
            rows = []
            for image_id in ids if seg is not None else []:
                try:
                    if job.cancelled.is_set():
                        raise Cancelled("cancelled")
                    self._save_image(image_id, what, seg, rows, job)
                except Cancelled:
                    done = f"; {', '.join(written)} written" if written else ""
                    return job.finish("cancelled", f"cancelled after {job.done} of {job.total} images{done}")
                job.done += 1
            written += [w for w in ("masks", "overlays", "fractions") if w in what]
            job.finish("done", f"saved {', '.join(written)} to {self.out}")
        finally:
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)

    def _save_image(self, image_id: str, what, seg, rows: list, job: Job) -> None:
        from ..trainable.io import area_fractions, overlay, write_fractions_csv, write_mask, write_overlay

        entry = self.session.entry(image_id)
        image = self.session.read(image_id)
        if entry.chunked:
            counts = self._save_streamed(image_id, image, what, seg, job)
        else:
            mask = seg.predict([image])[0]
            counts = (area_fractions(mask, seg.classes_)[0], mask.size)
            if "masks" in what:
                write_mask(self.out / "masks" / f"{image_id}_mask.png", mask, k=int(seg.classes_.max()))
            if "overlays" in what:
                write_overlay(self.out / "overlays" / f"{image_id}_overlay.png",
                              overlay(seg.scale(image), mask, colours=self.colours()))
        if "fractions" in what:
            rows.append((entry.name, counts))
            names = {c["value"]: c["name"] for c in self.session.classes}
            csv = self.out / "area_fractions.csv"
            tmp = csv.with_name(f".{csv.name}.tmp")
            write_fractions_csv(tmp, [r[0] for r in rows], [r[1] for r in rows], seg.classes_, class_names=names)
            tmp.replace(csv)  # a Save stopped at any point leaves the rows of the images done

    def _save_streamed(self, image_id: str, image, what, seg, job: Job) -> tuple[np.ndarray, int]:
        """Mask (and overlay) of a big image written tile by tile as ``segment apply`` writes them: an
        OME-Zarr pyramid for a zarr store, a tiled pyramidal BigTIFF for a TIFF (the CRF, when it is
        on, as further passes); returns (pixels per class, pixels) for the area fractions."""
        from ..chunked import is_zarr_path
        from ..trainable.stream import segment_to_files

        fmt = "ome-zarr" if is_zarr_path(self.session.entry(image_id).source) else "bigtiff"
        folder = self.out / "masks" if "masks" in what else self.out / f".masks-{job.id}"

        def on_tile(done, total):
            if job.cancelled.is_set():
                raise Cancelled("cancelled")

        cache, seg.cache = seg.cache, PeekCache(self.cache, seg)
        try:
            result = segment_to_files(seg, image, folder, image_id, fmt, overlays="overlays" in what, progress=False,
                                      colours=self.colours(), on_tile=on_tile)
            for path in result.paths:  # overlays go where the other images' overlays go
                if "_overlay." in path.name:
                    (self.out / "overlays").mkdir(parents=True, exist_ok=True)
                    target = self.out / "overlays" / path.name
                    shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)
                    path.rename(target)
        finally:
            seg.cache = cache
            if "masks" not in what:
                shutil.rmtree(folder, ignore_errors=True)
        return result.counts, result.size

    def _name_classes(self, config: Path) -> None:
        """Add the class names and colours to an exported model's config.json (``segment apply``
        reads only what it needs, so the extra keys change nothing there)."""
        cfg = json.loads(config.read_text())
        cfg["class_names"] = {str(c["value"]): c["name"] for c in self.session.classes}
        cfg["class_colours"] = {str(c["value"]): c["color"] for c in self.session.classes}
        write_atomic(config, (json.dumps(cfg, indent=2) + "\n").encode())

    def _write_labels(self, ids) -> None:
        """Label images named after their image plus ``_labels`` (what ``segment train`` pairs): a PNG
        per single image, a multi-page TIFF (a page per slice, 0 where unlabelled) per stack, and a
        zarr label store per big image (only its labelled blocks written)."""
        import tifffile

        from ..trainable.output_folder import image_stem

        folder = self.out / "labels"
        folder.mkdir(parents=True, exist_ok=True)
        sources = dict.fromkeys(self.session.entry(i).source for i in ids)
        for source in sources:
            stack_ids = [i for i, e in self.session.images.items() if e.source == source]
            labels = self.session.label_image(stack_ids[0])
            if isinstance(labels, SparseLabels):
                labels.export(folder / f"{image_stem(source)}_labels.zarr")
                continue
            if self.session.entry(stack_ids[0]).page is None:
                write_atomic(folder / f"{source.stem}_labels.png", png_bytes(labels))
                continue
            pages = np.stack([self.session.label_image(i) for i in stack_ids])
            tifffile.imwrite(folder / f"{source.stem}_labels.tif", pages, photometric="minisblack")

    def job(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise SessionError(f"no job {job_id!r}", status=404)
        return self.jobs[job_id]
