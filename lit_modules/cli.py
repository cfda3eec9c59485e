"""The ``lightning`` command: every training job is ``lightning fit|validate|test --config configs/<job>.yaml``.

A plain :class:`~lightning.pytorch.cli.LightningCLI` in subclass mode: the config names the
LightningModule and LightningDataModule by ``class_path``, so distillation, segmentation
probes and any later job share this one entry point. Two additions, both for jobs that are
preempted and requeued on a cluster:

- ``--run_dir DIR`` gives a run one stable folder: ``trainer.default_root_dir`` (where
  Lightning writes its SLURM ``hpc_ckpt_*.ckpt``), a TensorBoard logger that writes straight
  into ``DIR`` instead of a new ``version_N`` per restart, and so ModelCheckpoint's default
  folder ``DIR/checkpoints``.
- ``--ckpt_path=last`` also considers Lightning's SLURM checkpoints: Lightning alone resumes
  from ``last.ckpt`` even when the checkpoint saved at preemption is newer.

The config is saved with ``overwrite=True`` because a requeued job reuses its log folder.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

__all__ = ["ProjectCLI", "cli", "main", "newest_resume_checkpoint"]


def newest_resume_checkpoint(trainer) -> Optional[str]:
    """The newest of Lightning's SLURM checkpoints and every ModelCheckpoint's ``last*.ckpt``, or None."""
    candidates = set(glob.glob(os.path.join(str(trainer.default_root_dir), "hpc_ckpt_*.ckpt")))
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            # The same lookup Lightning does for ckpt_path="last".
            candidates |= set(callback._find_last_checkpoints(trainer))
    existing = [p for p in candidates if os.path.isfile(p)]
    return max(existing, key=os.path.getmtime) if existing else None


class ProjectCLI(LightningCLI):
    """LightningCLI with a stable per-run folder and a ``ckpt_path=last`` that knows SLURM checkpoints."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--run_dir", type=Optional[str], default=None,
            help="One stable folder for logs and checkpoints (keep it fixed across requeues): sets "
                 "trainer.default_root_dir and, unless trainer.logger is configured, a TensorBoardLogger "
                 "writing straight into it; ModelCheckpoint then defaults to RUN_DIR/checkpoints.")

    def instantiate_trainer(self, **kwargs):
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        run_dir = config.get("run_dir")
        if run_dir:
            trainer_cfg = config.get("trainer", {})
            root = trainer_cfg.get("default_root_dir")
            if root is not None and os.path.abspath(str(root)) != os.path.abspath(run_dir):
                raise ValueError(f"--run_dir={run_dir} and --trainer.default_root_dir={root} disagree; set only one")
            kwargs["default_root_dir"] = run_dir
            if trainer_cfg.get("logger") in (None, True):
                kwargs["logger"] = TensorBoardLogger(save_dir=run_dir, name="", version="", default_hp_metric=False)
        return super().instantiate_trainer(**kwargs)

    def before_fit(self) -> None:
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") == "last":
            newest = newest_resume_checkpoint(self.trainer)
            if newest is not None:
                rank_zero_info(f"ckpt_path=last: resuming from {newest}")
                config["ckpt_path"] = newest


def cli(args=None, *, run: bool = True) -> ProjectCLI:
    """Build (and by default run) the CLI; ``args`` is a list of command-line strings, for in-process use."""
    return ProjectCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"prog": "lightning"},
        seed_everything_default=0,
        args=args,
        run=run,
    )


def main(args=None) -> int:
    """Entry point of the ``lightning`` console script; ``main(["fit", "--config", ...])`` works in-process."""
    cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
