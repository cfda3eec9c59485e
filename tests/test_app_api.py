"""``alibi-vit app``'s server without a browser: the API of alibi_vit/app/API.md, the session
folder, and every bad input the page can send (a 4xx with a reason, and the server goes on)."""

import io
import json
import threading
import time

import numpy as np
import pytest
import tifffile
from PIL import Image

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from alibi_vit.app.engine import Engine, Job  # noqa: E402
from alibi_vit.app.server import create_app  # noqa: E402
from alibi_vit.app.session import Session, rasterise_stroke  # noqa: E402
from alibi_vit.cli.main import main  # noqa: E402
from alibi_vit.synthetic import synthetic_micrograph  # noqa: E402
from alibi_vit.trainable import TrainableSegmenter, mean_iou, read_labels, scribbles  # noqa: E402
from alibi_vit.trainable.cache import FeatureCache  # noqa: E402

SIZE = 160


@pytest.fixture
def micrograph(tmp_path):
    image, truth = synthetic_micrograph(SIZE, seed=3)[:2]
    folder = tmp_path / "images"
    folder.mkdir()
    tifffile.imwrite(folder / "m0.tif", image)  # 12-bit values in a 16-bit TIFF
    return folder, image, truth


@pytest.fixture
def start(tmp_path):
    """start(folder, token=None) → (session, engine, client) on tmp_path/session; engines closed afterwards."""
    engines = []

    def start(folder, token=None):
        session = Session(tmp_path / "session", [folder], allowed_roots=[folder])
        engines.append(Engine(session))
        return session, engines[-1], TestClient(create_app(session, engines[-1], token=token, max_upload_mb=0.5))

    yield start
    for engine in engines:
        engine.close()


def strokes_from(truth, seed=0):
    """Two short strokes per phase, as [x, y] points inside that phase (from the scribble generator)."""
    lab = scribbles(truth, per_class=2, rng=np.random.default_rng(seed))
    out = {}
    for v in np.unique(lab[lab > 0]):
        ys, xs = np.nonzero(lab == v)
        order = np.argsort(xs + SIZE * ys)[::7]
        out[int(v)] = [[float(xs[i]), float(ys[i])] for i in order]
    return out


def draw_and_train(client, truth):
    for name in ("dark", "middle", "bright"):
        assert client.post("/api/classes", json={"name": name}).status_code == 200
    for value, points in strokes_from(truth).items():
        for p in points:  # one disc per point: the labels are then inside the phase
            r = client.post("/api/images/m0/strokes", json={"class": value, "radius": 1.5, "points": [p]})
            assert r.status_code == 200, r.json()
    r = client.post("/api/train", json={"image": "m0"})
    assert r.status_code == 200, r.json()
    return r.json()


def read_png(content) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(content)))


def test_rasterised_stroke_is_the_capsule_around_the_polyline():
    labels = np.zeros((20, 30), np.uint8)
    rasterise_stroke(labels, [[5, 10], [20, 10]], 3, 2)
    yy, xx = np.mgrid[:20, :30]
    t = np.clip((xx - 5) / 15, 0, 1)  # hand-computed distance to the horizontal segment y = 10, x in [5, 20]
    inside = (xx - 5 - 15 * t) ** 2 + (yy - 10) ** 2 <= 9
    assert np.array_equal(labels == 2, inside)
    rasterise_stroke(labels, [[0.0, 0.0]], 1.0, 3)  # one point: a disc, clipped at the border
    assert labels[0, 0] == labels[0, 1] == labels[1, 0] == 3 and labels[1, 1] == 0


def test_feature_cache_gives_the_same_predictions_and_evicts_least_recent(micrograph):
    _, image, truth = micrograph
    labels = scribbles(truth, per_class=2, rng=np.random.default_rng(0))
    lo_hi = (float(image.min()), float(image.max()))
    plain = TrainableSegmenter(intensity_range=lo_hi, tile=84).fit([image], [labels])
    cache = FeatureCache()
    cached = TrainableSegmenter(intensity_range=lo_hi, tile=84, cache=cache)
    cached.precompute(image)
    assert len(cache) == 4 and cache.misses == 4  # 160 px in 84-px tiles: 2 × 2 tiles
    cached.fit([image], [labels])
    assert cache.misses == 4 and cache.hits >= 4
    assert cached.intensity_range == lo_hi  # kept, not refitted on the training image
    assert np.array_equal(plain.predict_proba([image])[0], cached.predict_proba([image])[0])
    small = FeatureCache(max_bytes=3 * 10)
    for key in "abcd":
        small.put(key, np.zeros(10, np.uint8))
    assert "a" not in small and all(k in small for k in "bcd") and small.nbytes == 30


def test_draw_train_predict_save_and_segment_apply_agree(tmp_path, micrograph, start):
    folder, image, truth = micrograph
    session, engine, client = start(folder)
    state = client.get("/api/state").json()
    assert [(i["id"], i["width"], i["height"]) for i in state["images"]] == [("m0", SIZE, SIZE)]
    assert client.post("/api/images/m0/open").status_code == 200
    shown = read_png(client.get("/api/images/m0/display.png").content)
    assert shown.shape == (SIZE, SIZE) and shown.dtype == np.uint8 and shown.max() > 200 and shown.min() < 50

    result = draw_and_train(client, truth)
    assert result["model"]["classes"] == [1, 2, 3]
    mask = read_png(client.get("/api/images/m0/mask.png").content)
    assert mean_iou(mask, truth) >= 0.7
    fractions = {c["value"]: c["fraction"] for c in result["prediction"]["fractions"]}
    assert fractions == pytest.approx({v: float((mask == v).mean()) for v in (1, 2, 3)})
    colours = read_png(client.get("/api/images/m0/prediction.png").content)
    assert colours.shape == (SIZE, SIZE, 4) and tuple(colours[mask == 2][0][:3]) == (0x3C, 0xB4, 0x4B)
    uncertainty = read_png(client.get("/api/images/m0/uncertainty.png").content)
    assert uncertainty.shape == (SIZE, SIZE) and uncertainty.max() > uncertainty.min()

    job = client.post("/api/save", json={"what": ["labels", "model", "masks", "fractions"], "scope": "all"}).json()
    for _ in range(200):
        record = client.get(f"/api/jobs/{job['job']}").json()
        if record["state"] != "running":
            break
        time.sleep(0.05)
    assert record["state"] == "done", record
    out = tmp_path / "session" / "export"
    saved_labels = read_labels(out / "labels" / "m0_labels.png")
    assert np.array_equal(saved_labels, session.label_image("m0"))
    assert np.array_equal(read_png((out / "masks" / "m0_mask.png").read_bytes()), mask)
    assert (out / "area_fractions.csv").read_text().splitlines()[1].startswith("m0.tif,")

    # The saved model is what `segment apply` reads, and it gives the app's mask.
    assert main(["segment", "apply", "--model", str(out / "model"), "--images", str(folder),
                 "--out", str(tmp_path / "applied"), "--no-overlay"]) == 0
    assert np.array_equal(read_png((tmp_path / "applied" / "m0_mask.png").read_bytes()), mask)
    # And `segment train` pairs the saved labels with their image.
    assert main(["segment", "train", "--images", str(folder), "--labels", str(out / "labels"), "--trees", "3",
                 "--out", str(tmp_path / "retrained")]) == 0


def test_session_survives_a_restart_with_labels_classes_and_undo(tmp_path, micrograph, start):
    folder, _, truth = micrograph
    session, engine, client = start(folder)
    client.post("/api/classes", json={"name": "a"})
    client.post("/api/classes", json={"name": "b", "color": "#102030"})
    client.patch("/api/classes/1", json={"name": "matrix", "color": "#AABBCC"})
    client.post("/api/images/m0/strokes", json={"class": 1, "radius": 4, "points": [[10, 10], [40, 12]]})
    client.post("/api/images/m0/strokes", json={"class": 2, "radius": 3, "points": [[80, 80]]})
    client.post("/api/images/m0/strokes", json={"erase": True, "radius": 2, "points": [[20, 11]]})
    client.post("/api/images/m0/undo")
    before = read_png(client.get("/api/images/m0/labels.png").content)
    engine.close()

    session2, _, client2 = start(folder)  # a new server on the same folder
    state = client2.get("/api/state").json()
    assert state["classes"] == [{"value": 1, "name": "matrix", "color": "#aabbcc"},
                                {"value": 2, "name": "b", "color": "#102030"}]
    after = read_png(client2.get("/api/images/m0/labels.png").content)
    assert np.array_equal(before, after) and set(np.unique(after)) == {0, 1, 2}
    assert np.array_equal(read_labels(tmp_path / "session" / "labels" / "m0.png"), after)  # human-readable copy
    assert client2.post("/api/images/m0/redo").status_code == 200  # the undone eraser stroke is still redoable
    assert read_png(client2.get("/api/images/m0/labels.png").content)[11, 20] == 0
    saved = json.loads((tmp_path / "session" / "strokes" / "m0.json").read_text())
    assert [s["class"] for s in saved["strokes"]] == [1, 2, 0]


def test_bad_input_gets_a_reason_and_the_server_goes_on(tmp_path, micrograph, start):
    folder, _, truth = micrograph
    _, _, client = start(folder)

    def refused(response, status, words):
        assert response.status_code == status, response.text
        assert all(w in response.json()["detail"] for w in words), response.json()["detail"]

    refused(client.post("/api/images?name=notes.png", content=b"plain text"), 400, ["notes.png", "cannot be read"])
    tiff = io.BytesIO()
    tifffile.imwrite(tiff, np.zeros((32, 32), np.uint16))
    refused(client.post("/api/images?name=cut.tif", content=tiff.getvalue()[:60]), 400, ["cut.tif"])
    refused(client.post("/api/images?name=big.tif", content=b"0" * (1 << 20)), 413, ["larger than", "0.5 MB"])
    refused(client.post("/api/images?name=script.sh", content=b"#!"), 400, ["not an image file name"])
    assert not list((tmp_path / "session" / "uploads").iterdir())  # refused uploads leave no file

    refused(client.post("/api/classes", json={"name": "  "}), 400, ["needs a name"])
    client.post("/api/classes", json={"name": "Pores"})
    refused(client.post("/api/classes", json={"name": "pores"}), 400, ["already", "pores"])
    refused(client.post("/api/classes", json={"name": "x", "color": "red"}), 400, ["#rrggbb"])
    refused(client.post("/api/train", json={"image": "m0"}), 400, ["at least two classes", "nothing is labelled"])
    client.post("/api/images/m0/strokes", json={"class": 1, "radius": 3, "points": [[20, 20]]})
    refused(client.post("/api/train", json={"image": "m0"}), 400, ["only 'Pores' is labelled"])
    refused(client.post("/api/images/m0/strokes", json={"class": 7, "radius": 3, "points": [[1, 1]]}), 400, ["no class 7"])
    refused(client.post("/api/images/m0/strokes", json={"class": 1, "radius": 0, "points": [[1, 1]]}), 400, ["radius"])
    refused(client.post("/api/images/m0/strokes", json={"class": 1, "radius": 2, "points": []}), 400, ["point"])
    refused(client.get("/api/images/m0/mask.png"), 409, ["no trained model"])
    refused(client.post("/api/save", json={"what": ["masks"]}), 409, ["Train first"])
    refused(client.put("/api/settings", json={"backbone": "vit_huge"}), 400, ["backbone must be one of"])

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    tifffile.imwrite(outside / "secret.tif", np.zeros((8, 8), np.uint16))
    refused(client.post("/api/images/add", json={"path": str(outside / "secret.tif")}), 403, ["outside the folders"])
    refused(client.post("/api/images/add", json={"path": str(folder / ".." / "elsewhere")}), 403, ["outside"])
    assert client.get("/api/images/..%2F..%2Fetc%2Fpasswd/display.png").status_code == 404
    assert client.get("/static/..%2F..%2Fsession.py").status_code == 404
    assert client.get("/api/state").status_code == 200  # still serving


def test_requests_from_another_sites_page_are_refused(tmp_path, micrograph, start):
    folder, _, _ = micrograph
    _, _, client = start(folder)
    forged = client.post("/api/classes", json={"name": "x"}, headers={"Origin": "http://evil.example"})
    assert forged.status_code == 403 and "cross-origin" in forged.json()["detail"]
    same = client.post("/api/classes", json={"name": "x"}, headers={"Origin": "http://testserver"})
    assert same.status_code == 200 and [c["name"] for c in client.get("/api/state").json()["classes"]] == ["x"]


def test_a_tokenless_app_answers_only_its_own_host_names(tmp_path, micrograph):
    folder, _, _ = micrograph
    session = Session(tmp_path / "session", [folder], allowed_roots=[folder])
    engine = Engine(session)
    try:
        app = create_app(session, engine, hosts={"127.0.0.1:8765", "localhost:8765"})
        assert TestClient(app, base_url="http://127.0.0.1:8765").get("/api/state").status_code == 200
        rebound = TestClient(app, base_url="http://attacker.example:8765").get("/api/state")
        assert rebound.status_code == 403 and "attacker.example:8765" in rebound.json()["detail"]
    finally:
        engine.close()


def test_token_is_required_when_set(tmp_path, micrograph, start):
    folder, _, _ = micrograph
    _, _, client = start(folder, token="s3cret")
    assert client.get("/api/state").status_code == 403
    assert "wrong token" in client.get("/api/state?token=nope").json()["detail"]
    assert client.get("/api/state", headers={"X-Token": "s3cret"}).status_code == 200
    page = client.get("/?token=s3cret")  # opening the printed URL sets a cookie for the page's requests
    assert page.status_code == 200 and client.cookies.get("alibi_vit_token") == "s3cret"
    assert client.get("/api/state").status_code == 200


def test_two_tabs_drawing_at_once_leave_consistent_files(tmp_path, micrograph, start):
    folder, _, _ = micrograph
    session, _, client = start(folder)
    client.post("/api/classes", json={"name": "a"})
    client.post("/api/classes", json={"name": "b"})

    def tab(value):
        for i in range(15):
            r = client.post("/api/images/m0/strokes", json={"class": value, "radius": 2, "points": [[5 * i, 10 * value]]})
            assert r.status_code == 200

    tabs = [threading.Thread(target=tab, args=(v,)) for v in (1, 2)]
    [t.start() for t in tabs]
    [t.join() for t in tabs]
    saved = json.loads((tmp_path / "session" / "strokes" / "m0.json").read_text())
    assert len(saved["strokes"]) == 30 and saved["version"] == 30
    replayed = np.zeros((SIZE, SIZE), np.uint8)
    for s in saved["strokes"]:
        rasterise_stroke(replayed, s["points"], s["radius"], s["class"])
    assert np.array_equal(read_labels(tmp_path / "session" / "labels" / "m0.png"), replayed)


def test_command_line_errors_are_one_line(tmp_path, capsys):
    assert main(["app", str(tmp_path / "missing"), "--session", str(tmp_path / "s")]) == 2
    assert "missing is neither an image file nor a folder" in capsys.readouterr().err
    assert main(["app", "--backbone", "alibi_vit_small_patch14_reg4_dinov2", "--session", str(tmp_path / "s")]) == 2
    assert "has no weights" in capsys.readouterr().err


def test_a_stack_written_page_by_page_opens_as_one_image_per_page(tmp_path, start):
    folder = tmp_path / "stacks"
    folder.mkdir()
    pages = [np.full((24, 32), 100 * (z + 1), np.uint16) for z in range(3)]
    with tifffile.TiffWriter(folder / "fib.tif") as tif:
        for page in pages:
            tif.write(page, photometric="minisblack")  # one series per page
    session, _, client = start(folder)
    ids = [i["id"] for i in client.get("/api/state").json()["images"]]
    assert ids == ["fib_z000", "fib_z001", "fib_z002"]
    assert all(np.array_equal(session.read(i), p) for i, p in zip(ids, pages))


def test_vit_backbone_in_the_page_trains_and_saves_a_model_segment_apply_reloads(tmp_path, micrograph):
    """Classical + a (tiny, random-init) ViT chosen in the page: patch features are cached like the
    classical ones, and the saved model (with its backbone weights) gives the app's mask in segment apply."""
    folder, _, truth = micrograph
    session = Session(tmp_path / "session", [folder], allowed_roots=[folder])
    engine = Engine(session, "alibi_vit_small_patch14_reg4_dinov2",
                    {"model_kwargs": dict(depth=1, embed_dim=32, num_heads=2)})
    try:
        client = TestClient(create_app(session, engine))
        assert client.get("/api/state").json()["settings"]["backbones"] == [None, "alibi_vit_small_patch14_reg4_dinov2"]
        r = client.put("/api/settings", json={"backbone": "alibi_vit_small_patch14_reg4_dinov2"})
        assert r.status_code == 200 and r.json()["backbone"] == "alibi_vit_small_patch14_reg4_dinov2"
        draw_and_train(client, truth)
        misses = engine.cache.misses
        assert client.post("/api/train", json={"image": "m0"}).status_code == 200
        assert engine.cache.misses == misses  # retraining computes no feature again
        assert engine._segmenter.vit is not None and engine.model["classes"] == [1, 2, 3]
        mask = read_png(client.get("/api/images/m0/mask.png").content)
        job = client.post("/api/save", json={"what": ["model"], "scope": "image", "image": "m0"}).json()
        while client.get(f"/api/jobs/{job['job']}").json()["state"] == "running":
            time.sleep(0.05)
        model = tmp_path / "session" / "export" / "model"
        assert (model / "backbone.safetensors").is_file() and (model / "vit_pca.npz").is_file()
        assert main(["segment", "apply", "--model", str(model), "--images", str(folder),
                     "--out", str(tmp_path / "applied"), "--no-overlay"]) == 0
        assert np.array_equal(read_png((tmp_path / "applied" / "m0_mask.png").read_bytes()), mask)
    finally:
        engine.close()


def test_a_cancelled_save_job_stops_before_the_next_image(tmp_path, micrograph, start):
    folder, image, truth = micrograph
    tifffile.imwrite(folder / "m1.tif", image)
    session, engine, client = start(folder)
    draw_and_train(client, truth)
    engine.run(engine._segmenter.save, tmp_path / "model")
    job = Job("j-test", 2, engine.out)
    job.cancelled.set()  # as DELETE /api/jobs/{job} does, before the first image is done
    engine._save_job(job, ["masks"], ["m0", "m1"], tmp_path / "model")
    assert job.state == "cancelled" and job.done == 0 and "cancelled after 0 of 2" in job.message
    assert not (engine.out / "masks").exists()
    r = client.post("/api/save", json={"what": ["masks"], "scope": "all"}).json()
    cancelled = client.delete(f"/api/jobs/{r['job']}").json()
    assert cancelled["job"] == r["job"]
    while client.get(f"/api/jobs/{r['job']}").json()["state"] == "running":
        time.sleep(0.05)
    final = client.get(f"/api/jobs/{r['job']}").json()
    assert final["state"] in ("cancelled", "done") and final["done"] <= 2  # racing the job: either ends cleanly
    assert client.delete("/api/jobs/nope").status_code == 404
