"""Which function runs each ``fckpt`` command, importing the command's module only then.

The parser names these functions (:data:`RUNNERS`) without importing any
command's module: ``fckpt --help`` and the commands that read no tensor start
without torch and without the modules of the commands not run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from functional_ckpt._src.cli.common import one_line, print_json
from functional_ckpt._src.cli.ui import UI

if TYPE_CHECKING:
    from collections.abc import Callable

    from functional_ckpt._src.cli.demo.run import DemoResult

__all__ = ["RUNNERS", "cmd_demo"]


def _ls(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli.listing import cmd_ls

    return cmd_ls(args, ui)


def _verify(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli.listing import cmd_verify

    return cmd_verify(args, ui)


def _prune(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli.listing import cmd_prune

    return cmd_prune(args, ui)


def _inspect(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli.show import cmd_inspect

    return cmd_inspect(args, ui)


def _diff(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli.show import cmd_diff

    return cmd_diff(args, ui)


def _export(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli.torchcmd import cmd_export_any

    return cmd_export_any(args, ui)


def _import(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli.torchcmd import cmd_import

    return cmd_import(args, ui)


def _run(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.cli.run import cmd_run

    return cmd_run(args, ui)


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
    "ls": _ls,
    "verify": _verify,
    "prune": _prune,
    "inspect": _inspect,
    "diff": _diff,
    "export": _export,
    "import": _import,
    "run": _run,
    "demo": cmd_demo,
}
