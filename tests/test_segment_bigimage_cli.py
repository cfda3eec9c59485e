"""``alibi-vit segment train|apply`` on images segmented tile by tile (BigTIFF, OME-Zarr) and their bad
inputs: damaged tiles, unreadable axis orders, a full disk. ``WHOLE_PIXELS`` is lowered so that
small test files take the path of images larger than memory."""

from __future__ import annotations

import csv
import errno
import shutil

import numpy as np
import pytest
import tifffile
from PIL import Image

from alibi_vit.chunked import open_image
from alibi_vit.cli import segment as segment_cli
from alibi_vit.cli.main import main
from alibi_vit.trainable import TrainableSegmenter, scribbles, synthetic_micrograph
from alibi_vit.trainable.writers import ZarrOutput

SHAPE = (300, 340)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("big_cli")
    image, truth = synthetic_micrograph(SHAPE, seed=3)
    (root / "train").mkdir()
    tifffile.imwrite(root / "train" / "t.tif", image, tile=(64, 64), bigtiff=True)
    Image.fromarray(scribbles(truth, 2, rng=0).astype(np.uint8)).save(root / "train" / "t_labels.png")
    assert main(["segment", "train", "--images", str(root / "train" / "t.tif"), "--labels",
                 str(root / "train" / "t_labels.png"), "--trees", "5", "--out", str(root / "model")]) == 0
    (root / "in").mkdir()
    tifffile.imwrite(root / "in" / "a.tif", image[::-1], tile=(64, 64), bigtiff=True, compression="zlib")
    out = ZarrOutput(root / "in" / "b.ome.zarr", SHAPE, image.dtype, 64)
    out.write((slice(0, SHAPE[0]), slice(0, SHAPE[1])), image[:, ::-1])
    out.finish()
    Image.fromarray(image[:100, :120]).save(root / "in" / "c.png")
    model = TrainableSegmenter.load(root / "model")
    expected = {"a": model.predict([image[::-1]])[0], "b": model.predict([image[:, ::-1]])[0],
                "c": model.predict([image[:100, :120]])[0]}
    return root, image, truth, expected


@pytest.fixture
def small_whole(monkeypatch):
    monkeypatch.setattr(segment_cli, "WHOLE_PIXELS", 10_000)


def _copy_inputs(root, tmp_path):
    folder = tmp_path / "in"
    shutil.copytree(root / "in", folder)
    return folder


def test_apply_streams_large_images_to_bigtiff_and_ome_zarr(data, tmp_path, small_whole, capsys):
    root, _, _, expected = data
    out = tmp_path / "out"
    assert main(["segment", "apply", "--model", str(root / "model"), "--images", str(root / "in"),
                 "--out", str(out)]) == 0
    masks = {"a": open_image(out / "a_mask.ome.tif").read(), "b": open_image(out / "b_mask.ome.zarr").read(),
             "c": np.asarray(Image.open(out / "c_mask.png"))}  # c.png is small: read whole, written as before
    for name, mask in masks.items():
        np.testing.assert_array_equal(mask, expected[name])
    assert open_image(out / "a_overlay.ome.tif").channels == 3 and (out / "b_overlay.ome.zarr").is_dir()
    rows = {r["image"]: r for r in csv.DictReader(open(out / "area_fractions.csv"))}
    for name, file in (("a", "a.tif"), ("b", "b.ome.zarr")):
        for c in (1, 2, 3):
            assert int(rows[file][f"pixels_{c}"]) == (expected[name] == c).sum()
    assert "MP/s" in capsys.readouterr().err


def test_train_reads_a_large_tiff_lazily_and_gives_the_same_model(data, tmp_path, small_whole):
    root, image, _, expected = data
    assert main(["segment", "train", "--images", str(root / "train" / "t.tif"), "--labels",
                 str(root / "train" / "t_labels.png"), "--trees", "5", "--out", str(tmp_path / "lazy")]) == 0
    lazy = TrainableSegmenter.load(tmp_path / "lazy")
    np.testing.assert_array_equal(lazy.predict([image[::-1]])[0], expected["a"])


def test_a_damaged_tile_skips_its_image_and_the_others_are_written(data, tmp_path, small_whole, capsys):
    root, _, _, expected = data
    folder = _copy_inputs(root, tmp_path)
    with tifffile.TiffFile(folder / "a.tif") as tif:
        offset, count = tif.pages[0].dataoffsets[7], tif.pages[0].databytecounts[7]
    with open(folder / "a.tif", "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * count)
    out = tmp_path / "out"
    assert main(["segment", "apply", "--model", str(root / "model"), "--images", str(folder),
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"warning: skipped {folder / 'a.tif'}: {folder / 'a.tif'}: cannot read rows" in err
    assert err.strip().splitlines()[-1] == "alibi-vit segment: error: 1 image(s) could not be segmented: a.tif"
    assert not list(out.glob("a_*")) and [p.name for p in out.glob(".*")] == [".manifests"]  # nothing half-written
    np.testing.assert_array_equal(open_image(out / "b_mask.ome.zarr").read(), expected["b"])
    assert [r["image"] for r in csv.DictReader(open(out / "area_fractions.csv"))][:2] == ["b.ome.zarr", "c.png"]


def test_a_zarr_of_unknown_axes_is_named_with_its_axes(data, tmp_path, capsys):
    import zarr

    root, _, _, _ = data
    folder = tmp_path / "in"
    folder.mkdir()
    arr = zarr.create_array(str(folder / "odd.zarr"), shape=(2, 40, 50), chunks=(1, 40, 50), dtype=np.uint16,
                            dimension_names=("wavelength", "y", "x"))
    arr[:] = 7
    assert main(["segment", "apply", "--model", str(root / "model"), "--images", str(folder),
                 "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert (f"alibi-vit segment: warning: skipped {folder / 'odd.zarr'}: {folder / 'odd.zarr'}: no recognisable "
            "axis order (axes found: wavelength, y, x); name the axes t, z, c, y, x\n") in err
    assert err.strip().splitlines()[-1] == "alibi-vit segment: error: 1 image(s) could not be segmented: odd.zarr"


def test_a_full_disk_is_a_clear_error_and_finished_outputs_stay(data, tmp_path, small_whole, capsys, monkeypatch):
    root, _, _, expected = data
    from zarr.storage import LocalStore

    real = LocalStore.set

    async def set_chunk(self, key, value, *args, **kwargs):  # b's mask is written, then the disk is full
        if "b_overlay" in str(self.root) and key.startswith("0/"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self, key, value, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "set", set_chunk)
    out = tmp_path / "out"
    assert main(["segment", "apply", "--model", str(root / "model"), "--images", str(root / "in"),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1]  # the file named is the one being written (in the run's staging folder)
    assert last.startswith(f"alibi-vit segment: error: cannot write {out}") and "\n" not in last
    assert last.endswith("b_overlay.ome.zarr: No space left on device; outputs written before stay valid")
    np.testing.assert_array_equal(open_image(out / "a_mask.ome.tif").read(), expected["a"])
    assert not list(out.glob("b_*")) and [p.name for p in out.glob(".*")] == [".manifests"]  # a's manifest only


def test_single_file_formats_refuse_large_images_before_any_work(data, tmp_path, small_whole, capsys):
    root, _, _, _ = data
    assert main(["segment", "apply", "--model", str(root / "model"), "--images", str(root / "in" / "a.tif"),
                 "--out", str(tmp_path / "out"), "--format", "png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"alibi-vit segment: error: {root / 'in' / 'a.tif'} is 300×340 px: it is segmented tile by tile, "
                   "which --out-format png cannot write; use --out-format auto, ome-zarr or bigtiff")
    assert not (tmp_path / "out").exists()
