"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

Two things the pages hold are made from the repository when the site is built, so that neither can drift
from it:

- figures: pages link them where they live, ``../benchmarks/results/NAME.png`` (a link that works in an
  editor and on a code host too); the site serves those files as ``results/NAME.png``, and a link to a
  figure that does not exist fails ``mkdocs build --strict``;
- command options: a line ``<!-- help: segment train -->`` becomes the ``--help`` text of
  ``alibi-vit segment train``, taken from the command's own argument parser; a line naming a command that
  does not exist stops the build.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
FIGURE_SUFFIXES = {".png", ".svg", ".jpg", ".pdf"}
_FIGURE_LINK = re.compile(r"\]\(\.\./benchmarks/results/")
_HELP_MARKER = re.compile(r"^<!-- help: ([\w -]+?) -->$", re.MULTILINE)
HELP_WIDTH = 100  # columns of the generated help text, so it reads the same whatever terminal built the site


def on_files(files, config):
    for path in sorted(RESULTS.iterdir()):
        if path.is_file() and path.suffix in FIGURE_SUFFIXES:
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    markdown = _FIGURE_LINK.sub("](results/", markdown)
    return _HELP_MARKER.sub(lambda match: "```text\n" + command_help(match.group(1).split()) + "```", markdown)


def command_help(words: list[str]) -> str:
    """``alibi-vit WORDS --help`` as text: the subcommand's parser, then its sub-actions' (``segment train``)."""
    from alibi_vit.cli.main import SUBCOMMANDS, subcommand_parser

    if words[0] not in SUBCOMMANDS:
        raise PluginError(f"docs: 'alibi-vit {' '.join(words)}' is not a command (help marker)")
    _, parser = subcommand_parser(words[0])
    for word in words[1:]:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or word not in actions[0].choices:
            raise PluginError(f"docs: 'alibi-vit {' '.join(words)}' is not a command (help marker)")
        parser = actions[0].choices[word]
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_WIDTH)  # argparse wraps to the terminal's width
    try:
        return parser.format_help()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
