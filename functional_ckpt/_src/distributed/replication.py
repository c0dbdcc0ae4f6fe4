"""Files sent between ranks on a checkpoint group: the bytes of the memory tier's replicas.

A transfer is a list of moves that every rank knows alike (who sends which file,
of which size, to whom). Each rank carries out its own moves in the list's order,
one piece at a time, with blocking sends and receives on a dedicated gloo group:
since every rank walks the same order, the first move not yet done always has
both its ranks at it, so no set of moves can wait on itself in a cycle. Moves
between other ranks run at the same time.

A source file is opened through the one opener and mapped, so its pages are sent
in place (no copy through Python); what arrives is received straight into a new
file's shared map (never through a link). What moves, and where it lands, is the
memory tier's to decide (``manager/memory_replicas``): this module only carries
bytes.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from functional_ckpt._src.distributed import groups
from functional_ckpt._src.log import done, logger
from functional_ckpt._src.storage import durable, opener
from functional_ckpt.errors import CheckpointError

__all__ = ["PIECE", "Move", "transfer"]

#: Bytes per send: large enough to run at the group's speed, small enough that a
#: piece's pages are touched while still cached.
PIECE = 64 << 20


@dataclass(frozen=True)
class Move:
    """Rank ``src`` of the group sends its file ``name`` (``size`` bytes) to rank ``dst``."""

    src: int
    dst: int
    name: str
    size: int


def transfer(
    moves: Sequence[Move],
    source: Callable[[Move], Path],
    target: Callable[[Move], Path],
    group: Any,
) -> int:
    """Carry out this rank's ``moves``: read from the directory ``source(move)``, write
    into ``target(move)``. Every rank of ``group`` calls it with the same list.
    Returns the bytes this rank sent or received; a file that could not be read or
    written raises (the first such error) once every move is done, so only a dead
    rank can keep another waiting (for the group's timeout)."""
    rank, t0 = dist.get_rank(group), time.perf_counter()
    moved = 0
    failed: list[BaseException] = []
    for tag, move in enumerate(moves):
        if move.src == move.dst or rank not in (move.src, move.dst):
            continue
        try:  # a local failure still moves every byte: the others' moves wait on them
            if move.src == rank:
                _send(source(move) / move.name, move, tag, group)
            else:
                _receive(target(move) / move.name, move, tag, group)
            moved += move.size
        except groups.Unanswered:  # a peer is gone: no later move can finish either
            raise
        except (OSError, CheckpointError) as e:
            failed.append(e)
    if failed:
        raise failed[0]
    mine = [target(m) for m in moves if m.dst == rank and m.src != m.dst]
    if mine:  # a record where the bytes landed: the replica's folder
        done(_LOG, "replicated", mine[0], seconds=time.perf_counter() - t0, nbytes=moved, to="into")
    return moved


_LOG = logger("distributed")


def _send(path: Path, move: Move, tag: int, group: Any) -> None:
    """Send exactly ``move.size`` bytes, whatever happens here (zeros in place of what
    cannot be read), so the receiver is never left waiting: its checksums reject such
    bytes, and this rank reports the error."""
    fd, view, size, failure = -1, None, -1, None
    try:
        dir_fd = opener.open_directory(path.parent)
        try:
            fd = opener.open_member(dir_fd, path.name, path)
        finally:
            os.close(dir_fd)
        size = os.fstat(fd).st_size
        if min(size, move.size):  # private (torch takes writable buffers only), not copied
            view = mmap.mmap(fd, min(size, move.size), access=mmap.ACCESS_COPY)
    except OSError as e:
        failure = e
    have = 0 if view is None else len(view)
    try:
        for offset in range(0, move.size, PIECE):
            n = min(PIECE, move.size - offset)
            if view is not None and offset + n <= have:
                piece = torch.frombuffer(view, dtype=torch.uint8, count=n, offset=offset)
            else:  # past what the file holds (or all of it, if it cannot be read)
                piece = torch.zeros(n, dtype=torch.uint8)
                k = max(0, have - offset)
                if k and view is not None:
                    piece[:k] = torch.frombuffer(view, dtype=torch.uint8, count=k, offset=offset)
            groups.send(piece, move.dst, group, tag)
            del piece  # the map can close only once no tensor shares it
    finally:
        _close(view, fd)
    if failure is not None:
        raise failure
    if size != move.size:
        raise CheckpointError(f"{path}: {size} bytes, not the {move.size} bytes sent for it")


def _close(view: mmap.mmap | None, fd: int) -> None:
    """A file's map, then the file (the pieces sent or received from it are gone)."""
    if view is not None:
        view.close()
    if fd >= 0:
        os.close(fd)


def _receive(path: Path, move: Move, tag: int, group: Any) -> None:
    """Receive ``move.size`` bytes into the new file ``path``, straight into its pages
    (a shared map of it: no copy through a buffer). Its space is reserved first (a full
    RAM file system is an error here, not a SIGBUS later); what cannot be written is
    still received, into a scratch buffer, so the sender is never left waiting."""
    fd, view, failure = -1, None, None
    try:
        fd = durable.open_new(path, mapped=True)
        if move.size:
            os.posix_fallocate(fd, 0, move.size)
            view = mmap.mmap(fd, move.size)
    except OSError as e:
        failure = e
    scratch: torch.Tensor | None = None
    try:
        for offset in range(0, move.size, PIECE):
            n = min(PIECE, move.size - offset)
            if view is not None:
                piece = torch.frombuffer(view, dtype=torch.uint8, count=n, offset=offset)
            else:
                scratch = torch.empty(n, dtype=torch.uint8) if scratch is None else scratch
                piece = scratch[:n]
            groups.recv(piece, move.src, group, tag)
            del piece  # the map can close only once no tensor shares it
    finally:
        _close(view, fd)
    if failure is not None:
        raise failure
