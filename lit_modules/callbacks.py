"""A checkpoint at the step where a run ends, whatever ends it: the last step, SIGTERM, or SLURM's requeue signal.

Lightning alone leaves three gaps, which :class:`LastCheckpoint` closes (``lightning fit``
adds one to every run, see lit_modules/cli.py):

- ``ModelCheckpoint(every_n_train_steps=N, save_last=True)`` does not refresh ``last.ckpt``
  when training ends, so the file a config hands to the next stage (and the one exported)
  can be up to N − 1 steps old.
- On SLURM's requeue signal Lightning saves ``hpc_ckpt_*.ckpt`` inside the signal handler,
  in the middle of a step (and behind a barrier that can deadlock against an all-reduce in
  flight), so the requeued job does not continue exactly where the first one stopped.
- SIGTERM ends a fit with exit code 0 and no checkpoint.

Here a signal handler only sets a flag. At the next training-step boundary
(``on_train_batch_end``, where ModelCheckpoint takes its own step checkpoints, so a resume
continues exactly) all processes agree on the flag in one all-reduce and write ``last.ckpt``
through every ``ModelCheckpoint(save_last=...)``; on the requeue signal rank 0 then runs
``scontrol requeue``. The fit ends with :class:`TrainingInterrupted`, a ``SystemExit`` whose
code is 128 + the signal number (143 for SIGTERM, 138 for SIGUSR1), as a shell reports a
process killed by that signal, so a scheduler sees the interruption.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from typing import Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

__all__ = ["LastCheckpoint", "TrainingInterrupted"]


class TrainingInterrupted(SystemExit):
    """Raised by :class:`LastCheckpoint` after it saved at a step boundary on a signal; ``code`` is 128 + signum."""

    def __init__(self, signum: int, checkpoints: list[str]):
        super().__init__(128 + int(signum))
        self.signum = int(signum)
        self.checkpoints = checkpoints

    def __str__(self) -> str:
        return (f"training stopped by {signal.Signals(self.signum).name} at a step boundary; "
                f"saved {', '.join(self.checkpoints)}")


def _slurm_job_id() -> str:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for an array task, else ``SLURM_JOB_ID``."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        raise ValueError(f"cannot requeue: SLURM job id {job!r} (from SLURM_JOB_ID/SLURM_ARRAY_*) is not a job id")
    return job


class LastCheckpoint(Callback):
    """Keep ``last.ckpt`` at the step where training ends, and turn SIGTERM / SLURM's requeue signal into a clean stop.

    - End of training: every ``ModelCheckpoint`` with ``save_last`` that has not saved at the
      final step writes ``last.ckpt`` then (at the step boundary when ``max_steps`` ends the
      run, so that a run extended with a larger ``max_steps`` resumes exactly).
    - SIGTERM (always) and the requeue signal of Lightning's ``SLURMEnvironment`` (SIGUSR1 by
      default; only under SLURM with ``auto_requeue``, which this callback then takes over):
      the handler sets a flag; at the next training-step boundary the callback saves
      ``last.ckpt`` as above (``DEFAULT_ROOT_DIR/hpc_ckpt_<n>.ckpt`` if no ModelCheckpoint has
      ``save_last``, which Lightning and ``--ckpt_path=last`` also resume from), requeues the
      SLURM job on the requeue signal (``scontrol requeue``, rank 0), and raises
      :class:`TrainingInterrupted`. A signal that arrives during validation is acted on at the
      next training step; one that arrives after the last step lets the run finish normally.

    The handlers are installed when training starts (replacing Lightning's for these signals)
    and Lightning restores the previous ones when the fit ends.

    Args:
        requeue: run ``scontrol requeue`` on the SLURM requeue signal (False: save and stop only).
    """

    def __init__(self, requeue: bool = True):
        self.requeue = requeue
        self.batches_trained = 0  # in this fit: tells a failure before training from one during it
        self._received: Optional[int] = None
        self._requeue_signal: Optional[int] = None
        self._replaced: dict[int, object] = {}

    # -- signal handlers --------------------------------------------------------------------------

    def _handler(self, signum, frame) -> None:
        # Only a flag: saving here would run in the middle of whatever the step is doing.
        if self._received is None or signum == self._requeue_signal:
            self._received = signum

    def _install(self, trainer: Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python only delivers signals to the main thread
        signals = [signal.SIGTERM]
        env = trainer._accelerator_connector.cluster_environment
        if isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None:
            self._requeue_signal = int(env.requeue_signal)
            signals.append(env.requeue_signal)
        for signum in signals:
            self._replaced[int(signum)] = signal.signal(signum, self._handler)

    def _restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._replaced.items():
                signal.signal(signum, handler)
        self._replaced = {}

    # -- saving -------------------------------------------------------------------------------------

    @staticmethod
    def _save_last(trainer: Trainer, *, fallback: bool, leave_scheduled: bool = False) -> list[str]:
        """Write ``last.ckpt`` of every ModelCheckpoint with ``save_last`` not yet saved at this step.

        ``leave_scheduled``: skip those whose ``every_n_train_steps`` falls on this step; they are
        about to save it themselves (with their top-k file, which an earlier save would suppress).
        """
        saved, has_last = [], False
        for callback in trainer.checkpoint_callbacks:
            if not isinstance(callback, ModelCheckpoint) or not callback.save_last:
                continue
            has_last = True
            # Lightning saves last.ckpt together with every other checkpoint of a step.
            if getattr(callback, "_last_global_step_saved", None) == trainer.global_step:
                continue
            every = getattr(callback, "_every_n_train_steps", 0)
            if leave_scheduled and every > 0 and trainer.global_step % every == 0:
                continue
            callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))
            saved.append(callback.last_model_path)
        if fallback and not has_last:
            path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
            trainer.save_checkpoint(path)
            saved.append(path)
        return saved

    def _requeue_job(self, trainer: Trainer, checkpoints: list[str]) -> None:
        if not trainer.is_global_zero:
            return
        job = _slurm_job_id()
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        except FileNotFoundError:
            rank_zero_warn(f"scontrol not found: SLURM job {job} was not requeued; resubmit it to resume from "
                           f"{', '.join(checkpoints)}")
            return
        if result.returncode == 0:
            rank_zero_info(f"requeued SLURM job {job}")
        else:
            rank_zero_warn(f"`scontrol requeue {job}` failed ({result.returncode}: {result.stderr.strip()}); "
                           f"resubmit the job to resume from {', '.join(checkpoints)}")

    # -- hooks ----------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.batches_trained = 0
        self._received = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After Lightning registered its own handlers (Trainer._run), so these replace them; a
        # SIGTERM that Lightning's handler caught before (setup, sanity check) is carried over.
        self._install(trainer)
        if trainer.received_sigterm and self._received is None:
            self._received = int(signal.SIGTERM)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx) -> None:
        self.batches_trained += 1
        if 0 <= trainer.max_steps <= trainer.global_step:
            # The run's last step: save here, where step checkpoints are taken, rather than in
            # on_train_end, whose loop state does not resume exactly when a run is extended. The
            # run is complete, so a pending signal stops nothing (the same on every process).
            self._save_last(trainer, fallback=False, leave_scheduled=True)
            return
        # Every process takes part in this all-reduce at the same point of every step, so they
        # all decide together, and a signal seen by any one of them stops them all.
        if not trainer.strategy.reduce_boolean_decision(self._received is not None, all=False):
            return
        requeue = self._requeue_signal is not None and trainer.strategy.reduce_boolean_decision(
            self._received == self._requeue_signal, all=False)
        signum = self._requeue_signal if requeue else int(signal.SIGTERM)
        checkpoints = self._save_last(trainer, fallback=True)
        checkpoints = checkpoints or [c.last_model_path for c in trainer.checkpoint_callbacks
                                      if isinstance(c, ModelCheckpoint) and c.save_last]
        rank_zero_info(f"{signal.Signals(signum).name}: saved step {trainer.global_step} to {', '.join(checkpoints)}")
        if requeue and self.requeue:
            self._requeue_job(trainer, checkpoints)
        self._restore()
        raise TrainingInterrupted(signum, checkpoints)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._received is not None:
            rank_zero_info(f"{signal.Signals(self._received).name} arrived after the last training step; "
                           "the run finished normally")
        self._save_last(trainer, fallback=False)
        self._restore()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore()
