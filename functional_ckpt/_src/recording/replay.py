"""``Replay``: any committed record of a recording back as a new state, exactly as it was
recorded, so a loop can be re-run from it (``fc.apply`` puts the random generators back)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from functional_ckpt._src import codec
from functional_ckpt._src.format.blobs import byte_view
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.format.manifest import NodeEntry, TensorEntry, dtype_name
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy.base import as_int
from functional_ckpt._src.recording import layout
from functional_ckpt._src.state.tree import Leaf, leaves_of, unflatten
from functional_ckpt._src.storage.shards import read_into
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint, NotRecorded, TemplateMismatch

__all__ = ["NotRecorded", "Replay"]


class Replay:
    """The committed records of the recording at ``path``, by step: ``replay[step]`` (or
    :meth:`restore` with ``like=``) is a new state, :meth:`items` a range in order.
    Holds the files open until :meth:`close` (or the end of a ``with`` block)."""

    def __init__(self, path: PathLike) -> None:
        self.path = Path(path)
        self._dir_fd, self._rec = layout.read_committed(self.path, f"Replay(path={str(path)!r})")
        self._fds: dict[int, int] = {}
        self._where = {s: i for i, s in enumerate(self._rec.steps.tolist())}

    @property
    def committed(self) -> layout.Committed:
        """Everything the opening vetted: header, layout, steps, locations, sizes."""
        return self._rec

    @property
    def steps(self) -> list[int]:
        """The recorded steps, ascending."""
        return self._rec.steps.tolist()  # type: ignore[no-any-return]

    @property
    def every(self) -> int:
        return int(self._rec.header["every"])

    @property
    def metadata(self) -> Any:
        return self._rec.header.get("metadata")

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, step: object) -> bool:
        return step in self._where

    def __getitem__(self, step: int) -> TensorDict:
        return self.restore(step)

    def __iter__(self) -> Iterator[int]:
        return iter(self.steps)

    def items(
        self, start: int | None = None, stop: int | None = None, *, like: Any = None
    ) -> Iterator[tuple[int, TensorDict]]:
        """``(step, state)`` for every recorded step in ``[start, stop)``, in order."""
        for step in self.steps:
            if (start is None or step >= start) and (stop is None or step < stop):
                yield step, self.restore(step, like)

    def restore(
        self, step: int, like: TensorDictBase | Mapping[str, Any] | None = None
    ) -> TensorDict:
        """The state recorded at ``step``, as new tensors, each on the device of its
        ``like`` tensor (which must match keys, dtypes and shapes; ``meta``: the CPU)."""
        what = f"Replay({str(self.path)!r})[{step!r}]"
        if self._dir_fd < 0:
            raise CheckpointError(f"{what}: the replay is closed")
        try:
            step = as_int(step, what)
        except TypeError as exc:
            raise NotRecorded(f"{exc}; steps are ints (see replay.steps)") from None
        row = self._where.get(step)
        if row is None:
            raise NotRecorded(f"{what}: step {step} is not recorded; {self._steps_text()}")
        devices = self._devices(like, what) if like is not None else {}
        rec, locs = self._rec, self._rec.locs[row]
        leaves: list[Leaf] = []
        stored = iter(zip(rec.leaves, locs, strict=True))
        for entry in rec.entries:
            if isinstance(entry, NodeEntry):
                leaves.append(Leaf(entry.path, "node", entry.info))
                continue
            _, loc = next(stored)
            seg, off, n, crc = int(loc["seg"]), int(loc["off"]), int(loc["n"]), int(loc["crc"])
            fd = self._segment(seg)
            if isinstance(entry, TensorEntry):
                t = torch.empty(entry.shape, dtype=entry.dtype)
                view = byte_view(t)
                got = read_into(fd, off, view) if n else 0
                self._check(got, n, crc32(view) if n else 0, crc, entry.path, seg, step)
                device = devices.get(entry.path)
                if device is not None and device.type != "meta" and device != t.device:
                    t = t.to(device)
                if entry.requires_grad and (t.is_floating_point() or t.is_complex()):
                    t.requires_grad_(True)
                leaves.append(Leaf(entry.path, "tensor", t))
            else:
                raw = os.pread(fd, n, off)
                self._check(len(raw), n, crc32(raw), crc, entry.path, seg, step)
                leaves.append(Leaf(entry.path, "value", codec.decode(raw, source=what)))
        return unflatten(leaves, rec.header.get("root"))

    def _check(
        self, got: int, n: int, actual: int, crc: int, path: KeyPath, seg: int, step: int
    ) -> None:
        if got != n or actual != crc:
            raise CorruptCheckpoint(
                f"{self.path / layout.segment_name(seg)}: the bytes of state[{format_path(path)}] "
                f"at step {step} do not match their checksum (damaged recording)"
            )

    def _devices(self, like: Any, what: str) -> dict[KeyPath, torch.device]:
        """Each tensor's device in ``like``, which must fit the recording's layout."""
        mine = {e.path: e for e in self._rec.leaves if isinstance(e, TensorEntry)}
        theirs = {x.path: x.value for x in leaves_of(like) if x.kind == "tensor"}
        for path in mine.keys() - theirs.keys() or theirs.keys() - mine.keys():
            side = "missing from like" if path in mine else "not in the recording"
            raise TemplateMismatch(f"{what}: like[{format_path(path)}] is {side}")
        out = {}
        for path, entry in mine.items():
            t = theirs[path]
            if t.dtype != entry.dtype or tuple(t.shape) != entry.shape:
                raise TemplateMismatch(
                    f"{what}: like[{format_path(path)}] is {dtype_name(t.dtype)}"
                    f"{list(t.shape)}, the recording holds {entry.spec}"
                )
            out[path] = t.device
        return out

    def _segment(self, seg: int) -> int:
        fd = self._fds.get(seg)
        if fd is None:
            size = self._rec.segments[seg]
            fd = layout.open_at_least(
                self._dir_fd, self.path, layout.segment_name(seg), size, "data segment"
            )
            self._fds[seg] = fd
        return fd

    def _steps_text(self) -> str:
        steps = self.steps
        if not steps:
            return "the recording holds no committed records"
        return (
            f"{len(steps)} records, steps {steps[0]} to {steps[-1]} every {self.every} "
            "(see replay.steps)"
        )

    def close(self) -> None:
        """Release the files; idempotent."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    def __del__(self) -> None:
        if getattr(self, "_dir_fd", -1) >= 0:
            self.close()

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Replay({str(self.path)!r}, {len(self)} records)"
