"""The napari widget's engine without napari or Qt (alibi_vit/napari/engine.py): the view's prediction."""

from __future__ import annotations

import numpy as np

from alibi_vit.napari import engine
from alibi_vit.synthetic import synthetic_micrograph
from alibi_vit.trainable import TrainableSegmenter, scribbles
from alibi_vit.trainable.cache import FeatureCache
from alibi_vit.trainable.classical import classical_features


def test_a_view_across_tiles_is_featurised_over_its_own_pixels_and_predicts_as_the_whole_image(monkeypatch):
    """The region on screen spans four tiles; each tile's part is featurised with the filters' reach around it
    only (pixels counted), and its probabilities are the whole image's there. A second prediction of the view
    (a retraining on the same view) reads the parts from the cache."""
    image, truth = synthetic_micrograph(320, phases=3, seed=2)
    seg = TrainableSegmenter(tile=128, cache=FeatureCache(1 << 30), classifier_params={"n_estimators": 4})
    seg.fit([image], [scribbles(truth, 3, rng=0)])
    feats = classical_features(seg.scale(image), intensity=None, filters=seg.filters)  # the whole image's
    expected = seg.model_.predict_proba(feats.reshape(-1, feats.shape[-1])).reshape(320, 320, 3)

    featurised = []
    real = TrainableSegmenter._classical_planes
    monkeypatch.setattr(TrainableSegmenter, "_classical_planes",
                        lambda self, src, tile: featurised.append(tile.outer) or real(self, src, tile))
    region = (slice(100, 180), slice(90, 200))
    got = np.zeros((320, 320, 3), np.float32)
    parts = []
    for part, proba in engine.predict_region(seg, image, region):
        parts.append(part)
        got[part] = proba
    assert len(parts) == 4  # rows 100-128 | 128-180, columns 90-128 | 128-200
    np.testing.assert_allclose(got[region], expected[region], atol=1e-5, rtol=0)
    area = sum((r.stop - r.start) * (c.stop - c.start) for r, c in featurised)
    h = seg.halo
    assert area <= (80 + 4 * h) * (110 + 4 * h)  # the parts and their halos, not four 128² tiles and theirs
    assert all(r.start >= 100 - h and r.stop <= 180 + h and c.start >= 90 - h and c.stop <= 200 + h
               for r, c in featurised)
    featurised.clear()
    list(engine.predict_region(seg, image, region))
    assert featurised == []  # the cache holds the parts


def test_a_scribble_snapshot_is_a_copy_of_the_layer_or_none_when_it_is_empty():
    data = np.zeros((40, 50, 60), np.uint8)
    assert engine.scribble_snapshot(data) is None
    data[3, 10:12, 5], data[30, 2, 40:45] = 1, 2
    snap = engine.scribble_snapshot(data)
    np.testing.assert_array_equal(snap, data)
    assert snap.dtype == data.dtype
    data[20, 20, 20] = 3  # a stroke drawn while the Train runs: not in its snapshot
    assert snap[20, 20, 20] == 0
