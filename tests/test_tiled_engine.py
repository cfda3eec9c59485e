"""The tiled engine: tiles equal the whole image, training reads only labelled tiles, prediction
streams tile by tile into OME-Zarr / BigTIFF, the feature cache is keyed by tile and bounded.

The whole-image references are computed independently of the engine: the classical filter bank on
the whole scaled image, the classifier on all its pixels, the ViT's whole-image window pass."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tifffile
import zarr
from zarr.storage import LocalStore

from alibi_vit.chunked import open_image
from alibi_vit.trainable import TrainableSegmenter, scribbles, synthetic_micrograph
from alibi_vit.trainable.cache import FeatureCache
from alibi_vit.trainable.classical import classical_features
from alibi_vit.trainable.io import overlay
from alibi_vit.trainable.stream import segment_to_files
from alibi_vit.trainable.tiles import TileGrid
from alibi_vit.trainable.writers import ZarrOutput

from test_chunked_images import CountingStore

SIZE, TILE, CHUNK = 1024, 256, 128
FAST = dict(classifier_params={"n_estimators": 10, "n_jobs": 2})


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 1024² 16-bit micrograph stored as a tiled BigTIFF and an OME-Zarr, a model, and the model's
    probabilities on the whole image computed without the engine (every filter on the whole image)."""
    folder = tmp_path_factory.mktemp("big")
    image, truth = synthetic_micrograph(SIZE, seed=5)
    labels = scribbles(truth, 2, rng=0)
    tifffile.imwrite(folder / "img.tif", image, tile=(CHUNK, CHUNK), bigtiff=True, compression="zlib")
    out = ZarrOutput(folder / "img.ome.zarr", image.shape, image.dtype, CHUNK)
    out.write((slice(0, SIZE), slice(0, SIZE)), image)
    out.finish()
    seg = TrainableSegmenter(**FAST, intensity_range=(float(image.min()), float(image.max())))
    seg.fit([image[:400, :400]], [scribbles(truth[:400, :400], 2, rng=0)])
    x = seg.scale(image)
    feats = classical_features(x, intensity=None, filters=seg.filters)
    proba = seg.model_.predict_proba(np.ascontiguousarray(feats.reshape(-1, feats.shape[-1])))
    return folder, image, labels, seg, x, proba.reshape(SIZE, SIZE, -1).astype(np.float32)


def test_tile_cores_partition_the_array_and_halos_clip_at_its_edges():
    for shape, tile, halo in [((10, 13), 4, 2), ((7, 5, 9), (3, 5, 4), 1), ((6,), 6, 3)]:
        grid = TileGrid(shape, tile, halo)
        owner = np.zeros(shape, int)
        for t in grid:
            owner[t.core] += 1
            for c, o, n in zip(t.core, t.outer, shape):
                assert o.start == max(c.start - halo, 0) and o.stop == min(c.stop + halo, n)
            np.testing.assert_array_equal(np.arange(np.prod(shape)).reshape(shape)[t.outer][t.inner],
                                          np.arange(np.prod(shape)).reshape(shape)[t.core])
        assert (owner == 1).all() and len(grid) == np.prod(grid.counts)
        assert tuple(sum(c) for c in grid.chunks) == tuple(shape)
    grid = TileGrid((10, 13), 4)
    first = grid.ordered((slice(5, 9), slice(0, 2)))
    assert [t.index for t in first[:2]] == [(1, 0), (2, 0)] and len({t.index for t in first}) == len(grid)


@pytest.mark.parametrize("source, out_format", [("img.tif", "bigtiff"), ("img.ome.zarr", "ome-zarr")])
def test_streamed_outputs_equal_the_whole_image(big, tmp_path, source, out_format, monkeypatch):
    folder, image, _, seg, x, ref = big
    tiled = TrainableSegmenter.load(seg.save(tmp_path / "model"))
    tiled.tile = TILE  # 1024² in 16 tiles of 256²
    writes = []
    real_write = ZarrOutput.write
    monkeypatch.setattr(ZarrOutput, "write", lambda self, core, block: (writes.append(block.shape[:2]),
                                                                        real_write(self, core, block))[1])
    result = segment_to_files(tiled, open_image(folder / source), tmp_path / "out", "img", out_format, proba=True,
                              progress=False)
    assert len(writes) == 3 * 16 and max(writes) == (TILE, TILE)  # mask, overlay, proba: one tile at a time
    suffix = ".ome.zarr" if out_format == "ome-zarr" else ".ome.tif"
    mask = open_image(tmp_path / "out" / f"img_mask{suffix}")
    labels = seg.classes_[ref.argmax(-1)]
    np.testing.assert_array_equal(mask.read(), labels)
    np.testing.assert_array_equal(mask.read(level=1), labels[::2, ::2])  # the pyramid keeps labels
    if out_format == "ome-zarr":
        proba = open_image(tmp_path / "out" / "img_proba.ome.zarr").read()
    else:
        proba = np.stack([open_image(tmp_path / "out" / f"img_proba_{c}.ome.tif").read() for c in seg.classes_], -1)
    np.testing.assert_allclose(proba, ref, atol=1e-5, rtol=0)
    shown = open_image(tmp_path / "out" / f"img_overlay{suffix}")
    np.testing.assert_array_equal(shown.read(slice(300, 700), slice(0, 1024)),
                                  overlay(x, labels, 0.4, 3)[300:700])
    np.testing.assert_array_equal(result.counts, [(labels == c).sum() for c in seg.classes_])
    assert result.size == SIZE * SIZE
    assert not any(p.name.startswith(".") for p in (tmp_path / "out").iterdir())  # staging removed


def _chunks_near(rows: slice, cols: slice, halo: int) -> set[str]:
    r = range(max(rows.start - halo, 0) // CHUNK, -(-min(rows.stop + halo, SIZE) // CHUNK))
    c = range(max(cols.start - halo, 0) // CHUNK, -(-min(cols.stop + halo, SIZE) // CHUNK))
    return {f"c/{i}/{j}" for i, j in itertools.product(r, c)}


def test_training_reads_and_featurises_only_around_the_labels(big, tmp_path):
    folder, image, _, seg, _, _ = big
    arr = zarr.create_array(str(tmp_path / "a.zarr"), shape=image.shape, chunks=(CHUNK, CHUNK), dtype=image.dtype)
    arr[:] = image
    truth = synthetic_micrograph(SIZE, seed=5)[1]
    labels = np.zeros_like(truth)  # labels in two tiles only: the top-left and the bottom-right
    labels[10:200:7, 20:240:5] = truth[10:200:7, 20:240:5]
    labels[800:1000:9, 900:1020:3] = truth[800:1000:9, 900:1020:3]
    store = CountingStore(LocalStore(str(tmp_path / "a.zarr"), read_only=True))
    lazy = TrainableSegmenter(**FAST, tile=TILE, intensity_range=seg.intensity_range)
    lazy.fit([open_image(zarr.open_array(store=store, mode="r"))], [labels])
    halo = lazy.halo  # the labels' boxes grown by the halo (their tiles with theirs would be 18 chunks)
    expected = _chunks_near(slice(10, 200), slice(20, 236), halo) | _chunks_near(slice(800, 999), slice(900, 1018),
                                                                                  halo)
    assert set(store.keys) == expected and len(expected) == 15  # of 64 chunks
    whole = TrainableSegmenter(**FAST, tile=TILE, intensity_range=seg.intensity_range).fit([image], [labels])
    probe = image[:300, :300]
    np.testing.assert_array_equal(lazy.predict_proba([probe])[0], whole.predict_proba([probe])[0])


def test_training_range_of_a_chunked_image_is_sampled_and_said(big, tmp_path):
    folder, image, labels, seg, _, _ = big
    truth = synthetic_micrograph(SIZE, seed=5)[1]
    one = np.zeros_like(labels)  # one labelled tile: quick to featurise
    one[:TILE:5, :TILE:5] = truth[:TILE:5, :TILE:5]
    whole = open_image(folder / "img.tif")  # 1 MP: the sample is every tile, the range the whole image's
    expected = TrainableSegmenter(**FAST, tile=TILE).fit([image], [one]).intensity_range
    assert TrainableSegmenter(**FAST, tile=TILE).fit([whole], [one]).intensity_range == expected
    tall = np.concatenate([image, image[::-1]])  # 2 MP: a seeded sample of tiles
    tifffile.imwrite(tmp_path / "tall.tif", tall, tile=(CHUNK, CHUNK))
    tall_labels = np.concatenate([one, np.zeros_like(one)])
    fitted = TrainableSegmenter(**FAST, tile=TILE).fit([open_image(tmp_path / "tall.tif")], [tall_labels])
    assert fitted.intensity_note == f"intensity range fitted on a seeded sample of tiles: 64 of 128 tiles of " \
                                    f"{tmp_path / 'tall.tif'}"
    lo, hi = fitted.intensity_range
    assert tall.min() <= lo < hi <= tall.max()


def test_per_image_modes_of_a_chunked_image_match_the_array_when_the_sample_is_whole(big):
    folder, image, _, _, _, _ = big
    for mode in ("percentile", "minmax", "dtype", "auto"):
        seg = TrainableSegmenter(intensity=mode)
        src = seg.source(open_image(folder / "img.ome.zarr"))
        np.testing.assert_allclose(src.read(slice(0, SIZE), slice(0, SIZE)), seg.scale(image), atol=1e-6, rtol=0)


def test_predict_tiles_gives_the_visible_region_first(big, tmp_path):
    _, image, _, seg, _, _ = big
    tiled = TrainableSegmenter.load(seg.save(tmp_path / "model"))
    tiled.tile = 112
    crop = image[:300, :330]
    whole = seg.predict_proba([crop])[0]
    order = []
    for core, p in tiled.predict_tiles(crop, first=(slice(150, 200), slice(230, 240))):
        order.append((core[0].start, core[1].start))
        np.testing.assert_allclose(p, whole[core], atol=1e-5, rtol=0)
    assert order[0] == (112, 224)  # the one tile on screen, then the others row by row
    assert order[1:] == [(r, c) for r in (0, 112, 224) for c in (0, 112, 224) if (r, c) != (112, 224)]


def test_crf_and_modal_filter_streamed_equal_the_in_memory_prediction(tmp_path):
    crop, truth = synthetic_micrograph(300, seed=2)
    crop, lab = crop[:, :270], scribbles(truth[:, :270], 2, rng=0)
    model = TrainableSegmenter(**FAST, crf="paper", modal=5, tile=112).fit([crop], [lab])
    proba = model.predict_proba([crop])[0]  # tiled CRF: 112-px tiles with 128 px of overlap
    mask = model.predict([crop])[0]
    segment_to_files(model, crop, tmp_path, "c", "ome-zarr", proba=True, overlays=False, progress=False)
    np.testing.assert_allclose(open_image(tmp_path / "c_proba.ome.zarr").read(), proba, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(open_image(tmp_path / "c_mask.ome.zarr").read(), mask)


def test_vit_features_of_tiles_equal_the_whole_images_window_pass():
    import torch.nn.functional as F

    from alibi_vit.models.checkpoint import create_backbone
    from alibi_vit.trainable.vit import vit_patch_features

    image, truth = synthetic_micrograph(200, seed=1)
    image = np.concatenate([image, image[:, :30]], 1)  # 200 × 230: padded to 210 × 238 px
    labels = scribbles(np.concatenate([truth, truth[:, :30]], 1), 2, rng=0)
    for name in ("alibi_vit_small_patch14_reg4_dinov2", "vit_small_patch14_reg4_dinov2"):
        model = create_backbone(name, seed=0, depth=1, embed_dim=32, num_heads=2)
        kw = dict(vit_tile=112, vit_overlap=28, n_components=4, **FAST)  # 8-patch windows, step 6
        seg = TrainableSegmenter(model, tile=56, **kw).fit([image], [labels])
        x = seg.scale(image)
        patches = vit_patch_features(model, x, tile=112, overlap=28)  # the whole-image pass
        z = torch_from(seg.vit.project(patches))
        up = F.interpolate(z[None], scale_factor=14, mode="bilinear", align_corners=False)[0, :, :200, :230]
        vit = seg.features(image)[..., -4:]
        np.testing.assert_allclose(vit, np.moveaxis(up.numpy(), 0, -1), atol=1e-5, rtol=1e-5)


def torch_from(a):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


def test_feature_cache_is_keyed_by_tile_and_bounded(big, tmp_path):
    folder, image, _, seg, _, _ = big
    crop = image[:512, :512]
    tifffile.imwrite(tmp_path / "a.tif", crop, tile=(CHUNK, CHUNK))
    one_tile = TILE * TILE * len(seg.feature_names) * 4
    cache = FeatureCache(max_bytes=2 * one_tile)
    cached = TrainableSegmenter(**FAST, tile=TILE, intensity_range=seg.intensity_range, cache=cache)
    cached.precompute(open_image(tmp_path / "a.tif"))  # 4 tiles, room for 2
    assert cache.misses == 4 and len(cache) == 2 and cache.nbytes <= cache.max_bytes
    cached.precompute(open_image(tmp_path / "a.tif"), first=(slice(300, 301), slice(300, 301)))
    assert cache.hits == 1 and cache.misses == 7  # the last tile was kept; the others were evicted
    tifffile.imwrite(tmp_path / "a.tif", crop[::-1], tile=(CHUNK, CHUNK))  # new pixels, new file identity
    hits = cache.hits
    cached.precompute(open_image(tmp_path / "a.tif"), first=(slice(300, 301), slice(300, 301)))
    assert cache.hits == hits


def test_a_failed_chunk_write_leaves_the_chunk_written_before(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from alibi_vit.trainable.writers import OutputError

    out = ZarrOutput(tmp_path / "m.ome.zarr", (8, 8), np.uint8, 4)
    first = np.arange(16, dtype=np.uint8).reshape(4, 4)
    out.write((slice(0, 4), slice(0, 4)), first)

    def full(self, target):  # the chunk's bytes went to a temporary file; moving it in place fails
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "replace", full)
    with pytest.raises(OutputError, match=r"cannot write .*m\.ome\.zarr: No space left on device"):
        out.write((slice(0, 4), slice(0, 4)), first + 100)
    monkeypatch.undo()
    np.testing.assert_array_equal(open_image(tmp_path / "m.ome.zarr").read(slice(0, 4), slice(0, 4)), first)
    assert not list((tmp_path / "m.ome.zarr").rglob("*.partial"))  # no temporary file left behind


def test_fit_on_the_segmenters_own_sources_equals_fit_on_the_images(big):
    """The app scales each image once and passes the source to every fit: the same model as from the
    images themselves (stored dtype kept); sources are refused where their scaling is not known."""
    folder, image, labels, seg, _, _ = big
    chunked = open_image(folder / "img.ome.zarr")
    ref = TrainableSegmenter(**FAST, tile=TILE, intensity_range=seg.intensity_range).fit([image, chunked],
                                                                                         [labels, labels])
    own = TrainableSegmenter(**FAST, tile=TILE, intensity_range=seg.intensity_range)
    sources = [own.source(image), own.source(chunked)]
    own.fit(sources, [labels, labels])
    assert own.intensity_dtype == ref.intensity_dtype == "uint16" and own.channels_ == ref.channels_ == 1
    probe = image[:300, :300]
    np.testing.assert_array_equal(own.predict_proba([probe])[0], ref.predict_proba([probe])[0])

    with pytest.raises(ValueError, match="fixed intensity_range"):
        TrainableSegmenter(**FAST).fit(sources, [labels, labels])
    lo, hi = seg.intensity_range
    other = TrainableSegmenter(**FAST, intensity_range=(lo, hi + 1))
    with pytest.raises(ValueError, match="not this segmenter's intensity range"):
        other.fit([sources[1]], [labels])
    from alibi_vit.trainable.sources import ArraySource

    with pytest.raises(ValueError, match="made by source"):
        own.fit([ArraySource(sources[0].pixels)], [labels])


def test_labelled_boxes_hold_every_labelled_pixel_once():
    from alibi_vit.trainable.tiles import labelled_boxes

    selected = np.zeros((300, 400), bool)
    selected[10:14, 20:120] = True  # a stroke
    selected[30:34, 20:120] = True  # another 16 px below it: the same box
    selected[250:290, 350:352] = True  # far away: a box of its own
    boxes = labelled_boxes(selected, gap=32)
    assert len(boxes) == 2
    owned = np.zeros(selected.shape, np.int64)
    for box, mine in boxes:
        assert mine.shape == selected[box].shape and not (mine & ~selected[box]).any()
        owned[box] += mine
    np.testing.assert_array_equal(owned, selected.astype(np.int64))
    assert boxes[0][0] == (slice(10, 34), slice(20, 120)) and boxes[1][0] == (slice(250, 290), slice(350, 352))


def test_sparse_strokes_are_featurised_in_boxes_with_the_whole_tiles_result(big, monkeypatch):
    """Training featurises boxes around the strokes (each with the halo) instead of their whole tiles: a
    fraction of the pixels, and the same classifier as fitted on whole tiles (a cache holding every tile, as
    after a prediction, is read instead of computing boxes); boxes are not cached."""
    _, image, _, seg, _, _ = big
    truth = synthetic_micrograph(SIZE, seed=5)[1]
    labels = np.zeros_like(truth)
    labels[100:104, 50:400] = truth[100:104, 50:400]
    labels[600:900, 700:703] = truth[600:900, 700:703]
    labels[300:303, 300:330] = 1
    labels[950:953, 900:1000] = 2
    featurised = []
    real = TrainableSegmenter._classical_tile

    def counting(self, src, tile, cached=True):  # what is computed, not read from the cache
        if not (cached and self.cache is not None and self._classical_key(src, tile) in self.cache):
            featurised.append(int(np.prod([s.stop - s.start for s in tile.outer])))
        return real(self, src, tile, cached)

    monkeypatch.setattr(TrainableSegmenter, "_classical_tile", counting)
    cache = FeatureCache()
    boxed = TrainableSegmenter(**FAST, tile=512, intensity_range=seg.intensity_range, cache=cache)
    boxed.fit([image], [labels])
    grid = boxed.tile_grid(boxed.source(image))
    labelled_tiles = sum(int(np.prod([s.stop - s.start for s in t.outer])) for t in grid if labels[t.core].any())
    assert sum(featurised) < 0.5 * labelled_tiles and len(cache) == 0
    whole = TrainableSegmenter(**FAST, tile=512, intensity_range=seg.intensity_range, cache=FeatureCache())
    whole.precompute(image)
    featurised[:] = []
    whole.fit([image], [labels])
    assert featurised == []  # every labelled tile read from the cache
    probe = image[200:700, 200:700]
    np.testing.assert_array_equal(boxed.predict_proba([probe])[0], whole.predict_proba([probe])[0])


def test_tiles_classified_band_by_band_equal_the_whole_images_features(monkeypatch):
    """Without a cache a tile's features are made pixel-major and classified a band of rows at a time: a colour
    image (every channel's planes), tiles of several bands, parts of tiles, against the classifier on the whole
    image's features."""
    from skimage.data import astronaut

    from alibi_vit.trainable import segmenter as segmenter_module

    monkeypatch.setattr(segmenter_module, "PREDICT_BAND", 48)
    image = astronaut()[:300, :260]
    labels = np.zeros(image.shape[:2], np.uint8)
    labels[20:26, 10:200], labels[150:156, 30:250], labels[270:276, 5:120] = 1, 2, 3
    seg = TrainableSegmenter(**FAST, tile=112).fit([image], [labels])
    x = seg.scale(image)
    feats = np.concatenate([classical_features(x[..., c], intensity=None, filters=seg.filters) for c in range(3)], -1)
    assert feats.shape[-1] == len(seg.feature_names)
    ref = seg.model_.predict_proba(np.ascontiguousarray(feats.reshape(-1, feats.shape[-1]))).reshape(300, 260, 3)
    np.testing.assert_allclose(seg.predict_proba([image])[0], ref, atol=1e-5, rtol=0)
    src = seg.source(image)
    tile = next(t for t in seg.tile_grid(src) if t.core[0].start == 112 and t.core[1].start == 112)
    part = (slice(120, 201), slice(130, 160))  # three bands of 48 rows, the last one short
    np.testing.assert_allclose(seg.tile_proba(src, tile, part), ref[part], atol=1e-5, rtol=0)


def test_training_reads_only_the_label_tiles_that_hold_a_nonzero_value(monkeypatch):
    """An in-memory label image is scanned along its axes first: tiles with nothing but 0 are neither read nor
    checked, and a bad value (negative) in any other tile is still refused."""
    from alibi_vit.trainable import segmenter as segmenter_module

    image, _ = synthetic_micrograph(300, seed=1)
    labels = np.zeros((300, 300), np.int64)
    labels[10:14, 10:60], labels[250:254, 240:260] = 1, 2  # in tiles (0, 0) and (2, 2) of 112 px
    seg = TrainableSegmenter(**FAST, tile=112)
    read = []
    real = segmenter_module.label_region
    monkeypatch.setattr(segmenter_module, "label_region",
                        lambda lab, *region, source: read.append(tuple((s.start, s.stop) for s in region))
                        or real(lab, *region, source=source))
    seg.fit([image], [labels])
    # Rows 0-112 and 224-300 hold labels, and so do the same columns: those four tiles are read, not the others.
    bands = ((0, 112), (224, 300))
    assert set(read) == {(r, c) for r in bands for c in bands}
    labels[150, 120] = -1
    with pytest.raises(ValueError, match="negative values"):
        TrainableSegmenter(**FAST, tile=112).fit([image], [labels])
