"""``alibi-vit export``: the student of a distillation checkpoint as a plain timm state_dict.

The work is :func:`lit_modules.export.export_student`: the weights are checked against the
student rebuilt from the checkpoint's hyperparameters before anything is written, and a
``.safetensors`` file records the architecture so ``--checkpoint`` elsewhere needs no ``--model-arg``.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="Lightning .ckpt of a distillation run")
    parser.add_argument("--out", required=True, help="output file: .safetensors (recommended), .pth or .pt")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip loading the weights into the rebuilt student before writing")


def run(args) -> int:
    from pathlib import Path

    from lit_modules.export import FORMATS  # a light module; export_student's imports are the slow ones

    from ..files import require_file, require_writable_folder

    # Checked before the (slow) import of the training code: a wrong path is said at once.
    require_file(args.checkpoint)
    if Path(args.out).suffix not in FORMATS:
        raise ValueError(f"--out {args.out} must end in one of {', '.join(FORMATS)}")
    require_writable_folder(Path(args.out).parent)

    from lit_modules.export import export_student

    out = export_student(args.checkpoint, args.out, verify=args.verify)
    print(f"wrote student weights to {out}")
    return 0
