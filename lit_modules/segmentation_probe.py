"""Segmentation linear probe on a frozen backbone (docs/method.md §6, paper Tab. 3).

The backbone (DINOv2, ALiBi-Dv2, NoPE or any timm ViT, built by ``alibi_vit.create_backbone``)
stays frozen in eval mode; its final-normed patch features go through BatchNorm2d + a 1×1
convolution, the logits are bilinearly upsampled to the label size, and cross-entropy ignores
label 255. Only the head is optimised (AdamW, lr 1e-3, weight decay 0.01).

mIoU is accumulated over the whole validation set (one confusion matrix, torchmetrics) and
never averaged over batches; classes that occur in neither predictions nor labels of the set
do not count. Per-class IoU is logged at the end of every validation epoch.

Feature cache: with ``feature_cache_dir`` the backbone runs once per image; its features are
stored as float16 files keyed by (backbone identity = name + options + a hash of the weights,
autocast precision, dataset, size, resize mode, image id). Later epochs read them in the loader
workers and skip image decoding and the backbone. Cached features are of the unaugmented
image, so the cache is refused when the datamodule augments. While caching, first-epoch
features are rounded to float16 too, so every epoch trains on exactly the same values.
Files for one ViT-S image at 518 px take ~1 MB (37·37·384 half floats); the cache dir should
be on local disk with room for (train + val images) × that.

Pretrained weights (DINOv2's, for ``vit_*_dinov2`` and for ``alibi_vit_*``/``nope_vit_*`` without a
checkpoint) come from the Hugging Face hub through timm. They are looked up in the local hub
cache first and then loaded from there without any network access; when they are not cached
and the hub cannot be reached (or ``HF_HUB_OFFLINE`` is set), construction fails at once with
a message naming ``--model.backbone_checkpoint`` and ``--model.allow_random_init`` instead of
retrying the download for a minute.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics.classification import MulticlassConfusionMatrix

from alibi_vit import create_backbone, patch_features
from alibi_vit.models.checkpoint import WeightsUnavailableError
from alibi_vit.models.names import MODEL_NAMES

__all__ = ["IGNORE_INDEX", "FeatureCache", "SegmentationProbeModule", "backbone_autocast", "confusion_matrix",
           "frozen_backbone", "iou_from_confusion"]

IGNORE_INDEX = 255
CACHE_DTYPE = torch.float16  # halves the disk; range is ample for layer-normed features (checked on save)


class FeatureCache:
    """Backbone features on disk: ``<root>/<backbone tag>/<key>.pt``, one (C, h, w) tensor per file.

    ``key`` comes from the dataset (``<dataset>-<H>x<W>-<resize mode>/<image id>``); files are
    written atomically (temp file + rename) so a crash or a second process never leaves a
    half-written file behind.
    """

    def __init__(self, root, backbone_tag: str):
        self.root = Path(root).expanduser()
        self.dir = self.root / backbone_tag

    @classmethod
    def attach(cls, datamodule, root, backbone_tag: str) -> "FeatureCache":
        """A cache under ``root`` handed to a segmentation datamodule, which then reads features from it."""
        if not hasattr(datamodule, "attach_feature_cache"):
            raise ValueError("feature_cache_dir needs a segmentation datamodule (datamodules.segmentation.*, "
                             "e.g. COCOStuffSegmentation for COCO images): the image datamodules have no cache")
        cache = cls(root, backbone_tag)
        datamodule.attach_feature_cache(cache)
        return cache

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.pt"

    def load(self, key: str) -> torch.Tensor | None:
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(f"cached features {path} cannot be read ({type(err).__name__}: {err}); "
                             "delete the file to recompute it") from err

    def save(self, key: str, features: torch.Tensor) -> None:
        if not torch.isfinite(features).all():
            raise ValueError(f"features for {key} are not finite in {features.dtype}; cannot cache them")
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save(features.detach().cpu().clone(), tmp)  # clone: a view would save the whole batch storage
        os.replace(tmp, path)


def confusion_matrix(num_classes: int) -> MulticlassConfusionMatrix:
    """Pixel confusion matrix (rows = label, columns = prediction) that skips label 255."""
    return MulticlassConfusionMatrix(num_classes, ignore_index=IGNORE_INDEX)


def iou_from_confusion(confmat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mIoU, per-class IoU) of a whole-set confusion matrix.

    A class in neither labels nor predictions has no IoU: NaN, and left out of the mean. Done
    here rather than by torchmetrics' JaccardIndex, whose macro average counted such classes as
    0 in some releases the project's requirements allow.
    """
    confmat = confmat.detach().cpu().double()  # float64: pixel counts of a whole val set exceed float32's 2^24
    tp = confmat.diag()
    union = confmat.sum(0) + confmat.sum(1) - tp
    iou = torch.where(union > 0, tp / union.clamp_min(1), torch.full_like(tp, float("nan")))
    present = union > 0
    miou = iou[present].mean() if present.any() else torch.tensor(float("nan"), dtype=torch.float64)
    return miou.float(), iou.float()


def frozen_backbone(backbone: str, backbone_checkpoint: str | None, pretrained: bool | None,
                    allow_random_init: bool, backbone_kwargs: dict | None):
    """The frozen feature backbone of a probe (and of RASA): weights from a checkpoint, the hub or, only
    when asked for, random; errors name the config options that fix them."""
    if pretrained is None:
        pretrained = backbone_checkpoint is None and not allow_random_init
    if not pretrained and backbone_checkpoint is None and not allow_random_init:
        raise ValueError(f"backbone {backbone} would have random weights: pass --model.backbone_checkpoint=PATH "
                         "or --model.pretrained=true (or --model.allow_random_init=true for smoke tests)")
    try:
        model = create_backbone(backbone, pretrained=pretrained, checkpoint=backbone_checkpoint,
                                **(backbone_kwargs or {}))
    except WeightsUnavailableError as err:
        raise ValueError(f"backbone {backbone}: no pretrained weights here: {err.reason}. Pass "
                         "--model.backbone_checkpoint=PATH (a timm state_dict file of the backbone, e.g. a released "
                         "ALiBi-Dv2 model or DINOv2's model.safetensors), or --model.allow_random_init=true to run "
                         "with random weights (pipeline checks only)") from None
    return model.requires_grad_(False).eval()


def backbone_autocast(device: torch.device):
    """bf16 autocast for the backbone where the device does bf16 natively (CUDA ≥ Ampere); else fp32."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class SegmentationProbeModule(L.LightningModule):
    """Linear segmentation probe: frozen backbone → BatchNorm2d → 1×1 conv → bilinear upsampling.

    Args:
        backbone: timm name: ``alibi_vit_*``/``nope_vit_*`` of this project or any timm ViT
            (``vit_small_patch14_reg4_dinov2`` for DINOv2).
        num_classes: classes of the dataset (21 VOC, 150 ADE20K, 171 COCO-Stuff); must match the datamodule.
        backbone_checkpoint: plain timm state_dict of the backbone (e.g. a released ALiBi-Dv2 model),
            loaded strictly.
        pretrained: load timm's pretrained weights; default: yes unless ``backbone_checkpoint`` is given
            or ``allow_random_init`` is set.
        backbone_kwargs: extra model options (e.g. ``depth``/``embed_dim`` for tiny test models).
        lr, weight_decay: AdamW on the head.
        feature_cache_dir: cache backbone features on disk (only without training augmentation).
        class_names: names for the per-class IoU logs; default: the datamodule's.
        allow_random_init: default ``False``. ``True`` permits a backbone with neither pretrained
            weights nor a checkpoint: its weights are random (smoke tests, the offline demo
            ``configs/probe_demo.yaml``); with ``pretrained`` left unset it also means "do not
            fetch pretrained weights". Otherwise random weights are an error, since a probe of
            random features is almost always a forgotten flag.

    Pretrained weights are read from the local Hugging Face cache when they are there; when they
    are not and the hub cannot be reached, construction fails within seconds with a message
    naming ``--model.backbone_checkpoint`` and ``--model.allow_random_init`` (see
    :func:`frozen_backbone` and ``alibi_vit.models.checkpoint.local_pretrained_overlay``).
    """

    def __init__(self, backbone: str = "alibi_vit_small_patch14_reg4_dinov2", num_classes: int = 21,
                 backbone_checkpoint: str | None = None, pretrained: bool | None = None,
                 backbone_kwargs: dict | None = None,
                 lr: float = 1e-3, weight_decay: float = 0.01, feature_cache_dir: str | None = None,
                 class_names: list[str] | None = None, allow_random_init: bool = False):
        super().__init__()
        self.save_hyperparameters()
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"{len(class_names)} class names for {num_classes} classes")
        self.backbone = frozen_backbone(backbone, backbone_checkpoint, pretrained, allow_random_init, backbone_kwargs)
        from_hub = pretrained if pretrained is not None else backbone_checkpoint is None and not allow_random_init
        if backbone in MODEL_NAMES and backbone_checkpoint is None and from_hub:
            rank_zero_warn(f"{backbone} without a checkpoint starts from DINOv2/DINOv3 weights converted without "
                           "distillation; pass model.backbone_checkpoint=<distilled state_dict>, or a released tag "
                           "such as alibi_vit_small_patch14_reg4_dinov2.dinosaw_coco, to probe ALiBi/NoPE models")
        dim = self.backbone.num_features
        self.head = nn.Sequential(nn.BatchNorm2d(dim), nn.Conv2d(dim, num_classes, kernel_size=1))
        self.num_classes = num_classes
        self.class_names = list(class_names) if class_names else None
        self.feature_cache: FeatureCache | None = None

        # One confusion matrix per stage, accumulated over the whole set (never a mean of batch
        # scores), gives the mean and the per-class IoU.
        self.val_metrics = confusion_matrix(num_classes)
        self.test_metrics = confusion_matrix(num_classes)

    @classmethod
    def load_probe(cls, path, map_location="cpu") -> SegmentationProbeModule:
        """A trained probe from a Lightning checkpoint, backbone included, loaded strictly.

        Checkpoints hold the backbone's weights, so nothing is downloaded and the original
        backbone checkpoint file need not exist any more.
        """
        return cls.load_from_checkpoint(path, map_location=map_location, strict=True, pretrained=False,
                                        backbone_checkpoint=None, allow_random_init=True)

    # ---- frozen backbone --------------------------------------------------------------------

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: no dropout/drop-path whatever the trainer's mode
        return self

    def backbone_tag(self, device: torch.device | None = None) -> str:
        """Backbone identity for the feature cache: name, options, weights hash, autocast precision."""
        digest = hashlib.sha1(json.dumps([self.hparams.backbone, self.hparams.backbone_kwargs or {}],
                                         sort_keys=True, default=str).encode())
        for key, value in sorted(self.backbone.state_dict().items()):
            digest.update(key.encode())
            # reshape: 0-dim tensors cannot be viewed as bytes
            digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        device = device or self.device
        precision = "bf16" if isinstance(backbone_autocast(device), torch.autocast) else "fp32"
        return f"{self.hparams.backbone}-{digest.hexdigest()[:16]}-{precision}"

    def backbone_features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) normalised images → (B, C, h, w) float32 patch features, no gradients."""
        with torch.no_grad(), backbone_autocast(images.device):
            return patch_features(self.backbone, images).float()

    def head_logits(self, features: torch.Tensor, size) -> torch.Tensor:
        """Head on (B, C, h, w) features, logits bilinearly upsampled to ``size`` (H, W)."""
        logits = self.head(features)
        return F.interpolate(logits, size=tuple(size), mode="bilinear", align_corners=False)

    def batch_features(self, batch: dict) -> torch.Tensor:
        """Features of a batch: computed from ``image`` entries, taken from cached ``features`` entries.

        Freshly computed features are written to the cache (when one is attached) and rounded
        to its dtype so that cached and uncached epochs see identical inputs.
        """
        size = batch["label"].shape[0]
        parts = []
        if "image" in batch:
            index = batch.get("image_index", torch.arange(batch["image"].shape[0]))
            features = self.backbone_features(batch["image"])
            if self.feature_cache is not None:
                features = features.to(CACHE_DTYPE)
                on_cpu = features.cpu()  # one device→host copy per batch, not one per image
                for i, f in zip(index.tolist(), on_cpu):
                    self.feature_cache.save(batch["cache_key"][i], f)
                features = features.float()
            parts.append((index, features))
        if "features" in batch:
            parts.append((batch["features_index"], batch["features"].float()))
        if not parts:
            raise ValueError("a probe batch needs 'image' or cached 'features'")
        if len(parts) == 1 and parts[0][1].shape[0] == size:
            index, features = parts[0]
            return features[torch.argsort(index.to(features.device))]
        out = parts[0][1].new_empty((size, *parts[0][1].shape[1:]))
        for index, features in parts:
            out[index.to(out.device)] = features
        return out

    def forward(self, batch: dict) -> torch.Tensor:
        """Logits (B, classes, H, W) at the label size of ``batch``."""
        return self.head_logits(self.batch_features(batch), batch["label"].shape[-2:])

    # ---- Lightning hooks --------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        dm_classes = getattr(datamodule, "num_classes", None)
        if dm_classes is not None and dm_classes != self.num_classes:
            raise ValueError(f"model.num_classes={self.num_classes} but the datamodule "
                             f"{type(datamodule).__name__} has {dm_classes} classes")
        if self.class_names is None:
            names = getattr(datamodule, "class_names", None)
            self.class_names = list(names) if names else [f"class_{i}" for i in range(self.num_classes)]
        if self.hparams.feature_cache_dir:
            self.feature_cache = FeatureCache.attach(datamodule, self.hparams.feature_cache_dir,
                                                     self.backbone_tag(self.trainer.strategy.root_device))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        label = batch["label"]
        if (label != IGNORE_INDEX).any():
            loss = F.cross_entropy(logits, label, ignore_index=IGNORE_INDEX)
        else:  # an all-ignore batch would give NaN; contribute nothing instead
            loss = logits.sum() * 0.0
        self.log("train/loss", loss, prog_bar=True, batch_size=label.shape[0])
        return loss

    def _eval_step(self, batch: dict, metrics: MulticlassConfusionMatrix, stage: str) -> None:
        logits = self(batch)
        label = batch["label"]
        if (label != IGNORE_INDEX).any():
            loss = F.cross_entropy(logits, label, ignore_index=IGNORE_INDEX)
            self.log(f"{stage}/loss", loss, batch_size=label.shape[0], sync_dist=True)
        metrics.update(logits.argmax(1), label)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics, "test")

    def _log_epoch(self, metrics: MulticlassConfusionMatrix, stage: str) -> None:
        miou, per_class = iou_from_confusion(metrics.compute())
        self.log(f"{stage}/mIoU", miou, prog_bar=True)
        names = self.class_names or [f"class_{i}" for i in range(self.num_classes)]
        self.log_dict({f"{stage}/IoU/{i:03d}_{names[i]}": per_class[i] for i in range(self.num_classes)})

    # Reset when an epoch starts, not when it ends: a reset inside `trainer.validate`'s inference
    # mode would leave inference tensors that a later `fit` cannot update in place.
    def on_validation_epoch_start(self) -> None:
        self.val_metrics.reset()

    def on_test_epoch_start(self) -> None:
        self.test_metrics.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_epoch(self.val_metrics, "val")

    def on_test_epoch_end(self) -> None:
        self._log_epoch(self.test_metrics, "test")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.head.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
