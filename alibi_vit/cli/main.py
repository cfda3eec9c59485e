"""The ``alibi-vit`` command: one entry point, one subcommand per tool.

Each subcommand lives in its own module of this package, named after it, that exposes
``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when chosen, so
``alibi-vit probe`` never pays for Lightning or the segmentation code, and ``alibi-vit --help``
imports none of them.

Errors in what the user gave (a ``ValueError``, a missing or unreadable file) are printed as
``alibi-vit COMMAND: error: ...`` with exit status 2, warnings as ``alibi-vit COMMAND: warning: ...``;
only unexpected failures (bugs) show a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys
import warnings

# Subcommand → its help line; the code is the module alibi_vit.cli.<subcommand>.
SUBCOMMANDS = {
    "probe": "positional-bias linear probe: R² of position from patch features",
    "show": "feature maps (PCA, k-means, similarity) side by side for several models",
    "robustness": "segmentation probe under flip, roll and rot90 (paper Tab. S3)",
    "export": "export a distilled student from a Lightning checkpoint as a timm state_dict",
    "channels": "a teacher's most positional channels, ranked by per-channel positional R²",
    "overcluster": "OverClustering mIoU of frozen backbones on Pascal VOC, with positional R² and probe mIoU side by side",
    "segment": "trainable segmentation of micrographs: train, apply, benchmark",
    "app": "interactive trainable segmentation in the browser: scribble, train, see, export",
    "heads": "attention-head diagnostics: sink, self and local heads, reach and prefix mass per layer and head",
}

# Longer messages are cut (the useful part of an error comes first): lines, and characters per line.
_MAX_LINES = 12
_MAX_LINE = 400


DESCRIPTION = ("alibi-vit: Vision Transformers without positional bias. One subcommand per tool; "
               "'alibi-vit COMMAND --help' describes each.")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("alibi-vit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alibi-vit", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"alibi-vit {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text)
    return parser


def format_error(err: BaseException) -> str:
    """The message of ``err`` for a terminal: its text (or its type if empty), at most ``_MAX_LINES`` lines
    of at most ``_MAX_LINE`` characters (a library's list of every missing key can run to 10 KB)."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        text = f"{err.filename}: {err.strerror}"  # e.g. PermissionError on --out, without errno noise
    else:
        text = str(err).strip() or type(err).__name__
        if isinstance(err, KeyError):  # str(KeyError) is the quoted key
            text = f"{type(err).__name__}: {text}"
    lines = [line if len(line) <= _MAX_LINE else line[:_MAX_LINE] + f"… ({len(line) - _MAX_LINE} more characters)"
             for line in text.splitlines()]
    if len(lines) > _MAX_LINES:
        lines = lines[:_MAX_LINES] + [f"… ({len(lines) - _MAX_LINES} more lines)"]
    return "\n".join(lines)


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``alibi-vit COMMAND: error: ...``, without the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def subcommand_parser(command: str):
    """The module of subcommand ``command`` and its argument parser (also what the docs' option pages show)."""
    module = importlib.import_module(f"{__package__}.{command}")
    parser = OneLineErrorParser(prog=f"alibi-vit {command}", description=SUBCOMMANDS[command])
    module.add_arguments(parser)
    return module, parser


# What argparse itself reads as a negative number (a value); any other word starting with "-" is an option to it.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_DASH_VALUE = re.compile(r"^-[\d.]")


def _attach_dash_values(argv: list) -> list:
    """``--option -1/2`` as ``--option=-1/2``: argparse takes a value that starts with "-" for an option (unless it
    is a plain negative number) and answers "expected one argument"; so the option's own check can say what is
    wrong with it (``--shard -1/2``: the share must be in 0..1)."""
    out = []
    for word in argv:
        previous = out[-1] if out else ""
        if (_DASH_VALUE.match(word) and not _NEGATIVE_NUMBER.match(word) and previous.startswith("--")
                and "=" not in previous and previous != "--"):
            out[-1] = f"{previous}={word}"
        else:
            out.append(word)
    return out


# tifffile names the object it complains about first: "<tifffile.TiffFile 'a.tif'> ImageJ series metadata invalid".
_TIFFFILE_OBJECT = re.compile(r"^<tifffile\.\w+(?: '([^']*)')?[^>]*>\s*")


class _TifffileWarnings(logging.Handler):
    """tifffile's log records (metadata it could not parse; the pixels are read regardless, and a file that
    cannot be read is an error of its own) as the command's one-line warnings naming the file, each once,
    instead of bare lines on stderr."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = set()

    def emit(self, record):
        text = record.getMessage().splitlines()[0] if record.getMessage() else ""
        text = _TIFFFILE_OBJECT.sub(lambda m: f"{m.group(1)}: " if m.group(1) else "", text)
        if text not in self.seen:
            self.seen.add(text)
            warnings.warn(f"{text} (tifffile)", stacklevel=2)


def main(argv=None) -> int:
    """Run ``alibi-vit`` with ``argv`` (None: this process's own arguments, as the console script and
    ``python -m alibi_vit.cli`` run it)."""
    from ..runtime import prefer_passive_threads_when_busy

    prefer_passive_threads_when_busy()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    # Parse the subcommand first, then let its module add its own options.
    known, _ = parser.parse_known_args(argv[:1] if argv else argv)
    prog = f"alibi-vit {known.command}"
    module, sub = subcommand_parser(known.command)
    args = sub.parse_args(_attach_dash_values(argv[1:]))

    def show_warning(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {message}", file=sys.stderr if file is None else file)

    tifffile_log = logging.getLogger("tifffile")
    routed, propagates = _TifffileWarnings(), tifffile_log.propagate
    with warnings.catch_warnings():
        warnings.showwarning = show_warning  # one line per warning, not the source line that raised it
        tifffile_log.addHandler(routed)
        tifffile_log.propagate = False  # else Python's last-resort handler prints the raw record too
        try:
            return int(module.run(args) or 0)
        except (OSError, ValueError) as err:  # bad input (FileNotFoundError is an OSError): a message
            print(f"{prog}: error: {format_error(err)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
        finally:
            tifffile_log.removeHandler(routed)
            tifffile_log.propagate = propagates


if __name__ == "__main__":
    sys.exit(main())
