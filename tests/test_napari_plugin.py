"""The napari plugin (alibi_vit/napari, docs/napari.md), driven headless through the real widget.

The viewer runs under Xvfb (pytest-xvfb starts it; `apt-get install xvfb libxcb-icccm4 libxcb-keysyms1
libxcb-xinerama0`); without napari, pytest-qt or a display every test here is skipped, saying which.
Strokes are painted with the Labels layer's own paint() (what a mouse drag calls), buttons are
clicked, and the widget's predictions are compared with what `alibi-vit segment train` + `segment
apply` make from the same strokes saved as a label image: they must be identical.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

napari = pytest.importorskip("napari", reason="napari is not installed (pip install -e '.[test]')")
pytest.importorskip("pytestqt", reason="pytest-qt is not installed (pip install -e '.[test]')")
if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
    pytest.skip("no display for napari's OpenGL canvas: install xvfb (pytest-xvfb then starts it) or run under "
                "xvfb-run", allow_module_level=True)

import tifffile
import zarr
from PIL import Image

from alibi_vit.cli import segment
from alibi_vit.synthetic import synthetic_micrograph
from alibi_vit.trainable import TrainableSegmenter, VolumeSegmenter
from tests.helpers import run_subcommand

TREES = 2  # a tiny forest: the tests check wiring and identity, not quality
WAIT_MS = 60_000
SCREENSHOT_DIR = os.environ.get("ALIBI_VIT_NAPARI_SCREENSHOTS")  # set to keep the screenshot (docs/napari.md)


def _widget(viewer):
    from alibi_vit.napari.widget import SegmentWidget

    widget = SegmentWidget(viewer)
    viewer.window.add_dock_widget(widget, name="alibi-vit")
    widget.trees_spin.setValue(TREES)
    return widget


def _wait(qtbot, widget):
    qtbot.waitUntil(lambda: not widget.busy, timeout=WAIT_MS)


def _stroke(layer, points, label, brush=3):
    """One drag of the brush through ``points`` (data coordinates), as the mouse paints it."""
    layer.brush_size = brush
    with layer.block_history():  # one stroke: one undo step and one paint event, as a mouse drag gives
        for a, b in itertools.pairwise(points):
            for t in np.linspace(0, 1, 8):
                layer.paint(tuple(np.asarray(a, float) * (1 - t) + np.asarray(b, float) * t), label)


def _strokes_2d(layer, mask):
    """Strokes inside each phase of a generated micrograph: short lines through pixels of that phase."""
    from scipy import ndimage as ndi

    for value in np.unique(mask):
        core = ndi.binary_erosion(mask == value, iterations=4)
        ys, xs = np.nonzero(core)
        picks = np.linspace(0, len(ys) - 1, 3).astype(int)
        for i in picks:
            _stroke(layer, [(ys[i], xs[i]), (ys[i], min(xs[i] + 2, mask.shape[1] - 1))], int(value))


def _ome_zarr(path, image, levels=2, chunks=64):
    """An NGFF 0.4 image (axes c, y, x, one channel) with ``levels`` pyramid levels."""
    group = zarr.open_group(str(path), mode="w", zarr_format=2)
    for i in range(levels):
        level = image[:: 2**i, :: 2**i]
        arr = group.create_array(str(i), shape=(1,) + level.shape, chunks=(1, chunks, chunks), dtype=level.dtype)
        arr[:] = level[None]
    group.attrs["multiscales"] = [{"version": "0.4", "axes": [{"name": "c", "type": "channel"},
                                                                {"name": "y", "type": "space"},
                                                                {"name": "x", "type": "space"}],
                                   "datasets": [{"path": str(i)} for i in range(levels)]}]
    return path


def _cli_masks(tmp_path, image_file: Path, labels: np.ndarray, options: list[str], name="cli"):
    """`segment train` on the image file and the strokes saved as a label PNG, then `segment apply`: the mask."""
    folder = tmp_path / f"{name}_train"
    folder.mkdir()
    shutil.copy(image_file, folder / image_file.name)
    Image.fromarray(labels.astype(np.uint8)).save(folder / f"{image_file.stem}_labels.png")
    model = tmp_path / f"{name}_model"
    assert run_subcommand(segment, ["train", "--images", str(folder / image_file.name), "--labels",
                                    str(folder / f"{image_file.stem}_labels.png"), "--out", str(model)]
                          + options) == 0
    return model, _apply(tmp_path, model, image_file, name)


def _apply(tmp_path, model, image_file, name):
    out = tmp_path / f"{name}_masks"
    assert run_subcommand(segment, ["apply", "--model", str(model), "--images", str(image_file), "--out",
                                    str(out), "--no-overlay"]) == 0
    return np.asarray(Image.open(out / f"{image_file.stem}_mask.png"))


@pytest.fixture
def micrograph(tmp_path):
    image, mask = synthetic_micrograph(96, phases=3, seed=3)
    path = tmp_path / "micrograph.tif"
    tifffile.imwrite(path, image)
    return path, image, mask


def test_reader_opens_an_ome_zarr_mosaic_lazily_as_a_multiscale_layer(make_napari_viewer, tmp_path):
    from alibi_vit.napari.reader import napari_get_reader

    image, _ = synthetic_micrograph(256, phases=3, seed=1)
    image = (1000 + image.astype(np.float64) / image.max() * 2000).astype(np.uint16)  # 1000..3000 of 65535
    path = _ome_zarr(tmp_path / "mosaic.ome.zarr", image, levels=3)
    assert napari_get_reader(str(tmp_path / "nothing.png")) is None
    viewer = make_napari_viewer()
    (layer,) = viewer.open(str(path), plugin="alibi-vit")  # napari finds the plugin through its manifest
    assert layer.multiscale and [tuple(level.shape) for level in layer.data] == [(256, 256), (128, 128), (64, 64)]
    lo, hi = layer.contrast_limits
    assert 1000 <= lo < 1500 and 2500 < hi <= 3000, "contrast limits from the data, not the uint16 range"
    np.testing.assert_array_equal(np.asarray(layer.data[1][10:50, 20:90]), image[::2, ::2][10:50, 20:90])
    assert layer.metadata["alibi_vit"]["path"] == str(path.resolve())


def test_reader_gives_a_volume_its_voxel_spacing(make_napari_viewer, tmp_path):
    rng = np.random.default_rng(0)
    volume = rng.integers(2000, 4000, (12, 40, 50), dtype=np.uint16)
    path = tmp_path / "stack.tif"
    tifffile.imwrite(path, volume, imagej=True, resolution=(1 / 0.5, 1 / 0.5), metadata={"spacing": 2.0, "unit": "um", "axes": "ZYX"})
    viewer = make_napari_viewer()
    (layer,) = viewer.open(str(path), plugin="alibi-vit")
    assert not layer.multiscale and layer.data.shape == (12, 40, 50)
    np.testing.assert_allclose(layer.scale, (2.0, 0.5, 0.5))
    lo, hi = layer.contrast_limits
    assert 2000 <= lo and hi < 4000
    np.testing.assert_array_equal(np.asarray(layer.data[5]), volume[5])


def test_widget_train_and_predict_equal_segment_train_and_apply(make_napari_viewer, qtbot, tmp_path, micrograph):
    path, image, mask = micrograph
    viewer = make_napari_viewer()
    viewer.open(str(path), plugin="alibi-vit")
    widget = _widget(viewer)
    assert widget.image_box.currentText() == "micrograph.tif"
    widget.scribble_button.click()
    scribbles = viewer.layers["micrograph.tif scribbles"]
    _strokes_2d(scribbles, mask)
    assert set(np.unique(scribbles.data)) == {0, 1, 2, 3}

    widget.train_button.click()  # fits, then predicts the view (here the whole image is on screen)
    _wait(qtbot, widget)
    after_train = np.array(viewer.layers["micrograph.tif prediction"].data)
    widget.scope_box.setCurrentText("whole")
    widget.predict_button.click()
    _wait(qtbot, widget)
    predicted = np.array(viewer.layers["micrograph.tif prediction"].data)
    uncertainty = np.array(viewer.layers["micrograph.tif uncertainty"].data)

    cli_model, cli_mask = _cli_masks(tmp_path, path, np.asarray(scribbles.data), widget.settings().options())
    np.testing.assert_array_equal(predicted, cli_mask)  # one engine: the same strokes give the same mask
    seen = after_train > 0
    assert seen.mean() > 0.9
    np.testing.assert_array_equal(after_train[seen], cli_mask[seen])
    assert (predicted == mask).mean() > 0.6  # it learnt the phases, roughly, from 9 strokes and 2 trees
    # Uncertainty 1 − max p: zero where the forest agrees; the fractions table counts the mask.
    expected = TrainableSegmenter.load(cli_model).predict_proba([image])[0]
    np.testing.assert_array_equal(uncertainty, np.round((1 - expected.max(-1)) * 255).astype(np.uint8))
    fractions = {c: f for c, (_, f) in widget.fractions.items()}
    for c in (1, 2, 3):
        assert fractions[c] == pytest.approx((cli_mask == c).mean())
    assert widget.fraction_table.rowCount() == 3

    # Save: a segment apply model folder, named classes; apply gives the widget's mask.
    model = widget.save_model(tmp_path / "napari_model")
    config = json.loads((model / "config.json").read_text())
    assert config["class_names"] == {"1": "class 1", "2": "class 2", "3": "class 3"}
    np.testing.assert_array_equal(_apply(tmp_path, model, path, "napari"), predicted)

    # Load the command's model into the widget: its prediction is the command's.
    viewer.layers.remove("micrograph.tif prediction")
    widget.load_model(cli_model)
    _wait(qtbot, widget)
    assert widget.model_source == str(cli_model) and widget.trees_spin.value() == TREES
    widget.predict("whole")
    _wait(qtbot, widget)
    np.testing.assert_array_equal(viewer.layers["micrograph.tif prediction"].data, cli_mask)


def test_a_vit_backbone_in_the_widget_trains_the_model_segment_train_makes(make_napari_viewer, qtbot, tmp_path,
                                                                             micrograph):
    """ViT features (a randomly initialised ALiBi ViT-S, named as such) beside the classical ones: the widget's
    model predicts what `segment train` + `segment apply` predict from the same strokes and options."""
    path, _, mask = micrograph
    viewer = make_napari_viewer()
    viewer.open(str(path), plugin="alibi-vit")
    widget = _widget(viewer)
    widget.backbone_edit.setText("alibi_vit_small_patch14_reg4_dinov2")
    widget.random_init_box.setChecked(True)
    widget.scribble_button.click()
    _strokes_2d(viewer.layers["micrograph.tif scribbles"], mask)
    widget.train("whole")
    _wait(qtbot, widget)
    assert widget.segmenter.vit is not None, widget.status.text()
    options = widget.settings().options()
    assert "--backbone" in options and "--allow-random-init" in options
    _, cli_mask = _cli_masks(tmp_path, path, np.asarray(viewer.layers["micrograph.tif scribbles"].data), options)
    np.testing.assert_array_equal(viewer.layers["micrograph.tif prediction"].data, cli_mask)


def test_live_mode_retrains_after_each_stroke(make_napari_viewer, qtbot, micrograph):
    path, _, mask = micrograph
    viewer = make_napari_viewer()
    viewer.open(str(path), plugin="alibi-vit")
    widget = _widget(viewer)
    scribbles = widget.scribble_layer(create=True)
    _strokes_2d(scribbles, np.where(mask == 3, 0, mask))  # phases 1 and 2 only
    widget.train()
    _wait(qtbot, widget)
    assert list(widget.segmenter.classes_) == [1, 2]
    widget.live_box.setChecked(True)
    ys, xs = np.nonzero(mask == 3)
    _stroke(scribbles, [(ys[0], xs[0]), (ys[len(ys) // 2], xs[len(ys) // 2])], 3)  # the paint event retrains
    assert widget.busy
    _wait(qtbot, widget)
    assert list(widget.segmenter.classes_) == [1, 2, 3]
    assert 3 in np.unique(viewer.layers["micrograph.tif prediction"].data)


def test_volume_scribbles_on_a_slice_train_3d_features(make_napari_viewer, qtbot, tmp_path):
    from scipy import ndimage as ndi

    rng = np.random.default_rng(2)
    field = ndi.gaussian_filter(rng.standard_normal((16, 48, 48)), 3)
    phases = np.digitize(field, np.quantile(field, [0.5])) + 1
    volume = (1000 * phases + rng.normal(0, 150, phases.shape)).astype(np.uint16)
    path = tmp_path / "volume.tif"
    tifffile.imwrite(path, volume, imagej=True, metadata={"spacing": 2.0, "axes": "ZYX"})
    viewer = make_napari_viewer()
    (layer,) = viewer.open(str(path), plugin="alibi-vit")
    np.testing.assert_allclose(layer.scale, (2.0, 1.0, 1.0))
    widget = _widget(viewer)
    viewer.dims.set_point(0, 8 * 2.0)  # world units: slice 8
    scribbles = widget.scribble_layer(create=True)
    for value in (1, 2):
        ys, xs = np.nonzero(ndi.binary_erosion(phases[8] == value, iterations=3))
        _stroke(scribbles, [(8, ys[0], xs[0]), (8, ys[-1], xs[-1])], value, brush=2)
    labels = np.array(scribbles.data)
    assert set(np.unique(labels[8])) == {0, 1, 2} and not labels[:8].any() and not labels[9:].any()
    widget.train()  # a volume: predicts the slice shown
    _wait(qtbot, widget)
    assert widget.segmenter.dims == 3
    shown = np.array(viewer.layers["volume.tif prediction"].data)
    assert shown[8].all() and not shown[:8].any() and not shown[9:].any()
    widget.predict("whole")  # every block: volume fractions
    _wait(qtbot, widget)
    whole = np.array(viewer.layers["volume.tif prediction"].data)
    assert sum(f for _, f in widget.fractions.values()) == pytest.approx(1.0)
    assert "volume fractions" in widget.fraction_table.toolTip()

    # The command on the same strokes, saved as a label stack: 3D features with the file's spacing.
    folder = tmp_path / "cli"
    folder.mkdir()
    shutil.copy(path, folder / path.name)
    tifffile.imwrite(folder / "volume_labels.tif", labels, imagej=True, metadata={"axes": "ZYX"})
    assert run_subcommand(segment, ["train", "--images", str(folder / path.name), "--labels",
                                    str(folder / "volume_labels.tif"), "--out", str(tmp_path / "model")]
                          + widget.settings().options()) == 0
    assert run_subcommand(segment, ["apply", "--model", str(tmp_path / "model"), "--images", str(path),
                                    "--out", str(tmp_path / "masks")]) == 0
    cli_mask = tifffile.imread(tmp_path / "masks" / "volume_mask.tif")
    np.testing.assert_array_equal(whole, cli_mask)
    np.testing.assert_array_equal(shown[8], cli_mask[8])  # the slice from its plane's features alone, the same
    assert (whole == phases).mean() > 0.8
    for c in (1, 2):
        assert widget.fractions[c][1] == pytest.approx((cli_mask == c).mean())

    # napari's dims rolled so that the slider moves along y: strokes in that XZ plane, and Train predicts it.
    viewer.layers.remove("volume.tif prediction")
    viewer.dims.order = (1, 0, 2)
    viewer.dims.set_point(1, 30)
    for value in (1, 2):
        zs, xs = np.nonzero(ndi.binary_erosion(phases[:, 30] == value, iterations=1))
        _stroke(scribbles, [(zs[0], 30, xs[0]), (zs[-1], 30, xs[-1])], value, brush=1)
    assert (np.array(scribbles.data)[:, 30] != labels[:, 30]).any()
    widget.train()
    _wait(qtbot, widget)
    shown = np.array(viewer.layers["volume.tif prediction"].data)
    assert shown[:, 30].all() and not np.delete(shown, 30, axis=1).any()
    np.testing.assert_array_equal(shown[:, 30], widget.segmenter.predict([volume])[0][:, 30])
    assert "y slice 30" in widget.status.text()


def test_errors_are_notifications_with_the_engine_messages(make_napari_viewer, qtbot, micrograph, tmp_path):
    from napari.utils.notifications import notification_manager

    path, _, mask = micrograph
    viewer = make_napari_viewer()
    viewer.open(str(path), plugin="alibi-vit")
    widget = _widget(viewer)
    before = len(notification_manager.records)
    widget.train()  # no scribble layer yet
    assert "no scribbles for micrograph.tif" in widget.status.text()
    scribbles = widget.scribble_layer(create=True)
    _strokes_2d(scribbles, np.where(mask == 1, 1, 0))
    widget.train()
    _wait(qtbot, widget)
    assert "only class 1 is labelled: at least two classes are needed" in widget.status.text()
    # A volume model given a 2D image.
    rng = np.random.default_rng(0)
    volume = rng.integers(0, 255, (6, 20, 20)).astype(np.uint8)
    labels = np.zeros_like(volume)
    labels[3, 2:5, 2:5], labels[3, 12:15, 12:15] = 1, 2
    VolumeSegmenter(classifier_params={"n_estimators": 1}).fit([volume], [labels]).save(tmp_path / "vol_model")
    widget.load_model(tmp_path / "vol_model")
    _wait(qtbot, widget)
    widget.predict("whole")
    _wait(qtbot, widget)
    assert "is a 2D image but the model segments volumes" in widget.status.text()
    messages = [str(n.message) for n in notification_manager.records[before:]]
    assert any("only class 1 is labelled" in m for m in messages)
    assert any("model segments volumes" in m for m in messages)


def test_sample_data_and_screenshot(make_napari_viewer, qtbot, tmp_path):
    viewer = make_napari_viewer(show=True)
    viewer.window.resize(1400, 850)
    viewer.open_sample("alibi-vit", "tem")
    assert [layer.name for layer in viewer.layers] == ["isb_tem", "isb_tem scribbles"]
    widget = _widget(viewer)
    assert widget.image_box.currentText() == "isb_tem"
    assert list(widget.class_names.values()) == ["phase 1", "phase 2"]  # the sample's class names
    widget.train()
    _wait(qtbot, widget)
    prediction = viewer.layers["isb_tem prediction"].data
    assert set(np.unique(prediction)) == {1, 2}
    viewer.layers["isb_tem scribbles"].visible = True
    shot = viewer.screenshot(str(tmp_path / "napari.png"), canvas_only=False, flash=False)
    assert shot.shape[0] > 400 and shot.shape[1] > 800 and shot[..., :3].std() > 10  # a drawn window, not blank
    if SCREENSHOT_DIR:
        Path(SCREENSHOT_DIR).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "napari.png", Path(SCREENSHOT_DIR) / "napari_screenshot.png")
