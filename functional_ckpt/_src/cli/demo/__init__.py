"""``fckpt demo``: train, SIGKILL, resume, and prove the result is bit-identical.

Lives at the edge: only the ``fckpt`` command loads it, and the library never
imports it. ``job`` is what the training children run, ``run`` the parent that
spawns, watches and compares them, ``report`` what is printed.
"""

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
