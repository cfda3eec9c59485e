"""ALiBi/NoPE ViTs: registration, conversion, variable sizes, equivariance, slopes, jitter, checkpoints."""

import copy

import pytest
import timm
import torch
from safetensors.torch import save_file

import alibi_vit
from alibi_vit import MODEL_NAMES, convert_to_alibi, convert_to_nope, create_backbone, patch_features
from alibi_vit.models.names import DINOV2_NAMES
from alibi_vit.models.names import DINOV3_NAMES
from tests.helpers import TINY, features, shuffle_patches, tiny_model

PATCH = 14


@pytest.mark.parametrize("name", DINOV2_NAMES)
def test_every_registered_model_builds_and_runs(name):
    model = tiny_model(name, depth=1, dtype=torch.float32)
    assert name in timm.list_models("*_patch14_reg4_dinov2")
    assert model.num_prefix_tokens == 5
    out = features(model, torch.randn(1, 3, 2 * PATCH, 3 * PATCH))
    assert out.shape == (1, 32, 2, 3)


def test_model_names_list_dinov2_and_dinov3_models():
    assert MODEL_NAMES == DINOV2_NAMES + DINOV3_NAMES
    assert all(timm.is_model(name) for name in MODEL_NAMES)


def test_architecture_matches_dinov2_small():
    ours = timm.create_model("alibi_vit_small_patch14_reg4_dinov2")
    theirs = timm.create_model("vit_small_patch14_reg4_dinov2")
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    assert ours.blocks[0].attn.num_heads == 6 and ours.blocks[0].attn.head_dim == 64


@pytest.mark.parametrize("shift", [(1, 0), (2, 3), (-1, 4)])
def test_wrapped_alibi_model_is_exactly_roll_equivariant(shift):
    model = tiny_model()
    x = torch.randn(2, 3, 4 * PATCH, 5 * PATCH, dtype=torch.float64)
    rolled = torch.roll(x, (shift[0] * PATCH, shift[1] * PATCH), (2, 3))
    torch.testing.assert_close(features(model, rolled), torch.roll(features(model, x), shift, (2, 3)),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("model_fn", [
    lambda: tiny_model(wrap=False),
    lambda: tiny_model("vit_small_patch14_reg4_dinov2", img_size=4 * PATCH, dynamic_img_size=True),
])
def test_models_with_absolute_position_are_not_roll_equivariant(model_fn):
    model = model_fn()
    with torch.no_grad():  # give the plain ViT a position embedding large enough to matter
        if type(model).__name__ == "VisionTransformer":
            model.pos_embed.normal_(0, 1.0)
    x = torch.randn(1, 3, 4 * PATCH, 5 * PATCH, dtype=torch.float64)
    rolled = torch.roll(x, (PATCH, 2 * PATCH), (2, 3))
    diff = (features(model, rolled) - torch.roll(features(model, x), (1, 2), (2, 3))).abs().max()
    assert diff > 1e-4


def test_nope_model_is_a_bag_of_patches():
    model = tiny_model("nope_vit_small_patch14_reg4_dinov2")
    h, w = 3, 4
    x = torch.randn(1, 3, h * PATCH, w * PATCH, dtype=torch.float64)
    perm = torch.randperm(h * w, generator=torch.Generator().manual_seed(1))
    shuffled = shuffle_patches(x, PATCH, perm)
    f, g = features(model, x).flatten(2), features(model, shuffled).flatten(2)
    torch.testing.assert_close(g, f[:, :, perm], rtol=0, atol=1e-10)


@pytest.mark.parametrize("size", [(PATCH, PATCH), (2 * PATCH, 7 * PATCH), (5 * PATCH, 3 * PATCH)])
def test_any_multiple_of_the_patch_size_works(size):
    model = tiny_model(dtype=torch.float32)
    out = features(model, torch.randn(2, 3, *size))
    assert out.shape == (2, 32, size[0] // PATCH, size[1] // PATCH)
    assert torch.isfinite(out).all()


def test_image_size_not_divisible_by_patch_is_a_clear_error():
    model = tiny_model(dtype=torch.float32)
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        patch_features(model, torch.randn(1, 3, 30, 28))
    with pytest.raises(ValueError, match="channels"):
        patch_features(model, torch.randn(1, 1, 28, 28))
    with pytest.raises(ValueError, match="batch, channels, height, width"):
        patch_features(model, torch.randn(3, 28, 28))


def test_backends_agree_inside_the_model():
    model = tiny_model(dtype=torch.float32, backend="eager")
    x = torch.randn(2, 3, 3 * PATCH, 4 * PATCH)
    ref = features(model, x)
    sdpa = copy.deepcopy(model)
    for block in sdpa.blocks:
        block.attn.backend = "sdpa"
    torch.testing.assert_close(features(sdpa, x), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch,prefix", [
    (dict(model_name="vit_small_patch16_224", class_token=True), 1),  # DINO / DeiT layout
    (dict(model_name="vit_base_patch16_224", class_token=True), 1),  # MAE layout
    (dict(model_name="vit_small_patch16_224", class_token=False, global_pool="avg"), 0),  # no prefix tokens
    (dict(model_name="vit_small_patch14_reg4_dinov2"), 5),
])
def test_convert_any_timm_vit(arch, prefix):
    torch.manual_seed(0)
    model = timm.create_model(**arch, depth=2, embed_dim=32, num_heads=2, init_values=1.0, img_size=64 if "16" in
                              arch["model_name"] else 56).eval().double()
    patch = model.patch_embed.patch_size[0]
    keys_before = set(model.state_dict())
    assert convert_to_alibi(model) is model
    assert model.num_prefix_tokens == prefix
    assert not model.pos_embed.requires_grad and torch.count_nonzero(model.pos_embed) == 0
    assert set(model.state_dict()) == keys_before  # still a plain timm state_dict
    x = torch.randn(1, 3, 3 * patch, 5 * patch, dtype=torch.float64)
    before = features(model, x)
    with torch.no_grad():  # whatever sits in pos_embed is never added
        model.pos_embed.normal_()
    torch.testing.assert_close(features(model, x), before, rtol=0, atol=0)
    torch.testing.assert_close(features(model, torch.roll(x, (patch, 2 * patch), (2, 3))),
                               torch.roll(before, (1, 2), (2, 3)), rtol=0, atol=1e-10)


def test_convert_rejects_non_vit_and_attention_dropout():
    with pytest.raises(TypeError, match="VisionTransformer"):
        convert_to_alibi(torch.nn.Linear(2, 2))
    model = timm.create_model("vit_small_patch14_reg4_dinov2", depth=1, attn_drop_rate=0.1)
    with pytest.raises(ValueError, match="attention dropout"):
        convert_to_alibi(model)


def test_slope_schemes():
    learned = tiny_model(slopes="learned", dtype=torch.float32)
    keys = [k for k in learned.state_dict() if k.endswith("attn.m")]
    assert keys == ["blocks.0.attn.m", "blocks.1.attn.m"]
    assert learned.blocks[0].attn.m.shape == (2, 1, 1) and learned.blocks[0].attn.m.requires_grad
    patch_features(learned, torch.randn(1, 3, 3 * PATCH, 3 * PATCH)).square().mean().backward()
    assert learned.blocks[0].attn.m.grad.abs().sum() > 0
    constant = tiny_model(dtype=torch.float32)
    assert not any(k.endswith("attn.m") for k in constant.state_dict())
    geometric = tiny_model(slopes="geometric", num_heads=4, dtype=torch.float32)
    torch.testing.assert_close(geometric.blocks[0].attn.m.view(-1), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]))
    # learned_random: trainable, starting uniform in [0, 1) as the authors' learned slopes (torch.rand), seeded
    rand_a = tiny_model(slopes="learned_random", num_heads=4, dtype=torch.float32, seed=3)
    rand_b = tiny_model(slopes="learned_random", num_heads=4, dtype=torch.float32, seed=3)
    m = rand_a.blocks[0].attn.m
    assert m.requires_grad and m.shape == (4, 1, 1) and ((m >= 0) & (m < 1)).all() and m.unique().numel() == 4
    torch.testing.assert_close(rand_b.blocks[0].attn.m, m)
    assert not torch.equal(rand_a.blocks[1].attn.m, m)  # every layer draws its own
    assert not torch.equal(tiny_model(slopes="learned_random", num_heads=4, dtype=torch.float32, seed=4)
                           .blocks[0].attn.m, m)
    with pytest.raises(ValueError, match="slope scheme"):
        tiny_model(slopes="random")
    with pytest.raises(ValueError, match="backend"):
        tiny_model(backend="cuda-magic")


def test_slopes_change_the_output():
    x = torch.randn(1, 3, 3 * PATCH, 4 * PATCH, dtype=torch.float64)
    a = features(tiny_model(), x)
    b = features(tiny_model(slopes="geometric"), x)
    assert (a - b).abs().max() > 1e-4


def test_jitter_is_off_by_default_and_seeded_when_on():
    x = torch.randn(1, 3, 3 * PATCH, 4 * PATCH, dtype=torch.float64)
    plain = tiny_model()
    assert all(b.attn.jitter == 0 for b in plain.blocks)
    torch.testing.assert_close(features(plain, x), features(plain, x), rtol=0, atol=0)
    jit_a, jit_b = tiny_model(jitter=0.1, jitter_seed=3), tiny_model(jitter=0.1, jitter_seed=3)
    first = features(jit_a, x)
    torch.testing.assert_close(first, features(jit_b, x), rtol=0, atol=0)  # same seed, same noise
    assert (first - features(jit_a, x)).abs().max() > 0  # fresh noise on the next call
    assert (first - features(plain, x)).abs().max() > 0
    with pytest.raises(ValueError, match="jitter"):
        tiny_model(jitter=-1.0)


def test_release_checkpoint_round_trip(tmp_path):
    for kwargs in ({}, {"slopes": "learned"}):
        model = tiny_model(dtype=torch.float32, **kwargs)
        if "slopes" in kwargs:
            with torch.no_grad():
                for b in model.blocks:
                    b.attn.m.uniform_(0.5, 2.0)
        path = tmp_path / "alibi.safetensors"
        save_file(model.state_dict(), str(path))
        loaded = timm.create_model("alibi_vit_small_patch14_reg4_dinov2", checkpoint_path=str(path),
                                   **TINY, **kwargs).eval()
        x = torch.randn(1, 3, 3 * PATCH, 4 * PATCH)
        torch.testing.assert_close(features(loaded, x), features(model, x), rtol=0, atol=0)
        again = create_backbone("alibi_vit_small_patch14_reg4_dinov2", checkpoint=path, **TINY, **kwargs).eval()
        torch.testing.assert_close(features(again, x), features(model, x), rtol=0, atol=0)


def test_mismatched_checkpoint_lists_the_keys(tmp_path):
    state = tiny_model(dtype=torch.float32, slopes="learned").state_dict()
    state["extra.weight"] = torch.zeros(1)
    del state["norm.bias"]
    path = tmp_path / "bad.pth"
    torch.save(state, path)
    with pytest.raises(ValueError) as err:
        create_backbone("alibi_vit_small_patch14_reg4_dinov2", checkpoint=path, **TINY)
    message = str(err.value)
    assert "missing keys (1): norm.bias" in message
    assert "extra.weight" in message and "blocks.0.attn.m" in message and str(path) in message
    with pytest.raises(FileNotFoundError):
        create_backbone("alibi_vit_small_patch14_reg4_dinov2", checkpoint=tmp_path / "nope.pth", **TINY)
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot read checkpoint"):
        create_backbone("alibi_vit_small_patch14_reg4_dinov2", checkpoint=tmp_path / "junk.pth", **TINY)


def test_pretrained_loads_dinov2_weights_from_a_local_file(tmp_path):
    torch.manual_seed(1)
    dinov2 = timm.create_model("vit_small_patch14_reg4_dinov2", **TINY)
    path = tmp_path / "dinov2.safetensors"
    save_file(dinov2.state_dict(), str(path))
    alibi = timm.create_model("alibi_vit_small_patch14_reg4_dinov2", pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    ours, theirs = alibi.state_dict(), dinov2.state_dict()
    assert set(ours) == set(theirs)
    for key in theirs:
        if key == "pos_embed":
            assert torch.count_nonzero(ours[key]) == 0 and torch.count_nonzero(theirs[key]) > 0
        else:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)


def test_intermediate_layers():
    model = tiny_model(depth=3)
    x = torch.randn(1, 3, 2 * PATCH, 3 * PATCH, dtype=torch.float64)
    with torch.no_grad():
        layers = patch_features(model, x, layers=[0, -1])
        final = patch_features(model, x)
    assert set(layers) == {0, -1} and layers[0].shape == final.shape
    torch.testing.assert_close(layers[-1], final)  # last block + final norm = forward_features
    assert (layers[0] - final).abs().max() > 1e-6
    with pytest.raises(ValueError, match="out of range"):
        patch_features(model, x, layers=[3])


def test_nope_twin_takes_no_position_options():
    with pytest.raises(ValueError, match="NoPE"):
        timm.create_model("nope_vit_small_patch14_reg4_dinov2", wrap=False)
    model = convert_to_nope(timm.create_model("vit_small_patch14_reg4_dinov2", depth=1))
    assert not model.blocks[0].attn.use_bias
    assert alibi_vit.AlibiVisionTransformer is type(model)


def test_whole_model_compiles_into_one_graph_with_the_fused_kernel():
    # Under TRITON_INTERPRET (CPU) the fused kernel runs on the interpreter; on a GPU, on the GPU.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fused = tiny_model(backend="triton", slopes="learned", dtype=torch.float32).to(device)
    reference = copy.deepcopy(fused)
    for block in reference.blocks:
        block.attn.backend = "eager"
    x = torch.randn(2, 3, 3 * PATCH, 4 * PATCH, device=device)
    compiled = torch.compile(fused.forward_features, fullgraph=True, backend="aot_eager")
    out, ref = compiled(x), reference.forward_features(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    out.square().mean().backward()
    ref.square().mean().backward()
    torch.testing.assert_close(fused.blocks[0].attn.m.grad, reference.blocks[0].attn.m.grad, rtol=1e-3, atol=1e-6)
