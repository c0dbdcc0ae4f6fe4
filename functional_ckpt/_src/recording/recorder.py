"""``Recorder``: append a small state to a recording every k steps, off the loop's thread.

The loop pays one copy of the tensors into a reused staging slot and the encoding of
the plain values; a background thread appends only the leaves that changed since the
previous record, so a crash loses at most the records after the last commit."""

from __future__ import annotations

import fcntl
import itertools
import os
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from functional_ckpt._src import codec
from functional_ckpt._src.format import manifest as mf
from functional_ckpt._src.format.blobs import byte_view
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.keys import format_path, fqn_of
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy.base import as_int, finite_number, positive_int
from functional_ckpt._src.recording import layout
from functional_ckpt._src.state.tree import Leaf, leaves_of, root_record
from functional_ckpt._src.storage import durable
from functional_ckpt.errors import CheckpointError, CheckpointExists, UnsupportedValue

__all__ = ["Recorder"]

#: A data segment is closed and a new one started past this size.
SEGMENT_BYTES = 1 << 30
_ALIGN = 64


def _signature(leaf: Leaf) -> tuple[Any, ...]:
    """What must stay the same from record to record: the layout of the first one."""
    if leaf.kind == "tensor":
        t = leaf.value
        return (leaf.path, "tensor", t.dtype, tuple(t.shape), t.layout, t.is_meta)
    if leaf.kind == "node":
        return (leaf.path, "node", leaf.value)
    return (leaf.path, "value")


class _Slot:
    """One staging buffer: every tensor leaf's bytes, and the values' encodings."""

    def __init__(self, specs: list[mf.TensorEntry], pin: bool) -> None:
        padded = [-(-e.nbytes // _ALIGN) * _ALIGN for e in specs]
        *offsets, total = itertools.accumulate(padded, initial=0)
        # Zeroed, so that the padding of every slot is equal: leaves compare as int64
        # words (torch.equal on bytes is many times slower).
        self.buf = torch.zeros(max(total, 1), dtype=torch.uint8, pin_memory=pin)
        self.raw = [self.buf[o : o + e.nbytes] for o, e in zip(offsets, specs, strict=True)]
        self.words = [
            self.buf[o : o + n].view(torch.int64) for o, n in zip(offsets, padded, strict=True)
        ]
        self.views = [r.view(e.dtype).view(e.shape) for r, e in zip(self.raw, specs, strict=True)]
        self.bytes = [byte_view(r) for r in self.raw]
        self.values: list[bytes] = []
        self.step = -1


class Recorder:
    """Record a state every ``every`` steps into the new recording ``path`` (absent or
    an empty directory: a recording is never appended to or overwritten).

    ``record`` stages the state and returns; the background writer commits every
    ``commit_every`` records or ``commit_secs`` seconds, on :meth:`commit` and on
    :meth:`close`, and its failure is raised by the next call. The first record
    fixes the layout (keys, dtypes, shapes, batch sizes). Not thread-safe.
    """

    def __init__(
        self,
        path: PathLike,
        every: int = 1,
        *,
        commit_every: int = 64,
        commit_secs: float = 1.0,
        metadata: Mapping[str, Any] | None = None,
        slots: int = 4,
    ) -> None:
        self.path = Path(path)
        self.every = positive_int(every, "every", f"Recorder(every={every!r})")
        self.commit_every = positive_int(commit_every, "commit_every", "Recorder(commit_every=…)")
        what = f"Recorder(commit_secs={commit_secs!r})"
        self.commit_secs = finite_number(commit_secs, "commit_secs", what, positive=True)
        positive_int(slots, "slots", f"Recorder(slots={slots!r})")
        self._slots_wanted = max(3, slots)
        self.metadata = dict(metadata or {})
        codec.check_encodable(self.metadata, where="Recorder(metadata=...)")
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_dir()):
            raise CheckpointExists(f"Recorder(path={str(self.path)!r}): exists, not a directory")
        durable.make_dirs(self.path)
        self._dir_fd = _claim(self.path)
        self._layout: list[tuple[Any, ...]] | None = None
        self._kinds: list[str] = []
        self._free: queue.Queue[_Slot] = queue.Queue()
        self._jobs: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._count = 0
        self._last_step: int | None = None
        self.committed = 0  # records committed so far (the writer thread's count)
        # The writer thread's state.
        self._ref: _Slot | None = None
        self._prev: np.ndarray | None = None
        self._pending: list[tuple[int, np.ndarray]] = []
        self._segments: list[int] = []
        self._seg_fd = -1
        self._index_fd = -1
        self._index_size = 0
        self._index_crc = 0
        self._header = b""
        self._last_commit = time.monotonic()

    def record(self, state: TensorDictBase | Mapping[str, Any], *, step: int | None = None) -> bool:
        """Stage ``state`` as the record of ``step`` (default: the count of calls so far);
        returns whether it was recorded (``step % every == 0``). Steps must increase."""
        self._check_open("record")
        if step is None:
            step = self._count
        step = as_int(step, f"Recorder.record(step={step!r})")
        if step > layout.MAX_STEP:
            raise CheckpointError(
                f"Recorder.record(step={step}): a recording holds steps up to {layout.MAX_STEP}"
            )
        if step < 0 or (self._last_step is not None and step <= self._last_step):
            raise CheckpointError(
                f"Recorder.record(step={step}): steps must increase (the last recorded step "
                f"is {self._last_step}); to record a re-run, start a new recording"
            )
        self._count = step + 1
        if step % self.every:
            return False
        leaves = leaves_of(state)
        values = [
            codec.encode(leaf.value, where=f"Recorder.record: state[{format_path(leaf.path)}]")
            for leaf in leaves
            if leaf.kind == "value"
        ]
        if self._layout is None:
            self._start(root_record(state), leaves)
        elif (got := [_signature(leaf) for leaf in leaves]) != self._layout:
            self._refuse_layout(got)
        tensors = [leaf.value for leaf in leaves if leaf.kind == "tensor"]
        while True:  # blocks while the writer is behind; a dead writer is reported
            try:
                slot = self._free.get(timeout=0.5)
                break
            except queue.Empty:
                self._raise_failure()
        try:
            with torch.no_grad():
                for view, t in zip(slot.views, tensors, strict=True):
                    view.copy_(t)
        except BaseException:
            self._free.put(slot)
            raise
        slot.values, slot.step = values, step
        self._last_step = step
        self._jobs.put(("record", slot))
        return True

    def _start(self, root: dict[str, Any] | None, leaves: list[Leaf]) -> None:
        entries: list[mf.Entry] = []
        pin = False
        for leaf in leaves:
            if leaf.kind == "node":
                entries.append(mf.NodeEntry(leaf.path, leaf.value))
            elif leaf.kind == "value":
                entries.append(mf.ValueEntry(leaf.path, None))
            else:
                t = leaf.value
                if t.layout != torch.strided or t.is_meta or type(t) is not torch.Tensor:
                    raise UnsupportedValue(
                        f"Recorder.record: state[{format_path(leaf.path)}] is a "
                        f"{type(t).__name__} ({t.layout}, {t.device}); a recording holds dense "
                        "local tensors"
                    )
                pin = pin or (t.is_cuda and torch.cuda.is_available())
                spec = (mf.dtype_name(t.dtype), tuple(t.shape), bool(t.requires_grad))
                entries.append(mf.TensorEntry(leaf.path, fqn_of(leaf.path), *spec))
        specs = [e for e in entries if isinstance(e, mf.TensorEntry)]
        self._kinds = [e.kind for e in entries if e.kind != "node"]
        planned = [e.to_plain() for e in entries]
        header = {"format": layout.FORMAT, "version": layout.VERSION, "created": time.time()}
        header |= {"every": self.every, "metadata": self.metadata, "root": root, "layout": planned}
        self._header = codec.encode(header, where="Recorder: the recording's header")
        durable.replace_durably(self.path / layout.HEADER, self._header)
        for _ in range(self._slots_wanted):
            self._free.put(_Slot(specs, pin))
        self._layout = [_signature(leaf) for leaf in leaves]
        self._thread = threading.Thread(target=self._run, name="fc-recorder", daemon=True)
        self._thread.start()

    def _refuse_layout(self, got: list[tuple[Any, ...]]) -> None:
        assert self._layout is not None
        for old, new in zip(self._layout, got, strict=False):
            if old != new:
                where = format_path(new[0] if new[0] == old[0] else old[0])
                raise CheckpointError(
                    f"Recorder.record(state): state[{where}] is {new[1:]}, the first record had "
                    f"{old[1:]}; every record of a recording has the layout of the first (keys, "
                    "dtypes, shapes, batch sizes): start a new recording for a new layout"
                )
        extra = got[len(self._layout) :] or self._layout[len(got) :]
        raise CheckpointError(
            f"Recorder.record(state): state[{format_path(extra[0][0])}] is "
            f"{'new' if len(got) > len(self._layout) else 'missing'}; every record of a "
            "recording has the layout of the first: start a new recording for a new layout"
        )

    def commit(self) -> int:
        """Block until every record so far is durable; returns how many are committed."""
        self._check_open("commit")
        if self._thread is not None:
            done = threading.Event()
            self._jobs.put(("commit", done))
            while not done.wait(0.5):
                self._raise_failure()
        self._raise_failure()
        return self.committed

    def close(self) -> None:
        """Commit what was recorded, stop the writer, release the files; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._jobs.put(("close",))
            self._thread.join()
        os.close(self._dir_fd)  # drops the claim: the recording is complete
        self._raise_failure()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # what was recorded up to a failure is what one wants to look at

    def __repr__(self) -> str:
        return f"Recorder({str(self.path)!r}, every={self.every}, committed={self.committed})"

    def _check_open(self, what: str) -> None:
        self._raise_failure()
        if self._closed:
            raise CheckpointError(f"Recorder({str(self.path)!r}).{what}: the recorder is closed")

    def _raise_failure(self) -> None:
        failure = self._failure
        if failure is not None:
            raise CheckpointError(
                f"{self.path}: writing the recording failed ({failure!r}); the "
                f"{self.committed} records committed before it are safe, later ones are lost"
            ) from failure

    def _run(self) -> None:
        while True:
            wait = max(0.0, self._last_commit + self.commit_secs - time.monotonic())
            try:
                job = self._jobs.get(timeout=wait if self._pending else None)
            except queue.Empty:
                job = ("commit", None)
            try:
                if self._failure is None and job[0] == "record":
                    self._write(job[1])
                    due = time.monotonic() - self._last_commit >= self.commit_secs
                    if len(self._pending) >= self.commit_every or due:
                        self._commit()
                elif self._failure is None:
                    self._commit()
            except BaseException as exc:  # reported by the loop's next call
                self._failure = exc
            finally:
                if job[0] == "record" and self._failure is not None:
                    self._free.put(job[1])  # the loop never waits on a dead writer
                if job[0] == "commit" and job[1] is not None:
                    job[1].set()
            if job[0] == "close":
                for fd in (self._seg_fd, self._index_fd):
                    if fd >= 0:
                        os.close(fd)
                return

    def _write(self, slot: _Slot) -> None:
        """Append the leaves that changed since the previous record; the rest are shared."""
        ref, prev = self._ref, self._prev
        locs = np.empty(len(self._kinds), layout.LOC)
        t = v = 0
        for i, kind in enumerate(self._kinds):
            if kind == "tensor":
                same = ref is not None and torch.equal(slot.words[t], ref.words[t])
                data: memoryview | bytes = slot.bytes[t]
                t += 1
            else:
                same = ref is not None and slot.values[v] == ref.values[v]
                data = slot.values[v]
                v += 1
            if same:
                assert prev is not None
                locs[i] = prev[i]
            else:
                locs[i] = self._append(data)
        self._pending.append((slot.step, locs))
        if ref is not None:
            self._free.put(ref)
        self._ref, self._prev = slot, locs

    def _append(self, data: memoryview | bytes) -> tuple[int, int, int, int]:
        n = len(data)
        if self._seg_fd < 0 or (self._segments[-1] and self._segments[-1] + n > SEGMENT_BYTES):
            if self._seg_fd >= 0:
                os.fsync(self._seg_fd)  # complete before the next segment is begun
                os.close(self._seg_fd)
            self._seg_fd = durable.open_new(self.path / layout.segment_name(len(self._segments)))
            self._segments.append(0)
        off = self._segments[-1]
        durable.write_all(self._seg_fd, data)
        self._segments[-1] = off + n
        return (len(self._segments) - 1, crc32(data), off, n)

    def _commit(self) -> None:
        """Data, then the index frame, then the marker: each durable before the next."""
        self._last_commit = time.monotonic()
        if not self._pending:
            return
        if self._seg_fd >= 0:
            os.fsync(self._seg_fd)
        steps = [s for s, _ in self._pending]
        locs = np.stack([loc for _, loc in self._pending])
        frame = codec.encode({"steps": steps, "locs": locs.tobytes()}, where="recording index")
        blob = layout.FRAME.pack(len(frame)) + frame
        if self._index_fd < 0:
            self._index_fd = durable.open_new(self.path / layout.INDEX)
        durable.write_all(self._index_fd, blob)
        os.fsync(self._index_fd)
        self._index_size += len(blob)
        self._index_crc = crc32(blob, self._index_crc)
        records = self.committed + len(steps)
        marker = {"format": layout.FORMAT, "version": layout.VERSION, "records": records}
        marker |= {"index_size": self._index_size, "index_crc32": self._index_crc}
        marker |= {"header_size": len(self._header), "header_crc32": crc32(self._header)}
        marker["segments"] = list(self._segments)
        durable.replace_durably(
            self.path / layout.RECORDING_MARKER, codec.encode(marker, where="recording marker")
        )
        self.committed += len(steps)
        self._pending.clear()


def _claim(path: Path) -> int:
    """The directory of a new recording, locked (``flock``) for this recorder's lifetime
    and found empty under the lock: a second recorder on one path is refused."""
    where = f"Recorder(path={str(path)!r})"
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CheckpointExists(
                f"{where}: another Recorder is writing there; choose a new path"
            ) from None
        except OSError:
            pass  # no flock on directories here (some network file systems): the check below
        if os.listdir(fd):
            raise CheckpointExists(
                f"{where}: the directory is not empty; a recording is never appended to or "
                "overwritten: choose a new path"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd
