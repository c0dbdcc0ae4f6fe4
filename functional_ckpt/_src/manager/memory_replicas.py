"""The memory tier across nodes: every rank's shard file also held in other failure domains.

Each node's folder is kept (locked, pruned, committed) by its lowest rank. A save of
step N is written into ``.replicating/step_N`` of each folder; then, off the training
thread, each rank sends its shard file to its *holders* (the same local rank on the
next ``replicas - 1`` domains) and the coordinator its small files to every folder;
once every rank confirmed, each keeper renames it ``step_N``: a step committed
anywhere was complete everywhere. Resume takes the newest step of one history whose
files are all held somewhere, gathers it into every folder, and only then reads it.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.replication import Move, transfer
from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.naming import (
    COMMIT_MARKER,
    DCP_METADATA,
    MANIFEST,
    parse_part,
    parse_shard,
    shard_name,
    step_name,
)
from functional_ckpt._src.log import warn
from functional_ckpt._src.manager.memory_folder import own_folder
from functional_ckpt._src.root.listing import StepInfo, committed_steps, read_info
from functional_ckpt._src.storage import commit, durable, ram
from functional_ckpt._src.storage.committed import check_committed
from functional_ckpt._src.storage.verify import verify
from functional_ckpt.errors import CheckpointError, MemoryTierWarning, RankFailed, is_damage

__all__ = ["STAGING", "ReplicaLayout", "Replicas", "holders_of", "layout_of"]

T = TypeVar("T")

#: In each folder: where a step is written and replicated before it is committed.
STAGING = ".replicating"


def _coordinator_files(staging: Path) -> list[str]:
    """What every folder gets from the coordinator, the commit marker last."""
    parts = sorted(n for n in os.listdir(staging) if parse_part(n) is not None)
    return [MANIFEST, *parts, DCP_METADATA, COMMIT_MARKER]


@dataclass(frozen=True)
class ReplicaLayout:
    """Who shares which folder and who holds whose files: the same value on every rank."""

    folders: tuple[int, ...]  # each rank's folder (ranks of one folder share the number)
    domains: tuple[int, ...]  # each rank's failure domain
    replicas: int
    holders: tuple[tuple[int, ...], ...]  # each rank's holders, in other domains

    def keepers(self) -> list[int]:
        """The rank that keeps each folder: the lowest rank sharing it."""
        return sorted({self.folders.index(f) for f in self.folders})


def holders_of(domains: Sequence[Hashable], replicas: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's holders: the rank at its position in each of the next ``replicas - 1``
    domains, in the order of their first ranks."""
    order = list(dict.fromkeys(domains))
    members = {d: [r for r, x in enumerate(domains) if x == d] for d in order}
    out = []
    for r, d in enumerate(domains):
        i, k = order.index(d), members[d].index(r)
        picks = [members[order[(i + j) % len(order)]] for j in range(1, replicas)]
        out.append(tuple(other[k % len(other)] for other in picks))
    return tuple(out)


def _index(values: Sequence[Any]) -> tuple[int, ...]:
    first: dict[Any, int] = {}
    return tuple(first.setdefault(repr(v), len(first)) for v in values)


def layout_of(idents: Sequence[Any], domains: Sequence[Any], replicas: int | None) -> ReplicaLayout:
    """The layout from every rank's folder identity and domain; ``replicas`` checked."""
    folders, doms = _index(idents), _index(domains)
    count = len(set(doms))
    wanted = (2 if count >= 2 else 1) if replicas is None else replicas
    if wanted > count:
        raise CheckpointError(
            f"Memory(replicas={replicas}): only {count} failure domain(s) among "
            f"{len(doms)} ranks ({sorted(set(map(str, domains)))}); a copy per domain is "
            "the most there can be: lower replicas= or give Memory(domain=...)"
        )
    return ReplicaLayout(folders, doms, wanted, holders_of(doms, wanted))


def _default_domain(rank: int) -> int | str:
    """The node of ``rank``: its first rank (from ``LOCAL_RANK``), else the host's name."""
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit():
        return rank - int(local)
    return socket.gethostname()


@dataclass
class Replicas:
    """One rank's share of a distributed memory tier (see the module docstring)."""

    folder: Path
    rank: int
    layout: ReplicaLayout
    group: Any
    #: What the last resume took from where: ``{"step": N, "fetched": {file: rank}}``.
    resumed: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def open(
        cls,
        folder: Path,
        replicas: int | None,
        domain: Callable[[int], int | str] | None,
        *,
        private: bool,
    ) -> Replicas:
        """Every rank, in the same order (groups are made here); each owns the folder."""
        rank = topology().rank
        group = groups.checkpoint_group(purpose="replicate")
        groups.checkpoint_group(purpose="memory")  # the tier's saves (beside the disk's)
        error: BaseException | None = None
        mine: list[Any] = []
        try:
            own_folder(folder, private=private)
            st = os.stat(folder)
            where = domain(rank) if domain is not None else _default_domain(rank)
            if isinstance(where, bool) or not isinstance(where, int | str):
                raise TypeError(
                    f"Memory(domain=...): returned {where!r} for rank {rank}; expected an int "
                    "or a str"
                )
            mine = [[socket.gethostname(), st.st_dev, st.st_ino], where]
        except Exception as e:
            error = e
        every = groups.agree_values(error, mine, group, f"memory tier {folder}")
        lay = layout_of([e[0] for e in every], [e[1] for e in every], replicas)
        return cls(folder, rank, lay, group)

    @property
    def keeper(self) -> bool:
        """Whether this rank keeps its folder (lock, retention, commits)."""
        return self.rank in self.layout.keepers()

    def staging(self, step: int) -> Path:
        return self.folder / STAGING / step_name(step)

    def clear_staging(self) -> None:
        """The keeper removes what an unfinished round left."""
        top = self.folder / STAGING
        if self.keeper and top.is_dir() and not top.is_symlink():
            for name in sorted(os.listdir(top)):
                commit.remove_tree(top / name)

    def replicate(self, step: int, error: BaseException | None) -> None:
        """Phase 2 of a save (every rank): replicas sent, agreed on, committed per folder;
        with ``error`` (this rank's phase 1 failed) nothing is committed anywhere."""
        what, staging, lay = f"memory-tier step {step}", self.staging(step), self.layout
        groups.agree(error, self.group, what)  # and the coordinator committed phase 1
        mine: list[Any] = [-1, []]  # this rank's shard file's size; the coordinator's files
        try:
            if os.path.lexists(staging / shard_name(self.rank)):
                mine[0] = _size(staging / shard_name(self.rank))
            if self.rank == 0:
                mine[1] = [[n, _size(staging / n)] for n in _coordinator_files(staging)]
        except Exception as e:
            error = e
        told = groups.agree_values(error, mine, self.group, what)
        others = [k for k in lay.keepers() if lay.folders[k] != lay.folders[0]]
        moves = self._moves([int(t[0]) for t in told])  # then the small files, marker last
        moves += [Move(0, k, str(n), int(size)) for k in others for n, size in told[0][1]]
        self._transfer(moves, staging, staging, what)  # every part and replica in place
        if self.keeper:  # a folder whose rename fails lacks the step (the others hold it)
            commit.commit_checkpoint(
                staging, self.folder / step_name(step), overwrite=True, sync=False
            )

    def _transfer(self, moves: list[Move], source: Path, target: Path, what: str) -> None:
        """``moves`` from the directory ``source`` into ``target``; all ranks fail together."""
        error: BaseException | None = None
        try:
            transfer(moves, source, target, self.group)
        except Exception as e:
            error = e
        groups.agree(error, self.group, what)

    def _moves(self, sizes: Sequence[int]) -> list[Move]:
        """Each rank's shard file to each of its holders' folders (once per folder)."""
        lay = self.layout
        moves = []
        for r, size in enumerate(sizes):
            if size < 0:
                continue
            done = {lay.folders[r]}
            for h in lay.holders[r]:
                if lay.folders[h] not in done:
                    done.add(lay.folders[h])
                    moves.append(Move(r, h, shard_name(r), size))
        return moves

    def resume(self, above: int | None, world: int, *, verified: bool) -> int | None:
        """Every rank: the newest step newer than ``above`` (any rank's) complete
        somewhere, gathered into every folder; None if there is none.

        A first try takes every file present at its size (the read checks every byte it
        takes); ``verified`` (after a read found damage) takes each file from a copy
        whose every byte passes its checksums.
        """
        mine = [self._held() if self.keeper else [], -1 if above is None else above]
        told = groups.all_gather_values(mine, self.group)
        reports, floor = [t[0] for t in told], max(t[1] for t in told)
        for step in sorted({s for rep in reports for s, *_ in rep}, reverse=True):
            if step <= floor:
                break
            need, holding = _copies(step, reports, self.layout, self.folder)
            saved = {p[0] for n in need if (p := parse_shard(n)) is not None}
            if saved and saved != set(range(world)):
                self._warn(
                    step,
                    f"was saved by {max(saved) + 1} ranks and this run has {world}: the memory "
                    "tier resumes only onto the world size that saved it; falling back to the "
                    "disk tier",
                )
                return None
            wanted = set(need) | {MANIFEST, COMMIT_MARKER}
            if not wanted <= set().union(*holding.values()):
                continue  # some rank's part is nowhere now (its node and its holders lost)
            good = (
                self._intact(step, holding)
                if verified
                else {f: holding.get(f, set()) for f in set(self.layout.folders)}
            )
            missing = wanted - set().union(*good.values())
            if missing:
                self._warn(
                    step,
                    f"has no intact copy of {sorted(missing)} on any rank "
                    "(checksums fail); trying an older step",
                )
                continue
            try:
                fetched = self._reassemble(step, need, wanted, good)
            except CheckpointError as e:
                self._warn(step, f"could not be gathered ({e}); falling back to the disk tier")
                return None
            self.resumed = {"step": step, "fetched": fetched}
            return int(step)
        return None

    def _warn(self, step: int, why: str) -> None:
        warn(f"{self.folder}: memory-tier step {step} {why}", MemoryTierWarning, stacklevel=5)

    def newest(
        self, read: Callable[[Path], T], above: int | None, world: int, stacklevel: int
    ) -> tuple[StepInfo, T] | None:
        """Every rank: the agreed step, gathered into each folder, read by all; a read that
        finds damage (on any rank) is tried once more with every copy checked first."""
        for verified in (False, True):
            step = self.resume(above, world, verified=verified)
            if step is None:
                return None
            path = self.folder / step_name(step)
            error: BaseException | None = None
            found: tuple[StepInfo, T] | None = None
            try:
                found = read_info(path, step), read(path)
            except Exception as err:
                error = err
            damaged = error is not None and (is_damage(error) or isinstance(error, RankFailed))
            said = str(error) if damaged else None
            told = groups.agree_values(
                None if damaged else error, said, self.group, f"restore {path}"
            )
            bad = "; ".join(f"rank {r}: {msg}" for r, msg in enumerate(told) if msg is not None)
            if not bad:
                return found
            then = (
                "falling back to the next tier"
                if verified
                else "every copy is checked and the step gathered again"
            )
            warn(
                f"{path}: memory-tier checkpoint of step {step} is unreadable ({bad}); {then}",
                MemoryTierWarning,
                stacklevel=stacklevel,
            )
        return None

    def _intact(self, step: int, holding: dict[int, set[str]]) -> dict[int, set[str]]:
        """Each folder's files of ``step`` whose every byte passes its checksums (each
        keeper checks its own folder)."""
        good: set[str] = set()
        path = self.folder / step_name(step)
        if self.keeper and self.layout.folders[self.rank] in holding:
            with contextlib.suppress(CheckpointError, OSError):
                bad = {p.file for p in verify(path).problems}
                if None not in bad and MANIFEST not in bad:
                    good = (ram.files_held(path)[1] | {MANIFEST, COMMIT_MARKER}) - bad
        goods = groups.all_gather_values(sorted(good), self.group)
        return {self.layout.folders[k]: set(goods[k]) for k in self.layout.keepers()}

    def _held(self) -> list[list[Any]]:
        """The keeper's committed steps: ``[step, {file: size}, [files present], manifest
        checksum]`` each (copies are of one checkpoint only when their checksums agree)."""
        out: list[list[Any]] = []
        for step, path in committed_steps(self.folder).items():
            with contextlib.suppress(CheckpointError, OSError):
                need, have = ram.files_held(path)
                crc = check_committed(path)["manifest_crc32"]
                out.append([step, need, sorted(have | {MANIFEST, COMMIT_MARKER}), crc])
        return out

    def _reassemble(
        self, step: int, need: dict[str, int], wanted: set[str], good: dict[int, set[str]]
    ) -> dict[str, int]:
        """Each folder gets what it lacks of ``step`` from folders holding it (``good``),
        then its keeper commits it; returns what this rank's folder fetched from whom.
        Every rank fails together."""
        lay, what = self.layout, f"memory-tier step {step}"
        final, build = self.folder / step_name(step), self.staging(step)
        members = {f: [r for r, g in enumerate(lay.folders) if g == f] for f in set(lay.folders)}
        moves: list[Move] = []
        for k in lay.keepers():
            f = lay.folders[k]
            lacking = sorted(wanted - good[f], key=lambda n: (n == COMMIT_MARKER, n))
            for i, name in enumerate(lacking):
                have = [g for g in sorted(good) if name in good[g]]  # spread over the holders
                src = members[have[(k + i) % len(have)]]  # and over the ranks of both folders
                dst = members[f]
                moves.append(Move(src[i % len(src)], dst[i % len(dst)], name, need.get(name, -1)))
        mine = lay.folders[self.rank]
        ours = [m for m in moves if lay.folders[m.dst] == mine]
        error: BaseException | None = None
        sizes: dict[str, int] = {}
        try:
            if ours and self.keeper:
                self.clear_staging()
                durable.make_dirs(build)
                for name in sorted(good.get(mine, set()) - {COMMIT_MARKER}):
                    os.link(final / name, build / name, follow_symlinks=False)
            sizes = {m.name: _size(final / m.name) for m in moves if m.src == self.rank}
        except Exception as e:
            error = e
        told = groups.agree_values(error, sizes, self.group, what)
        moves = [m if m.size >= 0 else replace(m, size=told[m.src][m.name]) for m in moves]
        self._transfer(moves, final, build, what)  # every folder has all it lacked
        try:
            if ours and self.keeper:
                if (final / COMMIT_MARKER).exists() and not (build / COMMIT_MARKER).exists():
                    os.link(final / COMMIT_MARKER, build / COMMIT_MARKER, follow_symlinks=False)
                commit.commit_checkpoint(build, final, overwrite=True, sync=False)
        except Exception as e:
            error = e
        groups.agree(error, self.group, what)
        return {m.name: m.src for m in ours}


def _size(path: Path) -> int:
    return os.stat(path, follow_symlinks=False).st_size


def _copies(
    step: int, reports: Sequence[Sequence[Sequence[Any]]], lay: ReplicaLayout, folder: Path
) -> tuple[dict[str, int], dict[int, set[str]]]:
    """What ``step`` needs and what each folder holds of it. Raises (every rank alike:
    the reports are everyone's) where folders hold two different checkpoints of it: two
    histories that share a step number are never mixed."""
    copies = [
        (lay.folders[r], dict(files), set(have), int(crc))
        for r, rep in enumerate(reports)
        for s, files, have, crc in rep
        if s == step
    ]
    sums: dict[int, list[int]] = {}
    for f, _, _, crc in copies:
        sums.setdefault(crc, []).append(f)
    if len(sums) > 1:
        told = "; ".join(
            f"manifest crc32 {c:#010x} in the folders of ranks {f}" for c, f in sums.items()
        )
        raise CheckpointError(
            f"{folder}: memory-tier step {step} is held as two different checkpoints "
            f"({told}): two histories of this run share the step (a node came back with "
            "the RAM of an older attempt). Refusing to mix them; remove the stale "
            "folder's checkpoints, or the memory tier's folders to resume from the disk"
        )
    return copies[0][1], {f: have for f, _, have, _ in copies}
