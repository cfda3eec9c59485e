"""The paper's baselines: blanked channels, transform averaging, the sin-cos position embedding."""

import copy
import math

import pytest
import timm
import torch

from alibi_vit.models.baselines import DIHEDRAL, FLIPS, blank_channels, transform_average
from tests.helpers import TINY, features, tiny_model

PATCH = 14


def dinov2(**kwargs):
    """A tiny plain DINOv2 with a visible learned position embedding (so nothing is equivariant by itself)."""
    model = tiny_model("vit_small_patch14_reg4_dinov2", img_size=4 * PATCH, dynamic_img_size=True, **kwargs)
    with torch.no_grad():
        model.pos_embed.normal_(0, 1.0)
    return model


@pytest.mark.parametrize("make", [dinov2, lambda: tiny_model("alibi_vit_small_plus_patch16_dinov3")])
def test_blanked_channels_are_exactly_zero_and_the_rest_unchanged(make):
    plain = make()
    patch = plain.patch_embed.patch_size[0]
    blanked = blank_channels(copy.deepcopy(plain), [3, 17, 31])
    assert set(blanked.state_dict()) == set(plain.state_dict())  # still a plain timm state_dict
    x = torch.randn(2, 3, 3 * patch, 4 * patch, dtype=torch.float64)
    ref, out = features(plain, x), features(blanked, x)
    assert torch.count_nonzero(out[:, [3, 17, 31]]) == 0
    keep = [c for c in range(ref.shape[1]) if c not in (3, 17, 31)]
    torch.testing.assert_close(out[:, keep], ref[:, keep], rtol=0, atol=0)
    with torch.no_grad():  # prefix tokens untouched, intermediate layers blanked too
        p = plain.num_prefix_tokens
        torch.testing.assert_close(blanked.forward_features(x)[:, :p], plain.forward_features(x)[:, :p], rtol=0, atol=0)
    layer = features(blanked, x, layers=[0])[0]
    assert torch.count_nonzero(layer[:, [3, 17, 31]]) == 0
    torch.testing.assert_close(layer[:, keep], features(plain, x, layers=[0])[0][:, keep], rtol=0, atol=0)


def test_blank_channels_rejects_bad_channels():
    with pytest.raises(ValueError, match=r"channels \[32\] are out of range.*32 feature channels"):
        blank_channels(dinov2(), [0, 32])
    with pytest.raises(ValueError, match="out of range"):
        blank_channels(dinov2(), [-1])
    with pytest.raises(ValueError, match="already"):
        blank_channels(blank_channels(dinov2(), [1]), [2])


def test_registered_blanked_dinov2_blanks_the_papers_channels():
    model = timm.create_model("blanked_vit_small_patch14_reg4_dinov2", depth=1).eval()
    out = features(model, torch.randn(1, 3, 2 * PATCH, 2 * PATCH))
    assert out.shape[1] == 384 and torch.count_nonzero(out[:, [47, 113, 117, 359]]) == 0
    assert torch.count_nonzero(out[:, [46, 48, 358]]) > 0
    with pytest.raises(ValueError, match="out of range"):
        timm.create_model("blanked_vit_small_patch14_reg4_dinov2", **TINY)  # width 32: pass channels=[...]
    small = timm.create_model("blanked_vit_small_patch14_reg4_dinov2", channels=[5], **TINY)
    assert small.blanked_channels.tolist() == [5]
    with pytest.raises(ValueError, match="takes no channels"):
        timm.create_model("tavg_vit_small_patch14_reg4_dinov2", channels=[5], **TINY)


@pytest.mark.parametrize("size", [(4, 4), (3, 5)])
def test_dihedral_average_is_exactly_equivariant(size):
    averaged = transform_average(dinov2())
    x = torch.randn(1, 3, size[0] * PATCH, size[1] * PATCH, dtype=torch.float64)
    base = features(averaged, x)
    for forward, inverse in DIHEDRAL:
        torch.testing.assert_close(features(averaged, forward(x)), forward(base), rtol=0, atol=1e-10)
    plain = dinov2()
    rot = lambda t: torch.rot90(t, 1, dims=(-2, -1))  # noqa: E731
    assert (features(plain, rot(x)) - rot(features(plain, x))).abs().max() > 1e-3  # not so without averaging


def test_average_equals_the_mean_of_inverted_views():
    plain, averaged = dinov2(), transform_average(dinov2(), FLIPS)
    x = torch.randn(1, 3, 3 * PATCH, 4 * PATCH, dtype=torch.float64)
    views = [features(plain, torch.flip(x, dims)).flip(dims) for dims in ((), (-1,), (-2,), (-2, -1))]
    torch.testing.assert_close(features(averaged, x), torch.stack(views).mean(0), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="pairs"):
        transform_average(dinov2(), [lambda t: t])


def test_registered_transform_average_and_its_layers():
    model = timm.create_model("tavg_vit_small_patch14_reg4_dinov2", **TINY).eval().double()
    assert len(model.averaged_transforms) == 8
    x = torch.randn(1, 3, 2 * PATCH, 3 * PATCH, dtype=torch.float64)
    flipped = torch.flip(x, (-1,))
    layer = features(model, x, layers=[0])[0]
    torch.testing.assert_close(features(model, flipped, layers=[0])[0], layer.flip(-1), rtol=0, atol=1e-10)


def test_sincos_position_embedding():
    torch.manual_seed(0)
    learned = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=224, **TINY).pos_embed.detach()
    torch.manual_seed(0)
    model = timm.create_model("sincos_vit_small_patch14_reg4_dinov2", **TINY)
    table = model.pos_embed.detach()[0]
    assert table.shape == (16 * 16, 32) and not model.pos_embed.requires_grad
    torch.testing.assert_close(table.std(), learned.std(), rtol=1e-5, atol=0)
    scale = table[0].abs().max()  # patch (0, 0): sin(0) = 0 and cos(0) = 1 in every band
    assert torch.count_nonzero(table[0]) == 16 and torch.allclose(table[0][table[0] != 0], scale)
    # patch (y=2, x=5), band 0 (frequency 1): the y and x coordinates each have sin and cos channels
    values = sorted(round(v, 5) for v in (table[2 * 16 + 5] / scale).tolist())
    for expected in (math.sin(2.0), math.cos(2.0), math.sin(5.0), math.cos(5.0)):
        assert round(expected, 5) in values
    out = features(model.eval(), torch.randn(1, 3, 5 * PATCH, 4 * PATCH))  # other sizes interpolate the table
    assert out.shape == (1, 32, 5, 4)
