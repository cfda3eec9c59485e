"""The app's Measure panel: the prediction shown, measured by alibi_vit.measure (the computation of
`alibi-vit segment measure`). Over HTTP: the fractions equal the pixel counts of the mask the app sends
(mask.png, counted here with numpy), every other number equals measure_mask's on that very mask, a volume's
slice is measured with the volume's spacing, a whole volume is predicted then measured in 3D (its fractions
the counts of the mask its model predicts, its scratch folder removed, also on Cancel), and a request with
nothing to measure gets a reason. In
Chromium: after Train, the Measure button fills the table with the class swatches and draws S2(r) in the
class colours, as a screenshot shows."""

from __future__ import annotations

import csv
import io
import json
import time

import numpy as np
import pytest
import tifffile

from alibi_vit.measure.analysis import LOCAL_METRICS, MeasureOptions, measure_mask
from alibi_vit.measure.masks import array_source
from alibi_vit.measure.report import object_summary
from alibi_vit.synthetic import synthetic_micrograph
from tests.helpers import app_clients, benchmark_module, finished_job, png_pixels

pytest.importorskip("fastapi")
app_driver = benchmark_module("app_driver")   # benchmarks/app_driver.py: strokes inside grains, the browser
PHASES = ("matrix", "speckle", "stripes")   # phases 1..3 of synthetic_micrograph
SIZE = 160


@pytest.fixture
def micrograph(tmp_path):
    """A folder with one 3-phase micrograph m0.tif (16-bit), and its ground truth."""
    image, truth = synthetic_micrograph(SIZE, 3, seed=3)
    folder = tmp_path / "images"
    folder.mkdir()
    tifffile.imwrite(folder / "m0.tif", image)
    return folder, truth


def label_and_train(send, truth, image_id="m0"):
    """Three classes, two strokes inside grains of each phase, then Train (``send(method, path, body)`` → JSON)."""
    for name in PHASES:
        send("POST", "/api/classes", {"name": name})
    for phase in (1, 2, 3):
        for stroke in app_driver.strokes_inside(truth, phase, 2, 2, narrow_ok=True):
            points = [[int(x), int(y)] for x, y in stroke]
            send("POST", f"/api/images/{image_id}/strokes", {"class": phase, "radius": 2, "points": points})
    return send("POST", "/api/train", {"image": image_id})


def library_result(mask, spacing=None, unit="px") -> dict:
    return measure_mask(array_source(mask, spacing=spacing), MeasureOptions(metrics=LOCAL_METRICS, unit=unit,
                                                                             progress=False))


def check_against_library(panel: dict, expected: dict, axes=None) -> None:
    """Every number of the panel equals measure_mask's on the same mask (axis names mapped to ``axes``; default
    the mask's own)."""
    own = tuple(expected["axes"])
    axes = own if axes is None else axes
    rename = {**dict(zip(own, axes)), "mean": "mean"}
    rows = {r["phase"]: r for r in panel["classes"]}
    assert set(rows) == set(expected["fractions"]["phases"])
    objects = {r["phase"]: r for r in object_summary(expected)}
    for phase, entry in expected["fractions"]["phases"].items():
        row = rows[phase]
        assert row["tile_ci95_low"] == pytest.approx(entry["tile_ci95_low"])
        assert row["tile_ci95_high"] == pytest.approx(entry["tile_ci95_high"])
        assert row["tile_ci95_low"] <= row["fraction"] <= row["tile_ci95_high"]
        surface = expected["specific_surface"][phase]
        assert row["specific_surface_isotropic"] == pytest.approx(surface["isotropic"])
        assert row["specific_surface_faces"] == pytest.approx(surface["faces"])
        for key in ("objects", "border_objects", "mean_equivalent_diameter", "median_equivalent_diameter"):
            assert row[key] == pytest.approx(objects[phase][key]), (phase, key)
        spans = [rename[r["axis"]] for r in expected["percolation"] if r["phase"] == phase and r["percolates"]]
        assert row["percolates_along"] == " ".join(spans)
    pairs = {(r["phase_a"], r["phase_b"]): r for r in panel["interfaces"]}
    assert set(pairs) == {(r["phase_a"], r["phase_b"]) for r in expected["interfaces"]}
    for r in expected["interfaces"]:
        got = pairs[r["phase_a"], r["phase_b"]]
        assert got["isotropic_area"] == pytest.approx(r["isotropic_area"])
        assert got["faces_area"] == pytest.approx(r["faces_area"])
        assert [got[f"faces_{rename[a]}"] for a in own] == [r[f"faces_{a}"] for a in own]
    curves = {(c["phase"], c["axis"]): c for c in panel["s2"]}
    for r in expected["s2"]:
        curve = curves[r["phase"], rename[r["axis"]]]
        assert curve["s2"][curve["r"].index(r["r"])] == pytest.approx(r["s2"])
        assert curve["distance"][curve["r"].index(r["r"])] == pytest.approx(r["distance"])


# ------------------------------------------------------------------------------------------ over HTTP
def test_measure_gives_the_counts_of_the_mask_shown_and_the_library_s_numbers(tmp_path, micrograph):
    folder, truth = micrograph
    with app_clients(tmp_path / "session") as start:
        session, _, client = start(folder)

        def send(method, path, body=None):
            answer = client.request(method, path, json=body)
            assert answer.status_code == 200, answer.text
            return answer.json()

        label_and_train(send, truth)
        job = finished_job(client, client.post("/api/images/m0/measure"))
        assert job["state"] == "done", job
        panel = job["result"]
        mask = png_pixels(client.get("/api/images/m0/mask.png"))   # the mask the page shows, as the app sends it

    assert job["progress"] == 1 and job["done"] == job["total"] == mask.size
    assert panel["measured"] == {"kind": "image", "id": "m0", "name": "m0.tif", "model": 1, "crf": False}
    assert panel["shape"] == [SIZE, SIZE] and panel["unit"] == "px" and panel["spacing"] == [1, 1]
    # Fractions: the pixels of each class in the mask, counted independently of the measure package.
    counts = np.bincount(mask.ravel(), minlength=4)
    assert counts[0] == 0
    classes = {c["value"]: c for c in session.classes}
    assert [r["phase"] for r in panel["classes"]] == [v for v in (1, 2, 3) if counts[v]]
    for row in panel["classes"]:
        assert row["pixels"] == counts[row["phase"]]
        assert row["fraction"] == pytest.approx(counts[row["phase"]] / mask.size, abs=1e-12)
        assert (row["name"], row["color"]) == (classes[row["phase"]]["name"], classes[row["phase"]]["color"])
    assert panel["interval"]["level"] == 0.95 and panel["interval"]["tiles"] > 1
    check_against_library(panel, library_result(mask))
    # The CSV is the table: a row per class, the same numbers in full.
    table = list(csv.DictReader(io.StringIO(panel["csv"])))
    assert [(int(r["phase"]), r["class"]) for r in table] == [(r["phase"], r["name"]) for r in panel["classes"]]
    for written, row in zip(table, panel["classes"]):
        assert float(written["fraction"]) == row["fraction"]
        assert float(written["specific_surface_isotropic_per_px"]) == row["specific_surface_isotropic"]
        assert int(written["objects"]) == row["objects"]
    json.dumps(panel, allow_nan=False)   # valid JSON: no NaN or infinity


def test_a_volume_slice_is_measured_with_the_volume_s_spacing(tmp_path):
    """An XZ slice of a two-layer stack whose ImageJ metadata give z 2.0 and x 0.5: lengths in that unit, the
    rows named z, the top layer spanning x and not z; every number as measure_mask gives it on the slice's
    prediction (read from the overlay PNG's class colours)."""
    from fastapi.testclient import TestClient

    from alibi_vit.app.engine import Engine
    from alibi_vit.app.server import create_app
    from alibi_vit.app.session import Session
    from alibi_vit.app.volume import Volumes

    rng = np.random.default_rng(0)
    z = np.arange(32)[:, None, None]
    truth = np.broadcast_to(np.where(z < 16, 1, 2), (32, 24, 24))
    volume = np.clip(np.where(truth == 1, 90.0, 160.0) + rng.normal(0, 18, truth.shape), 0, 255).astype(np.uint8)
    folder = tmp_path / "data"
    folder.mkdir()
    tifffile.imwrite(folder / "v.tif", volume, imagej=True, resolution=(2.0, 2.0), metadata={"spacing": 2.0, "axes": "ZYX"})
    volumes = Volumes(tmp_path / "session")
    session = Session(tmp_path / "session", [folder], allowed_roots=[folder], volume_claim=volumes.claim)
    engine = Engine(session)
    try:
        client = TestClient(create_app(session, engine, volumes=volumes))
        no_model = client.post("/api/volumes/v/measure", json={"view": "xz", "index": 12})
        assert no_model.status_code == 409 and "Train and predict first" in no_model.json()["detail"]
        for name, colour in (("top", "#ff0000"), ("bottom", "#00ff00")):
            client.post("/api/classes", json={"name": name, "color": colour})
        for cls, rows in ((1, (3, 10)), (2, (20, 28))):
            for row in rows:
                client.post("/api/volumes/v/strokes", json={"view": "xz", "index": 12, "class": cls, "radius": 1.5,
                                                            "points": [[2, row], [21, row]]})
        assert client.post("/api/volumes/train").status_code == 200
        assert client.post("/api/volumes/v/measure", json={"view": "xz", "index": 99}).status_code == 404
        job = finished_job(client, client.post("/api/volumes/v/measure", json={"view": "xz", "index": 12}))
        assert job["state"] == "done", job
        panel = job["result"]
        shown = png_pixels(client.get("/api/volumes/v/prediction/xz/12.png"))
    finally:
        engine.close()
    mask = np.where(shown[..., 1] == 255, 2, 1).astype(np.uint8)   # green: class 2, red: class 1
    assert np.mean(mask == truth[:, 12, :]) > 0.95
    assert panel["measured"]["name"] == "v.tif XZ y = 12" and panel["axes"] == ["z", "x"]
    assert panel["spacing"] == [2.0, 0.5] and panel["unit"] == "unit" and panel["shape"] == [32, 24]
    for row in panel["classes"]:
        assert row["fraction"] == pytest.approx(np.mean(mask == row["phase"]), abs=1e-12)
    check_against_library(panel, library_result(mask, spacing=(2.0, 0.5), unit="unit"), axes=("z", "x"))
    top = next(r for r in panel["classes"] if r["phase"] == 1)
    assert top["percolates_along"] == "x"
    assert {c["axis"] for c in panel["s2"]} == {"z", "x"}   # unequal spacing: no mean over the axes


def test_measure_without_a_prediction_or_of_an_unknown_image_gets_a_reason(tmp_path, micrograph):
    folder, _ = micrograph
    with app_clients(tmp_path / "session") as start:
        _, _, client = start(folder)
        early = client.post("/api/images/m0/measure")
        assert early.status_code == 409
        assert early.json()["detail"] == "nothing to measure: there is no prediction of m0.tif yet. Train and predict first"
        unknown = client.post("/api/images/nope/measure")
        assert unknown.status_code == 404 and unknown.json()["detail"] == "no image 'nope' in this session"
        assert client.post("/api/volumes/nope/measure", json={"view": "xy", "index": 0}).status_code == 404
        assert client.get("/api/jobs/j1").status_code == 404   # nothing was started


# ------------------------------------------------------------------------------------------ a whole volume
VOLUME_SHAPE = (24, 40, 48)   # (z, y, x): one prediction block
VOLUME_SPACING = (2.0, 0.5, 0.5)   # from the stack's ImageJ metadata: z spacing 2, pixel 0.5


@pytest.fixture
def volume_app(tmp_path):
    """The app on a folder holding v.tif: a top layer (class 1, dark) over a bottom one (class 2, bright) with a
    bright ball in the top layer, anisotropic spacing in its metadata; classes top and bottom, strokes on an XZ
    slice. Yields (client, engine, volumes, path of v.tif), the volume model not trained yet."""
    from fastapi.testclient import TestClient

    from alibi_vit.app.engine import Engine
    from alibi_vit.app.server import create_app
    from alibi_vit.app.session import Session
    from alibi_vit.app.volume import Volumes

    z, y, x = np.indices(VOLUME_SHAPE)
    ball = (z - 5) ** 2 + ((y - 28) / 2) ** 2 + ((x - 24) / 2) ** 2 <= 16   # round in µm: 4 z slices, 16 px across
    truth = np.where((z >= 12) | ball, 2, 1)
    rng = np.random.default_rng(1)
    volume = np.clip(np.where(truth == 1, 90.0, 160.0) + rng.normal(0, 18, truth.shape), 0, 255).astype(np.uint8)
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / "v.tif"
    tifffile.imwrite(path, volume, imagej=True, resolution=(2.0, 2.0), metadata={"spacing": 2.0, "axes": "ZYX"})
    volumes = Volumes(tmp_path / "session")
    session = Session(tmp_path / "session", [folder], allowed_roots=[folder], volume_claim=volumes.claim)
    engine = Engine(session)
    try:
        client = TestClient(create_app(session, engine, volumes=volumes))
        for name, colour in (("top", "#ff0000"), ("bottom", "#00ff00")):
            client.post("/api/classes", json={"name": name, "color": colour})
        for cls, rows in ((1, (3, 9)), (2, (16, 21))):
            for row in rows:
                answer = client.post("/api/volumes/v/strokes", json={"view": "xz", "index": 10, "class": cls,
                                                                     "radius": 1.5, "points": [[2, row], [45, row]]})
                assert answer.status_code == 200, answer.text
        yield client, engine, volumes, path
    finally:
        engine.close()


def scratch_left(volumes) -> list:
    """What a whole-volume measurement (or the Save it runs) leaves in the session's volumes folder."""
    return sorted(p.name for p in (volumes.folder / "volumes").glob(".*"))


def test_a_whole_volume_is_predicted_then_measured_in_3d(volume_app):
    """Measure the whole volume: its fractions are the voxel counts of the mask the trained model predicts (by
    VolumeSegmenter.predict, not the Save's streaming), every other number measure_mask's on that mask with the
    volume's spacing, per axis z, y, x; the scratch folder is gone; the slice form still works beside it."""
    from alibi_vit.chunked import open_volume
    from alibi_vit.trainable import VolumeSegmenter

    client, _, volumes, path = volume_app
    early = client.post("/api/volumes/v/measure", json={"whole": True})
    assert early.status_code == 409 and "Train and predict first" in early.json()["detail"]
    assert client.post("/api/volumes/nope/measure", json={"whole": True}).status_code == 404
    for body in ({}, {"whole": False}, {"view": "xy"}, {"index": 3}, {"whole": True, "view": "xy", "index": 0}):
        bad = client.post("/api/volumes/v/measure", json=body)
        assert bad.status_code == 400 and bad.json()["detail"].startswith("measure either a slice"), (body, bad.text)
    assert client.post("/api/volumes/train").status_code == 200
    started = time.perf_counter()
    job = finished_job(client, client.post("/api/volumes/v/measure", json={"whole": True}))
    seconds = time.perf_counter() - started
    assert job["state"] == "done", job
    panel = job["result"]
    assert finished_job(client, client.post("/api/volumes/v/measure", json={"view": "xy", "index": 3}))["state"] == "done"

    seg = VolumeSegmenter.load(volumes.folder / "volumes" / "model")
    mask = np.asarray(seg.predict([open_volume(path)])[0]).astype(np.uint8)
    voxels = mask.size
    assert scratch_left(volumes) == []
    assert job["done"] == job["total"] == 2 * voxels   # the voxels predicted, then read
    assert panel["measured"] == {"kind": "volume", "id": "v", "name": "v.tif (whole volume)", "whole": True,
                                 "model": 1, "crf": False}
    assert panel["shape"] == list(VOLUME_SHAPE) and panel["ndim"] == 3 and panel["axes"] == ["z", "y", "x"]
    assert panel["spacing"] == list(VOLUME_SPACING) and panel["unit"] == "unit" and panel["cells"] == "voxels"
    counts = np.bincount(mask.ravel(), minlength=3)
    assert counts[0] == 0 and counts[1] > 0 and counts[2] > 0
    for row in panel["classes"]:
        assert row["voxels"] == counts[row["phase"]] and "pixels" not in row
        assert row["fraction"] == pytest.approx(counts[row["phase"]] / voxels, abs=1e-12)
    check_against_library(panel, library_result(mask, spacing=VOLUME_SPACING, unit="unit"))
    assert {c["axis"] for c in panel["s2"]} == {"z", "y", "x"}   # unequal spacing: no mean over the axes
    assert {"faces_z", "faces_y", "faces_x"} <= set(panel["interfaces"][0])
    assert {r["axis"] for r in panel["percolation"]} == {"z", "y", "x"}
    top = next(r for r in panel["classes"] if r["phase"] == 1)
    assert top["percolates_along"] == "y x"   # the top layer spans y and x, not z
    table = list(csv.DictReader(io.StringIO(panel["csv"])))
    assert "voxels" in table[0] and "specific_surface_isotropic_per_unit" in table[0]
    assert [int(r["voxels"]) for r in table] == [r["voxels"] for r in panel["classes"]]
    json.dumps(panel, allow_nan=False)
    print(f"whole-volume measurement of {VOLUME_SHAPE}: {seconds:.2f} s")


def test_cancel_ends_a_whole_volume_measurement_and_removes_its_scratch(volume_app):
    """Cancel while the volume is predicted (the job held before the Save copies the model, by holding the
    volumes' lock): the job ends cancelled, and neither its scratch folder nor the Save's model copy stays."""
    from alibi_vit.app.measurements import start_volume_measurement

    client, engine, volumes, _ = volume_app
    assert client.post("/api/volumes/train").status_code == 200
    with volumes.lock:   # the Save copies the model under it: the job waits there until Cancel is pressed
        job = start_volume_measurement(engine, volumes, "v")
        time.sleep(0.2)
        assert client.delete(f"/api/jobs/{job.id}").status_code == 200
    deadline = time.monotonic() + 60
    while job.state == "running":
        assert time.monotonic() < deadline, job.record()
        time.sleep(0.05)
    assert job.state == "cancelled", job.record()
    assert job.message == "cancelled while predicting the volume" and job.result is None
    assert scratch_left(volumes) == []


# ------------------------------------------------------------------------------------------ in Chromium
def test_the_measure_panel_shows_the_class_swatches_and_s2_curves_in_the_class_colours(tmp_path, micrograph):
    """Train over HTTP, open the image in the page, press Measure: in a screenshot, each row's swatch is its
    class's colour and the S2 canvas holds pixels of every class colour (one curve each)."""
    from PIL import Image

    if not app_driver.CHROMIUM.exists():
        pytest.skip("the browser tests need Debian's Chromium at /usr/bin/chromium (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="the browser tests need the playwright package (pip install playwright)")
    folder, truth = micrograph
    server = app_driver.Server(folder, tmp_path / "session")
    try:
        label_and_train(server.json, truth)
        colours = {c["value"]: c["color"] for c in server.json("GET", "/api/state")["classes"]}
        with sync_api.sync_playwright() as playwright:
            browser = app_driver.launch_chromium(playwright)
            page = browser.new_page(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
            page.set_default_timeout(60_000)
            errors = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(server.url)
            page.click('.image-row[data-id="m0"]')
            app_driver.wait_timing(page, "image_shown", "m0", 1, timeout_ms=60_000)
            page.click("#measure")
            app_driver.wait_timing(page, "measure", "m0", 1, timeout_ms=60_000)
            page.locator("#measure-panel").scroll_into_view_if_needed()
            page.mouse.move(640, 5)
            page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
            shot = np.asarray(Image.open(io.BytesIO(page.screenshot())).convert("RGB")).astype(int)
            (tmp_path / "measure_panel.png").write_bytes(page.locator("#measure-panel").screenshot())
            rows = page.evaluate("() => [...document.querySelectorAll('#measure-table tbody tr')].map(tr => { "
                                 "const r = tr.querySelector('.swatch').getBoundingClientRect(); "
                                 "return [Number(tr.dataset.value), r.left, r.top, r.right, r.bottom]; })")
            canvas = page.locator("#measure-s2").bounding_box()
            result = page.evaluate("() => window.measureApp.result")
            browser.close()
        assert not errors, f"script errors in the page: {errors}"
    finally:
        server.stop()

    def rgb(hex_colour):
        return np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])

    assert [v for v, *_ in rows] == [r["phase"] for r in result["classes"]] and len(rows) == 3
    for value, left, top, right, bottom in rows:
        swatch = shot[int(top) + 2:int(bottom) - 2, int(left) + 2:int(right) - 2].reshape(-1, 3)
        assert len(swatch) and np.all(np.abs(swatch - rgb(colours[value])).max(axis=1) <= 2), (value, swatch[:3])
    region = shot[int(canvas["y"]):int(canvas["y"] + canvas["height"]),
                  int(canvas["x"]):int(canvas["x"] + canvas["width"])].reshape(-1, 3)
    for value, colour in colours.items():
        near = np.abs(region - rgb(colour)).max(axis=1) <= 40
        assert near.sum() >= 30, f"class {value} ({colour}): {near.sum()} pixels of its colour in the S2 plot"
