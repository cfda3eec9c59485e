"""The app's volume mode over HTTP: a volume opens as one entry; its slices in XY, XZ and YZ; strokes
drawn in each view land on the voxels computed by hand; the labels are stored once, as one sparse
3D store that ``segment train`` reads; Train on XZ strokes predicts a planted structure; Save writes
the volume's mask."""

from __future__ import annotations

import io
import json
import threading

import numpy as np
import pytest
import tifffile
from PIL import Image

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from alibi_vit.app.engine import Engine  # noqa: E402
from alibi_vit.app.server import create_app  # noqa: E402
from alibi_vit.app.session import Session  # noqa: E402
from alibi_vit.app.volume import Volumes  # noqa: E402
from alibi_vit.app.volume_labels import BLOCK, SparseVolumeLabels  # noqa: E402
from alibi_vit.chunked import open_volume  # noqa: E402
from alibi_vit.cli.main import main  # noqa: E402
from tests.helpers import png_pixels as png  # noqa: E402
from tests.helpers import finished_job  # noqa: E402

RED, GREEN = "#ff0000", "#00ff00"


def layered_volume(shape=(32, 24, 24), seed=0):
    """A noisy volume of two phases, class 1 above z = Z/2 and class 2 below: (volume, truth)."""
    rng = np.random.default_rng(seed)
    z = np.arange(shape[0])[:, None, None]
    truth = np.broadcast_to(np.where(z < shape[0] // 2, 1, 2), shape).astype(np.uint8)
    volume = np.where(truth == 1, 90.0, 160.0) + rng.normal(0, 18, shape)
    return np.clip(volume, 0, 255).astype(np.uint8), truth


def open_session(session_folder, folder):
    """(session, volumes) as ``alibi-vit app FOLDER --session SESSION_FOLDER`` opens them."""
    volumes = Volumes(session_folder)
    return Session(session_folder, [folder], allowed_roots=[folder], volume_claim=volumes.claim), volumes


@pytest.fixture
def start(tmp_path):
    """start(folder) → (session, client) on tmp_path/session; the engines are closed afterwards."""
    engines = []

    def start(folder):
        session, volumes = open_session(tmp_path / "session", folder)
        engines.append(Engine(session))
        return session, TestClient(create_app(session, engines[-1], volumes=volumes))

    yield start
    for engine in engines:
        engine.close()



def with_classes(client):
    for name, colour in (("top", RED), ("bottom", GREEN)):
        assert client.post("/api/classes", json={"name": name, "color": colour}).status_code == 200


def test_a_stack_a_zarr_and_a_2d_image_open_as_one_volume_entry_each(tmp_path, start):
    import zarr

    folder = tmp_path / "data"
    folder.mkdir()
    volume = layered_volume((6, 10, 12))[0]
    tifffile.imwrite(folder / "stack.tif", volume)
    array = zarr.create_array(str(folder / "cube.zarr"), shape=volume.shape, chunks=(2, 5, 6), dtype=np.uint8,
                              zarr_format=2)
    array[:] = volume
    array.attrs["_ARRAY_DIMENSIONS"] = ["z", "y", "x"]
    Image.fromarray(volume[0]).save(folder / "flat.png")
    session, client = start(folder)
    state = client.get("/api/state").json()
    assert [i["id"] for i in state["images"]] == ["flat"]
    assert sorted((v["id"], tuple(v["shape"])) for v in state["volumes"]) == [("cube", (6, 10, 12)),
                                                                             ("stack", (6, 10, 12))]
    upload = io.BytesIO()
    tifffile.imwrite(upload, volume)
    answer = client.post("/api/images?name=up.tif", content=upload.getvalue()).json()
    assert answer == {"ids": [], "volumes": ["up"]}
    again, volumes = open_session(tmp_path / "session", folder)  # a restart adds nothing twice
    assert sorted(volumes.volumes) == ["cube", "stack", "up"] and list(again.images) == ["flat"]


def test_slices_of_each_view_are_the_volume_s_planes(tmp_path, start):
    rng = np.random.default_rng(1)
    volume = rng.choice(np.array([0, 255], np.uint8), size=(9, 11, 13))  # display range 0..255: shown as stored
    folder = tmp_path / "data"
    folder.mkdir()
    tifffile.imwrite(folder / "v.tif", volume)
    _, client = start(folder)
    assert np.array_equal(png(client.get("/api/volumes/v/slice/xy/3.png")), volume[3])
    assert np.array_equal(png(client.get("/api/volumes/v/slice/xz/5.png")), volume[:, 5, :])
    assert np.array_equal(png(client.get("/api/volumes/v/slice/yz/12.png")), volume[:, :, 12])
    out_of_range = client.get("/api/volumes/v/slice/xz/11.png")
    assert out_of_range.status_code == 404 and "0 to 10" in out_of_range.json()["detail"]
    assert client.get("/api/volumes/v/slice/zz/1.png").status_code == 400
    assert client.get("/api/volumes/nope/slice/xy/1.png").status_code == 404


@pytest.mark.parametrize("view, index, point, voxel", [
    ("xy", 3, (4, 6), (3, 6, 4)),    # XY at z = 3: (x, y) = (column, row)
    ("xz", 5, (7, 2), (2, 5, 7)),    # XZ at y = 5: rows are z, columns x
    ("yz", 7, (2, 9), (9, 2, 7)),    # YZ at x = 7: rows are z, columns y
])
def test_a_stroke_in_each_view_labels_the_voxels_of_the_slice_shown(tmp_path, start, view, index, point, voxel):
    folder = tmp_path / "data"
    folder.mkdir()
    tifffile.imwrite(folder / "v.tif", layered_volume((12, 10, 9))[0])
    session, client = start(folder)
    with_classes(client)
    answer = client.post("/api/volumes/v/strokes", json={"view": view, "index": index, "class": 2, "radius": 1,
                                                         "points": [list(point)]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["labelled"] == {"2": 5}
    z, y, x = voxel  # a disc of radius 1: the voxel and its 4 neighbours within the slice
    in_plane = {"xy": [(0, 1, 0), (0, 0, 1)], "xz": [(1, 0, 0), (0, 0, 1)], "yz": [(1, 0, 0), (0, 1, 0)]}[view]
    expected = np.zeros((12, 10, 9), np.uint8)
    expected[z, y, x] = 2
    for dz, dy, dx in in_plane:
        expected[z + dz, y + dy, x + dx] = expected[z - dz, y - dy, x - dx] = 2
    stored = open_volume(tmp_path / "session" / "volumes" / "v" / "labels.zarr")  # as segment train reads it
    assert np.array_equal(stored.read_box(slice(None), slice(None), slice(None)), expected)
    # the stroke shows in the other views through that voxel
    red_green = png(client.get(f"/api/volumes/v/labels/xy/{z}.png"))
    assert red_green.shape == (10, 9, 4) and tuple(red_green[y, x]) == (0, 255, 0, 255)
    assert red_green[..., 3].sum() == 255 * int((expected[z] > 0).sum())
    side = png(client.get(f"/api/volumes/v/labels/yz/{x}.png"))
    assert tuple(side[z, y]) == (0, 255, 0, 255)


def test_labels_are_stored_once_as_a_sparse_3d_store_and_undo_replays(tmp_path, start):
    folder = tmp_path / "data"
    folder.mkdir()
    shape = (20, 140, 70)  # blocks of 64³: 1 × 3 × 2
    tifffile.imwrite(folder / "v.tif", np.zeros(shape, np.uint8))
    session, client = start(folder)
    with_classes(client)
    for z in (2, 5, 9):  # three XY slices, all in the first row of blocks
        assert client.post("/api/volumes/v/strokes", json={"view": "xy", "index": z, "class": 1, "radius": 2,
                                                           "points": [[3, 3], [10, 3]]}).status_code == 200
    assert client.post("/api/volumes/v/strokes", json={"view": "xz", "index": 130, "class": 2, "radius": 2,
                                                       "points": [[66, 5]]}).status_code == 200
    files = [p.relative_to(session.folder) for p in session.folder.rglob("*") if p.is_file()]
    label_files = [p for p in files if "labels" in str(p)]
    assert all(str(p).startswith("volumes/v/labels.zarr/") for p in label_files)
    chunks = sorted(str(p.relative_to("volumes/v/labels.zarr")) for p in label_files if p.name[0].isdigit())
    assert chunks == ["0/0/0", "0/2/1"]  # only the two blocks holding a label: (z 0, y 0, x 0), (z 0, y 128, x 64)
    assert not any(p.suffix == ".png" for p in files)
    # undo the XZ stroke: its block is gone from the store, the replay equals the labels before
    version = client.get("/api/state").json()["volumes"][0]["version"]
    assert client.post("/api/volumes/v/undo", json={"version": version}).status_code == 200
    assert not (session.folder / "volumes" / "v" / "labels.zarr" / "0" / "2" / "1").exists()
    labels = open_session(session.folder, folder)[1].label_volume("v")  # a restart replays the strokes
    assert set(labels.blocks) == {(0, 0, 0)} and int(labels.counts()[1]) == 3 * int((labels.plane(0, 2) > 0).sum())


def test_sparse_volume_labels_read_like_the_dense_array_they_paint():
    rng = np.random.default_rng(0)
    shape = (BLOCK + 5, 2 * BLOCK + 3, 7)
    labels, dense = SparseVolumeLabels(shape), np.zeros(shape, np.uint8)
    for axis, value in ((0, 1), (1, 2), (2, 3), (1, 0)):
        index = int(rng.integers(shape[axis]))
        plane_shape = tuple(n for a, n in enumerate(shape) if a != axis)
        mask = rng.random(plane_shape) < 0.3
        labels = labels.painted(axis, index, [(0, 0, mask)], value)
        np.moveaxis(dense, axis, 0)[index][mask] = value
    assert np.array_equal(np.asarray(labels), dense)
    assert np.array_equal(labels[3:BLOCK + 2, 100, 2:6], dense[3:BLOCK + 2, 100, 2:6])
    assert all(block.any() for block in labels.blocks.values())


def test_xz_strokes_train_a_model_whose_slices_show_the_planted_layers_and_save_writes_the_mask(tmp_path, start):
    folder = tmp_path / "data"
    folder.mkdir()
    volume, truth = layered_volume()
    tifffile.imwrite(folder / "v.tif", volume)
    _, client = start(folder)
    with_classes(client)
    assert client.get("/api/volumes/v/prediction/xy/3.png").status_code == 409  # no model yet
    for cls, rows in ((1, (3, 10)), (2, (20, 28))):  # XZ at y = 12: z rows in each layer
        for z in rows:
            assert client.post("/api/volumes/v/strokes", json={"view": "xz", "index": 12, "class": cls, "radius": 1.5,
                                                               "points": [[2, z], [21, z]]}).status_code == 200
    model = client.post("/api/volumes/train").json()["model"]
    assert model["classes"] == [1, 2]
    for view, index in (("xy", 4), ("xy", 27), ("xz", 3), ("yz", 20)):
        answer = client.get(f"/api/volumes/v/prediction/{view}/{index}.png")
        shown = png(answer)
        want = np.moveaxis(truth, ("xy", "xz", "yz").index(view), 0)[index]
        green = (shown[..., 1] == 255) & (shown[..., 0] == 0)
        assert np.mean(green == (want == 2)) > 0.95, (view, index)
        fractions = json.loads(answer.headers["X-Fractions"])
        assert abs(fractions["2"] - np.mean(want == 2)) < 0.05 and abs(sum(fractions.values()) - 1) < 1e-4
    restarted = open_session(tmp_path / "session", folder)[1]  # the model is restored on a restart
    assert restarted.model == model and np.array_equal(restarted.trained().classes_, [1, 2])
    saved = finished_job(client, client.post("/api/volumes/v/save", json={"what": ["labels", "masks", "model"]}))
    assert saved["state"] == "done" and saved["progress"] == 1, saved
    mask = tifffile.imread(tmp_path / "session" / "export" / "masks" / "v_mask.tif")
    assert mask.shape == truth.shape and np.mean(mask == truth) > 0.95
    labels = tmp_path / "session" / "export" / "labels" / "v_labels.zarr"
    assert main(["segment", "train", "--images", str(folder / "v.tif"), "--labels", str(labels),
                 "--out", str(tmp_path / "model")]) == 0


def test_bad_volume_requests_get_a_reason(tmp_path, start):
    folder = tmp_path / "data"
    folder.mkdir()
    tifffile.imwrite(folder / "v.tif", layered_volume((6, 8, 8))[0])
    _, client = start(folder)
    with_classes(client)
    stroke = {"view": "xy", "index": 1, "class": 1, "radius": 1, "points": [[1, 1]]}
    assert client.post("/api/volumes/v/strokes", json={**stroke, "class": 9}).json()["detail"].startswith("no class 9")
    assert client.post("/api/volumes/v/strokes", json={**stroke, "index": 6}).status_code == 404
    assert client.post("/api/volumes/v/strokes", json={**stroke, "view": "zz"}).status_code == 422
    assert "no volume has labels" in client.post("/api/volumes/train").json()["detail"]
    assert client.post("/api/volumes/v/undo").status_code == 409
    assert client.post("/api/volumes/v/save", json={"what": ["masks"]}).status_code == 409


def test_a_folder_of_slices_is_one_volume_with_slice_folders_and_bad_ones_are_one_line_errors(tmp_path, capsys):
    volume = layered_volume((5, 8, 9))[0]
    folder = tmp_path / "slices"
    folder.mkdir()
    for z in (0, 1, 2, 3, 4):  # numbered 2, 4, ..., 10: ordered by the number, not the name
        Image.fromarray(volume[z]).save(folder / f"s{2 * z + 2}.png")
    volumes = Volumes(tmp_path / "session")
    assert volumes.claim(folder) is None  # a folder is a volume only when the user says so
    assert volumes.claim(folder, slice_folder=True) == "slices"
    assert np.array_equal(volumes.plane("slices", 1, 3), volume[:, 3, :])
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(folder / "s99.png")
    assert main(["app", str(folder), "--slice-folders", "--session", str(tmp_path / "other"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "slice s99.png is 4×4" in err


def test_a_volume_with_a_slice_over_the_pixel_limit_is_skipped_with_the_reason(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    tifffile.imwrite(folder / "tall.tif", np.zeros((40, 8, 8), np.uint8))  # XZ and YZ slices of 320 px
    volumes = Volumes(tmp_path / "session", max_pixels=300)
    session = Session(tmp_path / "session", [folder], allowed_roots=[folder], volume_claim=volumes.claim)
    assert not volumes.volumes and not session.images
    assert "tall.tif is a volume of 8×8×40 voxels whose largest slice has 0.0 Mpx" in session.skipped[0]


def test_a_volume_save_is_a_job_with_progress_and_cancel_and_slices_are_shown_meanwhile(tmp_path, start,
                                                                                      monkeypatch):
    """Save answers at once with a job; while its mask is being written, slices and their overlays are
    answered; Cancel stops it and leaves no mask; a Save to the end counts its blocks (two of 140
    slices here) as it writes them."""
    from concurrent.futures import ThreadPoolExecutor

    from alibi_vit.trainable.stream import StreamLayout

    folder = tmp_path / "data"
    folder.mkdir()
    volume, truth = layered_volume((150, 20, 20))   # class 1 above z = 75, class 2 below
    tifffile.imwrite(folder / "v.tif", volume)
    _, client = start(folder)
    with_classes(client)
    for cls, rows in ((1, (10, 60)), (2, (90, 140))):
        for z in rows:
            client.post("/api/volumes/v/strokes", json={"view": "xz", "index": 10, "class": cls, "radius": 1.5,
                                                        "points": [[2, z], [17, z]]})
    assert client.post("/api/volumes/train").status_code == 200
    gate, real_run_tile = threading.Event(), StreamLayout.run_tile

    def held_run_tile(self, *args, **kwargs):   # the mask's blocks wait until the test lets them go
        gate.wait(30)
        return real_run_tile(self, *args, **kwargs)

    monkeypatch.setattr(StreamLayout, "run_tile", held_run_tile)
    pool = ThreadPoolExecutor(1)
    try:
        started = pool.submit(client.post, "/api/volumes/v/save", json={"what": ["labels", "masks"]})
        job = started.result(timeout=10).json()   # at once, not when the mask is written
        assert job["state"] == "running" and job["folder"] == str(tmp_path / "session" / "export"), job
        shown = client.get("/api/volumes/v/prediction/xy/120.png")   # the overlay of a slice, meanwhile
        assert shown.status_code == 200 and json.loads(shown.headers["X-Fractions"])["2"] > 0.9
        assert client.get("/api/volumes/v/slice/yz/3.png").status_code == 200
        assert client.get(f"/api/jobs/{job['job']}").json()["state"] == "running"
        assert client.delete(f"/api/jobs/{job['job']}").status_code == 200
    finally:
        gate.set()
        pool.shutdown(wait=True)
    cancelled = finished_job(client, started.result())
    assert cancelled["state"] == "cancelled" and "labels written" in cancelled["message"], cancelled
    export = tmp_path / "session" / "export"
    assert (export / "labels" / "v_labels.zarr").is_dir() and not list((export / "masks").glob("*"))
    assert not list((tmp_path / "session" / "volumes").glob(".save-*"))   # its copy of the model is gone too

    posted, progress = threading.Event(), []

    def counting_run_tile(self, *args, **kwargs):   # what the job says before each block
        posted.wait(30)
        progress.append(client.get(f"/api/jobs/{job_id}").json()["done"])
        return real_run_tile(self, *args, **kwargs)

    monkeypatch.setattr(StreamLayout, "run_tile", counting_run_tile)
    started = client.post("/api/volumes/v/save", json={"what": ["masks"]})
    job_id = started.json()["job"]
    posted.set()
    done = finished_job(client, started)
    assert done["state"] == "done" and done["progress"] == 1 and "masks of v.tif" in done["message"], done
    assert progress == [0, 1] and done["done"] == done["total"] == 2, (progress, done)
    mask = tifffile.imread(export / "masks" / "v_mask.tif")
    assert mask.shape == truth.shape and np.mean(mask == truth) > 0.95


def test_a_zarr_volume_stored_in_chunks_too_large_to_read_is_skipped_from_its_metadata(tmp_path):
    """8192³ voxels in one chunk (a 300-byte .zarray): its slices are within the limit, but every slice
    shown would decode all 550 G voxels; a chunk may hold at most 16 × --max-megapixels voxels."""
    folder = tmp_path / "data"
    store = folder / "cube.zarr"
    store.mkdir(parents=True)
    (store / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [8192] * 3, "chunks": [8192] * 3, "dtype": "|u1", "compressor": None,
        "fill_value": 0, "order": "C", "filters": None}))
    (store / ".zattrs").write_text(json.dumps({"_ARRAY_DIMENSIONS": ["z", "y", "x"]}))
    session, volumes = open_session(tmp_path / "session", folder)
    assert not volumes.volumes and not session.images
    assert "cube.zarr stores its pixels in chunks of 8192×8192×8192" in session.skipped[0]
    assert "549.8 Gpx" in session.skipped[0] and "limit of 1073.7 Mpx per chunk" in session.skipped[0]


def test_a_chunk_of_a_zarr_volume_that_leads_out_of_its_store_is_not_read(tmp_path, start):
    import zarr

    folder, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    for store, value in ((folder / "cube.zarr", 10), (elsewhere / "secret.zarr", 250)):
        array = zarr.create_array(str(store), shape=(6, 10, 12), chunks=(2, 5, 6), dtype=np.uint8, zarr_format=2)
        array[:] = value
        array.attrs["_ARRAY_DIMENSIONS"] = ["z", "y", "x"]
    _, client = start(folder)
    assert client.get("/api/volumes/cube/slice/xy/1.png").status_code == 200
    (folder / "cube.zarr" / "1.0.0").unlink()
    (folder / "cube.zarr" / "1.0.0").symlink_to(elsewhere / "secret.zarr" / "1.0.0")
    refused = client.get("/api/volumes/cube/slice/xy/2.png")   # z = 2 is in chunk 1.0.0
    assert refused.status_code == 403 and "1.0.0 of the zarr store" in refused.json()["detail"], refused.text
    assert client.get("/api/volumes/cube/slice/xy/0.png").status_code == 200   # its other chunks are read
