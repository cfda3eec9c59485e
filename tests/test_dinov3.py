"""ALiBi/NoPE DINOv3: architecture, RoPE off, any multiple of 16 px, roll equivariance, backends, weights."""

import copy

import pytest
import timm
import torch
from safetensors.torch import save_file

from alibi_vit import convert_to_alibi
from alibi_vit.models.attention import AlibiEvaAttention
from alibi_vit.models.dinov3 import AlibiEva
from alibi_vit.models.names import DINOV3_NAMES
from tests.helpers import TINY, features, shuffle_patches, tiny_model

PATCH = 16
ALIBI_SPLUS = "alibi_vit_small_plus_patch16_dinov3"


@pytest.mark.parametrize("name", DINOV3_NAMES)
def test_every_dinov3_model_builds_with_rope_off(name):
    model = tiny_model(name, depth=1, dtype=torch.float32)
    assert isinstance(model, AlibiEva) and model.rope is None and model.pos_embed is None
    assert model.num_prefix_tokens == 5 and model.patch_embed.patch_size == (PATCH, PATCH)
    assert all(type(b.attn) is AlibiEvaAttention for b in model.blocks)
    assert all(b.attn.use_bias == name.startswith("alibi") for b in model.blocks)
    out = features(model, torch.randn(1, 3, 2 * PATCH, 5 * PATCH))
    assert out.shape == (1, 32, 2, 5) and torch.isfinite(out).all()


@pytest.mark.parametrize("size", ["small", "small_plus"])
def test_architecture_matches_timm_dinov3(size):
    ours = timm.create_model(f"alibi_vit_{size}_patch16_dinov3")
    theirs = timm.create_model(f"vit_{size}_patch16_dinov3")
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert theirs.rope is not None and ours.rope is None


def test_huge_plus_matches_timm_dinov3():
    # DINOv3 H+/16 (timm's vit_huge_plus_patch16_dinov3), two of its 32 blocks to keep the test light
    ours = timm.create_model("alibi_vit_huge_plus_patch16_dinov3", depth=2)
    theirs = timm.create_model("vit_huge_plus_patch16_dinov3", depth=2)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert ours.embed_dim == 1280 and ours.blocks[0].attn.num_heads == 20 and ours.rope is None


@pytest.mark.parametrize("shift", [(1, 0), (2, 3), (-1, 4)])
def test_wrapped_alibi_dinov3_is_exactly_roll_equivariant(shift):
    model = tiny_model(ALIBI_SPLUS)
    x = torch.randn(2, 3, 4 * PATCH, 5 * PATCH, dtype=torch.float64)
    rolled = torch.roll(x, (shift[0] * PATCH, shift[1] * PATCH), (2, 3))
    torch.testing.assert_close(features(model, rolled), torch.roll(features(model, x), shift, (2, 3)),
                               rtol=0, atol=1e-10)


def test_rope_dinov3_and_unwrapped_alibi_are_not_roll_equivariant():
    for model in (tiny_model("vit_small_plus_patch16_dinov3"), tiny_model(ALIBI_SPLUS, wrap=False)):
        x = torch.randn(1, 3, 4 * PATCH, 5 * PATCH, dtype=torch.float64)
        rolled = torch.roll(x, (PATCH, 2 * PATCH), (2, 3))
        assert (features(model, rolled) - torch.roll(features(model, x), (1, 2), (2, 3))).abs().max() > 1e-4


def test_nope_dinov3_is_a_bag_of_patches():
    model = tiny_model("nope_vit_small_patch16_dinov3")
    h, w = 2, 3
    x = torch.randn(1, 3, h * PATCH, w * PATCH, dtype=torch.float64)
    perm = torch.randperm(h * w, generator=torch.Generator().manual_seed(1))
    shuffled = shuffle_patches(x, PATCH, perm)
    torch.testing.assert_close(features(model, shuffled).flatten(2), features(model, x).flatten(2)[:, :, perm],
                               rtol=0, atol=1e-10)


def test_the_bias_is_on_in_every_layer():
    x = torch.randn(1, 3, 3 * PATCH, 4 * PATCH, dtype=torch.float64)
    alibi, nope = tiny_model(ALIBI_SPLUS), tiny_model("nope_vit_small_plus_patch16_dinov3")
    nope.load_state_dict(alibi.state_dict())  # same weights: only the bias differs
    assert (features(alibi, x) - features(nope, x)).abs().max() > 1e-4
    for i in range(len(alibi.blocks)):  # switching it off in any one layer changes the output
        partial = copy.deepcopy(alibi)
        partial.blocks[i].attn.use_bias = False
        assert (features(partial, x) - features(alibi, x)).abs().max() > 1e-6


def test_fused_kernel_agrees_with_sdpa():
    # Under TRITON_INTERPRET (CPU) the fused kernel runs on the interpreter; on a GPU, on the GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fused = tiny_model(ALIBI_SPLUS, backend="triton", slopes="learned", dtype=torch.float32).to(device)
    reference, eager = copy.deepcopy(fused), copy.deepcopy(fused)
    for block_sdpa, block_eager in zip(reference.blocks, eager.blocks):
        block_sdpa.attn.backend, block_eager.attn.backend = "sdpa", "eager"
    x = torch.randn(2, 3, 3 * PATCH, 4 * PATCH, device=device)
    out, ref = fused.forward_features(x), reference.forward_features(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(eager.forward_features(x), ref, rtol=1e-4, atol=1e-5)
    out.square().mean().backward()
    ref.square().mean().backward()
    torch.testing.assert_close(fused.blocks[0].attn.m.grad, reference.blocks[0].attn.m.grad, rtol=1e-3, atol=1e-6)


def test_pretrained_starts_from_dinov3_weights_in_a_local_file(tmp_path):
    torch.manual_seed(1)
    dinov3 = timm.create_model("vit_small_plus_patch16_dinov3", **TINY)
    path = tmp_path / "dinov3.safetensors"
    save_file(dinov3.state_dict(), str(path))
    model = timm.create_model(ALIBI_SPLUS, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    ours, theirs = model.state_dict(), dinov3.state_dict()
    assert set(ours) == set(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)


def test_convert_to_alibi_takes_a_timm_dinov3():
    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_dinov3", **TINY).eval().double()
    keys = set(model.state_dict())
    assert convert_to_alibi(model) is model and isinstance(model, AlibiEva) and model.rope is None
    assert set(model.state_dict()) == keys
    x = torch.randn(1, 3, 3 * PATCH, 4 * PATCH, dtype=torch.float64)
    torch.testing.assert_close(features(model, torch.roll(x, (PATCH, 0), (2, 3))),
                               torch.roll(features(model, x), (1, 0), (2, 3)), rtol=0, atol=1e-10)


def test_non_zero_query_bias_without_a_place_for_it_is_an_error():
    from alibi_vit.models.dinov3 import meta_to_timm

    state = {"storage_tokens": torch.zeros(1, 4, 8), "blocks.0.attn.qkv.bias": torch.ones(24)}
    with pytest.raises(ValueError, match="qkv_bias=True"):
        meta_to_timm(state, qv_bias=False)
    zero = {"storage_tokens": torch.zeros(1, 4, 8), "blocks.0.attn.qkv.bias": torch.cat(
        [torch.zeros(8), torch.ones(8), torch.zeros(8)])}  # only the (ignored) key bias is set
    assert set(meta_to_timm(zero, qv_bias=False)) == {"reg_token"}
    with pytest.raises(ValueError, match="NoPE"):
        timm.create_model("nope_vit_small_patch16_dinov3", wrap=False)
    with pytest.raises(ValueError, match="patch_drop_rate"):
        timm.create_model(ALIBI_SPLUS, patch_drop_rate=0.1, **TINY)
    with pytest.raises(ValueError, match="absolute position embedding"):
        convert_to_alibi(timm.create_model("eva02_tiny_patch14_224", depth=1))
