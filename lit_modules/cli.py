"""The ``lightning`` command: every training job is ``lightning fit|validate|test --config configs/<job>.yaml``.

A plain :class:`~lightning.pytorch.cli.LightningCLI` in subclass mode: the config names the
LightningModule and LightningDataModule by ``class_path``, so distillation, segmentation
probes and any later job share this one entry point. Additions, mostly for jobs that are
preempted and requeued on a cluster:

- ``--run_dir DIR`` gives a run one stable folder: ``trainer.default_root_dir`` (where
  Lightning writes its SLURM ``hpc_ckpt_*.ckpt``), a TensorBoard logger that writes straight
  into ``DIR`` instead of a new ``version_N`` per restart (a logger the config names, e.g. the
  probe configs' TensorBoardLogger, is pointed there too), and so ModelCheckpoint's default
  folder ``DIR/checkpoints``.
- A value given on the command line beats the config's: ``--trainer.default_root_dir=X`` with
  a config that sets ``run_dir`` moves the run dir to X; a logger's ``save_dir`` from the config
  follows ``--trainer.default_root_dir``. Only contradicting values given at the same level
  (both on the command line, or both in configs) are an error.
- ``--ckpt_path=last`` also considers Lightning's SLURM checkpoints: Lightning alone resumes
  from ``last.ckpt`` even when the checkpoint saved at preemption is newer.
- Every ``fit`` gets a :class:`~lit_modules.callbacks.LastCheckpoint` (unless the config lists
  one): ``last.ckpt`` holds the final step, and SIGTERM or SLURM's requeue signal save it at
  the next step boundary and end the command with exit code 128 + signal number.
- Checkpoints are complete or absent (:class:`~lit_modules.checkpoint_io.AtomicCheckpointIO`,
  unless the config names a CheckpointIO plugin): one that cannot be written (a full disk) ends
  the run with one line naming it and the cause, exit status 1, and the earlier ones are kept.
- A fit that fails before its first training step removes the log folder it created (no empty
  ``version_N`` left behind).
- What the user got wrong is an error message with exit status 2, not a traceback: a
  configuration that cannot be built, a dataset root without the expected layout (the message
  shows it), an accelerator the machine lacks (with the CPU options to use instead), a
  ``--ckpt_path`` that is missing, a folder or not a readable checkpoint, a ``ValueError`` or
  ``OSError`` before the first training step (an image size the model cannot take, a training set
  smaller than a batch, a ``--run_dir`` that cannot be written); a typo in an option or a config
  file is one line too (:mod:`lit_modules.parser_errors`), not the usage.
- ``--ckpt_path FILE`` whose stored model settings differ from the config's (Lightning would silently
  take the checkpoint's, over the command line too) is refused with the differences named, unless
  ``--ckpt_hparams=checkpoint|config`` says which side wins.
- Lightning's adverts for its cloud services are not printed.

The config is saved with ``overwrite=True`` because a requeued job reuses its log folder.
"""

from __future__ import annotations

import glob
import logging
import os
import pickle
import shutil
import sys
import warnings
from typing import Iterable, Literal, Optional

import torch
from jsonargparse import Namespace
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from alibi_vit.files import require_file
from datamodules import DatasetLayoutError
from lit_modules.callbacks import LastCheckpoint
from lit_modules.checkpoint_io import AtomicCheckpointIO, CheckpointWriteError
from lit_modules.parser_errors import ConciseArgumentParser

__all__ = ["ConfigurationError", "ProjectCLI", "cli", "main", "newest_resume_checkpoint"]


def newest_resume_checkpoint(trainer) -> Optional[str]:
    """The newest of Lightning's SLURM checkpoints and every ModelCheckpoint's ``last*.ckpt``, or None."""
    candidates = set(glob.glob(os.path.join(str(trainer.default_root_dir), "hpc_ckpt_*.ckpt")))
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            # The same lookup Lightning does for ckpt_path="last".
            candidates |= set(callback._find_last_checkpoints(trainer))
    existing = [p for p in candidates if os.path.isfile(p)]
    return max(existing, key=os.path.getmtime) if existing else None


def _command_line_keys(args: Iterable) -> set[str]:
    """The option names (``run_dir``, ``trainer.default_root_dir``...) in a command line; configs are not opened."""
    return {a[2:].split("=", 1)[0] for a in args if isinstance(a, str) and a.startswith("--")}


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _same_dir(a, b) -> bool:
    return os.path.abspath(os.path.expanduser(str(a))) == os.path.abspath(os.path.expanduser(str(b)))


def check_checkpoint_file(path) -> None:
    """A ``--ckpt_path`` that is missing or not a readable Lightning checkpoint is one line, not a traceback from
    inside Lightning (which reads it while parsing the command line). Lightning's keywords ("last", ...) pass."""
    if not path or path in ("last", "best", "hpc", "registry"):
        return
    try:
        require_file(path, "--ckpt_path")
    except OSError as err:
        raise ConfigurationError(str(err)) from None
    try:  # what Lightning does next, with the failure caught
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as err:
        raise ConfigurationError(f"--ckpt_path {path} is not a readable checkpoint: the file is corrupted, truncated, "
                                 f"of another format or holds pickled objects ({type(err).__name__})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigurationError(f"--ckpt_path {path} is not a Lightning checkpoint (no 'state_dict'): give a .ckpt "
                                 "file that a training run wrote")


class ConfigurationError(ValueError):
    """A model, datamodule or trainer that cannot be built from the configuration; ``lightning`` prints one line."""


class ProjectCLI(LightningCLI):
    """LightningCLI with a stable per-run folder, command-line precedence, resumable stops and no empty log folders."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--run_dir", type=Optional[str], default=None,
            help="One stable folder for logs and checkpoints (keep it fixed across requeues): sets "
                 "trainer.default_root_dir and a TensorBoardLogger writing straight into it (a logger the config "
                 "names is pointed there); ModelCheckpoint then defaults to RUN_DIR/checkpoints.")

        parser.add_argument(
            "--ckpt_hparams", type=Optional[Literal["checkpoint", "config"]], default=None,
            help="When --ckpt_path holds model settings that differ from the config's (and the command line's), "
                 "the run is refused, naming them; 'checkpoint' goes on with the checkpoint's settings, 'config' "
                 "with the config's.")

    def parse_arguments(self, parser: LightningArgumentParser, args) -> None:
        # Which keys the user typed: a value given there beats the config's (before_instantiate_classes).
        if isinstance(args, (dict, Namespace)):
            self._given = set()
        else:
            self._given = _command_line_keys(sys.argv[1:] if args is None else args)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """Lightning replaces the config's model settings by those stored in ``--ckpt_path``, even values typed
        on the command line; here settings that differ are an error naming them, unless ``--ckpt_hparams``
        says which side wins."""
        if not self.config.get("subcommand"):
            return super()._parse_ckpt_path()
        config = self.config[self.config.subcommand]
        path, choice = config.get("ckpt_path"), config.get("ckpt_hparams")
        check_checkpoint_file(path)
        before = config.get("model").clone() if config.get("model") is not None else None
        try:
            super()._parse_ckpt_path()
        except SystemExit:  # jsonargparse already printed why; one line instead of Lightning's usage dump
            raise ConfigurationError(f"--ckpt_path {path} holds model settings that the config's model class does "
                                     "not take: it was written by another kind of job") from None
        config = self.config[self.config.subcommand]
        differences = _model_differences(before, config.get("model"))
        classes = [d for d in differences if d[0] == "class_path"]
        if classes:
            raise ConfigurationError(f"--ckpt_path {path} was written by a {classes[0][1]}, but the config's model is "
                                     f"a {classes[0][2]}: give a checkpoint of this kind of job")
        if not differences or choice == "checkpoint":
            return
        if choice == "config":
            config["model"] = before
            return
        shown = "; ".join(f"model.{key.removeprefix('init_args.')}: {theirs!r} in the checkpoint, {ours!r} given"
                          for key, theirs, ours in differences[:6])
        more = f" (and {len(differences) - 6} more)" if len(differences) > 6 else ""
        raise ConfigurationError(f"--ckpt_path {path} was trained with other model settings: {shown}{more}; add "
                                 "--ckpt_hparams=checkpoint to go on with the checkpoint's, or --ckpt_hparams=config "
                                 "to keep the config's")

    def _subconfig(self, config):
        return config[self.subcommand] if self.subcommand else config

    def before_instantiate_classes(self) -> None:
        config = self._subconfig(self.config)
        given = getattr(self, "_given", set())
        run_dir, root = config.get("run_dir"), config.get("trainer.default_root_dir")
        if run_dir and root is not None and not _same_dir(run_dir, root):
            root_given, run_given = "trainer.default_root_dir" in given, "run_dir" in given
            if root_given and not run_given:
                rank_zero_info(f"--trainer.default_root_dir={root} replaces the config's run_dir={run_dir}")
                run_dir = config["run_dir"] = str(root)
            elif not (run_given and not root_given):
                where = "on the command line" if root_given else "in the config"
                raise ValueError(f"run_dir={run_dir} and trainer.default_root_dir={root} are both set {where} "
                                 "and disagree; set only one")
        if run_dir:
            config["trainer.default_root_dir"] = run_dir
        # A logger the config names follows the folder the user chose, unless its save_dir was typed too.
        target = run_dir or (root if "trainer.default_root_dir" in given else None)
        if target is None or any(k.startswith("trainer.logger") and k.endswith("save_dir") for k in given):
            return
        for logger in _as_list(config.get("trainer.logger")):
            init = logger.get("init_args") if isinstance(logger, Namespace) else None
            if init is None or "save_dir" not in init:
                continue
            init["save_dir"] = str(target)
            if run_dir:  # straight into the run dir, as for the default logger
                for key in ("name", "version"):
                    if key in init and not any(k.startswith("trainer.logger") and k.endswith(key) for k in given):
                        init[key] = ""

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, FileNotFoundError) as err:
            # jsonargparse wraps a constructor's error in several lines about Union subtypes: keep the cause.
            while isinstance(err.__cause__, (ValueError, FileNotFoundError)):
                err = err.__cause__
            raise ConfigurationError(" ".join(str(err).split())) from err

    def instantiate_trainer(self, **kwargs):
        try:
            return self._trainer_with_run_dir(**kwargs)
        except (MisconfigurationException, TypeError, ValueError) as err:  # e.g. accelerator: gpu without a GPU
            hint = ""
            accelerator = str(self._subconfig(self.config).get("trainer.accelerator") or "auto")
            if not torch.cuda.is_available() and accelerator not in ("cpu", "auto"):
                hint = ("; this machine has no usable GPU: run on the CPU with --trainer.accelerator=cpu "
                        "--trainer.devices=1 --trainer.precision=32-true (slow: for trying a config out)")
            raise ConfigurationError(f"cannot set up the trainer: {' '.join(str(err).split())}{hint}") from err

    def _trainer_with_run_dir(self, **kwargs):
        config = self._subconfig(self.config_init)
        trainer_cfg = config.get("trainer", {})
        run_dir = config.get("run_dir")
        if run_dir and trainer_cfg.get("logger") in (None, True):
            kwargs["logger"] = TensorBoardLogger(save_dir=run_dir, name="", version="", default_hp_metric=False)
        callbacks = _as_list(trainer_cfg.get("callbacks"))
        if not any(isinstance(c, LastCheckpoint) for c in callbacks):
            kwargs["callbacks"] = [*callbacks, LastCheckpoint()]
        plugins = _as_list(trainer_cfg.get("plugins"))
        if not any(isinstance(p, CheckpointIO) for p in plugins):  # checkpoints complete or absent
            kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") == "last":
            newest = newest_resume_checkpoint(self.trainer)
            if newest is not None:
                rank_zero_info(f"ckpt_path=last: resuming from {newest}")
                config["ckpt_path"] = newest

    def fit(self, **kwargs) -> None:
        """``trainer.fit``, removing the log folders it created if it fails before its first training step."""
        new_dirs = []
        if rank_zero_only.rank == 0:
            dirs = [getattr(logger, "log_dir", None) for logger in self.trainer.loggers]
            dirs.append(self.trainer.default_root_dir)
            new_dirs = sorted({_first_new_folder(d) for d in dirs if isinstance(d, str) and not os.path.exists(d)})
        try:
            self.trainer.fit(**kwargs)
        except CheckpointWriteError:  # a full disk: one line (main); no partial checkpoint was left
            self._remove_if_untrained(new_dirs)
            raise
        except RuntimeError as err:
            if "Error(s) in loading state_dict" not in str(err):
                raise
            self._remove_if_untrained(new_dirs)
            detail = " ".join(str(err).split())
            detail = detail[detail.find(":") + 1:].strip()
            raise ConfigurationError(f"--ckpt_path {kwargs.get('ckpt_path')}: its weights do not fit the model the "
                                     f"config builds ({detail[:300]}{'…' if len(detail) > 300 else ''})") from None
        except (ValueError, OSError) as err:  # before the first step: what was asked cannot run (data, folders)
            if self._remove_if_untrained(new_dirs):
                raise
            raise ConfigurationError(_one_line(err)) from err
        except BaseException:
            self._remove_if_untrained(new_dirs)
            raise

    def _remove_if_untrained(self, new_dirs) -> bool:
        """Remove the folders this run created if it trained no step; whether it had trained."""
        counters = [c.batches_trained for c in self.trainer.callbacks if isinstance(c, LastCheckpoint)]
        trained = any(counters) if counters else self.trainer.global_step > 0
        for d in new_dirs:
            if not trained and os.path.isdir(d):
                shutil.rmtree(d, ignore_errors=True)
                rank_zero_info(f"removed {d}: the run failed before its first training step")
        return trained


def _one_line(err: BaseException) -> str:
    """An error's message on one line; an OSError as 'PATH: reason' (PermissionError on --run_dir...)."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        return f"{err.filename}: {err.strerror}"
    return " ".join(str(err).split()) or type(err).__name__


def _model_differences(before, after) -> list[tuple[str, object, object]]:
    """(key, value after, value before) for every model setting that differs between two parsed configs."""
    def flat(namespace):
        return {} if namespace is None else {key: value for key, value in namespace.items(branches=False)}

    old, new = flat(before), flat(after)
    return [(key, new.get(key), old.get(key)) for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


def _first_new_folder(path: str) -> str:
    """The outermost folder of ``path`` that does not exist yet (what a failed run may remove whole)."""
    path = os.path.abspath(path)
    while not os.path.exists(os.path.dirname(path)):
        path = os.path.dirname(path)
    return path


def cli(args=None, *, run: bool = True) -> ProjectCLI:
    """Build (and by default run) the CLI; ``args`` is a list of command-line strings, for in-process use."""
    return ProjectCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_class=ConciseArgumentParser,
        parser_kwargs={"prog": "lightning"},
        seed_everything_default=0,
        args=args,
        run=run,
    )


def _not_an_advert(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("💡 Tip:")


def quiet_lightning() -> None:
    """Drop what Lightning prints on every run that says nothing about the run: its adverts for its cloud
    services ("💡 Tip: ...") and a deprecation warning from its own use of torch's pytree API."""
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_an_advert)  # once, however often called
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")


def main(args=None) -> int:
    """Entry point of the ``lightning`` console script; ``main(["fit", "--config", ...])`` works in-process.

    Returns 0, or 2 with a message when the configuration cannot be built (weights that cannot be
    found offline, an accelerator the machine lacks, an unreadable ``--ckpt_path``, ...) or a dataset
    root lacks the expected layout (shown after the first line); 1 with a message when a checkpoint
    cannot be written (a full disk); a fit stopped by SIGTERM or SLURM's
    requeue signal raises :class:`~lit_modules.callbacks.TrainingInterrupted`
    (``SystemExit(128 + signum)``) after saving.
    """
    quiet_lightning()
    try:
        cli(args)
    except (ConfigurationError, DatasetLayoutError) as err:  # what the user gave: a message, not a traceback
        print(f"lightning: error: {err}", file=sys.stderr)
        return 2
    except CheckpointWriteError as err:  # the disk, not the code: a message naming the file and the cause
        print(f"lightning: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
