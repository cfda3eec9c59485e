"""``segment apply`` beyond one process: Dask clusters (--scheduler), SLURM job arrays (--shard, ``segment
merge``, configs/slurm/segment_apply.sbatch), --resume, and faults (a killed worker, a unit that keeps failing).

One LocalCluster of 2 worker processes serves the module (reached as ``tcp://``, the way an existing cluster
is); one test starts its own through ``--scheduler local:2``. Every run is compared byte for byte with the
reference folder that ``--scheduler threads`` wrote."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tifffile
from PIL import Image

from alibi_vit.cli import segment as segment_cli
from alibi_vit.cli.main import main
from alibi_vit.trainable import TrainableSegmenter, scribbles, synthetic_micrograph
from alibi_vit.trainable.output_folder import LOCK_NAME, OutputFolder
from alibi_vit.trainable.scheduler import (SlurmOptions, parse_scheduler, parse_shard, shard_from_environment)
from alibi_vit.trainable.writers import ZarrOutput

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "configs" / "slurm" / "segment_apply.sbatch"
MOSAIC = (300, 340)  # with the model's 140-px tiles: 3 × 3 tiles, each a unit of work


def _files(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` by relative path, with its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _outputs_of(files: dict[str, bytes]) -> dict[str, bytes]:
    """``files`` less the manifests, which name the inputs' folder (for runs on copied inputs)."""
    return {name: data for name, data in files.items()
            if not name.startswith(".manifests/") and name != "segment_run.json"}


def _outputs(folder: Path) -> dict[str, bytes]:
    return _outputs_of(_files(folder))


def _apply(model, images, out, *extra):
    # --features 2d: the inputs hold a TIFF stack, segmented slice by slice by the 2D model
    return main(["segment", "apply", "--model", str(model), "--images", str(images), "--out", str(out),
                 "--features", "2d", *extra])


@pytest.fixture(scope="module")
def hook_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hook")
    os.environ["ALIBI_VIT_TEST_HOOK_DIR"] = str(folder)  # before the workers start: they inherit it
    yield folder
    os.environ.pop("ALIBI_VIT_TEST_HOOK_DIR", None)


@pytest.fixture(scope="module")
def data(tmp_path_factory, hook_dir):
    """A model (classical features plus the test hook, 140-px tiles) and six inputs: PNG and TIFF images,
    a TIFF stack, an OME-Zarr mosaic segmented in 9 tile units, and one unreadable file; the reference
    outputs of --scheduler threads."""
    root = tmp_path_factory.mktemp("scale_out")
    image, truth = synthetic_micrograph((96, 128), seed=0)
    seg = TrainableSegmenter(classifier_params={"n_estimators": 5}, tile=140, feature_fn="scale_out_hook:features")
    seg.fit([image], [scribbles(truth, 2, rng=0)])
    seg.save(root / "model")
    inputs = root / "in"
    inputs.mkdir()
    for i in range(1, 5):
        picture, _ = synthetic_micrograph((64 + 8 * i, 80), seed=i)
        if i % 2:
            Image.fromarray(picture).save(inputs / f"p{i}.png")
        else:
            tifffile.imwrite(inputs / f"t{i}.tif", picture)
    tifffile.imwrite(inputs / "stack.tif", np.stack([synthetic_micrograph((48, 56), seed=10 + z)[0] for z in range(3)]),
                     photometric="minisblack")
    mosaic, _ = synthetic_micrograph(MOSAIC, seed=7)
    out = ZarrOutput(inputs / "mosaic.ome.zarr", MOSAIC, mosaic.dtype, 64)
    out.write((slice(0, MOSAIC[0]), slice(0, MOSAIC[1])), mosaic)
    out.finish()
    (inputs / "broken.png").write_bytes(b"not a png")
    reference = root / "reference"
    assert _apply(root / "model", inputs, reference) == 1  # broken.png is skipped and listed
    return root, _files(reference)


@pytest.fixture(scope="module")
def cluster(hook_dir):
    """A LocalCluster of 2 single-threaded worker processes; its scheduler's address."""
    import logging

    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=logging.ERROR) as local:
        yield local.scheduler_address


def test_a_local_cluster_writes_the_same_bytes_as_threads(data, tmp_path, capsys):
    root, reference = data
    assert _apply(root / "model", root / "in", tmp_path / "out", "--scheduler", "local:2") == 1
    captured = capsys.readouterr()
    assert "segmented 6 of 7 image(s)" in captured.out
    assert captured.err.strip().splitlines()[-1] == \
        "alibi-vit segment: error: 1 image(s) could not be segmented: broken.png"
    written = _files(tmp_path / "out")
    assert "mosaic_mask.ome.zarr/0/2/2" in written and "stack_mask.tif" in written  # all kinds of input
    assert written == reference


def test_a_worker_killed_mid_task_is_replaced_and_the_outputs_stay_identical(data, cluster, hook_dir, tmp_path):
    root, reference = data
    (hook_dir / "hang").touch()
    killed = []

    def kill_the_hanging_worker():
        deadline = time.monotonic() + 60
        while not (hook_dir / "pid").is_file() or not (hook_dir / "pid").read_text():
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        pid = int((hook_dir / "pid").read_text())
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    killer = threading.Thread(target=kill_the_hanging_worker)
    killer.start()
    try:
        status = _apply(root / "model", root / "in", tmp_path / "out", "--scheduler", cluster)
    finally:
        killer.join()
        (hook_dir / "hang").unlink()
        (hook_dir / "pid").unlink(missing_ok=True)
    assert killed and killed[0] != os.getpid()  # a worker process died while running a unit
    assert status == 1  # broken.png only
    assert _files(tmp_path / "out") == reference


def test_a_unit_that_keeps_failing_is_retried_a_bounded_number_of_times_then_listed(data, cluster, hook_dir,
                                                                                   tmp_path, capsys):
    from alibi_vit.trainable.scheduler import RETRIES

    root, reference = data
    inputs = tmp_path / "in"
    shutil.copytree(root / "in", inputs)
    Image.fromarray(np.full((40, 40), 1000, np.uint16)).save(inputs / "flat.png")
    (hook_dir / "fail_flat").touch()
    try:
        assert _apply(root / "model", inputs, tmp_path / "out", "--scheduler", cluster) == 1
    finally:
        (hook_dir / "fail_flat").unlink()
    err = capsys.readouterr().err
    assert "RuntimeError: the test hook refuses flat images" in err
    assert err.strip().splitlines()[-1] == \
        "alibi-vit segment: error: 2 image(s) could not be segmented: broken.png, flat.png"
    assert len((hook_dir / "calls_flat").read_text().split()) == 1 + RETRIES
    assert _outputs(tmp_path / "out") == _outputs_of(reference)  # every other output written, flat.png's none


def test_an_interrupted_run_resumed_redoes_only_what_is_missing_or_changed(data, cluster, tmp_path, capsys,
                                                                          monkeypatch):
    from alibi_vit.trainable import batch

    root, reference = data
    inputs, out = tmp_path / "in", tmp_path / "out"
    shutil.copytree(root / "in", inputs)
    real, committed = batch._finish_image, []

    def interrupted_after_three(folder, job, result, outcome):
        if len(committed) == 3:
            raise KeyboardInterrupt
        real(folder, job, result, outcome)
        committed.append(job.row)

    monkeypatch.setattr(batch, "_finish_image", interrupted_after_three)
    assert _apply(root / "model", inputs, out) == 130
    monkeypatch.undo()
    assert committed == ["mosaic.ome.zarr", "p1.png", "p3.png"]  # threads: one image after the other, by name
    kept = {p: os.stat(out / p).st_ino for p in ("mosaic_mask.ome.zarr", "p1_mask.png", "p1_overlay.png")}
    original = (inputs / "p3.png").read_bytes()
    Image.fromarray(synthetic_micrograph((50, 60), seed=99)[0]).save(inputs / "p3.png")  # another image now
    capsys.readouterr()
    assert _apply(root / "model", inputs, out, "--resume", "--scheduler", cluster) == 1  # broken.png
    line = capsys.readouterr().out
    assert "segmented 4 of 7 image(s)" in line and "2 kept from an earlier run (--resume)" in line
    assert {p: os.stat(out / p).st_ino for p in kept} == kept  # not written again
    (inputs / "p3.png").write_bytes(original)
    assert _apply(root / "model", inputs, out, "--resume") == 1
    assert "segmented 1 of 7 image(s)" in capsys.readouterr().out  # p3.png, changed back
    assert _outputs(out) == _outputs_of(reference)


def _worker_threads():
    import cv2

    from alibi_vit.trainable import batch

    return bool(batch._MODELS), os.environ.get("OMP_NUM_THREADS"), cv2.getNumThreads()


def test_workers_run_opencv_on_the_threads_dask_gives_them(data, cluster, tmp_path):
    """Dask sets OMP_NUM_THREADS=1 in its workers; OpenCV, which would start a thread per core, follows it."""
    from distributed import Client

    root, _ = data
    assert _apply(root / "model", root / "in", tmp_path / "out", "--scheduler", cluster) == 1
    with Client(cluster) as client:
        seen = list(client.run(_worker_threads).values())
    assert os.cpu_count() > 1  # else OpenCV's default would be one thread too
    loaded = [(env, threads) for has_model, env, threads in seen if has_model]
    assert loaded and all(env == "1" and threads == 1 for env, threads in loaded)


def test_three_shares_merged_equal_one_run(data, cluster, tmp_path, capsys, monkeypatch):
    root, reference = data
    out = tmp_path / "out"
    assert _apply(root / "model", root / "in", out, "--shard", "0/3") == 1  # broken.png, p3.png, t4.png
    assert main(["segment", "merge", str(out)]) == 2
    assert "share(s) 1/3, 2/3 never ran: run them (again, with --resume), then merge" in capsys.readouterr().err
    assert _apply(root / "model", root / "in", out, "--shard", "1/3", "--scheduler", cluster) == 0
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")  # an array 1-3: its third task is share 2/3
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "3")
    assert _apply(root / "model", root / "in", out) == 0
    assert "share 2/3: 2 image(s)" in capsys.readouterr().err
    assert main(["segment", "merge", str(out)]) == 0
    assert "merged 3 shares: 6 image(s)" in capsys.readouterr().out
    assert _files(out) == reference


def test_shards_split_the_inputs_every_nth_image(data, tmp_path):
    root, _ = data
    args = type("Args", (), {"images": [root / "in"], "recursive": False, "slice_folders": False,
                             "out": tmp_path / "out"})
    files, names = segment_cli._apply_inputs(args)
    rows = [n.row for n in names]
    assert rows == sorted(rows) and len(rows) == 7
    shares = [rows[i::3] for i in range(3)]
    assert sorted(sum(shares, [])) == rows and [len(s) for s in shares] == [3, 2, 2]


def test_the_sbatch_template_parses_and_gives_each_array_task_its_share(tmp_path):
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    stub = tmp_path / "bin" / "alibi-vit"
    stub.parent.mkdir()
    stub.write_text('#!/bin/bash\necho "$@"\n')
    stub.chmod(0o755)
    for ids, step in (("0-3", None), ("1-4", None), ("10-40:10", "10")):
        first, last = (int(v) for v in ids.split(":")[0].split("-"))
        tasks = list(range(first, last + 1, int(step or 1)))
        shares = []
        for task in tasks:
            env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "MODEL": "m", "IMAGES": "in", "OUT": "o",
                   "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_MIN": str(first),
                   "SLURM_ARRAY_TASK_COUNT": str(len(tasks)), **({"SLURM_ARRAY_TASK_STEP": step} if step else {})}
            run = subprocess.run(["bash", str(SBATCH), "--proba"], env=env, capture_output=True, text=True)
            assert run.returncode == 0, run.stderr
            args = run.stdout.strip().splitlines()[-1].split()
            assert args[:8] == ["segment", "apply", "--model", "m", "--images", "in", "--out", "o"]
            assert args[8] == "--shard" and args[10:] == ["--resume", "--proba"]
            shard = args[9]
            assert parse_shard(shard) == shard_from_environment(env)  # the template and the CLI agree
            shares.append(shard)
        assert shares == [f"{i}/{len(tasks)}" for i in range(len(tasks))]  # each share once


def test_shard_and_scheduler_specs_that_cannot_work_are_one_line_errors_before_any_work(data, tmp_path, capsys):
    root, _ = data
    for shard in ("3/3", "-1/3", "1/0", "one/3"):
        assert _apply(root / "model", root / "in", tmp_path / "out", f"--shard={shard}") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"alibi-vit segment: error: --shard {shard}")
    for spec in ("local:0", "processes", "tcp://host", "local:two"):
        assert _apply(root / "model", root / "in", tmp_path / "out", "--scheduler", spec) == 2
        assert "--scheduler" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="not on an evenly stepped range"):
        shard_from_environment({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "3",
                                "SLURM_ARRAY_TASK_STEP": "3"})  # --array=1,5,6 has no step; 5 is not on 1, 4, 7
    assert shard_from_environment({}) is None
    assert parse_scheduler("tcp://10.0.0.1:8786").address == "tcp://10.0.0.1:8786"


def test_an_unreachable_scheduler_is_named_within_ten_seconds(data, tmp_path, capsys):
    root, _ = data
    with socket.socket() as s:  # a port on this machine that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    assert _apply(root / "model", root / "in", tmp_path / "out", "--scheduler", f"tcp://127.0.0.1:{port}") == 2
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"alibi-vit segment: error: --scheduler tcp://127.0.0.1:{port}: cannot reach a Dask "
                              "scheduler there within 5 s")
    assert not list((tmp_path / "out").glob("*_mask*")) and not (tmp_path / "out" / LOCK_NAME).exists()


def test_slurm_without_sbatch_is_a_one_line_error(data, tmp_path, capsys, monkeypatch):
    root, _ = data
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    assert _apply(root / "model", root / "in", tmp_path / "out", "--scheduler", "slurm") == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("alibi-vit segment: error: --scheduler slurm: sbatch is not on PATH")


def test_slurm_worker_jobs_ask_for_the_resources_given(tmp_path):
    from dask_jobqueue import SLURMCluster

    config = tmp_path / "slurm.yaml"
    config.write_text("cores: 8\nmemory: 32GB\njob_extra_directives: ['--constraint=skylake']\nqueue: long\n")
    kwargs = SlurmOptions(cores=2, walltime="00:30:00", account="lab42", config=config).cluster_kwargs()
    assert kwargs == {"cores": 2, "processes": 2, "memory": "32GB", "walltime": "00:30:00", "queue": "long",
                      "account": "lab42", "job_extra_directives": ["--constraint=skylake"]}
    with SLURMCluster(**kwargs, scheduler_options={"dashboard_address": None}) as cluster:
        script = cluster.job_script()
    for line in ("#SBATCH -p long", "#SBATCH -A lab42", "#SBATCH -t 00:30:00", "#SBATCH --constraint=skylake",
                 "#SBATCH --cpus-per-task=2"):
        assert line in script
    assert "--nworkers 2" in script and "--nthreads 1" in script  # two single-threaded worker processes per job
    with pytest.raises(ValueError, match="expected a mapping"):
        config.write_text("- cores\n")
        SlurmOptions(config=config).cluster_kwargs()


def test_shares_lock_their_own_share_and_overlapping_runs_are_refused(tmp_path):
    me = {"host": socket.gethostname(), "pid": os.getppid(), "started": "then"}  # a live process
    (tmp_path / ".segment.shard-0-of-3.lock").write_text(__import__("json").dumps(me))
    settings = {"model_digest": "d", "crf": "off", "modal": 0}

    def run(shard):
        with OutputFolder(tmp_path, settings, lambda *a: None, shard=shard) as folder:
            return folder.lock_path.name

    assert run((1, 3)) == ".segment.shard-1-of-3.lock"  # another share of the same split: side by side
    for shard in ((0, 3), (0, 2), None):
        with pytest.raises(ValueError, match=rf"being written by process {os.getppid()} on .* \(share 0/3\)"):
            run(shard)
    assert sorted(p.name for p in tmp_path.glob(".segment*")) == [".segment.shard-0-of-3.lock"]


def test_images_a_killed_run_committed_are_listed_by_the_next_run(tmp_path):
    """SIGKILL between two saves of the run manifest: each image's own manifest still accounts for it."""
    written = []
    settings = {"model_digest": "d", "crf": "off", "modal": 0}

    def write_csv(path, names, counts):
        Path(path).write_text(",".join(names))
        written.append(list(names))

    killed = OutputFolder(tmp_path, settings, write_csv).__enter__()  # never left: as if killed
    signal.signal(signal.SIGTERM, killed._previous_sigterm)  # what leaving it would restore
    for row in ("b.png", "a.png"):
        (killed.stage(row, tmp_path) / f"{row[0]}_mask.png").write_bytes(b"1")
        killed.commit(row, tmp_path / row, [(row, [1], 1)], sha256=row)
    killed.lock_path.unlink()  # what taking over a dead process's lock does
    with OutputFolder(tmp_path, settings, write_csv) as folder:
        assert sorted(folder.images) == ["a.png", "b.png"]
        assert folder.finished("a.png")["input_sha256"] == "a.png"
    assert written[-1] == ["a.png", "b.png"]  # by name, not by the order they were written in


def test_a_share_without_images_still_counts_for_the_merge(tmp_path):
    from alibi_vit.trainable.output_folder import merge_shards

    settings = {"model_digest": "d", "crf": "off", "modal": 0, "classes": [1, 2]}
    rows = []

    def csv_for(classes):
        return lambda path, names, counts: (rows.append((list(classes), list(names))), Path(path).write_text("x"))

    with OutputFolder(tmp_path, settings, csv_for([1, 2]), shard=(0, 2)) as folder:
        (folder.stage("a.png", tmp_path) / "a_mask.png").write_bytes(b"1")
        folder.commit("a.png", tmp_path / "a.png", [("a.png", [3, 1], 4)])
    with OutputFolder(tmp_path, settings, csv_for([1, 2]), shard=(1, 2)):
        pass  # its only image could not be read, say
    assert merge_shards(tmp_path, csv_for) == (2, 1)
    assert rows[-1] == ([1, 2], ["a.png"]) and not list(tmp_path.glob("*shard*"))


def test_a_model_with_a_vit_backbone_goes_to_the_workers_with_its_weights(data, cluster, tmp_path):
    """A random-init backbone is saved in the model folder (backbone.safetensors): the workers load it from
    the files they are sent. Features from PyTorch in single-threaded workers equal those of this process."""
    images = tmp_path / "in"
    images.mkdir()
    for i in range(2):
        tifffile.imwrite(images / f"v{i}.tif", synthetic_micrograph((70, 84), seed=20 + i)[0])
    _, truth = synthetic_micrograph((70, 84), seed=20)
    Image.fromarray(scribbles(truth, 2, rng=0).astype(np.uint8)).save(tmp_path / "v0_labels.png")
    assert main(["segment", "train", "--images", str(images / "v0.tif"), "--labels", str(tmp_path / "v0_labels.png"),
                 "--out", str(tmp_path / "model"), "--trees", "3", "--backbone", "alibi_vit_small_patch14_reg4_dinov2",
                 "--model-arg", "depth=1", "--model-arg", "embed_dim=48", "--model-arg", "num_heads=2",
                 "--components", "3", "--allow-random-init"]) == 0
    assert (tmp_path / "model" / "backbone.safetensors").is_file()
    assert _apply(tmp_path / "model", images, tmp_path / "threads") == 0
    assert _apply(tmp_path / "model", images, tmp_path / "cluster", "--scheduler", cluster) == 0
    assert _files(tmp_path / "cluster") == _files(tmp_path / "threads")


def test_measure_on_a_cluster_writes_the_same_tables_as_in_this_process(data, cluster, tmp_path):
    """``segment measure --scheduler``: the blocks of a mosaic's and a stack's local metrics measured by the
    cluster's workers (each opening the stores itself) give the tables of one process, byte for byte."""
    root, _ = data
    masks = [str(root / "reference" / "mosaic_mask.ome.zarr"), str(root / "reference" / "stack_mask.tif")]
    common = ["segment", "measure", *masks, "--block", "64", "--radius", "8", "--quiet", "--no-plots",
              "--metrics", "fractions", "surfaces", "s2", "objects", "percolation"]
    assert main([*common, "--out", str(tmp_path / "here")]) == 0
    assert main([*common, "--out", str(tmp_path / "cluster"), "--scheduler", cluster]) == 0
    tables = {p.name: p.read_bytes() for p in sorted((tmp_path / "here").glob("*.csv"))}
    assert {"fractions.csv", "interfaces.csv", "s2.csv", "mosaic_objects.csv", "stack_objects.csv"} <= tables.keys()
    assert tables == {p.name: p.read_bytes() for p in sorted((tmp_path / "cluster").glob("*.csv"))}
