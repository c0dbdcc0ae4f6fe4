"""The staging stage of the save pipeline, the handle of a background save, and this
process's saves; a :class:`Stager` reuses its buffers, so host memory stays flat."""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 (its exit hook is registered first: runs after ours)
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, get_args

import torch

from functional_ckpt._src.distributed.topology import is_dtensor
from functional_ckpt._src.format.blobs import byte_view
from functional_ckpt._src.format.keys import format_path
from functional_ckpt._src.format.manifest import TensorEntry, Written
from functional_ckpt._src.save import trust
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.state.allocation import host_empty
from functional_ckpt._src.storage.live import LiveReader
from functional_ckpt._src.threads import BackgroundThread
from functional_ckpt.errors import CheckpointError, ModifiedDuringSave

_T = TypeVar("_T")

#: How an asynchronous save reads the state (see :func:`functional_ckpt.save_async`).
Staging = Literal["copy", "write", "none"]

#: The modes, in the order error messages list them.
STAGINGS: tuple[str, ...] = get_args(Staging)


def check_staging(value: object, what: str) -> Staging:
    """``value`` as a staging mode; a ValueError naming ``what``'s argument if it is not."""
    if value not in STAGINGS:
        listed = ", ".join(repr(m) for m in STAGINGS)
        raise ValueError(f"{what}(staging={value!r}): expected one of {listed}")
    return cast(Staging, value)


class Stager:
    """Reusable host buffers for one state layout, busy until the write that read them finished."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._layout: list[tuple[torch.Size, torch.dtype, bool]] = []
        self._free = threading.Condition()
        self._busy = False
        self.allocations = 0  # how many times buffers were (re)allocated

    def acquire(self, timeout: float | None = None) -> None:
        with self._free:
            if not self._free.wait_for(lambda: not self._busy, timeout):
                raise CheckpointError("timed out waiting for the previous save to finish")
            self._busy = True

    def release(self) -> None:
        with self._free:
            self._busy = False
            self._free.notify_all()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy ``tensors`` into the buffers; returns them once every copy is complete."""
        layout = [(t.shape, t.dtype, t.device.type == "cuda") for t in tensors]
        if layout != self._layout:
            self._buffers = [
                torch.empty(shape, dtype=dtype, pin_memory=True)
                if cuda
                else host_empty(shape, dtype)
                for shape, dtype, cuda in layout
            ]
            self._layout = layout
            self.allocations += 1
        cuda = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
        if cuda:
            self._stage_cuda([tensors[i] for i in cuda], [self._buffers[i] for i in cuda])
        host = [(b, t) for t, b in zip(tensors, self._buffers, strict=True) if not t.is_cuda]
        _copy_parallel(host)
        return list(self._buffers)

    @staticmethod
    def _stage_cuda(srcs: list[torch.Tensor], bufs: list[torch.Tensor]) -> None:
        stream = torch.cuda.Stream(device=srcs[0].device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(srcs[0].device))
        with torch.cuda.stream(stream), torch.no_grad():
            for src, buf in zip(srcs, bufs, strict=True):
                buf.copy_(src.detach(), non_blocking=True)
                src.record_stream(stream)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        event.synchronize()


#: Host copies run on this many threads: ``copy_`` drops the GIL, and one thread
#: neither fills the memory bandwidth nor hides the per-tensor call overhead.
COPY_THREADS = 4

#: States smaller than this are copied on the calling thread.
PARALLEL_BYTES = 8 << 20

_COPIERS = BackgroundThread("fc-stage", COPY_THREADS)


def _copy_parallel(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair on a small pool, all done before this returns or raises."""
    if sum(src.nbytes for _, src in pairs) < PARALLEL_BYTES:
        return _copy_group(pairs)
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(COPY_THREADS)]
    loads = [0] * COPY_THREADS
    for pair in sorted(pairs, key=lambda p: -p[0].nbytes):  # largest first, to the lightest
        k = loads.index(min(loads))
        groups[k].append(pair)
        loads[k] += pair[0].nbytes
    futures = [_COPIERS.pool().submit(_copy_group, g) for g in groups if g]
    wait(futures)
    for done in futures:
        done.result()


def _copy_group(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src.detach())


class PendingSave:
    """A save running in the background: see ``wait_staged()`` and ``result()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._staged = threading.Event()
        self._finished = threading.Event()
        self._info: CheckpointInfo | None = None
        self._error: BaseException | None = None
        self.started = time.perf_counter()
        self.staged_after: float | None = None  # seconds from the call to staged
        self._on_staged: list[Callable[[], object]] | None = []  # None once called
        self._on_finished: list[Callable[[], object]] | None = []  # None once called
        self._callbacks = threading.Lock()

    def when_staged(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the state is staged (now, if it is; also if the save failed)."""
        with self._callbacks:
            if self._on_staged is not None:
                self._on_staged.append(fn)
                return
        fn()

    def when_finished(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the save has finished, committed or not (now, if it has)."""
        with self._callbacks:
            if self._on_finished is not None:
                self._on_finished.append(fn)
                return
        fn()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the state's tensors are no longer read (copied, or written)."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"{self.path}: staging did not finish within {timeout} s")

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        """Wait for the commit; raise the background error if the save failed."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        assert self._info is not None
        return self._info

    def done(self) -> bool:
        return self._finished.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.path}: the save did not finish within {timeout} s")
        _UNREAD.discard(self)
        return self._error

    def _run(self, work: Any) -> None:
        try:
            self._info = work()
        except BaseException as e:  # surfaced through result(), never only logged
            self._error = e
            _UNREAD.add(self)  # until result() or exception() reads it; printed at exit
        finally:
            self._mark_staged()
            with self._callbacks:
                callbacks, self._on_finished = self._on_finished or [], None
            _call_all(callbacks)  # before anyone sees it done (a writer lock released)
            self._finished.set()
            _RUNNING.discard(self)

    def _mark_staged(self) -> None:
        """The callbacks run before ``wait_staged`` returns."""
        with self._callbacks:
            callbacks, self._on_staged = self._on_staged, None
        if callbacks is None:
            return
        self.staged_after = time.perf_counter() - self.started
        _call_all(callbacks)
        self._staged.set()


def _call_all(callbacks: list[Callable[[], object]]) -> None:
    for fn in callbacks:
        try:
            fn()
        except Exception:  # a callback's failure is not the save's
            continue


def version_guard(
    sources: Sequence[torch.Tensor],
    keys: Sequence[tuple[str, ...]],
    written: Sequence[torch.Tensor],
    targets: Sequence[TensorEntry],
) -> tuple[Callable[[int], None], Callable[[Written], None], Callable[[], None]]:
    """Hooks that refuse the commit of a state changed while it was written. Version counters
    miss writes through ``.data`` or numpy, so ``check`` checksums every tensor again.
    """
    versions = [t._version for t in sources]
    places = [_place(t) for t in sources]
    modified: list[int] = []

    def after_each(i: int) -> None:
        if sources[i]._version != versions[i] or _place(sources[i]) != places[i]:
            modified.append(i)

    def refuse(bad: Sequence[int]) -> None:
        names = ", ".join(format_path(keys[i]) for i in bad[:20])
        more = f" and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise ModifiedDuringSave(
            f"tensors changed in place (or were resized or freed) during a staging='none' "
            f"save, so the checkpoint was not committed: {names}{more}; use staging='copy' "
            "or stop mutating the state until result() returns"
        )

    def moved() -> None:
        bad = [i for i, t in enumerate(sources) if _place(t) != places[i]]
        if bad:
            refuse(bad)

    def check(result: Written) -> None:
        moved()  # before the memory is read again
        late = [i for i, t in enumerate(sources) if t._version != versions[i]]
        reader = LiveReader()
        try:
            changed = [
                i
                for i, (t, entry) in enumerate(zip(written, targets, strict=True))
                if reader.crc(byte_view(t)) != result.chunks[entry.fqn][0].crc32
            ]
        finally:
            reader.close()
        bad = sorted(set(modified) | set(late) | set(changed))
        if bad:
            refuse(bad)

    return after_each, check, moved


def _place(t: torch.Tensor) -> tuple[int, int, int]:
    """Where ``t``'s bytes are: its address, its storage's and that storage's size."""
    storage = t.untyped_storage()
    return t.data_ptr(), storage.data_ptr(), storage.nbytes()


#: Saves started and not finished: the process does not end before they do.
_RUNNING: set[PendingSave] = set()

#: Failed saves whose error nobody has read yet: printed at exit, which then fails.
_UNREAD: set[PendingSave] = set()

#: The last checkpoints ``fc.save`` and ``fc.save_async`` committed, the trust of an
#: incremental save's base (:mod:`.trust`; a manager brings its own).
PROCESS_TRUST = trust.TrustMemory()

#: Each live checkpoint group's last save plans (torch's groups hold no attributes).
_PLANS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def plans(group: Any, new: Callable[[], _T]) -> _T:
    """The last save plans of a checkpoint group, kept while it lives: two groups of the same
    ranks never share them, and a re-initialized job plans afresh."""
    if group not in _PLANS:
        _PLANS[group] = new()
    return cast(_T, _PLANS[group])


def forget(group: Any) -> None:
    """After a failed save, whose ranks may no longer hold the same plans."""
    _PLANS.pop(group, None)


def _finish_saves() -> None:
    """At exit: wait for every running save (Ctrl-C too), then print each failure nobody read."""
    while _RUNNING:
        for pending in list(_RUNNING):
            try:
                pending._finished.wait()
            except BaseException:  # the save is the obligation: wait again
                continue
    for pending in list(_UNREAD):
        error = pending._error
        assert error is not None
        sys.stderr.write(
            f"functional_ckpt: the background save to {pending.path} failed and was not "
            "committed; the error was never read (result() or exception()):\n"
            + "".join(traceback.format_exception(error))
        )


def _fail_exit() -> None:
    """The last word at exit: a failed save nobody read makes the exit status 1."""
    if _UNREAD:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


# Registered after ``concurrent.futures``'s own hook (imported above), ours runs first:
# every running save is waited for while the pools it checksums and fsyncs on take work.
threading._register_atexit(_finish_saves)  # type: ignore[attr-defined]
atexit.register(_fail_exit)


def _forget_in_child() -> None:
    """A child made by fork has none of its parent's threads: the saves are the parent's."""
    _RUNNING.clear()
    _UNREAD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def run_in_background(dest: Path, work: Callable[[PendingSave], CheckpointInfo]) -> PendingSave:
    """Run ``work`` on its own thread, which the process outlives only once it is done."""
    pending = PendingSave(dest)
    thread = threading.Thread(
        target=pending._run,
        args=(lambda: work(pending),),
        name=f"fc-save:{dest.name}",
        daemon=False,
    )
    _RUNNING.add(pending)
    thread.start()
    return pending


def rewrap(original: torch.Tensor, staged: torch.Tensor) -> torch.Tensor:
    """A staged local shard as a DTensor like ``original`` (plain tensors pass through)."""
    if not is_dtensor(original):
        return staged
    from torch.distributed.tensor import DTensor

    dt: Any = original
    return DTensor.from_local(
        staged, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
    )
