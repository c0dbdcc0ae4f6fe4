"""The package's log records, one child logger per stage, numbers as ``extra`` fields: a job
that runs for days wants a line per save, restore, commit or prune and a warning per fallback
without writing them itself. Silent (a ``NullHandler``) until the application configures
logging, and nothing is formatted that no handler would see."""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from functional_ckpt._src.paths import PathLike

__all__ = ["done", "logger", "phase", "size", "warn"]

NAME = "functional_ckpt"
logging.getLogger(NAME).addHandler(logging.NullHandler())


def logger(stage: str) -> logging.Logger:
    """The logger of one stage of the package: ``functional_ckpt.<stage>``."""
    return logging.getLogger(f"{NAME}.{stage}")


def size(n: float) -> str:
    """Bytes as a reader of a log wants them: ``14.2 GB``, ``512 B`` (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def done(
    log: logging.Logger,
    verb: str,
    path: PathLike,
    *,
    seconds: float,
    nbytes: int | None = None,
    step: int | None = None,
    to: str = "to",
) -> None:
    """One INFO record of a finished operation, e.g.
    ``saved step 1000: 14.2 GB in 3.1 s (4.6 GB/s) to ckpt/step_1000``."""
    if not log.isEnabledFor(logging.INFO):
        return
    what = verb if step is None else f"{verb} step {step}"
    amount = "" if nbytes is None else f"{size(nbytes)} "
    rate = nbytes / seconds if nbytes is not None and seconds > 0 else None
    speed = "" if rate is None else f" ({size(rate)}/s)"
    fields = {"step": step, "bytes": nbytes, "seconds": seconds, "throughput": rate}
    args = (what, amount, seconds, speed, to, path)
    log.info("%s: %sin %.3g s%s %s %s", *args, extra={**fields, "path": str(path)}, stacklevel=2)


def warn(message: str, category: type[Warning], *, stacklevel: int) -> None:
    """A fallback taken (a damaged checkpoint skipped, a tier unavailable, a leftover
    recovered): the Python warning the caller sees, as ``warnings.warn`` makes it, and a
    WARNING record on the logger of the stage that took it."""
    warnings.warn(message, category, stacklevel=stacklevel + 1)
    module = sys._getframe(1).f_globals.get("__name__", "")
    stage = module.removeprefix(f"{NAME}._src.").partition(".")[0]
    logger(stage).warning(message, extra={"category": category.__name__}, stacklevel=2)


@contextmanager
def phase(log: logging.Logger, name: str, path: PathLike) -> Iterator[None]:
    """A DEBUG record of how long one phase of an operation took."""
    if not log.isEnabledFor(logging.DEBUG):
        yield
        return
    t0 = time.perf_counter()
    yield
    seconds = time.perf_counter() - t0
    log.debug(
        "%s of %s: %.3g s", name, path, seconds, extra={"seconds": seconds, "path": str(path)}
    )
