"""Rolling a root back to an older step: the newer checkpoints move aside, crash-safely.

The plan is written durably to ``root/.rollback`` before the first move (one atomic
``rename`` each, ascending) and removed last; a writer that finds one finishes it, so
after any crash the rollback has not started or completes at the next open. Newer
checkpoints go to a branch, ``root/branches/<name>`` (a root itself), or are deleted."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from functional_ckpt._src import codec
from functional_ckpt._src.codec import documents
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.kind import is_committed
from functional_ckpt._src.format.naming import BRANCHES_DIR, EXPORTS_DIR, parse_step, step_name
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.run import add_cut
from functional_ckpt._src.storage import durable, opener
from functional_ckpt.errors import CheckpointError, CheckpointExists

#: The durable record of a rollback in progress.
INTENT_FILE = ".rollback"
_BRANCH_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")

Newer = Literal["branch", "delete"]


@dataclass(frozen=True)
class RollbackPlan:
    """One rollback: move ``names`` (``step_N`` directory names) out of the trunk, and cut
    it above ``to_step`` in the run record (so no tier resumes what it left)."""

    to_step: int
    names: list[str]
    newer: Newer
    branch: str | None

    @staticmethod
    def decode(raw: bytes, where: Path) -> RollbackPlan:
        try:
            data = documents.load(raw, str(where))
            branch = None if data["branch"] is None else str(data["branch"])
            names = [str(n) for n in data["names"]]
            plan = RollbackPlan(int(data["to_step"]), names, data["newer"], branch)
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{where}: unreadable rollback record ({exc}); it lists checkpoints to move "
                "aside: inspect it, then finish by hand or remove it"
            ) from None
        if plan.newer not in ("branch", "delete") or (plan.newer == "branch") != bool(plan.branch):
            raise CheckpointError(f"{where}: inconsistent rollback record {raw[:200]!r}")
        for name in plan.names:
            if "/" in name or name.startswith("."):
                raise CheckpointError(f"{where}: rollback record names {name!r}, not a step")
        return plan


def check_branch_name(name: object) -> str:
    if not isinstance(name, str) or _BRANCH_RE.fullmatch(name) is None:
        raise ValueError(
            f"rollback(branch={name!r}): a branch name is 1-100 letters, digits, '_', '.' "
            "or '-', starting with a letter or digit"
        )
    if naming.is_temporary_name(name):
        raise ValueError(f"rollback(branch={name!r}): the name looks like a temporary directory")
    return name


def check_request(newer: object, branch: str | None, reason: object = None) -> None:
    """Refuse a bad ``rollback(newer=..., branch=..., reason=...)`` before anything moves."""
    if newer not in ("branch", "delete"):
        raise ValueError(f"rollback(newer={newer!r}): newer must be 'branch' or 'delete'")
    if newer == "delete" and branch is not None:
        raise ValueError(f"rollback(branch={branch!r}): a branch needs newer='branch'")
    if branch is not None:
        check_branch_name(branch)
    if reason is not None:
        if not isinstance(reason, Mapping):
            raise TypeError(f"rollback(reason={reason!r}): reason must be a dict of plain data")
        codec.check_encodable(dict(reason), where="rollback(reason=...)")


def run(
    root: Path,
    to_step: int,
    newer_steps: list[int],
    newer: Newer,
    branch: str | None,
    reason: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Move ``newer_steps`` (ascending) out of the trunk and cut it above ``to_step``, under
    the caller's writer lock; returns the record later checkpoints list under
    ``metadata["rollbacks"]``."""
    name = branch if newer_steps and newer == "branch" else None  # (new: see new_branch)
    names = [step_name(s) for s in newer_steps]
    plan = RollbackPlan(to_step, names, "branch" if name else "delete", name)
    intent = root / INTENT_FILE
    if intent.exists():
        raise CheckpointError(f"{intent}: a rollback is already in progress; reopen the manager")
    # recorded durably before anything moves: from here on it finishes, even after a crash
    durable.replace_durably(intent, json.dumps(asdict(plan), sort_keys=True).encode())
    finish(root)
    done = {"time": time.time(), "to_step": to_step, "newer_steps": newer_steps, "branch": name}
    return done if reason is None else {**done, "reason": dict(reason)}


def new_branch(
    root: Path, name: str | None, from_step: int, to_step: int, taken: Collection[str] = ()
) -> str:
    """A branch name that does not exist yet, here or in ``taken`` (the remote tier's
    branches): ``name`` itself, which must be new."""
    parent = root / BRANCHES_DIR
    taken = {*taken, *(os.listdir(parent) if parent.is_dir() else ())}
    if name is not None:  # (checked by check_request, before the rollback began)
        if name in taken:
            raise CheckpointExists(
                f"{parent / name}: branch {name!r} already exists (here or on the remote "
                "tier); choose another name"
            )
        return name
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    base = f"step_{from_step}_before_rollback_to_{to_step}_{stamp}"
    candidate, n = base, 1
    while candidate in taken:
        n += 1
        candidate = f"{base}_{n}"
    return candidate


#: Largest rollback intent read back (the names of the steps it moves).
_INTENT_LIMIT = 64 << 20


def finish(root: Path) -> RollbackPlan | None:
    """Complete the rollback recorded in ``root``, if any; the caller holds the lock."""
    intent = root / INTENT_FILE
    for name in os.listdir(root):  # a plan a crash cut short before it was recorded
        if name.startswith(INTENT_FILE + naming.TMP_INFIX):
            os.unlink(root / name)
    try:
        raw = opener.read_file(intent, limit=_INTENT_LIMIT, what="rollback intent")
    except FileNotFoundError:
        return None
    plan = RollbackPlan.decode(raw, intent)
    if plan.newer == "branch":
        assert plan.branch is not None
        target = root / BRANCHES_DIR / plan.branch
        durable.make_dirs(target / EXPORTS_DIR)
        for name in plan.names:
            _move(root / name, target / name)
            _move(root / EXPORTS_DIR / name, target / EXPORTS_DIR / name)
    else:
        for name in plan.names:
            for parent in (root, root / EXPORTS_DIR):
                remove_all(delete(parent, [parent / name]))
    add_cut(root, (plan.to_step, None))  # a tier the moves did not reach (RAM) never resumes them
    os.unlink(intent)
    durable.fsync_dir(root)
    return plan


def _move(src: Path, dst: Path) -> None:
    """One atomic rename, durable in both directories; skipped when already done."""
    if not src.exists():
        return
    if dst.exists():
        raise CheckpointError(
            f"{src}: cannot move it to {dst}, which exists; move one of them by hand and "
            "reopen the manager to finish the rollback"
        )
    os.rename(src, dst)
    durable.fsync_dir(dst.parent)
    durable.fsync_dir(src.parent)


def branches(root: Path) -> dict[str, list[int]]:
    """Each branch of ``root`` with the committed steps it holds, by name."""
    parent = root / BRANCHES_DIR
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return {}
    out: dict[str, list[int]] = {}
    for name in names:
        path = parent / name
        if not path.is_dir() or _BRANCH_RE.fullmatch(name) is None:
            continue
        steps = (parse_step(n) for n in os.listdir(path) if is_committed(path / n))
        out[name] = sorted(s for s in steps if s is not None)
    return out
