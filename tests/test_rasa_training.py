"""RASA rounds in one Lightning fit (docs/method.md §8), on a tiny backbone with a strong position code."""

from pathlib import Path

import lightning as L
import pytest
import torch

from alibi_vit import create_backbone, patch_features
from alibi_vit.analysis.probe import positional_r2
from alibi_vit.analysis.rasa import PROJECTION_KEY, remove_planes
from datamodules.images import TensorImageDataset
from lit_modules.rasa import RASAModule, position_grid

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter", "ignore:.*does not have many workers",
                                        "ignore:The number of training batches")

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
                     check_val_every_n_epoch=val_every,
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
    # the reference's data: VOC12 train, random resized crops 25–100 %, flips and 90° rotations, and
    # 12 epochs of 1,464 // 32 = 45 steps = 540 steps per round; validation once per round, 4 batches
    from datamodules.rasa import RASADataModule

    dm = run.datamodule
    assert isinstance(dm, RASADataModule) and dm.dataset == "voc" and dm.train_split == "train"
    assert dm.augmentation.crop_scale == (0.25, 1.0) and dm.augmentation.flips and dm.augmentation.rotations
    assert dm.samples_per_epoch is None  # every VOC train image once per epoch
    assert run.trainer.max_epochs // run.model.hparams.rounds * (1464 // dm.batch_size) == 540
    assert run.trainer.check_val_every_n_epoch == 12 and run.trainer.limit_val_batches == 4
    assert run.model.hparams.oc_k == 21


def test_rounds_log_overclustering_and_own_plane_mse(tmp_path):
    import numpy as np

    from alibi_vit.analysis.overclustering import overclustering_seeds, resize_labels_nearest
    from datamodules.demo_voc import write_demo_voc
    from datamodules.rasa import RASADataModule

    root = write_demo_voc(tmp_path / "voc", n_train=4, n_val=3)
    L.seed_everything(0)
    module = RASAModule(backbone="vit_small_patch14_reg4_dinov2", backbone_kwargs=KWARGS, allow_random_init=True,
                        rounds=1, lr=5e-2, export_dir=str(tmp_path / "export"))
    dm = RASADataModule(str(root), image_size=56, batch_size=2, num_workers=0)
    _trainer(tmp_path, max_epochs=1).fit(module, datamodule=dm)
    (history,) = module.round_history
    # the round's head with its own plane removed predicts sigmoid(0) = 0.5 everywhere: MSE = mean (t − 0.5)²
    grid = position_grid(4, 4)
    assert history["val/mse_own_removed"] == pytest.approx(float((grid - 0.5).pow(2).mean()), abs=1e-5)
    # OverClustering of round 1 (no plane removed yet) on every validation image, k = 21, seed 0
    batches = list(dm.val_dataloader())
    with torch.no_grad():
        feats = torch.cat([patch_features(module.backbone, b["image"]) for b in batches])
    masks = resize_labels_nearest(torch.cat([b["label"] for b in batches]).numpy(), 100)
    expected = overclustering_seeds(feats.permute(0, 2, 3, 1).half().numpy(), masks, 21, 21, seeds=(0,))
    assert history["val/oc_miou"] == pytest.approx(expected.miou, abs=1e-6)
    assert 0 < history["val/oc_miou"] <= 1 and np.isfinite(history["val/oc_miou"])


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
