"""Distilling DINOv2 into an ALiBi (or NoPE) student: the recipe of docs/method.md §4.

The teacher is the unmodified DINOv2, frozen; its final-normed patch tokens, with the most
positional channels zeroed, are the target. The student is the same ViT with ``pos_embed``
zeroed and frozen and the 2D ALiBi bias in every attention layer; it starts from the
teacher's weights and learns to reproduce the target without absolute position. The loss is
1 − cosine similarity over channels per patch token; CLS and register tokens are not
supervised.

The teacher runs batched on the accelerator inside the step. It is deliberately *not* a
registered submodule: its weights stay out of checkpoints (they are the public DINOv2
weights, rebuilt from the hyperparameters), out of DDP's parameter broadcast, and out of
``train()``, so it can never leave eval mode.
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

import alibi_vit
from alibi_vit import create_backbone, load_state_dict_file, load_weights, patch_features
from alibi_vit.analysis.feature_maps import shared_pca_rgb
from alibi_vit.analysis.heads import (DEFAULT_SINK, figure_to_array, head_parameter_masks, head_statistics,
                                      plot_head_maps, reinit_head_parameters)
from alibi_vit.analysis.probe import positional_r2
from alibi_vit.images import denormalize, load_image_set, normalize
from alibi_vit.models.attention import POSITION_KWARGS
from alibi_vit.models.checkpoint import WeightsUnavailableError

__all__ = ["DistillationModule", "KNOWN_BLANK_CHANNELS", "build_student", "cosine_distance", "copy_teacher_weights",
           "student_state_dict"]

# The most positional channels of a teacher's published weights, blanked in the distillation
# target (docs/method.md §4), with the architecture they were measured on.
KNOWN_BLANK_CHANNELS = {
    "vit_small_patch14_reg4_dinov2": {"channels": (47, 113, 117, 359), "embed_dim": 384, "depth": 12},
    # the channels the authors blank for their ALiBi DINOv3 ViT-S+/16 student
    "vit_small_plus_patch16_dinov3": {"channels": (74, 123, 149, 267), "embed_dim": 384, "depth": 12},
}

# Parameters an ALiBi student may have that its teacher lacks: learned slopes (docs/method.md §2) and the
# query/value biases of a DINOv3 student built with qkv_bias=True (the authors' S+ student trains them; they
# start at zero, so the student starts as the teacher).
_STUDENT_ONLY_KEYS = re.compile(r"^blocks\.\d+\.attn\.(m|q_bias|v_bias)$")
# Keys never copied from the teacher: the student's position embedding stays zero.
_NOT_FROM_TEACHER = ("pos_embed",)


def build_student(name: str, model_kwargs: Optional[dict] = None, student_kwargs: Optional[dict] = None) -> nn.Module:
    """The student architecture, randomly initialised: a registered ALiBi/NoPE model, or any timm ViT converted.

    ``model_kwargs`` are architecture overrides shared with the teacher; ``student_kwargs``
    are the student's own (``slopes``, ``backend``, ``wrap``...). Export rebuilds the student
    with this same function, so exported weights are checked against the trained architecture.
    """
    kwargs = {**(model_kwargs or {}), **(student_kwargs or {})}
    if name in alibi_vit.MODEL_NAMES:
        return create_backbone(name, **kwargs)
    position = {k: kwargs.pop(k) for k in POSITION_KWARGS if k in kwargs}
    return alibi_vit.convert_to_alibi(create_backbone(name, **kwargs), **position)


def copy_teacher_weights(student: nn.Module, teacher: nn.Module) -> None:
    """Start the student from the teacher's weights (the paper's initialisation), strictly.

    Every student tensor must come from the teacher with the same shape, except ``pos_embed``
    (kept at zero) and learned slopes (kept at their initial value); anything else that does
    not match is an error listing the keys.
    """
    t_state, s_state = teacher.state_dict(), student.state_dict()
    missing = sorted(k for k in s_state if k not in t_state and k not in _NOT_FROM_TEACHER
                     and not _STUDENT_ONLY_KEYS.match(k))
    unused = sorted(k for k in t_state if k not in s_state)
    shapes = sorted(f"{k}: teacher {tuple(t_state[k].shape)} vs student {tuple(s_state[k].shape)}"
                    for k in s_state if k in t_state and k not in _NOT_FROM_TEACHER
                    and t_state[k].shape != s_state[k].shape)
    if missing or unused or shapes:
        lines = [f"cannot initialise the student ({type(student).__name__}) from the teacher:"]
        for title, keys in (("student keys the teacher lacks", missing), ("teacher keys the student lacks", unused),
                            ("shape mismatches", shapes)):
            if keys:
                lines.append(f"  {title} ({len(keys)}): " + ", ".join(keys))
        raise ValueError("\n".join(lines))
    merged = {k: (s_state[k] if k in _NOT_FROM_TEACHER or k not in t_state else t_state[k]) for k in s_state}
    load_weights(student, merged, source="teacher weights")


def student_state_dict(state: dict) -> dict:
    """The student's weights from this module's state_dict (keys ``student.*``), as a plain timm state_dict."""
    prefix = "student."
    out = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not out:
        some = ", ".join(list(state)[:5])
        raise ValueError(f"no 'student.*' keys in this state_dict (first keys: {some}); "
                         "is it a checkpoint of lit_modules.distillation.DistillationModule?")
    return out


def cosine_distance(student: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over batch and patches of 1 − cos(student, target) across channels, for (B, C, h, w) maps.

    Computed in float32 so that bf16 autocast does not quantise a loss that ends near 0.
    """
    if student.shape != target.shape:
        raise ValueError(f"student features {tuple(student.shape)} and target {tuple(target.shape)} differ in shape")
    cos = F.cosine_similarity(student.float(), target.float(), dim=1, eps=1e-8)
    return (1.0 - cos).mean()


def _check_reinit_heads(options) -> Optional[dict]:
    """``reinit_heads`` with its defaults filled in, or ``None``; a clear error for anything else."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ValueError(f"reinit_heads must be a mapping {{threshold, passes, steps_per_pass}}, got {options!r}")
    known = {"threshold", "passes", "steps_per_pass"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"reinit_heads has unknown keys {unknown}; it takes {sorted(known)}")
    if "steps_per_pass" not in options:
        raise ValueError("reinit_heads needs steps_per_pass (optimizer steps each pass trains the chosen heads)")
    out = {"threshold": float(options.get("threshold", DEFAULT_SINK)), "passes": options.get("passes", 1),
           "steps_per_pass": options["steps_per_pass"]}
    if not 0.0 < out["threshold"] <= 1.0:
        raise ValueError(f"reinit_heads.threshold is a prefix mass in (0, 1], got {out['threshold']}")
    for key in ("passes", "steps_per_pass"):
        if isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 1:
            raise ValueError(f"reinit_heads.{key} must be a positive integer, got {out[key]!r}")
    return out


def _images_of(batch) -> torch.Tensor:
    """Image tensor of a batch: a tensor, the first item of a tuple/list, or a dict's ``image``."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    if isinstance(batch, dict) and isinstance(batch.get("image"), torch.Tensor):
        return batch["image"]
    raise TypeError(f"expected a batch of images (a tensor, (images, ...) or {{'image': ...}}), got {type(batch)}")


def _normalized_set(source: str, size: int, count: Optional[int] = None, **kwargs) -> torch.Tensor:
    """The first ``count`` images of a bundled set or ``"noise"``, cropped to ``size`` and normalised, as a batch."""
    return torch.stack([normalize(img) for _, img in load_image_set(source, size, **kwargs)[:count]])


class DistillationModule(LightningModule):
    """Frozen DINOv2 teacher → ALiBi/NoPE student, with positional-probe and PCA monitoring at validation.

    Args:
        teacher: timm name of the teacher, e.g. ``vit_small_patch14_reg4_dinov2``.
        student: ``alibi_vit_*``/``nope_vit_*`` name, or a timm ViT name converted with ``convert_to_alibi``.
        teacher_pretrained: load the teacher's published weights through timm (hub or cache).
        teacher_checkpoint: a local timm state_dict for the teacher instead (loaded strictly).
        model_kwargs: architecture overrides for teacher and student alike (tiny test models).
        student_kwargs: the student's own options (``slopes``, ``backend``, ``wrap``, ``normalize``...).
        init_from: ``"teacher"`` (copy the teacher's weights, the paper's start), ``None`` (keep the
            student as built), or a path: a Lightning ``.ckpt`` of this module (stage 2 starts from
            stage 1's) or a plain timm state_dict (``.safetensors``/``.pth``) of the student.
        blank_channels: target channels set to zero, the teacher's most positional ones. ``None``
            (default): the known list of the teacher's published weights, which exists only for
            ``vit_small_patch14_reg4_dinov2`` (47, 113, 117, 359; docs/method.md §4) and
            ``vit_small_plus_patch16_dinov3`` (74, 123, 149, 267, the authors' list); any
            other teacher, a changed architecture or a randomly initialised teacher needs an
            explicit list (rank channels with ``alibi-vit channels``). ``[]``: no
            blanking. A known list given for another teacher is an error.
        lr, weight_decay, betas: AdamW over the student's trainable parameters.
        warmup_steps: linear warmup over this many optimizer steps (0: none); clipped, with a
            warning, to the run's length when the run is shorter.
        lr_schedule: ``"constant"`` or ``"cosine"`` decay to ``min_lr`` over the run, stepped per optimizer step.
        compile_student: run the student's forward through ``torch.compile``.
        probe_image_size: size of the fixed probe and PCA images (a multiple of the patch size).
        probe_fraction, probe_repeats: positional probe settings (docs/method.md §5).
        probe_noise_images: number of uniform-noise images probed (0: skip).
        pca_images: number of bundled photos shown as PCA-as-RGB of student features (0: skip).
        monitor_heads: at each validation, log the student's per-head prefix mass and mean attention
            distance beside the teacher's as the image ``val/heads`` and its number of sink heads as
            ``val/sink_heads`` (on the textures probe images; ``alibi_vit.analysis.heads``).
        reinit_heads: surgical re-initialisation of sink heads, ``{threshold: 0.9, passes: 1,
            steps_per_pass: N}`` (``None``: off). Pass k (k = 0..passes−1) starts at optimizer step
            k·N: the student's heads whose prefix mass on the textures probe images is ≥ threshold
            get fresh Q/K/V rows (and slope, if learned) and zeroed output-projection columns, and
            for N steps only those entries train (every other gradient is dropped and every other
            entry kept bit-identical); then normal distillation continues. A pass that finds no
            sink head leaves its steps to normal distillation.
    """

    def __init__(
        self,
        teacher: str = "vit_small_patch14_reg4_dinov2",
        student: str = "alibi_vit_small_patch14_reg4_dinov2",
        teacher_pretrained: bool = True,
        teacher_checkpoint: Optional[str] = None,
        model_kwargs: Optional[dict] = None,
        student_kwargs: Optional[dict] = None,
        init_from: Optional[str] = "teacher",
        blank_channels: Optional[Sequence[int]] = None,
        lr: float = 1e-4,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        min_lr: float = 0.0,
        compile_student: bool = False,
        probe_image_size: int = 224,
        probe_fraction: float = 0.025,
        probe_repeats: int = 10,
        probe_noise_images: int = 4,
        pca_images: int = 3,
        monitor_heads: bool = True,
        reinit_heads: Optional[dict] = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        if lr <= 0 or weight_decay < 0 or warmup_steps < 0 or min_lr < 0:
            raise ValueError(f"need lr > 0, weight_decay >= 0, warmup_steps >= 0, min_lr >= 0; got lr={lr}, "
                             f"weight_decay={weight_decay}, warmup_steps={warmup_steps}, min_lr={min_lr}")

        try:
            teacher_model = create_backbone(teacher, pretrained=teacher_pretrained and teacher_checkpoint is None,
                                            checkpoint=teacher_checkpoint, **(model_kwargs or {}))
        except WeightsUnavailableError as err:
            raise ValueError(f"teacher {teacher}: no pretrained weights here: {err.reason}. Pass "
                             "--model.teacher_checkpoint=PATH (a timm state_dict file of the teacher, e.g. DINOv2's "
                             "model.safetensors)") from None
        teacher_model.requires_grad_(False).eval()
        # Not a submodule on purpose (see the module docstring): plain attribute, moved to the
        # batch's device on first use.
        object.__setattr__(self, "teacher", teacher_model)

        self.student = build_student(student, model_kwargs, student_kwargs)
        self._check_pair()
        patch = self.student.patch_embed.patch_size[0]
        if probe_image_size % patch:
            raise ValueError(f"probe_image_size={probe_image_size} must be a multiple of the patch size {patch}")
        self.blank_channels = self._check_blank_channels(blank_channels)
        self.hparams["blank_channels"] = self.blank_channels  # checkpoints record the list actually used
        self._initialise_student(init_from)
        self._reinit = _check_reinit_heads(reinit_heads)

        # Surgical re-initialisation: the last pass started, and the one in progress (heads, masks, kept entries).
        self._reinit_started = -1
        self._surgery: Optional[dict] = None
        self._surgery_resumed: Optional[dict] = None
        self._teacher_heads = None

        self._student_forward = None  # compiled lazily, in the process that trains
        self._last_batch_end: Optional[float] = None
        self._probe_batches: Optional[dict] = None
        self._teacher_reference: Optional[dict] = None

    # -- construction ---------------------------------------------------------------------------

    def _check_pair(self) -> None:
        t, s = self.teacher, self.student
        if t.num_features != s.num_features:
            raise ValueError(f"teacher {self.hparams.teacher} has {t.num_features} channels but student "
                             f"{self.hparams.student} has {s.num_features}; they must match")
        if tuple(t.patch_embed.patch_size) != tuple(s.patch_embed.patch_size):
            raise ValueError(f"teacher patch size {t.patch_embed.patch_size} differs from the student's "
                             f"{s.patch_embed.patch_size}")

    def _check_blank_channels(self, channels) -> list[int]:
        name, dim = self.hparams.teacher, self.teacher.num_features
        known = KNOWN_BLANK_CHANNELS.get(name)
        how = ("pass an explicit --model.blank_channels=[...] (rank channels with `alibi-vit channels "
               f"--model {name} --pretrained --images DIR`), or [] for no blanking")
        if channels is None:
            if known is None:
                raise ValueError(f"no known blank_channels for teacher {name} (the default list is for "
                                 f"{', '.join(KNOWN_BLANK_CHANNELS)}): {how}")
            depth = len(self.teacher.blocks)
            if (dim, depth) != (known["embed_dim"], known["depth"]):
                raise ValueError(f"the default blank_channels {list(known['channels'])} belong to {name} with "
                                 f"width {known['embed_dim']} and depth {known['depth']}; this teacher has width "
                                 f"{dim} and depth {depth}: {how}")
            if not (self.hparams.teacher_pretrained or self.hparams.teacher_checkpoint):
                raise ValueError(f"the default blank_channels {list(known['channels'])} belong to {name}'s published "
                                 f"weights, but this teacher is randomly initialised: {how}")
            channels = known["channels"]
        channels = sorted({int(c) for c in channels})
        for other, entry in KNOWN_BLANK_CHANNELS.items():
            if other != name and channels == sorted(entry["channels"]):
                raise ValueError(f"blank_channels {channels} are {other}'s most positional channels, not those of "
                                 f"teacher {name}: {how}")
        bad = [c for c in channels if not 0 <= c < dim]
        if bad:
            raise ValueError(f"blank_channels {bad} are out of range for teacher {name} with {dim} channels "
                             f"(valid: 0..{dim - 1})")
        return channels

    def _initialise_student(self, init_from: Optional[str]) -> None:
        if init_from is None:
            pass
        elif init_from == "teacher":
            copy_teacher_weights(self.student, self.teacher)
        else:
            path = Path(init_from)
            state = load_state_dict_file(path)  # a Lightning .ckpt yields its 'state_dict'
            if any(k.startswith("student.") for k in state):
                state = student_state_dict(state)
            load_weights(self.student, state, source=f"init_from {path}")
        # The student must carry no absolute position, whatever the source held.
        if getattr(self.student, "pos_embed", None) is not None:
            with torch.no_grad():
                self.student.pos_embed.zero_()
            self.student.pos_embed.requires_grad_(False)

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()  # frozen: dropout/drop-path never on, whatever Lightning asks
        return self

    # -- the loss -------------------------------------------------------------------------------

    def _teacher_on(self, images: torch.Tensor) -> nn.Module:
        ref = next(self.teacher.parameters())
        dtype = next(self.student.parameters()).dtype  # follows "bf16-true"/"16-true" precision casts
        if ref.device != images.device or ref.dtype != dtype:
            self.teacher.to(device=images.device, dtype=dtype)
        return self.teacher

    @torch.no_grad()
    def teacher_targets(self, images: torch.Tensor) -> torch.Tensor:
        """Teacher's final-normed patch tokens (B, C, h, w) with ``blank_channels`` zeroed."""
        target = patch_features(self._teacher_on(images), images)
        if self.blank_channels:
            target = target.clone()
            target[:, self.blank_channels] = 0
        return target

    def student_features(self, images: torch.Tensor) -> torch.Tensor:
        if self.hparams.compile_student:
            if self._student_forward is None:
                student = self.student
                self._student_forward = torch.compile(lambda x: patch_features(student, x))
            return self._student_forward(images)
        return patch_features(self.student, images)

    def distillation_loss(self, images: torch.Tensor) -> torch.Tensor:
        """1 − cosine similarity between student features and the blanked teacher target, averaged."""
        return cosine_distance(self.student_features(images), self.teacher_targets(images))

    # -- Lightning hooks ------------------------------------------------------------------------

    def training_step(self, batch, batch_idx):
        images = _images_of(batch)
        loss = self.distillation_loss(images)
        # sync_dist: the logged value is the loss of the global batch, comparable across device counts.
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True, sync_dist=True,
                 batch_size=images.shape[0])
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False,
                 batch_size=images.shape[0])
        return loss

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._reinit is not None:
            self._surgery_schedule()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # Wall time between consecutive batch ends covers data loading, teacher and student.
        now = time.perf_counter()
        if self._last_batch_end is not None:
            per_device = _images_of(batch).shape[0] / max(now - self._last_batch_end, 1e-9)
            self.log("train/img_per_s_per_device", per_device, on_step=True, on_epoch=False)
            self.log("train/img_per_s", per_device * self.trainer.world_size, on_step=True, on_epoch=False)
        self._last_batch_end = now

    def on_train_epoch_start(self) -> None:
        self._last_batch_end = None

    def on_validation_end(self) -> None:
        self._last_batch_end = None  # validation time is not training throughput

    def validation_step(self, batch, batch_idx):
        images = _images_of(batch)
        loss = self.distillation_loss(images)
        self.log("val/loss", loss, on_step=False, on_epoch=True, prog_bar=True, sync_dist=True,
                 batch_size=images.shape[0])
        return loss

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or not self.trainer.is_global_zero:
            return
        self._monitor_position()
        if self.hparams.monitor_heads:
            self._monitor_heads()

    def on_train_end(self) -> None:
        if self._surgery is not None:  # the run ended inside a pass: report it, keep it for a resume
            self._finish_surgery(keep=True)

    # -- monitoring: positional probe and PCA images ----------------------------------------------

    def _probe_sets(self) -> dict:
        if self._probe_batches is None:
            size = self.hparams.probe_image_size
            sets = {"textures": _normalized_set("textures", size)}
            if self.hparams.probe_noise_images > 0:
                sets["noise"] = _normalized_set("noise", size, noise_count=self.hparams.probe_noise_images, seed=0)
            if self.hparams.pca_images > 0:
                sets["pca"] = _normalized_set("photos", size, count=self.hparams.pca_images)
            self._probe_batches = sets
        return self._probe_batches

    @torch.no_grad()
    def _features(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        was_training = model.training
        model.eval()
        try:
            dtype = next(model.parameters()).dtype  # "bf16-true"/"16-true" cast the weights, not these images
            return patch_features(model, images.to(self.device, dtype)).float()
        finally:
            model.train(was_training)

    def _probe(self, features: torch.Tensor) -> float:
        return positional_r2(features, target="xy", fraction=self.hparams.probe_fraction,
                             repeats=self.hparams.probe_repeats, seed=0)

    def _monitor_position(self) -> None:
        """Positional R² of student (each validation) and teacher (computed once) on fixed images; PCA images."""
        sets = self._probe_sets()
        probe_sets = [name for name in ("textures", "noise") if name in sets]
        if self._teacher_reference is None:
            teacher = self._teacher_on(sets["textures"].to(self.device))
            self._teacher_reference = {name: self._probe(self._features(teacher, sets[name]))
                                       for name in probe_sets}
        for name in probe_sets:
            self.log(f"val/probe_r2_{name}", self._probe(self._features(self.student, sets[name])),
                     rank_zero_only=True)
            self.log(f"val/teacher_probe_r2_{name}", self._teacher_reference[name], rank_zero_only=True)
        if "pca" in sets and isinstance(self.logger, TensorBoardLogger):
            images = sets["pca"]
            pca = shared_pca_rgb(self._features(self.student, images)).cpu()
            shown = F.interpolate(pca, size=images.shape[-2:], mode="nearest")
            # Input (de-normalised to [0, 1]) beside its PCA map, one row per image.
            inputs = denormalize(images.cpu())
            self.logger.experiment.add_images("val/student_pca", torch.cat([inputs, shown], dim=-1),
                                              global_step=self.global_step)

    # -- monitoring: attention heads ---------------------------------------------------------------

    def _sink_threshold(self) -> float:
        return self._reinit["threshold"] if self._reinit is not None else DEFAULT_SINK

    def _head_stats(self, model: nn.Module):
        return head_statistics(model, self._probe_sets()["textures"].to(self.device))

    def _monitor_heads(self) -> None:
        """Per-head prefix mass and mean distance of student and teacher (once) as an image; sink-head counts."""
        threshold = self._sink_threshold()
        if self._teacher_heads is None:
            self._teacher_heads = self._head_stats(self._teacher_on(self._probe_sets()["textures"].to(self.device)))
        student = self._head_stats(self.student)
        self.log("val/sink_heads", float(len(student.sink_heads(threshold))), rank_zero_only=True)
        self.log("val/teacher_sink_heads", float(len(self._teacher_heads.sink_heads(threshold))), rank_zero_only=True)
        if isinstance(self.logger, TensorBoardLogger):
            fig = plot_head_maps({f"teacher {self.hparams.teacher}": self._teacher_heads,
                                  f"student, step {self.global_step}": student}, sink=threshold)
            self.logger.experiment.add_image("val/heads", figure_to_array(fig), global_step=self.global_step,
                                             dataformats="HWC")

    # -- surgical re-initialisation of sink heads ------------------------------------------------------

    def _surgery_schedule(self) -> None:
        """At the first batch of each pass: finish the previous one, detect sink heads, re-initialise them."""
        steps, step = self._reinit["steps_per_pass"], self.global_step
        if self._surgery is not None and step >= self._surgery["end"]:
            self._finish_surgery()
        if self._surgery_resumed is not None:  # resumed inside a pass: same heads, no second re-initialisation
            state, self._surgery_resumed = self._surgery_resumed, None
            if step < state["end"]:
                self._begin_surgery(state["pass"], [tuple(h) for h in state["heads"]], state["before"], reinit=False)
        k = step // steps
        if k < self._reinit["passes"] and k > self._reinit_started:
            self._reinit_started = k
            stats = self._head_stats(self.student)
            heads = stats.sink_heads(self._reinit["threshold"])
            if not heads:
                rank_zero_info(f"reinit_heads pass {k + 1}: no head with prefix mass ≥ {self._reinit['threshold']:g}; "
                               "normal distillation")
                return
            self._begin_surgery(k, heads, [float(stats.prefix_mass[i, j]) for i, j in heads], reinit=True)

    def _begin_surgery(self, k: int, heads, before, reinit: bool) -> None:
        by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            by_layer.setdefault(layer, []).append(head)
        masks = {}
        for layer, layer_heads in by_layer.items():
            attn = self.student.blocks[layer].attn
            mine = (reinit_head_parameters if reinit else head_parameter_masks)(attn, layer_heads)
            masks.update({f"blocks.{layer}.attn.{name}": mask for name, mask in mine.items()})
        params = dict(self.student.named_parameters())
        self._surgery = {"pass": k, "heads": [list(h) for h in heads], "before": list(before),
                         "end": (k + 1) * self._reinit["steps_per_pass"], "masks": masks,
                         # Entries outside the heads, restored after each step (AdamW's decoupled weight decay
                         # moves every parameter that has a gradient, even a zero one).
                         "kept": {name: params[name].detach().clone() for name in masks}}
        if reinit:
            listed = ", ".join(f"{i}.{j} ({b:.3f})" for (i, j), b in zip(heads, before))
            rank_zero_info(f"reinit_heads pass {k + 1}: re-initialised {len(heads)} sink heads, layer.head (prefix "
                           f"mass): {listed}; training only them for {self._reinit['steps_per_pass']} steps")

    def _finish_surgery(self, keep: bool = False) -> None:
        state = self._surgery
        if not keep:
            self._surgery = None
        heads = [tuple(h) for h in state["heads"]]
        stats = self._head_stats(self.student)
        after = [float(stats.prefix_mass[i, j]) for i, j in heads]
        listed = ", ".join(f"{i}.{j} {b:.3f} → {a:.3f}" for (i, j), b, a in zip(heads, state["before"], after))
        rank_zero_info(f"reinit_heads pass {state['pass'] + 1} {'stopped' if keep else 'done'} at step "
                       f"{self.global_step}: prefix mass of the re-initialised heads {listed}")
        if self.logger is not None and self.trainer.is_global_zero:
            self.logger.log_metrics({"reinit/heads": float(len(heads)),
                                     "reinit/prefix_mass_before": sum(state["before"]) / len(heads),
                                     "reinit/prefix_mass_after": sum(after) / len(heads)}, step=self.global_step)
            if isinstance(self.logger, TensorBoardLogger):
                self.logger.experiment.add_text(
                    "reinit/heads", f"pass {state['pass'] + 1} (layer.head: prefix mass before → after): {listed}",
                    global_step=self.global_step)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._surgery is None:
            return
        masks = self._surgery["masks"]
        for name, param in self.student.named_parameters():
            if name not in masks:
                param.grad = None  # no gradient: AdamW leaves the parameter and its state alone
            elif param.grad is not None:
                param.grad.mul_(masks[name])

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self._surgery is not None:
            params = dict(self.student.named_parameters())
            with torch.no_grad():
                for name, mask in self._surgery["masks"].items():
                    params[name].copy_(torch.where(mask, params[name], self._surgery["kept"][name]))

    def on_save_checkpoint(self, checkpoint) -> None:
        if self._reinit is not None:
            active = None if self._surgery is None else {k: self._surgery[k] for k in ("pass", "heads", "before", "end")}
            checkpoint["reinit_heads"] = {"started": self._reinit_started, "active": active}

    def on_load_checkpoint(self, checkpoint) -> None:
        state = checkpoint.get("reinit_heads")
        if state is not None and self._reinit is not None:
            self._reinit_started = int(state["started"])
            self._surgery_resumed = state["active"]

    # -- optimisation -----------------------------------------------------------------------------

    def configure_optimizers(self):
        params = [p for p in self.student.parameters() if p.requires_grad]
        hp = self.hparams
        optimizer = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
        if hp.warmup_steps == 0 and hp.lr_schedule == "constant":
            return optimizer
        total = float(self.trainer.estimated_stepping_batches)
        if hp.lr_schedule == "cosine" and not math.isfinite(total):
            raise ValueError("a cosine schedule needs a finite run: set trainer.max_steps or trainer.max_epochs")
        warmup = hp.warmup_steps
        if warmup > total:
            # A short run (a smoke test, a demo with --trainer.max_steps=3) still reaches the peak lr.
            rank_zero_warn(f"warmup_steps={warmup} is longer than this run's {int(total)} optimizer steps; "
                           f"warming up over {int(total)} steps instead")
            warmup = int(total)
        floor = hp.min_lr / hp.lr

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if hp.lr_schedule == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1.0, total - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
