"""A first segmentation on classical features (the CPU default) starts without PyTorch (the command line also
without scikit-learn), and XGBoost loads while the features are computed: checked in fresh processes, where
imports are what they cost a user."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from alibi_vit.trainable.segmenter import default_device
from tests.helpers import run_in_fresh_process

NO_GPU_DRIVER = sys.platform.startswith("linux") and not any(
    os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/kfd", "/dev/dxg"))
needs_no_gpu_driver = pytest.mark.skipif(not NO_GPU_DRIVER, reason="with a GPU driver, torch is asked for the device")

# Run the command in this process as the console script does (main() reading sys.argv), then list which of the
# heavy modules were imported on the way.
_PROBE = ("import sys\nfrom alibi_vit.cli.main import main\ntry:\n    code = main()\n"
          "except SystemExit as stop:\n    code = stop.code\n"
          "print(sorted({'torch', 'timm', 'xgboost', 'zarr', 'sklearn', 'alibi_vit.trainable._xgboost'} & set(sys.modules)))\n"
          "sys.exit(code)\n")


def _image_and_labels(folder: Path):
    rng = np.random.default_rng(0)
    image = (rng.random((64, 64)) * 60).astype(np.uint8)
    image[:, 32:] += 150  # two phases: dark left, bright right
    labels = np.zeros((64, 64), np.uint8)
    labels[10:50, 5:20], labels[10:50, 44:60] = 1, 2
    (folder / "images").mkdir()
    (folder / "labels").mkdir()
    Image.fromarray(image).save(folder / "images" / "a.png")
    Image.fromarray(labels).save(folder / "labels" / "a.png")
    (folder / "tiffs").mkdir()
    Image.fromarray(image).save(folder / "tiffs" / "a.tif")


def test_default_device_agrees_with_torch():
    import torch

    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")


@needs_no_gpu_driver
def test_segment_train_and_apply_never_import_torch(tmp_path):
    """Nor zarr, for a TIFF that is not tiled (read by memory map), nor scikit-learn: XGBoost is imported without
    it, under a private name (the process's own ``xgboost`` is left unimported)."""
    _image_and_labels(tmp_path)
    train = run_in_fresh_process(["segment", "train", "--images", "images", "--labels", "labels", "--out", "model"],
                                 tmp_path, _PROBE, timeout=300)
    assert train.returncode == 0, train.stderr
    assert train.stdout.strip().splitlines()[-1] == "['alibi_vit.trainable._xgboost']"
    apply = run_in_fresh_process(["segment", "apply", "--model", "model", "--images", "tiffs", "--out", "out"],
                                 tmp_path, _PROBE, timeout=300)
    assert apply.returncode == 0, apply.stderr
    assert apply.stdout.strip().splitlines()[-1] == "['alibi_vit.trainable._xgboost']"
    mask = np.asarray(Image.open(tmp_path / "out" / "a_mask.png"))
    assert (mask[:, :28] == 1).mean() > 0.95 and (mask[:, 36:] == 2).mean() > 0.95


@needs_no_gpu_driver
def test_api_fit_predict_never_imports_torch_or_scikit_learn_and_loads_xgboost_in_a_thread(tmp_path):
    script = ("import sys, threading\nimport numpy as np\n"
              "from alibi_vit.trainable.segmenter import TrainableSegmenter\n"
              "names = []\nstart = threading.Thread.start\n"
              "def spy(self):\n    names.append(self.name)\n    return start(self)\n"
              "threading.Thread.start = spy\n"
              "image = np.zeros((64, 64), np.uint8); image[:, 32:] = 200\n"
              "labels = np.zeros((64, 64), np.uint8); labels[5:60, 5:20] = 1; labels[5:60, 44:60] = 2\n"
              "mask = TrainableSegmenter().fit([image], [labels]).predict([image])[0]\n"
              "print(sorted({'torch', 'timm', 'sklearn', 'xgboost'} & set(sys.modules)), "
              "'alibi-vit-import-xgboost' in names, "
              "int((mask[:, :28] == 1).all() and (mask[:, 36:] == 2).all()))\n")
    result = run_in_fresh_process([], tmp_path, script, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[] True 1"
