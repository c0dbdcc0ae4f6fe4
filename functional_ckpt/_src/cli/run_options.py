"""``fckpt run``'s options: the flags, over a config file's ``run`` block, over the
defaults, checked once before the first launch.

A manager's config file can hold the relaunch options (``run``: retries,
backoff, stall limit) next to the manager's own, so that one file describes a
job; the flags given to ``fckpt run`` win over it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from functional_ckpt._src.cli.common import UsageError, is_checkpoint_dir, one_line
from functional_ckpt._src.codec import documents
from functional_ckpt._src.policy.config import (
    MANAGER_KEYS,
    Relaunch,
    at_key,
    check_keys,
    relaunch_from_config,
)
from functional_ckpt._src.storage.opener import read_file
from functional_ckpt.errors import CheckpointError, ConfigError

__all__ = ["RunOptions", "run_options"]

_CONFIG_LIMIT = 1 << 20
_YAML = (".yaml", ".yml")


@dataclass
class RunOptions:
    """What ``fckpt run`` was asked to do, checked."""

    command: list[str]
    retries: int
    backoff: float
    max_backoff: float
    stall_limit: int
    root: Path | None


def _document(path: Path) -> Any:
    """The parsed config file: JSON, or YAML (``.yaml``/``.yml``, needs PyYAML)."""
    try:
        text = read_file(path, limit=_CONFIG_LIMIT, what="config file")
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except (OSError, CheckpointError) as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc})") from None
    try:
        return documents.load(text, f"--config {path}", yaml=path.suffix.lower() in _YAML)
    except ImportError:
        raise UsageError(
            f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or give JSON"
        ) from None
    except ConfigError as exc:
        raise UsageError(one_line(exc)) from None


def _config(path: Path, key: str | None) -> Relaunch:
    """The ``run`` block of a manager's config (under ``key``, dotted).

    Its ``root`` is not read: the job may be given another one, and it reports the
    steps of the one it uses.
    """
    cfg = _document(path)
    parts = key.split(".") if key else []
    for i, part in enumerate(parts):
        if not isinstance(cfg, dict) or part not in cfg:
            raise UsageError(f"--config {path}: no key {'.'.join(parts[: i + 1])!r} in it")
        cfg = cfg[part]
    try:
        given = check_keys(cfg, key or "config", MANAGER_KEYS, "keys")
        run = given.get("run")
        relaunch = (
            Relaunch() if run is None else relaunch_from_config(run, at_key(key or "", "run"))
        )
    except ConfigError as exc:
        raise UsageError(f"--config {path}: {exc}") from None
    return relaunch


def run_options(args: argparse.Namespace) -> RunOptions:
    command: Sequence[str] = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command to run; put it after '--': fckpt run -- python train.py")
    relaunch = Relaunch()
    if args.config:
        relaunch = _config(Path(args.config), args.config_key)
    elif args.config_key:
        raise UsageError("--config-key names a key of --config FILE; give --config too")
    # The command line wins over the config file, which wins over the defaults.
    retries = relaunch.retries if args.retries is None else args.retries
    backoff = relaunch.backoff if args.backoff is None else args.backoff
    max_backoff = relaunch.max_backoff if args.max_backoff is None else args.max_backoff
    stall_limit = relaunch.stall_limit if args.stall_limit is None else args.stall_limit
    root = Path(args.root) if args.root else None
    if root is not None and is_checkpoint_dir(root):
        raise UsageError(
            f"--root {root}: is a checkpoint; give the directory of checkpoints that holds it"
        )
    if stall_limit == 1:
        raise UsageError(
            "--stall-limit 1: give 2 or more (failures in a row at the same place), or 0 for never"
        )
    if backoff < 0 or max_backoff < 0:
        raise UsageError("--backoff and --max-backoff must be >= 0 seconds")
    return RunOptions(
        command=list(command),
        retries=retries,
        backoff=backoff,
        max_backoff=max(max_backoff, backoff),
        stall_limit=stall_limit,
        root=root,
    )
