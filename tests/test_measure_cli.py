"""``alibi-vit segment measure``: what it writes (tables, JSON, plots that are not blank, instance labels) for a
PNG mask, a TIFF volume and a chunked zarr mosaic; bad input as one line with exit status 2; help and the
default metrics without PyTorch."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_measure_chunks import smooth_phases

from alibi_vit.cli.main import main
from tests.helpers import run_in_fresh_process


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _not_blank(path: Path) -> None:
    pixels = np.asarray(Image.open(path).convert("L"), float)
    assert pixels.std() > 5 and (pixels < 128).mean() > 0.005, f"{path} looks blank"


def test_measures_a_png_a_tiff_volume_and_a_zarr_mosaic(tmp_path, capsys):
    import tifffile
    import zarr

    Image.fromarray(smooth_phases((96, 120), seed=11) + 1).save(tmp_path / "sem_mask.png")
    Image.fromarray(np.full((96, 120), 7, np.uint8)).save(tmp_path / "sem.png")  # the image the mask segments
    tifffile.imwrite(tmp_path / "ct.tif", smooth_phases((24, 28, 32), seed=12, phases=2))
    store = zarr.create_array(str(tmp_path / "mosaic.zarr"), shape=(160, 200), chunks=(64, 64), dtype=np.uint8)
    store[:] = smooth_phases((160, 200), seed=13, phases=2)
    proba = np.full((96, 120), 0.25, np.float32)
    tifffile.imwrite(tmp_path / "sem_proba_1.tif", proba)
    out = tmp_path / "out"
    code = main(["segment", "measure", str(tmp_path / "sem_mask.png"), str(tmp_path / "ct.tif"),
                 str(tmp_path / "mosaic.zarr"), "--out", str(out), "--spacing", "0.5", "--unit", "um",
                 "--probabilities", str(tmp_path / "sem_proba_1.tif"), "--intensity-images", str(tmp_path),
                 "--instance-labels", "--block", "64",
                 "--radius", "8", "--quiet"])
    assert code == 0
    printed = capsys.readouterr()
    assert "| phase | fraction |" in printed.out and "no probability map" in printed.err
    fractions = _rows(out / "fractions.csv")
    assert {r["mask"] for r in fractions} == {str(tmp_path / n) for n in ("sem_mask.png", "ct.tif", "mosaic.zarr")}
    sem = [r for r in fractions if r["mask"].endswith("sem_mask.png")]
    assert sum(float(r["fraction"]) for r in sem) == pytest.approx(1)
    assert float(next(r for r in sem if r["phase"] == "1")["proba_fraction"]) == pytest.approx(0.25)
    assert "specific_surface_isotropic_per_um" in fractions[0]
    for name in ("interfaces", "s2", "objects_summary", "percolation", "chords", "rve"):
        assert _rows(out / f"{name}.csv"), name
    summary = json.loads((out / "ct_measure.json").read_text())
    assert summary["shape"] == [24, 28, 32] and summary["spacing"] == [0.5, 0.5, 0.5] and summary["unit"] == "um"
    assert {float(r["intensity_mean"]) for r in _rows(out / "sem_objects.csv")} == {7.0}
    objects = _rows(out / "mosaic_objects.csv")
    assert objects and {"equivalent_diameter", "border", "aspect_ratio", "centroid_y"} <= set(objects[0])
    for stem in ("sem", "ct", "mosaic"):
        for plot in ("fraction_vs_window", "s2", "sizes"):
            _not_blank(out / f"{stem}_{plot}.png")
            assert (out / f"{stem}_{plot}.svg").read_text().lstrip().startswith("<?xml")
        assert (out / f"{stem}_objects.tif").is_file()
    assert "Definitions, units" in (out / "report.md").read_text()


def test_a_region_is_measured_alone_and_global_metrics_refuse_past_the_memory_limit(tmp_path, capsys):
    import tifffile

    tifffile.imwrite(tmp_path / "ct.tif", smooth_phases((20, 24, 28), seed=14, phases=2))
    code = main(["segment", "measure", str(tmp_path / "ct.tif"), "--out", str(tmp_path / "o"), "--region",
                 "2:12,:,4:", "--no-plots", "--quiet", "--metrics", "fractions", "chords"])
    assert code == 0
    summary = json.loads((tmp_path / "o" / "ct_measure.json").read_text())
    assert summary["shape"] == [10, 24, 24] and summary["origin"] == [2, 0, 4]
    capsys.readouterr()
    code = main(["segment", "measure", str(tmp_path / "ct.tif"), "--out", str(tmp_path / "o"), "--metrics",
                 "chords", "--max-memory", "20kB", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--region 0:" in err and "works on the whole region" in err


def test_a_missing_library_names_the_extra(tmp_path, capsys, monkeypatch):
    Image.fromarray(smooth_phases((40, 40), seed=15, phases=2)).save(tmp_path / "m.png")
    monkeypatch.setitem(sys.modules, "porespy", None)  # import porespy now raises ImportError
    monkeypatch.setitem(sys.modules, "taufactor", None)
    for metric, library in (("thickness", "porespy"), ("tortuosity", "TauFactor")):
        code = main(["segment", "measure", str(tmp_path / "m.png"), "--out", str(tmp_path / "o"), "--metrics",
                     metric, "--quiet"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and library in err and 'pip install "alibi-vit[measure]"' in err


def _bad_inputs(folder: Path) -> None:
    import tifffile
    import zarr

    (folder / "broken.png").write_bytes(b"not a png")
    tifffile.imwrite(folder / "float.tif", np.random.default_rng(0).random((8, 8)).astype(np.float32))
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(folder / "ok.png")
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(folder / "rgb.png")
    zarr.create_array(str(folder / "empty.zarr"), shape=(0, 16), chunks=(1, 16), dtype=np.uint8)
    tifffile.imwrite(folder / "labels.tif", np.arange(64, dtype=np.uint16).reshape(8, 8) * 10)


@pytest.mark.parametrize("args, message", [
    (["broken.png"], "broken.png: cannot read the image"),
    (["float.tif"], "float.tif: values are float32 (not integers)"),
    (["rgb.png"], "rgb.png: has 3 colour channels"),
    (["empty.zarr"], "empty"),
    (["labels.tif"], "labels.tif: holds the value 630; a phase mask holds class values 0..255"),
    (["missing.png"], "missing.png: no such file or folder"),
    (["ok.png", "--spacing", "1,2,3"], "--spacing has 3 values but the mask has 2 axes"),
    (["ok.png", "--spacing", "a,b"], "--spacing expects numbers"),
    (["ok.png", "--region", "0:4"], "--region '0:4': expected 2 ranges"),
    (["ok.png", "--region", "0:4,5:99"], "x range 5:99 is empty or outside 0:8"),
    (["ok.png", "--max-memory", "lots"], "--max-memory expects a size"),
    (["ok.png", "--metrics", "volume"], "argument --metrics: invalid choice"),
])
def test_bad_input_is_one_line_without_traceback(tmp_path, args, message):
    _bad_inputs(tmp_path)
    result = run_in_fresh_process(["segment", "measure", *args, "--out", "o", "--quiet"], tmp_path)
    err = result.stderr.strip()
    assert result.returncode == 2 and "\n" not in err and "Traceback" not in err, err
    assert err.startswith("alibi-vit segment") and message in err, err
    assert result.stdout.strip().splitlines()[-1] == "torch not imported"


def test_help_and_default_metrics_never_import_torch(tmp_path):
    help_text = run_in_fresh_process(["segment", "measure", "--help"], tmp_path)
    assert help_text.returncode == 0 and "--probabilities" in help_text.stdout
    assert help_text.stdout.strip().splitlines()[-1] == "torch not imported"
    Image.fromarray(smooth_phases((64, 64), seed=16, phases=2)).save(tmp_path / "m.png")
    run = run_in_fresh_process(["segment", "measure", "m.png", "--out", "o", "--quiet", "--no-plots"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "torch not imported"


def test_segment_apply_measure_measures_the_masks_it_wrote(tmp_path, capsys):
    rng = np.random.default_rng(0)
    image = (rng.random((64, 64)) * 60).astype(np.uint8)
    image[:, 32:] += 150  # two phases: dark left, bright right
    labels = np.zeros((64, 64), np.uint8)
    labels[10:50, 5:20], labels[10:50, 44:60] = 1, 2
    for folder in ("images", "labels"):
        (tmp_path / folder).mkdir()
    Image.fromarray(image).save(tmp_path / "images" / "a.png")
    Image.fromarray(labels).save(tmp_path / "labels" / "a.png")
    assert main(["segment", "train", "--images", str(tmp_path / "images"), "--labels", str(tmp_path / "labels"),
                 "--out", str(tmp_path / "model")]) == 0
    assert main(["segment", "apply", "--model", str(tmp_path / "model"), "--images", str(tmp_path / "images"),
                 "--out", str(tmp_path / "out"), "--proba", "--measure"]) == 0
    rows = {r["phase"]: r for r in _rows(tmp_path / "out" / "measure" / "fractions.csv")}
    assert float(rows["1"]["fraction"]) == pytest.approx(0.5, abs=0.06)
    assert float(rows["1"]["proba_fraction"]) == pytest.approx(float(rows["1"]["fraction"]), abs=0.1)
    assert (tmp_path / "out" / "measure" / "a_s2.png").is_file()


def test_the_commands_metric_names_are_the_librarys():
    from alibi_vit.cli import segment_measure
    from alibi_vit.measure import analysis

    assert segment_measure.METRICS == analysis.METRICS
    assert segment_measure.DEFAULT_METRICS == analysis.DEFAULT_METRICS


def test_apply_to_ome_zarr_measures_with_the_multichannel_probabilities_it_wrote(tmp_path, capsys):
    """A mosaic streamed to OME-Zarr gets one ``<name>_proba.ome.zarr`` with a channel per class; its channels
    name their classes, and the probability view of each fraction is that channel's mean."""
    import tifffile
    import zarr

    rng = np.random.default_rng(1)
    image = (rng.random((96, 96)) * 60).astype(np.uint8)
    image[:, 48:] += 150
    labels = np.zeros((96, 96), np.uint8)
    labels[10:80, 5:30], labels[10:80, 60:90] = 1, 2
    for folder in ("images", "labels", "mosaics"):
        (tmp_path / folder).mkdir()
    Image.fromarray(image).save(tmp_path / "images" / "a.png")
    Image.fromarray(labels).save(tmp_path / "labels" / "a.png")
    tifffile.imwrite(tmp_path / "mosaics" / "a.tif", image, tile=(32, 32))  # tiled: segmented as a mosaic
    assert main(["segment", "train", "--images", str(tmp_path / "images"), "--labels", str(tmp_path / "labels"),
                 "--out", str(tmp_path / "model")]) == 0
    assert main(["segment", "apply", "--model", str(tmp_path / "model"), "--images", str(tmp_path / "mosaics"),
                 "--out", str(tmp_path / "out"), "--out-format", "ome-zarr", "--proba", "--measure"]) == 0
    store = zarr.open_group(str(tmp_path / "out" / "a_proba.ome.zarr"), mode="r")
    assert store.attrs["alibi_vit"]["channel_classes"] == [1, 2]
    assert [c["label"] for c in store.attrs["omero"]["channels"]] == ["class 1", "class 2"]
    proba = np.asarray(store["0"])
    rows = {r["phase"]: r for r in _rows(tmp_path / "out" / "measure" / "fractions.csv")}
    for channel, phase in enumerate(("1", "2")):
        assert float(rows[phase]["proba_fraction"]) == pytest.approx(proba[channel].mean(dtype=np.float64), rel=1e-6)
    mask = np.asarray(zarr.open_group(str(tmp_path / "out" / "a_mask.ome.zarr"), mode="r")["0"])
    assert float(rows["1"]["fraction"]) == pytest.approx((mask == 1).mean(), abs=1e-12)
    # Without the channel classes, the store is refused with the way out named.
    attrs = zarr.open_group(str(tmp_path / "out" / "a_proba.ome.zarr"), mode="r+").attrs
    del attrs["alibi_vit"]
    code = main(["segment", "measure", str(tmp_path / "out" / "a_mask.ome.zarr"), "--probabilities",
                 str(tmp_path / "out" / "a_proba.ome.zarr"), "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "does not say which class each of its 2 channels holds" in err and "_proba_<class>" in err
