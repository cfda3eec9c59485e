"""``alibi-vit app`` on big images (zarr / OME-Zarr, read chunk by chunk): display tiles at the
level on screen, sparse label storage, Train on the labelled tiles only, the region on screen
predicted first and the rest filled in, streamed Save, and labels ``segment train`` reads.

Laziness is proved by counting the chunks read from the image's store; results are compared with
references computed without the app (the image's levels read with zarr, numpy means and max-pools,
and a segmenter fitted on the whole image as an array)."""

import json
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

pytest.importorskip("fastapi")

from alibi_vit.app.server import create_app  # noqa: E402
from alibi_vit.app.session import Session  # noqa: E402
from alibi_vit.chunked import open_image  # noqa: E402
from alibi_vit.cli.main import main  # noqa: E402
from alibi_vit.synthetic import synthetic_micrograph  # noqa: E402
from alibi_vit.trainable import TrainableSegmenter  # noqa: E402
from alibi_vit.trainable.writers import ZarrOutput  # noqa: E402
from tests.helpers import app_clients  # noqa: E402
from tests.helpers import png_pixels as png  # noqa: E402
from tests.helpers import serve_app  # noqa: E402

SIZE, CHUNK, TILE = 1024, 128, 252  # image px, storage chunk px, featurisation tile px (18 patches)


@pytest.fixture(scope="module")
def micrograph():
    image, truth = synthetic_micrograph(SIZE, seed=11)[:2]
    return image, truth


@pytest.fixture
def chunk_reads(monkeypatch):
    """[(store folder, chunk key)] of every chunk read from a local zarr store (metadata not counted)."""
    from zarr.storage import LocalStore

    reads = []
    real_get = LocalStore.get

    async def get(self, key, prototype=None, byte_range=None):
        if not key.rsplit("/", 1)[-1].startswith((".z", "zarr.json")):
            reads.append((Path(self.root), key))
        return await real_get(self, key, prototype, byte_range)

    monkeypatch.setattr(LocalStore, "get", get)
    return reads


def chunks_read(reads, store: Path) -> set[tuple[str, int, int]]:
    """(array, chunk row, chunk column) read from ``store`` (array "" for a bare array)."""
    out = set()
    for root, key in reads:
        if root.resolve() == store.resolve():
            parts = key.split("/")
            prefix = "/".join(p for p in parts[:-2] if p != "c")
            out.add((prefix, int(parts[-2]), int(parts[-1])))
    return out


@pytest.fixture
def start(tmp_path):
    with app_clients(tmp_path / "session") as start:
        yield start



def ome_zarr(tmp_path, image) -> tuple[Path, Path]:
    """(folder, store): ``image`` written into ``folder/big.ome.zarr`` with its pyramid, chunks of CHUNK px."""
    folder = tmp_path / "images"
    folder.mkdir()
    out = ZarrOutput(folder / "big.ome.zarr", image.shape, image.dtype, CHUNK)
    out.write((slice(0, SIZE), slice(0, SIZE)), image)
    return folder, out.finish()


def display(pixels, lo, hi) -> np.ndarray:
    """8-bit display values of grey pixels, the session's range mapped to 0..255."""
    return (np.clip((pixels.astype(np.float64) - lo) / (hi - lo), 0, 1) * 255).round().astype(np.uint8)


def test_tiles_come_from_the_files_pyramid_reading_only_their_chunks(tmp_path, micrograph, start, chunk_reads):
    image, _ = micrograph
    folder, store = ome_zarr(tmp_path, image)
    level1 = np.asarray(zarr.open_group(str(store), mode="r")["1"])  # as the file stores it
    session, engine, client = start(folder)
    state = client.get("/api/state").json()
    (record,) = state["images"]
    assert (record["id"], record["width"], record["height"], record["chunked"]) == ("big", SIZE, SIZE, True)
    session.fix_intensity()  # the classifier's range, from a seeded sample of tiles: not counted below
    chunk_reads.clear()
    lo, hi = engine.display_range("big")  # the page's, fitted on level 1 (the coarsest): its 4 × 4 chunks

    # Zoomed out (one level-1 tile is the whole image): only the stored level 1 is read, 4 × 4 chunks.
    shown = png(client.get("/api/images/big/tiles/image/1/0/0.png"))
    np.testing.assert_array_equal(shown, display(level1, lo, hi))
    assert chunks_read(chunk_reads, store) == {("1", r, c) for r in range(4) for c in range(4)}
    # Zoomed in on the bottom right: the 4 × 4 level-0 chunks of that tile, nothing else.
    chunk_reads.clear()
    shown = png(client.get("/api/images/big/tiles/image/0/1/1.png"))
    np.testing.assert_array_equal(shown, display(image[512:, 512:], lo, hi))
    assert chunks_read(chunk_reads, store) == {("0", r, c) for r in range(4, 8) for c in range(4, 8)}

    # Never whole; a level or tile the image has not is a 404 naming what there is.
    r = client.get("/api/images/big/display.png")
    assert r.status_code == 413 and "tiles" in r.json()["detail"]
    r = client.get("/api/images/big/tiles/image/2/0/0.png")
    assert r.status_code == 404 and "levels 0 to 1" in r.json()["detail"]
    r = client.get("/api/images/big/tiles/image/0/2/0.png")
    assert r.status_code == 404 and "no tile (2, 0)" in r.json()["detail"]
    assert client.get("/api/images/big/tiles/prediction/0/0/0.png").status_code == 409  # nothing predicted yet


def test_a_level_the_file_lacks_is_built_once_into_the_session_folder(tmp_path, micrograph, start, chunk_reads):
    image, _ = micrograph
    folder = tmp_path / "images"
    folder.mkdir()
    store = folder / "flat.zarr"  # a bare array: no pyramid
    zarr.create_array(str(store), shape=image.shape, chunks=(CHUNK, CHUNK), dtype=image.dtype)[:] = image
    session, engine, client = start(folder)
    session.fix_intensity()  # the classifier's range, from a seeded sample of tiles: not counted below
    chunk_reads.clear()
    mean = image.astype(np.float64).reshape(SIZE // 2, 2, SIZE // 2, 2).mean(axis=(1, 3))
    shown = png(client.get("/api/images/flat/tiles/image/1/0/0.png"))
    assert len(chunks_read(chunk_reads, store)) == 64  # built from the whole image once ...
    lo, hi = engine.display_range("flat")  # (the page's range, fitted on level 1, the coarsest)
    expected = display(np.round(mean), lo, hi)  # each pixel the mean of 2 × 2, rounded (half to even)
    np.testing.assert_array_equal(shown, expected)
    built = session.folder / "cache" / "pyramids" / "flat"
    assert (built / "1").is_dir()
    chunk_reads.clear()
    np.testing.assert_array_equal(png(client.get("/api/images/flat/tiles/image/1/0/0.png")), expected)
    assert not chunks_read(chunk_reads, store)  # ... then read from the session folder
    # A restarted app finds the level built.
    engine.close()
    session2, _, client2 = start(folder)
    np.testing.assert_array_equal(png(client2.get("/api/images/flat/tiles/image/1/0/0.png")), expected)
    assert not chunks_read(chunk_reads, store)


def corner_points(truth, rows: slice, cols: slice, per_class: int = 12):
    """{class: [[x, y], ...]}: points inside each phase of ``truth`` within the given box, far from
    the phase's edge (so a small disc there is one class)."""
    from scipy.ndimage import binary_erosion

    out = {}
    for v in np.unique(truth):
        inside = np.zeros_like(truth, bool)
        inside[rows, cols] = binary_erosion(truth[rows, cols] == v, iterations=3)
        ys, xs = np.nonzero(inside)
        if len(ys):
            pick = np.linspace(0, len(ys) - 1, min(per_class, len(ys))).round().astype(int)
            out[int(v)] = [[float(xs[i]), float(ys[i])] for i in pick]
    return out


def prediction_mosaic(client, image_id: str, level: int = 0) -> np.ndarray:
    """The prediction layer of a level, stitched from its tiles (0 where not predicted)."""
    h = w = -(-SIZE // (1 << level))
    out = np.zeros((h, w), np.uint8)
    for r in range(-(-h // 512)):
        for c in range(-(-w // 512)):
            out[r * 512:(r + 1) * 512, c * 512:(c + 1) * 512] = \
                png(client.get(f"/api/images/{image_id}/tiles/prediction/{level}/{r}/{c}.png"))
    return out


def near(tiles, halo: int, chunk: int = CHUNK) -> set[tuple[str, int, int]]:
    """The level-0 chunks a featurisation of these tiles (row, col of TILE px cores, plus halo) reads."""
    out = set()
    for tr, tc in tiles:
        r0, r1 = max(tr * TILE - halo, 0), min((tr + 1) * TILE + halo, SIZE)
        c0, c1 = max(tc * TILE - halo, 0), min((tc + 1) * TILE + halo, SIZE)
        out |= {("0", i, j) for i in range(r0 // chunk, -(-r1 // chunk)) for j in range(c0 // chunk, -(-c1 // chunk))}
    return out


def test_train_reads_labelled_tiles_predicts_the_region_first_then_fills_in(tmp_path, micrograph, start,
                                                                            chunk_reads, capsys):
    image, truth = micrograph
    folder, store = ome_zarr(tmp_path, image)
    session, engine, client = start(folder)
    seg = engine.segmenter()
    seg.tile = TILE  # 1024² in 5 × 5 tiles (the last ones 16 px)
    for name in ("dark", "middle", "bright"):
        assert client.post("/api/classes", json={"name": name}).status_code == 200
    # Scribbles in two tiles only: the top-left and (3, 3).
    points = corner_points(truth, slice(20, 230), slice(20, 230))
    for v, more in corner_points(truth, slice(780, 990), slice(780, 990)).items():
        points[v] = points.get(v, []) + more
    for v, pts in points.items():
        for p in pts:
            r = client.post("/api/images/big/strokes", json={"class": v, "radius": 2, "points": [p]})
            assert r.status_code == 200, r.json()
    labels = np.asarray(session.label_image("big"))
    assert set(np.unique(labels)) == {0, 1, 2, 3}

    # Labels are stored sparsely: only the 512² blocks holding a label have a chunk file.
    stored = session.folder / "labels" / "big.zarr"
    files = {tuple(int(p) for p in f.relative_to(stored).parts) for f in stored.rglob("*")
             if f.is_file() and not f.name.startswith(".")}
    assert files == {(0, 0), (1, 1)}
    np.testing.assert_array_equal(np.asarray(zarr.open_array(str(stored), mode="r")), labels)
    # Label tiles: level 0 as drawn, level 1 each pixel the largest label of its 2 × 2 block.
    np.testing.assert_array_equal(png(client.get("/api/images/big/tiles/labels/0/1/1.png")), labels[512:, 512:])
    np.testing.assert_array_equal(png(client.get("/api/images/big/tiles/labels/1/0/0.png")),
                                  labels.reshape(512, 2, 512, 2).max(axis=(1, 3)))

    chunk_reads.clear()
    region = [400, 420, 600, 610]  # top, left, bottom, right: tiles (1..2, 1..2) on screen
    r = client.post("/api/train", json={"image": "big", "region": region})
    assert r.status_code == 200, r.json()
    answer = r.json()
    halo = seg.halo
    # Features of the labelled tiles (training) and of the tiles on screen (prediction): nothing else.
    expected = near([(0, 0), (3, 3)], halo) | near([(1, 1), (1, 2), (2, 1), (2, 2)], halo)
    assert chunks_read(chunk_reads, store) == expected and len(expected) < 64
    prediction = answer["prediction"]
    assert not prediction["complete"] and 0 < prediction["predicted"] < 0.5

    # The reference: the same segmenter fitted on the whole image as an array, labels as an array.
    ref_seg = TrainableSegmenter(intensity_range=session.fix_intensity(), colour=session.colour, tile=TILE)
    ref_seg.fit([image], [labels])
    ref = ref_seg.classes_[ref_seg.predict_proba([image])[0].argmax(-1)]
    shown = prediction_mosaic(client, "big")
    on_screen = (slice(region[0], region[2]), slice(region[1], region[3]))
    np.testing.assert_array_equal(shown[on_screen], ref[on_screen])
    done = shown > 0
    np.testing.assert_array_equal(shown[done], ref[done])
    # Only the blocks (a quarter tile, 63 px) overlapping the region were predicted.
    block = TILE // 4
    rows, cols = np.nonzero(done)
    assert rows.min() >= region[0] // block * block and rows.max() < -(-region[2] // block) * block
    assert cols.min() >= region[1] // block * block and cols.max() < -(-region[3] // block) * block
    # Zoomed out, the prediction shows every second pixel of level 0.
    np.testing.assert_array_equal(prediction_mosaic(client, "big", 1), shown[::2, ::2])

    # A new view: only its tiles are read and predicted.
    chunk_reads.clear()
    r = client.post("/api/predict", json={"image": "big", "region": [850, 60, 900, 200]})
    assert r.status_code == 200, r.json()
    assert chunks_read(chunk_reads, store) == near([(3, 0)], halo)
    assert r.json()["prediction"]["predicted"] > prediction["predicted"]

    # The image shown: the rest of its prediction fills in, in the background.
    assert client.post("/api/images/big/open").json()["features"] == "on demand"
    deadline = time.monotonic() + 300
    while not (client.get("/api/state").json()["images"][0]["prediction"] or {}).get("complete"):
        assert time.monotonic() < deadline, "the prediction did not fill in"
        time.sleep(0.5)
    np.testing.assert_array_equal(prediction_mosaic(client, "big"), ref)
    fractions = client.get("/api/state").json()["images"][0]["prediction"]["fractions"]
    for v, f in fractions.items():
        assert f == pytest.approx((ref == int(v)).mean())

    # Save: the mask streamed as an OME-Zarr pyramid (as segment apply writes it), and the labels as
    # a zarr label store that segment train pairs with the image.
    r = client.post("/api/save", json={"what": ["labels", "masks"], "image": "big"})
    job = r.json()["job"]
    while (state := client.get(f"/api/jobs/{job}").json())["state"] == "running":
        time.sleep(0.2)
    assert state["state"] == "done", state
    export = session.folder / "export"
    mask = open_image(export / "masks" / "big_mask.ome.zarr")
    np.testing.assert_array_equal(mask.read(), ref)
    np.testing.assert_array_equal(mask.read(level=1), ref[::2, ::2])
    label_store = export / "labels" / "big_labels.zarr"
    np.testing.assert_array_equal(np.asarray(zarr.open_array(str(label_store), mode="r")), labels)
    assert main(["segment", "train", "--images", str(store), "--labels", str(label_store),
                 "--out", str(tmp_path / "model")]) == 0
    counts = ", ".join(f"{v}: {(labels == v).sum()}" for v in (1, 2, 3))
    assert f"{(labels > 0).sum()} labelled pixels in classes {counts}" in capsys.readouterr().out
    assert TrainableSegmenter.load(tmp_path / "model").classes_.tolist() == [1, 2, 3]


def test_a_pyramidal_ome_tiff_is_shown_from_its_own_levels(tmp_path, micrograph, start):
    """A BigTIFF of more than 16.8 Mpx with a pyramid (SubIFDs, as OME-TIFF writers store it): the
    levels it stores are read from it (here every second pixel, which a mean would not give), the
    coarser ones built from its smallest level."""
    import tifffile

    image = np.tile(micrograph[0], (5, 5))[:4200, :4200]  # 17.6 Mpx: read chunk by chunk
    folder = tmp_path / "images"
    folder.mkdir()
    with tifffile.TiffWriter(folder / "pyr.ome.tif", bigtiff=True) as tif:
        tif.write(image, subifds=2, tile=(256, 256), metadata={"axes": "YX"})
        tif.write(image[::2, ::2], subfiletype=1, tile=(256, 256))
        tif.write(image[::4, ::4], subfiletype=1, tile=(256, 256))
    session, engine, client = start(folder)
    (record,) = client.get("/api/state").json()["images"]
    assert (record["id"], record["chunked"], record["width"]) == ("pyr", True, 4200)
    lo, hi = engine.display_range("pyr")  # the page's range, fitted on level 4 (the coarsest, built from level 3)
    np.testing.assert_array_equal(png(client.get("/api/images/pyr/tiles/image/1/1/2.png")),
                                  display(image[::2, ::2][512:1024, 1024:1536], lo, hi))
    np.testing.assert_array_equal(png(client.get("/api/images/pyr/tiles/image/2/0/1.png")),
                                  display(image[::4, ::4][:512, 512:1024], lo, hi))
    level2 = image[::4, ::4].astype(np.float64)  # 1050²: level 3 (525²) is its 2 × 2 means
    np.testing.assert_array_equal(png(client.get("/api/images/pyr/tiles/image/3/0/0.png")),
                                  display(np.round(level2.reshape(525, 2, 525, 2).mean(axis=(1, 3)))[:512, :512], lo, hi))
    built = session.folder / "cache" / "pyramids" / "pyr"
    assert sorted(p.name for p in built.iterdir() if not p.name.startswith(".")) == ["3", "4"]


# ---------------------------------------------------------------------- stores that lie or lead elsewhere
def declared_store(store: Path, shape, chunks, v3: bool = False) -> None:
    """A zarr array of uint8 whose metadata alone are written (a few hundred bytes, no chunk files)."""
    store.mkdir()
    if v3:
        meta = {"zarr_format": 3, "node_type": "array", "shape": shape, "data_type": "uint8",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                "fill_value": 0, "codecs": [{"name": "bytes"}], "attributes": {}}
        (store / "zarr.json").write_text(json.dumps(meta))
    else:
        meta = {"zarr_format": 2, "shape": shape, "chunks": chunks, "dtype": "|u1", "compressor": None,
                "fill_value": 0, "order": "C", "filters": None}
        (store / ".zarray").write_text(json.dumps(meta))


def test_a_store_declaring_more_than_the_app_takes_is_refused_from_its_metadata(tmp_path, start):
    """The bound of images read whole (--max-megapixels, 67.1 Mpx by default) applies to what a chunked
    image declares: 1024 times that per image, and a chunk (decoded whole) at most that."""
    folder = tmp_path / "images"
    folder.mkdir()
    declared_store(folder / "liar.zarr", [2_000_000, 2_000_000], [512, 512])
    declared_store(folder / "liar3.zarr", [2_000_000, 2_000_000], [2_000_000, 2_000_000], v3=True)
    declared_store(folder / "onechunk.zarr", [20_000, 20_000], [20_000, 20_000])   # 400 Mpx, in one chunk
    declared_store(folder / "fine.zarr", [20_000, 20_000], [512, 512])
    assert (folder / "liar.zarr" / ".zarray").stat().st_size < 300
    session, _, client = start(folder)
    state = client.get("/api/state").json()
    assert [(i["id"], i["width"]) for i in state["images"]] == [("fine", 20_000)]
    notes = {n.split()[0]: n for n in state["notes"]}
    assert sorted(notes) == ["liar.zarr", "liar3.zarr", "onechunk.zarr"]
    for name in ("liar.zarr", "liar3.zarr"):
        assert "declares 2000000×2000000 px = 4,000.0 Gpx" in notes[name] and "limit of 68.7 Gpx" in notes[name]
    assert "chunks of 20000×20000" in notes["onechunk.zarr"] and "limit of 67.1 Mpx per chunk" in notes["onechunk.zarr"]
    refused = client.post("/api/images/add", json={"path": str(folder / "liar.zarr")})
    assert refused.status_code == 413 and refused.json()["detail"].startswith("liar.zarr declares")
    # The cap follows --max-megapixels: a session allowing 16 times more takes the 400 Mpx chunk.
    roomy = Session(tmp_path / "roomy", [folder / "onechunk.zarr"], max_pixels=16 << 26)
    assert list(roomy.images) == ["onechunk"] and not roomy.skipped


def test_a_chunk_that_leads_out_of_its_store_is_not_read(tmp_path, start):
    """A chunk file that is a symbolic link to a file outside the store is refused (403, naming it);
    a link to another chunk of the same store is read."""
    folder, elsewhere = tmp_path / "images", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    pixels = (np.arange(64 * 64) % 200).reshape(64, 64).astype(np.uint8)
    for store, values in ((folder / "img.zarr", pixels), (elsewhere / "secret.zarr", np.full((64, 64), 250, np.uint8))):
        zarr.create_array(str(store), shape=(64, 64), chunks=(32, 32), dtype=np.uint8, zarr_format=2,
                          compressors=None)[:] = values
    shared = folder / "img.zarr"
    (shared / "1.0").unlink()
    (shared / "1.0").symlink_to(shared / "1.1")   # storage shared within the store: fine
    want = pixels.copy()
    want[32:, :32] = pixels[32:, 32:]
    from alibi_vit.app.imagefiles import open_chunked

    np.testing.assert_array_equal(open_chunked(shared).read(), want)

    (shared / "0.0").unlink()
    (shared / "0.0").symlink_to(elsewhere / "secret.zarr" / "0.0")
    _, _, client = start(folder)
    refused = client.get("/api/images/img/tiles/image/0/0/0.png")
    assert refused.status_code == 403, refused.text
    detail = refused.json()["detail"]
    assert "0.0 of the zarr store" in detail and "outside the store" in detail and "img.zarr" in detail



def test_a_tile_whose_client_went_away_stops_being_built(tmp_path, start, monkeypatch):
    """The coarsest tile of an image without a pyramid is built from every chunk below it (64 here,
    each read made to take 50 ms); a client that gives up after 0.3 s leaves at most the level-1 tile
    being built when the server saw it go (16 chunks each) behind, not the other three."""
    import httpx
    from zarr.storage import LocalStore

    folder = tmp_path / "images"
    folder.mkdir()
    zarr.create_array(str(folder / "flat.zarr"), shape=(2048, 2048), chunks=(256, 256), dtype=np.uint8,
                      zarr_format=2)[:] = np.random.default_rng(0).integers(0, 255, (2048, 2048), dtype=np.uint8)
    session, engine, _ = start(folder)
    session.fix_intensity()   # its sample of tiles is read before reads are slowed down
    reads, real_get = [], LocalStore.get

    async def slow_get(self, key, prototype=None, byte_range=None):
        if not key.rsplit("/", 1)[-1].startswith((".z", "zarr.json")) and "flat.zarr" in str(self.root):
            time.sleep(0.05)  # noqa: ASYNC251 - blocks zarr's loop: the chunks of a region are read one by one
            reads.append(key)
        return await real_get(self, key, prototype, byte_range)

    monkeypatch.setattr(LocalStore, "get", slow_get)
    base, stop = serve_app(create_app(session, engine))
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.get(f"{base}/api/images/flat/tiles/image/2/0/0.png", timeout=0.3)
        time.sleep(2.0)
        settled = len(reads)
        time.sleep(1.0)
        assert len(reads) == settled <= 32, (settled, len(reads))   # all 64 without the client
    finally:
        stop()
