"""The progress file: how a managed job tells ``fckpt run`` its newest committed step."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from functional_ckpt._src.storage.durable import replace_durably
from functional_ckpt._src.storage.opener import read_state

#: Set by ``fckpt run`` in the job's environment: the file the job reports progress to.
PROGRESS_ENV = "FCKPT_PROGRESS"


def report_progress(step: int, saved_at: float) -> None:
    """Record ``step`` for a supervisor that asked; best effort: it never fails a save."""
    target = os.environ.get(PROGRESS_ENV)
    if not target:
        return
    data = json.dumps({"step": int(step), "time": float(saved_at)}).encode()
    with contextlib.suppress(OSError):
        replace_durably(Path(target), data)


@dataclass(frozen=True)
class ReportedStep:
    """The newest committed step a job reported, and when it was saved (Unix time)."""

    step: int
    time: float


def read_progress(path: Path) -> ReportedStep | None:
    """What the job reported last; None if nothing (yet) or nothing readable."""
    raw = read_state(path, "progress file")
    step, when = (raw.get("step"), raw.get("time")) if isinstance(raw, dict) else (None, None)
    if not isinstance(step, int) or isinstance(step, bool) or not isinstance(when, int | float):
        return None
    return ReportedStep(step, float(when))
