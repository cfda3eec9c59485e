"""Block by block equals whole: fractions, interfaces, S2 and objects (stitched across block borders) are the same
whatever the block size, on arrays and on a chunked zarr store; the objects agree with scikit-image's
``label`` and ``regionprops_table`` on the whole array; the confidence intervals behave."""

from __future__ import annotations

import numpy as np
import pytest

from alibi_vit.measure.analysis import MeasureOptions, measure_mask
from alibi_vit.measure.masks import array_source, open_mask

LOCAL = ("fractions", "surfaces", "s2", "objects", "percolation")


def smooth_phases(shape, seed: int, phases: int = 3) -> np.ndarray:
    from scipy import ndimage

    field = ndimage.gaussian_filter(np.random.default_rng(seed).random(shape), 2.0)
    edges = np.quantile(field, np.linspace(0, 1, phases + 1)[1:-1])
    return np.digitize(field, edges).astype(np.uint8)


def _measure(source, **options):
    return measure_mask(source, MeasureOptions(progress=False, metrics=LOCAL, radius=6, **options))


def _objects_sorted(table) -> dict:
    order = np.lexsort([table[k] for k in sorted(k for k in table if k.startswith("centroid_"))] + [table["phase"]])
    return {k: v[order] for k, v in table.items() if isinstance(v, np.ndarray) and k != "id"}


def _same(a: dict, b: dict) -> None:
    assert a["fractions"]["phases"] == b["fractions"]["phases"]
    assert a["fractions"]["windows"] == b["fractions"]["windows"]
    assert a["interfaces"] == b["interfaces"]
    assert a["s2"] == b["s2"]
    assert a["percolation"] == b["percolation"]
    first, second = _objects_sorted(a["objects"]), _objects_sorted(b["objects"])
    assert first.keys() == second.keys()
    for key in first:
        np.testing.assert_allclose(first[key], second[key], rtol=1e-9, atol=1e-9, err_msg=key)


@pytest.mark.parametrize("shape, small", [((150, 230), 32), ((40, 44, 36), 8)])
def test_blocks_give_the_whole_array_result(shape, small):
    mask = smooth_phases(shape, seed=3)
    whole = _measure(array_source(mask), block=512)
    assert whole["block"] >= max(shape)  # one block
    _same(whole, _measure(array_source(mask), block=small))


def test_chunked_zarr_store_equals_the_array(tmp_path):
    zarr = pytest.importorskip("zarr")
    mask = smooth_phases((200, 180), seed=4)
    store = zarr.create_array(str(tmp_path / "m.zarr"), shape=mask.shape, chunks=(64, 64), dtype=np.uint8)
    store[:] = mask
    source = open_mask(tmp_path / "m.zarr")
    assert source.shape == (1, 200, 180) and source.ndim == 2
    _same(_measure(array_source(mask)), _measure(source, block=64))


def test_objects_agree_with_regionprops_table_and_instance_labels_with_label(tmp_path):
    import tifffile
    from skimage.measure import label, regionprops_table

    mask = smooth_phases((120, 140), seed=5, phases=2)
    spacing = (0.5, 2.0)
    grey = np.random.default_rng(5).random(mask.shape) + mask
    intensity = array_source(mask, name="grey")  # a source whose reader gives the floats
    intensity.reader, intensity.dtype = (lambda box: grey[None][box]), grey.dtype
    result = measure_mask(array_source(mask, spacing), MeasureOptions(
        progress=False, metrics=("objects",), block=32, instance_labels=tmp_path / "objects"), intensity=intensity)
    table = result["objects"]
    for phase in (0, 1):
        expected_labels = label(mask == phase, connectivity=1)
        props = regionprops_table(expected_labels, grey, spacing=spacing, properties=(
            "area", "centroid", "equivalent_diameter_area", "axis_major_length", "axis_minor_length", "orientation",
            "intensity_mean"))
        mine = table["phase"] == phase
        assert mine.sum() == expected_labels.max()
        order_mine = np.lexsort((table["centroid_x"][mine], table["centroid_y"][mine]))
        order_props = np.lexsort((props["centroid-1"], props["centroid-0"]))
        for ours, theirs in (("size", "area"), ("centroid_y", "centroid-0"), ("centroid_x", "centroid-1"),
                             ("equivalent_diameter", "equivalent_diameter_area"),
                             ("axis_major_length", "axis_major_length"), ("axis_minor_length", "axis_minor_length"),
                             ("intensity_mean", "intensity_mean")):
            np.testing.assert_allclose(table[ours][mine][order_mine], props[theirs][order_props], rtol=1e-6,
                                       atol=1e-9, err_msg=ours)
        round_enough = table["aspect_ratio"][mine][order_mine] > 1.05  # orientation is undefined for round ones
        np.testing.assert_allclose(table["orientation"][mine][order_mine][round_enough],
                                   props["orientation"][order_props][round_enough], atol=1e-6)
    ids = tifffile.imread(result["instance_labels"])
    assert ids.shape == mask.shape and ids.max() == len(table["id"])
    # one instance id per skimage object and back: the same partition of the pixels
    reference = label(mask == 1, connectivity=1) + (label(mask == 0, connectivity=1) + 10_000) * (mask == 0)
    pairs = np.unique(np.stack([ids.ravel(), reference.ravel()]), axis=1)
    assert len(np.unique(pairs[0])) == len(np.unique(pairs[1])) == pairs.shape[1]


def test_border_flags_and_minimum_size():
    mask = np.zeros((1, 30, 30), np.uint8)
    mask[0, 0:3, 10:13] = 1  # touches the top edge
    mask[0, 10:20, 10:20] = 1  # whole, 100 px
    mask[0, 25:27, 25:27] = 1  # whole, 4 px
    result = measure_mask(array_source(mask[0]), MeasureOptions(progress=False, metrics=("objects",), min_size=5,
                                                                block=16))
    table = result["objects"]
    ones = table["phase"] == 1
    assert sorted(table["voxels"][ones]) == [9, 100] and result["objects_dropped_small"] == 1
    assert dict(zip(table["voxels"][ones], table["border"][ones])) == {9: True, 100: False}


def test_confidence_intervals_and_probability_view():
    mask = smooth_phases((256, 256), seed=6, phases=2)
    uniform = measure_mask(array_source(np.ones((64, 64), np.uint8)), MeasureOptions(progress=False,
                                                                                     metrics=("fractions",)))
    entry = uniform["fractions"]["phases"][1]
    assert entry["fraction"] == 1 and entry["tile_se"] == 0 and entry["tile_ci95_low"] == entry["tile_ci95_high"] == 1
    proba = np.where(mask == 1, 0.9, 0.2)
    source = array_source(mask)
    probability = array_source(np.zeros((256, 256), np.uint8), name="p")  # a source whose reader gives floats
    probability.reader, probability.dtype = (lambda box: proba[None][box]), proba.dtype
    result = measure_mask(source, MeasureOptions(progress=False, metrics=("fractions",)), {1: probability})
    entry = result["fractions"]["phases"][1]
    assert entry["proba_fraction"] == pytest.approx(proba.mean())
    spread = np.sqrt(np.sum(proba * (1 - proba))) / proba.size
    assert entry["proba_ci95_high"] - entry["proba_ci95_low"] == pytest.approx(2 * 1.96 * spread)
    assert entry["tile_ci95_low"] < entry["fraction"] < entry["tile_ci95_high"]
    assert entry["tile_se"] > 0 and entry["tiles"] == 16
    # the representative-volume check: fractions vary less over larger windows
    stds = [r["std"] for r in result["fractions"]["windows"] if r["phase"] == 1 and r["windows"] > 1]
    assert stds == sorted(stds, reverse=True)


class _ShuffledExecutor:
    """A scheduler stand-in: every unit's arguments go through pickle (as to a worker process) and the units
    finish in a shuffled order, as a cluster's may."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def broadcast(self, value):
        import pickle

        return pickle.loads(pickle.dumps(value))

    def submit(self, fn, *args):
        import pickle

        fn, args = pickle.loads(pickle.dumps((fn, args)))
        return _Done(fn(*args))

    def completed(self, futures):
        return [futures[i] for i in self.rng.permutation(len(futures))]


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


@pytest.mark.parametrize("shape, block", [((150, 230), 32), ((40, 44, 36), 8)])
def test_blocks_finished_in_any_order_on_workers_give_the_same_result_and_object_ids(tmp_path, shape, block):
    zarr = pytest.importorskip("zarr")
    mask = smooth_phases(shape, seed=8)
    store = zarr.create_array(str(tmp_path / "m.zarr"), shape=mask.shape, chunks=(16,) * mask.ndim, dtype=np.uint8,
                              dimension_names="zyx"[-mask.ndim:])
    store[:] = mask
    grey = (np.random.default_rng(1).random(shape) * 1000).astype(np.uint16)
    options = dict(progress=False, metrics=LOCAL, radius=5, block=block)
    serial = measure_mask(array_source(mask), MeasureOptions(**options, instance_labels=tmp_path / "serial"),
                          intensity=array_source(grey, name="grey"))
    shuffled = measure_mask(open_mask(tmp_path / "m.zarr"),
                            MeasureOptions(**options, instance_labels=tmp_path / "shuffled"),
                            intensity=array_source(grey, name="grey"),
                            executor=_ShuffledExecutor(seed=2))
    assert serial["fractions"] == shuffled["fractions"] and serial["s2"] == shuffled["s2"]
    assert serial["interfaces"] == shuffled["interfaces"] and serial["percolation"] == shuffled["percolation"]
    assert serial["objects"].keys() == shuffled["objects"].keys()
    for key, column in serial["objects"].items():  # the same ids in the same order, not only the same set
        np.testing.assert_array_equal(column, shuffled["objects"][key], err_msg=key)
    import tifffile

    np.testing.assert_array_equal(tifffile.imread(tmp_path / "serial.tif"), tifffile.imread(tmp_path / "shuffled.tif"))
