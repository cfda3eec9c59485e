"""What the app's page is sent to show an image: each image's own display range (the classifier
keeps the session's one), and a big TIFF without a pyramid shown coarse first, from a few of its
rows, before any of its finer display levels is built."""


import numpy as np
import pytest
import tifffile
import zarr

pytest.importorskip("fastapi")

from tests.helpers import app_clients  # noqa: E402
from tests.helpers import png_pixels as png  # noqa: E402


@pytest.fixture
def start(tmp_path):
    with app_clients(tmp_path / "session") as start:
        yield start



def stretched(pixels, lo, hi) -> np.ndarray:
    return (np.clip((pixels.astype(np.float64) - lo) / (hi - lo), 0, 1) * 255).round().astype(np.uint8)


def test_each_16_bit_image_is_shown_in_its_own_range_and_featurised_in_the_sessions(tmp_path, start):
    """A 1000-3000 image beside a 2000-53000 one (and a zarr store of 1000-3000, sent as tiles):
    each is shown spanning 0-255, its own 0.01 and 99.99 percentiles black and white; the
    session's range, which the features are computed with, still spans all of them."""
    rng = np.random.default_rng(0)
    folder = tmp_path / "images"
    folder.mkdir()
    dim = rng.integers(1000, 3001, (60, 80)).astype(np.uint16)
    bright = rng.integers(2000, 53001, (60, 80)).astype(np.uint16)
    tifffile.imwrite(folder / "dim.tif", dim)
    tifffile.imwrite(folder / "bright.tif", bright)
    zarr.create_array(str(folder / "store.zarr"), shape=dim.shape, chunks=(32, 32), dtype=dim.dtype)[:] = dim[::-1]
    session, engine, client = start(folder)
    assert {i["id"]: i["chunked"] for i in client.get("/api/state").json()["images"]} == \
        {"bright": False, "dim": False, "store": True}

    for image_id, pixels in (("dim", dim), ("bright", bright)):
        shown = png(client.get(f"/api/images/{image_id}/display.png"))
        assert shown.min() <= 1 and shown.max() >= 254, (image_id, shown.min(), shown.max())
        lo, hi = np.percentile(pixels.astype(np.float64), [0.01, 99.99])
        assert np.abs(shown.astype(int) - stretched(pixels, lo, hi)).max() <= 1, image_id
        np.testing.assert_array_equal(png(client.get(f"/api/images/{image_id}/tiles/image/0/0/0.png")), shown)
    tile = png(client.get("/api/images/store/tiles/image/0/0/0.png"))
    lo, hi = np.percentile(dim.astype(np.float64), [0.01, 99.99])
    assert np.abs(tile.astype(int) - stretched(dim[::-1], lo, hi)).max() <= 1

    lo, hi = session.fix_intensity()   # what the classifier scales every image with: one range for all
    assert lo < 1100 and hi > 52000
    assert engine.segmenter().intensity_range == (lo, hi)


def test_a_big_tiff_without_a_pyramid_is_shown_zoomed_out_from_a_few_of_its_rows(tmp_path, start, monkeypatch):
    """A 4608² BigTIFF without a pyramid (read chunk by chunk): its levels 8 and 16 times coarser
    are read from one row in 8 (16) of the image, each pixel the mean of 8 pixels along the middle
    row of its block, not built from the whole image; level 1 is still each 2 × 2's mean, built when
    asked for; every tile is made once."""
    from alibi_vit.chunked import ChunkedImage
    from alibi_vit.synthetic import synthetic_micrograph

    size = 4608  # over the 4096² above which the app reads a TIFF chunk by chunk; levels 0-4
    image = np.tile(synthetic_micrograph(512, 3, seed=3)[0], (9, 9))
    folder = tmp_path / "images"
    folder.mkdir()
    tifffile.imwrite(folder / "big.tif", image, bigtiff=True)
    session, engine, client = start(folder)
    assert client.get("/api/state").json()["images"][0]["chunked"]
    session.fix_intensity()  # (the session's sample of tiles, for the classifier: not counted below)

    rows_read = []
    real_read = ChunkedImage.read

    def read(self, rows=slice(None), cols=slice(None), plane=0, level=0):
        rows_read.extend(range(*rows.indices(self.level_shape(level)[0])))
        return real_read(self, rows, cols, plane, level)

    monkeypatch.setattr(ChunkedImage, "read", read)
    shown, expected = {}, {}
    for level, stride in ((4, 16), (3, 8)):
        rows_read.clear()
        n = -(-size // stride)
        shown[level] = np.zeros((n, n), np.uint8)
        for r in range(-(-n // 512)):
            for c in range(-(-n // 512)):
                shown[level][r * 512:(r + 1) * 512, c * 512:(c + 1) * 512] = \
                    png(client.get(f"/api/images/big/tiles/image/{level}/{r}/{c}.png"))
        assert len(set(rows_read)) == n, (level, len(set(rows_read)))  # one row per block, each once
        step = stride // 8
        samples = image[stride // 2::stride, step // 2::step].astype(np.float64)
        expected[level] = samples.reshape(n, n, 8).mean(axis=2).round()
    lo, hi = engine.display_range("big")  # fitted on level 4, the coarsest
    assert (lo, hi) == pytest.approx(np.percentile(expected[4], [0.01, 99.99]), abs=0.5)
    for level in (4, 3):
        assert np.abs(shown[level].astype(int) - stretched(expected[level], lo, hi)).max() <= 1, level

    rows_read.clear()
    level1 = png(client.get("/api/images/big/tiles/image/1/2/3.png"))  # rows 1024-1535, columns 1536-2047
    mean = image[2048:3072, 3072:4096].astype(np.float64).reshape(512, 2, 512, 2).mean(axis=(1, 3))
    np.testing.assert_array_equal(level1, stretched(np.round(mean), lo, hi))
    assert set(rows_read) == set(range(2048, 3072))
    rows_read.clear()
    client.get("/api/images/big/tiles/image/3/0/0.png")
    client.get("/api/images/big/tiles/image/1/2/3.png")
    assert not rows_read  # kept in the session folder
