"""The argument types and shared flags of ``fckpt``'s parser.

Each value a flag takes is checked while the command line is parsed, so a bad one
is a one-line usage error naming the flag, before any command runs; the parser
itself (:class:`Parser`) turns argparse's errors into that same one line.
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

from functional_ckpt._src.cli.common import UsageError

__all__ = [
    "Parser",
    "add_policy_flags",
    "non_negative_arg",
    "positive_arg",
    "seconds_arg",
    "size_arg",
    "subcommand",
]


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2 (via main)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def size_arg(text: str) -> str:
    """A shard size as ``export_safetensors`` takes it, checked while parsing the flags."""
    from functional_ckpt._src.export.safetensors import parse_size

    try:
        parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 500MB, 5GB, 5G or 2GiB, got {text!r}"
        ) from None
    return text


def positive_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def subcommand(
    subs: Any, name: str, summary: str, description: str, examples: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subs.add_parser(
        name,
        help=summary,
        description=description,
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def add_policy_flags(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument(
        "--keep-last",
        type=positive_arg,
        metavar="N",
        required=required,
        help="keep the N highest steps",
    )
    p.add_argument(
        "--keep-best",
        type=positive_arg,
        metavar="K",
        help="also keep the K checkpoints with the best --metric",
    )
    p.add_argument("--metric", metavar="M", help="metric name for --keep-best (e.g. val_loss)")
    p.add_argument(
        "--mode",
        choices=("min", "max"),
        default="min",
        help="whether lower or higher --metric is better (default: min)",
    )


def non_negative_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value
