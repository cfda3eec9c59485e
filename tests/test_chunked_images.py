"""Lazy readers of images larger than memory (alibi_vit.chunked): TIFF/BigTIFF (tiled, strips,
pyramidal OME-TIFF) and zarr/OME-Zarr (v2, v3), checked against the arrays written."""

from __future__ import annotations

import numpy as np
import pytest
import tifffile
import zarr
from zarr.storage import LocalStore, WrapperStore

from alibi_vit.chunked import is_zarr_path, open_image, sample_tiles
from alibi_vit.images import ImageReadError

RNG = np.random.default_rng(0)
GREY = RNG.integers(0, 60000, (300, 420), dtype=np.uint16)
RGB = RNG.integers(0, 255, (200, 260, 3), dtype=np.uint8)


class CountingStore(WrapperStore):
    """A zarr store that records the chunk keys read through it."""

    def __init__(self, store):
        super().__init__(store)
        self.keys = []

    async def get(self, key, prototype, byte_range=None):
        if not key.rsplit("/", 1)[-1].startswith((".z", "zarr.json")):
            self.keys.append(key)
        return await super().get(key, prototype, byte_range)


@pytest.mark.parametrize("layout", [dict(tile=(128, 128), compression="zlib"), dict(rowsperstrip=32,
                                                                                    compression="zlib"),
                                    dict(rowsperstrip=32), dict()])
def test_tiff_regions_equal_the_written_array(tmp_path, layout):
    path = tmp_path / "a.tif"
    tifffile.imwrite(path, GREY, bigtiff=True, **layout)
    image = open_image(path)
    assert image.axes == "yx" and image.shape == GREY.shape and image.channels == 1 and image.planes == 1
    assert image.dtype == np.uint16
    for rows, cols in [(slice(0, 300), slice(0, 420)), (slice(17, 211), slice(130, 401)), (slice(299, 300),
                                                                                           slice(0, 1))]:
        np.testing.assert_array_equal(image.read(rows, cols), GREY[rows, cols])


def test_a_tiled_tiff_dropped_after_reading_leaves_no_file_open(tmp_path):
    """The zarr store over a tiled TIFF reopens the file to read tiles; dropping the view closes it (an
    open one is an "unclosed file" ResourceWarning, which a segment run showed among its warnings)."""
    import gc
    import warnings

    path = tmp_path / "a.tif"
    tifffile.imwrite(path, GREY, bigtiff=True, tile=(64, 64), compression="zlib")
    gc.collect()  # what earlier tests left unclosed is warned about now, not in the block below
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = open_image(path)
        np.testing.assert_array_equal(image.read(slice(0, 100), slice(0, 100)), GREY[:100, :100])
        del image
        gc.collect()
    ours = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning) and path.name in str(w.message)]
    assert not ours, ours


@pytest.mark.parametrize("planar", [False, True])
def test_rgb_tiff_reads_channels_last(tmp_path, planar):
    path = tmp_path / "rgb.tif"
    data = np.moveaxis(RGB, -1, 0) if planar else RGB
    tifffile.imwrite(path, data, photometric="rgb", planarconfig="separate" if planar else "contig", tile=(64, 64))
    image = open_image(path)
    assert image.channels == 3 and image.shape == RGB.shape[:2]
    np.testing.assert_array_equal(image.read(slice(10, 150), slice(33, 200)), RGB[10:150, 33:200])


def test_pyramidal_ome_tiff_exposes_its_levels(tmp_path):
    path = tmp_path / "p.ome.tif"
    with tifffile.TiffWriter(path, bigtiff=True) as tif:
        tif.write(GREY, subifds=2, tile=(64, 64))
        tif.write(GREY[::2, ::2], subfiletype=1, tile=(64, 64))
        tif.write(GREY[::4, ::4], subfiletype=1, tile=(64, 64))
    image = open_image(path)
    assert [image.level_shape(i) for i in range(3)] == [(300, 420), (150, 210), (75, 105)]
    np.testing.assert_array_equal(image.read(level=2), GREY[::4, ::4])


@pytest.mark.parametrize("fmt", [2, 3])
def test_zarr_arrays_and_ome_zarr_groups(tmp_path, fmt):
    plain = zarr.create_array(str(tmp_path / "plain.zarr"), shape=GREY.shape, chunks=(64, 64), dtype=GREY.dtype,
                              zarr_format=fmt)
    plain[:] = GREY
    np.testing.assert_array_equal(open_image(tmp_path / "plain.zarr").read(slice(5, 99), slice(70, 300)),
                                  GREY[5:99, 70:300])
    # An NGFF image: axes c, y, x of one channel (dropped), two levels; 0.5 nests the metadata under "ome".
    group = zarr.open_group(str(tmp_path / "img.ome.zarr"), mode="w", zarr_format=fmt)
    for i, step in enumerate((1, 2)):
        arr = group.create_array(str(i), shape=(1,) + GREY[::step, ::step].shape, chunks=(1, 64, 64),
                                 dtype=GREY.dtype)
        arr[:] = GREY[None, ::step, ::step]
    ms = {"version": "0.4" if fmt == 2 else "0.5", "axes": [{"name": "c", "type": "channel"},
                                                           {"name": "y", "type": "space"},
                                                           {"name": "x", "type": "space"}],
          "datasets": [{"path": "0"}, {"path": "1"}]}
    group.attrs.update({"multiscales": [ms]} if fmt == 2 else {"ome": {"version": "0.5", "multiscales": [ms]}})
    image = open_image(tmp_path / "img.ome.zarr")
    assert image.axes == "cyx" and image.channels == 1 and len(image.levels) == 2
    np.testing.assert_array_equal(image.read(slice(0, 40), slice(0, 40), level=1), GREY[::2, ::2][:40, :40])


def test_named_dimensions_give_the_axis_order(tmp_path):
    data = np.moveaxis(RGB, -1, 0)  # stored c, y, x
    arr = zarr.create_array(str(tmp_path / "cyx.zarr"), shape=data.shape, chunks=(3, 64, 64), dtype=data.dtype,
                            dimension_names=("c", "y", "x"))
    arr[:] = data
    image = open_image(tmp_path / "cyx.zarr")
    assert image.channels == 3
    np.testing.assert_array_equal(image.read(slice(3, 70), slice(0, 100)), RGB[3:70, 0:100])


def test_planes_index_the_other_axes(tmp_path):
    stack = RNG.integers(0, 255, (2, 3, 40, 50), dtype=np.uint8)
    arr = zarr.create_array(str(tmp_path / "tz.zarr"), shape=stack.shape, chunks=(1, 1, 40, 50), dtype=np.uint8,
                            dimension_names=("t", "z", "y", "x"))
    arr[:] = stack
    image = open_image(tmp_path / "tz.zarr")
    assert image.planes == 6
    np.testing.assert_array_equal(image.read(plane=4), stack[1, 1])  # row-major over (t, z)


@pytest.mark.parametrize("names, found", [(("a", "b", "c"), "a, b, c"), (("c", "y", "x", "channel"),
                                                                          "c, y, x, channel")])
def test_unrecognised_axes_or_two_channel_axes_name_the_axes_found(tmp_path, names, found):
    shape = (2, 30, 40, 2)[:len(names)]
    zarr.create_array(str(tmp_path / "bad.zarr"), shape=shape, chunks=shape, dtype=np.uint8,
                      dimension_names=names)
    with pytest.raises(ImageReadError, match=f"axes found: {found}") as err:
        open_image(tmp_path / "bad.zarr")
    assert "\n" not in str(err.value)


def test_a_3d_array_without_names_is_refused_and_a_bare_group_too(tmp_path):
    zarr.create_array(str(tmp_path / "s.zarr"), shape=(5, 30, 40), chunks=(1, 30, 40), dtype=np.uint8)
    with pytest.raises(ImageReadError, match=r"axes found: none, shape \(5, 30, 40\)"):
        open_image(tmp_path / "s.zarr")
    zarr.open_group(str(tmp_path / "g.zarr"), mode="w").create_array("x", shape=(4, 4), dtype=np.uint8)
    with pytest.raises(ImageReadError, match="without OME-Zarr multiscales metadata.*arrays: x"):
        open_image(tmp_path / "g.zarr")


def test_damaged_tiles_name_the_file_and_region(tmp_path):
    path = tmp_path / "c.tif"
    tifffile.imwrite(path, GREY, tile=(128, 128), compression="zlib")
    with tifffile.TiffFile(path) as tif:  # tile 5 of 4 a row: rows 128:256, columns 128:256
        offset, count = tif.pages[0].dataoffsets[5], tif.pages[0].databytecounts[5]
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * count)
    image = open_image(path)
    np.testing.assert_array_equal(image.read(slice(0, 128), slice(0, 128)), GREY[:128, :128])  # others fine
    with pytest.raises(ImageReadError, match=r"c\.tif: cannot read rows 130:140, columns 140:150"):
        image.read(slice(130, 140), slice(140, 150))


def test_only_the_chunks_a_region_touches_are_read(tmp_path):
    arr = zarr.create_array(str(tmp_path / "a.zarr"), shape=GREY.shape, chunks=(100, 100), dtype=GREY.dtype)
    arr[:] = GREY
    store = CountingStore(LocalStore(str(tmp_path / "a.zarr"), read_only=True))
    image = open_image(zarr.open_array(store=store, mode="r"))
    image.read(slice(150, 180), slice(250, 310))  # rows in chunk 1, columns in chunks 2 and 3
    assert sorted(store.keys) == ["c/1/2", "c/1/3"]


def test_sample_tiles_is_seeded_and_stops_at_the_budget(tmp_path):
    arr = zarr.create_array(str(tmp_path / "a.zarr"), shape=GREY.shape, chunks=(100, 105), dtype=GREY.dtype)
    arr[:] = GREY
    image = open_image(tmp_path / "a.zarr")
    pixels, n, total = sample_tiles(image, max_pixels=25_000, seed=3)
    assert total == 12 and n == 3 and pixels.shape == (1, 3 * 100 * 105)  # 10 500 px a tile: three reach 25 000
    again, _, _ = sample_tiles(image, max_pixels=25_000, seed=3)
    np.testing.assert_array_equal(pixels, again)
    assert set(np.unique(pixels)) <= set(np.unique(GREY))
    everything, n_all, _ = sample_tiles(image, max_pixels=10 ** 9, seed=0)
    assert n_all == 12 and np.array_equal(np.sort(everything.ravel()), np.sort(GREY.ravel()))


def test_paths_that_are_not_chunked_images(tmp_path):
    (tmp_path / "folder").mkdir()
    assert not is_zarr_path(tmp_path / "folder")
    with pytest.raises(ImageReadError, match="no such image file"):
        open_image(tmp_path / "missing.tif")
    (tmp_path / "a.png").write_bytes(b"")
    with pytest.raises(ImageReadError, match="PNG and JPEG files are read whole"):
        open_image(tmp_path / "a.png")
