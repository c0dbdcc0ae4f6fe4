"""Which function runs each ``fckpt`` command, importing the command's module only then.

The parser names these functions (:data:`RUNNERS`) without importing any
command's module: ``fckpt --help`` and the commands that read no tensor start
without torch and without the modules of the commands not run.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from functional_ckpt._src.cli.common import one_line, print_json
from functional_ckpt._src.cli.ui import UI

if TYPE_CHECKING:
    from functional_ckpt._src.cli.demo.run import DemoResult

__all__ = ["RUNNERS", "cmd_demo"]


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace, UI], int]:
    """The function ``name`` of the command module ``module``, imported when it runs."""

    def run(args: argparse.Namespace, ui: UI) -> int:
        command = getattr(importlib.import_module(f"functional_ckpt._src.cli.{module}"), name)
        return int(command(args, ui))

    return run


def cmd_demo(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli import demo

    try:
        return _demo(demo, args, ui)
    except demo.DemoError as e:
        ui.error(one_line(e))  # the answer is "no": the demo's runs could not be compared
        return 1


def _demo(demo: Any, args: argparse.Namespace, ui: UI) -> int:
    root = Path(args.root) if args.root else demo.default_root()

    say = ui.note if args.json else ui.print  # with --json, stdout holds only the document

    def progress(label: str, total: int) -> Any:  # a Progress bar or a demo.Heartbeat
        if not ui.show_progress:  # a log: a plain line every few seconds, no bar
            return demo.Heartbeat(label, total, say)
        return ui.progress(label, total, unit="steps").start()

    say(f"fckpt demo: train, SIGKILL, resume, compare; working in {root}")
    result = demo.run_demo(root, args.steps, args.crash_at, progress=progress, say=say)
    result.plot = demo.plot(result)
    if args.json:
        print_json(ui, _demo_json(result))
    else:
        ui.print("")
        ui.print(demo.format_report(result, ui.paint, ui.ascii_only))
    return 0 if result.identical else 1


def _demo_json(result: DemoResult) -> dict[str, Any]:
    """``demo --json``: the verdict and the numbers the report is made of."""
    return {
        "root": str(result.root),
        "identical": result.identical,
        "losses_identical": result.losses_identical,
        "state_diff": list(result.state_diff),
        "steps": result.schedule.steps,
        "crash_at": result.crash_at,
        "killed_at": result.first.last_step,
        "resumed_from": result.second.resumed_from,
        "finished_at": result.second.last_step,
        "replayed": result.replayed,
        "kept": list(result.kept),
        "kept_by": {str(k): v for k, v in result.kept_by.items()},
        "in_flight": list(result.in_flight),
        "wall_s": result.wall_s,
        "plot": None if result.plot is None else str(result.plot),
    }


#: The function that runs each command, by the command's name.
RUNNERS: Final[dict[str, Callable[[argparse.Namespace, UI], int]]] = {
    "ls": _lazy("listing", "cmd_ls"),
    "verify": _lazy("listing", "cmd_verify"),
    "prune": _lazy("listing", "cmd_prune"),
    "inspect": _lazy("show", "cmd_inspect"),
    "diff": _lazy("show", "cmd_diff"),
    "export": _lazy("torchcmd", "cmd_export_any"),
    "import": _lazy("torchcmd", "cmd_import"),
    "run": _lazy("run", "cmd_run"),
    "demo": cmd_demo,
}
