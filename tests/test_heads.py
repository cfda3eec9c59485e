"""Attention-head diagnostics (alibi_vit.analysis.heads), the ``alibi-vit heads`` command and the
surgical re-initialisation of sink heads during distillation.

References are computed here independently, in float64, with Python loops over tokens and the
distance written out from docs/method.md §2.
"""

from __future__ import annotations

import csv
import logging
import math

import numpy as np
import pytest
import torch
from timm.layers import Attention

import alibi_vit  # noqa: F401  (registers the models)
from alibi_vit.analysis.heads import (attention_statistics, distance_rows, head_parameter_masks, head_statistics,
                                      reinit_head_parameters)
from alibi_vit.cli import heads as heads_cli
from alibi_vit.cli.main import main
from alibi_vit.models.checkpoint import create_backbone
from kernels.alibi_bias import patch_distances
from tests.helpers import run_subcommand

SMALL = dict(depth=2, embed_dim=32, num_heads=4, init_values=1.0)
ALIBI = "alibi_vit_small_patch14_reg4_dinov2"
DINOV2 = "vit_small_patch14_reg4_dinov2"


def tiny(name=ALIBI, seed=0, **kwargs):
    torch.manual_seed(seed)
    return create_backbone(name, **{**SMALL, **kwargs}).eval().double()


def images(n=2, h=4, w=5, patch=14, seed=0):
    return torch.randn(n, 3, h * patch, w * patch, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- the reference, written out -------------------------------------------------------------------

def distance(a, b, grid, wrap):
    (h, w), (y1, x1), (y2, x2) = grid, divmod(a, grid[1]), divmod(b, grid[1])
    dy, dx = abs(y1 - y2), abs(x1 - x2)
    if wrap:
        dy, dx = min(dy, h - dy), min(dx, w - dx)
    return math.hypot(dy, dx)


def reference_statistics(probs, grid, prefix, wrap):
    """Means over images and patch queries of a (B, heads, N, N) float64 array of attention rows."""
    B, H, N, _ = probs.shape
    out = {k: np.zeros(H) for k in ("prefix_mass", "self_mass", "entropy", "mean_distance")}
    for b in range(B):
        for head in range(H):
            for i in range(N - prefix):
                row = probs[b, head, prefix + i]
                out["prefix_mass"][head] += row[:prefix].sum()
                out["self_mass"][head] += row[prefix + i]
                out["entropy"][head] += -sum(p * math.log(p) for p in row if p > 0) / math.log(N)
                patch = row[prefix:]
                out["mean_distance"][head] += sum(patch[j] * distance(i, j, grid, wrap)
                                                  for j in range(N - prefix)) / patch.sum()
    return {k: v / (B * (N - prefix)) for k, v in out.items()}


@torch.no_grad()
def reference_probabilities(attn, x, grid, wrap, slopes):
    """softmax(q kᵀ/√d + m_h B) in float64 from the layer's weights and input x (B, N, C) (no q/k norm)."""
    B, N, C = x.shape
    H = attn.num_heads
    d = C // H
    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    q, k = qkv[..., :C].reshape(B, N, H, d), qkv[..., C:2 * C].reshape(B, N, H, d)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    if slopes is not None:
        h, w = grid
        d_max = math.hypot(h // 2, w // 2) if wrap else math.hypot(h - 1, w - 1)
        prefix = N - h * w
        bias = torch.zeros(N, N, dtype=torch.float64)
        for i in range(h * w):
            for j in range(h * w):
                bias[prefix + i, prefix + j] = -distance(i, j, grid, wrap) / d_max
        logits = logits + slopes.view(1, -1, 1, 1) * bias
    return logits.softmax(-1)


def attention_inputs(model, x):
    """The input of every attention layer in one forward pass."""
    seen = []
    handles = [b.attn.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach())) for b in model.blocks]
    with torch.no_grad():
        model.forward_features(x)
    for handle in handles:
        handle.remove()
    return seen


# ---- the statistics --------------------------------------------------------------------------------

def test_uniform_attention_has_the_hand_computed_distance_and_entropy():
    """Uniform rows on a 3×3 grid: on the torus every patch has 4 neighbours at 1 and 4 at √2."""
    grid, prefix = (3, 3), 1
    N = prefix + 9
    probs = torch.full((1, 1, 9, N), 1.0 / N, dtype=torch.float64)
    rows = torch.arange(9)
    torus = attention_statistics(probs, rows, grid, prefix, wrap=True)
    assert torus["mean_distance"].item() / 9 == pytest.approx((4 + 4 * math.sqrt(2)) / 9, abs=1e-12)
    assert torus["entropy"].item() / 9 == pytest.approx(1.0, abs=1e-12)
    assert torus["prefix_mass"].item() / 9 == pytest.approx(0.1, abs=1e-12)
    assert torus["self_mass"].item() / 9 == pytest.approx(0.1, abs=1e-12)
    # Plain: centre 4×1 + 4×√2; edge midpoints 3×1 + 2×√2 + 2 + 2×√5; corners 2×1 + √2 + 2×2 + 2×√5 + √8.
    plain = attention_statistics(probs, rows, grid, prefix, wrap=False)
    centre, edge = 4 + 4 * math.sqrt(2), 3 + 2 * math.sqrt(2) + 2 + 2 * math.sqrt(5)
    corner = 2 + math.sqrt(2) + 4 + 2 * math.sqrt(5) + math.sqrt(8)
    assert plain["mean_distance"].item() / 9 == pytest.approx((centre + 4 * edge + 4 * corner) / 81, abs=1e-12)


@pytest.mark.parametrize("wrap", [True, False])
def test_statistics_of_random_rows_match_the_reference(wrap):
    grid, prefix = (3, 4), 2
    N = prefix + 12
    gen = torch.Generator().manual_seed(1)
    probs = (3 * torch.randn(2, 3, N, N, generator=gen, dtype=torch.float64)).softmax(-1)
    probs[0, 1, prefix + 5, 7] = 0.0  # a zero probability: 0·log 0 counts as 0
    probs[0, 1, prefix + 5] /= probs[0, 1, prefix + 5].sum()
    got = attention_statistics(probs[:, :, prefix:], torch.arange(12), grid, prefix, wrap=wrap)
    expected = reference_statistics(probs.numpy(), grid, prefix, wrap)
    for key, value in expected.items():
        np.testing.assert_allclose(got[key].numpy() / got["queries"].numpy(), value, rtol=1e-12, err_msg=key)


@pytest.mark.parametrize("wrap", [True, False])
@pytest.mark.parametrize("metric", ["euclidean", "manhattan"])
def test_distance_rows_are_the_bias_geometry_in_patches(wrap, metric):
    grid = (3, 5)
    rows = distance_rows(grid, torch.tensor([0, 7, 14]), wrap=wrap, metric=metric, dtype=torch.float64)
    full = patch_distances(grid, wrap=wrap, normalize=False, metric=metric, dtype=torch.float64)
    torch.testing.assert_close(rows, full[[0, 7, 14]], rtol=0, atol=0)


@pytest.mark.parametrize("wrap, slopes", [(True, "constant"), (False, "geometric")])
def test_alibi_model_statistics_match_the_float64_reference(wrap, slopes):
    model = tiny(wrap=wrap, slopes=slopes)
    x = images()
    grid, prefix = (4, 5), model.num_prefix_tokens
    inputs = attention_inputs(model, x)
    stats = head_statistics(model, x, max_chunk_elements=500)  # several query chunks per layer
    for layer, (block, inp) in enumerate(zip(model.blocks, inputs)):
        m = block.attn.m.view(-1)
        probs = reference_probabilities(block.attn, inp, grid, wrap, m)
        expected = reference_statistics(probs.numpy(), grid, prefix, wrap)
        for key, value in expected.items():
            np.testing.assert_allclose(getattr(stats, key)[layer].numpy(), value, rtol=1e-9, err_msg=f"{layer} {key}")
        np.testing.assert_allclose(stats.slopes[layer].numpy(), m.numpy())
    assert stats.torus == [wrap, wrap]
    assert stats.position == [f"alibi ({slopes} slopes)"] * 2


def test_dinov2_statistics_match_the_reference_with_plain_distances():
    model = tiny(DINOV2)
    x = images(1)
    inputs = attention_inputs(model, x)
    stats = head_statistics(model, x)
    for layer, (block, inp) in enumerate(zip(model.blocks, inputs)):
        probs = reference_probabilities(block.attn, inp, (4, 5), False, None)
        expected = reference_statistics(probs.numpy(), (4, 5), model.num_prefix_tokens, wrap=False)
        for key, value in expected.items():
            np.testing.assert_allclose(getattr(stats, key)[layer].numpy(), value, rtol=1e-9, err_msg=key)
    assert stats.position == ["learned pos. embedding"] * 2 and stats.torus == [False, False]
    assert torch.isnan(stats.slopes).all()
    assert stats.rows()[0]["slope"] == "" and stats.rows()[0]["distance_on"] == "plain"


@pytest.mark.parametrize("name", ["vit_small_plus_patch16_dinov3", DINOV2])
def test_probabilities_equal_timms_own_eager_attention(name):
    """RoPE (DINOv3) and q/k norms included: the recomputed rows are those timm's eager path builds."""
    model = tiny(name)
    x = images(1, patch=model.patch_embed.patch_size[0])
    rows, handles = [], []
    for block in model.blocks:
        block.attn.fused_attn = False
        handles.append(block.attn.attn_drop.register_forward_hook(lambda m, args, out: rows.append(args[0])))
    with torch.no_grad():
        model.forward_features(x)
    for block, handle in zip(model.blocks, handles):
        block.attn.fused_attn = True
        handle.remove()
    stats = head_statistics(model, x)
    assert len(rows) == len(model.blocks)
    p = model.num_prefix_tokens
    for layer, probs in enumerate(rows):
        got = attention_statistics(probs[:, :, p:], torch.arange(20), (4, 5), p, wrap=False)
        np.testing.assert_allclose(stats.entropy[layer].numpy(), (got["entropy"] / got["queries"]).numpy(),
                                   rtol=1e-10)
        np.testing.assert_allclose(stats.mean_distance[layer].numpy(),
                                   (got["mean_distance"] / got["queries"]).numpy(), rtol=1e-10)


def force_sink(model, layer, head, strength=50.0):
    """Make one head attend to CLS: CLS alone carries channel 0, and this head's q·k reads only channel 0."""
    C = model.embed_dim
    d = C // model.blocks[layer].attn.num_heads
    with torch.no_grad():
        model.cls_token.zero_()
        model.cls_token[..., 0] = 10.0
        model.reg_token[..., 0] = 0.0
        model.patch_embed.proj.weight[0] = 0.0
        model.patch_embed.proj.bias[0] = 0.0
        qkv = model.blocks[layer].attn.qkv
        rows = slice(head * d, (head + 1) * d)
        qkv.weight[rows] = 0.0
        qkv.bias[rows] = 0.0
        qkv.bias[head * d] = 1.0
        qkv.weight[C + head * d: C + (head + 1) * d] = 0.0
        qkv.weight[C + head * d, 0] = strength


def test_a_head_forced_onto_cls_is_the_only_flagged_head():
    model = tiny(img_size=112)
    force_sink(model, layer=0, head=1)
    stats = head_statistics(model, images(2, 8, 8))
    flags = stats.flags()
    assert flags["sink"].nonzero().tolist() == [[0, 1]]
    assert not flags["self"].any() and not flags["local"].any()
    assert stats.prefix_mass[0, 1] > 0.99
    assert stats.sink_heads() == [(0, 1)]


def test_a_fused_only_attention_layer_is_refused_with_the_way_out():
    class FusedOnly(Attention):
        def forward(self, x, attn_mask=None, is_causal=False):
            B, N, C = x.shape
            q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
            return self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))

    model = tiny(DINOV2)
    old = model.blocks[1].attn
    model.blocks[1].attn = FusedOnly(32, num_heads=4, qkv_bias=True).double()
    model.blocks[1].attn.load_state_dict(old.state_dict())
    with pytest.raises(ValueError, match=r"blocks\.1\.attn \(FusedOnly\).*convert_to_alibi"):
        head_statistics(model, images(1))


def test_head_masks_and_reinitialisation_touch_only_the_chosen_heads():
    model = tiny(slopes="learned")
    attn = model.blocks[0].attn
    before = {k: v.clone() for k, v in attn.named_parameters()}
    masks = reinit_head_parameters(attn, [2])
    assert masks.keys() == head_parameter_masks(attn, [2]).keys() == {"qkv.weight", "qkv.bias", "proj.weight", "m"}
    d = 8
    assert masks["qkv.weight"].sum() == 3 * d * 32 and masks["qkv.weight"][[16, 48, 80]].all()
    assert masks["proj.weight"][:, 16:24].all() and masks["proj.weight"].sum() == 32 * d
    for name, param in attn.named_parameters():
        mask = masks.get(name, torch.zeros_like(param, dtype=torch.bool))
        assert torch.equal(param[~mask], before[name][~mask]), name
    assert (attn.proj.weight[:, 16:24] == 0).all() and (attn.qkv.bias[masks["qkv.bias"]] == 0).all()
    assert not torch.equal(attn.qkv.weight[masks["qkv.weight"]], before["qkv.weight"][masks["qkv.weight"]])
    with pytest.raises(ValueError, match="head indices below 4"):
        head_parameter_masks(attn, [4])


# ---- the command -----------------------------------------------------------------------------------

TINY_ARGS = ["--model-arg", "depth=2", "--model-arg", "embed_dim=32", "--model-arg", "num_heads=4"]


def test_heads_command_writes_csv_summary_and_figure(tmp_path, capsys):
    out = tmp_path / "heads.csv"
    assert run_subcommand(heads_cli, ["--model", DINOV2, ALIBI, *TINY_ARGS, "--images", "textures", "--size", "56",
                                      "--out", str(out)]) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 4
    assert {(r["model"], r["layer"], r["head"]) for r in rows} == {(m, str(i), str(j)) for m in (DINOV2, ALIBI)
                                                                   for i in range(2) for j in range(4)}
    alibi = [r for r in rows if r["model"] == ALIBI]
    assert {r["slope"] for r in alibi} == {"1.0"} and {r["distance_on"] for r in alibi} == {"torus"}
    assert {r["weights"] for r in rows} == {"random init"}
    printed = capsys.readouterr().out
    assert "sink" in printed and f"{ALIBI} *" in printed and "learned pos. embedding" in printed
    assert (tmp_path / "heads.png").stat().st_size > 10_000


def test_heads_command_refuses_an_image_smaller_than_a_patch(tmp_path, capsys):
    from PIL import Image

    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.full((40, 40, 3), 128, np.uint8)).save(folder / "fine.png")
    Image.fromarray(np.full((10, 9, 3), 128, np.uint8)).save(folder / "speck.png")
    code = main(["heads", "--model", ALIBI, *TINY_ARGS, "--images", str(folder), "--size", "28",
                 "--out", str(tmp_path / "h.csv")])
    err = capsys.readouterr().err
    assert code == 2
    assert "alibi-vit heads: error: image 'speck'" in err and "10×9 px, smaller than one 14×14-px patch" in err
    assert len(err.strip().splitlines()) == 1 + err.count("note:")
    assert not (tmp_path / "h.csv").exists()


# ---- surgical re-initialisation during distillation ------------------------------------------------

class Snapshots:
    """A Lightning callback that keeps the student's parameters at given global steps (before the step runs)
    and the chosen head's output columns right after the module's own batch-start hook re-initialised them."""

    def __init__(self, steps):
        from lightning.pytorch.callbacks import Callback

        outer = self

        class _Callback(Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                if trainer.global_step in steps:
                    outer.params[trainer.global_step] = {k: v.detach().clone()
                                                         for k, v in module.student.named_parameters()}

            def on_before_backward(self, trainer, module, loss):
                if trainer.global_step == 0:
                    outer.proj_at_start = module.student.blocks[0].attn.proj.weight.detach().clone()

        self.params, self.proj_at_start, self.callback = {}, None, _Callback()


def surgery_module(**reinit):
    from lit_modules.distillation import DistillationModule

    torch.manual_seed(0)
    module = DistillationModule(teacher=DINOV2, student=ALIBI, teacher_pretrained=False,
                                model_kwargs={**SMALL, "img_size": 56}, student_kwargs={"backend": "sdpa"},
                                blank_channels=[], probe_image_size=112, probe_noise_images=0, pca_images=0,
                                lr=1e-2, weight_decay=0.1, reinit_heads=reinit or None)
    force_sink(module.student, layer=0, head=1)
    return module


def test_surgical_phase_trains_only_the_chosen_heads(caplog):
    from lightning.pytorch import Trainer

    module = surgery_module(threshold=0.9, passes=1, steps_per_pass=3)
    initial = {k: v.detach().clone() for k, v in module.student.named_parameters()}
    snaps = Snapshots({3})
    data = torch.utils.data.DataLoader(torch.randn(8, 3, 56, 56, generator=torch.Generator().manual_seed(0)),
                                       batch_size=2)
    trainer = Trainer(max_steps=4, logger=False, enable_checkpointing=False, accelerator="cpu",
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[snaps.callback])
    with caplog.at_level(logging.INFO):
        trainer.fit(module, data)
    masks = {f"blocks.0.attn.{k}": v for k, v in head_parameter_masks(module.student.blocks[0].attn, [1]).items()}
    after = snaps.params[3]  # the surgical pass's 3 steps done, normal distillation not yet
    for name, value in after.items():
        mask = masks.get(name, torch.zeros_like(value, dtype=torch.bool))
        assert torch.equal(value[~mask], initial[name][~mask]), f"{name} changed outside the chosen head"
        if mask.any():
            assert (value[mask] != initial[name][mask]).all() or name == "blocks.0.attn.qkv.bias", name
    assert (snaps.proj_at_start[:, 8:16] == 0).all()  # the chosen head's output columns start at zero
    assert (after["blocks.0.attn.proj.weight"][:, 8:16] != 0).any()  # ...and then train
    # After the pass, normal distillation trains everything again.
    final = dict(module.student.named_parameters())
    assert not torch.equal(final["blocks.1.mlp.fc1.weight"], after["blocks.1.mlp.fc1.weight"])
    logged = caplog.text
    assert "reinit_heads pass 1: re-initialised 1 sink heads, layer.head (prefix mass): 0.1 (" in logged
    assert "reinit_heads pass 1 done at step 3: prefix mass of the re-initialised heads 0.1 " in logged


@pytest.mark.parametrize("options, message", [
    ({"passes": 2}, "needs steps_per_pass"),
    ({"steps_per_pass": 0}, "steps_per_pass must be a positive integer"),
    ({"steps_per_pass": 5, "threshold": 1.5}, r"threshold is a prefix mass in \(0, 1\]"),
    ({"steps_per_pass": 5, "step": 3}, "unknown keys"),
])
def test_bad_reinit_options_are_clear_errors(options, message):
    from lit_modules.distillation import _check_reinit_heads

    with pytest.raises(ValueError, match=message):
        _check_reinit_heads(options)


def test_resuming_inside_a_surgical_pass_continues_it_exactly(tmp_path):
    from lightning.pytorch import Trainer

    # Every batch the same, so that the data order Lightning resumes with cannot matter.
    data = torch.utils.data.DataLoader(torch.randn(1, 3, 56, 56, generator=torch.Generator().manual_seed(0))
                                       .expand(4, -1, -1, -1), batch_size=2)

    def trainer(steps):
        return Trainer(max_steps=steps, logger=False, enable_checkpointing=False, accelerator="cpu",
                       enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)

    whole = surgery_module(passes=1, steps_per_pass=3)
    trainer(4).fit(whole, data)
    first = surgery_module(passes=1, steps_per_pass=3)
    t = trainer(2)
    t.fit(first, data)
    t.save_checkpoint(tmp_path / "mid.ckpt")
    resumed = surgery_module(passes=1, steps_per_pass=3)
    trainer(4).fit(resumed, data, ckpt_path=tmp_path / "mid.ckpt")
    for (name, a), b in zip(whole.student.named_parameters(), resumed.student.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
