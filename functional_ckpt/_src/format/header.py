"""What a manifest says beside the tree (save time, metrics, the manager's record), typed.

A manifest is authenticated, not trusted, so :func:`header_of` reads a value of the
wrong type, NaN, infinity or a time outside 1970-9999 as *unknown*, never fatal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: Reserved metadata key holding the manager's own record of each checkpoint.
MANAGER_KEY = "manager"

#: Largest time accepted as a save time (the last second of the year 9999).
_MAX_TIME = 253_402_300_799.0


def number(value: object) -> float | None:
    """``value`` as a finite float if it is an int or float (not a bool); else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        x = float(value)
    except OverflowError:
        return None
    return x if math.isfinite(x) else None


def integer(value: object) -> int | None:
    """``value`` if it is an int (not a bool); else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def save_time(value: object) -> float | None:
    """A recorded save time (Unix seconds) that can be one; else None."""
    t = number(value)
    return t if t is not None and 0.0 <= t <= _MAX_TIME else None


def metrics_of(value: object) -> dict[str, float]:
    """The ``str -> finite number`` part of a recorded metrics mapping; the rest is dropped."""
    if not isinstance(value, Mapping):
        return {}
    return {k: x for k, v in value.items() if isinstance(k, str) and (x := number(v)) is not None}


@dataclass(frozen=True)
class Record:
    """The manager's record of a checkpoint (``metadata["manager"]``); ``raw`` as stored."""

    step: int | None = None
    epoch: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    is_final: bool = False
    running_time: float = 0.0
    raw: Mapping[str, Any] = field(default_factory=dict)


def record_of(metadata: Mapping[str, Any]) -> Record:
    """The manager's record in a checkpoint's metadata; an empty one if there is none."""
    raw = metadata.get(MANAGER_KEY)
    if not isinstance(raw, dict):
        return Record()
    running = number(raw.get("running_time"))
    return Record(
        step=integer(raw.get("step")),
        epoch=integer(raw.get("epoch")),
        metrics=metrics_of(raw.get("metrics")),
        is_final=raw.get("is_final") is True,
        running_time=running if running is not None and running >= 0 else 0.0,
        raw=raw,
    )


@dataclass(frozen=True)
class Header:
    """A manifest's save time, ``metadata``, the manager's ``record`` and format ``version``."""

    created: float | None
    metadata: Mapping[str, Any]
    record: Record
    version: int | None = None


def header_of(manifest: Mapping[str, Any]) -> Header:
    """The typed header of a decoded manifest; never raises, whatever it holds."""
    meta = manifest.get("metadata")
    meta = dict(meta) if isinstance(meta, dict) else {}
    return Header(
        created=save_time(manifest.get("created")),
        metadata=meta,
        record=record_of(meta),
        version=integer(manifest.get("version")),
    )
