"""The app's featurisation tiles and prediction blocks: models the app trains use ``APP_TILE``
(smaller than the library's default, so a Train featurises less beyond the labels and the view),
which changes no result: their tiled predictions equal the whole image's, ``segment apply`` of a
saved app model gives the app's mask, and models saved with other tiles are restored with theirs.
The classifier library is imported when the app starts, not at the first Train."""

import io
import json
import subprocess
import sys
import time

import numpy as np
import pytest
import tifffile
from PIL import Image

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from alibi_vit.app.engine import APP_TILE, Engine  # noqa: E402
from alibi_vit.app.predictions import PredictionStore, blocks_per_tile  # noqa: E402
from alibi_vit.app.server import create_app  # noqa: E402
from alibi_vit.app.session import Session  # noqa: E402
from alibi_vit.cli.main import main  # noqa: E402
from alibi_vit.synthetic import synthetic_micrograph  # noqa: E402
from alibi_vit.trainable import TrainableSegmenter  # noqa: E402

HEIGHT, WIDTH = 700, 1024  # 2 × 2 tiles of 518 px; one tile of the library's 1036


@pytest.fixture(scope="module")
def micrograph():
    image, truth = synthetic_micrograph(WIDTH, seed=5)[:2]
    return image[:HEIGHT], truth[:HEIGHT]


@pytest.fixture
def folder(tmp_path, micrograph):
    folder = tmp_path / "images"
    folder.mkdir()
    tifffile.imwrite(folder / "m.tif", micrograph[0])
    return folder


@pytest.fixture
def start(tmp_path):
    engines = []

    def start(folder, **engine_kwargs):
        session = Session(tmp_path / "session", [folder], allowed_roots=[folder])
        engines.append(Engine(session, **engine_kwargs))
        return session, engines[-1], TestClient(create_app(session, engines[-1]))

    yield start
    for engine in engines:
        engine.close()


def png(content) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(content)))


def draw_in_every_tile(client, truth) -> None:
    """Three classes, and in each 518-px tile three dots per class well inside its phase."""
    from scipy.ndimage import binary_erosion

    for name in ("dark", "middle", "bright"):
        assert client.post("/api/classes", json={"name": name}).status_code == 200
    for rows in (slice(0, 518), slice(518, HEIGHT)):
        for cols in (slice(0, 518), slice(518, WIDTH)):
            for v in (1, 2, 3):
                inside = np.zeros(truth.shape, bool)
                inside[rows, cols] = binary_erosion(truth[rows, cols] == v, iterations=3)
                ys, xs = np.nonzero(inside)
                for i in np.linspace(0, len(ys) - 1, 3).round().astype(int) if len(ys) else []:
                    r = client.post("/api/images/m/strokes",
                                    json={"class": v, "radius": 2, "points": [[float(xs[i]), float(ys[i])]]})
                    assert r.status_code == 200, r.json()


def whole_image_mask(seg, image) -> np.ndarray:
    """``seg``'s mask of ``image`` computed as one tile (its features on the whole image at once)."""
    tile = seg.tile
    seg.tile = max(image.shape) + 14
    try:
        assert len(seg.tile_grid(seg.source(image))) == 1
        return seg.predict([image])[0]
    finally:
        seg.tile = tile


def test_blocks_are_the_smallest_divisions_of_a_tile_of_at_least_60_px():
    # hand-computed: 518 = 7 · 74, 1036 = 14 · 74, 252 = 4 · 63 (6 · 42 is too small), 84 has no division ≥ 60 px
    assert [blocks_per_tile(t) for t in (518, 1036, 252, 84, 14)] == [7, 14, 4, 1, 1]
    store = PredictionStore((1000, 1200), 518, [1, 2], model=1, crf=False)
    # a view rows 100..150, cols 200..300 in the first tile: blocks 1–2 by rows, 2–4 by cols (74 px each)
    assert store.pending((slice(0, 518), slice(0, 518)), (slice(100, 150), slice(200, 300))) == \
        (slice(74, 222), slice(148, 370))


def test_app_models_use_small_tiles_and_give_the_whole_image_and_segment_apply_mask(tmp_path, folder, micrograph,
                                                                                   start):
    image, truth = micrograph
    session, engine, client = start(folder)
    draw_in_every_tile(client, truth)
    r = client.post("/api/train", json={"image": "m"})
    assert r.status_code == 200, r.json()
    assert r.json()["prediction"]["complete"]
    mask = png(client.get("/api/images/m/mask.png").content)

    # The same fit outside the app (same tile, intensity range, labels) predicts that mask, tile by
    # tile and with the whole image as one tile.
    ref = TrainableSegmenter(intensity_range=session.fix_intensity(), colour=session.colour,
                             tile=APP_TILE)
    ref.fit([image], [np.asarray(session.label_image("m"))])
    assert len(ref.tile_grid(ref.source(image))) == 4
    np.testing.assert_array_equal(ref.predict([image])[0], mask)
    np.testing.assert_array_equal(whole_image_mask(ref, image), mask)

    job = client.post("/api/save", json={"what": ["model"], "image": "m"}).json()["job"]
    while (state := client.get(f"/api/jobs/{job}").json())["state"] == "running":
        time.sleep(0.05)
    assert state["state"] == "done", state
    model = tmp_path / "session" / "export" / "model"
    assert json.loads((model / "config.json").read_text())["tile"] == APP_TILE == 518
    assert main(["segment", "apply", "--model", str(model), "--images", str(folder), "--out", str(tmp_path / "out"),
                 "--no-overlay"]) == 0
    np.testing.assert_array_equal(png((tmp_path / "out" / "m_mask.png").read_bytes()), mask)


def test_a_model_trained_with_other_tiles_is_restored_with_them(folder, micrograph, start):
    """A model an earlier version saved with the library's 1036-px tiles keeps them when restored and
    predicts as before; the next Train makes a model of the app's tiles."""
    image, truth = micrograph
    session, engine, client = start(folder, feature_tile=1036)
    draw_in_every_tile(client, truth)
    assert client.post("/api/train", json={"image": "m"}).status_code == 200
    before = png(client.get("/api/images/m/mask.png").content)
    engine.close()

    session2, engine2, client2 = start(folder)
    assert engine2._model_seg.tile == 1036
    np.testing.assert_array_equal(png(client2.get("/api/images/m/mask.png").content), before)
    ref = TrainableSegmenter(intensity_range=session2.fix_intensity(), colour=session2.colour, tile=1036)
    ref.fit([image], [np.asarray(session2.label_image("m"))])
    np.testing.assert_array_equal(whole_image_mask(ref, image), before)
    assert client2.post("/api/train", json={"image": "m"}).status_code == 200
    assert engine2._model_seg.tile == APP_TILE


def test_the_classifier_library_is_imported_when_the_app_starts(tmp_path, folder):
    """In a fresh interpreter: no XGBoost before the engine exists, XGBoost soon after, no Train."""
    code = f"""
import sys, time
from pathlib import Path
from alibi_vit.app.engine import Engine
from alibi_vit.app.session import Session
from alibi_vit.trainable.classifier import PRIVATE_XGBOOST
assert "xgboost" not in sys.modules and PRIVATE_XGBOOST not in sys.modules
folder = Path({str(folder)!r})
engine = Engine(Session(Path({str(tmp_path / "session")!r}), [folder], allowed_roots=[folder]))
deadline = time.monotonic() + 120
while PRIVATE_XGBOOST not in sys.modules or not hasattr(sys.modules[PRIVATE_XGBOOST], "train"):
    assert time.monotonic() < deadline, "xgboost was not imported"
    time.sleep(0.05)
assert engine.model is None
engine.close()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
