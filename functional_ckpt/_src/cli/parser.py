"""``fckpt``'s parser: every command's flags, help text and examples.

Building it imports no command's module (each command's function is looked up in
:data:`.commands.RUNNERS`, which imports its module only when it runs), so
``fckpt --help`` and the commands that read no tensor start light.
"""

from __future__ import annotations

import argparse
from typing import Any

import functional_ckpt as fc
from functional_ckpt._src.cli.arguments import (
    Parser,
    add_policy_flags,
    non_negative_arg,
    positive_arg,
    seconds_arg,
    size_arg,
    subcommand,
)
from functional_ckpt._src.cli.commands import RUNNERS
from functional_ckpt._src.cli.ui import PROG

__all__ = ["build_parser"]


def _add_ls(subs: Any) -> None:
    p = subcommand(
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
    add_policy_flags(p, required=False)
    p.set_defaults(func=RUNNERS["ls"])


def _add_inspect(subs: Any) -> None:
    p = subcommand(
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
    p.set_defaults(func=RUNNERS["inspect"])


def _add_verify(subs: Any) -> None:
    p = subcommand(
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
    p.set_defaults(func=RUNNERS["verify"])


def _add_diff(subs: Any) -> None:
    p = subcommand(
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
    p.set_defaults(func=RUNNERS["diff"])


def _add_export(subs: Any) -> None:
    p = subcommand(
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
        type=size_arg,
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
    p.set_defaults(func=RUNNERS["export"])


def _add_import(subs: Any) -> None:
    p = subcommand(
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
    p.set_defaults(func=RUNNERS["import"])


def _add_prune(subs: Any) -> None:
    p = subcommand(
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
    add_policy_flags(p, required=True)
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("-n", "--dry-run", action="store_true", help="show the plan, delete nothing")
    p.add_argument(
        "--json", action="store_true", help="print JSON for scripts (with --yes or --dry-run)"
    )
    p.set_defaults(func=RUNNERS["prune"])


def _add_demo(subs: Any) -> None:
    from functional_ckpt._src.cli.demo import DEFAULT_STEPS

    p = subcommand(
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
        type=positive_arg,
        default=DEFAULT_STEPS,
        help=f"training steps (default: {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--crash-at",
        type=positive_arg,
        metavar="STEP",
        help="step after which the first process is killed (default: 40%% of --steps)",
    )
    p.add_argument(
        "--json", action="store_true", help="print the verdict as JSON (progress on stderr)"
    )
    p.set_defaults(func=RUNNERS["demo"])


def _add_run(subs: Any) -> None:
    p = subcommand(
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
        type=non_negative_arg,
        default=None,
        metavar="N",
        help="relaunches after a failure (default: 3)",
    )
    p.add_argument(
        "--backoff",
        type=seconds_arg,
        default=None,
        metavar="SECONDS",
        help="pause before the first relaunch, doubled after each failure (default: 1)",
    )
    p.add_argument(
        "--max-backoff",
        type=seconds_arg,
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
        type=non_negative_arg,
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
    p.set_defaults(func=RUNNERS["run"])


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log what the library does to stderr (-v: each save, restore, commit, "
        "delete...; -vv: also each phase's time)",
    )
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
