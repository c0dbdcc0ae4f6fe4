"""Files sent between ranks on a checkpoint group: the bytes of the memory tier's replicas.

Every rank walks the same list of moves in order, with blocking sends and receives,
so the first move not yet done always has both its ranks at it: no cycle can wait on
itself. Files are mapped, so pages move in place, never copied through Python.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator, Sequence
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

#: Bytes per send: enough to run at the group's speed, few enough to stay in cache.
PIECE = 64 << 20


@dataclass(frozen=True)
class Move:
    """Rank ``src`` of the group sends its file ``name`` (``size`` bytes) to rank ``dst``."""

    src: int
    dst: int
    name: str
    size: int


def transfer(moves: Sequence[Move], source: Path, target: Path, group: Any, what: str) -> int:
    """Carry out this rank's ``moves`` (every rank calls it with the same list), from the
    directory ``source`` into ``target``; returns the bytes moved. A local failure fails
    every rank, once every move is done: only a dead rank keeps one waiting."""
    rank, t0, moved = dist.get_rank(group), time.perf_counter(), 0
    failed: list[BaseException] = []
    for tag, move in enumerate(moves):
        if move.src == move.dst or rank not in (move.src, move.dst):
            continue
        try:  # a local failure still moves every byte: the others' moves wait on them
            _carry(move, tag, group, source / move.name if move.src == rank else None, target)
            moved += move.size
        except Exception as e:
            failed.append(e)
            if isinstance(e, groups.Unanswered):  # a peer is gone: no collective can finish
                raise
    groups.agree(failed[0] if failed else None, group, what)
    if any(m.dst == rank and m.src != m.dst for m in moves):  # where the bytes landed
        done(_LOG, "replicated", target, seconds=time.perf_counter() - t0, nbytes=moved, to="into")
    return moved


_LOG = logger("distributed")


def _carry(move: Move, tag: int, group: Any, sent: Path | None, target: Path) -> None:
    """Send the file ``sent`` (None: receive ``move.name`` into ``target``), exactly
    ``move.size`` bytes through a map of it. What cannot be read is sent as zeros (the
    receiver's checksums reject them), what cannot be written is received into scratch:
    neither side ever waits on the other's failure, raised once the bytes have moved.
    A received file's space is reserved first (a full tmpfs is an error, not a SIGBUS)."""
    fd, view = -1, None
    failure: BaseException | None = None
    try:
        if sent is not None:
            dir_fd = opener.open_directory(sent.parent)
            try:
                fd = opener.open_member(dir_fd, sent.name, sent, size=move.size)
            finally:
                os.close(dir_fd)
            if move.size:  # private (torch takes writable buffers only), not copied
                view = mmap.mmap(fd, move.size, access=mmap.ACCESS_COPY)
        else:
            fd = durable.open_new(target / move.name, mapped=True)
            if move.size:
                os.posix_fallocate(fd, 0, move.size)
                view = mmap.mmap(fd, move.size)
    except (OSError, CheckpointError) as e:
        failure = e
    try:
        for piece in _pieces(view, move.size):
            if sent is not None:
                groups.send(piece, move.dst, group, tag)
            else:
                groups.recv(piece, move.src, group, tag)
            del piece  # the map can close only once no tensor shares it
    finally:
        if view is not None:
            view.close()
        if fd >= 0:
            os.close(fd)
    if failure is not None:
        raise failure


def _pieces(view: mmap.mmap | None, size: int) -> Iterator[torch.Tensor]:
    """``size`` bytes of ``view`` in pieces of :data:`PIECE`, in place (None: zeros)."""
    for offset in range(0, size, PIECE):
        n = min(PIECE, size - offset)
        if view is None:
            yield torch.zeros(n, dtype=torch.uint8)
        else:
            yield torch.frombuffer(view, dtype=torch.uint8, count=n, offset=offset)
