"""Segmentation linear probe: learning, whole-set mIoU, the feature cache, the config through the CLI."""

import importlib.util
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from datamodules.segmentation import VOCSegmentation, write_synthetic_voc
from lit_modules.segmentation_probe import SegmentationProbeModule

TINY = dict(depth=2, embed_dim=48, num_heads=2)
REPO = Path(__file__).resolve().parents[1]


def tiny_probe(num_classes=21, seed=0, **kwargs):
    torch.manual_seed(seed)
    return SegmentationProbeModule("alibi_vit_small_patch14_reg4_dinov2", num_classes=num_classes,
                                   backbone_kwargs=TINY, allow_random_init=True, **kwargs)


def trainer(**kwargs):
    return L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


@pytest.fixture(scope="module")
def voc_root(tmp_path_factory):
    return write_synthetic_voc(tmp_path_factory.mktemp("voc"), n_train=10, n_val=6, seed=0)


def test_probe_learns_a_colour_task_beyond_chance(voc_root):
    """Class = colour of a region: a linear head on frozen random features must learn it."""
    L.seed_everything(0)
    dm = VOCSegmentation(str(voc_root), image_size=70, batch_size=5, num_workers=0)
    model = tiny_probe(lr=2e-2)
    backbone_before = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    t = trainer(max_epochs=8)
    before = t.validate(model, datamodule=dm, verbose=False)[0]["val/mIoU"]
    t.fit(model, datamodule=dm)
    after = float(t.callback_metrics["val/mIoU"])
    # chance: always predicting background gives IoU(bg) = its pixel share and 0 for the 3 object classes
    labels = torch.cat([b["label"] for b in dm.val_dataloader()])
    valid = labels != 255
    chance = float((labels[valid] == 0).float().mean()) / 4
    assert after > 0.6 and after > chance + 0.3 and after > before + 0.3, (before, after, chance)
    # the backbone is frozen
    for key, value in model.backbone.state_dict().items():
        assert torch.equal(value, backbone_before[key]), key
    assert not model.backbone.training


def one_hot_features(classes: torch.Tensor, channels: int = 48) -> torch.Tensor:
    """Features whose first channels are the one-hot of ``classes`` (h, w) → (channels, h, w)."""
    f = torch.zeros(channels, *classes.shape)
    f[:3] = torch.nn.functional.one_hot(classes, 3).permute(2, 0, 1).float() * 10.0
    return f


def iou_by_hand(preds: np.ndarray, labels: np.ndarray, n: int = 3):
    valid = labels != 255
    p, t = preds[valid], labels[valid]
    ious = []
    for c in range(n):
        inter, union = np.sum((p == c) & (t == c)), np.sum((p == c) | (t == c))
        ious.append(inter / union if union else np.nan)
    return np.array(ious)


def test_miou_is_accumulated_over_the_whole_set_not_averaged_per_batch():
    model = tiny_probe(num_classes=3)
    with torch.no_grad():  # head = identity on the first 3 channels: predictions = argmax of the one-hot
        conv = model.head[1]
        conv.weight.zero_()
        conv.bias.zero_()
        conv.weight[:, :3, 0, 0] = torch.eye(3)
    rng = np.random.default_rng(0)
    # batch 1: big images where class 0 dominates and is right; batch 2: one small image, mostly wrong
    labels_1 = rng.choice([0, 0, 0, 1, 255], size=(3, 6, 6))
    preds_1 = np.where(rng.random((3, 6, 6)) < 0.9, np.where(labels_1 == 255, 0, labels_1), 2)
    labels_2 = rng.choice([1, 2], size=(1, 6, 6))
    preds_2 = np.where(rng.random((1, 6, 6)) < 0.3, labels_2, (labels_2 + 1) % 3)
    batches = []
    for preds, labels in ((preds_1, labels_1), (preds_2, labels_2)):
        feats = torch.stack([one_hot_features(torch.from_numpy(p)) for p in preds])
        batches.append({"features": feats, "features_index": torch.arange(len(preds)),
                        "label": torch.from_numpy(labels).long(), "cache_key": [""] * len(preds)})
    t = trainer()
    metrics = t.validate(model, dataloaders=DataLoader(batches, batch_size=None), verbose=False)[0]

    whole = iou_by_hand(np.concatenate([preds_1.ravel(), preds_2.ravel()]),
                        np.concatenate([labels_1.ravel(), labels_2.ravel()]))
    per_batch = [np.nanmean(iou_by_hand(p.ravel(), lab.ravel()))
                 for p, lab in ((preds_1, labels_1), (preds_2, labels_2))]
    assert metrics["val/mIoU"] == pytest.approx(np.nanmean(whole), abs=1e-6)
    assert abs(np.mean(per_batch) - np.nanmean(whole)) > 0.05  # the two definitions really differ here
    for c in range(3):
        assert metrics[f"val/IoU/{c:03d}_class_{c}"] == pytest.approx(whole[c], abs=1e-6)


def test_absent_classes_are_nan_and_not_averaged():
    model = tiny_probe(num_classes=4)
    with torch.no_grad():
        model.head[1].weight.zero_()
        model.head[1].bias.zero_()
        model.head[1].weight[:3, :3, 0, 0] = torch.eye(3)
    labels = torch.tensor([[[0, 1], [1, 0]]])
    batch = {"features": one_hot_features(labels[0])[None], "features_index": torch.arange(1), "label": labels,
             "cache_key": [""]}
    metrics = trainer().validate(model, dataloaders=DataLoader([batch], batch_size=None), verbose=False)[0]
    assert metrics["val/mIoU"] == pytest.approx(1.0)  # classes 2 and 3 occur nowhere: not counted as 0
    assert np.isnan(metrics["val/IoU/003_class_3"])


def _absent_classes_count_as_zero(confmat, average, ignore_index=None, zero_division=0.0):
    """torchmetrics' JaccardIndex reduction as some allowed releases did it: absent classes score 0."""
    confmat = confmat.float()
    tp = confmat.diag()
    iou = tp / (confmat.sum(0) + confmat.sum(1) - tp).clamp_min(1)
    return iou if average in (None, "none") else iou.mean()


def test_miou_does_not_depend_on_torchmetrics_absent_class_handling(monkeypatch):
    """Classes in neither labels nor predictions stay out of the mean whatever torchmetrics does."""
    import torchmetrics.classification.jaccard as tm_jaccard
    import torchmetrics.functional.classification.jaccard as tm_functional_jaccard

    monkeypatch.setattr(tm_jaccard, "_jaccard_index_reduce", _absent_classes_count_as_zero)
    monkeypatch.setattr(tm_functional_jaccard, "_jaccard_index_reduce", _absent_classes_count_as_zero)
    test_absent_classes_are_nan_and_not_averaged()


def test_backbone_tag_hashes_zero_dim_tensors():
    model = tiny_probe()
    tag = model.backbone_tag()
    model.backbone.register_buffer("scale", torch.tensor(2.0))  # 0-dim, as some timm models keep
    assert model.backbone_tag() != tag


def test_feature_cache_skips_the_backbone_and_images_after_the_first_epoch(voc_root, tmp_path):
    cache_dir = tmp_path / "cache"
    dm = VOCSegmentation(str(voc_root), image_size=42, batch_size=4, num_workers=0)
    model = tiny_probe(feature_cache_dir=str(cache_dir))
    seen = []

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.append((trainer.current_epoch, "image" in batch, "features" in batch))

    trainer(max_epochs=2, callbacks=[Record()]).fit(model, datamodule=dm)
    assert {(e, i, f) for e, i, f in seen if e == 0} == {(0, True, False)}
    assert {(e, i, f) for e, i, f in seen if e == 1} == {(1, False, True)}  # no image decoded, no backbone

    [tag_dir] = list(cache_dir.iterdir())
    assert tag_dir.name.startswith("alibi_vit_small_patch14_reg4_dinov2-") and tag_dir.name.endswith("-fp32")
    files = sorted((tag_dir / "voc2012-42x42-stretch").glob("*.pt"))
    assert len(files) == 16  # every train and val image once
    # cached = the backbone's features of the unaugmented image, rounded to float16
    plain = VOCSegmentation(str(voc_root), image_size=42, num_workers=0)
    plain.setup("validate")
    item = plain.val_set[0]
    expected = model.backbone_features(item["image"][None])[0].half()
    assert torch.equal(torch.load(tag_dir / "voc2012-42x42-stretch" / f"{item['image_id']}.pt"), expected)

    # another backbone (different weights) never reads these files
    other = tiny_probe(seed=1, feature_cache_dir=str(cache_dir))
    assert other.backbone_tag() != model.backbone_tag()


def test_feature_cache_refused_with_augmentation(voc_root, tmp_path):
    dm = VOCSegmentation(str(voc_root), image_size=42, batch_size=4, num_workers=0, augment=True)
    with pytest.raises(ValueError, match="augment=False"):
        trainer(max_epochs=1).fit(tiny_probe(feature_cache_dir=str(tmp_path)), datamodule=dm)


def test_bad_setups_are_clear_errors(voc_root):
    with pytest.raises(ValueError, match="random weights: pass --model.backbone_checkpoint"):
        SegmentationProbeModule("alibi_vit_small_patch14_reg4_dinov2", pretrained=False, backbone_kwargs=TINY)
    dm = VOCSegmentation(str(voc_root), image_size=42, num_workers=0)
    with pytest.raises(ValueError, match="num_classes=5 .* 21 classes"):
        trainer().validate(tiny_probe(num_classes=5), datamodule=dm)
    dm = VOCSegmentation(str(voc_root), image_size=50, num_workers=0)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        trainer().validate(tiny_probe(), datamodule=dm)


@pytest.mark.skipif(importlib.util.find_spec("lit_modules.cli") is None,
                    reason="lit_modules.cli (the `lightning` command) does not exist yet")
@pytest.mark.parametrize("config", ["probe_voc12.yaml"])
def test_probe_config_runs_through_the_lightning_cli(config, voc_root, tmp_path, monkeypatch):
    from lit_modules.cli import main

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(REPO / "configs" / config), f"--data.root={voc_root}",
          "--model.backbone_kwargs={depth: 2, embed_dim: 48, num_heads: 2}", "--model.allow_random_init=true",
          "--data.image_size=28", "--data.batch_size=8", "--data.num_workers=0", "--trainer.max_epochs=1",
          "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false"])
    [run] = list((tmp_path / "runs" / "probe_voc12").iterdir())
    assert (run / "config.yaml").is_file()
    best = run / "checkpoints" / "best.ckpt"
    assert best.is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    # checkpoints are self-contained: the probe reloads strictly without the backbone's source
    probe = SegmentationProbeModule.load_probe(best)
    assert probe.hparams.backbone == "alibi_vit_small_patch14_reg4_dinov2" and probe.num_classes == 21


@pytest.mark.skipif(importlib.util.find_spec("lit_modules.cli") is None,
                    reason="lit_modules.cli (the `lightning` command) does not exist yet")
@pytest.mark.parametrize("config,classes", [("probe_voc07.yaml", 21), ("probe_voc12.yaml", 21),
                                            ("probe_ade20k.yaml", 150), ("probe_cocostuff.yaml", 171)])
def test_all_probe_configs_parse_with_paper_settings(config, classes, tmp_path, monkeypatch):
    from lit_modules.cli import cli

    monkeypatch.chdir(tmp_path)
    run = cli(["--config", str(REPO / "configs" / config),
               "--model.backbone_kwargs={depth: 1, embed_dim: 32, num_heads: 2}",
               "--model.allow_random_init=true", "--trainer.accelerator=cpu"], run=False)
    assert run.model.num_classes == classes == run.datamodule.num_classes
    assert run.model.hparams.backbone == "alibi_vit_small_patch14_reg4_dinov2"
    assert (run.model.hparams.lr, run.model.hparams.weight_decay) == (1e-3, 0.01)
    assert run.datamodule.image_size == (518, 518) and not run.datamodule.augment
    expected = {"probe_voc07.yaml": (75, 64), "probe_voc12.yaml": (50, 64), "probe_ade20k.yaml": (50, 32),
                "probe_cocostuff.yaml": (10, 32)}[config]
    assert (run.trainer.max_epochs, run.datamodule.batch_size) == expected
    if config == "probe_voc07.yaml":
        assert run.datamodule.year == 2007 and run.datamodule.val_split == "val"
    # ADE20K: 1,000 random training images per epoch (paper Tab. S2); the others use every image
    assert run.datamodule.train_samples_per_epoch == (1000 if config == "probe_ade20k.yaml" else None)
    # random weights only when asked for: the configs themselves say no
    import yaml

    assert yaml.safe_load((REPO / "configs" / config).read_text())["model"]["init_args"]["allow_random_init"] is False


@pytest.mark.skipif(importlib.util.find_spec("lit_modules.cli") is None,
                    reason="lit_modules.cli (the `lightning` command) does not exist yet")
def test_crop_flip_augmentation_is_selectable_from_the_command_line(tmp_path, monkeypatch):
    from lit_modules.cli import cli

    monkeypatch.chdir(tmp_path)
    run = cli(["--config", str(REPO / "configs" / "probe_ade20k.yaml"), "--data.augment=crop_flip",
               "--model.backbone_kwargs={depth: 1, embed_dim: 32, num_heads: 2}",
               "--model.allow_random_init=true", "--trainer.accelerator=cpu"], run=False)
    assert run.datamodule.augmentation == "crop_flip" and run.datamodule.augment


def test_each_epoch_trains_on_a_fresh_random_subset(voc_root):
    """train_samples_per_epoch through a real Trainer: Lightning sets the sampler's epoch, so draws change."""
    dm = VOCSegmentation(str(voc_root), image_size=28, batch_size=2, num_workers=0, train_samples_per_epoch=4)
    seen: dict[int, list] = {}

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            seen.setdefault(trainer.current_epoch, []).extend(batch["image_id"])

    trainer(max_epochs=3, limit_val_batches=0, callbacks=[Record()]).fit(tiny_probe(), datamodule=dm)
    assert sorted(seen) == [0, 1, 2]
    for ids in seen.values():
        assert len(ids) == len(set(ids)) == 4  # 4 distinct of the 10 training images, in 2 batches
    assert len({frozenset(ids) for ids in seen.values()}) > 1  # not the same 4 every epoch


# ---- pretrained weights without a network --------------------------------------------------------------


@pytest.mark.parametrize("backbone", ["vit_small_patch14_reg4_dinov2", "alibi_vit_small_patch14_reg4_dinov2"])
@pytest.mark.parametrize("cause", ["no connection", "HF_HUB_OFFLINE"])
def test_no_weights_offline_fails_at_once_naming_the_way_out(backbone, cause, no_network, monkeypatch):
    import time

    import huggingface_hub

    if cause == "HF_HUB_OFFLINE":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(ValueError) as info:
        SegmentationProbeModule(backbone)  # pretrained by default: DINOv2's weights from the hub
    assert time.perf_counter() - start < 5.0  # no minute of download retries
    message = str(info.value)
    assert "\n" not in message and backbone in message
    assert "--model.backbone_checkpoint" in message and "--model.allow_random_init=true" in message
    assert ("HF_HUB_OFFLINE is set" in message) == (cause == "HF_HUB_OFFLINE")
    assert len(no_network) == (1 if cause == "no connection" else 0)  # one request, no retries


def test_cached_hub_weights_load_without_any_network(no_network, tmp_path):
    """Weights in the local Hugging Face cache are read from there; the unreachable hub is never asked."""
    import huggingface_hub
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(3)
    source = timm.create_model("vit_small_patch14_reg4_dinov2", num_classes=0, **TINY)
    snapshot = Path(huggingface_hub.constants.HF_HUB_CACHE) / "models--timm--vit_small_patch14_reg4_dinov2.lvd142m"
    (snapshot / "snapshots" / "abc123").mkdir(parents=True)
    (snapshot / "refs").mkdir()
    (snapshot / "refs" / "main").write_text("abc123")
    save_file({k: v.contiguous() for k, v in source.state_dict().items()},
              snapshot / "snapshots" / "abc123" / "model.safetensors")

    torch.manual_seed(4)  # a different random init, so equality below means the file was loaded
    probe = SegmentationProbeModule("vit_small_patch14_reg4_dinov2", backbone_kwargs=TINY)
    assert no_network == []
    loaded = probe.backbone.state_dict()
    assert set(loaded) == set(source.state_dict())
    for key, value in source.state_dict().items():
        assert torch.equal(loaded[key], value), key


def test_lightning_command_prints_the_offline_failure_as_one_line(no_network, monkeypatch, tmp_path, capsys):
    """`lightning fit --config configs/probe_voc12.yaml` with no weights offline: one line naming the way out, exit 2."""
    import huggingface_hub

    from datamodules.demo_voc import write_demo_voc
    from lit_modules.cli import main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    write_demo_voc(tmp_path / "voc")
    config = str(Path(__file__).resolve().parents[1] / "configs" / "probe_voc12.yaml")
    capsys.readouterr()
    assert main(["fit", "--config", config, f"--data.root={tmp_path / 'voc'}", "--trainer.accelerator=cpu",
                 f"--trainer.default_root_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lightning: error: "), err
    assert "--model.backbone_checkpoint" in err[0] and "--model.allow_random_init=true" in err[0]
