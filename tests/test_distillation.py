"""Distillation job: module semantics, the demo config end to end, DDP equivalence, resume, export.

Everything runs on CPU with 2-block, width-48 models so the whole file takes well under a minute
or two on two cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import alibi_vit  # noqa: F401  (registers the ALiBi models with timm)
from alibi_vit import patch_features
pytest.importorskip("jsonargparse", reason="the lightning CLI needs jsonargparse (the GPU image lacks it)")
from lit_modules.cli import cli, main, newest_resume_checkpoint  # noqa: E402
from alibi_vit.analysis.feature_maps import shared_pca_rgb  # noqa: E402
from lit_modules.distillation import KNOWN_BLANK_CHANNELS, DistillationModule, cosine_distance  # noqa: E402
from lit_modules.export import export_student  # noqa: E402
from tests.helpers import benchmark_module  # noqa: E402

# In-process CLI runs see pytest's own argv too; Lightning warns about that, harmlessly.
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
TINY = {"depth": 2, "embed_dim": 48, "num_heads": 2}
TEACHER = "vit_small_patch14_reg4_dinov2"
STUDENT = "alibi_vit_small_patch14_reg4_dinov2"


def tiny_module(**overrides) -> DistillationModule:
    kwargs = dict(teacher=TEACHER, student=STUDENT, teacher_pretrained=False, model_kwargs=TINY,
                  student_kwargs={"backend": "sdpa"}, blank_channels=[5, 47], probe_image_size=56,
                  probe_fraction=0.25, probe_repeats=2, probe_noise_images=1, pca_images=1)
    kwargs.update(overrides)
    torch.manual_seed(0)
    return DistillationModule(**kwargs)


def images(n=2, size=28, seed=0):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def load_step(path):
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def scalars(run_dir, tag):
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def fit(run_dir, *overrides):
    """Run ``lightning fit`` on the demo config in-process and return the CLI object."""
    return cli(["fit", "--config", DEMO, f"--run_dir={run_dir}", "--trainer.enable_progress_bar=false",
                *overrides])


# -- the module itself ----------------------------------------------------------------------------

def test_loss_is_mean_one_minus_cosine_per_patch():
    gen = torch.Generator().manual_seed(1)
    s, t = torch.randn(2, 5, 3, 4, generator=gen), torch.randn(2, 5, 3, 4, generator=gen)
    a, b = s.numpy(), t.numpy()
    expected = np.mean([1 - a[i, :, y, x] @ b[i, :, y, x] / np.linalg.norm(a[i, :, y, x]) / np.linalg.norm(b[i, :, y, x])
                        for i in range(2) for y in range(3) for x in range(4)])
    assert cosine_distance(s, t).item() == pytest.approx(expected, rel=1e-5)
    assert cosine_distance(s, 3.0 * s).item() == pytest.approx(0.0, abs=1e-6)  # scale-free
    assert cosine_distance(s, -s).item() == pytest.approx(2.0, abs=1e-6)


def test_target_is_teacher_patch_tokens_with_blanked_channels():
    module = tiny_module(blank_channels=[5, 47])
    x = images()
    target = module.teacher_targets(x)
    with torch.no_grad():
        tokens = module.teacher.forward_features(x)[:, module.teacher.num_prefix_tokens:]  # CLS/registers dropped
    reference = tokens.reshape(2, 2, 2, 48).permute(0, 3, 1, 2)
    assert target.shape == (2, 48, 2, 2)
    assert torch.all(target[:, [5, 47]] == 0)
    keep = [c for c in range(48) if c not in (5, 47)]
    torch.testing.assert_close(target[:, keep], reference[:, keep])
    assert not target.requires_grad


def test_teacher_frozen_out_of_state_dict_and_student_pos_embed_frozen():
    module = tiny_module()
    module.train()
    assert not module.teacher.training  # stays in eval when Lightning calls train()
    assert all(not p.requires_grad for p in module.teacher.parameters())
    assert set(module.state_dict()) == {f"student.{k}" for k in module.student.state_dict()}
    assert not any(n.startswith("teacher") for n, _ in module.named_parameters())

    # Started from the teacher's weights, except the position embedding, which is zero and frozen.
    torch.testing.assert_close(module.student.blocks[1].mlp.fc2.weight, module.teacher.blocks[1].mlp.fc2.weight)
    assert torch.count_nonzero(module.teacher.pos_embed) > 0
    assert torch.count_nonzero(module.student.pos_embed) == 0 and not module.student.pos_embed.requires_grad

    optimizer = module.configure_optimizers()
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in module.student.parameters() if p.requires_grad}
    assert id(module.student.pos_embed) not in in_optimizer
    module.distillation_loss(images()).backward()
    assert all(p.grad is None for p in module.teacher.parameters())
    assert module.student.blocks[0].attn.qkv.weight.grad is not None


def test_learned_slopes_student_starts_from_teacher():
    module = tiny_module(student_kwargs={"backend": "sdpa", "slopes": "learned"})
    m = module.student.blocks[0].attn.m
    assert isinstance(m, torch.nn.Parameter) and torch.all(m == 1)
    torch.testing.assert_close(module.student.blocks[0].attn.qkv.weight, module.teacher.blocks[0].attn.qkv.weight)


def test_bad_configuration_errors(tmp_path):
    with pytest.raises(ValueError, match=r"blank_channels \[359\].*0\.\.47"):
        tiny_module(blank_channels=[47, 359])
    with pytest.raises(ValueError, match="channels"):
        tiny_module(student_kwargs={"backend": "sdpa", "embed_dim": 64})
    # init_from is loaded strictly: a partial state_dict is an error that lists the missing keys.
    torch.save({"cls_token": torch.zeros(1, 1, 48)}, tmp_path / "partial.pth")
    with pytest.raises(ValueError, match=r"missing keys .*blocks\.0\.attn\.qkv\.weight"):
        tiny_module(init_from=str(tmp_path / "partial.pth"))


def test_blank_channels_default_belongs_to_the_published_dinov2_s(tmp_path, monkeypatch):
    # docs/method.md §4: DINOv2-S/14-reg4's four most positional channels.
    assert KNOWN_BLANK_CHANNELS[TEACHER] == {"channels": (47, 113, 117, 359), "embed_dim": 384, "depth": 12}
    with pytest.raises(ValueError, match=r"width 384 and depth 12; this teacher has width 48 and depth 2.*"
                                         r"alibi-vit channels --model"):
        tiny_module(blank_channels=None)  # tiny test models need an explicit list

    # The default is used for the listed architecture with real weights (a local checkpoint standing
    # in for them), refused for a randomly initialised one; checkpoints record the list used. A tiny
    # entry keeps this fast: the full-size model would only be slower.
    monkeypatch.setitem(KNOWN_BLANK_CHANNELS, TEACHER, {"channels": (3, 30), "embed_dim": 48, "depth": 2})
    with pytest.raises(ValueError, match="randomly initialised"):
        tiny_module(blank_channels=None)
    weights = tmp_path / "teacher.pth"
    torch.save(tiny_module().teacher.state_dict(), weights)
    module = tiny_module(blank_channels=None, teacher_checkpoint=str(weights))
    assert module.blank_channels == [3, 30] == module.hparams.blank_channels
    x = images(1, 28)
    target = module.teacher_targets(x)
    assert torch.all(target[:, [3, 30]] == 0) and torch.count_nonzero(target[:, 4]) > 0
    monkeypatch.undo()

    # Any other teacher: no default, and DINOv2-S's list is refused (here in range, so not caught otherwise).
    base = dict(teacher="vit_base_patch14_reg4_dinov2", student="alibi_vit_base_patch14_reg4_dinov2")
    with pytest.raises(ValueError, match="no known blank_channels for teacher vit_base_patch14_reg4_dinov2"):
        tiny_module(blank_channels=None, **base)
    with pytest.raises(ValueError, match=r"\[47, 113, 117, 359\] are vit_small_patch14_reg4_dinov2's"):
        tiny_module(blank_channels=[359, 47, 117, 113], **base, model_kwargs={**TINY, "embed_dim": 384})
    # An explicit empty list: no blanking, the target is the teacher's tokens.
    module = tiny_module(blank_channels=[])
    with torch.no_grad():
        reference = patch_features(module.teacher, x)
    assert module.blank_channels == [] and torch.equal(module.teacher_targets(x), reference)


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_warmup_longer_than_the_run_is_clipped_with_a_warning(schedule):
    from lightning.pytorch import Trainer

    module = tiny_module(lr=1e-3, warmup_steps=5, lr_schedule=schedule)
    module.trainer = Trainer(max_steps=3, logger=False, enable_checkpointing=False, accelerator="cpu")
    with pytest.warns(UserWarning, match="warmup_steps=5 is longer than this run's 3 optimizer steps"):
        config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(3):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # A linear warmup over the run's 3 steps: the configured lr is reached at the last one.
    np.testing.assert_allclose(lrs, [1e-3 / 3, 2e-3 / 3, 1e-3], rtol=1e-6)


def test_loss_falls_when_overfitting_one_batch():
    module = tiny_module(init_from=None, lr=3e-3)  # random student: a large initial loss
    optimizer = module.configure_optimizers()
    x = images(4, 28, seed=3)
    losses = []
    for _ in range(40):
        loss = module.distillation_loss(x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 0.3
    assert losses[-1] < 0.25 * losses[0], losses


def test_pca_rgb_is_first_components_scaled_to_unit_range():
    gen = torch.Generator().manual_seed(0)
    # Two directions of very different variance: the red channel must follow the dominant one.
    coeffs = torch.randn(2, 2, 4, 4, generator=gen) * torch.tensor([10.0, 1.0]).view(1, 2, 1, 1)
    basis = torch.linalg.qr(torch.randn(6, 2, generator=gen))[0]  # (C=6, 2) orthonormal
    feats = torch.einsum("bkhw,ck->bchw", coeffs, basis)
    rgb = shared_pca_rgb(feats)
    assert rgb.shape == (2, 3, 4, 4) and rgb.min() >= 0 and rgb.max() <= 1
    red = rgb[:, 0].flatten()
    corr = np.corrcoef(red.numpy(), coeffs[:, 0].flatten().numpy())[0, 1]
    assert abs(corr) > 0.999
    assert red.min() == 0 and red.max() == 1


# -- Lightning runs -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    main(["fit", "--config", DEMO, f"--run_dir={run_dir}", "--trainer.max_steps=10",
          "--trainer.val_check_interval=5", "--trainer.enable_progress_bar=false"])
    return run_dir


def test_demo_config_trains_logs_and_checkpoints(demo_run):
    assert list(demo_run.glob("events.out.tfevents.*")), "no TensorBoard event file"
    losses = scalars(demo_run, "train/loss")
    assert [s for s, _ in losses] == list(range(10))
    for tag in ("train/lr", "train/img_per_s", "val/loss", "val/probe_r2_textures", "val/probe_r2_noise",
                "val/teacher_probe_r2_textures", "val/sink_heads", "val/teacher_sink_heads"):
        assert scalars(demo_run, tag), tag
    acc = EventAccumulator(str(demo_run), size_guidance={"images": 0})
    acc.Reload()
    assert {"val/student_pca", "val/heads"} <= set(acc.Tags()["images"])
    assert [v for _, v in scalars(demo_run, "val/sink_heads")] == [0.0, 0.0]  # random init: near-uniform heads
    # Linear warmup over 5 steps, then cosine decay of the configured 1e-3 to 0 over the remaining 5.
    lrs = dict(scalars(demo_run, "train/lr"))
    expected = [1e-3 * (s + 1) / 5 for s in range(5)] + [1e-3 * 0.5 * (1 + np.cos(np.pi * (s - 5) / 5))
                                                         for s in range(5, 10)]
    np.testing.assert_allclose([lrs[s] for s in range(10)], expected, rtol=1e-6)

    ckpt_path = demo_run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 10
    assert all(k.startswith("student.") for k in ckpt["state_dict"])  # no teacher weights
    # The final step is also a scheduled one: ModelCheckpoint's own top-k file is still written.
    assert load_step(demo_run / "checkpoints" / "epoch=0-step=10.ckpt") == 10
    assert (demo_run / "config.yaml").is_file()


def test_export_reloads_in_timm_with_identical_features(demo_run, tmp_path):
    ckpt_path = demo_run / "checkpoints" / "last.ckpt"
    out = export_student(ckpt_path, tmp_path / "student.safetensors")
    (tmp_path / "plain.txt").write_text("written the ordinary way")  # the permissions the umask gives
    assert out.stat().st_mode & 0o777 == (tmp_path / "plain.txt").stat().st_mode & 0o777
    model = timm.create_model(STUDENT, checkpoint_path=str(out), num_classes=0, backend="sdpa", **TINY).eval()

    state = torch.load(ckpt_path, map_location="cpu", weights_only=True)["state_dict"]
    module = tiny_module(init_from=str(ckpt_path)).eval()
    torch.testing.assert_close(module.student.blocks[0].attn.qkv.weight, state["student.blocks.0.attn.qkv.weight"],
                               rtol=0, atol=0)
    x = images(2, 42, seed=5)
    with torch.no_grad():
        assert torch.equal(patch_features(model, x), patch_features(module.student, x))

    # The command-line path and the .pth format give the same weights.
    from alibi_vit.cli import main as alibi_vit_main

    pth = tmp_path / "student.pth"
    assert alibi_vit_main(["export", "--checkpoint", str(ckpt_path), "--out", str(pth)]) == 0
    from safetensors.torch import load_file

    a, b = load_file(str(out)), torch.load(pth, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_refuses_weights_that_do_not_fit_the_student(demo_run, tmp_path):
    ckpt = torch.load(demo_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    ckpt["hyper_parameters"]["model_kwargs"] = {**TINY, "depth": 3}
    bad = tmp_path / "bad.ckpt"
    torch.save(ckpt, bad)
    with pytest.raises(ValueError, match=r"missing keys.*blocks\.2\."):
        export_student(bad, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_resume_mid_epoch_continues_exactly_where_it_stopped(tmp_path):
    # 88 demo tiles / batch 8 = 11 batches per epoch: stopping at step 10 is mid-epoch.
    common = ["--trainer.limit_val_batches=0", "--model.init_from=null", "--model.lr_schedule=constant"]
    fit(tmp_path / "straight", "--trainer.max_steps=20", *common)

    run_dir = tmp_path / "interrupted"
    fit(run_dir, "--trainer.max_steps=10", *common)
    first = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert first["global_step"] == 10
    assert {int(s["step"]) for s in first["optimizer_states"][0]["state"].values()} == {10}

    run = fit(run_dir, "--trainer.max_steps=20", "--ckpt_path=last", *common)
    assert run.trainer.global_step == 20
    second = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert second["global_step"] == 20
    # AdamW's step count carried on from 10: the optimizer state was restored, not re-created.
    assert {int(s["step"]) for s in second["optimizer_states"][0]["state"].values()} == {20}
    # TensorBoard (same folder, two event files) holds each step exactly once, and the resumed run
    # saw the same batches with the same weights as the uninterrupted one: identical losses.
    resumed, straight = scalars(run_dir, "train/loss"), scalars(tmp_path / "straight", "train/loss")
    assert [s for s, _ in resumed] == [s for s, _ in straight] == list(range(20))
    np.testing.assert_allclose([v for _, v in resumed], [v for _, v in straight], rtol=1e-5, atol=1e-7)


def test_ckpt_path_last_prefers_a_newer_slurm_checkpoint(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = Trainer(default_root_dir=tmp_path, logger=False, accelerator="cpu",
                      callbacks=[ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True)])
    assert newest_resume_checkpoint(trainer) is None
    (tmp_path / "checkpoints").mkdir()
    last, hpc = tmp_path / "checkpoints" / "last.ckpt", tmp_path / "hpc_ckpt_1.ckpt"
    last.write_bytes(b"x")
    assert newest_resume_checkpoint(trainer) == str(last)
    hpc.write_bytes(b"x")
    now = time.time()
    os.utime(last, (now - 100, now - 100))
    os.utime(hpc, (now, now))
    assert newest_resume_checkpoint(trainer) == str(hpc)
    os.utime(last, (now + 100, now + 100))
    assert newest_resume_checkpoint(trainer) == str(last)


def test_two_process_ddp_matches_single_process_on_same_global_batch(tmp_path):
    common = ["--trainer.max_steps=4", "--trainer.limit_val_batches=0", "--model.init_from=null",
              "--model.lr=3e-3", "--model.warmup_steps=0", "--model.lr_schedule=constant", "--data.batch_size=8",
              "--data.shuffle=true"]
    fit(tmp_path / "single", "--trainer.devices=1", *common)
    fit(tmp_path / "ddp", "--trainer.devices=2", "--trainer.strategy=ddp_spawn", *common)
    single = scalars(tmp_path / "single", "train/loss")
    ddp = scalars(tmp_path / "ddp", "train/loss")
    assert [s for s, _ in single] == [s for s, _ in ddp] == [0, 1, 2, 3]
    a, b = np.array([v for _, v in single]), np.array([v for _, v in ddp])
    assert abs(a[0] - a[-1]) > 1e-2  # the weights actually moved
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    # It really ran two processes: global throughput is twice the per-device figure.
    per_device = dict(scalars(tmp_path / "ddp", "train/img_per_s_per_device"))
    total = dict(scalars(tmp_path / "ddp", "train/img_per_s"))
    assert per_device and all(total[s] == pytest.approx(2 * v) for s, v in per_device.items())


# -- benchmark script -----------------------------------------------------------------------------

def test_benchmark_smoke_writes_markdown_and_json(tmp_path):
    bench = benchmark_module("bench_distill_throughput")
    assert bench.main(["--smoke", "--backends", "sdpa", "eager", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "distill_throughput_cpu-smoke.json").read_text())
    assert {(r["backend"], r["image_size"]) for r in data["results"]} == {(b, s) for b in ("sdpa", "eager")
                                                                          for s in (28, 56)}
    assert all(r["status"] == "ok" and r["img_per_s"] > 0 for r in data["results"])
    assert "--smoke" in data["meta"]["command"]
    assert "| 56 |" in (tmp_path / "distill_throughput_cpu-smoke.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_benchmark_without_gpu_exits_with_message():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_distill_throughput.py")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_dinov3_config_blanks_the_authors_channels_and_trains_query_value_biases(tmp_path):
    import yaml

    from lit_modules.cli import cli

    config = ROOT / "configs" / "alibi_dv3.yaml"
    init = yaml.safe_load(config.read_text())["model"]["init_args"]
    assert init["blank_channels"] == [74, 123, 149, 267] and init["student_kwargs"]["qkv_bias"] is True
    assert yaml.safe_load((ROOT / "configs" / "alibi_dv3_512.yaml").read_text())["model"]["init_args"][
        "blank_channels"] == [74, 123, 149, 267]
    assert KNOWN_BLANK_CHANNELS["vit_small_plus_patch16_dinov3"]["channels"] == (74, 123, 149, 267)
    # the config builds (tiny, random-init teacher): the student has q/v biases, zero at the start, trained
    run = cli(["--config", str(config), f"--run_dir={tmp_path}", "--data.root=/nonexistent",
               "--trainer.accelerator=cpu", "--model.teacher_pretrained=false", "--model.blank_channels=[1, 2]",
               "--model.model_kwargs={depth: 1, embed_dim: 48, num_heads: 2}",
               "--model.student_kwargs={slopes: constant, backend: sdpa, qkv_bias: true}"], run=False)
    student = run.model.student
    q_bias = student.blocks[0].attn.q_bias
    assert q_bias is not None and q_bias.requires_grad and torch.count_nonzero(q_bias) == 0
    optimizer = run.model.configure_optimizers()  # the config: constant lr, no warmup → the optimizer alone
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(q_bias) in trained and id(student.blocks[0].attn.v_bias) in trained
