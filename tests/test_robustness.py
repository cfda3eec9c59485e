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
