"""Every state a power loss could leave during one recorded operation, checked.

From the ops of a :class:`~tests.crash_record.Recorder` (the tree before, then each
call in order) a crash state is: a prefix of the ops (the crash point); of the
directory changes in it not yet made durable by an fsync of their directory after
them, any subset (POSIX orders nothing between barriers, so any may have reached the
disk and any not); of each file whose bytes changed since its last fsync, one of
four contents: the last fsynced bytes, all of them, a torn prefix (the first half
of the new bytes, the old after), or the new size with the new bytes lost (zeros).
Each prefix's choices are enumerated whole when there are few, else sampled
deterministically (the two extremes, every single choice flipped from each, then a
seeded draw), as ALICE and CrashMonkey do.

Each distinct tree is materialised in a scratch directory and held to the commit
protocol's promises (:class:`Oracle`): every checkpoint (or export) name shows
exactly the bytes it had before the operation or exactly those it has after it,
never anything else; only an overwrite without an atomic exchange may leave the
name empty for a moment, its checkpoint then whole in a ``.trash-`` sibling; no
directory nobody committed looks committed; what the root's listing calls committed
restores and verifies (``fc.restore``, ``fc.verify``); and a writing
``CheckpointManager`` opening the root (its leftover recovery) leaves every name
with its old or its new bytes, nothing committed lost.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.root import listing
from tests.crash_record import Recorder
from tests.crash_tree import DATA, META, Op, Tree, scan
from tests.depth import FULL

#: A name that holds nothing.
ABSENT: tuple[tuple[str, str, str], ...] = (("", "absent", ""),)

#: Choices of one prefix enumerated whole up to this many; beyond, this many sampled.
#: By default few: the two extremes and every single flip still reach every crash
#: point, every kind of state and every file's every content (tests/depth.py).
PER_PREFIX = 64 if FULL else 4

#: The four contents of a file with bytes not yet fsynced.
SYNCED, FULL, TORN, ZEROS = range(4)
_CONTENT = ("last fsynced bytes", "every byte written", "a torn prefix", "new size, zeros")


@dataclass
class CrashState:
    point: int  # the ops before it happened
    kept: frozenset[int]  # of the ops not yet durable, those that reached the disk
    contents: dict[int, int]  # file inode -> which content (SYNCED .. ZEROS)
    tree: Tree


@dataclass
class Report:
    operation: str
    ops: int
    states: int = 0  # crash states enumerated
    distinct: int = 0  # distinct trees materialised and checked
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.operation}: {self.ops} ops, {self.ops + 1} crash points, {self.states} "
            f"crash states, {self.distinct} distinct trees checked, "
            f"{len(self.failures)} violations"
        )


def _contents(synced: bytes, full: bytes) -> list[bytes]:
    """The contents a power loss may leave of a file: ``SYNCED``, ``FULL``, ``TORN``, ``ZEROS``."""
    lo = next((i for i, (a, b) in enumerate(zip(synced, full, strict=False)) if a != b), None)
    lo = min(len(synced), len(full)) if lo is None else lo
    mid = lo + (len(full) - lo) // 2
    return [synced, full, full[:mid] + synced[mid:], synced[:lo] + b"\0" * (len(full) - lo)]


def crash_states(rec: Recorder, seed: int = 0) -> Iterator[CrashState]:
    """Every crash state of the recording (sampled per prefix where there are many)."""
    ops = rec.ops
    skeleton = rec.before.copy()
    for ino, kind in rec.live.kinds.items():
        if ino not in skeleton.kinds:
            skeleton.kinds[ino] = kind
            if kind == "d":
                skeleton.entries[ino] = {}
            elif kind == "f":
                skeleton.data[ino] = b""
            else:
                skeleton.targets[ino] = rec.live.targets[ino]
    waiting: dict[int, set[int]] = {}  # meta op index -> directories still to be fsynced
    synced_at: dict[int, int] = {}  # file inode -> index of its last fsync
    for point in range(len(ops) + 1):
        if point:
            op = ops[point - 1]
            if op.kind in META:
                waiting[point - 1] = set(op.dirs)
            elif op.kind == "fsync":
                if skeleton.kinds[op.ino] == "d":
                    for left in waiting.values():
                        left.discard(op.ino)
                    for i in [i for i, left in waiting.items() if not left]:
                        del waiting[i]
                else:
                    synced_at[op.ino] = point - 1
        pending = sorted(waiting)
        files = _dirty_files(skeleton, ops[:point], synced_at)
        durable = _durable_data(skeleton, ops[:point], files)
        rng = random.Random(seed * 100_003 + point)
        for bits, picks in _choices(len(pending), len(files), rng):
            kept = frozenset(i for i, b in zip(pending, bits, strict=True) if b)
            tree = skeleton.copy()
            for i, op in enumerate(ops[:point]):
                if op.kind in META and (i not in waiting or i in kept):
                    tree.apply(op)
            contents = {}
            for (ino, variants), pick in zip(files.items(), picks, strict=True):
                contents[ino] = pick
                tree.data[ino] = variants[pick]
            tree.data.update(durable)
            yield CrashState(point, kept, contents, tree)


def _dirty_files(
    skeleton: Tree, done: list[Op], synced_at: dict[int, int]
) -> dict[int, list[bytes]]:
    """Each file whose bytes changed since its last fsync: its four possible contents."""
    out: dict[int, list[bytes]] = {}
    for ino in sorted({op.ino for op in done if op.kind in DATA}):
        synced, full = Tree(data={ino: skeleton.data[ino]}), Tree(data={ino: skeleton.data[ino]})
        for i, op in enumerate(done):
            if op.kind in DATA and op.ino == ino:
                full.apply(op)
                if i < synced_at.get(ino, -1):
                    synced.apply(op)
        if synced.data[ino] != full.data[ino]:
            out[ino] = _contents(synced.data[ino], full.data[ino])
    return out


def _durable_data(
    skeleton: Tree, done: list[Op], dirty: dict[int, list[bytes]]
) -> dict[int, bytes]:
    """The bytes of every file written and fsynced since, with nothing left to lose."""
    full = Tree(data=dict(skeleton.data))
    for op in done:
        if op.kind in DATA and op.ino not in dirty:
            full.apply(op)
    return {ino: data for ino, data in full.data.items() if ino not in dirty}


def _choices(
    metas: int, files: int, rng: random.Random
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The choices of one prefix: all where few, else extremes, single flips and a draw."""
    total = 2**metas * 4**files
    if total <= PER_PREFIX:
        for bits in itertools.product((0, 1), repeat=metas):
            for picks in itertools.product(range(4), repeat=files):
                yield bits, picks
        return
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    low, high = ((0,) * metas, (SYNCED,) * files), ((1,) * metas, (FULL,) * files)
    wanted = [low, high]
    for base, flip_bit in ((low, 1), (high, 0)):
        for i in range(metas):
            bits = list(base[0])
            bits[i] = flip_bit
            wanted.append((tuple(bits), base[1]))
        for j in range(files):
            for v in (FULL, TORN, ZEROS) if base is low else (SYNCED, TORN, ZEROS):
                picks = list(base[1])
                picks[j] = v
                wanted.append((base[0], tuple(picks)))
    while len(wanted) < 2 * PER_PREFIX + metas + files:
        wanted.append(
            (
                tuple(rng.randrange(2) for _ in range(metas)),
                tuple(rng.randrange(4) for _ in range(files)),
            )
        )
    for choice in wanted:
        if choice not in seen:
            seen.add(choice)
            yield choice


def materialise(tree: Tree, dest: Path) -> None:
    """Write ``tree`` at ``dest`` (which must not exist); hard links stay hard links."""
    made: dict[int, Path] = {}
    dest.mkdir()
    for rel, ino in tree.walk():
        path = dest / rel
        kind = tree.kinds[ino]
        if ino in made and kind == "f":
            os.link(made[ino], path)
        elif kind == "d":
            path.mkdir()
        elif kind == "l":
            path.symlink_to(tree.targets[ino])
        else:
            path.write_bytes(tree.data.get(ino, b""))
        made.setdefault(ino, path)


def describe(rec: Recorder, state: CrashState) -> str:
    """The operation sequence as the crash left it, for a failure."""
    lines = [f"crash after op {state.point} of {len(rec.ops)}:"]
    for i, op in enumerate(rec.ops):
        if i >= state.point:
            mark = "  never ran "
        elif op.kind in META:
            mark = (
                "  on disk   " if i in state.kept or not _waiting(rec, state, i) else "  LOST      "
            )
        else:
            mark = "  ran       "
        lines.append(f"{mark}[{i:3d}] {op.text}")
    for ino, pick in sorted(state.contents.items()):
        lines.append(f"  file {rec.names.get(ino, ino)}: {_CONTENT[pick]}")
    return "\n".join(lines)


def _waiting(rec: Recorder, state: CrashState, index: int) -> bool:
    """Whether meta op ``index`` was still waiting for a directory fsync at the crash."""
    left = set(rec.ops[index].dirs)
    for op in rec.ops[index + 1 : state.point]:
        if op.kind == "fsync":
            left.discard(op.ino)
    return bool(left)


class Oracle:
    """The promises of the commit protocol, for one operation's before and after trees."""

    def __init__(self, before: Tree, after: Tree) -> None:
        self.names: dict[str, set[tuple[tuple[str, str, str], ...]]] = {}
        for tree in (before, after):
            for rel in _guarded(tree):
                self.names[rel] = {_shape(before, rel), _shape(after, rel)}
        self.after = {rel: _shape(after, rel) for rel in self.names}
        # checkpoints the operation keeps, wherever it moves them (a rollback's branch)
        now = {_shape(after, rel) for rel in _guarded(after)}
        self.kept = {_shape(before, rel) for rel in _guarded(before)} & now
        self._readable: dict[tuple[tuple[str, str, str], ...], str | None] = {}

    def check(self, root: Path, *, returned: bool = False) -> list[str]:
        """The promises for the tree at ``root``; ``returned``: the crash came after the
        operation returned, so its result must be durable (only the new bytes allowed)."""
        problems = self._names(root, recovered=False)
        if returned:
            tree = scan(root)
            problems += [
                f"{rel}: not what the operation left, though it had returned"
                for rel, shape in sorted(self.after.items())
                if _shape(tree, rel) != shape
            ]
        for step, path in sorted(listing.committed_steps(root).items()):
            rel = path.relative_to(root).as_posix()
            if _shape(scan(root), rel) not in self.names.get(rel, set()) - {ABSENT}:
                problems.append(f"the listing shows step {step} ({rel}) as committed, torn")
        if problems:
            return problems
        try:
            with fc.CheckpointManager(root) as mgr:
                mgr.steps()
        except Exception as e:  # any failure to open is a finding, shown with the ops
            return [f"a writing manager could not open the root: {type(e).__name__}: {e}"]
        return [f"after a manager opened the root: {p}" for p in self._names(root, recovered=True)]

    def _names(self, root: Path, *, recovered: bool) -> list[str]:
        tree = scan(root)
        out = []
        for rel, allowed in sorted(self.names.items()):
            now = _shape(tree, rel)
            if now not in allowed:
                if now == ABSENT and not recovered and _kept_aside(tree, rel, allowed):
                    continue
                what = "gone" if now == ABSENT else "neither its old nor its new bytes"
                out.append(f"{rel}: {what}")
            elif now != ABSENT:
                problem = self._read(root / rel, now)
                if problem:
                    out.append(f"{rel}: {problem}")
        out += [
            f"{rel}: looks committed, yet no operation committed it"
            for rel in _guarded(tree)
            if rel not in self.names
        ]
        if recovered and self.kept - {_shape(tree, rel) for rel in _guarded(tree)}:
            out.append("a checkpoint the operation keeps (or moves) is nowhere to be found")
        return out

    def _read(self, path: Path, shape: tuple[tuple[str, str, str], ...]) -> str | None:
        """Restore and verify a checkpoint (once per distinct content)."""
        if not (path / naming.COMMIT_MARKER).exists():
            return None  # an export: its bytes were compared whole
        if shape not in self._readable:
            try:
                fc.restore(path)
                report = fc.verify(path)
                self._readable[shape] = None if report.ok else f"fc.verify: {report}"
            except fc.CheckpointError as e:
                self._readable[shape] = f"fc.restore: {type(e).__name__}: {e}"
        return self._readable[shape]


def _guarded(tree: Tree) -> list[str]:
    """Directories that a reader takes for a checkpoint or an export (by name, not temporary)."""
    out = []
    for rel, ino in tree.walk():
        if tree.kinds[ino] != "d" or naming.is_temporary_name(os.path.basename(rel)):
            continue
        names = tree.entries[ino]
        if naming.COMMIT_MARKER in names or "model.safetensors" in names:
            out.append(rel)
    return out


def _shape(tree: Tree, rel: str) -> tuple[tuple[str, str, str], ...]:
    ino = tree.lookup(rel)
    if ino is None:
        return ABSENT
    return (("", tree.kinds[ino], ""), *tree.shape(ino))


def _kept_aside(tree: Tree, rel: str, allowed: set[tuple[tuple[str, str, str], ...]]) -> bool:
    """Whether a ``.trash-``/``.tmp-`` sibling holds one of the name's allowed checkpoints."""
    parent, _, name = rel.rpartition("/")
    prefix = f"{parent}/" if parent else ""
    siblings = tree.entries.get(tree.lookup(parent) or 0, {}) if parent else tree.entries[0]
    return any(
        other.startswith(name + ".") and _shape(tree, prefix + other) in allowed - {ABSENT}
        for other in siblings
    )


def explore(operation: str, rec: Recorder, scratch: Path, *, seed: int = 0) -> Report:
    """Check every crash state of ``rec``; a violation carries the op sequence."""
    report = Report(operation, len(rec.ops))
    oracle = Oracle(rec.before, rec.live)
    seen: set[tuple[bool, tuple[tuple[str, str, str], ...]]] = set()
    for state in crash_states(rec, seed):
        report.states += 1
        key = (state.point == len(rec.ops), state.tree.shape())
        if key in seen:
            continue
        seen.add(key)
        report.distinct += 1
        where = scratch / f"state-{report.distinct}"
        materialise(state.tree, where)
        problems = oracle.check(where, returned=state.point == len(rec.ops))
        shutil.rmtree(where)
        if problems:
            report.failures.append("\n".join([*problems, describe(rec, state)]))
    return report
