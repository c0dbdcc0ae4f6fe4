"""The ``fckpt`` command line (``main``); nothing in the library imports this package."""

from functional_ckpt._src.cli.main import main
from functional_ckpt._src.cli.parser import build_parser

__all__ = ["build_parser", "main"]
