"""Checkpoint collectives on dedicated gloo groups with a timeout; every rank fails together."""

from __future__ import annotations

import atexit
import contextlib
import os
import resource
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.log import logger, warn
from functional_ckpt.errors import CheckpointError, CheckpointWarning, RankFailed

T = TypeVar("T")
_LOG = logger("distributed")

#: Seconds a rank waits for the others in a checkpoint collective before failing.
DEFAULT_TIMEOUT = float(os.environ.get("FCKPT_TIMEOUT", "600"))


def checkpoint_group(purpose: str = "save") -> Any:
    """A dedicated gloo group per ``purpose``, so saves and the manager's decisions never
    interleave. Creating one is a collective: call it from the training thread, in the same
    order on every rank."""
    tag, ranks = f"functional_ckpt:{purpose}", list(range(dist.get_world_size()))
    group = c10d._find_pg_by_ranks_and_tag(tag, ranks)
    if group is None:
        _room_for(len(ranks))
        timeout = timedelta(seconds=DEFAULT_TIMEOUT)
        group = c10d._new_group_with_tag(ranks, timeout, "gloo", pg_tag=tag)
        atexit.register(_release, group)
    return group


def _room_for(peers: int) -> None:
    """A gloo group holds a socket per peer: the usual soft limit of 1,024 descriptors would
    stop a rank near 500 ranks a group, far below its hard limit. Raise the soft limit as
    far as the group needs (logged), never past the hard one (a warning)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    need = held + peers + 64  # a restore's files and a margin
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
    if raised > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        _LOG.info("soft descriptor limit %d raised to %d for %d ranks", soft, raised, peers)
    if raised < need:
        what = f"a checkpoint group of {peers} ranks needs about {need} descriptors"
        warn(
            f"{what}, above the hard limit {hard}: raise `ulimit -Hn`",
            CheckpointWarning,
            stacklevel=3,
        )


def _release(group: Any) -> None:
    """Tear a group down before interpreter shutdown frees them in arbitrary order."""
    if topology().initialized:
        with contextlib.suppress(Exception):
            dist.destroy_process_group(group)


class Unanswered(CheckpointError):
    """Another rank did not answer a collective: it died, hung up or stayed silent too long."""


def _collective(op: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
    """Run one collective (every one of the package runs here), so a lost peer is always
    :class:`Unanswered`; returns once gloo's worker thread let go of the tensors too."""
    flat = [t for a in args for t in (a if isinstance(a, list) else [a])]
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]

    def uses() -> list[int]:
        return [t._use_count() for t in tensors]  # type: ignore[attr-defined]

    held = uses()
    try:
        op(*args, **kwargs)
    except Exception as e:
        raise Unanswered(f"another rank did not answer ({type(e).__name__}: {e})") from e
    for _ in range(20_000):  # about 2 s at most: the thread lets go within microseconds
        if all(now <= n for now, n in zip(uses(), held, strict=True)):
            return
        time.sleep(0.0001)


# Every checkpoint collective passes through these five: tests/dist_job.py counts each
# rank's traffic there, as benchmarks/scale.py predicts it.


def _all_gather(out: list[torch.Tensor], t: torch.Tensor, group: Any) -> None:
    _collective(dist.all_gather, out, t, group=group)


def _all_reduce_max(t: torch.Tensor, group: Any) -> None:
    _collective(dist.all_reduce, t, op=dist.ReduceOp.MAX, group=group)


def _gather(t: torch.Tensor, out: list[torch.Tensor] | None, dst: int, group: Any) -> None:
    _collective(dist.gather, t, out, dst=dist.get_global_rank(group, dst), group=group)


def _broadcast(t: torch.Tensor, src: int, group: Any) -> None:
    _collective(dist.broadcast, t, src=dist.get_global_rank(group, src), group=group)


def _scatter(t: torch.Tensor, parts: list[torch.Tensor] | None, src: int, group: Any) -> None:
    _collective(dist.scatter, t, parts, src=dist.get_global_rank(group, src), group=group)


def send(t: torch.Tensor, dst: int, group: Any, tag: int) -> None:
    """``t`` to rank ``dst`` of ``group``, point to point (a replica's bytes)."""
    _collective(dist.send, t, dst=dist.get_global_rank(group, dst), group=group, tag=tag)


def recv(t: torch.Tensor, src: int, group: Any, tag: int) -> None:
    """Into ``t`` from rank ``src`` of ``group`` (what :func:`send` sent)."""
    _collective(dist.recv, t, src=dist.get_global_rank(group, src), group=group, tag=tag)


def all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    """Every rank's ``data``, without pickling (length-prefixed byte tensors)."""
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _all_gather(sizes, size, group)
    longest = max(int(s.item()) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    _all_gather(out, buf, group)
    return [bytes(t[: int(s.item())].numpy()) for t, s in zip(out, sizes, strict=True)]


def _framed(data: bytes, width: int) -> torch.Tensor:
    """``data`` after its 8-byte length, padded to ``8 + width`` bytes."""
    buf = torch.zeros(8 + width, dtype=torch.uint8)
    head = bytearray(len(data).to_bytes(8, "little"))
    head += data
    buf[: len(head)] = torch.frombuffer(head, dtype=torch.uint8)
    return buf


def _unframed(t: torch.Tensor) -> bytes:
    got = bytes(t.numpy())
    return got[8 : 8 + int.from_bytes(got[:8], "little")]


def _longest(n: int, group: Any) -> int:
    """The largest ``n`` of any rank (what every rank pads its payload to)."""
    size = torch.tensor([n], dtype=torch.int64)
    _all_reduce_max(size, group)
    return int(size.item())


def gather_bytes(data: bytes, group: Any, dst: int = 0) -> list[bytes] | None:
    """Every rank's ``data`` on rank ``dst`` (None elsewhere); the others receive eight bytes."""
    longest = _longest(len(data), group)
    out = None
    if dist.get_rank(group) == dst:
        world = dist.get_world_size(group)
        out = [torch.zeros(8 + longest, dtype=torch.uint8) for _ in range(world)]
    _gather(_framed(data, longest), out, dst, group)
    return None if out is None else [_unframed(t) for t in out]


def broadcast_bytes(data: bytes, group: Any, src: int = 0) -> bytes:
    """Rank ``src``'s ``data`` on every rank of ``group`` (the others pass anything)."""
    mine = dist.get_rank(group) == src
    size = torch.tensor([len(data) if mine else 0], dtype=torch.int64)
    _broadcast(size, src, group)
    n = int(size.item())
    if n == 0:
        return b""
    buf = torch.zeros(n, dtype=torch.uint8)
    if mine:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    _broadcast(buf, src, group)
    return data if mine else bytes(buf.numpy())


def scatter_bytes(parts: list[bytes] | None, group: Any, src: int = 0) -> bytes:
    """Rank ``src``'s ``parts[r]`` on each rank ``r`` of ``group`` (the others pass None)."""
    mine = dist.get_rank(group) == src
    if mine and (parts is None or len(parts) != dist.get_world_size(group)):
        raise ValueError("scatter_bytes: the source passes one part per rank")
    longest = max(len(p) for p in parts) if mine and parts else 0
    size = torch.tensor([longest], dtype=torch.int64)
    _broadcast(size, src, group)
    longest = int(size.item())
    bufs = [_framed(p, longest) for p in parts] if mine and parts is not None else None
    out = torch.zeros(8 + longest, dtype=torch.uint8)
    _scatter(out, bufs, src, group)
    return _unframed(out)


def all_gather_values(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value`` (anything the exact codec stores), without pickling."""
    from functional_ckpt._src import codec

    return [codec.decode(b) for b in all_gather_bytes(codec.encode(value), group)]


def one_directory(path: Path, group: Any) -> bool:
    """Whether every rank's ``path`` is the coordinator's directory (a probe file it made)."""
    path.mkdir(parents=True, exist_ok=True)
    token = all_gather_values(uuid.uuid4().hex, group)[0]
    probe = path / f".fc-probe-{token}"
    first = topology().coordinator
    if first:
        probe.touch()
    all_gather_bytes(b"", group)  # the probe exists before anyone looks
    seen = all(all_gather_values(probe.exists(), group))
    if first:
        with contextlib.suppress(OSError):
            probe.unlink()
    return seen


def agree(error: BaseException | None, group: Any, what: str) -> None:
    """Make every rank fail together when any failed a local step (others: :class:`RankFailed`)."""

    def reports(mine: bytes, group: Any) -> list[bytes]:
        # one integer when every rank succeeded: nobody has anything to report
        return all_gather_bytes(mine, group) if _longest(len(mine), group) else []

    told = answered(what, reports, report(error), group)
    raise_failures(error, what, dict(enumerate(told)))


def answered(what: str, collective: Callable[[Any, Any], T], data: Any, group: Any) -> T:
    """``collective(data, group)``; a rank that died or timed out fails it, naming ``what``."""
    try:
        return collective(data, group)
    except Unanswered as e:
        raise CheckpointError(f"{what}: {e}; nothing committed") from e
    except Exception as e:
        raise CheckpointError(
            f"{what}: another rank did not answer ({e}); nothing committed"
        ) from e


def agree_values(error: BaseException | None, value: Any, group: Any, what: str) -> list[Any]:
    """Every rank's ``value`` in one round once none failed; else all fail as in :func:`agree`."""
    mine = [report(error), None if error is not None else value]
    told = answered(what, all_gather_values, mine, group)
    raise_failures(error, what, {r: bytes(t[0]) for r, t in enumerate(told)})
    return [t[1] for t in told]


def report(error: BaseException | None) -> bytes:
    """A rank's failure as it travels to the others (b"" for none); never raises."""
    if error is None:
        return b""
    return f"{type(error).__name__}\0{_message(error)}".encode(errors="replace")


def raise_failures(error: BaseException | None, what: str, reports: dict[int, bytes]) -> None:
    """Fail as :func:`agree` does, given every rank's :func:`report` by rank."""
    told = {r: m.decode(errors="replace").partition("\0") for r, m in reports.items() if m}
    failures = {r: (kind, message) for r, (kind, _, message) in told.items()}
    if not failures:
        if error is not None:
            raise error
        return
    everyone = RankFailed(what, failures)
    if error is None:
        raise everyone
    if len(failures) > 1:
        error.add_note(str(everyone))
    raise error


def _message(e: BaseException) -> str:
    try:
        return str(e)
    except BaseException:  # a user's __str__ that raises
        return f"(a {type(e).__name__} whose message could not be made)"


def as_checkpoint_error(e: BaseException, what: str, suffix: str = "") -> BaseException:
    """A step's failure: the project's errors as they are, others as a :class:`CheckpointError`."""
    if isinstance(e, CheckpointError) or not isinstance(e, Exception):
        return e
    return CheckpointError(f"{what}: {type(e).__name__}: {_message(e)}{suffix}")
