"""``alibi-vit overcluster`` on a generated VOC-layout set, with a tiny random-init backbone."""

import csv
from functools import partial

import pytest
import torch

from alibi_vit import create_backbone, patch_features
from alibi_vit.cli import overcluster as overcluster_cli
import numpy as np

from alibi_vit.analysis.overclustering import overclustering_seeds
from alibi_vit.analysis.rasa import fold_planes
from datamodules.demo_voc import write_demo_voc
from tests.helpers import run_subcommand

KWARGS = ["--model-arg", "depth=2", "--model-arg", "embed_dim=48", "--model-arg", "num_heads=2"]
TINY = dict(depth=2, embed_dim=48, num_heads=2)


_run = partial(run_subcommand, overcluster_cli)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def voc(tmp_path_factory):
    return write_demo_voc(tmp_path_factory.mktemp("voc"), n_train=1, n_val=6)


def test_overcluster_matches_direct_computation(voc, tmp_path, capsys):
    torch.manual_seed(0)
    model = create_backbone("vit_small_patch14_reg4_dinov2", **TINY).eval()
    planes = [torch.randn(2, 48)]
    path = tmp_path / "rasa.pth"
    torch.save(fold_planes(model, planes).state_dict(), path)
    out = tmp_path / "oc.csv"
    assert _run(["--backbone", "vit_small_patch14_reg4_dinov2", "--checkpoint", str(path), *KWARGS,
                 "--data.root", str(voc), "--k", "21", "25", "--size", "56", "--num-workers", "0",
                 "--batch-size", "4", "--seeds", "0", "3", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [int(r["k"]) for r in rows] == [21, 25]
    assert int(rows[0]["patches"]) == 6 * 4 * 4 and rows[0]["seeds"] == "0 3" and rows[0]["absent"] == "zero"
    assert rows[0]["recipe"] == "leopart" and rows[0]["mask_size"] == "100"
    assert "IoU_background" in rows[0] and "recipe leopart" in capsys.readouterr().out
    first_line = (tmp_path / "oc.md").read_text().splitlines()[0]
    assert "does not compare with Leopart's OverClustering tables" in first_line
    assert "56 px (the reference: 448)" in first_line and "6 images (the reference: 1440)" in first_line

    # the same numbers from the pieces: VOC val images stretched to 56 px, RASA-folded features, masks at 100 px
    dm = overcluster_cli.voc_datamodule(voc, size=56, batch_size=6, num_workers=0)
    batch = next(iter(dm.val_dataloader()))
    with torch.no_grad():
        feats = patch_features(fold_planes(model, planes), batch["image"])
    maps = feats.permute(0, 2, 3, 1).half().numpy()
    # nearest 56 → 100 px: pixel i takes label pixel ⌊i·56/100⌋
    idx = np.arange(100) * 56 // 100
    masks = batch["label"].numpy()[:, idx][:, :, idx]
    assert int(rows[0]["scored_pixels"]) == int((masks != 255).sum())
    for row in rows:
        expected = overclustering_seeds(maps, masks, int(row["k"]), 21, seeds=(0, 3))
        assert float(row["mIoU"]) == pytest.approx(expected.miou, abs=1e-6)
        assert float(row["mIoU_std"]) == pytest.approx(expected.std, abs=1e-6)
        assert [float(v) for v in row["mIoU_per_seed"].split()] == pytest.approx(expected.mious.tolist(), abs=1e-6)


def test_comparison_names_the_reference_table_or_the_departures():
    from alibi_vit.analysis.overclustering import RECIPES

    leopart = {"size": 448, "mask_size": 100, "seeds": (0, 1, 2, 3, 4)}
    assert overcluster_cli.comparison(RECIPES["leopart"], leopart, 1440, 2012, "val") == \
        "compares with Leopart's OverClustering tables (Ziegler & Asano 2022, VOC12 val)"
    rasa = {"size": 224, "mask_size": 224, "seeds": (1,)}
    assert overcluster_cli.comparison(RECIPES["rasa"], rasa, 640, 2012, "val").startswith("compares with the RASA")
    text = overcluster_cli.comparison(RECIPES["rasa"], {**rasa, "seeds": (0, 1)}, 320, 2007, "val")
    assert text.startswith("does not compare with the RASA") and "320 images (the reference: 640)" in text
    assert "0 1 as seeds (the reference: 1)" in text and "VOC2007 val split (the reference: VOC2012 val)" in text
    # kmeans++ compares with nothing, whatever its inputs
    assert overcluster_cli.comparison(RECIPES["kmeans++"], leopart, 10, 2012, "val") == \
        "compares with no reference table (not the references' k-means)"


def test_rasa_recipe_clusters_pixels_of_the_first_images(voc, tmp_path):
    torch.manual_seed(0)
    model = create_backbone("vit_small_patch14_reg4_dinov2", **TINY).eval()
    path = tmp_path / "tiny.pth"
    torch.save(model.state_dict(), path)
    out = tmp_path / "rasa.csv"
    assert _run(["--backbone", "vit_small_patch14_reg4_dinov2", "--checkpoint", str(path), *KWARGS,
                 "--data.root", str(voc), "--recipe", "rasa", "--k", "21", "--size", "56", "--max-images", "4",
                 "--num-workers", "0", "--out", str(out)]) == 0
    (row,) = list(csv.DictReader(open(out)))
    # the recipe's defaults: one seed (1), masks at the image size, every pixel of the first 4 images clustered
    assert (row["recipe"], row["seeds"], row["mask_size"], row["images"]) == ("rasa", "1", "56", "4")
    assert int(row["points"]) == 4 * 56 * 56
    dm = overcluster_cli.voc_datamodule(voc, size=56, batch_size=4, num_workers=0)
    batch = next(iter(dm.val_dataloader()))
    with torch.no_grad():
        maps = patch_features(model, batch["image"]).permute(0, 2, 3, 1).half().numpy()
    expected = overclustering_seeds(maps, batch["label"].numpy(), 21, 21, recipe="rasa")
    assert float(row["mIoU"]) == pytest.approx(expected.miou, abs=1e-6)


def test_overcluster_bad_k(voc, tmp_path):
    with pytest.raises(ValueError, match="fewer than VOC's 21 classes"):
        _run(["--backbone", "vit_small_patch14_reg4_dinov2", *KWARGS, "--data.root", str(voc), "--k", "10",
              "--out", str(tmp_path / "x.csv")])


def test_overcluster_bad_size(voc, tmp_path):
    with pytest.raises(ValueError, match="not a multiple of the patch size"):
        _run(["--backbone", "vit_small_patch14_reg4_dinov2", *KWARGS, "--data.root", str(voc), "--size", "50",
              "--num-workers", "0", "--out", str(tmp_path / "x.csv")])


@pytest.mark.filterwarnings("ignore:.*does not have many workers", "ignore:The number of training batches")
def test_comparison_table(voc, tmp_path):
    import lightning as L

    from alibi_vit.analysis.probe import positional_r2
    from alibi_vit.images import load_image_set, normalize
    from datamodules.segmentation import VOCSegmentation
    from lit_modules.segmentation_probe import SegmentationProbeModule

    torch.manual_seed(0)
    model = create_backbone("vit_small_patch14_reg4_dinov2", **TINY).eval()
    rasa = tmp_path / "rasa.pth"
    torch.save(fold_planes(model, [torch.randn(2, 48)]).state_dict(), rasa)
    plain = tmp_path / "plain.pth"
    torch.save(model.state_dict(), plain)
    # a (barely) trained probe on the same tiny backbone
    probe = SegmentationProbeModule("vit_small_patch14_reg4_dinov2", backbone_checkpoint=str(plain),
                                    backbone_kwargs=TINY)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(probe, datamodule=VOCSegmentation(str(voc), image_size=56, batch_size=2, num_workers=0))
    trainer.save_checkpoint(tmp_path / "probe.ckpt")

    out = tmp_path / "cmp.csv"
    assert _run(["--backbone", "dinov2=vit_small_patch14_reg4_dinov2", "dinov2+rasa=vit_small_patch14_reg4_dinov2",
                 "--checkpoint", f"dinov2={plain}", "--checkpoint", f"dinov2+rasa={rasa}", *KWARGS,
                 "--data.root", str(voc), "--k", "21", "30", "--size", "56", "--num-workers", "0",
                 "--r2-images", "noise", "--r2-size", "112", "--probe-checkpoint", f"dinov2={tmp_path / 'probe.ckpt'}",
                 "--out", str(out)]) == 0
    lines = (tmp_path / "cmp.md").read_text().splitlines()
    assert lines[0].startswith("OverClustering recipe `leopart` (6 images at 56 px)")
    assert lines[2] == "| backbone | weights | R² noise | OC k=21 | OC k=30 | probe mIoU |"
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:]]
    assert [c[0] for c in cells] == ["dinov2", "dinov2+rasa"]
    # R² column: the positional probe of the plain backbone on the same noise images
    images = torch.stack([normalize(img) for _, img in load_image_set("noise", 112)])
    with torch.no_grad():
        expected = positional_r2(patch_features(model, images), "xy")
    assert float(cells[0][2]) == pytest.approx(expected, abs=1e-3)
    # every mIoU is a fraction, as robustness and the probe report it: the table shows the CSV's values
    assert 0 <= float(cells[0][5]) <= 1 and cells[1][5] == ""
    with open(out) as f:
        csv_rows = list(csv.DictReader(f))
    assert cells[0][3] == f"{float(csv_rows[0]['mIoU']):.3f} ± {float(csv_rows[0]['mIoU_std']):.3f}" and float(csv_rows[0]["probe_mIoU"]) <= 1
