"""``Memory``: the memory tier as one option value (checked where the user writes it), and
its folder in RAM, verified at every open and tied to its run by a mark, never by a path,
so no other user can plant or block it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_ckpt._src import codec
from functional_ckpt._src.format.dcp_values import MAX_VALUE_BYTES
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.log import warn
from functional_ckpt._src.policy.base import SavePolicy
from functional_ckpt._src.policy.leaves import every_steps
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.root.listing import committed_steps
from functional_ckpt._src.root.run import RUN_FILE, Run, open_run
from functional_ckpt._src.state.tree import State, leaves_of
from functional_ckpt._src.storage import durable, opener, ram, usage
from functional_ckpt.errors import CheckpointError, MemoryTierWarning

__all__ = ["Memory", "OverBudget", "adopt", "check_budget", "claim_folder", "resolve_budget"]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return _int(v) or isinstance(v, float)


#: What each field must be, as its error says.
_EXPECTED = {
    "path": "a directory path or None",
    "save": "a SavePolicy",
    "keep": "fc.keep_last(1) or fc.keep_last(2) (a bare 1 or 2 is short for them)",
    "budget": "bytes (an int > 0) or a fraction of the available memory (a float in (0, 1])",
    "promote_on": "a tuple of signal numbers that can be handled",
    "promote_within": "a number of seconds > 0",
    "replicas": "a number of copies >= 1 (or None: 2 where there are two failure domains)",
    "domain": "a function of a rank, returning its failure domain (an int or a str)",
    "async_save": "a bool",
    "incremental": "a bool",
}


@dataclass(frozen=True)
class Memory:
    """Checkpoint into RAM on a policy of its own (default: every step), above the disk tier.

    A folder in RAM (``path``; by default one per run under ``/dev/shm``) holds the
    newest ``keep`` (``keep_last(1)`` or ``keep_last(2)``; a bare 1 or 2 is short for
    them) checkpoints in the ordinary format, without fsync: it survives a crash of the
    process, not a reboot. ``budget`` caps its RAM: bytes, or a fraction of the memory
    available. On a signal of ``promote_on`` its newest checkpoint is copied to the disk
    tier within ``promote_within`` seconds. Under ``torch.distributed`` each rank's
    files are also held by ``replicas - 1`` other failure domains (``domain(rank)``,
    by default its node). See docs/tiered.md.
    """

    path: str | os.PathLike[str] | None = None
    save: SavePolicy = field(default_factory=lambda: every_steps(1))
    keep: int | RetentionPolicy = 2
    budget: int | float = 0.5
    promote_on: tuple[int, ...] = (int(signal.SIGTERM),)
    promote_within: float = 60.0
    async_save: bool = True
    incremental: bool = True
    replicas: int | None = None
    domain: Callable[[int], int | str] | None = None

    @property
    def held(self) -> int:
        """How many checkpoints the tier holds (0 where ``keep`` says no count)."""
        n: Any = self.keep
        if isinstance(n, RetentionPolicy):
            spec = n.spec
            n = spec.get("keep_last", {}).get("n") if isinstance(spec, dict) else None
        return n if _int(n) else 0

    def __post_init__(self) -> None:
        b, w, r, sig = self.budget, self.promote_within, self.replicas, self.promote_on
        handled = set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}
        sigs = isinstance(sig, tuple) and all(map(_int, sig))
        ok = {  # field: (of a right type, of a right value)
            "path": (self.path is None or isinstance(self.path, str | os.PathLike), True),
            "save": (isinstance(self.save, SavePolicy), True),
            "keep": (True, self.held in (1, 2)),
            "budget": (_num(b), _num(b) and (0 < b <= 1 if isinstance(b, float) else b > 0)),
            "promote_on": (sigs, sigs and set(sig) <= handled),
            "promote_within": (True, _num(w) and w > 0),
            "replicas": (r is None or _int(r), r is None or (_int(r) and r >= 1)),
            "domain": (self.domain is None or callable(self.domain), True),
            "async_save": (isinstance(self.async_save, bool), True),
            "incremental": (isinstance(self.incremental, bool), True),
        }
        for name, (right_type, right_value) in ok.items():
            if not (right_type and right_value):
                raise (ValueError if right_type else TypeError)(
                    f"Memory({name}={getattr(self, name)!r}): expected {_EXPECTED[name]}"
                )


class OverBudget(CheckpointError):
    """A memory-tier save that would not fit the tier's budget (it is skipped)."""


def resolve_budget(option: Memory, folder: Path) -> int:
    """The tier's budget in bytes, against what ``folder`` can take now (a crashed run's
    checkpoints count as room: they are pruned at the next save)."""
    held = usage.disk_bytes([Path(d) for d, _, _ in os.walk(folder)])  # each inode once
    room = ram.available_bytes(folder) + held
    budget = option.budget
    if isinstance(budget, float):
        return int(room * budget)
    if budget > room:
        raise CheckpointError(
            f"Memory(budget={budget}): {folder} can take at most {room} bytes now "
            "(free space there, capped by the memory available); lower the budget or "
            "give the tier a larger folder with Memory(path=...)"
        )
    return budget


#: A checkpoint's bytes beside its leaves', at most: a leaf's manifest and ``.metadata`` entries
#: (its key four times), a tensor's zip framing, a value's DCP byte entry; its files' pages.
OVERHEAD = {"tensor": 700, "value": 1400, "node": 64, "checkpoint": 16 << 10}


def check_budget(option: Memory, budget: int, folder: Path, state: State) -> None:
    """Refuse ``keep`` checkpoints of this very state over ``budget``, counted as stored (each
    leaf with its entries; no value encoded), checked at every save: a state grows (Adam's
    moments, at step one), and one of many small leaves is mostly their entries."""
    need = OVERHEAD["checkpoint"]
    for path, kind, v in leaves_of(state):
        need += OVERHEAD[kind] + 4 * len("".join(path))
        if kind == "tensor":
            need += v.nbytes
        elif kind == "value":
            size = _encoded(v, path)  # in the manifest, and a small one as a DCP byte entry
            need += size + (size if size <= MAX_VALUE_BYTES else 0)
    need *= option.held
    if need > budget:
        raise OverBudget(
            f"Memory(budget={option.budget!r}): {option.held} checkpoint(s) of "
            f"this state need {need} bytes in {folder}, more than the budget of "
            f"{budget} bytes; the memory tier skips every save that does not fit (said "
            "once). Raise budget=, lower keep= (1 holds one checkpoint), or leave it out"
        )


def _encoded(v: Any, path: KeyPath) -> int:
    """A value's encoded bytes, at most: from its length or ``nbytes`` (a container's from its
    items), encoded only where it is of another kind."""
    if v is None or isinstance(v, bool | float) or (isinstance(v, int) and abs(v) < 1 << 63):
        return 9
    if isinstance(v, str | bytes | bytearray):
        return 9 + (len(v) if not isinstance(v, str) or v.isascii() else 4 * len(v))
    if isinstance(getattr(v, "nbytes", None), int):  # a numpy array or scalar
        return 128 + int(v.nbytes)
    if isinstance(v, list | tuple | set | frozenset):
        return 9 + sum(_encoded(x, path) for x in v)
    if isinstance(v, dict):
        return 9 + sum(_encoded(k, path) + _encoded(x, path) for k, x in v.items())
    return len(codec.encode(v, where=f"state[{format_path(path)}]"))


#: In the tier's folder: the root and the run it belongs to.
MARK_FILE = ".memory-tier.json"
_SHM = Path("/dev/shm")


def claim_folder(
    path: str | os.PathLike[str] | None, root: Path, run: Run, *, retry: bool
) -> tuple[Path, Run]:
    """The tier's folder, verified (:func:`_own`), and the run as it now is. The default,
    ``/dev/shm/fckpt-<uid>-<secret>`` (the secret in the owner-only run record), planted
    by another user is left alone and (``retry``) a new secret drawn."""
    if path is not None:
        _check_apart(Path(path), root)
        _own(Path(path), private=False)
        return Path(path), run
    if not (run.secret.isascii() and run.secret.isalnum()):  # one name, as drawn
        raise CheckpointError(
            f'{root / RUN_FILE}: its "secret" ({run.secret!r}) is not the word of letters '
            "and digits that names the memory tier's folder (edited by hand, or damaged); "
            "put back the one it had, or give the tier a folder with Memory(path=...)"
        )
    if not _SHM.is_dir():
        raise CheckpointError(
            f"CheckpointManager({root}, memory=fc.manager.Memory()): this machine has no "
            "/dev/shm; give the tier a folder in RAM with Memory(path=...)"
        )
    try:
        _own(_SHM / f"fckpt-{os.getuid()}-{run.secret}", private=True)
    except CheckpointError as e:
        if not retry:
            raise
        warn(f"{e}; it is left alone, a new one used", MemoryTierWarning, stacklevel=6)
        run = open_run(root, new_secret=True)[0]
        _own(_SHM / f"fckpt-{os.getuid()}-{run.secret}", private=True)
    return _SHM / f"fckpt-{os.getuid()}-{run.secret}", run


def _own(folder: Path, *, private: bool) -> None:
    """Make ``folder`` (0700) if missing; refuse it unless this user's directory, not a link,
    not writable by others (``private``: no access at all)."""
    with contextlib.suppress(FileExistsError):
        if not private:
            durable.make_dirs(folder.parent)
        os.mkdir(folder, 0o700)
    st = os.lstat(folder)
    mask = 0o077 if private else 0o022
    bad = [
        (stat.S_ISLNK(st.st_mode), "is a link"),
        (not stat.S_ISDIR(st.st_mode), "is not a directory"),
        (st.st_uid != os.getuid(), f"belongs to another user (uid {st.st_uid})"),
        (st.st_mode & mask, f"is open to other users (mode {stat.S_IMODE(st.st_mode):o})"),
    ]
    why = next((w for b, w in bad if b), None)
    if why is not None:
        raise CheckpointError(
            f"Memory(path={str(folder)!r}): the folder {why}; a memory tier's folder must be "
            "a directory of this user's that no other user can write (chmod go-w), not a link"
        )


#: Directories below a memory folder searched for a root, at most (a larger tree is refused).
SEARCHED = 1000


def _check_apart(folder: Path, root: Path) -> None:
    """Refuse a folder inside or around any root, at any depth (retention there deletes the
    other's), or too large a tree to search (links are not followed)."""
    a, b = os.path.realpath(folder), os.path.realpath(root)
    inside = [p for p in Path(a).parents if (p / RUN_FILE).exists()]
    around: list[Path] = []

    def unsearched(e: OSError) -> None:  # a folder not made yet is no tree to search
        if not isinstance(e, FileNotFoundError):
            why = f"{e.filename} cannot be searched for a checkpoint root ({e.strerror or e})"
            raise CheckpointError(f"Memory(path={str(folder)!r}): {why}; make it readable")

    for n, (here, _, files) in enumerate(os.walk(a, onerror=unsearched)):
        if n == SEARCHED:
            raise CheckpointError(
                f"Memory(path={str(folder)!r}): more than {SEARCHED} directories below it "
                "to search for a checkpoint root; give the memory tier a folder of its own"
            )
        around += [Path(here)] if RUN_FILE in files else []
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep) or inside or around:
        raise CheckpointError(
            f"Memory(path={str(folder)!r}): the memory tier's folder must be apart from the "
            f"disk root {root} and from any other root ({', '.join(map(str, inside + around))}"
            "): neither inside the other"
        )


def adopt(folder: Path, root: Path, run: Run) -> None:
    """Mark ``folder`` as this run's; refuse (never empty) one holding another's checkpoints."""
    mine = {"root": os.path.realpath(root), "run": run.id}
    theirs = opener.read_state(folder / MARK_FILE, "memory tier mark")
    if theirs == mine:
        return
    held = sorted(committed_steps(folder))
    if held:
        whose = (
            f"run {theirs.get('run')} of {theirs.get('root')}"
            if isinstance(theirs, dict)
            else "no memory tier of a known run"
        )
        raise CheckpointError(
            f"Memory(path={str(folder)!r}): the folder holds checkpoints (steps {held}) of "
            f"{whose}, not of this run ({run.id} of {root}); they are left as they are. "
            "Remove them, or give the tier another folder"
        )
    durable.replace_durably(folder / MARK_FILE, json.dumps(mine).encode(), sync=False)


def report_orphans(root: Path, run: Run) -> None:
    """Warn of this user's folders of an earlier run of ``root`` (``run`` was made now, with a
    memory tier or not): never resumed, never removed (the only copy of their steps, maybe)."""
    real = os.path.realpath(root)
    with contextlib.suppress(OSError):
        for path in _SHM.glob(f"fckpt-{os.getuid()}-*"):
            mark: Any = opener.read_state(path / MARK_FILE, "memory tier mark")
            if not isinstance(mark, dict) or mark.get("root") != real or mark.get("run") == run.id:
                continue
            held = sorted(committed_steps(path))
            if held:
                warn(
                    f"{path}: memory-tier checkpoints (steps {held}) of an earlier run "
                    f"of {root} ({mark.get('run')}), whose run record is gone from the root; "
                    f"a new run starts and they are not resumed. Free its RAM with rm -rf {path}",
                    MemoryTierWarning,
                    stacklevel=3,
                )
