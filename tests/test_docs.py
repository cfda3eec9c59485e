"""The README and the documentation site: the site builds with every link checked, the README's set-up
commands come first and are the ones CI runs, and the test tools stay out of a user's install."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = 40  # lines of a terminal or a browser window before anything is scrolled
INSTALL, TEST = 'pip install -e ".[test]"', "python -m pytest -q"
TEST_TOOLS = {"pytest", "httpx", "playwright", "mkdocs"}


def _commands(text: str) -> list[str]:
    """The commands of the bash blocks of a Markdown text, one per line, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.split("  #")[0].strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_docs_site_builds_with_every_link_and_anchor_resolved(tmp_path):
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail('CI must build the docs: mkdocs is missing (install with pip install -e ".[test]")')
        pytest.skip('mkdocs is not installed (pip install -e ".[test]")')
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    options = (tmp_path / "site" / "cli" / "index.html").read_text()
    assert "usage: alibi-vit segment apply" in options and "--images" in options  # the generated option lists
    assert (tmp_path / "site" / "results" / "app_screenshot.png").is_file()  # figures from benchmarks/results


def test_readme_links_point_at_files_that_exist():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert any(t.startswith("docs/") for t in local)
    assert not [t for t in local if not (ROOT / t).exists()]


def test_first_screen_of_readme_holds_install_test_and_main_job():
    first = "\n".join(README.splitlines()[:FIRST_SCREEN])
    for command in (INSTALL, TEST, "lightning fit --config configs/demo.yaml", "alibi-vit segment train"):
        assert command in first, f"{command!r} is not in the README's first {FIRST_SCREEN} lines"
    assert "docs/" in first


def test_ci_installs_and_tests_the_way_the_readme_says():
    readme = _commands(README)
    assert INSTALL in readme and TEST in readme
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert INSTALL in ci and TEST in ci


def test_test_tools_are_an_extra_not_a_runtime_dependency():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements):
        return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}

    assert not names(project["dependencies"]) & TEST_TOOLS
    assert names(project["optional-dependencies"]["test"]) >= TEST_TOOLS


def test_every_command_has_its_options_on_the_options_page():
    from alibi_vit.cli.main import SUBCOMMANDS, subcommand_parser

    expected = set()
    for command in SUBCOMMANDS:
        _, parser = subcommand_parser(command)
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        expected |= {f"{command} {action}" for action in actions[0].choices} if actions else {command}
    shown = set(re.findall(r"^<!-- help: ([\w -]+?) -->$", (ROOT / "docs" / "cli.md").read_text(), flags=re.M))
    assert shown == expected


def test_readme_commands_parse():
    """Every ``alibi-vit`` line of the README names a command and options the command knows."""
    from alibi_vit.cli.main import subcommand_parser

    lines = [line for line in _commands(README) if line.startswith("alibi-vit ")]
    assert len(lines) >= 4
    for line in lines:
        words = shlex.split(line)[1:]
        _, parser = subcommand_parser(words[0])
        parser.parse_args(words[1:])  # argparse exits (SystemExit) on an unknown option


def test_every_command_option_has_help_text():
    from alibi_vit.cli.main import SUBCOMMANDS, subcommand_parser

    def silent(parser, name):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for word, sub in action.choices.items():
                    yield from silent(sub, f"{name} {word}")
            elif not isinstance(action, argparse._HelpAction) and not (action.help or "").strip():
                yield f"alibi-vit {name} {'/'.join(action.option_strings) or action.dest}"

    missing = [option for command in SUBCOMMANDS for option in silent(subcommand_parser(command)[1], command)]
    assert not missing, "options without help: " + ", ".join(missing)


def test_python_version_in_readme_and_install_page_is_the_one_pyproject_requires():
    import tomllib

    required = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minimum = re.fullmatch(r">=\s*(3\.\d+)", required)
    assert minimum, f"requires-python {required!r} is not of the form '>=3.N'"
    for page in (README, (ROOT / "docs" / "install.md").read_text()):
        stated = set(re.findall(r"Python\s*(?:≥|>=)\s*(3\.\d+)", page))
        assert stated == {minimum.group(1)}, f"a page says Python ≥ {sorted(stated)}, pyproject requires {required}"
