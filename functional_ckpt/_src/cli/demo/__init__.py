"""``fckpt demo``: train, SIGKILL, resume, and prove the result is bit-identical.

Lives at the edge: only the ``fckpt`` command loads it, and the library never
imports it. ``job`` is what the training children run, ``run`` the parent that
spawns, watches and compares them, ``report`` what is printed.

Its names are imported on first use: the ``fckpt`` parser reads
``job.DEFAULT_STEPS`` without loading the rest.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from functional_ckpt._src.cli.demo.job import (
        DEFAULT_STEPS,
        DemoError,
        Job,
        Schedule,
        ShuffleLoader,
        child_main,
    )
    from functional_ckpt._src.cli.demo.report import (
        SPARKS,
        format_report,
        plot,
        report_lines,
        sparkline,
    )
    from functional_ckpt._src.cli.demo.run import (
        ChildLog,
        DemoResult,
        EventTail,
        Heartbeat,
        default_crash_at,
        default_root,
        read_attempt,
        run_demo,
    )

#: Where each name lives: ``name -> module of this package``.
_WHERE = {
    "ChildLog": "run",
    "DEFAULT_STEPS": "job",
    "DemoError": "job",
    "DemoResult": "run",
    "EventTail": "run",
    "Heartbeat": "run",
    "Job": "job",
    "SPARKS": "report",
    "Schedule": "job",
    "ShuffleLoader": "job",
    "child_main": "job",
    "default_crash_at": "run",
    "default_root": "run",
    "format_report": "report",
    "plot": "report",
    "read_attempt": "run",
    "report_lines": "report",
    "run_demo": "run",
    "sparkline": "report",
}

__all__ = [
    "DEFAULT_STEPS",
    "SPARKS",
    "ChildLog",
    "DemoError",
    "DemoResult",
    "EventTail",
    "Heartbeat",
    "Job",
    "Schedule",
    "ShuffleLoader",
    "child_main",
    "default_crash_at",
    "default_root",
    "format_report",
    "plot",
    "read_attempt",
    "report_lines",
    "run_demo",
    "sparkline",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # looked up once; the next access finds it directly
    return value
