"""The run a root holds: a random id recorded in every checkpoint, so a tier outside the
root (RAM) is resumed only when it holds this run's (no leading dot: ``rm -rf ckpt/*``
starts a new run), an owner-only secret naming the memory tier's folder, and where its
trunk was cut (a tier a move of the trunk did not reach never resumes what it left)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from functional_ckpt._src.storage import durable, opener
from functional_ckpt.errors import CheckpointError

#: In a root: its run's id and the secret naming its memory tier's folder.
RUN_FILE = "run.json"


#: Where a run's trunk was cut (a rollback, a delete, a restore saved on from): its
#: checkpoints above ``above`` (up to ``upto``; None: all) saved before the cut left the
#: trunk; "before" by how many cuts each records, never by a clock (docs/tiered.md).
Cut = tuple[int, int | None]


@dataclass(frozen=True)
class Run:
    """A root's run: ``id`` recorded in every checkpoint; ``secret`` names its RAM folder;
    ``lineage``: the runs its checkpoints continue, once it has any (its own deletions
    never make another run's checkpoints its own), ``until`` and ``until_time`` where it
    left each (the step, and the save time its checkpoint there records); ``cuts``: where
    its own trunk was cut, for good (see :data:`Cut`)."""

    id: str
    secret: str
    lineage: tuple[str, ...] = ()
    until: dict[str, int] = field(default_factory=dict)
    until_time: dict[str, float] = field(default_factory=dict)
    cuts: tuple[Cut, ...] = ()


def read_run(root: Path) -> Run | None:
    """The run recorded in ``root``; None where none is (or none to trust)."""
    doc = opener.read_state(root / RUN_FILE, "run record")
    if not isinstance(doc, dict):
        return None
    rid, secret = doc.get("run"), doc.get("secret")
    if not (isinstance(rid, str) and rid and isinstance(secret, str) and secret):
        return None
    found = doc.get("lineage")
    lineage = tuple(r for r in found if isinstance(r, str)) if isinstance(found, list) else ()
    until, times = numbers(doc.get("until"), int), numbers(doc.get("until_time"), float)
    return Run(rid, secret, lineage, until, times, cuts_of(doc.get("cuts"), root / RUN_FILE))


def cuts_of(found: object, where: object = RUN_FILE) -> tuple[Cut, ...]:
    """The recorded cuts, in order. A damaged record is refused, never read as none: each
    cut decides what no tier may resume."""
    entries = [] if found is None else found
    if isinstance(entries, list | tuple):
        cuts = [c for c in entries if isinstance(c, list | tuple) and len(c) == 2]
        ints = all(
            type(a) is int and a >= -1 and (b is None or (type(b) is int and b > a))
            for a, b in cuts
        )
        if ints and len(cuts) == len(entries):
            return tuple((a, b) for a, b in cuts)
    raise CheckpointError(
        f'{where}: "cuts" is {found!r}, not a list of [step from -1, later step or null]: '
        "where this run's trunk was cut is unknown, so nothing is resumed; restore the file "
        "from a copy, or remove the root's run.json to start a new run"
    )


def add_cut(root: Path, cut: Cut) -> None:
    """Record ``cut`` last in ``root``'s run, if it has one, durably (under the writer's
    lock): each cut counts, as the checkpoints saved after it count them."""
    if (run := read_run(root)) is not None:
        record_run(root, replace(run, cuts=(*run.cuts, cut)))


def numbers(found: object, kind: type) -> dict[str, Any]:
    """The entries of a recorded ``{run: number}`` that are of ``kind`` (none if unrecorded)."""
    return {r: v for r, v in found.items() if type(v) is kind} if isinstance(found, dict) else {}


def open_run(root: Path, *, new_secret: bool = False) -> tuple[Run, bool]:
    """The run of ``root`` (under the writer's lock), made and recorded if there is none;
    and whether it was made now. ``new_secret`` keeps the id, draws a new secret."""
    run = read_run(root)
    made = run is None
    if run is None or new_secret:
        run = replace(run or Run(secrets.token_hex(16), ""), secret=secrets.token_hex(16))
        record_run(root, run)
    return run, made


def record_run(root: Path, run: Run) -> None:
    """Write ``run`` as ``root``'s (under the writer's lock), crash-safely, owner-only."""
    path = root / RUN_FILE
    doc: dict[str, Any] = {"run": run.id, "secret": run.secret, "lineage": list(run.lineage)}
    doc |= {"until": run.until, "until_time": run.until_time, "cuts": [list(c) for c in run.cuts]}
    try:
        durable.replace_durably(path, json.dumps(doc).encode(), mode=0o600)
    except OSError as e:  # a directory or a special file in its place: not ours to fix
        raise CheckpointError(f"{path}: cannot record the run ({e.strerror or e})") from e
