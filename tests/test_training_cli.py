"""The ``lightning`` command's run management, on the tiny demo config on CPU.

last.ckpt at the final step; SIGTERM and SLURM's requeue signal turned into a save at the next
step boundary, a requeue and a non-zero exit, with an exact resume; command-line values beating
the config's; probe loggers following the chosen folder; no log folder left by a run that
failed before training.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

pytest.importorskip("jsonargparse", reason="the lightning CLI needs jsonargparse (the GPU image lacks it)")
from lit_modules.callbacks import LastCheckpoint, TrainingInterrupted  # noqa: E402
from lit_modules.cli import cli, main  # noqa: E402
from tests.helpers import full_disk  # noqa: E402

# In-process CLI runs see pytest's own argv too; Lightning warns about that, harmlessly.
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
PROBE = str(ROOT / "configs" / "probe_voc07.yaml")
# Demo without validation: 88 tiles / batch 8 = 11 steps per epoch; the demo's ModelCheckpoint
# saves every 10 steps.
# Constant lr after the 5-step warmup: the schedule does not depend on max_steps, so a run extended
# from a finished one can match the straight run.
FAST = ["--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--model.lr_schedule=constant"]
STEPS = 14  # crosses the epoch boundary at 11 and is not a multiple of every_n_train_steps=10


def demo(run_dir, *overrides, run=True):
    args = ["--config", DEMO, f"--run_dir={run_dir}", *FAST, *overrides]
    return cli(["fit", *args] if run else args, run=run)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class SendSignal(Callback):
    """Sends ``signum`` to this process in the middle of the training step at ``step`` (after backward)."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step, self.sent = signum, step, False

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)


def interrupted_fit(run_dir, signum, step, *overrides):
    """The demo fit with ``signum`` sent mid-step at ``step``; returns (CLI object, TrainingInterrupted)."""
    run = demo(run_dir, f"--trainer.max_steps={STEPS}", *overrides, run=False)
    run.trainer.callbacks.append(SendSignal(signum, step))
    before = signal.getsignal(signum)
    with pytest.raises(TrainingInterrupted) as stop:
        run.trainer.fit(run.model, run.datamodule)
    assert signal.getsignal(signum) == before  # handlers restored after the fit
    return run, stop.value


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    run = demo(run_dir, f"--trainer.max_steps={STEPS}")
    return run_dir, run


def test_last_ckpt_holds_the_final_step(straight):
    run_dir, run = straight
    assert run.trainer.global_step == STEPS
    # ModelCheckpoint(every_n_train_steps=10) alone would leave step 10 here.
    ckpt = load(run_dir / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == STEPS
    assert_same_tensors(ckpt["state_dict"], {k: v.cpu() for k, v in run.model.state_dict().items()})
    assert sum(isinstance(c, LastCheckpoint) for c in run.trainer.callbacks) == 1


def test_finished_run_extended_with_more_steps_matches_the_straight_run(tmp_path, straight):
    demo(tmp_path, "--trainer.max_steps=7")
    assert load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 7
    demo(tmp_path, f"--trainer.max_steps={STEPS}", "--ckpt_path=last")
    a, b = load(tmp_path / "checkpoints" / "last.ckpt"), load(straight[0] / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == STEPS
    assert_same_tensors(a["state_dict"], b["state_dict"])


def test_sigterm_saves_at_the_step_boundary_and_exits_non_zero(tmp_path):
    run, stop = interrupted_fit(tmp_path, signal.SIGTERM, 3)
    assert stop.code == 128 + signal.SIGTERM == 143
    # Sent during step 4 (global_step 3 before its optimizer step): saved once that step ended.
    ckpt = load(tmp_path / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 4 == run.trainer.global_step
    assert_same_tensors(ckpt["state_dict"], {k: v.cpu() for k, v in run.model.state_dict().items()})
    assert {int(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()} == {4}


def test_slurm_requeue_signal_saves_at_step_boundary_requeues_and_resumes_exactly(tmp_path, monkeypatch, straight):
    # A SLURM batch task as Lightning detects it, with `scontrol` replaced by a script that records its arguments.
    for key, value in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NAME": "distill",
                       "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                       "SLURM_NODELIST": "localhost"}.items():
        monkeypatch.setenv(key, value)
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls.txt"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    run_dir = tmp_path / "run"
    run, stop = interrupted_fit(run_dir, signal.SIGUSR1, 6)
    assert type(run.trainer._accelerator_connector.cluster_environment).__name__ == "SLURMEnvironment"
    assert stop.code == 128 + signal.SIGUSR1
    assert calls.read_text().split() == ["requeue", "4242"]
    assert load(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 7
    assert not list(run_dir.glob("hpc_ckpt_*.ckpt"))  # Lightning's own mid-step save did not run

    # The requeued job: same command, --ckpt_path=last. It ends with the uninterrupted run's weights
    # and optimizer state, bit for bit.
    resumed = demo(run_dir, f"--trainer.max_steps={STEPS}", "--ckpt_path=last")
    assert resumed.trainer.global_step == STEPS
    a, b = load(run_dir / "checkpoints" / "last.ckpt"), load(straight[0] / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == STEPS
    assert_same_tensors(a["state_dict"], b["state_dict"])
    for sa, sb in zip(a["optimizer_states"][0]["state"].values(), b["optimizer_states"][0]["state"].values()):
        assert_same_tensors(sa, sb)
    assert calls.read_text().split() == ["requeue", "4242"]  # the resumed run finished: no second requeue


def test_command_line_beats_the_config(tmp_path):
    # demo.yaml sets run_dir; --trainer.default_root_dir on the command line moves the run there.
    run = cli(["--config", DEMO, f"--trainer.default_root_dir={tmp_path / 'x'}"], run=False)
    assert Path(run.trainer.default_root_dir) == tmp_path / "x"
    assert Path(run.trainer.logger.log_dir) == tmp_path / "x"
    assert run.config["run_dir"] == str(tmp_path / "x")  # what config.yaml will record
    # --run_dir on the command line beats a default_root_dir from the config (here: given as a config dict).
    run = cli(["--config", DEMO, f"--trainer={{default_root_dir: {tmp_path / 'y'}}}", f"--run_dir={tmp_path / 'z'}"],
              run=False)
    assert Path(run.trainer.default_root_dir) == tmp_path / "z"
    with pytest.raises(ValueError, match="both set on the command line and disagree"):
        cli(["--config", DEMO, f"--run_dir={tmp_path / 'a'}", f"--trainer.default_root_dir={tmp_path / 'b'}"],
            run=False)


PROBE_TINY = ["--model.allow_random_init=true", "--model.backbone_kwargs={depth: 2, embed_dim: 48, num_heads: 2}",
              "--trainer.accelerator=cpu"]


def test_probe_logger_follows_the_chosen_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = cli(["--config", PROBE, "--data.root=data", f"--trainer.default_root_dir={tmp_path / 'root'}", *PROBE_TINY],
              run=False)
    assert Path(run.trainer.logger.log_dir) == tmp_path / "root" / "probe_voc07" / "version_0"
    run = cli(["--config", PROBE, "--data.root=data", f"--run_dir={tmp_path / 'rd'}", *PROBE_TINY], run=False)
    assert Path(run.trainer.logger.log_dir) == tmp_path / "rd"
    run = cli(["--config", PROBE, "--data.root=data", f"--trainer.default_root_dir={tmp_path / 'root'}",
               f"--trainer.logger.init_args.save_dir={tmp_path / 'mine'}", *PROBE_TINY], run=False)
    assert Path(run.trainer.logger.log_dir) == tmp_path / "mine" / "probe_voc07" / "version_0"
    run = cli(["--config", PROBE, "--data.root=data", *PROBE_TINY], run=False)
    assert Path(run.trainer.logger.log_dir) == Path("runs") / "probe_voc07" / "version_0"  # the config's default


def test_run_failing_before_training_leaves_no_log_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "root" / "probe_voc07" / "version_0").mkdir(parents=True)  # an earlier run's: kept
    # no dataset there: fails in the datamodule's setup, as a message showing the layout
    assert main(["fit", "--config", PROBE, f"--data.root={tmp_path / 'empty'}",
                 f"--trainer.default_root_dir={tmp_path / 'root'}", *PROBE_TINY]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"lightning: error: Pascal VOC 2007: no JPEGImages folder in any of {tmp_path / 'empty'}")
    assert "expected layout:" in err
    assert sorted(p.name for p in (tmp_path / "root" / "probe_voc07").iterdir()) == ["version_0"]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "lightning_logs").exists()
    # a root folder the failed run created is removed whole, not left behind empty
    assert main(["fit", "--config", PROBE, f"--data.root={tmp_path / 'empty'}",
                 f"--trainer.default_root_dir={tmp_path / 'new' / 'root'}", *PROBE_TINY]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert err.startswith("lightning: error: ") and "\n" not in err, err
    return err


def test_distillation_without_its_data_or_gpu_is_a_message(tmp_path, monkeypatch, capsys):
    import timm
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    teacher = timm.create_model("vit_small_patch14_reg4_dinov2", num_classes=0)
    save_file({k: v.contiguous() for k, v in teacher.state_dict().items()}, str(tmp_path / "teacher.safetensors"))
    args = ["fit", "--config", str(ROOT / "configs" / "alibi.yaml"), f"--data.root={tmp_path / 'coco'}",
            f"--model.teacher_checkpoint={tmp_path / 'teacher.safetensors'}"]
    if not torch.cuda.is_available():  # the config asks for GPUs: the message says how to try it on the CPU
        assert main(args) == 2
        assert "--trainer.accelerator=cpu --trainer.devices=1" in _one_line_error(capsys)
    assert main([*args, "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.precision=32-true"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"lightning: error: COCO image folder {tmp_path / 'coco' / 'train2017'} does not exist")
    assert "expected COCO layout:" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher.safetensors"]  # no runs/ folder left


def test_unreadable_ckpt_path_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    torch.save({"weight": torch.ones(3)}, tmp_path / "state_dict.pt")
    good = (tmp_path / "state_dict.pt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(good[: len(good) // 2])
    for path, problem in ((tmp_path / "truncated.ckpt", "is not a readable checkpoint"),
                          (tmp_path / "state_dict.pt", "is not a Lightning checkpoint"),
                          (tmp_path / "missing.ckpt", "does not exist")):
        assert main(["fit", "--config", DEMO, f"--run_dir={tmp_path / 'run'}", *FAST, f"--ckpt_path={path}"]) == 2
        assert f"--ckpt_path {path} {problem}" in _one_line_error(capsys)


def test_checkpoint_with_other_model_settings_is_refused_naming_them(tmp_path, monkeypatch, capsys, straight):
    """Lightning alone restores the checkpoint's model settings over the config and the command line."""
    monkeypatch.chdir(tmp_path)
    ckpt = straight[0] / "checkpoints" / "last.ckpt"
    args = ["fit", "--config", DEMO, *FAST, f"--ckpt_path={ckpt}", "--model.blank_channels=[]",
            f"--trainer.max_steps={STEPS + 1}"]
    assert main([*args, f"--run_dir={tmp_path / 'refused'}"]) == 2
    err = _one_line_error(capsys)
    assert "model.blank_channels: [5, 11, 23, 47] in the checkpoint, [] given" in err and "--ckpt_hparams" in err
    assert not (tmp_path / "refused").exists()
    for choice, channels in (("config", []), ("checkpoint", [5, 11, 23, 47])):
        assert main([*args, f"--run_dir={tmp_path / choice}", f"--ckpt_hparams={choice}"]) == 0
        resumed = load(tmp_path / choice / "checkpoints" / "last.ckpt")
        assert resumed["global_step"] == STEPS + 1 and resumed["hyper_parameters"]["blank_channels"] == channels
    # A checkpoint of another kind of job names both classes.
    assert main(["fit", "--config", str(ROOT / "configs" / "probe_demo.yaml"), f"--ckpt_path={ckpt}"]) == 2
    err = _one_line_error(capsys)
    assert "DistillationModule" in err and "SegmentationProbeModule" in err


@pytest.mark.parametrize("arguments, message", [
    (["--model.lrr=1"], "--model.lrr: no such option of lit_modules.distillation.DistillationModule"),
    (["--trainer.precision=bogus"], "--trainer.precision: 'bogus' is not accepted; expected one of"),
    (["--data.batch_size=x"], "--data.batch_size: expected an int, got 'x'"),
    (["--trainr.max_steps=3"], "unrecognized arguments: --trainr.max_steps=3"),
    (["--model=Foo"], "--model: 'Foo' is not a class"),
])
def test_command_line_typos_are_one_line_without_the_usage(tmp_path, monkeypatch, capsys, arguments, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", DEMO, *arguments])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lightning fit: error: ") and "\n" not in err and message in err, err
    assert not list(tmp_path.iterdir())


def test_config_file_mistakes_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  max_steps: [1\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text(Path(DEMO).read_text().replace("    lr: 1.0e-3", "    lrr: 1.0e-3"))
    for config, message in ((broken, "(line 2, column 14)"), (typo, "--model.lrr: no such option"),
                            (tmp_path / "missing.yaml", "File does not exist")):
        with pytest.raises(SystemExit) as stop:
            main(["fit", "--config", str(config)])
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and "\n" not in err and message in err, err


def test_runs_that_cannot_start_are_one_line_and_leave_no_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    cases = [(["--data.image_size=50"], "image size 50×50 px is not a multiple of the patch size 14×14"),
             (["--data.batch_size=1000"], "the training set has 88 images, fewer than one global batch of 1000"),
             ([f"--run_dir={tmp_path / 'a_file' / 'run'}"], f"{tmp_path / 'a_file' / 'run'}: Not a directory"),
             (["--trainer.devices=0"], "cannot set up the trainer"),
             ([f"--ckpt_path={tmp_path}"], f"--ckpt_path {tmp_path} is a folder")]
    try:
        (Path("/sys") / "alibi-vit-test").mkdir()
    except OSError:  # as here, even for root: an unwritable --run_dir
        cases.append((["--run_dir=/sys/alibi-vit-test"], "/sys/alibi-vit-test: Operation not permitted"))
    else:
        (Path("/sys") / "alibi-vit-test").rmdir()
    for arguments, message in cases:
        run_dir = [] if any(a.startswith("--run_dir") for a in arguments) else [f"--run_dir={tmp_path / 'run'}"]
        assert main(["fit", "--config", DEMO, *FAST, *run_dir, *arguments]) == 2, arguments
        err = _one_line_error(capsys)
        assert message in err and "GPU" not in err, err  # the demo asks for the CPU: no GPU hint
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_lightning_adverts_and_its_own_deprecation_warning_are_not_shown(tmp_path, monkeypatch, caplog, recwarn):
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    assert main(["fit", "--config", DEMO, f"--run_dir={tmp_path / 'run'}", "--trainer.max_steps=2",
                 "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"]) == 0
    assert any("GPU available" in r.getMessage() for r in caplog.records)  # Lightning's log is still there
    assert not [r for r in caplog.records if "Tip:" in r.getMessage()]
    assert not [w for w in recwarn if "LeafSpec" in str(w.message)]


def test_a_full_disk_keeps_the_last_complete_checkpoint_and_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    assert main(["fit", "--config", DEMO, f"--run_dir={run_dir}", *FAST, "--trainer.max_steps=2"]) == 0
    last = run_dir / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    capsys.readouterr()
    full_disk(monkeypatch, lambda path: ".ckpt" in path)  # the checkpoints' disk fills up
    assert main(["fit", "--config", DEMO, f"--run_dir={run_dir}", *FAST, "--trainer.max_steps=4",
                 "--ckpt_path=last"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"lightning: error: cannot write checkpoint {last}: No space left on device; the checkpoints "
                   "written before are kept")
    assert last.read_bytes() == before and load(last)["global_step"] == 2  # not a truncated step 4
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # no partial file left
