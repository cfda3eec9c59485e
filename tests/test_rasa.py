"""RASA plane removal and folding (docs/method.md §8)."""

import pytest
import torch

from alibi_vit import create_backbone, patch_features
from alibi_vit.analysis.rasa import (PROJECTION_KEY, fold_planes, orthogonalize_planes, projection_matrix,
                                     remove_planes)

TINY = dict(depth=2, embed_dim=48, num_heads=2, init_values=1.0)


def test_remove_one_plane_by_hand():
    # plane rows w0 = (2, 0, 0), w1 = (1, 1, 0): Gram–Schmidt gives r = e0, c = e1, so removal keeps only e2
    plane = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    x = torch.tensor([[[3.0, -4.0, 5.0], [1.0, 2.0, -7.0]]])  # (B=1, N=2, C=3)
    expected = torch.tensor([[[0.0, 0.0, 5.0], [0.0, 0.0, -7.0]]])
    torch.testing.assert_close(remove_planes(x, [plane]), expected)


def test_remove_oblique_plane_by_hand():
    # w0 = (1, 1, 0, 0), w1 = (1, 0, 0, 0): r = (1, 1, 0, 0)/√2, c = (1, −1, 0, 0)/√2 → plane = span(e0, e1)
    # w0' = (0, 0, 1, 1): a second plane, rows (0, 0, 1, 1) and (0, 0, 1, 0) → span(e2, e3); all is removed
    p1 = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])[None]
    torch.testing.assert_close(remove_planes(x, [p1]), torch.tensor([[[0.0, 0.0, 3.0, 4.0]]]))
    p2 = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    torch.testing.assert_close(remove_planes(x, [p1, p2]), torch.zeros(1, 1, 4))


def test_sequential_removal_by_hand_order_matters():
    # C = 3, plane 1 = span(e0, e1); plane 2 = span(e1, (e0+e2)/√2) → not orthogonal to plane 1.
    # x = (1, 1, 1): after plane 1 → (0, 0, 1); then plane 2: (0,0,1) − ((0,0,1)·u) u with u = (1,0,1)/√2 →
    # (0,0,1) − (1/√2)(1,0,1)/√2 = (−0.5, 0, 0.5)
    p1 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    p2 = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    x = torch.ones(1, 1, 3)
    torch.testing.assert_close(remove_planes(x, [p1, p2]), torch.tensor([[[-0.5, 0.0, 0.5]]]))
    # the other order: plane 2 first → (1,1,1) − (1)e1 − (√2)(1,0,1)/√2 = (0, 0, 0)
    torch.testing.assert_close(remove_planes(x, [p2, p1]), torch.zeros(1, 1, 3))
    # L = (I − P2)(I − P1) agrees with the hand result (x Lᵀ) and is not symmetric
    L = projection_matrix([p1, p2])
    torch.testing.assert_close((x.double() @ L.T).float(), torch.tensor([[[-0.5, 0.0, 0.5]]]))
    assert not torch.allclose(L, L.T)


def test_channel_first_maps_and_matrix_agree():
    g = torch.Generator().manual_seed(0)
    planes = [torch.randn(2, 16, generator=g) for _ in range(3)]
    maps = torch.randn(2, 16, 3, 5, generator=g, dtype=torch.float64)
    L = projection_matrix(planes)
    tokens = maps.flatten(2).transpose(1, 2)  # (B, N, C)
    expected = (tokens @ L.T).transpose(1, 2).reshape(maps.shape)
    torch.testing.assert_close(remove_planes(maps, planes), expected)
    torch.testing.assert_close(remove_planes(tokens, torch.stack(planes)), tokens @ L.T)


def test_orthogonal_to_every_plane():
    g = torch.Generator().manual_seed(1)
    raw = [torch.randn(2, 24, generator=g, dtype=torch.float64) for _ in range(4)]
    x = torch.randn(3, 10, 24, generator=g, dtype=torch.float64)
    # the last plane is always removed exactly
    assert (remove_planes(x, raw) @ raw[-1].T).abs().max() < 1e-10
    planes = orthogonalize_planes(raw)
    out = remove_planes(x, planes)
    for plane in planes + [raw[0]]:  # raw[0] spans the same plane as planes[0]
        assert (out @ plane.T).abs().max() < 1e-10
    # orthogonalising keeps each plane's part outside the earlier planes: same result as the raw removal
    # when the input already lies outside the earlier planes
    clean = remove_planes(x, raw[:1])
    outside = raw[1] - (raw[1] @ planes[0].T) @ planes[0]
    torch.testing.assert_close(remove_planes(clean, planes[1:2]), remove_planes(clean, [outside]))


@pytest.mark.parametrize("bad, match", [
    ([torch.randn(2, 7)], "width 7"),
    ([torch.randn(3, 8)], r"\(2, C\)"),
    ([torch.tensor([[1.0, 2.0] + [0.0] * 6, [2.0, 4.0] + [0.0] * 6])], "parallel"),
    ([torch.zeros(2, 8)], "rank < 2"),
    ([torch.full((2, 8), float("nan"))], "non-finite"),
])
def test_bad_planes(bad, match):
    with pytest.raises(ValueError, match=match):
        remove_planes(torch.randn(1, 4, 8), bad)


def test_bad_features():
    with pytest.raises(ValueError, match=r"\(B, C, h, w\) or \(B, N, C\)"):
        remove_planes(torch.randn(4, 8), [torch.randn(2, 8)])


def _overlapping_planes(g, n=3, width=48):
    """Planes inside one 4-dimensional subspace: far from orthogonal, so L = (I − P_3)(I − P_2)(I − P_1) is
    clearly not symmetric and a transposed fold (x L instead of x Lᵀ) gives other features."""
    basis = torch.eye(width)[:4] + 0.1 * torch.randn(4, width, generator=g)
    return [torch.randn(2, 4, generator=g) @ basis for _ in range(n)]


def _model(name="vit_small_patch14_reg4_dinov2", **kwargs):
    torch.manual_seed(0)
    return create_backbone(name, **TINY, **kwargs).eval().double()


@pytest.mark.parametrize("name", ["vit_small_patch14_reg4_dinov2", "alibi_vit_small_patch14_reg4_dinov2",
                                  "nope_vit_small_patch14_reg4_dinov2", "vit_small_patch16_dinov3",
                                  "alibi_vit_small_patch16_dinov3"])
def test_fold_equals_removal_on_patch_tokens(name):
    model = _model(name)
    g = torch.Generator().manual_seed(2)
    planes = _overlapping_planes(g)
    L = projection_matrix(planes)
    assert (L - L.T).abs().max() > 0.1
    patch = model.patch_embed.patch_size[0]
    x = torch.randn(2, 3, 2 * patch, 3 * patch, generator=g, dtype=torch.float64)
    with torch.no_grad():
        folded = fold_planes(model, planes)
        assert type(folded) is type(model)
        assert folded_ok(folded)
        got = patch_features(folded, x)
        ref = patch_features(model, x)  # the original is untouched (fold_planes copies)
        torch.testing.assert_close(got, remove_planes(ref, planes), rtol=1e-5, atol=1e-5)
        transposed = remove_planes(ref, planes).flatten(2).transpose(1, 2)
        wrong = ref.flatten(2).transpose(1, 2) @ L.to(ref.dtype)  # the reference code's x L
        assert (transposed - wrong).abs().max() > 1e-2
        # CLS and register tokens untouched, patch tokens as x Lᵀ
        tokens, tokens_ref = folded.forward_features(x), model.forward_features(x)
        p = model.num_prefix_tokens
        torch.testing.assert_close(tokens[:, :p], tokens_ref[:, :p], rtol=0, atol=0)
        torch.testing.assert_close(tokens[:, p:], tokens_ref[:, p:] @ L.T, rtol=1e-5, atol=1e-5)


def folded_ok(model):
    return PROJECTION_KEY in model.state_dict()


@pytest.mark.parametrize("name", ["vit_small_patch14_reg4_dinov2", "alibi_vit_small_patch16_dinov3"])
def test_fold_twice_composes_and_state_dict_loads_back(tmp_path, name):
    model = _model(name)
    g = torch.Generator().manual_seed(3)
    planes = _overlapping_planes(g)
    folded = fold_planes(fold_planes(model, planes[:1]), planes[1:])
    patch = model.patch_embed.patch_size[0]
    x = torch.randn(1, 3, 2 * patch, 2 * patch, generator=g, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(patch_features(folded, x), remove_planes(patch_features(model, x), planes),
                                   rtol=1e-5, atol=1e-5)
    state = folded.state_dict()
    assert set(state) - set(model.state_dict()) == {PROJECTION_KEY}
    path = tmp_path / "rasa.pth"
    torch.save({k: v.float() for k, v in state.items()}, path)
    # every command builds through create_backbone: it folds the file's matrix
    loaded = create_backbone(name, checkpoint=path, **TINY).eval().double()
    torch.testing.assert_close(loaded.state_dict()[PROJECTION_KEY].float(), state[PROJECTION_KEY].float())
    with torch.no_grad():
        torch.testing.assert_close(patch_features(loaded, x), patch_features(folded, x), rtol=1e-5, atol=1e-5)
    # a projection of the wrong width is a shape mismatch, named
    torch.save({**{k: v.float() for k, v in state.items()}, PROJECTION_KEY: torch.eye(7)}, path)
    with pytest.raises(ValueError, match=PROJECTION_KEY):
        create_backbone(name, checkpoint=path, **TINY)


def test_fold_rejects_wrong_width():
    with pytest.raises(ValueError, match="width 40"):
        fold_planes(_model(), [torch.randn(2, 40)])
