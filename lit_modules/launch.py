"""The ``lightning`` console script: process settings first (:mod:`alibi_vit.runtime`), then
:func:`lit_modules.cli.main`, whose module imports PyTorch and Lightning."""

from __future__ import annotations

from alibi_vit.runtime import prefer_passive_threads_when_busy


def main() -> int:
    prefer_passive_threads_when_busy()
    from lit_modules.cli import main as run

    return run()
