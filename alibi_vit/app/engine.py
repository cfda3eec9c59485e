"""The app's compute side: features in the background, training, prediction, Save and Predict-all jobs.

Compute runs on one worker thread (:mod:`~alibi_vit.app.scheduler`) by priority: a Train and the
prediction of the image on screen first (``NOW``), then the features of the image on screen and
saving the model (``SHOWN``), then the features of images opened earlier and Predict all
(``BACKGROUND``). Feature computations and predictions give way between tiles to anything more
urgent, so a Train waits only for the features of the images it trains on, however large an image
opened before is. Features are cached (:class:`~alibi_vit.trainable.cache.FeatureCache`, keyed by
pixels), so retraining after a stroke costs the classifier fit and one prediction; an image whose
features would take more than half the cache is not precomputed and is predicted without it (it
would evict the features of every other image, those Train needs among them).

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

from .model_store import ModelStore
from .scheduler import Cancelled, Scheduler
from .session import Session, SessionError, png_bytes, remember, write_atomic

__all__ = ["BACKGROUND", "Engine", "Job", "NOW", "SHOWN"]

SAVE_KINDS = ("labels", "model", "masks", "overlays", "fractions")
KEEP_PREDICTIONS = 4  # images whose probabilities stay in memory
NOW, SHOWN, BACKGROUND = 0, 1, 2  # task priorities (lower runs first)


def _rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


class Job:
    """A cancellable background job with progress."""

    def __init__(self, job_id: str, total: int, folder: Path | None):
        self.id, self.total, self.folder = job_id, total, folder
        self.done, self.state, self.message = 0, "running", ""
        self.cancelled = threading.Event()

    def finish(self, state: str, message: str) -> None:
        self.state, self.message = state, message

    def record(self) -> dict:
        return {"job": self.id, "state": self.state, "progress": self.done / max(self.total, 1), "done": self.done,
                "total": self.total, "message": self.message,
                "folder": None if self.folder is None else str(self.folder)}


class Engine:
    """Features, model and predictions of one session.

    backbone: the ViT the page may add to the classical features (None: classical only), with
    ``backbone_kwargs`` for :class:`~alibi_vit.trainable.TrainableSegmenter` (checkpoint, pretrained,
    model_kwargs, seed). cache_bytes: the feature cache's budget. out: where Save writes.
    """

    def __init__(self, session: Session, backbone: str | None = None, backbone_kwargs: dict | None = None,
                 cache_bytes: int = 4 << 30, out: Path | None = None, device: str | None = None):
        from ..trainable.cache import FeatureCache

        self.session, self.backbone, self.backbone_kwargs = session, backbone, dict(backbone_kwargs or {})
        self.out = Path(out) if out else session.folder / "export"
        self.device = device
        self.cache = FeatureCache(cache_bytes)
        self.scheduler = Scheduler()
        self.features: dict[str, dict] = {}  # id → {"state", "progress", "error", "note"}
        self.shown: str | None = None  # the image last opened: the one on screen
        self._trainer = None  # the segmenter of the current settings, which Train fits
        self._trainer_key = None
        self._model_seg = None  # the fitted segmenter predictions come from (the trainer, or one restored)
        self.model = None  # record of the trained model: id, classes, seconds, images, pixels, versions, key
        self._model_ids = itertools.count(1)
        self.predictions: OrderedDict[str, dict] = OrderedDict()  # id → {"model", "crf", "proba", "mask"}
        self.predicted: dict[str, dict] = {}  # id → {"model", "crf", "fractions"} of every image predicted
        self.jobs: dict[str, Job] = {}
        self._job_ids = itertools.count(1)
        self._scaled: OrderedDict[str, np.ndarray] = OrderedDict()
        self._display: OrderedDict[str, bytes] = OrderedDict()
        self._display_locks: dict[str, threading.Lock] = {}
        self.store = ModelStore(session.folder / "model")
        self.notes: list[str] = []  # shown in the page: what the engine could not do at start
        self._closed = False
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
                                               device=self.device, **kwargs)
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
        self.scheduler.cancel(lambda key: key[0] in ("features", "predict"), "cancelled: the backbone changed")
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
        """Memory the cached classical features of an image take."""
        from ..trainable.classical import DEFAULT_SIGMAS, classical_feature_names

        shape = self.session.entry(image_id).shape
        channels = shape[2] if len(shape) == 3 and self.session.colour == "channels" else 1
        return int(np.prod(shape[:2])) * channels * len(classical_feature_names(DEFAULT_SIGMAS)) * 4

    def _fits_cache(self, image_id: str) -> bool:
        """Whether an image's features are worth caching: at most half the cache, so that keeping them
        does not evict the features of every other image (those Train needs after each stroke)."""
        return self._feature_bytes(image_id) <= self.cache.max_bytes / 2

    def open(self, image_id: str) -> dict:
        """The image is on screen: its features are computed before those of images opened earlier
        (in the background; once); returns its feature state."""
        self.session.entry(image_id)
        self.shown = image_id
        self.scheduler.reprioritise(lambda key: key[0] == "features" and key[1] != image_id, BACKGROUND)
        state = self.feature_state(image_id)
        if state["state"] == "ready":
            return state
        if not self._fits_cache(image_id):
            state = self.features[image_id] = {
                "state": "on demand", "progress": 0.0, "error": None,
                "note": f"its features ({self._feature_bytes(image_id) / 2**30:.1f} GB) would take more than half "
                        f"the feature cache ({self.cache.max_bytes / 2**30:.1f} GB, --cache-gb): they are computed "
                        "when it is trained on or predicted, and not kept"}
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

    def scaled(self, image_id: str, seg) -> np.ndarray:
        """The image as the features of ``seg`` (of the session's intensity range) see it (float32 in
        [0, 1]), kept for a few images."""
        if image_id in self._scaled:
            return self._scaled[image_id]
        x = seg.scale(self.session.read(image_id), self.session.entry(image_id).name)
        return remember(self._scaled, image_id, x, KEEP_PREDICTIONS)

    def display_png(self, image_id: str) -> bytes:
        """8-bit PNG of the image for the page, scaled as the classifier sees it (the session's
        intensity range). Made on the request's thread: showing an image never waits for features."""
        from ..images import scale_to_range

        # Many requests for one image at once make its PNG once (a 4096² one takes GBs to make).
        with self._display_locks.setdefault(image_id, threading.Lock()):
            if image_id in self._display:
                return self._display[image_id]
            lo, hi = self.session.fix_intensity()
            x = scale_to_range(self.session.read(image_id), lo, hi, source=self.session.entry(image_id).name,
                               colour=self.session.colour == "channels")
            data = png_bytes((np.clip(x[..., :3] if x.ndim == 3 else x, 0, 1) * 255).round().astype(np.uint8))
            return remember(self._display, image_id, data, KEEP_PREDICTIONS)

    # ---- training and prediction --------------------------------------------------------------
    def submit_train(self, image_id: str | None = None):
        """Queue a Train (predicting ``image_id`` after it); a Train still queued is superseded."""
        if image_id is not None:
            self.session.entry(image_id)
        return self.scheduler.submit(("train",), lambda: self._train(image_id), NOW, replace=True)

    def _train(self, image_id):
        session = self.session
        ids = session.labelled_ids()
        present = sorted({int(v) for i in ids for v in session.counts(i)})  # counts kept per label version
        if len(present) < 2:
            names = [session.class_by_value(v)["name"] for v in present]
            have = f"only {names[0]!r} is labelled" if names else "nothing is labelled yet"
            raise SessionError(f"Train needs scribbles of at least two classes: {have}")
        with session.lock:  # the label versions trained on, to tell when the model is stale
            versions = session.versions()
            labels = {i: session.label_image(i).copy() for i in ids}
        seg = self.segmenter()
        key = self._trainer_key
        start = time.perf_counter()
        seg.fit([session.read(i) for i in ids], [labels[i] for i in ids])
        for i in ids:
            self.features[i] = {"state": "ready", "progress": 1.0, "error": None, "note": None}
        self.model = {"id": next(self._model_ids), "classes": [int(c) for c in seg.classes_],
                      "seconds": round(time.perf_counter() - start, 3), "images": len(ids),
                      "pixels": int(sum((lab > 0).sum() for lab in labels.values())),
                      "versions": versions, "key": [key[0], list(key[1]), key[2]]}
        self._model_seg = seg
        self.predictions.clear()
        self.scheduler.submit(("persist",), self._persist, SHOWN, keep=True)
        result = {"model": self.model_state()}
        if image_id is not None:
            result["prediction"] = {"fractions": self.fractions_of(self._predict(image_id)["mask"])}
        return result

    def _persist(self) -> None:
        """Save the current model in the session folder (if it is not yet)."""
        model = self.model
        if model is not None and self._model_seg is not None:
            self.store.save(self._model_seg, model)

    def _persist_now(self) -> None:
        self._wait(self.scheduler.submit(("persist",), self._persist, NOW))

    def _predict(self, image_id: str) -> dict:
        model = self.current_model()
        if model is None or self._model_seg is None:
            raise SessionError("no trained model yet: label at least two classes and press Train", status=409)
        crf = self._crf()
        cached = self.predictions.get(image_id)
        if cached is None or cached["model"] != model["id"] or cached["crf"] != crf:
            seg = self._model_seg
            seg.crf = crf
            x = self.scaled(image_id, seg)
            cache, seg.cache = seg.cache, (seg.cache if self._fits_cache(image_id) else None)
            try:  # between tiles, the worker may stop it (nobody waits any more, or it was cancelled)
                (proba,) = seg.predict_proba([x], scaled=True, on_progress=lambda *_: self.scheduler.checkpoint())
            finally:
                seg.cache = cache
            cached = {"model": model["id"], "crf": crf, "proba": proba, "mask": seg.mask_from_proba(proba)}
            self.predicted[image_id] = {"model": model["id"], "crf": bool(crf),
                                        "fractions": self.fractions_of(cached["mask"])}
        return remember(self.predictions, image_id, cached, KEEP_PREDICTIONS)

    def submit_prediction(self, image_id: str):
        """Queue the prediction of an image (joining one queued or running): first for the image on screen."""
        self.session.entry(image_id)
        return self.scheduler.submit(("predict", image_id), lambda: self._predict(image_id),
                           NOW if image_id == self.shown else SHOWN)

    def fractions_of(self, mask: np.ndarray) -> list[dict]:
        """Pixels and area fraction of each class of the session in a predicted mask."""
        from ..trainable.io import area_fractions

        classes = self.session.classes
        counts, fractions = area_fractions(mask, [c["value"] for c in classes])
        return [{"value": c["value"], "name": c["name"], "color": c["color"], "pixels": int(n), "fraction": float(f)}
                for c, n, f in zip(classes, counts, fractions)]

    def colours(self) -> np.ndarray:
        """(256, 3) uint8: the colour of each label value (the session's class colours; 0 black)."""
        table = np.zeros((256, 3), np.uint8)
        for c in self.session.classes:
            table[c["value"]] = _rgb(c["color"])
        return table

    def prediction_png(self, prediction: dict) -> bytes:
        mask = prediction["mask"]
        rgba = np.concatenate([self.colours()[mask], np.full(mask.shape + (1,), 255, np.uint8)], axis=-1)
        return png_bytes(rgba)

    @staticmethod
    def mask_png(prediction: dict) -> bytes:
        return png_bytes(prediction["mask"].astype(np.uint8))

    @staticmethod
    def uncertainty_png(prediction: dict) -> bytes:
        """1 − max probability, 255 at the most uncertain possible (1 − 1/K)."""
        proba = prediction["proba"]
        k = proba.shape[-1]
        u = (1.0 - proba.max(-1)) / (1.0 - 1.0 / k)
        return png_bytes((np.clip(u, 0, 1) * 255).round().astype(np.uint8))

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
        rewritten after each image), checking for Cancel between images."""
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
                if job.cancelled.is_set():
                    done = f"; {', '.join(written)} written" if written else ""
                    return job.finish("cancelled", f"cancelled after {job.done} of {job.total} images{done}")
                self._save_image(image_id, what, seg, rows)
                job.done += 1
            written += [w for w in ("masks", "overlays", "fractions") if w in what]
            job.finish("done", f"saved {', '.join(written)} to {self.out}")
        finally:
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)

    def _save_image(self, image_id: str, what, seg, rows: list) -> None:
        from PIL import Image

        from ..trainable.io import area_fractions, overlay, write_fractions_csv, write_mask

        entry = self.session.entry(image_id)
        image = self.session.read(image_id)
        mask = seg.predict([image])[0]
        if "masks" in what:
            write_mask(self.out / "masks" / f"{image_id}_mask.png", mask, k=int(seg.classes_.max()))
        if "overlays" in what:
            rgb = overlay(seg.scale(image), mask, colours=self.colours())
            (self.out / "overlays").mkdir(parents=True, exist_ok=True)
            Image.fromarray(rgb).save(self.out / "overlays" / f"{image_id}_overlay.png")
        if "fractions" in what:
            rows.append((entry.name, (area_fractions(mask, seg.classes_)[0], mask.size)))
            names = {c["value"]: c["name"] for c in self.session.classes}
            csv = self.out / "area_fractions.csv"
            tmp = csv.with_name(f".{csv.name}.tmp")
            write_fractions_csv(tmp, [r[0] for r in rows], [r[1] for r in rows], seg.classes_, class_names=names)
            tmp.replace(csv)  # a Save stopped at any point leaves the rows of the images done

    def _name_classes(self, config: Path) -> None:
        """Add the class names and colours to an exported model's config.json (``segment apply``
        reads only what it needs, so the extra keys change nothing there)."""
        cfg = json.loads(config.read_text())
        cfg["class_names"] = {str(c["value"]): c["name"] for c in self.session.classes}
        cfg["class_colours"] = {str(c["value"]): c["color"] for c in self.session.classes}
        write_atomic(config, (json.dumps(cfg, indent=2) + "\n").encode())

    def _write_labels(self, ids) -> None:
        """Label images named after their image plus ``_labels`` (what ``segment train`` pairs): a PNG
        per single image, a multi-page TIFF (a page per slice, 0 where unlabelled) per stack."""
        import tifffile

        folder = self.out / "labels"
        folder.mkdir(parents=True, exist_ok=True)
        sources = dict.fromkeys(self.session.entry(i).source for i in ids)
        for source in sources:
            stack_ids = [i for i, e in self.session.images.items() if e.source == source]
            if self.session.entry(stack_ids[0]).page is None:
                write_atomic(folder / f"{source.stem}_labels.png", png_bytes(self.session.label_image(stack_ids[0])))
                continue
            pages = np.stack([self.session.label_image(i) for i in stack_ids])
            tifffile.imwrite(folder / f"{source.stem}_labels.tif", pages, photometric="minisblack")

    def job(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise SessionError(f"no job {job_id!r}", status=404)
        return self.jobs[job_id]
