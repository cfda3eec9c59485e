"""RASA post-training of a frozen encoder, every round in one ``lightning fit`` (docs/method.md §8).

Round t trains a fresh position head (a bias-free 2×C linear layer and a sigmoid) on the frozen
backbone's final-normed patch tokens with the planes of rounds 1..t−1 removed, against each
patch's (row, col) normalised to [0, 1] (MSE; AdamW on the head only, no weight decay, the
learning rate cosine-decayed to 0 over ``cosine_t_max`` steps of each round, by default the round's
length; the reference decays over 540 of its 552 steps and lets the cosine climb back for the last
12, to 2.4e-7 of the peak). When the round's epochs are over, the plane its two weight rows span
is frozen and stacked, the head is re-initialised and the optimizer state cleared. The number of
rounds is ``rounds``; each round gets ``trainer.max_epochs / rounds`` epochs (the reference: 12
rounds × 12 epochs, batch 32, 518 px).

Logged once per key every validation epoch (``configs/rasa.yaml``: at the end of each round, before
its plane is stacked): ``val/mse`` (the round's head on its tokens), ``val/mse_raw`` (the same head on
the tokens with no plane removed), ``val/mse_own_removed`` (the same head on the tokens with this
round's plane removed too: what the next round starts from; the targets' variance when the plane
held what the head used), ``val/head_r2`` (1 − MSE / variance of the targets), ``val/cosine`` (mean
cosine similarity between original tokens and those of ``val/mse``) and ``val/round``. With labelled
validation batches (:class:`datamodules.rasa.RASADataModule`'s VOC val at 224 px) also the
OverClustering mIoU at k = ``oc_k`` by the RASA reference's own recipe
(:data:`alibi_vit.analysis.overclustering.RECIPES` ``"rasa"``: pixels of bilinearly upsampled
features, faiss k-means, seed 1) of three feature sets:

- ``val/oc_miou_cleaned``: the tokens with every plane up to this round's removed (the reference's
  ``x_no_pos``; what the next round, and a model folded at this round, gives). The best round is
  chosen by it.
- ``val/oc_miou_raw`` (the encoder's own tokens; the same every round, computed once) and
  ``val/oc_miou_plane`` (only the tokens' component in this round's plane, the reference's
  ``x_pos``), with ``oc_reference_mean`` (default).
- ``val/oc_miou_reference_mean``: the mean of those three. The reference logs all three under one
  key (``val/K=21_miou``), which Lightning averages: this is the number its log shows.

``train/mse`` and ``train/lr`` every step.

When fitting ends with every round done, the folded backbone (:func:`alibi_vit.analysis.rasa.fold_planes`:
the timm state_dict plus the one matrix ``rasa_projection``) of the selected round is written to
``EXPORT/rasa_backbone.safetensors`` (its metadata records the model name and kwargs, as
``alibi-vit export`` does, and the rounds folded in): with ``select_round="best"`` (default) the
round of highest ``val/oc_miou_cleaned`` (the reference picks its weights by its k = 21 validation
mIoU), with ``"last"`` (or without labelled validation) all rounds. ``EXPORT/rasa_planes.pt`` holds
every round's plane ((T, 2, C) float32, orthonormal rows) and ``EXPORT/rasa_rounds.json`` the last
validation metrics of every round and the selection. ``EXPORT`` is ``export_dir`` or
``<run dir>/rasa``. ``alibi_vit.create_backbone(name, checkpoint=EXPORT/rasa_backbone.safetensors)``
rebuilds it.

Data: :class:`datamodules.rasa.RASADataModule` (the reference's VOC train images and augmentations;
``configs/rasa.yaml``), any of the image datamodules (batches of images), or a segmentation
datamodule (its labels serve only the OverClustering scores). With ``feature_cache_dir`` and a
segmentation datamodule (e.g. ``COCOStuffSegmentation`` for COCO images, ``VOCSegmentation``) the
backbone runs once per image and later epochs read float16 features from disk, exactly as the
segmentation probe caches them (same files, same keys: a probe's cache of the same backbone is
reused).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_only

from alibi_vit import patch_features
from alibi_vit.analysis.rasa import fold_planes, orthogonalize_planes, remove_planes
from lit_modules.segmentation_probe import FeatureCache, SegmentationProbeModule, backbone_autocast, frozen_backbone

__all__ = ["RASAModule", "position_grid"]


def position_grid(h: int, w: int, device=None) -> torch.Tensor:
    """(h·w, 2) targets (row/(h−1), col/(w−1)), row-major; a single row or column is 0."""
    rows = torch.linspace(0, 1, h, device=device) if h > 1 else torch.zeros(1, device=device)
    cols = torch.linspace(0, 1, w, device=device) if w > 1 else torch.zeros(1, device=device)
    return torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).reshape(-1, 2)


class RASAModule(L.LightningModule):
    """RASA rounds on a frozen backbone.

    Args:
        backbone: timm name: ``vit_small_patch14_reg4_dinov2`` (DINOv2), ``vit_small_patch16_dinov3``,
            this project's ``alibi_vit_*``/``nope_vit_*`` (or a release tag such as
            ``alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco``).
        backbone_checkpoint: a plain timm state_dict of the backbone, loaded strictly.
        pretrained: timm's pretrained weights; default: yes unless a checkpoint is given or
            ``allow_random_init`` is set.
        backbone_kwargs: extra model options (``depth``/``embed_dim`` for tiny test models).
        allow_random_init: permit random weights (tests, offline demos); otherwise an error.
        rounds: RASA rounds (reference: 12); ``trainer.max_epochs`` must be a multiple of it.
        lr: AdamW learning rate of the head (reference 2e-4), no weight decay, cosine to 0 per round.
        orthogonalize: default True: a finished round's plane is made orthogonal to the earlier
            planes before it is stacked. The round's tokens have no component in those planes, so
            the head's predictions do not change; the cleaned features end orthogonal to every plane.
            False stacks the head's raw plane as the reference code does.
        feature_cache_dir: cache backbone features on disk (needs a segmentation datamodule).
        export_dir: where the folded backbone and the planes go (default ``<run dir>/rasa``).
        oc_k: clusters of the per-round OverClustering score (21: VOC's classes; 0 turns it off).
        oc_num_classes: classes of the validation labels (21 for VOC).
        oc_batches: only the first this many validation batches feed the OverClustering scores (None: all;
            the reference: 10 batches of 32, the first 320 VOC val images), the others only the MSEs.
        oc_reference_mean: also score the raw tokens and the plane's component, and log the mean of the three
            as the reference's log shows it (``val/oc_miou_reference_mean``).
        select_round: ``best`` (default: the round of highest ``val/oc_miou_cleaned`` is exported) or ``last``.
        cosine_t_max: steps over which each round's learning rate falls to 0 (default: the round's length;
            the reference: 540, (1,464 // 32) × 12, in rounds of 552 steps).
    """

    def __init__(self, backbone: str = "vit_small_patch14_reg4_dinov2", backbone_checkpoint: str | None = None,
                 pretrained: bool | None = None, backbone_kwargs: dict | None = None,
                 allow_random_init: bool = False, rounds: int = 12, lr: float = 2e-4, orthogonalize: bool = True,
                 feature_cache_dir: str | None = None, export_dir: str | None = None, oc_k: int = 21,
                 oc_num_classes: int = 21, oc_batches: int | None = None, oc_reference_mean: bool = True,
                 select_round: Literal["best", "last"] = "best", cosine_t_max: int | None = None):
        super().__init__()
        self.save_hyperparameters()
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {rounds}")
        if oc_k and oc_k < oc_num_classes:
            raise ValueError(f"oc_k={oc_k} is fewer than the {oc_num_classes} classes (0 turns the score off)")
        if oc_batches is not None and oc_batches < 1:
            raise ValueError(f"oc_batches must be at least 1 (None: every validation batch), got {oc_batches}")
        if select_round not in ("best", "last"):
            raise ValueError(f"select_round must be 'best' or 'last', got {select_round!r}")
        if cosine_t_max is not None and cosine_t_max < 1:
            raise ValueError(f"cosine_t_max must be at least 1 step, got {cosine_t_max}")
        self.backbone = frozen_backbone(backbone, backbone_checkpoint, pretrained, allow_random_init, backbone_kwargs)
        dim = self.backbone.num_features
        self.head = nn.Linear(dim, 2, bias=False)
        # finished rounds' planes, orthonormal rows; grows by one (2, C) per round (see on_load_checkpoint)
        self.register_buffer("planes", torch.zeros(0, 2, dim))
        self.round_history: list[dict] = []
        self.feature_cache = None
        self._val_sums: dict[str, torch.Tensor] = {}
        self._val_oc: dict[str, list] = {}
        self._raw_oc: tuple | None = None  # (fingerprint of the validation features, their mIoU): computed once

    # ---- frozen backbone and features -------------------------------------------------------

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()
        return self

    def backbone_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) normalised images → (B, C, h, w) float32 features, no gradients."""
        with torch.no_grad(), backbone_autocast(images.device):
            return patch_features(self.backbone, images).float()

    def backbone_tag(self, device=None) -> str:
        # the segmentation probe's cache identity (name, options, weights hash, precision): shared files
        return SegmentationProbeModule.backbone_tag(self, device)

    def batch_features(self, batch) -> torch.Tensor:
        """(B, C, h, w) features of a batch: an image tensor, or a segmentation batch (images and/or cached)."""
        if isinstance(batch, torch.Tensor):
            return self.backbone_features(batch)
        if isinstance(batch, dict):
            return SegmentationProbeModule.batch_features(self, batch)
        raise ValueError(f"a RASA batch is an image tensor or a segmentation batch dict, got {type(batch).__name__}")

    @property
    def round(self) -> int:
        """Index of the round being trained (0-based) = number of finished planes."""
        return self.planes.shape[0]

    def _tokens(self, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        features = self.batch_features(batch)
        B, C, h, w = features.shape
        self._grid = (h, w)  # the last batch's patch grid (validation reshapes tokens back to maps)
        raw = features.flatten(2).transpose(1, 2)  # (B, N, C)
        clean = remove_planes(raw, self.planes) if self.round else raw
        return raw, clean, position_grid(h, w, raw.device).expand(B, -1, -1)

    def predict_position(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(tokens))

    # ---- rounds -----------------------------------------------------------------------------

    def _epochs_per_round(self) -> int:
        max_epochs = self.trainer.max_epochs
        rounds = self.hparams.rounds
        if max_epochs is None or max_epochs < 1 or max_epochs % rounds:
            raise ValueError(f"trainer.max_epochs={max_epochs} must be a positive multiple of model.rounds={rounds} "
                             f"(each round trains the same number of epochs; the reference: 12 × 12 = 144)")
        return max_epochs // rounds

    def round_plane(self) -> torch.Tensor:
        """(2, C) orthonormal rows of the plane this round's head spans, as it will be stacked: made orthogonal
        to the earlier planes first with ``orthogonalize`` (the round's tokens have no component in those)."""
        from alibi_vit.analysis.rasa import orthonormal_plane

        weight = self.head.weight.detach().double()
        if self.hparams.orthogonalize:
            plane = orthogonalize_planes(list(self.planes.double()) + [weight])[-1]
        else:
            plane = orthonormal_plane(weight, self.round)
        return plane.to(self.planes)

    def finish_round(self) -> torch.Tensor:
        """Freeze the head's plane, stack it, start a fresh head with a fresh optimizer state."""
        plane = self.round_plane()
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")} \
            if self._trainer is not None else {}
        self.round_history.append({"round": self.round + 1, **metrics})
        self.planes = torch.cat([self.planes, plane[None]])
        self.head.reset_parameters()
        if self._trainer is not None:
            for optimizer in self.trainer.optimizers:
                optimizer.state.clear()  # AdamW moments belong to the old head
        return plane

    def _catch_up(self, finished_rounds: int) -> None:
        while self.round < min(finished_rounds, self.hparams.rounds):
            self.finish_round()

    def on_train_epoch_start(self) -> None:
        # rounds whose epochs are over (also after resuming from a checkpoint saved before the plane was stacked)
        self._catch_up(self.current_epoch // self._epochs_per_round())

    def on_train_end(self) -> None:
        self._catch_up(self.current_epoch // self._epochs_per_round())
        if self.round == self.hparams.rounds:
            self.export()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["rasa_round_history"] = self.round_history

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        planes = checkpoint["state_dict"].get("planes")
        if planes is not None:  # the buffer's size is the number of finished rounds
            self.planes = torch.zeros_like(planes, device=self.planes.device)
        self.round_history = list(checkpoint.get("rasa_round_history", []))

    # ---- Lightning hooks --------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self._epochs_per_round()  # a bad max_epochs fails before any work
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if self.hparams.feature_cache_dir:
            self.feature_cache = FeatureCache.attach(datamodule, self.hparams.feature_cache_dir,
                                                     self.backbone_tag(self.trainer.strategy.root_device))

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        _, clean, target = self._tokens(batch)
        loss = F.mse_loss(self.predict_position(clean), target)
        self.log("train/mse", loss, prog_bar=True, batch_size=clean.shape[0])
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=clean.shape[0])
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}
        self._val_oc = {}

    def validation_step(self, batch, batch_idx: int) -> None:
        raw, clean, target = self._tokens(batch)
        cleaned = remove_planes(clean, self.round_plane()[None])  # this round's plane removed too
        oc_batch = self.hparams.oc_batches is None or batch_idx < self.hparams.oc_batches
        if self.hparams.oc_k and oc_batch and isinstance(batch, dict) and "label" in batch:
            h, w = self._grid
            sets = {"cleaned": cleaned, "raw": raw, "plane": clean - cleaned} if self.hparams.oc_reference_mean \
                else {"cleaned": cleaned}
            for name, tokens in sets.items():
                self._val_oc.setdefault(name, []).append(tokens.reshape(tokens.shape[0], h, w, -1).half().cpu().numpy())
            self._val_oc.setdefault("masks", []).append(batch["label"].cpu().numpy())
        sums = {
            "sse": (self.predict_position(clean) - target).pow(2).sum(),
            "sse_raw": (self.predict_position(raw) - target).pow(2).sum(),
            "sse_own": (self.predict_position(cleaned) - target).pow(2).sum(),
            "sst": (target - 0.5).pow(2).sum(),  # the grid targets' mean is exactly 0.5
            "cos": F.cosine_similarity(raw, clean, dim=-1).sum(),
            "tokens": torch.tensor(float(raw.shape[0] * raw.shape[1]), device=raw.device),
        }
        for k, v in sums.items():
            self._val_sums[k] = self._val_sums.get(k, 0.0) + v.detach().double()

    def overclustering_scores(self) -> dict[str, float]:
        """The OverClustering metrics of the collected validation features (RASA recipe, k = ``oc_k``)."""
        import numpy as np

        from alibi_vit.analysis.overclustering import overclustering_seeds

        collected = {name: np.concatenate(parts) for name, parts in self._val_oc.items()}
        self._val_oc = {}
        masks = collected.pop("masks")
        if masks.size < self.hparams.oc_k:
            return {}

        def miou(features) -> float:
            return float(overclustering_seeds(features, masks, self.hparams.oc_k, self.hparams.oc_num_classes,
                                              recipe="rasa").miou)

        scores = {"val/oc_miou_cleaned": miou(collected["cleaned"])}
        if "raw" in collected:
            fingerprint = (collected["raw"].shape, float(np.sum(collected["raw"], dtype=np.float64)))
            if self._raw_oc is None or self._raw_oc[0] != fingerprint:  # the same images every round: once
                self._raw_oc = (fingerprint, miou(collected["raw"]))
            scores["val/oc_miou_raw"] = self._raw_oc[1]
            scores["val/oc_miou_plane"] = miou(collected["plane"])
            scores["val/oc_miou_reference_mean"] = float(np.mean([scores[f"val/oc_miou_{name}"]
                                                                  for name in ("raw", "plane", "cleaned")]))
        return scores

    def on_validation_epoch_end(self) -> None:
        if not self._val_sums:
            return
        s = {k: self.trainer.strategy.reduce(v, reduce_op="sum") for k, v in self._val_sums.items()}
        values = s["tokens"] * 2
        metrics = self.overclustering_scores() if self._val_oc else {}
        self.log_dict({**metrics, "val/mse": (s["sse"] / values).float(), "val/mse_raw": (s["sse_raw"] / values).float(),
                       "val/mse_own_removed": (s["sse_own"] / values).float(),
                       "val/head_r2": (1 - s["sse"] / s["sst"].clamp_min(1e-12)).float(),
                       "val/cosine": (s["cos"] / s["tokens"]).float(),
                       "val/round": float(self.round + 1)}, sync_dist=False)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.head.parameters(), lr=self.hparams.lr, weight_decay=0.0)
        steps = self.trainer.estimated_stepping_batches
        per_round = max(1, int(steps) // self.hparams.rounds) if math.isfinite(steps) else None
        if per_round is None:
            return optimizer
        t_max = self.hparams.cosine_t_max or per_round

        def cosine(step: int) -> float:  # each round from lr to 0 at t_max; beyond it the cosine climbs back
            return 0.5 * (1.0 + math.cos(math.pi * (step % per_round) / t_max))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- export -----------------------------------------------------------------------------

    def selected_round(self) -> tuple[int, str]:
        """(rounds to fold in, why): the round of highest ``val/oc_miou_cleaned`` (the earliest of ties) with
        ``select_round="best"`` when every finished round was validated at its end, else all finished rounds."""
        key = "val/oc_miou_cleaned"
        history = self.round_history[:self.round]
        scored = all(key in h and h.get("val/round", h["round"]) == h["round"] for h in history)  # none stale
        if self.hparams.select_round == "best" and history and scored:
            best = max(history, key=lambda h: (h[key], -h["round"]))
            return best["round"], f"highest {key}"
        if self.hparams.select_round == "best":
            return self.round, f"last round (not every round has its own {key}: no labelled validation at its end)"
        return self.round, "last round (select_round=last)"

    def folded_backbone(self, rounds: int | None = None) -> nn.Module:
        """A copy of the backbone with the first ``rounds`` finished planes (default: all) folded in
        (:func:`alibi_vit.analysis.rasa.fold_planes`)."""
        planes = self.planes if rounds is None else self.planes[:rounds]
        return fold_planes(self.backbone, list(planes), inplace=False)

    def export_dir(self) -> Path:
        if self.hparams.export_dir:
            return Path(self.hparams.export_dir)
        root = self.trainer.default_root_dir if self._trainer is not None else "."
        return Path(root) / "rasa"

    @rank_zero_only
    def export(self) -> Path:
        """Write the selected round's folded backbone (.safetensors), every plane (.pt) and the per-round metrics
        with the selection (.json)."""
        from alibi_vit.models.checkpoint import save_safetensors

        out = self.export_dir()
        out.mkdir(parents=True, exist_ok=True)
        rounds, why = self.selected_round()
        folded = self.folded_backbone(rounds)
        state = {k: v.detach().cpu().contiguous() for k, v in folded.state_dict().items()}
        metadata = {"format": "pt", "model": str(self.hparams.backbone),
                    "model_kwargs": json.dumps({k: v for k, v in (self.hparams.backbone_kwargs or {}).items()
                                                if k != "pretrained_cfg_overlay"}, default=str),
                    "rasa_rounds": str(rounds)}
        save_safetensors(state, out / "rasa_backbone.safetensors", metadata=metadata)
        torch.save(self.planes.detach().cpu().float().clone(), out / "rasa_planes.pt")
        summary = {"selected_round": rounds, "selected_by": why, "rounds": self.round_history}
        (out / "rasa_rounds.json").write_text(json.dumps(summary, indent=2) + "\n")
        return out
