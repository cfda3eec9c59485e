"""RASA rounds in one Lightning fit (docs/method.md §8), on a tiny backbone with a strong position code."""

import math
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn as nn

from alibi_vit import create_backbone, patch_features
from alibi_vit.analysis.probe import positional_r2
from alibi_vit.analysis.rasa import PROJECTION_KEY, remove_planes
from datamodules.images import TensorImageDataset
from lit_modules.rasa import RASAModule, position_grid

pytestmark = [pytest.mark.filterwarnings("ignore:LightningCLI's args parameter", "ignore:.*does not have many workers",
                                         "ignore:The number of training batches"),
              pytest.mark.usefixtures("one_thread")]

KWARGS = {"depth": 2, "embed_dim": 48, "num_heads": 2}
ROOT = Path(__file__).resolve().parents[1]


def _inject_position(module: RASAModule, strength: float = 0.5) -> None:
    """A learned position embedding that is a linear ramp in two random channel directions on top of a
    large constant one (which keeps the final LayerNorm's scale nearly the same for every patch).

    DINOv2's LayerScale (1e-5) leaves the blocks' changes tiny, so the final tokens carry (row, col)
    almost linearly in one plane, which a round should find.
    """
    pos = module.backbone.pos_embed  # (1, 37·37, C), interpolated to the image's grid
    g = torch.Generator().manual_seed(0)
    u, v, w = torch.randn(3, pos.shape[-1], generator=g)
    grid = position_grid(37, 37) * 2 - 1
    with torch.no_grad():
        pos.copy_(strength * (2 * w + grid[:, :1] * u + grid[:, 1:] * v)[None])


def _data(n_train=16, n_val=4, size=112):
    g = torch.Generator().manual_seed(1)
    images = torch.randn(n_train + n_val, 3, size, size, generator=g)
    return L.LightningDataModule.from_datasets(TensorImageDataset(images[:n_train]),
                                               val_dataset=TensorImageDataset(images[n_train:]), batch_size=4)


def _trainer(tmp_path, max_epochs, val_every=1):
    return L.Trainer(accelerator="cpu", max_epochs=max_epochs, limit_train_batches=4, logger=False,
                     check_val_every_n_epoch=val_every, num_sanity_val_steps=0,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=tmp_path)


def test_two_rounds_remove_position_and_export(tmp_path):
    L.seed_everything(0)
    module = RASAModule(backbone="vit_small_patch14_reg4_dinov2", backbone_kwargs=KWARGS, allow_random_init=True,
                        rounds=2, lr=5e-2, export_dir=str(tmp_path / "export"))
    _inject_position(module)
    images = torch.randn(4, 3, 112, 112, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = patch_features(module.backbone, images)
    r2_before = positional_r2(before, min_train=32, fraction=0.5, repeats=3)
    assert r2_before > 0.7

    trainer = _trainer(tmp_path, max_epochs=20, val_every=10)  # 2 rounds × 10 epochs of 4 steps
    trainer.fit(module, datamodule=_data())
    assert module.planes.shape == (2, 2, 48)
    # stacked planes: orthonormal rows, the second orthogonal to the first
    gram = module.planes.reshape(4, 48) @ module.planes.reshape(4, 48).T
    torch.testing.assert_close(gram, torch.eye(4), atol=1e-5, rtol=0)
    # the first round's head learned position (the round's last validation)
    history = module.round_history
    assert [h["round"] for h in history] == [1, 2]
    assert history[0]["val/head_r2"] > 0.5
    assert history[1]["val/cosine"] < 1.0 and history[0]["val/cosine"] == pytest.approx(1.0)

    # a ridge probe (standardised features, per image) reads much less position after the first plane is gone
    r2_after = positional_r2(remove_planes(before, module.planes[:1]), min_train=32, fraction=0.5, repeats=3)
    assert r2_after < r2_before - 0.3
    cleaned = remove_planes(before, module.planes)

    # the export: timm state_dict + one matrix, whose model equals remove_planes of the original
    out = tmp_path / "export"
    planes = torch.load(out / "rasa_planes.pt", weights_only=True)
    torch.testing.assert_close(planes, module.planes)
    folded = create_backbone("vit_small_patch14_reg4_dinov2", checkpoint=out / "rasa_backbone.safetensors").eval()
    assert set(folded.state_dict()) == set(module.backbone.state_dict()) | {PROJECTION_KEY}
    with torch.no_grad():
        torch.testing.assert_close(patch_features(folded, images), cleaned, atol=1e-4, rtol=1e-4)

    # a checkpoint holds the stacked planes (the buffer grows per round) and loads back strictly
    trainer.save_checkpoint(tmp_path / "rasa.ckpt")
    again = RASAModule.load_from_checkpoint(tmp_path / "rasa.ckpt", strict=True)
    torch.testing.assert_close(again.planes, module.planes)
    assert [h["round"] for h in again.round_history] == [1, 2]


def test_rounds_must_divide_epochs(tmp_path):
    module = RASAModule(backbone="vit_small_patch14_reg4_dinov2", backbone_kwargs=KWARGS, allow_random_init=True,
                        rounds=2)
    with pytest.raises(ValueError, match="multiple of model.rounds=2"):
        _trainer(tmp_path, max_epochs=3).fit(module, datamodule=_data())


def test_random_weights_need_consent():
    with pytest.raises(ValueError, match="allow_random_init"):
        RASAModule(backbone="vit_small_patch14_reg4_dinov2", backbone_kwargs=KWARGS, pretrained=False)


def test_config_builds_the_reference_recipe(tmp_path):
    from lit_modules.cli import cli

    run = cli(["--config", str(ROOT / "configs" / "rasa.yaml"), f"--run_dir={tmp_path}",
               "--model.allow_random_init=true",
               "--model.backbone_kwargs={depth: 2, embed_dim: 48, num_heads: 2}"], run=False)
    assert isinstance(run.model, RASAModule)
    assert (run.model.hparams.rounds, run.model.hparams.lr, run.trainer.max_epochs) == (12, 2e-4, 144)
    assert run.datamodule.batch_size == 32 and run.datamodule.image_size == 518
    from datamodules.rasa import RASADataModule

    dm = run.datamodule
    assert isinstance(dm, RASADataModule) and dm.dataset == "voc" and dm.train_split == "train"
    assert dm.augmentation.crop_scale == (0.25, 1.0) and dm.augmentation.flips and dm.augmentation.rotations
    # the reference's data: albumentations ColorJitter(0.8·0.4, 0.8·0.4, 0.8·0.4, 0.2·0.4), GaussianBlur((3, 7)),
    # RandomRotate90(p=0.5), Normalize(std=(0.229, 0.224, 0.255)); validation images at 224 px
    aug = dm.augmentation
    assert aug.jitter == pytest.approx((0.32, 0.32, 0.32, 0.08)) and aug.blur_kernel == (3, 7)
    assert aug.rotation_p == 0.5 and aug.std == (0.229, 0.224, 0.255) and dm.val_image_size == 224
    # its loader: VOC train not shuffled, the last partial batch kept: ⌈1,464 / 32⌉ = 46 steps per epoch, 12 epochs
    # per round; its cosine T_max: (1,464 // 32) · 12 = 540; OverClustering on its first 10 validation batches
    assert dm.samples_per_epoch is None and not dm.shuffle and not dm.drop_last
    epochs_per_round = run.trainer.max_epochs // run.model.hparams.rounds
    assert epochs_per_round * math.ceil(1464 / dm.batch_size) == 552
    assert run.model.hparams.cosine_t_max == epochs_per_round * (1464 // dm.batch_size)
    assert run.trainer.check_val_every_n_epoch == epochs_per_round and run.trainer.limit_val_batches == 1.0
    assert (run.model.hparams.oc_k, run.model.hparams.oc_batches, run.model.hparams.select_round) == (21, 10, "best")


def test_cosine_schedule_is_the_references_per_round():
    """Each round's learning rate follows torch's CosineAnnealingLR(T_max) from its start, past T_max too."""
    from types import SimpleNamespace

    module = RASAModule(backbone="vit_small_patch14_reg4_dinov2", backbone_kwargs=KWARGS, allow_random_init=True,
                        rounds=2, lr=2e-4, cosine_t_max=540)
    module._trainer = SimpleNamespace(estimated_stepping_batches=2 * 552)  # two rounds of 552 steps
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    ours = []
    for _ in range(2 * 552):
        ours.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    reference_opt = torch.optim.AdamW(nn.Linear(1, 1).parameters(), lr=2e-4, weight_decay=0.0)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(reference_opt, T_max=540, eta_min=0.0)
    theirs = []
    for _ in range(552):
        theirs.append(reference_opt.param_groups[0]["lr"])
        reference_opt.step()
        reference.step()
    np.testing.assert_allclose(ours[:552], theirs, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(ours[552:], theirs, rtol=1e-9, atol=1e-15)  # a new round starts over
    assert ours[540] == 0.0 and 0 < ours[551] < 3e-7  # the last 12 steps climb back a little


def test_rasa_metrics_log_one_value_per_key_and_select_the_best_round(tmp_path, monkeypatch):
    import json

    from alibi_vit.analysis.overclustering import overclustering_seeds
    from datamodules.demo_voc import write_demo_voc
    from datamodules.rasa import RASADataModule

    root = write_demo_voc(tmp_path / "voc", n_train=4, n_val=3)
    L.seed_everything(0)
    module = RASAModule(backbone="vit_small_patch14_reg4_dinov2", backbone_kwargs=KWARGS, allow_random_init=True,
                        rounds=2, lr=5e-2, export_dir=str(tmp_path / "export"), oc_batches=1)
    _inject_position(module)
    epochs = []  # the keys logged at the end of each validation epoch
    real_log, real_end = module.log, module.on_validation_epoch_end

    def end_of_validation():
        epochs.append([])
        real_end()

    def log(name, *args, **kwargs):
        if module.trainer.validating:
            epochs[-1].append(name)
        return real_log(name, *args, **kwargs)

    monkeypatch.setattr(module, "on_validation_epoch_end", end_of_validation)
    monkeypatch.setattr(module, "log", log)
    dm = RASADataModule(str(root), image_size=56, val_image_size=56, batch_size=2, num_workers=0)
    _trainer(tmp_path, max_epochs=4, val_every=2).fit(module, datamodule=dm)  # 2 rounds × 2 epochs
    # one value per key and validation epoch (the reference logs three mIoUs under one key, which Lightning
    # averages: 0.1, 0.2, 0.6 → 0.3)
    assert len(epochs) == 2 and all(len(keys) == len(set(keys)) for keys in epochs)
    oc_keys = {"val/oc_miou_cleaned", "val/oc_miou_raw", "val/oc_miou_plane", "val/oc_miou_reference_mean"}
    assert oc_keys <= set(epochs[0])

    # each round's values from the pieces: the first validation batch (oc_batches=1) of VOC val at 56 px, the
    # tokens with the planes up to that round removed, the raw tokens, and that round's plane component
    batch = next(iter(dm.val_dataloader()))
    with torch.no_grad():
        raw = patch_features(module.backbone, batch["image"])
    masks = batch["label"].numpy()

    def miou(feats):
        return overclustering_seeds(feats.permute(0, 2, 3, 1).half().numpy(), masks, 21, 21, recipe="rasa").miou

    history = module.round_history
    assert [h["round"] for h in history] == [1, 2]
    for t, h in enumerate(history):
        before, after = remove_planes(raw, module.planes[:t]), remove_planes(raw, module.planes[:t + 1])
        assert h["val/oc_miou_cleaned"] == pytest.approx(miou(after), abs=1e-6)
        assert h["val/oc_miou_raw"] == pytest.approx(miou(raw), abs=1e-6)
        assert h["val/oc_miou_plane"] == pytest.approx(miou(before - after), abs=1e-6)
        parts = [h[f"val/oc_miou_{name}"] for name in ("raw", "plane", "cleaned")]
        assert h["val/oc_miou_reference_mean"] == pytest.approx(np.mean(parts), abs=1e-6)
        # the round's head reads nothing once its plane is removed: sigmoid(0) = 0.5 everywhere
        grid = position_grid(4, 4)
        assert h["val/mse_own_removed"] == pytest.approx(float((grid - 0.5).pow(2).mean()), abs=1e-5)

    # the export folds in the round of highest val/oc_miou_cleaned; every plane is kept
    summary = json.loads((tmp_path / "export" / "rasa_rounds.json").read_text())
    best = max(history, key=lambda h: (h["val/oc_miou_cleaned"], -h["round"]))["round"]
    assert summary["selected_round"] == best and summary["selected_by"] == "highest val/oc_miou_cleaned"
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    folded = create_backbone("vit_small_patch14_reg4_dinov2",
                             checkpoint=tmp_path / "export" / "rasa_backbone.safetensors").eval()
    with torch.no_grad():
        torch.testing.assert_close(patch_features(folded, batch["image"]),
                                   remove_planes(raw, module.planes[:best]), atol=1e-4, rtol=1e-4)


def test_round_selection_by_hand():
    module = RASAModule(backbone="vit_small_patch14_reg4_dinov2", backbone_kwargs=KWARGS, allow_random_init=True,
                        rounds=3)
    module.planes = torch.zeros(3, 2, 48)
    module.round_history = [{"round": 1, "val/oc_miou_cleaned": 0.30}, {"round": 2, "val/oc_miou_cleaned": 0.41},
                            {"round": 3, "val/oc_miou_cleaned": 0.41}]
    assert module.selected_round() == (2, "highest val/oc_miou_cleaned")  # ties: the earlier round, fewer planes
    module.hparams.select_round = "last"
    assert module.selected_round() == (3, "last round (select_round=last)")
    module.hparams.select_round = "best"
    module.round_history = [{"round": 1}, {"round": 2}, {"round": 3}]  # validation without labels
    assert module.selected_round()[0] == 3
    # a round not validated at its end carries the previous validation's metrics: no selection on stale numbers
    module.round_history = [{"round": 1, "val/round": 1.0, "val/oc_miou_cleaned": 0.5},
                            {"round": 2, "val/round": 1.0, "val/oc_miou_cleaned": 0.5}]
    module.planes = torch.zeros(2, 2, 48)
    assert module.selected_round()[0] == 2


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_feature_cache_gives_the_same_rounds(tmp_path):
    from datamodules.demo_voc import write_demo_voc
    from datamodules.segmentation import VOCSegmentation

    root = write_demo_voc(tmp_path / "voc", n_train=4, n_val=2)
    cache = tmp_path / "cache"

    def fit():
        L.seed_everything(0)
        module = RASAModule(backbone="vit_small_patch14_reg4_dinov2", backbone_kwargs=KWARGS, allow_random_init=True,
                            rounds=2, lr=5e-2, feature_cache_dir=str(cache), export_dir=str(tmp_path / "export"))
        dm = VOCSegmentation(str(root), image_size=56, batch_size=2, num_workers=0)
        _trainer(tmp_path, max_epochs=4).fit(module, datamodule=dm)
        return module

    first = fit()  # epoch 1 computes and writes the features, later epochs read them
    files = sorted(cache.rglob("*.pt"))
    assert len(files) == 6  # 4 train + 2 val images
    stamps = [f.stat().st_mtime_ns for f in files]
    second = fit()  # everything from the cache: the same planes
    assert [f.stat().st_mtime_ns for f in files] == stamps
    torch.testing.assert_close(second.planes, first.planes)
    assert first.planes.shape == (2, 2, 48)
