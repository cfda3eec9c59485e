"""One-line errors for mistakes in a ``lightning`` command line or config file.

jsonargparse answers a typo with the whole usage (50-60 lines) and then a message that lists every
alternative of every Union type it tried, ``NoneType`` included; the line that matters comes last.
:class:`ConciseArgumentParser` prints one line instead, ``lightning: error: WHERE: WHAT``, built from the
parts of that message that name the option, the value and what was expected, and points to ``--help``.
A message of a shape not recognised here is printed whole (without the usage), on one line.
"""

from __future__ import annotations

import re
import sys

from lightning.pytorch.cli import LightningArgumentParser

__all__ = ["ConciseArgumentParser", "concise_message"]

_KEY = re.compile(r'Parser key "([^"]+)":')
_CLASS = re.compile(r"Problem with given class_path '([^']+)':")
_NOT_ACCEPTED = re.compile(r"Option '([^']+)' is not accepted|Key '([^']+)' is not expected")
_GOT = re.compile(r"Expected a (.+?)\. Got value: (.*)")
_IMPORT_PATH = re.compile(r"Expected a dot import path string: (.*)")


def _type_name(expected: str) -> str:
    """``<class 'int'>`` → ``an int``; ``typing.Literal['a', 'b']`` → ``'a', 'b'``."""
    literal = re.fullmatch(r"typing\.Literal\[(.*)\]", expected)
    if literal:
        return literal.group(1)
    name = re.fullmatch(r"<class '(?:[\w.]+\.)?(\w+)'>", expected)
    return f"{'an' if name and name.group(1)[0] in 'aeiou' else 'a'} {name.group(1)}" if name else expected


def concise_message(message: str) -> str:
    """The one line that matters of a jsonargparse error message."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "invalid command line"
    if lines[0].startswith("Problems parsing config"):  # YAML syntax: where it broke, on one line
        text = " ".join(lines)
        return re.sub(r'\s*in "<unicode string>", (line \d+, column \d+)', r" (\1)", text)
    keys = [m.group(1) for line in lines for m in [_KEY.match(line)] if m]
    if not keys:
        text = " ".join(lines)
        if "not accept option" in text or "unrecognized arguments" in text:
            text += " (--help lists the options)"
        return text
    option = "--" + ".".join(keys)
    classes = [m.group(1) for line in lines for m in [_CLASS.search(line)] if m]
    rest = _KEY.sub("", lines[0]).strip()  # 'Parser key "config": File does not exist: ...'
    if rest:
        return f"{option}: {rest}"
    for line in lines:
        unknown = _NOT_ACCEPTED.search(line)
        if unknown:
            name = unknown.group(1) or unknown.group(2)
            owner = f" of {classes[0]}" if classes else ""
            return f"{option}.{name}: no such option{owner} (--help lists the options)"
        got = _GOT.search(line)
        if got:
            return f"{option}: expected {_type_name(got.group(1))}, got {got.group(2)!r}"
        bad_class = _IMPORT_PATH.search(line)
        if bad_class:
            return f"{option}: {bad_class.group(1)!r} is not a class (give its import path, e.g. package.module.Class)"
    expected = [line[len("- Expected a "):] for line in lines if line.startswith("- Expected a ")]
    expected = [_type_name(e) for e in expected if e != "<class 'NoneType'>"]
    given = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Given value:")), None)
    if expected and given is not None:
        return f"{option}: {given!r} is not accepted; expected one of {', '.join(expected)}"
    return f"{option}: " + " ".join(line for line in lines[1:] if not line.startswith(("Subtypes:", "Errors:")))


class ConciseArgumentParser(LightningArgumentParser):
    """LightningArgumentParser whose errors are one line on stderr and exit status 2, without the usage."""

    def error(self, message: str, ex: Exception | None = None):
        if not self.exit_on_error:  # parsing a Union alternative, or called from code that handles it
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        print(f"{prog}: error: {concise_message(message)}", file=sys.stderr)
        self.exit(2)
