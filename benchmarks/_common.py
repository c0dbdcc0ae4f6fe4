"""Helpers shared by the benchmark scripts: timing, durable writes, memory, reporting.

Nothing here knows about functional_ckpt; the save/restore, async and distributed
benchmarks all build on the same pieces so their numbers are measured the same way:

* :func:`timed` / :func:`median` -- wall-clock timing with ``time.perf_counter``;
* :func:`fsync_file`, :func:`fsync_dir`, :func:`write_views_durably` -- the fsyncs a
  competitor needs so that every tool is compared on *durable* writes, and the raw
  floor written with batched ``writev``, handed to the disk as it goes
  (:func:`write_views`, :func:`start_writeback`);
* :func:`check_not_tmpfs`, :func:`remove_path`, :func:`settle`, :func:`scratch_dir` --
  where the written files go and how they are dropped between repetitions;
* :func:`measure_peak_above_baseline`, :func:`run_json_child` -- peak resident memory
  of one action above what the process already held, best run in a fresh child
  process so that earlier work cannot inflate it;
* :func:`bench_parser`, :func:`add_run_args` -- the options every script shares;
* :class:`Table`, :func:`render_targets`, :func:`write_json`, :func:`finish`,
  :func:`environment` -- output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = REPO_ROOT / "bench-results"

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10

T = TypeVar("T")

# --------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once; return (seconds, its result)."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (NaN when empty, so tables still print)."""
    return statistics.median(values) if values else float("nan")


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either side is missing or the divisor is not positive."""
    if num is None or den is None or den <= 0 or num != num or den != den:
        return None
    return num / den


def rotate(items: Sequence[T], k: int) -> list[T]:
    """``items`` starting at position ``k`` (mod len): interleaves tools across repetitions."""
    if not items:
        return []
    k %= len(items)
    return [*items[k:], *items[:k]]


def verdict(value: float | None, limit: float) -> str:
    """PASS / FAIL of ``value <= limit``; SKIP when the value is missing."""
    if value is None or value != value:
        return "SKIP"
    return "PASS" if value <= limit else "FAIL"


# --------------------------------------------------------------------------- durable files


def fsync_file(path: Path) -> None:
    """fsync an existing file by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """fsync a directory so that the names created in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def write_all(fd: int, data: memoryview | bytes | bytearray) -> None:
    """os.write until every byte of ``data`` is written."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


#: Bytes per ``writev`` of a floor that hands its file to the disk as it goes.
WRITEBACK_BLOCK = 32 * MiB


def _libc_sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)``: the disk starts on these bytes now,
    not when the fsync comes (nothing where the call is missing)."""
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, 2)


def write_views(fd: int, views: Iterable[memoryview], *, writeback: bool = False) -> int:
    """Write ``views`` back to back with one ``writev`` per ``IOV_MAX`` of them.

    One system call per small tensor would make the floor slower than what the
    hardware can do (four times, for 10k x 1 KiB here). With ``writeback`` (a file
    about to be fsynced) the views go out in blocks of about
    :data:`WRITEBACK_BLOCK`, each handed to the disk at once, so the disk works
    while the next block is copied: measured here, a 1 GiB write+fsync takes
    0.6-0.8x as long. Returns the bytes written.
    """
    total = handed = 0
    batch: list[memoryview] = []
    size = 0
    for view in views:
        if writeback:
            pieces = (
                [view]
                if len(view) <= WRITEBACK_BLOCK
                else [view[o : o + WRITEBACK_BLOCK] for o in range(0, len(view), WRITEBACK_BLOCK)]
            )
            for piece in pieces:
                batch.append(piece)
                size += len(piece)
                if size >= WRITEBACK_BLOCK or len(batch) == IOV_MAX:
                    total += _writev_all(fd, batch)
                    batch, size = [], 0
                    if total - handed >= WRITEBACK_BLOCK:
                        start_writeback(fd, handed, total - handed)
                        handed = total
            continue
        batch.append(view)
        if len(batch) == IOV_MAX:
            total += _writev_all(fd, batch)
            batch = []
    if batch:
        total += _writev_all(fd, batch)
    return total


def _writev_all(fd: int, views: list[memoryview]) -> int:
    n = os.writev(fd, views)
    total = sum(len(v) for v in views)
    if n < total:  # a short write: finish view by view from where it stopped
        for v in views:
            if n >= len(v):
                n -= len(v)
                continue
            write_all(fd, memoryview(v).cast("B")[n:])
            n = 0
    return total


def write_views_durably(path: Path, views: Iterable[memoryview], *, writeback: bool = True) -> int:
    """Write ``views`` back to back into a new file, fsync it and its directory.

    This is the floor for a durable save: no framing, no checksums, no metadata;
    by default as fast as this disk allows (``writeback``, see :func:`write_views`).
    Returns the number of bytes written.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        total = write_views(fd, views, writeback=writeback)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)
    return total


def read_views(path: Path, views: Iterable[memoryview]) -> int:
    """Fill ``views`` in order from the start of ``path`` (the raw-read floor).

    One ``preadv`` per ``IOV_MAX`` views, as :func:`write_views` writes them.
    """
    offset = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        batch: list[memoryview] = []
        for view in views:
            batch.append(view)
            if len(batch) == IOV_MAX:
                offset = _preadv_all(fd, batch, offset, path)
                batch = []
        if batch:
            offset = _preadv_all(fd, batch, offset, path)
    finally:
        os.close(fd)
    return offset


def _preadv_all(fd: int, views: list[memoryview], offset: int, path: Path) -> int:
    n = os.preadv(fd, views, offset)
    for view in views:  # after a short read, finish view by view from where it stopped
        if n >= len(view):
            n -= len(view)
            offset += len(view)
            continue
        done, n = n, 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise EOFError(f"{path}: short read at {offset + done}")
            done += got
        offset += done
    return offset


# --------------------------------------------------------------------------- scratch space


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (longest mount-point match)."""
    target = str(path.resolve())
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def check_not_tmpfs(path: Path, allow: bool = False) -> str:
    """Refuse memory-backed filesystems (fsync would be free); return the fs type.

    With ``allow`` (smoke tests) it only warns.
    """
    fstype = filesystem_type(path)
    if fstype in {"tmpfs", "ramfs"}:
        msg = f"{path} is on {fstype}: durable-write timings would be meaningless"
        if not allow:
            raise SystemExit(msg)
        print(f"warning: {msg}", file=sys.stderr)
    return fstype


def remove_path(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def settle() -> None:
    """Flush all dirty data (and pending discards of deleted files) before the next tool.

    Runs outside every timed region so that one tool does not pay for the writeback
    or block freeing left behind by the previous one.
    """
    os.sync()


def scratch_dir(base: Path) -> Path:
    """A fresh, empty directory for one run's files under ``base``."""
    run = base / f"run-{os.getpid()}"
    remove_path(run)
    run.mkdir(parents=True)
    return run


# --------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # pragma: no cover - psutil is a bench dependency
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's high-water RSS mark to its current RSS (Linux >= 4.0).

    ``ru_maxrss`` cannot be reset and may carry peaks from before the measured
    region (imports, even the pre-exec copy of the parent), so peaks are read
    from ``VmHWM`` after this reset. Returns False where that is impossible.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def peak_rss_bytes() -> int:
    """Peak RSS since the last :func:`reset_peak_rss` (else since the process started)."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class PeakSampler:
    """Fallback peak-RSS probe: samples RSS in a thread every ``interval`` seconds."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def measure_peak_above_baseline(action: Callable[[], Any]) -> dict[str, Any]:
    """Run ``action``; report RSS before it, the peak during it and the difference.

    Uses the kernel's high-water mark when it can be reset, else a sampling thread
    (which can miss short spikes); ``method`` says which.
    """
    gc.collect()
    baseline = rss_bytes()
    if reset_peak_rss():
        action()
        peak, method = peak_rss_bytes(), "VmHWM after clear_refs"
    else:
        with PeakSampler() as sampler:
            action()
        peak, method = sampler.peak, "sampling thread (1 ms)"
    return {"baseline": baseline, "peak": peak, "extra": max(0, peak - baseline), "method": method}


def run_json_child(argv: Sequence[str], timeout: float = 600.0) -> dict[str, Any]:
    """Run ``python argv...`` in a fresh interpreter; parse the last stdout line as JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {argv} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# --------------------------------------------------------------------------- output


def fmt_seconds(s: float | None) -> str:
    if s is None or s != s:
        return "-"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.3f} s"


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def fmt_ms(s: float | None) -> str:
    """Seconds as milliseconds with two decimals (small stalls need the precision)."""
    if s is None or s != s:
        return "-"
    return f"{s * 1000:.2f} ms"


def fmt_pct(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:+.2f}%"


def fmt_rate(nbytes: int, seconds: float | None) -> str:
    if not seconds or seconds != seconds:
        return "-"
    return f"{nbytes / seconds / 1e9:.2f} GB/s"


@dataclass
class Table:
    """A plain-text table with left-aligned columns."""

    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def render(self) -> str:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

        rule = "  ".join("-" * w for w in widths)
        return "\n".join([line(self.headers), rule, *(line(r) for r in self.rows)])


def render_targets(targets: Sequence[dict[str, Any]], keys: Sequence[str] = ("target",)) -> str:
    """The targets as a table: the ``keys`` columns, the value against its limit, the verdict.

    A target with ``"unit": "s"`` is a duration (shown in ms); any other is a ratio.
    """
    table = Table([*keys, "value", "limit", "result"])
    for t in targets:
        if t.get("unit") == "s":
            value, limit = fmt_ms(t["value"]), fmt_ms(t["limit"])
        else:
            value, limit = fmt_ratio(t["value"]), f"{t['limit']:.2f}x"
        table.add(*(t[k] for k in keys), value, limit, t["result"])
    return table.render()


def environment() -> dict[str, Any]:
    """Versions and machine facts worth keeping next to the numbers."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    for mod in ("torch", "safetensors", "tensordict"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # informational only
            info[mod] = None
    try:
        import psutil

        info["memory_bytes"] = int(psutil.virtual_memory().total)
    except ImportError:  # pragma: no cover
        pass
    return info


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON, atomically (tmp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def finish(args: argparse.Namespace, payload: dict[str, Any], failed: bool | None = None) -> int:
    """Write ``payload`` to ``--json``, say where, and return the exit status.

    Only ``--strict`` turns a failed target into exit 1 (numbers from a shared or small
    machine are worth keeping even when they miss). ``failed`` defaults to whether any
    of ``payload["targets"]`` is FAIL; a SKIP (no value) fails nothing.
    """
    write_json(args.json, payload)
    print(f"\nwrote {args.json}")
    if failed is None:
        failed = any(t["result"] == "FAIL" for t in payload["targets"])
    return 1 if args.strict and failed else 0


# --------------------------------------------------------------------------- arguments


def bench_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of the script's docstring ``doc``."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0] if doc else None)


def add_run_args(p: argparse.ArgumentParser, name: str, strict: str | None = "a target") -> None:
    """``--dir``, ``--json`` (default ``bench-results/<name>.json``), ``--allow-tmpfs`` and,
    unless ``strict`` is None, ``--strict`` (exit 1 when ``strict`` fails)."""
    p.add_argument("--dir", type=Path, default=DEFAULT_RESULTS / "tmp", help="scratch directory")
    p.add_argument("--json", type=Path, default=DEFAULT_RESULTS / f"{name}.json")
    p.add_argument(
        "--allow-tmpfs", action="store_true", help="only warn when --dir is memory-backed"
    )
    if strict is not None:
        p.add_argument("--strict", action="store_true", help=f"exit 1 when {strict} fails")


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def drop_cache(root: Path) -> str:
    """Drop the files under ``root`` from the page cache, as after a restart; says how.

    The whole page cache where this process may write ``/proc/sys/vm/drop_caches``
    (root), else each file's pages by ``posix_fadvise`` (which the kernel may keep).
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except (OSError, AttributeError):
                pass
            finally:
                os.close(fd)
    return "fadvise (drop_caches not allowed)"
