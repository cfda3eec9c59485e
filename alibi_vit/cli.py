"""The ``alibi-vit`` command: one entry point, one subcommand per tool.

Each subcommand lives in its own module that exposes ``add_arguments(parser)`` and
``run(args) -> int``; they are imported only when chosen, so ``alibi-vit probe`` never pays for
Lightning or the segmentation code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "probe": ("alibi_vit.probe_cli", "positional-bias linear probe: R² of position from patch features"),
    "show": ("alibi_vit.feature_maps", "feature maps (PCA, k-means, similarity) side by side for several models"),
    "robustness": ("lit_modules.robustness", "segmentation probe under flip, roll and rot90 (paper Tab. S3)"),
    "export": ("lit_modules.export", "export a distilled student from a Lightning checkpoint as a timm state_dict"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alibi-vit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # Parse the subcommand first, then let its module add its own options.
    known, _ = parser.parse_known_args(argv[:1] if argv else argv)
    module = importlib.import_module(known._module)
    sub = argparse.ArgumentParser(prog=f"alibi-vit {known.command}", description=SUBCOMMANDS[known.command][1])
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except (FileNotFoundError, ValueError) as err:  # bad input: a message, not a traceback
        print(f"alibi-vit {known.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
