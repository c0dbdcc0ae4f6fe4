"""The memory tier across nodes: every rank's shard files also held in other failure domains.

Under ``torch.distributed`` each node has a folder of its own, shared by its ranks;
the lowest rank of a folder *keeps* it (its lock, retention and commits). A save of
step N runs in two phases:

1. every rank writes, through DCP's planners, into ``.replicating/step_N`` of its
   folder: the coordinator's folder holds the manifest, the others their ranks'
   parts (nothing there is a checkpoint any reader lists);
2. off the training thread, each rank sends its shard file to its *holders* (the
   same local rank on the next ``replicas - 1`` domains, as NVIDIA's resiliency
   extension forms its cliques) and the coordinator its manifest, ``.metadata`` and
   marker to every folder; once every rank confirmed its part and all its replicas
   (:func:`~..distributed.groups.agree`), each keeper renames its directory to
   ``step_N``.

So a step committed in any folder was complete everywhere it should be; a crash
before the agreement leaves no folder with the step. Resume takes the newest step
whose files are all held somewhere (each checked byte for byte against the
manifest's checksums), reassembles it in every folder from the holders of what a
folder lacks, and only then do the ranks read it, all the same step.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src import codec
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
from functional_ckpt._src.root.listing import committed_steps
from functional_ckpt._src.storage import commit, durable, opener, ram
from functional_ckpt._src.storage.committed import check_committed
from functional_ckpt._src.storage.verify import verify
from functional_ckpt.errors import CheckpointError, MemoryTierWarning, RankFailed, is_damage

__all__ = ["STAGING", "ReplicaLayout", "Replicas", "holders_of", "layout_of"]

T = TypeVar("T")

#: In each folder: where a step is written and replicated before it is committed.
STAGING = ".replicating"


def _coordinator_files(staging: Path) -> list[str]:
    """What every folder gets from the coordinator: the manifest (its index and every
    rank's part, where it is split), ``.metadata``, and the commit marker last."""
    parts = sorted(n for n in os.listdir(staging) if parse_part(n) is not None)
    return [MANIFEST, *parts, DCP_METADATA, COMMIT_MARKER]


@dataclass(frozen=True)
class ReplicaLayout:
    """Who shares which folder and who holds whose files: the same value on every rank."""

    folders: tuple[int, ...]  # each rank's folder (ranks of one folder share the number)
    domains: tuple[int, ...]  # each rank's failure domain
    replicas: int
    holders: tuple[tuple[int, ...], ...]  # each rank's holders, in other domains

    def keeper(self, rank: int) -> int:
        """The rank that keeps ``rank``'s folder: the lowest rank sharing it."""
        return self.folders.index(self.folders[rank])

    def keepers(self) -> list[int]:
        return sorted({self.keeper(r) for r in range(len(self.folders))})


def holders_of(domains: Sequence[Hashable], replicas: int) -> tuple[tuple[int, ...], ...]:
    """Each rank's holders: the rank at its position in each of the next ``replicas - 1``
    domains, in the order of their first ranks (pure, so a layout can be reasoned about)."""
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
    """The node of ``rank``: its first rank, where torchrun says (``LOCAL_RANK``), else
    the host's name."""
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
        """Every rank, on the training thread, in the same order (groups are made here);
        each makes the folder or checks it is its own (``private``: see :func:`own_folder`)."""
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
        return self.layout.keeper(self.rank) == self.rank

    def barrier(self) -> None:
        groups.all_gather_bytes(b"", self.group)

    def staging(self, step: int) -> Path:
        return self.folder / STAGING / step_name(step)

    def clear_staging(self) -> None:
        """The keeper removes what an unfinished round left (never committed)."""
        top = self.folder / STAGING
        if self.keeper and top.is_dir() and not top.is_symlink():
            for name in sorted(os.listdir(top)):
                commit.remove_tree(top / name)

    # ------------------------------------------------------------------ saving

    def replicate(self, step: int, error: BaseException | None) -> None:
        """Phase 2 of a save (every rank): replicas sent, agreed on, committed per folder.

        ``error`` is this rank's failure of phase 1: every rank then fails together,
        and nothing is committed anywhere.
        """
        what = f"memory-tier step {step}"
        staging = self.staging(step)
        groups.agree(error, self.group, what)  # and the coordinator committed phase 1
        small: list[list[Any]] = []
        size = -1
        try:
            if self.rank == 0:
                small = [[n, _read(staging / n)] for n in _coordinator_files(staging)]
            own = staging / shard_name(self.rank)
            if os.path.lexists(own):
                size = os.stat(own, follow_symlinks=False).st_size
        except Exception as e:
            error = e
        sizes = [int(n) for n in groups.agree_values(error, size, self.group, what)]
        packed = codec.encode(small) if self.rank == 0 else b""
        got = codec.decode(groups.broadcast_bytes(packed, self.group))
        assert isinstance(got, list) and got and got[-1][0] == COMMIT_MARKER
        files = [(str(n), bytes(b)) for n, b in got]
        moves = self._moves(sizes)
        try:
            if self.keeper and self.layout.folders[self.rank] != self.layout.folders[0]:
                for name, data in files[:-1]:
                    durable.write_new(staging / name, data, sync=False)
            transfer(moves, lambda m: staging, lambda m: staging, self.group)
        except Exception as e:
            error = e
        groups.agree(error, self.group, what)  # every part and every replica is in place
        # Committed: each keeper makes it visible (a folder whose rename fails lacks the
        # step, which the other folders hold; its rank reports it).
        if self.keeper:
            if not (staging / COMMIT_MARKER).exists():
                durable.write_new(staging / COMMIT_MARKER, files[-1][1], sync=False)
            commit.commit_checkpoint(
                staging, self.folder / step_name(step), overwrite=True, sync=False
            )

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

    @staticmethod
    def complete(path: Path) -> bool:
        """Whether the folder's checkpoint ``path`` holds every file its manifest lists."""
        return ram.holds_every_file(path)

    # ------------------------------------------------------------------ resuming

    def resume(self, at_least: int | None, world: int, *, verified: bool) -> int | None:
        """Every rank: the newest step not older than ``at_least`` (any rank's) that is
        complete somewhere, gathered into every folder; None if there is none.

        Unverified (a resume's first try), every file present at its recorded size
        counts: the read that follows checks every byte it takes, and each copy a folder
        received was read, here or at its source. ``verified`` (after a read found
        damage) first checks every byte of every copy and takes each file from an
        intact one.
        """
        held = self._held() if self.keeper else []
        reports = groups.all_gather_values(held, self.group)
        floors = groups.all_gather_values(-1 if at_least is None else at_least, self.group)
        floor = max(floors)
        steps = sorted({s for rep in reports for s, *_ in rep}, reverse=True)
        for step in steps:
            if step < floor:
                break
            _one_history(step, reports, self.layout, self.folder)
            need, holding = _holding(step, reports, self.layout)
            saved = {r for n in need if (p := parse_shard(n)) is not None for r in [p[0]]}
            if saved and saved != set(range(world)):
                warn(
                    f"{self.folder}: memory-tier step {step} was saved by "
                    f"{max(saved) + 1} ranks and this run has {world}: the memory tier "
                    "resumes only onto the world size that saved it; falling back to the "
                    "disk tier",
                    MemoryTierWarning,
                    stacklevel=4,
                )
                return None
            wanted = set(need) | {MANIFEST, COMMIT_MARKER}
            if not wanted <= set().union(*holding.values()):
                continue  # some rank's part is nowhere now (its node and its holders lost)
            if verified:
                good = self._intact(step, holding)
                missing = wanted - set().union(*good.values())
                if missing:
                    warn(
                        f"{self.folder}: memory-tier step {step}: no intact copy of "
                        f"{sorted(missing)} on any rank (checksums fail); trying an older step",
                        MemoryTierWarning,
                        stacklevel=4,
                    )
                    continue
            else:
                good = {f: holding.get(f, set()) for f in set(self.layout.folders)}
            try:
                fetched = self._reassemble(step, need, wanted, good)
            except CheckpointError as e:
                warn(
                    f"{self.folder}: memory-tier step {step} could not be gathered ({e}); "
                    "falling back to the disk tier",
                    MemoryTierWarning,
                    stacklevel=4,
                )
                return None
            self.resumed = {"step": step, "fetched": fetched}
            return int(step)
        return None

    def read_together(self, path: Path, read: Callable[[Path], T]) -> tuple[T | None, str]:
        """Every rank reads the gathered checkpoint ``path``: what it read, or (every rank
        alike) None and what the damage was. Any rank's error other than damage raises on
        every rank."""
        error: BaseException | None = None
        found: T | None = None
        try:
            found = read(path)
        except Exception as err:
            error = err
        # Each rank's outcome: read, found damage (or was told of it), or failed otherwise.
        damaged = error is not None and (is_damage(error) or isinstance(error, RankFailed))
        failed = error is not None and not damaged
        said = "" if error is None else str(error)
        told = groups.all_gather_values([damaged, failed, said], self.group)
        if any(f for _, f, _ in told):
            groups.agree(error if failed else None, self.group, f"restore {path}")
        bad = [f"rank {r}: {msg}" for r, (d, _, msg) in enumerate(told) if d]
        if bad:
            return None, "; ".join(bad)
        return found, ""

    def _intact(self, step: int, holding: dict[int, set[str]]) -> dict[int, set[str]]:
        """Each folder's files of ``step`` whose every byte passes its checksums (every
        rank: each keeper checks its own folder)."""
        mine = self.layout.folders[self.rank]
        good_here = self._good(step) if self.keeper and mine in holding else set()
        goods = groups.all_gather_values(sorted(good_here), self.group)
        return {self.layout.folders[k]: set(goods[k]) for k in self.layout.keepers()}

    def _held(self) -> list[list[Any]]:
        """The keeper's committed steps: ``[step, {file: size}, [files present], manifest
        checksum]`` each (copies are of one checkpoint only when their checksums agree)."""
        out: list[list[Any]] = []
        for step, path in committed_steps(self.folder).items():
            with contextlib.suppress(CheckpointError, OSError):
                need = ram.listed_files(path)
                have = sorted(ram.present_files(path, need) | {MANIFEST, COMMIT_MARKER})
                out.append([step, need, have, check_committed(path)["manifest_crc32"]])
        return out

    def _good(self, step: int) -> set[str]:
        """The files of the folder's ``step`` whose every byte passes its checksums."""
        path = self.folder / step_name(step)
        try:
            report = verify(path)
            need = ram.listed_files(path)
        except (CheckpointError, OSError):
            return set()
        bad = {p.file for p in report.problems}
        if None in bad or MANIFEST in bad:
            return set()
        return (ram.present_files(path, need) | {MANIFEST, COMMIT_MARKER}) - {b for b in bad if b}

    def _reassemble(
        self, step: int, need: dict[str, int], wanted: set[str], good: dict[int, set[str]]
    ) -> dict[str, int]:
        """Each folder gets what it lacks of ``step`` from the folders that hold it
        (``good``); returns what this rank's folder fetched and from whom. Every rank
        raises together if any rank failed."""
        lay = self.layout
        final = self.folder / step_name(step)
        build = self.staging(step)
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
        here = good.get(mine, set())
        what = f"memory-tier step {step}"
        error: BaseException | None = None
        small: dict[str, int] = {}
        try:
            if ours and self.keeper:
                self.clear_staging()
                durable.make_dirs(build)
                for name in sorted(here - {COMMIT_MARKER}):
                    os.link(final / name, build / name, follow_symlinks=False)
            small = {m.name: _size(final / m.name) for m in moves if m.src == self.rank}
        except Exception as e:
            error = e
        self._fetch(moves, small, error, final, build, what, commit_here=bool(ours))
        return {m.name: m.src for m in ours}

    def _fetch(
        self,
        moves: list[Move],
        sizes: dict[str, int],
        error: BaseException | None,
        final: Path,
        build: Path,
        what: str,
        *,
        commit_here: bool,
    ) -> None:
        """The moves of a reassembly, then each keeper's commit; every rank fails together."""
        told = groups.agree_values(error, sizes, self.group, what)
        sized = [
            Move(m.src, m.dst, m.name, m.size if m.size >= 0 else told[m.src][m.name])
            for m in moves
        ]
        try:
            transfer(sized, lambda m: final, lambda m: build, self.group)
        except Exception as e:
            error = e
        groups.agree(error, self.group, what)  # every folder has all it lacked
        try:
            if commit_here and self.keeper:
                if (final / COMMIT_MARKER).exists() and not (build / COMMIT_MARKER).exists():
                    # the marker last, as at every commit
                    os.link(final / COMMIT_MARKER, build / COMMIT_MARKER, follow_symlinks=False)
                commit.commit_checkpoint(build, final, overwrite=True, sync=False)
        except Exception as e:
            error = e
        groups.agree(error, self.group, what)


def _size(path: Path) -> int:
    return os.stat(path, follow_symlinks=False).st_size


def _read(path: Path) -> bytes:
    return opener.read_file(path, limit=1 << 36, what="memory-tier file")


def _holding(
    step: int, reports: Sequence[Sequence[Sequence[Any]]], lay: ReplicaLayout
) -> tuple[dict[str, int], dict[int, set[str]]]:
    """What ``step`` needs (the first keeper's manifest) and what each folder holds of it
    (folders whose manifest lists other files hold nothing of it)."""
    need: dict[str, int] | None = None
    holding: dict[int, set[str]] = {}
    for r, rep in enumerate(reports):
        for s, files, have, _ in rep:
            if s != step:
                continue
            need = dict(files) if need is None else need
            if dict(files) == need:
                holding[lay.folders[r]] = set(have)
    return need or {}, holding


def _one_history(
    step: int, reports: Sequence[Sequence[Sequence[Any]]], lay: ReplicaLayout, folder: Path
) -> None:
    """Raise (every rank alike: the reports are everyone's) where the folders hold two
    checkpoints of ``step``: two histories that share a step number are never mixed."""
    sums: dict[int, list[int]] = {}
    for r, rep in enumerate(reports):
        for s, _, _, crc in rep:
            if s == step:
                sums.setdefault(int(crc), []).append(lay.folders[r])
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
