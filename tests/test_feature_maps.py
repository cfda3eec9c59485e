"""Feature-map figures: PCA, k-means and similarity panels, the grid, and `alibi-vit show`."""

import inspect

import numpy as np
import pytest
import torch
from PIL import Image

import alibi_vit
from alibi_vit.cli import main
from alibi_vit.analysis.feature_maps import (
    COLORBAR_WIDTH, COLUMNS, LABEL_HEIGHT, PAD, PCAColouring, cosine_similarity_map, feature_map_grid, grid_shape,
    kmeans_labels, pca_rgb,
)

TINY = dict(depth=2, embed_dim=48, num_heads=2)
TINY_ARGS = ["--model-arg", "depth=2", "--model-arg", "embed_dim=48", "--model-arg", "num_heads=2"]


def planted(h=8, w=10, c=24, seed=0):
    """Features with four regions of distinct mean vectors (so three principal components carry signal)."""
    g = torch.Generator().manual_seed(seed)
    regions = torch.zeros(h, w, dtype=torch.long)
    regions[:5, 5:], regions[5:7, 5:], regions[7:, 5:] = 1, 2, 3  # sizes 40, 25, 10, 5: a clear size order
    centres = torch.randn(4, c, generator=g) * 3.0
    features = centres[regions].permute(2, 0, 1) + 0.05 * torch.randn(c, h, w, generator=g)
    return features, regions


def test_pca_rgb_shows_planted_regions_as_flat_colours():
    features, regions = planted()
    for standardise in (False, True):
        rgb = pca_rgb(features, standardise=standardise)
        assert rgb.shape == (3, 8, 10) and rgb.min() >= 0 and rgb.max() <= 1
        means = torch.stack([rgb[:, regions == r].mean(1) for r in range(4)])
        within = max(float(rgb[:, regions == r].std(1).max()) for r in range(4))
        between = float(torch.cdist(means, means).masked_fill(torch.eye(4, dtype=bool), 9).min())
        assert between > 5 * within


def test_kmeans_recovers_planted_clusters_ordered_by_size():
    features, regions = planted()
    labels = kmeans_labels(features, k=4)
    assert torch.equal(labels, regions)  # cluster 0 = largest region, 3 = smallest
    assert inspect.signature(kmeans_labels).parameters["n_init"].default == 15  # the paper's setting
    with pytest.raises(ValueError, match="k must be"):
        kmeans_labels(features, k=0)


def test_cosine_similarity_against_a_direct_computation():
    features, regions = planted()
    sim = cosine_similarity_map(features, (1, 2))
    unit = features / features.norm(dim=0, keepdim=True)
    expected = torch.einsum("chw,c->hw", unit, unit[:, 1, 2])
    torch.testing.assert_close(sim, expected, atol=1e-5, rtol=0)
    assert sim[1, 2] == pytest.approx(1.0, abs=1e-6)
    assert sim[regions == 0].min() > sim[regions != 0].max()
    with pytest.raises(ValueError, match="outside"):
        cosine_similarity_map(features, (8, 0))


def test_grid_has_the_documented_layout_and_shows_the_image():
    torch.manual_seed(0)
    models = {name: alibi_vit.create_backbone(name, **TINY).eval()
              for name in ("alibi_vit_small_patch14_reg4_dinov2", "vit_small_patch14_reg4_dinov2")}
    image = torch.rand(3, 56, 84)
    grid = feature_map_grid(models, image, k=3, query=(5, 70))
    # header strip, then per model a name strip over a row of 5 panels; PAD px around everything
    assert grid.shape == (3, LABEL_HEIGHT + 2 * (LABEL_HEIGHT + 56 + PAD) + PAD,
                          PAD + len(COLUMNS) * (84 + PAD) + COLORBAR_WIDTH)
    assert grid_shape(2, (56, 84)) == tuple(grid.shape[1:])
    assert grid.min() >= 0 and grid.max() <= 1
    top, left = 2 * LABEL_HEIGHT, PAD  # first model's image panel; the query cross sits near (5, 70)
    # (labels are drawn through an 8-bit image: half a grey level of rounding)
    torch.testing.assert_close(grid[:, top + 20:top + 56, left:left + 60], image[:, 20:, :60],
                               atol=0.5 / 255 + 1e-6, rtol=0)
    # panels of the two models differ (different architectures, different features)
    second = top + 56 + PAD + LABEL_HEIGHT
    pca_left = PAD + (84 + PAD)
    first_pca = grid[:, top:top + 56, pca_left:pca_left + 84]
    assert not torch.equal(first_pca, grid[:, second:second + 56, pca_left:pca_left + 84])
    # the query cross: red at the query pixel with a white edge, in the image and the similarity panel
    sim_left = PAD + 4 * (84 + PAD)
    red, white = torch.tensor([1.0, 0.1, 0.1]), torch.ones(3)
    for panel_left in (left, sim_left):
        torch.testing.assert_close(grid[:, top + 5, panel_left + 70], red, atol=1 / 255, rtol=0)
        torch.testing.assert_close(grid[:, top + 5 + 2, panel_left + 70 + 3], white, atol=1 / 255, rtol=0)
    # the colour bar right of the similarity panel: viridis from 1 (top, yellow) to 0 (bottom, purple)
    bar = grid[:, top:top + 56, PAD + 5 * (84 + PAD) + 4]
    torch.testing.assert_close(bar[:, 0], torch.tensor([253, 231, 37]) / 255.0, atol=1 / 255, rtol=0)
    torch.testing.assert_close(bar[:, -1], torch.tensor([68, 1, 84]) / 255.0, atol=1 / 255, rtol=0)


def test_joint_pca_gives_the_same_feature_the_same_colour_in_every_image():
    features, regions = planted()
    other = features.clone()
    other[:, regions == 0] = features[:, regions == 1][:, :1]  # image 2: region 0 now looks like region 1
    for standardise in (False, True):
        joint = PCAColouring([features, other], standardise=standardise)
        a, b = joint(features), joint(other)
        # region 1 has the same features in both images: the same colours
        torch.testing.assert_close(a[:, regions == 1], b[:, regions == 1], atol=1e-6, rtol=0)
        # and image 2's region 0 takes region 1's colour
        torch.testing.assert_close(b[:, regions == 0].mean(1), a[:, regions == 1].mean(1), atol=0.05, rtol=0)
    # fitted on one image, it is pca_rgb
    torch.testing.assert_close(PCAColouring(features)(features), pca_rgb(features), atol=0, rtol=0)
    with pytest.raises(ValueError, match="at least one image"):
        PCAColouring([])


def test_show_command_writes_figures_and_tensorboard_images(tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (61, 77, 3), dtype=np.uint8)).save(folder / "odd size.png")
    Image.fromarray(rng.integers(0, 255, (90, 70), dtype=np.uint8)).save(folder / "grey.jpg")
    out, tb = tmp_path / "figures", tmp_path / "tb"
    code = main(["show", "--models", "alibi_vit_small_patch14_reg4_dinov2", "nope_vit_small_patch14_reg4_dinov2",
                 "vit_small_patch14_reg4_dinov2", "--images", str(folder), "--out", str(out), "--size", "56",
                 "--k", "3", "--query", "10", "40", *TINY_ARGS, "--tensorboard", str(tb), "--pca", "per-image"])
    assert code == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["grey.png", "odd_size.png"]
    height, width = grid_shape(3, (56, 56))
    for name in files:
        with Image.open(out / name) as im:
            assert im.size == (width, height) and im.mode == "RGB"
            assert np.asarray(im).std() > 10  # not blank

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb), size_guidance={"images": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["feature_maps/grey", "feature_maps/odd_size"]
    image_event = events.Images("feature_maps/grey")[0]
    assert (image_event.width, image_event.height) == (width, height)


def test_show_on_a_bundled_set_with_a_checkpoint(tmp_path):
    torch.manual_seed(1)
    model = alibi_vit.create_backbone("alibi_vit_small_patch14_reg4_dinov2", **TINY)
    ckpt = tmp_path / "alibi.pth"
    torch.save(model.state_dict(), ckpt)
    out = tmp_path / "figures"
    assert main(["show", "--models", "alibi_vit_small_patch14_reg4_dinov2", "--images", "textures", "--out", str(out),
                 "--size", "42", "--checkpoint", f"alibi_vit_small_patch14_reg4_dinov2={ckpt}", *TINY_ARGS]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["brick.png", "grass.png", "gravel.png"]


def test_show_rejects_sizes_off_the_patch_grid(tmp_path, capsys):
    code = main(["show", "--models", "alibi_vit_small_patch14_reg4_dinov2", "--images", "textures",
                 "--out", str(tmp_path), "--size", "50", *TINY_ARGS])
    assert code == 2 and "multiple of the patch size" in capsys.readouterr().err
