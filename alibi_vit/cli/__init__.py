"""The ``alibi-vit`` command: the entry point (``main``), one module per subcommand named after it,
and the options several subcommands share (``options``).

This is the only part of :mod:`alibi_vit` that may import ``lit_modules`` or ``datamodules``.
"""

from .main import main

__all__ = ["main"]
