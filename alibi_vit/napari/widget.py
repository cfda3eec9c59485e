"""The dock widget: scribble, Train (live after each stroke), Predict, Save/Load model.

Every computation runs in a napari worker thread (:func:`napari.qt.threading.create_worker`), one at
a time, with a progress bar and Cancel (a worker stops after the tile in hand); the viewer never
waits. What is computed is :mod:`alibi_vit.napari.engine`'s: the segmenter ``segment train`` builds
from the same options, fitted on the image as that command reads it and on the scribble layer (0 =
unlabelled, 1..K = classes), so a model saved here is a ``segment train`` model folder.

Errors (a bad image, scribbles of one class only, a model of other features) are napari
notifications with the engine's own message, never a traceback dialog.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from qtpy.QtCore import Qt, QTimer
from qtpy.QtGui import QColor
from qtpy.QtWidgets import (
    QCheckBox,
    QComboBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from . import engine
from .reader import METADATA_KEY
from .sample_data import SCRIBBLE_SUFFIX

__all__ = ["SegmentWidget"]

# The app's class colours (alibi_vit.app.session.DEFAULT_COLOURS, the masks' palette): a class has the
# same colour in napari, the app, the masks' palette PNGs and the overlays.
CLASS_COLOURS = ("#e6194b", "#3cb44b", "#0082c8", "#ffe119", "#911eb4", "#46f0f0", "#f58231", "#f032e6",
                 "#d2f53c", "#fabebe")
PREDICTION_SUFFIX, UNCERTAINTY_SUFFIX = " prediction", " uncertainty"
SCOPES = ("view", "slice", "whole")
REDRAW_S = 0.5  # while a prediction comes in piece by piece, the output layers are redrawn at most this often
SCOPE_WORDS = {"view": "the view", "slice": "the slice", "whole": "the whole image"}


def _colour(value: int, colours: dict) -> str:
    return colours.get(value) or CLASS_COLOURS[(value - 1) % len(CLASS_COLOURS)]


def _compact(table: QTableWidget) -> None:
    """A table as tall as a few rows, its last column filling the width."""
    table.horizontalHeader().setStretchLastSection(True)
    table.setMinimumHeight(110)


def _warm_up_napari() -> None:
    """napari's one-time costs of a session's first layer, paid once this widget is shown rather than when the
    first image opens: its unit registry (pint parses its definitions on first use, 0.6 s on a 2-core CPU; on
    this, the main thread: that lazy registry is not thread-safe) and the scipy import of its thumbnails (0.4 s,
    on a thread: imports are)."""
    import threading

    import pint

    threading.Thread(target=lambda: __import__("scipy.ndimage"), name="alibi-vit-warm-up", daemon=True).start()
    pint.get_application_registry().get().pixel  # noqa: B018 - the first use builds the registry


class SegmentWidget(QWidget):
    """Trainable segmentation of the chosen image layer from the strokes of its scribble layer."""

    def __init__(self, napari_viewer):
        super().__init__()
        from ..trainable.cache import FeatureCache

        self.viewer = napari_viewer
        self.cache = FeatureCache(engine.CACHE_BYTES)  # features kept between retrainings (results unchanged)
        self.segmenter = None  # the fitted segmenter predictions come from (trained here, or loaded)
        self._trainer, self._trainer_key = None, None
        self.model_source = None  # "trained" or the folder a model was loaded from
        self.worker = None
        self._pending = None  # a live retraining asked for while a job ran
        self._scribbles_connected = None
        self.fractions = {}  # class value → (pixels, fraction) of the last prediction
        self._unshown: dict = {}  # id → output layer written since its last redraw
        self._shown_at = 0.0  # when the output layers were last redrawn
        self.last_seconds = None  # Train or Predict → the prediction written, in seconds (the last job)
        self.fit_seconds = None  # of those, reading the image and fitting (the last Train)
        self.class_names: dict[int, str] = {}
        self.class_colours: dict[int, str] = {}
        self._colours_set: dict[int, dict] = {}  # id(layer) → the class colours its colormap has
        self._build()
        QTimer.singleShot(0, _warm_up_napari)
        self.viewer.layers.events.inserted.connect(self._refresh_layers)
        self.viewer.layers.events.removed.connect(self._refresh_layers)
        self._refresh_layers()

    # ---- the widget ------------------------------------------------------------------------------
    def _build(self) -> None:
        layout = QVBoxLayout(self)
        top = QFormLayout()
        self.image_box = QComboBox()
        self.image_box.currentTextChanged.connect(self._image_chosen)
        top.addRow("Image", self.image_box)
        self.image_info = QLabel("")
        self.image_info.setWordWrap(True)
        top.addRow(self.image_info)
        layout.addLayout(top)

        classes = QGroupBox("Classes (scribble with label 1, 2, …; 0 erases)")
        cl = QVBoxLayout(classes)
        self.class_table = QTableWidget(0, 2)
        self.class_table.setHorizontalHeaderLabels(["label", "name"])
        self.class_table.verticalHeader().setVisible(False)
        self.class_table.itemChanged.connect(self._class_renamed)
        _compact(self.class_table)
        cl.addWidget(self.class_table)
        row = QHBoxLayout()
        self.add_class_button = QPushButton("Add class")
        self.add_class_button.clicked.connect(lambda: self.add_class())
        self.scribble_button = QPushButton("Scribble layer")
        self.scribble_button.setToolTip("create (or select) the Labels layer the strokes are drawn in")
        self.scribble_button.clicked.connect(lambda: self.scribble_layer(create=True))
        row.addWidget(self.add_class_button)
        row.addWidget(self.scribble_button)
        cl.addLayout(row)
        layout.addWidget(classes)

        features = QGroupBox("Features, classifier, CRF")
        form = QFormLayout(features)
        self.filters_box = QComboBox()
        self.filters_box.addItems(["compact", "weka"])
        form.addRow("Filters", self.filters_box)
        self.features_box = QComboBox()
        self.features_box.addItems(engine.FEATURE_MODES)
        self.features_box.setToolTip("auto: volumes on 3D features, 2D images on 2D ones; 2d: volumes slice by slice")
        form.addRow("2D / 3D", self.features_box)
        self.backbone_edit = QLineEdit()
        self.backbone_edit.setPlaceholderText("none: classical features only")
        self.backbone_edit.setToolTip("a ViT backbone name, e.g. alibi_vit_small_patch14_reg4_dinov2")
        form.addRow("ViT backbone", self.backbone_edit)
        ck = QHBoxLayout()
        self.checkpoint_edit = QLineEdit()
        self.checkpoint_edit.setPlaceholderText("checkpoint file (optional)")
        browse = QPushButton("…")
        browse.clicked.connect(self._choose_checkpoint)
        ck.addWidget(self.checkpoint_edit)
        ck.addWidget(browse)
        form.addRow("Checkpoint", ck)
        weights = QHBoxLayout()
        self.pretrained_box = QCheckBox("timm's pretrained")
        self.random_init_box = QCheckBox("allow random init")
        weights.addWidget(self.pretrained_box)
        weights.addWidget(self.random_init_box)
        form.addRow("Weights", weights)
        self.classifier_box = QComboBox()
        self.classifier_box.addItems(["random_forest", "xgboost"])
        form.addRow("Classifier", self.classifier_box)
        self.trees_spin = QSpinBox()
        self.trees_spin.setRange(0, 10000)
        self.trees_spin.setSpecialValueText("default (25)")
        form.addRow("Trees", self.trees_spin)
        self.crf_box = QComboBox()
        self.crf_box.addItems(engine.CRF_CHOICES)
        self.crf_box.setToolTip("dense CRF clean-up of whole-image predictions (2D; not of the view)")
        form.addRow("CRF", self.crf_box)
        layout.addWidget(features)

        actions = QHBoxLayout()
        self.train_button = QPushButton("Train")
        self.train_button.clicked.connect(lambda: self.train())
        self.live_box = QCheckBox("live")
        self.live_box.setToolTip("retrain and predict the view after each stroke (after a first Train)")
        self.scope_box = QComboBox()
        self.scope_box.addItems(SCOPES)
        self.predict_button = QPushButton("Predict")
        self.predict_button.clicked.connect(lambda: self.predict())
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.cancel_button.setEnabled(False)
        for w in (self.train_button, self.live_box, self.scope_box, self.predict_button, self.cancel_button):
            actions.addWidget(w)
        layout.addLayout(actions)
        self.progress = QProgressBar()
        self.progress.setRange(0, 1)
        layout.addWidget(self.progress)
        self.status = QLabel("")
        self.status.setWordWrap(True)
        layout.addWidget(self.status)

        self.fraction_table = QTableWidget(0, 3)
        self.fraction_table.setHorizontalHeaderLabels(["class", "fraction", "pixels"])
        self.fraction_table.verticalHeader().setVisible(False)
        _compact(self.fraction_table)
        layout.addWidget(self.fraction_table)

        model = QHBoxLayout()
        self.save_button = QPushButton("Save model…")
        self.save_button.clicked.connect(self._save_dialog)
        self.load_button = QPushButton("Load model…")
        self.load_button.clicked.connect(self._load_dialog)
        model.addWidget(self.save_button)
        model.addWidget(self.load_button)
        layout.addLayout(model)
        self.command_edit = QLineEdit()
        self.command_edit.setReadOnly(True)
        self.command_edit.setToolTip("the same training as a command (the scribbles saved as a label image)")
        layout.addWidget(self.command_edit)
        layout.addStretch(1)

    def _choose_checkpoint(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Backbone checkpoint")
        if path:
            self.checkpoint_edit.setText(path)

    def _refresh_layers(self, *_) -> None:
        from napari.layers import Image

        names = [layer.name for layer in self.viewer.layers if isinstance(layer, Image)
                 and not layer.name.endswith(UNCERTAINTY_SUFFIX)]
        current = self.image_box.currentText()
        self.image_box.blockSignals(True)
        self.image_box.clear()
        self.image_box.addItems(names)
        self.image_box.blockSignals(False)
        if current in names:
            self.image_box.setCurrentText(current)
        elif names:
            self.image_box.setCurrentIndex(len(names) - 1)  # the layer added last
            self._image_chosen(self.image_box.currentText())
        else:
            self.image_info.setText("open an image (File ▸ Open, or a sample: File ▸ Open Sample ▸ alibi-vit)")
        if any(layer.name.endswith(SCRIBBLE_SUFFIX) for layer in self.viewer.layers):
            # XGBoost's import (with SciPy) takes a CPU-second or so: once there are scribbles, while
            # the user draws, not after the first click on Train, nor while an image opens.
            from ..trainable.classifier import import_in_background

            import_in_background()

    # ---- the image and its layers ----------------------------------------------------------------
    def image_layer(self):
        name = self.image_box.currentText()
        if not name or name not in self.viewer.layers:
            raise ValueError("no image chosen: open an image and choose it in the widget")
        return self.viewer.layers[name]

    def _source(self, layer) -> dict:
        return dict(layer.metadata.get(METADATA_KEY) or {})

    def is_volume(self, layer) -> bool:
        info = self._source(layer)
        if "volume" in info:
            return bool(info["volume"])
        return layer.ndim == 3 and not layer.rgb

    def _level0(self, layer):
        return layer.data[0] if layer.multiscale else layer.data

    def _shape(self, layer) -> tuple[int, ...]:
        shape = tuple(self._level0(layer).shape)
        return shape[:-1] if layer.rgb else shape

    def _image_chosen(self, name: str) -> None:
        if not name or name not in self.viewer.layers:
            return
        layer = self.viewer.layers[name]
        shape = self._shape(layer)
        kind = "volume" if self.is_volume(layer) else ("colour image" if layer.rgb else "image")
        lazy = " (read lazily from its file)" if self._source(layer).get("path") else ""
        self.image_info.setText(f"{kind} {'×'.join(map(str, shape))}, {np.dtype(self._level0(layer).dtype).name}"
                                f"{lazy}")
        names = layer.metadata.get("classes")  # a sample's class names
        if names and not self.class_names:
            for value, n in enumerate(names, start=1):
                self.class_names[value] = str(n)
        if not self.class_names:
            self.class_names = {1: "class 1", 2: "class 2"}
        self._show_classes()
        found = self.viewer.layers[name + SCRIBBLE_SUFFIX] if name + SCRIBBLE_SUFFIX in self.viewer.layers else None  # noqa: SIM401 - a LayerList, not a dict
        if found is not None:
            self._watch(found)
            self._colour_layer(found)

    def add_class(self, name: str | None = None) -> int:
        value = max(self.class_names, default=0) + 1
        self.class_names[value] = name or f"class {value}"
        self._show_classes()
        for layer in self._class_layers():
            self._colour_layer(layer)
        return value

    def _show_classes(self) -> None:
        self.class_table.blockSignals(True)
        self.class_table.setRowCount(len(self.class_names))
        for row, (value, name) in enumerate(sorted(self.class_names.items())):
            item = QTableWidgetItem(str(value))
            item.setFlags(item.flags() & ~Qt.ItemIsEditable)
            item.setBackground(QColor(_colour(value, self.class_colours)))
            self.class_table.setItem(row, 0, item)
            self.class_table.setItem(row, 1, QTableWidgetItem(name))
        self.class_table.blockSignals(False)

    def _class_renamed(self, item) -> None:
        if item.column() == 1:
            value = int(self.class_table.item(item.row(), 0).text())
            self.class_names[value] = item.text().strip() or f"class {value}"
            self._show_fractions()

    def _class_layers(self) -> list:
        name = self.image_box.currentText()
        return [self.viewer.layers[n] for n in (name + SCRIBBLE_SUFFIX, name + PREDICTION_SUFFIX)
                if n in self.viewer.layers]

    def _colour_layer(self, layer) -> None:
        from napari.utils.colormaps import DirectLabelColormap

        values = set(self.class_names) | {int(v) for v in (self.segmenter.classes_ if self.segmenter else [])}
        colours = {None: "transparent", 0: "transparent"}
        colours.update({v: _colour(v, self.class_colours) for v in sorted(values)})
        if self._colours_set.get(id(layer)) == colours:  # a new colormap redraws the whole layer: only on change
            return
        layer.colormap = DirectLabelColormap(color_dict=colours)
        self._colours_set[id(layer)] = colours

    def scribble_layer(self, create: bool = False):
        """The chosen image's scribble layer (``<image> scribbles``), made when ``create`` and missing."""
        image = self.image_layer()
        name = image.name + SCRIBBLE_SUFFIX
        if name in self.viewer.layers:
            layer = self.viewer.layers[name]
        elif not create:
            raise ValueError(f"no scribbles for {image.name}: press 'Scribble layer' and draw strokes of at least "
                             "two classes")
        else:
            layer = self.viewer.add_labels(np.zeros(self._shape(image), np.uint8), name=name, scale=image.scale,
                                           translate=image.translate)
            layer.brush_size = 5
            layer.selected_label = 1
            layer.mode = "paint"
        self._colour_layer(layer)
        self._watch(layer)
        if create:
            self.viewer.layers.selection.active = layer
        return layer

    def _watch(self, layer) -> None:
        if self._scribbles_connected is not layer:
            layer.events.paint.connect(self._stroke)
            self._scribbles_connected = layer

    def _output_layers(self, image):
        """The chosen image's prediction (Labels) and uncertainty (Image) layers, made when missing."""
        shape = self._shape(image)
        pred_name, unc_name = image.name + PREDICTION_SUFFIX, image.name + UNCERTAINTY_SUFFIX
        made = False
        if pred_name not in self.viewer.layers or self.viewer.layers[pred_name].data.shape != shape:
            if pred_name in self.viewer.layers:
                self.viewer.layers.remove(pred_name)
            pred = self.viewer.add_labels(np.zeros(shape, np.uint8), name=pred_name, scale=image.scale,
                                          translate=image.translate, opacity=0.45)
            made = True
            # under the scribbles, so the strokes stay visible
            scribbles = image.name + SCRIBBLE_SUFFIX
            if scribbles in self.viewer.layers:
                self.viewer.layers.move(self.viewer.layers.index(pred), self.viewer.layers.index(scribbles))
        if unc_name not in self.viewer.layers or self.viewer.layers[unc_name].data.shape != shape:
            if unc_name in self.viewer.layers:
                self.viewer.layers.remove(unc_name)
            k = max(len(self.segmenter.classes_), 2)
            self.viewer.add_image(np.zeros(shape, np.uint8), name=unc_name, scale=image.scale,
                                  translate=image.translate, colormap="magma", visible=False,
                                  contrast_limits=(0, round(255 * (1 - 1 / k))), blending="additive")
            made = True
        pred = self.viewer.layers[pred_name]
        self._colour_layer(pred)
        scribbles = image.name + SCRIBBLE_SUFFIX
        if scribbles in self.viewer.layers and made:  # drawing goes on in the scribbles, not the new layers
            self.viewer.layers.selection.active = self.viewer.layers[scribbles]
        return pred, self.viewer.layers[unc_name]

    # ---- settings ------------------------------------------------------------------------------
    def settings(self) -> engine.Settings:
        backbone = self.backbone_edit.text().strip() or None
        return engine.Settings(filters=self.filters_box.currentText(), classifier=self.classifier_box.currentText(),
                               trees=self.trees_spin.value() or None, crf=self.crf_box.currentText(),
                               features=self.features_box.currentText(), backbone=backbone,
                               checkpoint=self.checkpoint_edit.text().strip() or None,
                               pretrained=self.pretrained_box.isChecked(),
                               allow_random_init=self.random_init_box.isChecked())

    def set_settings(self, settings: engine.Settings) -> None:
        self.filters_box.setCurrentText(settings.filters)
        self.classifier_box.setCurrentText(settings.classifier)
        self.trees_spin.setValue(settings.trees or 0)
        self.crf_box.setCurrentText(settings.crf)
        self.features_box.setCurrentText(settings.features)
        self.backbone_edit.setText(settings.backbone or "")
        self.checkpoint_edit.setText(settings.checkpoint or "")
        self.pretrained_box.setChecked(settings.pretrained)
        self.random_init_box.setChecked(settings.allow_random_init)

    def _trainer_for(self, settings, volume: bool):
        """The segmenter Train fits: kept while the settings stay (its features stay in the cache)."""
        key = (tuple(settings.options()), volume)
        if self._trainer_key != key:
            self._trainer = engine.build_segmenter(settings, volume, cache=self.cache)
            self._trainer_key = key
        return self._trainer

    # ---- jobs ----------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.worker is not None

    def _start(self, job, what: str, on_done=None):
        from napari.qt.threading import create_worker

        if self.busy:
            raise ValueError(f"busy: {self.status.text()} (Cancel it first)")
        started = time.perf_counter()
        self.progress.setRange(0, 0)
        self.status.setText(what + " …")
        for w in (self.train_button, self.predict_button, self.save_button, self.load_button):
            w.setEnabled(False)
        self.cancel_button.setEnabled(True)

        self._shown_at = started  # pieces of the job's first REDRAW_S are drawn with the next ones

        def returned(result):
            self._show_pieces()
            self.last_seconds = time.perf_counter() - started
            if on_done is not None:
                on_done(result)

        def errored(err):
            self._fail(err)

        worker = create_worker(job, _start_thread=False,
                               _connect={"yielded": self._on_yield, "returned": returned, "errored": errored,
                                         "aborted": lambda: self.status.setText(f"{what}: cancelled"),
                                         "finished": self._finished})
        self.worker = worker
        worker.start()
        return worker

    def _show_pieces(self) -> None:
        """Redraw the output layers written since their last redraw (a redraw of a mosaic-sized layer costs about
        0.2 s: pieces arriving faster are drawn together)."""
        for layer in self._unshown.values():
            layer.refresh()
        self._unshown.clear()
        self._shown_at = time.perf_counter()

    def _fail(self, err) -> None:
        from napari.utils.notifications import show_error

        message = str(err) or type(err).__name__
        self.status.setText(f"error: {message}")
        show_error(message)

    def _finished(self) -> None:
        self._show_pieces()  # what a cancelled or failed job wrote
        self.worker = None
        self.progress.setRange(0, 1)
        self.progress.setValue(1)
        for w in (self.train_button, self.predict_button, self.save_button, self.load_button):
            w.setEnabled(True)
        self.cancel_button.setEnabled(False)
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending()

    def cancel(self) -> None:
        """Stop the running job after the tile in hand (a classifier fit runs to its end first)."""
        if self.worker is not None:
            self.worker.quit()
            self._pending = None

    def _on_yield(self, item) -> None:
        kind = item[0]
        if kind == "progress":
            _, done, total, text = item
            self.progress.setRange(0, max(total, 1))
            self.progress.setValue(done)
            self.status.setText(text)
        elif kind == "piece":
            _, image, region, mask, uncertainty = item
            pred, unc = self._output_layers(image)
            pred.data[region] = mask
            unc.data[region] = uncertainty
            self._unshown.update({id(pred): pred, id(unc): unc})
            if time.perf_counter() - self._shown_at >= REDRAW_S:
                self._show_pieces()
            for value, n in zip(*np.unique(mask[mask > 0], return_counts=True)):
                self._counts[int(value)] = self._counts.get(int(value), 0) + int(n)

    # ---- Train and Predict ---------------------------------------------------------------------
    def train(self, scope: str | None = None):
        """Fit on the scribbles of the chosen image (in a worker), then predict ``scope`` (default: the
        view of a 2D image, the slice shown of a volume). Returns the worker (None when refused)."""
        try:
            image = self.image_layer()
            scribbles = self.scribble_layer()
            volume = self.is_volume(image)
            labels = engine.scribble_snapshot(scribbles.data)  # strokes drawn meanwhile go to the next Train
            if labels is None:
                raise ValueError("the scribble layer is empty: draw strokes of at least two classes")
            settings = self.settings()
            path = self._source(image).get("path")
            data = None if path else self._level0(image)
            target = self._target(image, scope or ("slice" if volume else "view"))
        except ValueError as err:
            self._fail(err)
            return None
        self.command_edit.setText(settings.command(path or f"{image.name}.tif", f"{image.name}_labels.png",
                                                   "my_model"))

        def job():
            yield "progress", 0, 0, "features and classifier"
            started = time.perf_counter()
            seg = self._trainer_for(settings, volume)
            source = engine.training_image(path, data, volume)
            engine.fit(seg, source, labels, volume)
            self.fit_seconds = time.perf_counter() - started
            self.segmenter, self.model_source = seg, "trained"
            counts = seg.label_counts_
            yield "progress", 1, 1, (f"trained on {sum(counts.values())} labelled pixels: "
                                     + ", ".join(f"{c}: {n}" for c, n in counts.items()))
            yield from self._prediction(seg, image, source, volume, target)
            return counts

        return self._start(job, "Train", lambda counts: self._predicted(target, "trained"))

    def predict(self, scope: str | None = None):
        """Predict ``scope`` (view, slice, whole; default the widget's choice) of the chosen image with
        the current model, in a worker. Returns the worker (None when refused)."""
        try:
            if self.segmenter is None:
                raise ValueError("no model yet: press Train (or Load model)")
            image = self.image_layer()
            volume = self.is_volume(image)
            path = self._source(image).get("path")
            data = None if path else self._level0(image)
            target = self._target(image, scope or self.scope_box.currentText())
        except ValueError as err:
            self._fail(err)
            return None
        seg = self.segmenter

        def job():
            source = engine.training_image(path, data, volume)
            yield from self._prediction(seg, image, source, volume, target)

        return self._start(job, f"Predict {SCOPE_WORDS[target[0]]}", lambda _: self._predicted(target, "predicted"))

    def _target(self, image, scope: str):
        """(scope, its region of the image's data): the view's rows and columns, a volume's slice
        index shown, or everything."""
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        volume = self.is_volume(image)
        if volume and scope in ("view", "slice"):
            # The slice on screen is perpendicular to the axis the slider moves along (napari's dims order can
            # show any of the three planes); in a 3D view, the z slice at the slider.
            hidden = self.viewer.dims.not_displayed
            axis = int(hidden[-1]) - (self.viewer.dims.ndim - 3) if hidden else 0
            axis = axis if 0 <= axis < 3 else 0
            index = int(round(image.world_to_data(self.viewer.dims.point)[axis]))
            return "slice", (axis, min(max(index, 0), self._shape(image)[axis] - 1))
        if scope == "view":
            return "view", self._view_region(image)
        return "whole", None

    def _view_region(self, image) -> tuple[slice, slice]:
        """The rows and columns of the image (full resolution) on screen."""
        corners = np.asarray(image.corner_pixels, float)[:, -2:]
        if image.multiscale:
            corners = corners * np.asarray(image.downsample_factors[image.data_level])[-2:]
        h, w = self._shape(image)[-2:]
        lo = np.clip(np.floor(corners[0]), 0, [h, w]).astype(int)
        hi = np.clip(np.ceil(corners[1]) + 1, 0, [h, w]).astype(int)
        if (hi <= lo).any():  # the view is off the image
            return slice(0, h), slice(0, w)
        return slice(int(lo[0]), int(hi[0])), slice(int(lo[1]), int(hi[1]))

    def _prediction(self, seg, image, source, volume: bool, target):
        """Worker part of a prediction: yields progress and ("piece", …) items the main thread writes."""
        self._counts = {}
        scope, where = target
        if volume and seg.dims == 2 and scope == "whole":
            raise ValueError("a model of 2D images predicts a volume slice by slice: predict a slice")
        if not volume and seg.dims == 3:
            raise ValueError(f"{image.name} is a 2D image but the model segments volumes (3D features): load or "
                             "train a model of 2D images")
        if scope == "slice":
            axis, index = where
            proba = engine.predict_plane(seg, source, axis, index)
            mask = seg.classes_[proba.argmax(-1)].astype(np.uint8)
            yield "piece", image, tuple(index if a == axis else slice(None) for a in range(3)), mask, \
                engine.uncertainty_u8(proba)
        elif scope == "view":
            region = where
            tiles = len(seg.tile_grid(seg.source(source)).covering(region))
            for i, (part, proba) in enumerate(engine.predict_region(seg, source, region)):
                mask = seg.classes_[proba.argmax(-1)].astype(np.uint8)
                yield "piece", image, part, mask, engine.uncertainty_u8(proba)
                yield "progress", i + 1, tiles, f"predicted tile {i + 1} of {tiles} of the view"
        elif volume:
            src = seg.source(source)
            blocks = len(seg.tile_grid(src))
            for i, (core, proba) in enumerate(seg.predict_tiles(src)):
                mask = seg.classes_[proba.argmax(-1)].astype(np.uint8)
                yield "piece", image, core, mask, engine.uncertainty_u8(proba)
                yield "progress", i + 1, blocks, f"predicted block {i + 1} of {blocks}"
        else:
            for done, total, proba in engine.predict_whole(seg, source):
                if proba is None:
                    yield "progress", done, total, f"predicted tile {done} of {total}"
            mask = seg.mask_from_proba(proba).astype(np.uint8)  # the modal filter too, as segment apply
            yield "piece", image, (slice(None), slice(None)), mask, engine.uncertainty_u8(proba)

    def _predicted(self, target, verb: str) -> None:
        total = max(sum(self._counts.values()), 1)
        self.fractions = {c: (n, n / total) for c, n in sorted(self._counts.items())}
        self._fraction_scope = target[0]
        self._show_fractions()
        what = {"view": "the view", "whole": "the whole image"}.get(target[0]) or \
            f"{'zyx'[target[1][0]]} slice {target[1][1]}"
        self.status.setText(f"{verb}; predicted {what} in {self.last_seconds:.2f} s")

    def _show_fractions(self) -> None:
        self.fraction_table.setRowCount(len(self.fractions))
        for row, (value, (n, f)) in enumerate(self.fractions.items()):
            name = QTableWidgetItem(self.class_names.get(value, f"class {value}"))
            name.setBackground(QColor(_colour(value, self.class_colours)))
            self.fraction_table.setItem(row, 0, name)
            self.fraction_table.setItem(row, 1, QTableWidgetItem(f"{f:.4f}"))
            self.fraction_table.setItem(row, 2, QTableWidgetItem(str(n)))
        scope = getattr(self, "_fraction_scope", None)
        noun = "volume fractions" if scope == "whole" and self._is_volume_shown() else "area fractions"
        self.fraction_table.setToolTip(f"{noun} of {SCOPE_WORDS.get(scope, 'the prediction')}")

    def _is_volume_shown(self) -> bool:
        try:
            return self.is_volume(self.image_layer())
        except ValueError:
            return False

    def _stroke(self, event=None) -> None:
        """Live mode: each stroke retrains and predicts the view (after a first Train)."""
        if not self.live_box.isChecked() or self.segmenter is None or self.model_source != "trained":
            return
        if self.busy:
            self._pending = self.train
            return
        self.train()

    # ---- Save / Load -----------------------------------------------------------------------------
    def _save_dialog(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Save the model into a folder")
        if folder:
            self.save_model(folder)

    def _load_dialog(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "A model folder (segment train's --out, the app's model/)")
        if folder:
            self.load_model(folder)

    def save_model(self, folder) -> Path | None:
        """Write the model folder ``segment apply --model`` reads, with the class names and colours
        (as the app's Save adds them to config.json). Quick: the main thread does it."""
        try:
            if self.segmenter is None:
                raise ValueError("no model to save: press Train first")
            folder = Path(folder)
            self.segmenter.save(folder)
            config = json.loads((folder / "config.json").read_text())
            classes = [int(c) for c in self.segmenter.classes_]
            config["class_names"] = {str(c): self.class_names.get(c, f"class {c}") for c in classes}
            config["class_colours"] = {str(c): _colour(c, self.class_colours) for c in classes}
            (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        except (OSError, ValueError) as err:
            self._fail(err)
            return None
        self.status.setText(f"model saved to {folder}: alibi-vit segment apply --model {folder} --images … --out …")
        return folder

    def load_model(self, folder):
        """Load a model folder (trained here, by ``segment train`` or by the app) in a worker; its settings
        and class names become the widget's. Returns the worker (None when refused)."""
        from ..trainable import TrainableSegmenter

        folder = Path(folder)
        cache = self.cache

        def job():
            yield "progress", 0, 0, f"loading {folder}"
            seg = TrainableSegmenter.load(folder)
            seg.cache = cache
            return seg, json.loads((folder / "config.json").read_text())

        def loaded(result):
            seg, config = result
            self.segmenter, self.model_source = seg, str(folder)
            backbone = config.get("backbone") or {}
            crf = config.get("crf") or "off"
            self.set_settings(engine.Settings(
                filters=config.get("filters", "compact") if seg.dims == 2 else self.filters_box.currentText(),
                classifier=config["classifier"], trees=config.get("classifier_params", {}).get("n_estimators"),
                crf="library" if crf is True else crf, features="3d" if seg.dims == 3 else "auto",
                backbone=backbone.get("name"), checkpoint=None, pretrained=bool(backbone.get("pretrained"))))
            names = config.get("class_names") or {}
            colours = config.get("class_colours") or {}
            self.class_names = {int(c): names.get(str(c), f"class {c}") for c in config["classes"]}
            self.class_colours = {int(c): v for c, v in colours.items()}
            self._show_classes()
            for layer in self._class_layers():
                self._colour_layer(layer)
            self.status.setText(f"model loaded from {folder} ({seg.dims}D features, classes "
                                + ", ".join(self.class_names[int(c)] for c in seg.classes_) + "): press Predict")

        return self._start(job, f"Load {folder.name}", loaded)
