"""``fckpt``: look at, check, compare, export and prune checkpoints from the shell.

Each command is presentation over the library's functions, never new checkpoint logic;
bad input is one line ``fckpt: error: <message>``, never a traceback (docs/cli.md).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Sequence

import functional_ckpt as fc
from functional_ckpt._src.cli.parser import COMMANDS, build_parser
from functional_ckpt._src.cli.ui import UI, Declined, UsageError, one_line
from functional_ckpt.errors import CorruptCheckpoint, IncompleteCheckpoint, UnsafeCheckpoint

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fckpt`` and ``python -m functional_ckpt``; returns the exit status."""
    ui = UI()
    try:
        args = build_parser().parse_args(argv)
        if args.verbose:
            _log_to_stderr(logging.INFO if args.verbose == 1 else logging.DEBUG)
        module, name = COMMANDS[args.command_name]
        run = getattr(importlib.import_module(f"functional_ckpt._src.cli.{module}"), name)
        return int(run(args, ui))
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except (Declined, CorruptCheckpoint, UnsafeCheckpoint, IncompleteCheckpoint) as e:
        ui.error(one_line(e))  # the answer is "no": declined, damaged, hostile, never committed
        return 1
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (UsageError, fc.CheckpointError, OSError, ValueError, TypeError, ArithmeticError) as e:
        ui.error(one_line(e))
        return 2
    except (RecursionError, MemoryError) as e:  # the input nests or grows beyond any bound
        ui.error(f"the input is too deeply nested or too large ({type(e).__name__})")
        return 2
    except KeyboardInterrupt:
        ui.error("interrupted")
        return 130


def _log_to_stderr(level: int) -> None:
    """``-v``: the library's records (the ``functional_ckpt`` logger) on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fckpt: %(name)s: %(message)s"))
    log = logging.getLogger("functional_ckpt")
    log.addHandler(handler)
    log.setLevel(level)
