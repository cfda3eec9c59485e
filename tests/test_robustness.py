"""Robustness evaluation (paper Tab. S3): transforms, their inverses on features, the command."""

import csv

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import alibi_vit
from alibi_vit.cli import main
from datamodules.segmentation import VOCSegmentation, write_synthetic_voc
from lit_modules.robustness import TRANSFORMS, evaluate_robustness, make_transform
from lit_modules.segmentation_probe import SegmentationProbeModule

TINY = dict(depth=2, embed_dim=48, num_heads=2)


def patch_means(images: torch.Tensor) -> torch.Tensor:
    """A position-free 'backbone' whose features are each patch's mean colour."""
    return F.avg_pool2d(images, 14)


@pytest.mark.parametrize("name", TRANSFORMS)
@pytest.mark.parametrize("roll", [(1, 2), (2, 3)])
def test_inverse_on_features_undoes_the_image_transform(name, roll):
    images = torch.rand(2, 3, 56, 84)  # 4×6 patches: rectangular, so rot90 changes the grid shape
    t = make_transform(name, (14, 14), roll)
    transformed = patch_means(t.image(images))
    torch.testing.assert_close(t.features_inverse(transformed), patch_means(images), atol=1e-6, rtol=0)
    if name != "none":  # and the transform really moved the patches
        assert transformed.shape != patch_means(images).shape or not torch.allclose(transformed, patch_means(images))


def test_roll_moves_images_by_whole_patches_with_wraparound():
    image = torch.arange(28 * 42, dtype=torch.float32).view(1, 1, 28, 42)
    rolled = make_transform("roll", (14, 14), (1, 2)).image(image)
    assert torch.equal(rolled[..., 14:, 28:], image[..., :14, :14])  # top-left patch moved down 1, right 2
    assert torch.equal(rolled[..., :14, :14], image[..., 14:, 14:28])  # wrapped in from the bottom/right


@pytest.fixture(scope="module")
def voc_root(tmp_path_factory):
    return write_synthetic_voc(tmp_path_factory.mktemp("voc"), n_train=4, n_val=4, seed=3)


def test_wrapped_alibi_features_roll_exactly_so_roll_equals_none(voc_root):
    torch.manual_seed(0)
    probe = SegmentationProbeModule("alibi_vit_small_patch14_reg4_dinov2", backbone_kwargs=TINY,
                                    allow_random_init=True).eval()
    images = torch.randn(2, 3, 56, 70)
    roll = make_transform("roll", (14, 14), (2, 3))
    torch.testing.assert_close(roll.features_inverse(probe.backbone_features(roll.image(images))),
                               probe.backbone_features(images), atol=1e-5, rtol=1e-5)

    dm = VOCSegmentation(str(voc_root), image_size=56, batch_size=2, num_workers=0)
    dm.setup("validate")
    scores = evaluate_robustness(probe, dm.val_dataloader(), device="cpu")
    assert set(scores) == set(TRANSFORMS)
    assert scores["roll"] == pytest.approx(scores["none"], abs=1e-6)


def test_robustness_miou_leaves_absent_classes_out(monkeypatch):
    """21 VOC classes, a few present: the score is the mean over the present ones only."""
    import numpy as np
    import torchmetrics.classification.jaccard as tm_jaccard

    # a torchmetrics release whose macro mean scored absent classes 0 must not change the result
    monkeypatch.setattr(tm_jaccard, "_jaccard_index_reduce",
                        lambda confmat, average, *args, **kwargs: (confmat.diag() / (
                            confmat.sum(0) + confmat.sum(1) - confmat.diag()).clamp_min(1)).mean())
    torch.manual_seed(0)
    probe = SegmentationProbeModule("alibi_vit_small_patch14_reg4_dinov2", backbone_kwargs=TINY,
                                    allow_random_init=True).eval()
    images = torch.randn(2, 3, 28, 42)
    labels = torch.randint(0, 2, (2, 28, 42))
    labels[:, :3] = 255
    scores = evaluate_robustness(probe, [{"image": images, "label": labels}], transforms=("none",))
    with torch.no_grad():
        preds = probe.head_logits(probe.backbone_features(images), labels.shape[-2:]).argmax(1)
    valid = labels != 255
    p, t = preds[valid].numpy(), labels[valid].numpy()
    ious = [np.sum((p == c) & (t == c)) / np.sum((p == c) | (t == c)) for c in range(21) if np.any((p == c) | (t == c))]
    assert len(ious) < 21
    assert scores["none"] == pytest.approx(np.mean(ious), abs=1e-6)


def test_learned_position_embeddings_are_not_roll_equivariant():
    """Control: DINOv2's architecture (learned pos_embed) does not roll its features with the image."""
    torch.manual_seed(0)
    model = alibi_vit.create_backbone("vit_small_patch14_reg4_dinov2", **TINY).eval()
    images = torch.randn(1, 3, 56, 70)
    roll = make_transform("roll", (14, 14), (2, 3))
    with torch.no_grad():
        moved = roll.features_inverse(alibi_vit.patch_features(model, roll.image(images)))
        plain = alibi_vit.patch_features(model, images)
    assert (moved - plain).abs().max() > 1e-3


def test_robustness_command_prints_table_and_writes_csv(voc_root, tmp_path, capsys):
    L.seed_everything(0)
    dm = VOCSegmentation(str(voc_root), image_size=42, batch_size=4, num_workers=0)
    probe = SegmentationProbeModule("alibi_vit_small_patch14_reg4_dinov2", backbone_kwargs=TINY,
                                    allow_random_init=True, lr=2e-2)
    trainer = L.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(probe, datamodule=dm)
    ckpt = tmp_path / "probe.ckpt"
    trainer.save_checkpoint(ckpt)

    out = tmp_path / "robustness.csv"
    # dataset root, size and resize mode come from the checkpoint's stored datamodule settings
    assert main(["robustness", "--checkpoint", f"alibi={ckpt}", str(ckpt), "--num-workers", "0",
                 "--batch-size", "3", "--csv", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| backbone | none | flip-ud | roll | rot90 |" in printed and "42x42" in printed
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [r["backbone"] for r in rows] == ["alibi", "alibi_vit_small_patch14_reg4_dinov2"]
    for row in rows:
        scores = {t: float(row[t]) for t in TRANSFORMS}
        assert all(0.0 <= s <= 1.0 for s in scores.values())
        assert scores["roll"] == scores["none"]
    assert rows[0]["none"] == rows[1]["none"]  # the same checkpoint twice

    # bad input is a one-line error and exit status 2
    assert main(["robustness", "--checkpoint", str(tmp_path / "missing.ckpt"), "--data.root", str(voc_root)]) == 2
    assert "missing.ckpt does not exist" in capsys.readouterr().err
    assert main(["robustness", "--checkpoint", str(ckpt), "--dataset", "ade20k", "--data.root",
                 str(_ade_fixture(tmp_path)), "--num-workers", "0", "--csv", str(out)]) == 2
    assert "21 classes, ade20k has 150" in capsys.readouterr().err


def _ade_fixture(tmp_path):
    import numpy as np
    from PIL import Image

    base = tmp_path / "ade" / "ADEChallengeData2016"
    for sub in ("images/validation", "annotations/validation"):
        (base / sub).mkdir(parents=True)
    Image.fromarray(np.zeros((42, 42, 3), np.uint8)).save(base / "images/validation/a.jpg")
    Image.fromarray(np.ones((42, 42), np.uint8)).save(base / "annotations/validation/a.png")
    return tmp_path / "ade"


# ---- the offline demo, and files that are not probe checkpoints --------------------------------------


def test_demo_voc_writes_a_voc_layout_set(tmp_path, capsys):
    from datamodules.demo_voc import main as demo_main

    assert demo_main([str(tmp_path / "voc"), "--train", "3", "--val", "2"]) == 0
    assert "wrote 3 training and 2 validation images" in capsys.readouterr().out
    dm = VOCSegmentation(str(tmp_path / "voc"), image_size=28, num_workers=0)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (3, 2)
    labels = {int(v) for i in range(2) for v in dm.val_set[i]["label"].unique()}
    assert 0 in labels and 255 in labels and labels <= {0, 1, 2, 3, 255}  # background, 3 colour classes, borders


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_probe_demo_config_then_robustness_run_offline(tmp_path, monkeypatch, capsys):
    """configs/probe_demo.yaml: generates its data, trains, and `alibi-vit robustness` reads its checkpoint."""
    from pathlib import Path

    import huggingface_hub

    from lit_modules.cli import main as lightning_main

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # nothing may be downloaded
    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[1] / "configs" / "probe_demo.yaml"
    lightning_main(["fit", "--config", str(config), "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false"])
    assert (tmp_path / "runs/probe_demo/voc/VOCdevkit/VOC2012/ImageSets/Segmentation/val.txt").is_file()
    ckpt = tmp_path / "runs/probe_demo/checkpoints/last.ckpt"
    assert ckpt.is_file()
    assert torch.load(ckpt, weights_only=True)["global_step"] == 2 * 4  # the final step: 2 epochs of 32 / 8 images

    capsys.readouterr()
    assert main(["robustness", "--checkpoint", str(ckpt), "--num-workers", "0",
                 "--csv", "runs/probe_demo/robustness.csv"]) == 0
    assert "mIoU on voc2012 val (8 images, 70x70 px" in capsys.readouterr().out
    with open(tmp_path / "runs/probe_demo/robustness.csv") as f:
        [row] = list(csv.DictReader(f))
    assert float(row["roll"]) == float(row["none"]) > 0.3  # wrapped ALiBi: rolling changes nothing

    # a mistyped root is an error showing the layout, never a freshly generated demo set
    assert main(["robustness", "--checkpoint", str(ckpt), "--num-workers", "0", "--data.root", "runs/probe_dmeo/voc",
                 "--csv", "runs/typo.csv"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("alibi-vit robustness: error: the demo VOC set is not in runs/probe_dmeo/voc")
    assert "expected layout:" in err and "JPEGImages" in err
    assert not (tmp_path / "runs/probe_dmeo").exists() and not (tmp_path / "runs/typo.csv").exists()


def _tiny_probe_checkpoint(path, voc_root):
    probe = SegmentationProbeModule("alibi_vit_small_patch14_reg4_dinov2", backbone_kwargs=TINY,
                                    allow_random_init=True)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=1, limit_val_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(probe, datamodule=VOCSegmentation(str(voc_root), image_size=28, batch_size=2, num_workers=0))
    trainer.save_checkpoint(path)
    return path


def test_corrupt_checkpoints_are_one_line_errors(voc_root, tmp_path, capsys):
    good = _tiny_probe_checkpoint(tmp_path / "probe.ckpt", voc_root).read_bytes()
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(good[: len(good) // 2])  # a copy cut short
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"PK" + bytes(range(256)) * 4)  # a zip header, then nonsense
    pickled = tmp_path / "pickled.ckpt"  # a pickle of an arbitrary object: refused by the weights-only loader
    import pickle

    pickled.write_bytes(pickle.dumps({"state_dict": {}, "model": L.Trainer}))
    for path in (truncated, garbage, pickled):
        capsys.readouterr()
        assert main(["robustness", "--checkpoint", str(path), "--data.root", str(voc_root)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"alibi-vit robustness: error: cannot read probe checkpoint {path}: "), err
        assert "\n" not in err and "weights_only=False" not in err and "Traceback" not in err
    text = tmp_path / "config.ckpt"
    text.write_text("model: {}\n")  # not a PyTorch file at all
    assert main(["robustness", "--checkpoint", str(text), "--data.root", str(voc_root)]) == 2
    assert capsys.readouterr().err.strip() == (f"alibi-vit robustness: error: {text} is not a PyTorch checkpoint file "
                                               "(neither a torch.save zip archive nor a pickle); pass the Lightning "
                                               ".ckpt of a trained segmentation probe")


def test_distillation_checkpoint_is_refused_by_name(voc_root, tmp_path, capsys):
    from lit_modules.distillation import DistillationModule

    torch.manual_seed(0)
    module = DistillationModule(teacher="vit_small_patch14_reg4_dinov2", student="alibi_vit_small_patch14_reg4_dinov2",
                                teacher_pretrained=False, model_kwargs=TINY, student_kwargs={"backend": "sdpa"},
                                blank_channels=[5, 47])
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    trainer.strategy.connect(module)
    path = tmp_path / "distill.ckpt"
    trainer.save_checkpoint(path)
    assert main(["robustness", "--checkpoint", str(path), "--data.root", str(voc_root)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"alibi-vit robustness: error: {path} is a checkpoint without a probe head"), err
    assert "(its weights: student)" in err and "\n" not in err

    # the same checkpoint as the `lightning` command writes it names the module's class
    ckpt = torch.load(path, weights_only=True)
    ckpt["hyper_parameters"]["_class_path"] = "lit_modules.distillation.DistillationModule"
    torch.save(ckpt, path)
    assert main(["robustness", "--checkpoint", str(path), "--data.root", str(voc_root)]) == 2
    assert "is a checkpoint of lit_modules.distillation.DistillationModule, not of a segmentation probe" in \
        capsys.readouterr().err

    # an exported backbone state_dict is not a Lightning checkpoint
    state = tmp_path / "backbone.pth"
    torch.save(module.student.state_dict(), state)
    assert main(["robustness", "--checkpoint", str(state), "--data.root", str(voc_root)]) == 2
    assert "is not a Lightning checkpoint" in capsys.readouterr().err


def test_a_roll_that_wraps_to_none_is_refused_and_a_wrapped_roll_is_reported_as_such(voc_root, tmp_path, capsys):
    ckpt = _tiny_probe_checkpoint(tmp_path / "probe.ckpt", voc_root)  # 28 px images: a 2×2 patch grid
    common = ["robustness", "--checkpoint", str(ckpt), "--num-workers", "0", "--transforms", "none", "roll"]
    assert main([*common, "--roll", "4", "6", "--csv", str(tmp_path / "none.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--roll 4 6 wraps around the 2×2 patch grid to no roll at all" in err
    assert not (tmp_path / "none.csv").exists()
    assert main([*common, "--roll", "3", "4", "--csv", str(tmp_path / "wrapped.csv")]) == 0
    assert "--roll 3 4 on the 2×2 patch grid is a roll of 1 0 patches" in capsys.readouterr().err
    with open(tmp_path / "wrapped.csv") as f:
        assert [row["roll_patches"] for row in csv.DictReader(f)] == ["1 0"]
