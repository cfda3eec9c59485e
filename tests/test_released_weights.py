"""The paper's released checkpoints as timm tags: configs, the authors' formats, the pos_embed rules, bad input.

Nothing is downloaded: files in the authors' formats are made here, and the hub download is
replaced by a function that serves them.
"""

import pytest
import timm
import timm.models._builder as timm_builder
import torch
from timm.models import get_pretrained_cfg

from alibi_vit import patch_features
from tests.helpers import TINY, tiny_model

RELEASES = {
    "alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco": "alibi_coco_dv2_vits14_reg4.pth",
    "alibi_vit_small_patch14_reg4_dinov2.dinosaw_imagenet": "alibi_dv2_vits14_reg4.pth",
    "nope_vit_small_patch14_reg4_dinov2.dinosaw_coco": "nope_coco_dv2_vits14_reg4.pth",
    "alibi_vit_small_plus_patch16_dinov3.dinosaw_coco": "alibi_coco_dv3_vits16_plus_reg4.pth",
}


def features(model):
    patch = model.patch_embed.patch_size[0]
    x = torch.randn(1, 3, 3 * patch, 4 * patch, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        return patch_features(model.eval().double(), x)


def meta_format(state):
    """A timm-Eva state_dict written the way Meta's dinov3 code names it (independent of the code under test)."""
    out = {"mask_token": torch.zeros(1, state["cls_token"].shape[-1])}
    for key, value in state.items():
        if key.endswith(".attn.q_bias"):
            stem = key[: -len("q_bias")]
            k_part = torch.randn_like(value)  # masked in Meta's model: must not matter
            out[stem + "qkv.bias"] = torch.cat([value, k_part, state[stem + "v_bias"]])
            out[stem + "qkv.bias_mask"] = torch.cat([torch.ones_like(value), torch.zeros_like(value),
                                                     torch.ones_like(value)])
            continue
        if key.endswith(".attn.v_bias"):
            continue
        key = (key.replace("reg_token", "storage_tokens").replace("gamma_1", "ls1.gamma")
               .replace("gamma_2", "ls2.gamma").replace("mlp.fc1_g.", "mlp.w1.").replace("mlp.fc1_x.", "mlp.w2.")
               .replace("mlp.fc2.", "mlp.w3."))
        out[key] = value
    return out


def release_file(name, tmp_path, with_pos_embed=True):
    """(source model, path) of a release file in the authors' format for the tag ``name``."""
    arch = name.split(".")[0]
    if "dinov3" in arch:
        source = tiny_model(arch, qkv_bias=True, seed=3)
        with torch.no_grad():
            for block in source.blocks:  # float32 values, so a float32 model holds them exactly
                block.attn.q_bias.copy_(torch.randn(block.attn.q_bias.shape))
                block.attn.v_bias.copy_(torch.randn(block.attn.v_bias.shape))
        state = meta_format(source.state_dict())
    else:
        source = tiny_model(arch, seed=3)
        state = dict(source.state_dict())
        assert torch.count_nonzero(state["pos_embed"]) == 0
        if not with_pos_embed:
            del state["pos_embed"]
    path = tmp_path / RELEASES[name]
    torch.save(state, path)
    return source, path


@pytest.mark.parametrize("name,filename", RELEASES.items())
def test_each_release_tag_points_at_the_authors_hub_file(name, filename):
    cfg = get_pretrained_cfg(name)
    assert (cfg.hf_hub_id, cfg.hf_hub_filename) == ("rmdocherty/dino-saw", filename)
    assert name in timm.list_pretrained(name.split(".")[0] + "*")


@pytest.mark.parametrize("arch,default", [
    ("alibi_vit_small_patch14_reg4_dinov2", "timm/vit_small_patch14_reg4_dinov2.lvd142m"),
    ("nope_vit_small_patch14_reg4_dinov2", "timm/vit_small_patch14_reg4_dinov2.lvd142m"),
    ("alibi_vit_small_plus_patch16_dinov3", "timm/vit_small_plus_patch16_dinov3.lvd1689m"),
    ("nope_vit_base_patch16_dinov3", "timm/vit_base_patch16_dinov3.lvd1689m"),
])
def test_the_original_weights_stay_the_default_tag(arch, default):
    assert get_pretrained_cfg(arch).hf_hub_id == default


@pytest.mark.parametrize("name", RELEASES)
def test_hub_download_loads_the_authors_format(name, tmp_path, monkeypatch):
    source, path = release_file(name, tmp_path)
    calls = []

    def fake_hub(model_id, filename, **kwargs):
        calls.append((model_id, filename))
        return torch.load(tmp_path / filename, weights_only=True)

    monkeypatch.setattr(timm_builder, "load_state_dict_from_hf", fake_hub)
    model = timm.create_model(name, pretrained=True, **TINY)
    assert calls == [("rmdocherty/dino-saw", RELEASES[name])]
    if "dinov3" in name:  # Meta's attention has query/value biases: the tag builds them
        assert model.blocks[0].attn.q_bias is not None
    torch.testing.assert_close(features(model), features(source), rtol=0, atol=0)


@pytest.mark.parametrize("with_pos_embed", [True, False])
@pytest.mark.parametrize("name", list(RELEASES)[:3])
def test_local_release_file_with_and_without_pos_embed(name, with_pos_embed, tmp_path):
    source, path = release_file(name, tmp_path, with_pos_embed=with_pos_embed)
    expected = features(source)
    by_overlay = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **TINY)
    torch.testing.assert_close(features(by_overlay), expected, rtol=0, atol=0)
    by_path = timm.create_model(name.split(".")[0], checkpoint_path=str(path), **TINY)
    torch.testing.assert_close(features(by_path), expected, rtol=0, atol=0)
    assert torch.count_nonzero(by_path.pos_embed) == 0 and by_path.pos_embed.shape == source.pos_embed.shape


def test_zero_pos_embed_of_another_grid_is_accepted(tmp_path):
    source, _ = release_file("alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco", tmp_path)
    state = dict(source.state_dict())
    state["pos_embed"] = torch.zeros(1, 16 * 16, state["pos_embed"].shape[-1])  # saved at 224 px
    model = tiny_model()
    model.load_state_dict(state)
    torch.testing.assert_close(features(model), features(source), rtol=0, atol=0)


def test_learned_pos_embed_is_refused_everywhere(tmp_path):
    state = dict(tiny_model().state_dict())
    state["pos_embed"] = torch.randn_like(state["pos_embed"])  # a DINOv2 checkpoint, not a release
    path = tmp_path / "dinov2.pth"
    torch.save(state, path)
    with pytest.raises(ValueError, match="learned .non-zero. pos_embed"):
        tiny_model().load_state_dict(state)
    with pytest.raises(ValueError, match="learned .non-zero. pos_embed"):
        timm.create_model("alibi_vit_small_patch14_reg4_dinov2", checkpoint_path=str(path), **TINY)
    with pytest.raises(ValueError, match="learned .non-zero. pos_embed"):
        timm.create_model("nope_vit_small_patch14_reg4_dinov2.dinosaw_coco", pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(path)), **TINY)


def test_unknown_tag_lists_the_known_tags():
    for name, known in [("alibi_vit_small_patch14_reg4_dinov2.dinosaw", "dinosaw_coco"),
                        ("alibi_vit_small_plus_patch16_dinov3.lvd142m", "lvd1689m")]:
        with pytest.raises(ValueError, match="unknown pretrained tag") as err:
            timm.create_model(name)
        assert known in str(err.value) and name.split(".")[0] + ".dinosaw_coco" in str(err.value)


def test_checkpoint_of_the_other_architecture_names_both(tmp_path):
    dinov3 = meta_format(tiny_model("alibi_vit_small_plus_patch16_dinov3", qkv_bias=True).state_dict())
    with pytest.raises(ValueError, match="DINOv3 .Meta's dinov3 format.*alibi_vit_small_patch14_reg4_dinov2.*DINOv2"):
        tiny_model().load_state_dict(dinov3)
    timm_dinov3 = tiny_model("alibi_vit_small_plus_patch16_dinov3").state_dict()
    with pytest.raises(ValueError, match="DINOv3 .timm Eva format.*DINOv2-architecture"):
        tiny_model().load_state_dict(timm_dinov3)
    dinov2 = timm.create_model("vit_small_patch14_reg4_dinov2", **TINY).state_dict()
    path = tmp_path / "dinov2.safetensors"
    from safetensors.torch import save_file
    save_file(dinov2, str(path))
    with pytest.raises(ValueError, match="DINOv2-style ViT.*alibi_vit_small_plus_patch16_dinov3 is a DINOv3"):
        timm.create_model("alibi_vit_small_plus_patch16_dinov3", pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(path)), **TINY)


@pytest.mark.parametrize("name,with_pos_embed", [("alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco", False),
                                                 ("alibi_vit_small_plus_patch16_dinov3.dinosaw_coco", True)])
def test_create_backbone_loads_release_files_through_the_same_rules(name, with_pos_embed, tmp_path):
    """`alibi-vit --checkpoint` and the probe configs load through create_backbone: a file without pos_embed
    and a Meta-format DINOv3 file load there too, giving the source model's features."""
    from alibi_vit import create_backbone

    source, path = release_file(name, tmp_path, with_pos_embed=with_pos_embed)
    extra = {"qkv_bias": True} if "dinov3" in name else {}
    loaded = create_backbone(name.split(".")[0], checkpoint=path, **TINY, **extra)
    torch.testing.assert_close(features(loaded), features(source), rtol=0, atol=1e-12)
