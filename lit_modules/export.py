"""The student of a distillation checkpoint as a plain timm state_dict (the command ``alibi-vit export``).

The result is the release format: ``timm.create_model("alibi_vit_small_patch14_reg4_dinov2",
checkpoint_path=...)`` loads it (after ``import alibi_vit``), strictly. Before writing, the
weights are loaded strictly into the student architecture rebuilt from the checkpoint's
hyperparameters, so an export that would not load is never written.

A ``.safetensors`` export records the architecture in its metadata (``model``, ``model_kwargs``,
``student_kwargs``); ``alibi_vit.create_backbone`` and ``alibi-vit probe``/``show`` read it, so
a non-default architecture (the demo's 2 blocks, say) loads without ``--model-arg``. ``.pth``/``.pt``
files hold only the tensors.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

__all__ = ["FORMATS", "export_student"]

FORMATS = (".safetensors", ".pth", ".pt")


def _read_checkpoint(path: Path) -> dict:
    from alibi_vit.files import require_file
    from alibi_vit.models.checkpoint import read_torch_file

    require_file(path)

    ckpt = read_torch_file(path, what="Lightning checkpoint")
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a Lightning checkpoint (no 'state_dict')")
    return ckpt


def export_student(checkpoint, out, *, verify: bool = True) -> Path:
    """Write the student weights of a ``DistillationModule`` checkpoint to ``out`` (.safetensors, .pth or .pt).

    With ``verify`` the student is rebuilt from the checkpoint's hyperparameters (no teacher,
    no download) and the weights are loaded into it strictly first; a mismatch lists the keys.
    Returns the written path.
    """
    from alibi_vit import load_weights

    from .distillation import build_student, student_state_dict

    checkpoint, out = Path(checkpoint), Path(out)
    if out.suffix not in FORMATS:
        raise ValueError(f"output {out} must end in one of {', '.join(FORMATS)}")
    ckpt = _read_checkpoint(checkpoint)
    state = {k: v.detach().clone().contiguous() for k, v in student_state_dict(ckpt["state_dict"]).items()}
    hparams = dict(ckpt.get("hyper_parameters") or {})
    name = hparams.get("student")
    if verify:
        if not name:
            raise ValueError(f"{checkpoint} records no student name in its hyperparameters; pass verify=False "
                             "to export without the check")
        model = build_student(name, hparams.get("model_kwargs"), hparams.get("student_kwargs"))
        load_weights(model, state, source=f"student weights of {checkpoint}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        from alibi_vit.models.checkpoint import save_safetensors

        metadata = {"format": "pt", "model": str(name), "source": checkpoint.name,
                    "global_step": str(ckpt.get("global_step", "")),
                    "model_kwargs": json.dumps(hparams.get("model_kwargs") or {}),
                    "student_kwargs": json.dumps(hparams.get("student_kwargs") or {})}
        save_safetensors(state, out, metadata=metadata)
    else:
        import torch

        torch.save(state, out)
        kwargs = {**(hparams.get("model_kwargs") or {}), **(hparams.get("student_kwargs") or {})}
        if kwargs:
            given = " ".join(f"--model-arg {k}={v}" for k, v in kwargs.items())
            warnings.warn(f"{out.suffix} files do not record the architecture: load {out.name} with {given} "
                          "(a .safetensors export records it)", stacklevel=2)
    return out
