"""The memory tier across nodes: every rank's shard file also held in other failure domains.

A save of step N is written into ``.replicating/step_N`` of each node's folder, each
shard file sent to its *holders* (the same local rank on the next ``replicas - 1``
domains), then committed by each folder's keeper (its lowest rank): a step committed
anywhere was complete everywhere. A resume gathers the newest step of one history into
every folder; one plan (:meth:`Replicas._plan`) says who sends what in both.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
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
from functional_ckpt._src.root.listing import StepInfo, read_info
from functional_ckpt._src.save.staging import PendingSave
from functional_ckpt._src.storage import commit, durable, ram
from functional_ckpt._src.storage.committed import check_committed
from functional_ckpt._src.storage.verify import verify
from functional_ckpt.errors import CheckpointError, MemoryTierWarning, RankFailed, is_damage

__all__ = ["STAGING", "ReplicaLayout", "Replicas", "holders_of", "layout_of", "fail_together"]

T = TypeVar("T")

#: In each folder: where a step is written and replicated before it is committed.
STAGING = ".replicating"


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


class Replicas:
    """One rank's share of a distributed memory tier (see the module docstring)."""

    def __init__(
        self,
        folder: Path,
        replicas: int | None,
        domain: Callable[[int], int | str] | None,
        steps: Callable[[], list[int]],
    ) -> None:
        """``steps``: this rank's folder's checkpoints of this run."""
        self.folder, self.rank, self.steps = folder, topology().rank, steps
        self.group = groups.checkpoint_group(purpose="replicate")
        groups.checkpoint_group(purpose="memory")  # the tier's saves (beside the disk's)
        #: What the last resume took from where: ``{"step": N, "fetched": {file: rank}}``.
        self.resumed: dict[str, Any] = {}
        mine: list[Any] = []
        error: BaseException | None = None
        try:
            local = os.environ.get("LOCAL_RANK", "")  # the node's first rank, else its name
            node = self.rank - int(local) if local.isdigit() else socket.gethostname()
            where = domain(self.rank) if domain is not None else node
            if isinstance(where, bool) or not isinstance(where, int | str):
                raise TypeError(
                    f"Memory(domain=...): returned {where!r} for rank {self.rank}; expected "
                    "an int or a str"
                )
            st = os.stat(folder)
            mine = [[socket.gethostname(), st.st_dev, st.st_ino], where]
        except Exception as e:
            error = e
        every = groups.agree_values(error, mine, self.group, f"memory tier {folder}")
        self.layout = layout_of([e[0] for e in every], [e[1] for e in every], replicas)
        self.keeper = self.rank in self.layout.keepers()  # of its folder: lock, retention, commits

    def staging(self, step: int) -> Path:
        return self.folder / STAGING / step_name(step)

    def clear_staging(self) -> None:
        """The keeper removes what an unfinished round left."""
        top = self.folder / STAGING
        if self.keeper and top.is_dir() and not top.is_symlink():
            for name in sorted(os.listdir(top)):
                commit.remove_tree(top / name)

    def replicate(self, step: int, pending: PendingSave | None) -> BaseException | None:
        """Phase 2 of a save (every rank): replicas sent, agreed on, committed per folder (none
        where phase 1, ``pending``, failed); a keeper's failed commit is returned (the others
        hold it)."""
        what, staging, lay = f"memory-tier step {step}", self.staging(step), self.layout
        with fail_together(self.group, what):  # and the coordinator committed phase 1
            if pending is not None:
                pending.result()
        held: dict[str, int] = {}
        error: BaseException | None = None
        try:
            if self.keeper:
                held = {n: os.lstat(staging / n).st_size for n in os.listdir(staging)}
        except Exception as e:
            error = e
        told = groups.agree_values(error, held, self.group, what)
        have = {lay.folders[k]: told[k] for k in lay.keepers()}
        small = {MANIFEST, DCP_METADATA, COMMIT_MARKER}  # the coordinator's, to every folder
        small = {n for n in have[lay.folders[0]] if n in small or parse_part(n) is not None}
        want = {f: set(small) for f in have}
        for r, holders in enumerate(lay.holders):
            if shard_name(r) in have[lay.folders[r]]:
                for h in holders:
                    want[lay.folders[h]].add(shard_name(r))
        transfer(self._plan(want, have), staging, staging, self.group, what)
        try:
            if self.keeper:
                commit.commit_checkpoint(
                    staging, self.folder / step_name(step), overwrite=True, sync=False
                )
        except Exception as e:
            return e
        return None

    def _plan(self, want: dict[int, set[str]], have: dict[int, dict[str, int]]) -> list[Move]:
        """Who sends which file to whom: each folder's lacking ``want``-ed files (in
        :func:`_order`), spread over the folders that ``have`` them and the ranks of both."""
        lay, moves = self.layout, []
        members = {f: [r for r, g in enumerate(lay.folders) if g == f] for f in set(lay.folders)}
        for k in lay.keepers():
            f = lay.folders[k]
            lacking = sorted(want[f] - set(have[f]), key=_order)
            for i, name in enumerate(lacking):
                holding = [g for g in sorted(have) if name in have[g]]
                src, dst = members[holding[(k + i) % len(holding)]], members[f]
                size = have[holding[0]][name]
                moves.append(Move(src[i % len(src)], dst[i % len(dst)], name, size))
        return moves

    def newest(
        self, read: Callable[[Path], T], above: int | None, world: int
    ) -> tuple[StepInfo, T] | None:
        """Every rank: the newest step newer than ``above`` whole somewhere, gathered into
        every folder, each file from a copy at its size (the read checks every byte), read
        by all; a read that finds damage (on any rank) is tried once more, each file from a
        copy passing its checksums."""
        for verified in (False, True):
            mine = [self._held() if self.keeper else [], -1 if above is None else above]
            told = groups.all_gather_values(mine, self.group)
            reports, floor = [t[0] for t in told], max(t[1] for t in told)
            for step in sorted({s for rep in reports for s, *_ in rep}, reverse=True):
                if step <= floor:
                    return None
                need, holding = _copies(step, reports, self.layout, self.folder)
                saved = {p for n in need if (p := parse_part(n)) is not None}  # every rank's
                if saved and saved != set(range(world)):
                    why = f"was saved by {max(saved) + 1} ranks and this run has {world}: the "
                    self._warn(step, why + "memory tier resumes only onto that world size")
                    return None
                if not set(need) <= set().union(*holding.values()):
                    continue  # some rank's part is nowhere now (its node and its holders lost)
                good = self._intact(step, holding) if verified else holding
                missing = set(need) - set().union(*good.values())
                if missing:
                    no = f"has no intact copy of {sorted(missing)} on any rank (checksums fail)"
                    self._warn(step, no, "trying an older step")
                    continue
                try:
                    self.resumed = {"step": step, "fetched": self._reassemble(step, need, good)}
                except CheckpointError as e:
                    self._warn(step, f"could not be gathered ({e})")
                    return None
                break
            else:
                return None
            path, error = self.folder / step_name(step), None
            found: tuple[StepInfo, T] | None = None
            try:
                found = read_info(path, step), read(path)
            except Exception as err:
                error = err
            damaged = error is not None and (is_damage(error) or isinstance(error, RankFailed))
            told = groups.agree_values(
                None if damaged else error, str(error) if damaged else None, self.group, str(path)
            )
            bad = "; ".join(f"rank {r}: {msg}" for r, msg in enumerate(told) if msg is not None)
            if not bad:
                return found
            then = (
                "every copy is checked and the step gathered again",
                "falling back to the next tier",
            )
            self._warn(step, f"is unreadable ({bad})", then[verified])
        return None

    def _warn(self, step: int, why: str, then: str = "falling back to the disk tier") -> None:
        warn(
            f"{self.folder}: memory-tier step {step} {why}; {then}", MemoryTierWarning, stacklevel=8
        )

    def _intact(self, step: int, holding: dict[int, set[str]]) -> dict[int, set[str]]:
        """Each folder's files of ``step`` passing their checksums (each keeper checks its own)."""
        good: set[str] = set()
        path = self.folder / step_name(step)
        if self.keeper and self.layout.folders[self.rank] in holding:
            with contextlib.suppress(CheckpointError, OSError):
                bad = {p.file for p in verify(path).problems}
                if None not in bad and MANIFEST not in bad:
                    good = ram.files_held(path)[1] - bad
        goods = groups.all_gather_values(sorted(good), self.group)
        return {self.layout.folders[k]: set(goods[k]) for k in self.layout.keepers()}

    def _held(self) -> list[list[Any]]:
        """The keeper's steps of this run: ``[step, {file: size}, [files present], manifest
        checksum]`` each (copies are of one checkpoint only when their checksums agree)."""
        out: list[list[Any]] = []
        for step in self.steps():
            path = self.folder / step_name(step)
            with contextlib.suppress(CheckpointError, OSError):
                need, have = ram.files_held(path)
                out.append([step, need, sorted(have), check_committed(path)["manifest_crc32"]])
        return out

    def _reassemble(
        self, step: int, need: dict[str, int], good: dict[int, set[str]]
    ) -> dict[str, int]:
        """Each folder gets what it lacks of ``step`` from those holding it (``good``), its
        keeper commits it; what this rank's folder fetched from whom. All fail together."""
        lay, what, mine = self.layout, f"memory-tier step {step}", self.layout.folders[self.rank]
        final, build = self.folder / step_name(step), self.staging(step)
        have = {f: {n: need[n] for n in good.get(f, ())} for f in set(lay.folders)}
        moves = self._plan({f: set(need) for f in have}, have)
        ours = [m for m in moves if lay.folders[m.dst] == mine]
        with fail_together(self.group, what):
            if ours and self.keeper:
                self.clear_staging()
                durable.make_dirs(build)
                for name in sorted(have[mine]):  # what it holds, linked in; the marker last
                    if name != COMMIT_MARKER:
                        os.link(final / name, build / name, follow_symlinks=False)
        transfer(moves, final, build, self.group, what)  # every folder has all it lacked
        with fail_together(self.group, what):
            if ours and self.keeper:
                if COMMIT_MARKER in have[mine]:
                    os.link(final / COMMIT_MARKER, build / COMMIT_MARKER, follow_symlinks=False)
                commit.commit_checkpoint(build, final, overwrite=True, sync=False)
        return {m.name: m.src for m in ours}


@contextlib.contextmanager
def fail_together(group: Any, what: str) -> Iterator[None]:
    """Where the block fails on any rank of ``group``, it fails on every one (None: this
    process alone)."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as e:
        if group is None:
            raise
        error = e
    if group is not None:
        groups.agree(error, group, what)


def _order(name: str) -> tuple[bool, bool, str]:
    """Shard files first (each rank's to its peer, all at once), the commit marker last."""
    return name == COMMIT_MARKER, parse_shard(name) is None, name


def _copies(
    step: int, reports: Sequence[Sequence[Sequence[Any]]], lay: ReplicaLayout, folder: Path
) -> tuple[dict[str, int], dict[int, set[str]]]:
    """What ``step`` needs and what each folder holds of it; raises (every rank alike) where
    folders hold two different checkpoints of it: two histories are never mixed."""
    copies = [
        (r, dict(files), set(have), int(crc))
        for r, rep in enumerate(reports)
        for s, files, have, crc in rep
        if s == step
    ]
    sums = {crc: [r for r, *_, c in copies if c == crc] for *_, crc in copies}
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
    return copies[0][1], {lay.folders[r]: have for r, _, have, _ in copies}
