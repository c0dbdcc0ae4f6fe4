"""``fckpt``'s parser and which function runs each command: building it imports no command's
module, so ``fckpt --help`` starts light; a bad flag value is a usage error naming the flag."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn

import functional_ckpt as fc
from functional_ckpt._src.cli.ui import PROG, UsageError

__all__ = ["COMMANDS", "DEFAULT_STEPS", "build_parser"]

#: The module of this package and the function in it that run each command.
COMMANDS = {
    "ls": ("listing", "cmd_ls"),
    "inspect": ("show", "cmd_inspect"),
    "verify": ("verify", "cmd_verify"),
    "diff": ("show", "cmd_diff"),
    "export": ("show", "cmd_export"),
    "import": ("show", "cmd_import"),
    "prune": ("listing", "cmd_prune"),
    "run": ("run", "cmd_run"),
    "demo": ("demo", "cmd_demo"),
}
#: ``fckpt demo``'s training steps unless ``--steps`` says otherwise.
DEFAULT_STEPS = 2400

#: Each command's help: its line in ``fckpt --help``, its description, its examples.
_HELP = {
    "ls": """list the checkpoints of a root
List the checkpoints under ROOT (step, save time, size, status, metrics) and
which part of the retention policy (recorded in the checkpoints, or given by
the flags) keeps each one. Half-written, quarantined and uncommitted
directories are listed with their status, and a manager's exports below.
examples:
  fckpt ls runs/exp1 --verify                 # also re-check every checksum
  fckpt ls runs/exp1 --keep-last 2 --keep-best 1 --metric val_loss
  fckpt ls runs/exp1 --json | jq '.[].step'
""",
    "inspect": """show what a checkpoint holds (no tensor data is read)
Show a checkpoint's tree (every tensor's dtype, shape and size, every
non-tensor value) and its metadata, from the manifest alone.
examples:
  fckpt inspect runs/exp1/step_000001000 --key optimizer/param_groups
  fckpt inspect runs/exp1/step_000001000 --json | jq '.entries[].key'
""",
    "verify": """re-check every checksum of a checkpoint or of a whole root
Re-read every byte and check every CRC32, of one checkpoint or of every
committed one under a root; one line per damaged file or key.
Exit status: 0 all intact, 1 damage found, 2 bad input.
examples:
  fckpt verify runs/exp1 --quiet || echo 'damaged!'
  fckpt verify runs/exp1 --json | jq '.checkpoints[].status'
""",
    "diff": """compare two checkpoints key by key
Keys added (+) and removed (-) from A to B, changed shapes, dtypes and values,
and each other tensor's maximum absolute difference (nothing if bit-identical).
examples:
  fckpt diff runs/exp1/step_000001000 runs/exp1/step_000002000
  fckpt diff a/step_000000100 b/step_000000100 --exit-code && echo identical
""",
    "export": """write the weights as safetensors, or weights / full state as a torch file
Write the tensors under --select as Hugging Face-style safetensors (sharded past
--max-shard-size), or with --format torch as one torch.save file that
model.load_state_dict takes (--full: the whole state), loadable with
torch.load(weights_only=True). OUT appears atomically. PATH may be a root (its
newest checkpoint). --config adds config.json and a model directory's side
files, so that from_pretrained(OUT) loads it.
examples:
  fckpt export runs/exp1 weights/ --dtype bfloat16 --max-shard-size 2GB
  fckpt export ckpt ema/ --select ema/model --overwrite
  fckpt export runs/exp1 hf/ --config base_model/   # loads with from_pretrained
  fckpt export runs/exp1 full.pt --format torch --full
""",
    "import": """turn a torch.save file (.pt, .pth) into a checkpoint
Read FILE with torch.load(weights_only=True) (a pickle that would run code is
refused) and save it as the checkpoint OUT. A bare state_dict becomes the
state's 'model' subtree; any other dict is the state as it is.
examples:
  fckpt import model.pt ckpt/imported
  fckpt import lightning.ckpt runs/exp1/step_000005000
""",
    "prune": """delete the checkpoints a retention policy does not keep
Show what the policy keeps and deletes, ask, then delete crash-safely under the
root's writer lock; never the newest checkpoint. Without a terminal, --yes is
required.
examples:
  fckpt prune runs/exp1 --keep-last 3 --dry-run
  fckpt prune runs/exp1 --keep-last 3 --keep-best 2 --metric val_loss --yes
""",
    "run": """run a training command, relaunching it after a crash
Run CMD and start it again when it fails, up to --retries times, after a pause
of --backoff seconds doubled per failure (up to --max-backoff); never after
success. SIGTERM, SIGINT and SIGHUP go to CMD's process group, and then it is
not started again. Each attempt's resumed and reached steps are reported (from
--root, or from CMD's CheckpointManager via FCKPT_PROGRESS); --stall-limit
failures in a row at the same checkpoint stop the job. --config reads the
options from a config's run block; flags win. CMD sees FCKPT_RUN_ATTEMPT=1, 2, ...
Exit status: the last attempt's (128+N for a death by signal N).
examples:
  fckpt run --retries 5 --root runs/exp1 -- torchrun --nproc-per-node 8 train.py
  fckpt run --backoff 30 --max-backoff 600 --stall-limit 0 -- ./train.sh
  fckpt run --config ckpt.yaml -- python train.py --config ckpt.yaml
""",
    "demo": """train, SIGKILL, resume, and check the result is bit-identical
Train a small model in a subprocess that checkpoints with a CheckpointManager,
SIGKILL it partway, resume it in a new process, and compare with an
uninterrupted reference: per-step losses and the final state must be
bit-identical. Exit status 0 only when identical.
examples:
  fckpt demo --root /tmp/demo --steps 300 --crash-at 100
  fckpt ls /tmp/demo/run/checkpoints     # then look at what it left
""",
}

_MAIN_HELP = """\
Look at, check, compare, export, import and prune functional_ckpt checkpoints, \
and run a training command that is relaunched after a crash.
examples:
  fckpt demo                          # see train / crash / resume work
  fckpt ls runs/exp1
  fckpt inspect runs/exp1/step_000001000 --key model
  fckpt verify runs/exp1
  fckpt diff runs/exp1/step_000001000 runs/exp1/step_000002000
  fckpt export runs/exp1 weights/ --dtype bfloat16
  fckpt import model.pt ckpt/imported
  fckpt prune runs/exp1 --keep-last 3 --keep-best 2 --metric val_loss
  fckpt run --retries 3 --root runs/exp1 -- python train.py

exit status: 0 ok, 1 damage found / not identical / declined, 2 bad input
--json: one JSON document on stdout (ls, inspect, verify, diff, export, import,
prune, demo). 'fckpt COMMAND --help' shows each command's options. NO_COLOR=1
disables colours."""


#: ``--json``'s help where it says more than "print JSON for scripts".
_JSON = {"prune": "print JSON for scripts (with --yes or --dry-run)"}
_JSON["demo"] = "print the verdict as JSON (progress on stderr)"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2 (via main)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def is_url(text: str) -> bool:
    return "://" in text


def _checked(kind: type, ok: Callable[[Any], bool], expected: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``kind(text)`` if ``ok`` of it, else an error naming the flag."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive = _checked(int, lambda v: v > 0, "a positive integer")
_non_negative = _checked(int, lambda v: v >= 0, "an integer >= 0")
_seconds = _checked(float, lambda v: 0 <= v < float("inf"), "seconds >= 0")
_stall = _checked(int, lambda v: v == 0 or v >= 2, "0 (never) or 2 or more failures in a row")
_local = _checked(str, lambda v: not is_url(v), "a local path (URLs: ls, inspect, verify)")


def _size(text: str) -> str:
    """A shard size as ``export_safetensors`` takes it."""
    from functional_ckpt._src.export.safetensors import parse_size

    try:
        parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 500MB, 5GB, 5G or 2GiB, got {text!r}"
        ) from None
    return text


def _raw(text: str) -> dict[str, Any]:
    """``description`` and ``epilog`` of a help text (its examples kept as written)."""
    description, examples = text.split("examples:\n")
    raw = {"description": description.rstrip(), "epilog": "examples:\n" + examples}
    return {**raw, "formatter_class": argparse.RawDescriptionHelpFormatter}


def _command(subs: Any, name: str) -> Any:
    summary, text = _HELP[name].split("\n", 1)
    p = subs.add_parser(name, help=summary, **_raw(text))
    p.set_defaults(command_name=name)
    return p


def _policy_flags(p: Any, *, required: bool) -> None:
    keep = "keep the N highest steps"
    p.add_argument("--keep-last", type=_positive, metavar="N", required=required, help=keep)
    best = "also keep the K checkpoints with the best --metric"
    p.add_argument("--keep-best", type=_positive, metavar="K", help=best)
    p.add_argument("--metric", metavar="M", help="metric name for --keep-best (e.g. val_loss)")
    mode = "whether lower or higher --metric is better (default: min)"
    p.add_argument("--mode", choices=("min", "max"), help=mode)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, **_raw(_MAIN_HELP))
    parser.add_argument("--version", action="version", version=f"%(prog)s {fc.__version__}")
    verbose = "log what the library does to stderr (-v: each save, restore, commit, delete...; "
    verbose += "-vv: also each phase's time)"
    parser.add_argument("-v", "--verbose", action="count", default=0, help=verbose)
    subs = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")

    p = _command(subs, "ls")
    p.add_argument("root", help="directory holding step_* checkpoints")
    p.add_argument("--verify", action="store_true", help="re-read every byte (slow)")
    _policy_flags(p, required=False)

    p = _command(subs, "inspect")
    p.add_argument("path", help="a checkpoint directory")
    key = "only keys starting with PREFIX, nested keys joined by '/' (model/0.weight)"
    p.add_argument("--key", metavar="PREFIX", help=key)

    p = _command(subs, "verify")
    p.add_argument("path", help="a checkpoint directory, or a root of checkpoints")
    p.add_argument("-q", "--quiet", action="store_true", help="print only damage and the total")

    p = _command(subs, "diff")
    p.add_argument("a", type=_local, help="the first checkpoint")
    p.add_argument("b", type=_local, help="the second checkpoint")
    p.add_argument("--all", action="store_true", help="also list the identical keys")
    differ = "exit with status 1 when the checkpoints differ"
    p.add_argument("--exit-code", action="store_true", help=differ)

    p = _command(subs, "export")
    p.add_argument("path", type=_local, help="a checkpoint, or a root (its newest checkpoint)")
    out = "output directory (safetensors) or file (torch); must not exist unless --overwrite"
    p.add_argument("out", type=_local, help=out)
    form = "safetensors (default) or torch (a torch.save file)"
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors", help=form)
    select = "subtree holding the weights, nested keys joined by '/' (default: model)"
    p.add_argument("--select", "--key", dest="select", help=select)
    full = "with --format torch: the whole state, not the weights"
    p.add_argument("--full", action="store_true", help=full)
    dtype = "convert floating-point tensors (bfloat16 or bf16, float16 or fp16, ...)"
    p.add_argument("--dtype", help=dtype)
    shard = "largest safetensors shard, e.g. 500MB, 5GB (or 5G), 2GiB (default: 5GB)"
    p.add_argument("--max-shard-size", type=_size, metavar="SIZE", help=shard)
    config = "config.json to write beside the weights; a model directory (save_pretrained's "
    config += "output) also gives its tokenizer files, generation_config.json and other side files"
    p.add_argument("--config", type=_local, metavar="DIR_OR_FILE", help=config)
    p.add_argument("--overwrite", action="store_true", help="replace OUT atomically")

    p = _command(subs, "import")
    p.add_argument("file", type=_local, help="a torch.save file (.pt, .pth, .ckpt)")
    out = "the checkpoint directory to write (must not exist unless --overwrite)"
    p.add_argument("out", type=_local, help=out)
    p.add_argument("--overwrite", action="store_true", help="replace OUT atomically")

    p = _command(subs, "prune")
    p.add_argument("root", type=_local, help="directory holding step_* checkpoints")
    _policy_flags(p, required=True)
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("-n", "--dry-run", action="store_true", help="show the plan, delete nothing")

    p = _command(subs, "run")
    retries = "relaunches after a failure (default: 3)"
    p.add_argument("--retries", type=_non_negative, metavar="N", help=retries)
    backoff = "pause before the first relaunch, doubled after each failure (default: 1)"
    p.add_argument("--backoff", type=_seconds, metavar="SECONDS", help=backoff)
    longest = "longest pause (default: 60)"
    p.add_argument("--max-backoff", type=_seconds, metavar="SECONDS", help=longest)
    root = "the job's checkpoint root, read to report steps and see progress"
    p.add_argument("--root", type=_local, metavar="DIR", help=root)
    stall = "stop after K >= 2 failures in a row at the same place (default: 2; 0: never)"
    p.add_argument("--stall-limit", type=_stall, metavar="K", help=stall)
    config = "a manager's config (JSON or YAML): relaunch options from its run block"
    p.add_argument("--config", type=_local, metavar="FILE", help=config)
    where = "where in --config FILE the manager's config is (dotted: trainer.checkpoint)"
    p.add_argument("--config-key", metavar="KEY", help=where)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...")

    p = _command(subs, "demo")
    p.add_argument("--root", type=_local, help="working directory (default: a new temporary one)")
    steps = f"training steps (default: {DEFAULT_STEPS})"
    p.add_argument("--steps", type=_positive, default=DEFAULT_STEPS, help=steps)
    crash = "step after which the first process is killed (default: 40%% of --steps)"
    p.add_argument("--crash-at", type=_positive, metavar="STEP", help=crash)
    for name, command in subs.choices.items():  # every command but run has one
        if name != "run":
            text = _JSON.get(name, "print JSON for scripts")
            command.add_argument("--json", action="store_true", help=text)
    return parser
