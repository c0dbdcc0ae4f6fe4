"""Forking: start a new run in a new root from a checkpoint of another run.

The fork shares the source's data files (an incremental save on it as base).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from functional_ckpt._src.format.header import MANAGER_KEY, header_of
from functional_ckpt._src.format.naming import step_in_name
from functional_ckpt._src.manager.manager import CheckpointManager
from functional_ckpt._src.manager.provenance import AUTO_KEYS, Provenance, git_commit
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy.base import as_int
from functional_ckpt._src.policy.leaves import never
from functional_ckpt._src.policy.retention import keep_all
from functional_ckpt._src.restore.api import restore
from functional_ckpt._src.save.api import save
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import CheckpointError, CheckpointExists


def fork(checkpoint_path: PathLike, new_root: PathLike, *, step: int | None = None) -> Path:
    """Start a new run in the empty ``new_root`` from a checkpoint of another run, as
    ``new_root/step_N`` (``N`` the source's step unless ``step`` is given): user
    metadata, step and metrics kept, policies afresh, ``"forked_from"`` recorded."""
    if step is not None and as_int(step, "fork(step=...)") < 0:
        raise ValueError(f"fork(step={step!r}): steps must be >= 0")
    src = Path(checkpoint_path)
    head = header_of(committed.read_manifest(src))
    meta = dict(head.metadata)
    src_step = head.record.step if head.record.step is not None else step_in_name(src.name)
    target = src_step if step is None else step
    if target is None:
        raise CheckpointError(f"{src}: cannot tell the checkpoint's step; pass fork(..., step=N)")
    state = restore(src)
    provenance: dict[str, Any] = {
        "path": str(src.resolve()),
        "step": src_step,
        "time": time.time(),
        "hostname": meta.get("hostname"),
        "git_commit": meta.get("git_commit"),
    }
    if "forked_from" in meta:
        provenance["parent"] = meta["forked_from"]
    cwd = os.getcwd()
    run = Provenance(cwd, git_commit(cwd))  # a new run, whose parent is the source
    run.continued_from(src_step, meta, src)
    with CheckpointManager(new_root, save=never(), keep=keep_all()) as mgr:
        if existing := mgr.steps():
            raise CheckpointExists(
                f"{mgr.root}: already holds checkpoints (steps {existing[:5]}…); fork into "
                "an empty root"
            )
        run.run = mgr._run.run
        record = dict(head.record.raw)
        for key in ("save", "export", "policy_state", "export_policy_state"):
            record.pop(key, None)  # a new run: its policies start fresh
        record.update(step=target, running_time=0.0)
        user = {k: v for k, v in meta.items() if k not in AUTO_KEYS and k != MANAGER_KEY}
        user["forked_from"] = provenance
        metadata = {**run.metadata(record, {}), **user}
        metadata[MANAGER_KEY] = record
        path = mgr.path(target)
        save(path, state, metadata=metadata, overwrite=path.exists(), base=src)
        return path
