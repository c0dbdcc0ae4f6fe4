"""``fckpt``: look at, check, compare, export and prune checkpoints from the shell.

Every subcommand is a thin layer over the public functions (``fc.inspect``,
``fc.verify``, ``fc.restore``, ``fc.export_safetensors``, ``fc.retention.plan_deletions``,
``CheckpointManager.delete``) and :mod:`functional_ckpt._src.root`: the command line
adds presentation, never new checkpoint logic. Conventions:

* results go to stdout, progress bars and errors to stderr; progress bars only
  when stderr is a terminal, colours only when stdout is one (and ``NO_COLOR`` is
  unset), so piped output is plain text;
* exit status 0: done and all good; 1: the answer is "no" (a checkpoint is
  damaged or unsafe, the demo's runs differ, a prune was declined); 2: bad input
  (missing path, not a checkpoint, wrong flags), reported as one line
  ``fckpt: error: <message>`` without a traceback, whatever the input file holds;
* ``--json`` (every command that prints a table or a report) makes stdout one
  JSON document and nothing else; errors and exit statuses stay as they are.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import functional_ckpt as fc
from functional_ckpt._src.cli.common import Declined, UsageError, one_line, print_json
from functional_ckpt._src.cli.ui import PROG, UI

if TYPE_CHECKING:
    from functional_ckpt._src.cli.demo.run import DemoResult

__all__ = ["build_parser", "main"]

# --------------------------------------------------------------------------- commands
# Each command's module is imported when that command runs, never to build the
# parser: ``fckpt --help`` and the commands that read no tensor start without
# torch and the modules of the commands not run.


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


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2 (via main)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _size(text: str) -> str:
    """A shard size as ``export_safetensors`` takes it, checked while parsing the flags."""
    from functional_ckpt._src.export.safetensors import parse_size

    try:
        parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 500MB, 5GB, 5G or 2GiB, got {text!r}"
        ) from None
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _sub(
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


def _add_policy_flags(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument(
        "--keep-last",
        type=_positive,
        metavar="N",
        required=required,
        help="keep the N highest steps",
    )
    p.add_argument(
        "--keep-best",
        type=_positive,
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


def _add_ls(subs: Any) -> None:
    p = _sub(
        subs,
        "ls",
        "list the checkpoints of a root",
        "List the checkpoints under ROOT: step, save time, size, status, metrics, and\n"
        "which part of the retention policy keeps each one. The policy is read from\n"
        "the checkpoints' metadata when recorded there, or taken from the flags.\n"
        "Half-written (*.tmp-*), quarantined (*.corrupt-*) and uncommitted directories\n"
        "are listed too, with their status; a manager's safetensors exports\n"
        "(ROOT/exports) below the checkpoints.",
        "  fckpt ls runs/exp1\n"
        "  fckpt ls runs/exp1 --verify                 # also re-check every checksum\n"
        "  fckpt ls runs/exp1 --keep-last 2 --keep-best 1 --metric val_loss\n"
        "  fckpt ls runs/exp1 --json | jq '.[].step'\n",
    )
    p.add_argument("root", help="directory holding step_* checkpoints")
    p.add_argument("--verify", action="store_true", help="re-read every byte (slow)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    _add_policy_flags(p, required=False)
    p.set_defaults(func=_ls)


def _add_inspect(subs: Any) -> None:
    p = _sub(
        subs,
        "inspect",
        "show what a checkpoint holds (no tensor data is read)",
        "Show a checkpoint's tree: every tensor's dtype, shape and size, every\n"
        "non-tensor value, and the metadata. Only the manifest is read, so this is\n"
        "instant even for huge checkpoints.",
        "  fckpt inspect runs/exp1/step_000001000\n"
        "  fckpt inspect runs/exp1/step_000001000 --key optimizer/param_groups\n"
        "  fckpt inspect runs/exp1/step_000001000 --json | jq '.entries[].key'\n",
    )
    p.add_argument("path", help="a checkpoint directory")
    p.add_argument(
        "--key",
        metavar="PREFIX",
        help="only keys starting with PREFIX, nested keys joined by '/' (model/0.weight)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=_inspect)


def _add_verify(subs: Any) -> None:
    p = _sub(
        subs,
        "verify",
        "re-check every checksum of a checkpoint or of a whole root",
        "Re-read every byte and check every CRC32. Given a root, verify every committed\n"
        "checkpoint under it. Prints one line per damaged file or key.\n"
        "Exit status: 0 all intact, 1 damage found, 2 bad input.",
        "  fckpt verify runs/exp1/step_000001000\n"
        "  fckpt verify runs/exp1 --quiet || echo 'damaged!'\n"
        "  fckpt verify runs/exp1 --json | jq '.checkpoints[].status'\n",
    )
    p.add_argument("path", help="a checkpoint directory, or a root of checkpoints")
    p.add_argument("-q", "--quiet", action="store_true", help="print only damage and the total")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=_verify)


def _add_diff(subs: Any) -> None:
    p = _sub(
        subs,
        "diff",
        "compare two checkpoints key by key",
        "Keys added (+) and removed (-) from A to B, tensors whose shape or dtype\n"
        "changed, non-tensor values that changed, and for every other tensor the\n"
        "maximum absolute difference (or nothing, if bit-identical). Both checkpoints\n"
        "are read in full.",
        "  fckpt diff runs/exp1/step_000001000 runs/exp1/step_000002000\n"
        "  fckpt diff a/step_000000100 b/step_000000100 --exit-code && echo identical\n"
        "  fckpt diff a/step_000000100 b/step_000000100 --json | jq '.entries[].key'\n",
    )
    p.add_argument("a", help="the first checkpoint")
    p.add_argument("b", help="the second checkpoint")
    p.add_argument("--all", action="store_true", help="also list the identical keys")
    p.add_argument(
        "--exit-code", action="store_true", help="exit with status 1 when the checkpoints differ"
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=_diff)


def _add_export(subs: Any) -> None:
    p = _sub(
        subs,
        "export",
        "write the weights as safetensors, or weights / full state as a torch file",
        "Write the tensors under --select as Hugging Face-style model.safetensors, or as\n"
        "shards plus model.safetensors.index.json when they exceed --max-shard-size.\n"
        "With --format torch, write them as one torch.save file OUT (a state_dict that\n"
        "model.load_state_dict takes), or with --full the whole state; the file loads\n"
        "with torch.load(weights_only=True). OUT appears atomically: complete or not at\n"
        "all. PATH may be a root: its newest checkpoint is exported. With --config, the\n"
        "config.json and side files of a model directory go with the weights, so that\n"
        "from_pretrained(OUT) loads it.",
        "  fckpt export runs/exp1/step_000001000 weights/\n"
        "  fckpt export runs/exp1 weights/ --dtype bfloat16 --max-shard-size 2GB\n"
        "  fckpt export ckpt ema/ --select ema/model --overwrite\n"
        "  fckpt export runs/exp1 hf/ --config base_model/   # loads with from_pretrained\n"
        "  fckpt export runs/exp1 model.pt --format torch\n"
        "  fckpt export runs/exp1 full.pt --format torch --full\n",
    )
    p.add_argument("path", help="a checkpoint, or a root (its newest checkpoint)")
    p.add_argument(
        "out",
        help="output directory (safetensors) or file (torch); must not exist unless --overwrite",
    )
    p.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="safetensors (default) or torch (a torch.save file)",
    )
    p.add_argument(
        "--select",
        "--key",
        dest="select",
        default="model",
        help="subtree holding the weights, nested keys joined by '/' (default: model)",
    )
    p.add_argument(
        "--full", action="store_true", help="with --format torch: the whole state, not the weights"
    )
    p.add_argument(
        "--dtype", help="convert floating-point tensors (bfloat16 or bf16, float16 or fp16, ...)"
    )
    p.add_argument(
        "--max-shard-size",
        type=_size,
        metavar="SIZE",
        help="largest safetensors shard, e.g. 500MB, 5GB (or 5G), 2GiB (default: 5GB)",
    )
    p.add_argument(
        "--config",
        metavar="DIR_OR_FILE",
        help="config.json to write beside the weights; a model directory (save_pretrained's "
        "output) also gives its tokenizer files, generation_config.json and other side files",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT atomically")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=_export)


def _add_import(subs: Any) -> None:
    p = _sub(
        subs,
        "import",
        "turn a torch.save file (.pt, .pth) into a checkpoint",
        "Read FILE with torch.load(weights_only=True), which refuses a pickle that\n"
        "would run code (nothing in it runs), and save what it holds as the checkpoint\n"
        "OUT with fc.save (atomically). A bare state_dict becomes the state's 'model'\n"
        "subtree; any other dict (a training checkpoint such as Lightning's) is the\n"
        "state as it is.",
        "  fckpt import model.pt ckpt/imported\n"
        "  fckpt import lightning.ckpt runs/exp1/step_000005000\n"
        "  fckpt inspect ckpt/imported\n",
    )
    p.add_argument("file", help="a torch.save file (.pt, .pth, .ckpt)")
    p.add_argument(
        "out", help="the checkpoint directory to write (must not exist unless --overwrite)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT atomically")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=_import)


def _add_prune(subs: Any) -> None:
    p = _sub(
        subs,
        "prune",
        "delete the checkpoints a retention policy does not keep",
        "Show which checkpoints the policy keeps and which it deletes, ask, then\n"
        "delete crash-safely (renamed out of sight first) under the root's writer\n"
        "lock. The newest checkpoint is never deleted. Without a terminal, --yes is\n"
        "required.",
        "  fckpt prune runs/exp1 --keep-last 3 --dry-run\n"
        "  fckpt prune runs/exp1 --keep-last 3 --keep-best 2 --metric val_loss\n"
        "  fckpt prune runs/exp1 --keep-last 1 --yes\n",
    )
    p.add_argument("root", help="directory holding step_* checkpoints")
    _add_policy_flags(p, required=True)
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("-n", "--dry-run", action="store_true", help="show the plan, delete nothing")
    p.add_argument(
        "--json", action="store_true", help="print JSON for scripts (with --yes or --dry-run)"
    )
    p.set_defaults(func=_prune)


def _add_demo(subs: Any) -> None:
    from functional_ckpt._src.cli.demo import DEFAULT_STEPS

    p = _sub(
        subs,
        "demo",
        "train, SIGKILL, resume, and check the result is bit-identical",
        "Train a small model on generated data in a subprocess that checkpoints with a\n"
        "CheckpointManager (every_steps | every_secs | on_improve, keep_last | keep_best,\n"
        "async saves), SIGKILL it partway, resume it in a new process, run an\n"
        "uninterrupted reference alongside, and compare: per-step losses and final\n"
        "state must be bit-identical. About a minute on 2 CPU cores.\n"
        "Exit status 0 only when identical.",
        "  fckpt demo\n"
        "  fckpt demo --root /tmp/demo --steps 300 --crash-at 100\n"
        "  fckpt ls /tmp/demo/run/checkpoints     # then look at what it left\n",
    )
    p.add_argument("--root", help="working directory (default: a new temporary directory)")
    p.add_argument(
        "--steps",
        type=_positive,
        default=DEFAULT_STEPS,
        help=f"training steps (default: {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--crash-at",
        type=_positive,
        metavar="STEP",
        help="step after which the first process is killed (default: 40%% of --steps)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the verdict as JSON (progress on stderr)"
    )
    p.set_defaults(func=cmd_demo)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _add_run(subs: Any) -> None:
    p = _sub(
        subs,
        "run",
        "run a training command, relaunching it after a crash",
        "Run CMD; when it fails (non-zero exit, or killed by a signal) start it again,\n"
        "up to --retries times, pausing --backoff seconds, doubled after each failure\n"
        "(up to --max-backoff). Never after success. SIGTERM, SIGINT and SIGHUP are\n"
        "passed on to CMD's whole process group (an on_signal policy saves) and then\n"
        "CMD is not started again. Each attempt's resumed and reached checkpoint steps\n"
        "are reported (read from --root, or reported by CMD's CheckpointManager through\n"
        "the file named in FCKPT_PROGRESS), and a job whose --stall-limit consecutive\n"
        "failures end at the same checkpoint is stopped early (a job that reports no\n"
        "steps: the same quick failure). --config takes the options from a config\n"
        "file's run block; flags win over it.\n"
        "CMD sees FCKPT_RUN_ATTEMPT=1, 2, ...\n"
        "Exit status: the last attempt's (128+N for a death by signal N).",
        "  fckpt run --retries 3 -- python train.py --config c.yaml\n"
        "  fckpt run --retries 5 --root runs/exp1 -- torchrun --nproc-per-node 8 train.py\n"
        "  fckpt run --backoff 30 --max-backoff 600 --stall-limit 0 -- ./train.sh\n"
        "  fckpt run --config ckpt.yaml -- python train.py --config ckpt.yaml\n",
    )
    p.add_argument(
        "--retries",
        type=_non_negative,
        default=None,
        metavar="N",
        help="relaunches after a failure (default: 3)",
    )
    p.add_argument(
        "--backoff",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="pause before the first relaunch, doubled after each failure (default: 1)",
    )
    p.add_argument(
        "--max-backoff",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="longest pause (default: 60)",
    )
    p.add_argument(
        "--root",
        metavar="DIR",
        help="the job's checkpoint root, read to report steps and see progress",
    )
    p.add_argument(
        "--stall-limit",
        type=_non_negative,
        default=None,
        metavar="K",
        help="stop after K >= 2 failures in a row at the same place (default: 2; 0: never)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a manager's config (JSON or YAML): relaunch options from its run block",
    )
    p.add_argument(
        "--config-key",
        metavar="KEY",
        help="where in --config FILE the manager's config is (dotted: trainer.checkpoint)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    p.set_defaults(func=_run)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Look at, check, compare, export, import and prune functional_ckpt "
        "checkpoints, and run a training command that is relaunched after a crash.",
        epilog="examples:\n"
        "  fckpt demo                          # see train / crash / resume work\n"
        "  fckpt ls runs/exp1\n"
        "  fckpt inspect runs/exp1/step_000001000 --key model\n"
        "  fckpt verify runs/exp1\n"
        "  fckpt diff runs/exp1/step_000001000 runs/exp1/step_000002000\n"
        "  fckpt export runs/exp1 weights/ --dtype bfloat16\n"
        "  fckpt import model.pt ckpt/imported\n"
        "  fckpt prune runs/exp1 --keep-last 3 --keep-best 2 --metric val_loss\n"
        "  fckpt run --retries 3 --root runs/exp1 -- python train.py\n\n"
        "exit status: 0 ok, 1 damage found / not identical / declined, 2 bad input\n"
        "--json: one JSON document on stdout (ls, inspect, verify, diff, export, import,\n"
        "prune, demo). 'fckpt COMMAND --help' shows each command's options. NO_COLOR=1\n"
        "disables colours.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {fc.__version__}")
    subs = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    for add in (
        _add_ls,
        _add_inspect,
        _add_verify,
        _add_diff,
        _add_export,
        _add_import,
        _add_prune,
        _add_run,
        _add_demo,
    ):
        add(subs)
    return parser


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fckpt`` and ``python -m functional_ckpt``; returns the exit status."""
    ui = UI()
    try:
        args = build_parser().parse_args(argv)
        status: int = args.func(args, ui)
        return status
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        ui.error(one_line(e))
        return 2
    except Declined as e:
        ui.error(one_line(e))
        return 1
    except (
        fc.errors.CorruptCheckpoint,
        fc.errors.UnsafeCheckpoint,
        fc.errors.IncompleteCheckpoint,
    ) as e:
        ui.error(one_line(e))  # the answer is "no": damaged, never committed, or hostile
        return 1
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (fc.CheckpointError, OSError, ValueError, TypeError, ArithmeticError) as e:
        ui.error(one_line(e))
        return 2
    except KeyboardInterrupt:
        ui.error("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
