"""RASA post-training of a frozen encoder, every round in one ``lightning fit`` (docs/method.md §8).

Round t trains a fresh position head (a bias-free 2×C linear layer and a sigmoid) on the frozen
backbone's final-normed patch tokens with the planes of rounds 1..t−1 removed, against each
patch's (row, col) normalised to [0, 1] (MSE; AdamW on the head only, no weight decay, the
learning rate cosine-decayed to 0 within each round). When the round's epochs are over, the
plane its two weight rows span is frozen and stacked, the head is re-initialised and the
optimizer state cleared. The number of rounds is ``rounds``; each round gets
``trainer.max_epochs / rounds`` epochs (the reference: 12 rounds × 12 epochs, batch 32, 518 px).

Logged every validation epoch: ``val/mse`` (the round's head on the cleaned tokens),
``val/mse_raw`` (the same head on the tokens with no plane removed), ``val/mse_own_removed``
(the same head on the cleaned tokens with its own plane removed too: what the next round starts
from; near the targets' variance when the plane held what the head used), ``val/head_r2`` (1 − MSE /
variance of the targets, cleaned tokens), ``val/cosine`` (mean cosine similarity between
original and cleaned tokens) and ``val/round``; with labelled validation batches (a segmentation
datamodule such as :class:`datamodules.rasa.RASADataModule`'s VOC val) also ``val/oc_miou``: the
OverClustering mIoU (:func:`alibi_vit.analysis.overclustering.overclustering_seeds`, k =
``oc_k``, one seed, masks at 100×100) of the cleaned features of those batches, by which the
reference picks its best round (``configs/rasa.yaml`` validates 4 batches at the end of each
round). ``train/mse`` and ``train/lr`` every step.

When fitting ends with every round done, the folded backbone (:func:`alibi_vit.analysis.rasa.fold_planes`: the timm state_dict
plus the one matrix ``rasa_projection``) is written to ``EXPORT/rasa_backbone.safetensors``
(its metadata records the model name and kwargs, as ``alibi-vit export`` does), the planes to
``EXPORT/rasa_planes.pt`` ((T, 2, C) float32, orthonormal rows) and the last validation
metrics of every round to ``EXPORT/rasa_rounds.json``; ``EXPORT`` is ``export_dir`` or
``<run dir>/rasa``. ``alibi_vit.create_backbone(name, checkpoint=EXPORT/rasa_backbone.safetensors)``
rebuilds it.

Data: :class:`datamodules.rasa.RASADataModule` (the reference's VOC train images and augmentations;
``configs/rasa.yaml``), any of the image datamodules (batches of images), or a segmentation
datamodule (its labels serve only ``val/oc_miou``). With ``feature_cache_dir`` and a segmentation datamodule (e.g.
``COCOStuffSegmentation`` for COCO images, ``VOCSegmentation``) the backbone runs once per image
and later epochs read float16 features from disk, exactly as the segmentation probe caches them
(same files, same keys: a probe's cache of the same backbone is reused).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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
    """

    def __init__(self, backbone: str = "vit_small_patch14_reg4_dinov2", backbone_checkpoint: str | None = None,
                 pretrained: bool | None = None, backbone_kwargs: dict | None = None,
                 allow_random_init: bool = False, rounds: int = 12, lr: float = 2e-4, orthogonalize: bool = True,
                 feature_cache_dir: str | None = None, export_dir: str | None = None, oc_k: int = 21,
                 oc_num_classes: int = 21):
        super().__init__()
        self.save_hyperparameters()
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {rounds}")
        if oc_k and oc_k < oc_num_classes:
            raise ValueError(f"oc_k={oc_k} is fewer than the {oc_num_classes} classes (0 turns the score off)")
        self.backbone = frozen_backbone(backbone, backbone_checkpoint, pretrained, allow_random_init, backbone_kwargs)
        dim = self.backbone.num_features
        self.head = nn.Linear(dim, 2, bias=False)
        # finished rounds' planes, orthonormal rows; grows by one (2, C) per round (see on_load_checkpoint)
        self.register_buffer("planes", torch.zeros(0, 2, dim))
        self.round_history: list[dict] = []
        self.feature_cache = None
        self._val_sums: dict[str, torch.Tensor] = {}
        self._val_oc: list[tuple] = []

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

    def finish_round(self) -> torch.Tensor:
        """Freeze the head's plane, stack it, start a fresh head with a fresh optimizer state."""
        plane = self.head.weight.detach().clone()
        if self.hparams.orthogonalize:
            plane = orthogonalize_planes(list(self.planes.double()) + [plane.double()])[-1]
        else:
            from alibi_vit.analysis.rasa import orthonormal_plane

            plane = orthonormal_plane(plane, self.round)
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")} \
            if self._trainer is not None else {}
        self.round_history.append({"round": self.round + 1, **metrics})
        self.planes = torch.cat([self.planes, plane.to(self.planes)[None]])
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
        self._val_oc = []

    def own_plane(self) -> torch.Tensor:
        """(1, 2, C) orthonormal basis of the plane the current head's two rows span."""
        from alibi_vit.analysis.rasa import orthonormal_plane

        return orthonormal_plane(self.head.weight.detach().double(), self.round).to(self.head.weight)[None]

    def validation_step(self, batch, batch_idx: int) -> None:
        raw, clean, target = self._tokens(batch)
        own_removed = remove_planes(clean, self.own_plane())
        if self.hparams.oc_k and isinstance(batch, dict) and "label" in batch:
            from alibi_vit.analysis.overclustering import resize_labels_nearest

            h, w = self._grid
            self._val_oc.append((clean.reshape(clean.shape[0], h, w, -1).half().cpu().numpy(),
                                 resize_labels_nearest(batch["label"].cpu().numpy(), 100)))
        sums = {
            "sse": (self.predict_position(clean) - target).pow(2).sum(),
            "sse_raw": (self.predict_position(raw) - target).pow(2).sum(),
            "sse_own": (self.predict_position(own_removed) - target).pow(2).sum(),
            "sst": (target - 0.5).pow(2).sum(),  # the grid targets' mean is exactly 0.5
            "cos": F.cosine_similarity(raw, clean, dim=-1).sum(),
            "tokens": torch.tensor(float(raw.shape[0] * raw.shape[1]), device=raw.device),
        }
        for k, v in sums.items():
            self._val_sums[k] = self._val_sums.get(k, 0.0) + v.detach().double()

    def on_validation_epoch_end(self) -> None:
        if not self._val_sums:
            return
        s = {k: self.trainer.strategy.reduce(v, reduce_op="sum") for k, v in self._val_sums.items()}
        values = s["tokens"] * 2
        metrics = {}
        if self._val_oc:
            import numpy as np

            from alibi_vit.analysis.overclustering import overclustering_seeds

            features = np.concatenate([f for f, _ in self._val_oc])
            masks = np.concatenate([m for _, m in self._val_oc])
            if features.shape[0] * features.shape[1] * features.shape[2] >= self.hparams.oc_k:
                result = overclustering_seeds(features, masks, self.hparams.oc_k, self.hparams.oc_num_classes,
                                              seeds=(0,))
                metrics["val/oc_miou"] = float(result.miou)
            self._val_oc = []
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

        def cosine(step: int) -> float:  # each round: from lr down to 0
            return 0.5 * (1.0 + math.cos(math.pi * min(step % per_round, per_round) / per_round))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---- export -----------------------------------------------------------------------------

    def folded_backbone(self) -> nn.Module:
        """A copy of the backbone with every finished plane folded in (:func:`alibi_vit.analysis.rasa.fold_planes`)."""
        return fold_planes(self.backbone, list(self.planes), inplace=False)

    def export_dir(self) -> Path:
        if self.hparams.export_dir:
            return Path(self.hparams.export_dir)
        root = self.trainer.default_root_dir if self._trainer is not None else "."
        return Path(root) / "rasa"

    @rank_zero_only
    def export(self) -> Path:
        """Write the folded backbone (.safetensors), the planes (.pt) and the per-round metrics (.json)."""
        from alibi_vit.models.checkpoint import save_safetensors

        out = self.export_dir()
        out.mkdir(parents=True, exist_ok=True)
        folded = self.folded_backbone()
        state = {k: v.detach().cpu().contiguous() for k, v in folded.state_dict().items()}
        metadata = {"format": "pt", "model": str(self.hparams.backbone),
                    "model_kwargs": json.dumps({k: v for k, v in (self.hparams.backbone_kwargs or {}).items()
                                                if k != "pretrained_cfg_overlay"}, default=str),
                    "rasa_rounds": str(self.round)}
        save_safetensors(state, out / "rasa_backbone.safetensors", metadata=metadata)
        torch.save(self.planes.detach().cpu().float().clone(), out / "rasa_planes.pt")
        (out / "rasa_rounds.json").write_text(json.dumps(self.round_history, indent=2) + "\n")
        return out
