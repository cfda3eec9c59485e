"""The app's compute side: features in the background, training, prediction, export jobs.

One worker thread runs every feature computation, training and prediction in order, so they never
race on the segmenter and two cores are not oversubscribed; a training request simply queues
behind the feature jobs of the images it needs. Features are cached
(:class:`~alibi_vit.trainable.cache.FeatureCache`, keyed by pixels), so retraining after a stroke
costs the classifier fit and one prediction. Save jobs run on their own thread with a copy of the
model loaded from its saved folder (exactly what ``alibi-vit segment apply`` would load).
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .session import Session, SessionError, png_bytes, remember

__all__ = ["Engine", "Job"]

SAVE_KINDS = ("labels", "model", "masks", "overlays", "fractions")
KEEP_PREDICTIONS = 4  # images whose probabilities stay in memory


def _rgb(colour: str) -> tuple[int, int, int]:
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


class Job:
    """A cancellable background job with progress."""

    def __init__(self, job_id: str, total: int, folder: Path):
        self.id, self.total, self.folder = job_id, total, folder
        self.done, self.state, self.message = 0, "running", ""
        self.cancelled = threading.Event()

    def record(self) -> dict:
        return {"job": self.id, "state": self.state, "progress": self.done / max(self.total, 1), "done": self.done,
                "total": self.total, "message": self.message, "folder": str(self.folder)}


class Engine:
    """Features, model and predictions of one session.

    backbone: the ViT the page may add to the classical features (None: classical only), with
    ``backbone_kwargs`` for :class:`~alibi_vit.trainable.TrainableSegmenter` (checkpoint, pretrained,
    model_kwargs). cache_bytes: the feature cache's budget. out: where Save writes.
    """

    def __init__(self, session: Session, backbone: str | None = None, backbone_kwargs: dict | None = None,
                 cache_bytes: int = 4 << 30, out: Path | None = None, device: str | None = None):
        from ..trainable.cache import FeatureCache

        self.session, self.backbone, self.backbone_kwargs = session, backbone, dict(backbone_kwargs or {})
        self.out = Path(out) if out else session.folder / "export"
        self.device = device
        self.cache = FeatureCache(cache_bytes)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="alibi-vit-app")
        self.features: dict[str, dict] = {}  # id → {"state", "progress", "error"}
        self._segmenter = None
        self._segmenter_key = None
        self.model = None  # {"id", "classes", "seconds", "images", "pixels"} of the trained segmenter
        self._model_ids = itertools.count(1)
        self.predictions: OrderedDict[str, dict] = OrderedDict()  # id → {"model", "proba", "mask"}
        self.jobs: dict[str, Job] = {}
        self._job_ids = itertools.count(1)
        self._scaled: OrderedDict[str, np.ndarray] = OrderedDict()
        self._display: OrderedDict[str, bytes] = OrderedDict()

    def close(self) -> None:
        for job in self.jobs.values():
            job.cancelled.set()
        self.worker.shutdown(wait=True, cancel_futures=True)

    # ---- the segmenter ----------------------------------------------------------------------
    def backbones(self) -> list:
        return [None] + ([self.backbone] if self.backbone else [])

    def segmenter(self):
        """The segmenter of the current settings (rebuilt when the backbone choice changes; a CRF
        change only switches its post-processing)."""
        from ..trainable import TrainableSegmenter
        from ..trainable.segmenter import DEFAULT_CRF_PRESET

        lo_hi = self.session.fix_intensity()
        backbone = self.session.settings.get("backbone")
        key = (backbone, lo_hi, self.session.colour)
        if self._segmenter_key != key:
            kwargs = self.backbone_kwargs if backbone else {}
            self._segmenter = TrainableSegmenter(backbone, intensity_range=lo_hi, colour=self.session.colour,
                                                 cache=self.cache, device=self.device, **kwargs)
            self._segmenter_key, self.model = key, None
            self.predictions.clear()
        self._segmenter.crf = DEFAULT_CRF_PRESET if self.session.settings.get("crf") else False
        return self._segmenter

    def settings_changed(self) -> None:
        """Drop what the new settings make stale (the model on a backbone change; predictions always)."""
        self.predictions.clear()
        if self._segmenter_key is not None and self._segmenter_key[0] != self.session.settings.get("backbone"):
            self.model = None
            self.features.clear()

    # ---- features ---------------------------------------------------------------------------
    def feature_state(self, image_id: str) -> dict:
        return self.features.get(image_id, {"state": "pending", "progress": 0.0, "error": None})

    def open(self, image_id: str) -> dict:
        """Queue the image's features (once); returns its feature state."""
        self.session.entry(image_id)
        state = self.feature_state(image_id)
        if state["state"] in ("pending", "error"):
            state = self.features[image_id] = {"state": "running", "progress": 0.0, "error": None}
            self.worker.submit(self._compute_features, image_id)
        return state

    def _compute_features(self, image_id: str) -> None:
        state = self.features[image_id]
        try:
            def progress(done, total):
                state["progress"] = done / total

            self.segmenter().precompute(self.session.read(image_id), progress)
            state["state"], state["progress"] = "ready", 1.0
        except Exception as err:  # noqa: BLE001 - shown in the page; the server keeps running
            state["state"], state["error"] = "error", str(err) or type(err).__name__
            if not isinstance(err, ValueError):
                traceback.print_exc()

    def scaled(self, image_id: str) -> np.ndarray:
        """The image as the features see it (float32 in [0, 1]), kept for a few images."""
        if image_id in self._scaled:
            return self._scaled[image_id]
        x = self.segmenter().scale(self.session.read(image_id), self.session.entry(image_id).name)
        return remember(self._scaled, image_id, x, KEEP_PREDICTIONS)

    def display_png(self, image_id: str) -> bytes:
        """8-bit PNG of the image for the page, scaled as the classifier sees it (the session's
        intensity range). Made on the request's thread: showing an image never waits for features."""
        from ..images import scale_to_range

        if image_id in self._display:
            return self._display[image_id]
        lo, hi = self.session.fix_intensity()
        x = scale_to_range(self.session.read(image_id), lo, hi, source=self.session.entry(image_id).name,
                           colour=self.session.colour == "channels")
        data = png_bytes((np.clip(x[..., :3] if x.ndim == 3 else x, 0, 1) * 255).round().astype(np.uint8))
        return remember(self._display, image_id, data, KEEP_PREDICTIONS)

    def run(self, fn, *args):
        """Run ``fn(*args)`` on the worker thread and wait for it."""
        return self.worker.submit(fn, *args).result()

    # ---- training and prediction --------------------------------------------------------------
    def train(self, image_id: str | None = None) -> dict:
        return self.run(self._train, image_id)

    def _train(self, image_id):
        session = self.session
        if image_id is not None:
            session.entry(image_id)
        ids = session.labelled_ids()
        labels = {i: session.label_image(i).copy() for i in ids}
        present = sorted({int(v) for i in ids for v in session.counts(i)})  # counts kept per label version
        if len(present) < 2:
            names = [session.class_by_value(v)["name"] for v in present]
            have = f"only {names[0]!r} is labelled" if names else "nothing is labelled yet"
            raise SessionError(f"Train needs scribbles of at least two classes: {have}")
        seg = self.segmenter()
        start = time.perf_counter()
        images = [session.read(i) for i in ids]
        seg.fit(images, [labels[i] for i in ids])
        for i in ids:
            self.features[i] = {"state": "ready", "progress": 1.0, "error": None}
        self.model = {"id": next(self._model_ids), "classes": [int(c) for c in seg.classes_],
                      "seconds": round(time.perf_counter() - start, 3), "images": len(ids),
                      "pixels": int(sum((lab > 0).sum() for lab in labels.values()))}
        self.predictions.clear()
        result = {"model": dict(self.model)}
        if image_id is not None:
            result["prediction"] = {"fractions": self._fractions(image_id)}
        return result

    def _predict(self, image_id: str) -> dict:
        if self.model is None:
            raise SessionError("no trained model yet: label at least two classes and press Train", status=409)
        cached = self.predictions.get(image_id)
        if cached is None or cached["model"] != self.model["id"]:
            seg = self.segmenter()
            (proba,) = seg.predict_proba([self.scaled(image_id)], scaled=True)
            cached = {"model": self.model["id"], "proba": proba, "mask": seg.mask_from_proba(proba)}
        return remember(self.predictions, image_id, cached, KEEP_PREDICTIONS)

    def prediction(self, image_id: str) -> dict:
        return self.run(self._predict, image_id)

    def _fractions(self, image_id: str) -> list[dict]:
        from ..trainable.io import area_fractions

        mask = self._predict(image_id)["mask"]
        values = [c["value"] for c in self.session.classes]
        counts, fractions = area_fractions(mask, values)
        return [{"value": v, "name": c["name"], "color": c["color"], "pixels": int(n), "fraction": float(f)}
                for v, c, n, f in zip(values, self.session.classes, counts, fractions)]

    def fractions(self, image_id: str) -> list[dict]:
        return self.run(self._fractions, image_id)

    def colours(self) -> np.ndarray:
        """(256, 3) uint8: the colour of each label value (the session's class colours; 0 black)."""
        table = np.zeros((256, 3), np.uint8)
        for c in self.session.classes:
            table[c["value"]] = _rgb(c["color"])
        return table

    def prediction_png(self, image_id: str) -> bytes:
        mask = self.prediction(image_id)["mask"]
        rgba = np.concatenate([self.colours()[mask], np.full(mask.shape + (1,), 255, np.uint8)], axis=-1)
        return png_bytes(rgba)

    def mask_png(self, image_id: str) -> bytes:
        return png_bytes(self.prediction(image_id)["mask"].astype(np.uint8))

    def uncertainty_png(self, image_id: str) -> bytes:
        """1 − max probability, 255 at the most uncertain possible (1 − 1/K)."""
        proba = self.prediction(image_id)["proba"]
        k = proba.shape[-1]
        u = (1.0 - proba.max(-1)) / (1.0 - 1.0 / k)
        return png_bytes((np.clip(u, 0, 1) * 255).round().astype(np.uint8))

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
        if needs_model and self.model is None:
            raise SessionError(f"saving {', '.join(needs_model)} needs a trained model: press Train first", status=409)
        if scope == "image":
            self.session.entry(image_id)
        ids = list(self.session.images) if scope == "all" else [image_id]
        model_dir = None
        if needs_model:  # the model as segment apply will load it, written before the job starts
            model_dir = self.out / "model" if "model" in what else self.session.folder / "model"
            self.run(self._segmenter.save, model_dir)
        per_image = [w for w in what if w in ("labels", "masks", "overlays", "fractions")]
        job = Job(f"j{next(self._job_ids)}", len(ids) if per_image else 0, self.out)
        self.jobs[job.id] = job
        threading.Thread(target=self._save_job, args=(job, what, ids, model_dir), daemon=True).start()
        return job

    def _save_job(self, job: Job, what, ids, model_dir) -> None:
        from ..trainable import TrainableSegmenter
        from ..trainable.io import area_fractions, overlay, write_fractions_csv, write_mask

        try:
            seg = None
            if {"masks", "overlays", "fractions"} & set(what):
                seg = TrainableSegmenter.load(model_dir, device=self.device)
                seg.cache = self.cache  # same settings, same keys: open images are not featurised again
            names, counts = [], []
            by_source: dict[Path, list[str]] = {}
            for image_id in ids:
                if job.cancelled.is_set():
                    job.state, job.message = "cancelled", f"cancelled after {job.done} of {job.total} images"
                    return
                entry = self.session.entry(image_id)
                by_source.setdefault(entry.source, []).append(image_id)
                if seg is not None:
                    image = self.session.read(image_id)
                    mask = seg.predict([image])[0]
                    if "masks" in what:
                        write_mask(self.out / "masks" / f"{image_id}_mask.png", mask, k=int(seg.classes_.max()))
                    if "overlays" in what:
                        rgb = overlay(seg.scale(image), mask, colours=self.colours())
                        (self.out / "overlays").mkdir(parents=True, exist_ok=True)
                        from PIL import Image

                        Image.fromarray(rgb).save(self.out / "overlays" / f"{image_id}_overlay.png")
                    if "fractions" in what:
                        names.append(entry.name)
                        counts.append((area_fractions(mask, seg.classes_)[0], mask.size))
                job.done += 1
            if "labels" in what:
                self._write_labels(by_source)
            if "fractions" in what:
                write_fractions_csv(self.out / "area_fractions.csv", names, counts, seg.classes_)
            job.state, job.message = "done", f"saved {', '.join(what)} to {self.out}"
        except Exception as err:  # noqa: BLE001 - reported to the page
            job.state, job.message = "error", str(err) or type(err).__name__
            if not isinstance(err, (ValueError, OSError)):
                traceback.print_exc()

    def _write_labels(self, by_source: dict) -> None:
        """Label images named after their image plus ``_labels`` (what ``segment train`` pairs): a PNG
        per single image, a multi-page TIFF (a page per slice, 0 where unlabelled) per stack."""
        import tifffile

        folder = self.out / "labels"
        folder.mkdir(parents=True, exist_ok=True)
        for source, ids in by_source.items():
            entries = [self.session.entry(i) for i in ids]
            if entries[0].page is None:
                (folder / f"{source.stem}_labels.png").write_bytes(png_bytes(self.session.label_image(ids[0])))
                continue
            stack_ids = [i for i, e in self.session.images.items() if e.source == source]
            pages = np.stack([self.session.label_image(i) for i in stack_ids])
            tifffile.imwrite(folder / f"{source.stem}_labels.tif", pages, photometric="minisblack")

    def job(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise SessionError(f"no job {job_id!r}", status=404)
        return self.jobs[job_id]
