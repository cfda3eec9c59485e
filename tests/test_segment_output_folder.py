"""``segment apply`` output folders: unique names, one run and one model per folder, masks and CSV that agree
(alibi_vit/trainable/output_folder.py)."""

import csv
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from alibi_vit.cli.main import main
from alibi_vit.trainable import scribbles, synthetic_micrograph
from alibi_vit.trainable.io import read_array
from alibi_vit.trainable.output_folder import LOCK_NAME, MANIFEST_NAME, OutputFolder, output_names


def _csv_rows(path):
    with open(path) as f:
        return {row["image"]: row for row in csv.DictReader(f) if row["image"] not in ("mean", "std")}


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("alibi-vit segment: error: "), err
    return err[-1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two trained models (different seeds of trees) and a folder with x.png beside x.tif, plus x.tif in a
    second folder: three images whose outputs would all be called x_mask.png."""
    root = tmp_path_factory.mktemp("outfolder")
    for d in ("a", "b", "labels"):
        (root / d).mkdir()
    for i, (folder, name) in enumerate([("a", "x.tif"), ("a", "x.png"), ("b", "x.tif")]):
        image, mask = synthetic_micrograph((48, 64), seed=i)
        if name.endswith(".png"):
            Image.fromarray(image.astype(np.uint16)).save(root / folder / name)  # 16-bit PNG, as the TIFFs
        else:
            tifffile.imwrite(root / folder / name, image)
    _, mask = synthetic_micrograph((48, 64), seed=0)
    Image.fromarray(scribbles(mask, 2, rng=0).astype(np.uint8)).save(root / "labels" / "x_labels.png")
    models = []
    for trees in (4, 6):
        models.append(root / f"model{trees}")
        assert main(["segment", "train", "--images", str(root / "a" / "x.tif"), "--labels", str(root / "labels"),
                     "--trees", str(trees), "--out", str(models[-1])]) == 0
    return root, models


def test_output_names_are_unique_and_say_where_they_come_from():
    files = [Path("a/x.png"), Path("a/x.tif"), Path("b/x.tif"), Path("a/y.tif"), Path("c/x_tif.png")]
    sources = [Path("a"), Path("a"), Path("b"), Path("a"), Path("c")]
    relative = [Path(f.name) for f in files]
    names, notes = output_names(files, sources, relative)
    by_file = {str(f): (n.folder.as_posix(), n.stem, n.row) for f, n in zip(files, names)}
    assert by_file == {"a/x.png": (".", "x", "x.png"),  # x.tif moved to a/ and b/, so x.png keeps its stem
                       "a/x.tif": ("a", "x", "a/x.tif"), "b/x.tif": ("b", "x", "b/x.tif"),
                       "a/y.tif": (".", "y", "y.tif"), "c/x_tif.png": (".", "x_tif", "x_tif.png")}
    assert len(notes) == 1 and "x.tif" in notes[0]
    # Same stem, different extension, same folder: the extension joins the stem; a real x_tif clashes then.
    files = [Path("x.png"), Path("x.tif"), Path("x_tif.png")]
    names, notes = output_names(files, [Path(".")] * 3, files)
    assert [n.stem for n in names] == ["x_png", "x_tif", "x_tif-2"]
    assert len({n.row for n in names}) == 3 and len(notes) == 2


def test_colliding_names_each_get_their_own_mask_and_csv_row(data, tmp_path, capsys):
    from alibi_vit.trainable import TrainableSegmenter

    root, (model, _) = data
    out = tmp_path / "out"
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "a"), str(root / "b"),
                 "--out", str(out)]) == 0
    assert "segmented 3 of 3" in capsys.readouterr().out
    seg = TrainableSegmenter.load(model)
    expected = {"x.png": (out / "x_mask.png", root / "a" / "x.png"),
                "a/x.tif": (out / "a" / "x_mask.png", root / "a" / "x.tif"),
                "b/x.tif": (out / "b" / "x_mask.png", root / "b" / "x.tif")}
    rows = _csv_rows(out / "area_fractions.csv")
    assert set(rows) == set(expected)
    for name, (mask_path, image_path) in expected.items():
        mask = np.asarray(Image.open(mask_path))
        np.testing.assert_array_equal(mask, seg.predict([read_array(image_path)])[0])  # each its own image's
        assert int(rows[name]["pixels_1"]) == int((mask == 1).sum())
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["complete"] and set(manifest["images"]) == set(expected)
    assert not (out / LOCK_NAME).exists()


def test_links_and_link_loops_are_followed_to_each_real_image_once(data, tmp_path, capsys):
    """A folder holding ``self -> .`` (a loop: 40 levels deep before the system refuses) and a link to its
    image: --recursive segments the one real image once, and its CSV holds one row."""
    from alibi_vit.trainable.io import list_image_files

    root, (model, _) = data
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "x.tif").write_bytes((root / "a" / "x.tif").read_bytes())
    (folder / "self").symlink_to(".")
    (folder / "link.tif").symlink_to("x.tif")
    assert list_image_files([folder], recursive=True) == [folder / "x.tif"]
    other = tmp_path / "in2"  # a link to a folder above: another loop
    (other / "sub").mkdir(parents=True)
    (other / "x.tif").symlink_to(folder / "x.tif")
    (other / "sub" / "up").symlink_to("..")
    assert list_image_files([other], recursive=True) == [other / "x.tif"]
    assert list_image_files([folder, folder / "x.tif", folder / "self"], recursive=True) == [folder / "x.tif"]
    out = tmp_path / "out"
    assert main(["segment", "apply", "--model", str(model), "--images", str(folder), str(folder / "self"),
                 "--recursive", "--out", str(out)]) == 0
    assert "segmented 1 of 1" in capsys.readouterr().out
    assert set(_csv_rows(out / "area_fractions.csv")) == {"x.tif"}
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*_mask.png")) == ["x_mask.png"]


def test_a_full_disk_names_the_file_and_leaves_no_lock(data, tmp_path, capsys, monkeypatch):
    """The disk fills up while the lock, a mask, the CSV or the colour key is written: one line naming that
    file, exit status 2, no lock left behind (the next run is not refused) and no partial file."""
    from tests.helpers import full_disk

    root, (model, _) = data
    cases = [(LOCK_NAME, f"{LOCK_NAME}: No space left on device"),
             ("x_mask.png", "x_mask.png: No space left on device; outputs written before stay valid"),
             ("area_fractions", "area_fractions.csv: No space left on device; outputs written before stay valid"),
             ("colour_key", "colour_key.png: No space left on device")]
    for i, (name, named) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with monkeypatch.context() as patched:
            full_disk(patched, lambda path: path.startswith(str(out)) and name in Path(path).name)
            assert main(["segment", "apply", "--model", str(model), "--images", str(root / "b"),
                         "--out", str(out)]) == 2
        err = _one_line_error(capsys)
        assert err.startswith("alibi-vit segment: error: ") and str(out) in err and err.endswith(named), err
        assert not (out / LOCK_NAME).exists() and not [p for p in out.rglob("*") if ".tmp" in p.name
                                                       or ".part" in p.name]
    # No stale lock: a run on the freed disk goes ahead.
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "b"),
                 "--out", str(tmp_path / "out0")]) == 0


def test_a_folder_of_another_model_or_crf_is_refused_naming_the_difference(data, tmp_path, capsys):
    root, (model, other) = data
    out = tmp_path / "out"
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "b"), "--out", str(out)]) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["segment", "apply", "--model", str(other), "--images", str(root / "b"), "--out", str(out)]) == 2
    err = _one_line_error(capsys)
    assert "another model" in err and str(model) in err and str(other) in err
    assert main(["segment", "apply", "--model", str(model), "--crf", "on", "--images", str(root / "b"),
                 "--out", str(out)]) == 2
    assert "crf off there, gentle now" in _one_line_error(capsys)  # --crf on: the default preset, gentle
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # nothing touched


def test_masks_without_a_manifest_are_refused(data, tmp_path, capsys):
    root, (model, _) = data
    out = tmp_path / "out"
    out.mkdir()
    Image.fromarray(np.zeros((4, 4), np.uint8)).save(out / "old_mask.png")
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "b"), "--out", str(out)]) == 2
    assert "no segment_run.json accounts for (old_mask.png)" in _one_line_error(capsys)


def test_a_second_run_of_the_same_model_keeps_earlier_images_and_replaces_changed_outputs(data, tmp_path):
    root, (model, _) = data
    out = tmp_path / "out"
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "a"), "--out", str(out)]) == 0
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "a" / "x.tif"),
                 "--format", "tif", "--no-overlay", "--out", str(out)]) == 0
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    # x.tif alone now: its outputs are x_mask.tif (the earlier x_tif_mask.png and overlay are gone);
    # x.png of the first run keeps its mask and its row.
    assert "x_mask.tif" in files and "x_tif_mask.png" not in files and "x_tif_overlay.png" not in files
    assert "x_png_mask.png" in files
    assert set(_csv_rows(out / "area_fractions.csv")) == {"x.png", "x.tif"}


def test_a_live_lock_refuses_a_second_run_and_a_dead_ones_is_taken_over(data, tmp_path, capsys):
    root, (model, _) = data
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": "then"}))
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "b"), "--out", str(out)]) == 2
    err = _one_line_error(capsys)
    assert f"being written by process {os.getppid()} on {socket.gethostname()}" in err
    assert not (out / "x_mask.png").exists()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (out / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "started": "then"}))
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "b"), "--out", str(out)]) == 0
    assert f"taking over the lock of process {gone.pid}" in capsys.readouterr().err
    assert (out / "x_mask.png").is_file() and not (out / LOCK_NAME).exists()


def test_ctrl_c_leaves_masks_and_csv_that_agree(data, tmp_path, capsys, monkeypatch):
    from alibi_vit.trainable import TrainableSegmenter

    root, (model, _) = data
    out = tmp_path / "out"
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "b"), "--out", str(out)]) == 0
    calls = []
    original = TrainableSegmenter.mask_from_proba

    def interrupted_on_the_second_image(self, proba):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, proba)

    monkeypatch.setattr(TrainableSegmenter, "mask_from_proba", interrupted_on_the_second_image)
    assert main(["segment", "apply", "--model", str(model), "--images", str(root / "a"), "--out", str(out)]) == 130
    assert "interrupted" in capsys.readouterr().err
    masks = sorted(p.relative_to(out).as_posix() for p in out.rglob("*_mask.png"))
    assert masks == ["x_mask.png", "x_png_mask.png"]  # b's x.tif from the first run, a's first image
    assert set(_csv_rows(out / "area_fractions.csv")) == {"x.tif", "x.png"}
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert manifest["complete"] is False
    assert sorted(o for image in manifest["images"].values() for o in image["outputs"] if "_mask" in o) == masks
    assert not (out / LOCK_NAME).exists() and not (out / ".segment.partial").exists()


def test_sigterm_inside_a_run_writes_the_csv_and_releases_the_lock(tmp_path):
    written, handler = [], signal.getsignal(signal.SIGTERM)

    def write_csv(path, names, counts):
        Path(path).write_text(",".join(names))
        written.append(names)

    with pytest.raises(SystemExit) as stop:
        with OutputFolder(tmp_path, {"model_digest": "d", "crf": "off", "modal": 0}, write_csv) as folder:
            (folder.stage("m.png", tmp_path) / "m_mask.png").write_bytes(b"1")
            folder.commit("m.png", tmp_path / "m.png", [("m.png", [1], 1)])
            (folder.stage("n.png", tmp_path) / "n_mask.png").write_bytes(b"1")  # staged, not committed
            os.kill(os.getpid(), signal.SIGTERM)
    assert stop.value.code == 128 + signal.SIGTERM
    assert written[-1] == ["m.png"] and (tmp_path / "area_fractions.csv").read_text() == "m.png"
    assert (tmp_path / "m_mask.png").is_file() and not (tmp_path / "n_mask.png").exists()
    assert not (tmp_path / LOCK_NAME).exists()
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
