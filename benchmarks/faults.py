"""Fault and attack suite: crashes, full disks, bad destinations, corruption, hostile files.

A checkpoint library is trusted only as far as it was tried, so this script tries it
and prints what happened instead of promising anything::

    python benchmarks/faults.py                 # long form (>= 300 SIGKILL trials)
    python benchmarks/faults.py --ci --json x   # the short form tests/test_faults.py runs

It runs every attack class of the project in one table: crashes (SIGKILL of saves,
exports, pruning, overwrites without ``RENAME_EXCHANGE``, rollbacks), full disks, bad
destinations, corruption, hostile files, storage hardening (durability order, special
files, unpickler attacks, derived ``.metadata``, overwrite scope and races, reader
fuzzing), manager roots (lock-file links, template errors, ``fckpt`` on odd
manifests) and, from ``benchmarks/faults_values.py`` (also runnable on its own),
values and manifests (decoder budgets, view bits, limits, chunk coverage, unstaged
saves) and, from ``benchmarks/faults_trust.py``, the third attack suite's classes
(hash floods in every decoder, symlinked steps under every destructive operation,
wrong manager roots, hostile remote manifests on resume, terminal control
characters, special state files). ``--scenarios`` picks some.

Every trial uses real files, real ``SIGKILL``s of real processes and real mounts.
Crash children are ``os.fork()``ed from this process after torch is imported (a
fresh interpreter per trial would cost seconds of imports each); they leave through
``os._exit`` only, so no ``atexit`` hook or pytest teardown ever runs in them.

Columns of the table:

* ``lost``: committed checkpoints that existed before a trial and were gone or
  damaged after it (or a retention policy deleting more than it may);
* ``torn``: visible (non-temporary) checkpoints that did not restore whole, or a
  restore that returned data of mixed versions;
* ``detected``: corruptions / hostile files caught by both ``fc.verify`` and
  ``fc.restore`` (x/y);
* ``executed``: hostile payloads that ran (a marker file appeared);
* ``other``: anything else that went wrong: an unclear error type, a leaked
  temporary directory, a hang, a traceback, a wrong exit status, a large
  allocation. Each is tagged; see ``--json``.

A values class counts a wrong value restored, a hostile input accepted or a save
that cannot be loaded as ``torn``, and an error that is not a ``CheckpointError``
as ``other``; its slowest trial and worst memory ratio are printed below the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import inspect
import json
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.naming import QUARANTINE_INFIX, parse_step, step_name
from functional_ckpt._src.storage import commit, durable
from functional_ckpt.errors import LeftoverWarning, is_damage

# --------------------------------------------------------------------------- results


@dataclass
class Result:
    """What one scenario tried and what went wrong; plain data, dumped to JSON."""

    scenario: str
    trials: int = 0
    lost: int = 0
    torn: int = 0
    detected: int = 0
    corruptions: int = 0
    executed: int = 0
    other: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # named sub-counters
    problems: list[str] = field(default_factory=list)  # "tag: detail", first ones only
    skipped: str | None = None
    seconds: float = 0.0
    figures: dict[str, float] = field(default_factory=dict)  # worst time, memory ratio

    def bump(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def problem(self, tag: str, detail: str, *, column: str = "other") -> None:
        """Record a failure under ``column`` (lost / torn / executed / other) with a tag."""
        setattr(self, column, getattr(self, column) + 1)
        self.bump(f"{column}:{tag}")
        if len(self.problems) < 40:
            self.problems.append(f"{tag}: {detail[:400]}")

    def tags(self) -> set[str]:
        return {p.split(":", 1)[0] for p in self.problems}


@dataclass(frozen=True)
class Scale:
    """How many trials of each kind; the long and the CI forms differ only here."""

    kills_per_kind: int  # SIGKILL trials for each of sync / async / prune / export
    flips_per_file: int  # random single-bit flips per checkpoint file
    exhaustive_marker: bool  # flip every bit of COMMITTED (it is tiny)
    disk_full_steps: int  # free-space levels tried on the small filesystem
    vanish_trials: int  # destination removed mid-save
    follow_secs: float  # how long a reader follows a writer
    fuzz_examples: int = 3000  # mutated manifests / markers / .metadata files read back
    cli_each: bool = True  # run the CLI against every overwrite target (slow: a process each)
    leftover_kills: int = 100  # SIGKILLs per mode with RENAME_EXCHANGE unavailable
    rollback_kills: int = 100  # SIGKILLs of CheckpointManager.rollback
    values_quick: bool = False  # benchmarks/faults_values.py's short form


LONG = Scale(80, 40, True, 24, 20, 15.0)
CI = Scale(8, 6, False, 8, 4, 3.0, 300, False, 5, 8, True)

KINDS = ("sync", "async", "prune", "export")


# --------------------------------------------------------------------------- states


def make_state(version: int, *, big: int = 2, small: int = 24) -> dict[str, Any]:
    """A state whose every tensor element equals ``version``: a reader can tell torn mixes."""
    v = float(version)
    model: dict[str, Any] = {f"big{i}": torch.full((1 << 18,), v) for i in range(big)}
    model.update({f"s{i}": torch.full((16, 4), v) for i in range(small)})
    return {
        "model": model,
        "optim": {"m": torch.full((100,), v), "count": torch.tensor(version)},
        "step": version,
        "meta": {"v": [version] * 4, "t": (version, "x")},
    }


def state_version(state: Any) -> int:
    """The version a restored state claims, after checking every leaf agrees with it."""
    version = int(fc.codec.to_python(state["step"]))
    leaves = [
        t.reshape(-1).double()
        for t in state.values(include_nested=True, leaves_only=True)
        if isinstance(t, torch.Tensor)
    ]
    flat = torch.cat(leaves)
    if not bool((flat == version).all()):
        wrong = flat[flat != version][0].item()
        raise AssertionError(f"a tensor holds {wrong}, expected {version} everywhere")
    meta = fc.codec.to_python(state["meta"])
    if meta != {"v": [version] * 4, "t": (version, "x")}:
        raise AssertionError(f"meta {meta!r} does not match version {version}")
    return version


def check_whole(path: Path) -> int:
    """Restore and verify a visible checkpoint; its version, or AssertionError/CheckpointError."""
    version = state_version(fc.restore(path))
    report = fc.verify(path)
    if not report.ok:
        raise AssertionError(f"verify failed: {report}")
    return version


def export_version(path: Path) -> int:
    """Load a safetensors export with safetensors itself and check it is one step whole."""
    from safetensors.torch import load_file

    step = int(path.name.split("_")[1])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise AssertionError("no safetensors file")
    names: set[str] = set()
    for f in files:
        for name, t in load_file(str(f)).items():
            names.add(name)
            if not bool((t == step).all()):
                raise AssertionError(f"{f.name}:{name} is not step {step}")
    if not {"big0", "s0"} <= names:
        raise AssertionError(f"export misses tensors: {sorted(names)[:5]}")
    return step


# --------------------------------------------------------------------------- processes


def after_fork_in_child() -> None:
    """Make a forked child able to save.

    The library's checksum pool is a module-level ThreadPoolExecutor; after
    ``fork`` its thread is gone but the executor believes it is idle, so the first
    checksum of a tensor >= 1 MiB waits forever (weakness ``fork-pool``, reported).
    Until the library resets it with ``os.register_at_fork`` we reset it here.
    """
    torch.set_num_threads(1)
    from functional_ckpt._src.storage import shards

    if hasattr(shards, "_POOL"):
        shards._POOL = None


def fork_child(work: Callable[[], None]) -> int:
    """Run ``work`` in a forked child that can only leave through ``os._exit``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            after_fork_in_child()
            work()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    return pid


def kill(pid: int) -> bool:
    """SIGKILL a child and reap it; False if it had already exited on its own (a bug)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def run_forked(fn: Callable[[], Any], timeout: float, mem_limit: int | None = None) -> Any:
    """``fn()`` in a forked child (isolated memory limit, hang guard); its JSON result.

    Returns ``{"hang": True}`` when the child does not answer within ``timeout``.
    """
    r, w = os.pipe()

    def work() -> None:
        os.close(r)
        if mem_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit, mem_limit))
        out = json.dumps(fn()).encode()
        os.write(w, out)

    pid = fork_child(work)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    os.set_blocking(r, False)
    try:
        while True:
            try:
                chunk = os.read(r, 1 << 16)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    kill(pid)
                    return {"hang": True}
                time.sleep(0.005)
                continue
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks) or b"null")


def vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_reset() -> bool:
    """Reset this process's peak RSS (VmHWM) so a later read measures one action."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_and_peak() -> tuple[int, int]:
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


# --------------------------------------------------------------------------- listing


def visible(root: Path) -> list[Path]:
    """Directories a user would take for checkpoints: not temporary, not manager files."""
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir() and not naming.is_temporary_name(p.name) and p.name != "exports"
    )


def temporaries(root: Path) -> list[Path]:
    out: list[Path] = []
    for parent in (root, root / "exports"):
        if parent.is_dir():
            out += [p for p in parent.iterdir() if naming.is_temporary_name(p.name)]
    return out


def snapshot(paths: list[Path], res: Result, load: Callable[[Path], int]) -> dict[str, int]:
    """name -> version of every visible entry; anything unreadable counts as torn."""
    seen: dict[str, int] = {}
    for p in paths:
        try:
            seen[p.name] = load(p)
        except Exception as e:
            res.problem("torn", f"{p}: {type(e).__name__}: {e}", column="torn")
    return seen


def check_kept(
    before: dict[str, int], after: dict[str, int], keep: int | None, res: Result
) -> None:
    """Every entry committed before the trial still exists and is at least as new.

    With a retention policy ``keep_last(keep)`` an entry may be gone only if at
    least ``keep`` newer ones exist.
    """
    for name, version in before.items():
        now = after.get(name)
        if now is not None and now >= version:
            continue
        if now is None and keep is not None and sum(v > version for v in after.values()) >= keep:
            continue
        res.problem("lost", f"{name} (version {version}) became {now}", column="lost")


# --------------------------------------------------------------------------- SIGKILL


def _child_loop(kind: str, root: Path, start: int) -> None:  # pragma: no cover - child
    """Save forever (the parent kills us): the workload of one kind of crash trial."""
    v = start
    if kind in ("sync", "async"):
        while True:
            name, overwrite = (f"ck{v:06d}", False) if v % 2 else ("ck_over", True)
            if kind == "sync":
                fc.save(root / name, make_state(v), overwrite=overwrite)
            else:
                pending = fc.save_async(root / name, make_state(v), overwrite=overwrite)
                pending.wait_staged()
                pending.result()
            v += 1
    export = fc.manager.Export(fc.every_steps(1), select="model") if kind == "export" else None
    with fc.CheckpointManager(root, keep=fc.keep_last(2), export=export) as mgr:
        v = (mgr.latest_step() or 0) + 1
        while True:
            mgr.maybe_save(make_state(v), step=v)
            v += 1


def _trim(root: Path, keep: int) -> None:
    """Keep the directory small between trials (old entries removed crash-safely)."""
    for parent in (root, root / "exports"):
        old = [p for p in visible(parent) if p.name != "ck_over"][:-keep]
        for p in old:
            aside = durable.tmp_sibling(p, naming.TRASH_INFIX)
            os.rename(p, aside)
            commit.remove_tree(aside)


def _damage_warning(category: type[Warning]) -> bool:
    """A warning that reports damage (a recovered leftover is a recovery, not damage)."""
    return issubclass(category, fc.errors.CheckpointWarning) and not issubclass(
        category, LeftoverWarning
    )


def _check_manager(root: Path, after: dict[str, int], res: Result) -> None:
    """A restarted writer cleans up; a reader resumes from the newest committed step."""
    with warnings.catch_warnings(record=True) as recovered:
        warnings.simplefilter("always", LeftoverWarning)
        with fc.CheckpointManager(root, keep=fc.keep_last(2)):
            pass  # opening a writer recovers or removes a crashed writer's temporaries
    res.bump("recovered", sum(issubclass(w.category, LeftoverWarning) for w in recovered))
    for t in temporaries(root):
        res.problem("temp-leak", f"{t} survived a writer's start")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr = fc.CheckpointManager(root, read_only=True)
        state = mgr.restore_latest()
    for w in caught:
        if _damage_warning(w.category):
            res.problem("skipped", str(w.message), column="torn")
    # The writer may have renamed a committed leftover back (killed between the marker
    # and the rename): the newest step is then one the snapshot before it did not see.
    now = snapshot(visible(root), res, check_whole)
    check_kept(after, now, None, res)
    newest = max(now.values(), default=None)
    got = None if state is None else state_version(state)
    if got != newest or mgr.restored_step != newest:
        res.problem("resume", f"restore_latest gave {got}/{mgr.restored_step}, newest {newest}")


def kill_trial(kind: str, root: Path, rng: random.Random, window: float, res: Result) -> None:
    """One SIGKILL at a random moment of a child saving in a loop; then check everything."""
    manager = kind in ("prune", "export")
    keep = 2 if manager else None
    if not manager:
        _trim(root, 4)
    before = snapshot(visible(root), res, check_whole)
    exports_before = snapshot(visible(root / "exports"), res, export_version)
    start = max(before.values(), default=0) + 1
    pid = fork_child(lambda: _child_loop(kind, root, start))
    time.sleep(rng.uniform(0.0, window))
    if not kill(pid):
        res.problem("child-died", f"the {kind} saver exited before it was killed")
    res.trials += 1
    res.bump("killed-mid-save", bool(temporaries(root)))
    after = snapshot(visible(root), res, check_whole)
    check_kept(before, after, keep, res)
    if kind == "export":
        exports_after = snapshot(visible(root / "exports"), res, export_version)
        check_kept(exports_before, exports_after, 2, res)
    for t in temporaries(root):
        try:
            fc.restore(t)
            res.problem("temp-readable", f"{t} restored", column="torn")
        except fc.CheckpointError:
            pass
    if manager:
        _check_manager(root, after, res)
    else:
        for t in temporaries(root):
            commit.remove_tree(t)


def save_seconds(base: Path) -> float:
    """How long one save of the crash state takes here: kills are spread over a few."""
    t0 = time.perf_counter()
    fc.save(base / "probe", make_state(1))
    dt = time.perf_counter() - t0
    shutil.rmtree(base / "probe")
    return dt


def scenario_kill(kind: str, scale: Scale, base: Path, seed: int) -> Result:
    res = Result(f"SIGKILL during {kind} saves" + (" (keep_last=2)" if kind == "prune" else ""))
    if kind == "export":
        res.scenario = "SIGKILL during exports"
    rng = random.Random(seed)
    window = max(0.05, 4 * save_seconds(base)) + 0.02  # fork + start-up, then ~4 saves
    root = base / f"kill-{kind}"
    root.mkdir()
    for _ in range(scale.kills_per_kind):
        kill_trial(kind, root, rng, rng.choice([window / 8, window]), res)
        if kind == "export":
            _trim(root / "exports", 4)
    res.bump("committed-at-end", len(visible(root)))
    return res


# --------------------------------------------------------------------------- mounts


def mount_tmpfs(path: Path, size: str, *, ro: bool = False) -> str | None:
    """Mount a small tmpfs at ``path``; None on success, else why it could not be."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if ro else "")
    try:
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run mount: {e}"
    if proc.returncode != 0:
        return f"mount -t tmpfs failed (needs root / CAP_SYS_ADMIN): {proc.stderr.strip()}"
    return None


def remount(path: Path, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", str(path)], check=True, timeout=20)


def umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, timeout=20, capture_output=True)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[str | None]:
    why = mount_tmpfs(path, size)
    try:
        yield why
    finally:
        if why is None:
            umount(path)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill_leaving(path: Path, leave: int) -> Path:
    """Fill the filesystem of ``path`` until only ``leave`` bytes are free."""
    filler = path / "filler.bin"
    need = max(0, free_bytes(path) - leave)
    with open(filler, "wb") as f:
        block = b"\0" * (1 << 16)
        while need > 0:
            try:
                need -= f.write(block[: min(need, len(block))])
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    break
                raise
    return filler


# --------------------------------------------------------------------------- disk full


def _expect_no_space(err: BaseException | None, res: Result, where: str) -> None:
    if err is None:
        return
    if not isinstance(err, fc.CheckpointError):
        res.problem("unclear-error", f"{where}: {type(err).__name__}: {err}")
    elif "space" not in str(err).lower():
        res.problem("unclear-error", f"{where}: message does not say 'no space': {err}")


def manager_has_async() -> bool:
    """Whether CheckpointManager saves in the background yet (``async_save=``)."""
    return "async_save" in inspect.signature(fc.CheckpointManager.__init__).parameters


DISK_FULL_MODES = ("sync", "async", "manager") + (("manager-async",) if manager_has_async() else ())


def _full_disk_save(mode: str, mnt: Path, v: int) -> BaseException | None:
    state = make_state(v, big=2, small=20)
    try:
        if mode == "sync":
            fc.save(mnt / f"ck{v:04d}", state)
        elif mode == "async":
            fc.save_async(mnt / f"ck{v:04d}", state).result()
        elif mode == "manager":
            with fc.CheckpointManager(mnt / "mgr", keep=fc.keep_last(1)) as mgr:
                mgr.maybe_save(state, step=v)
        else:  # the manager's own async saves: the failure surfaces on a later call
            opts: dict[str, Any] = {"async_save": True}
            with fc.CheckpointManager(mnt / "mgr", keep=fc.keep_last(1), **opts) as mgr:
                mgr.maybe_save(state, step=v)
                mgr.wait()
    except Exception as e:
        return e
    return None


def scenario_disk_full(scale: Scale, base: Path, seed: int) -> Result:
    """ENOSPC at every stage of a save on a real 8 MiB tmpfs, sync, async and managed."""
    res = Result("disk full mid-save (8 MiB tmpfs)")
    mnt = base / "full"
    with tmpfs(mnt, "8m") as why:
        if why is not None:
            res.skipped = why
            return res
        fc.save(mnt / "base", make_state(1, big=0, small=4))
        with fc.CheckpointManager(mnt / "mgr") as mgr:
            mgr.maybe_save(make_state(1, big=0, small=4), step=1)
        need = 2 * (1 << 20) + (1 << 18)  # the state written below, with headroom
        levels = [int(need * i / (scale.disk_full_steps - 1)) for i in range(scale.disk_full_steps)]
        v = 2
        for leave in levels:
            for mode in DISK_FULL_MODES:
                filler = fill_leaving(mnt, leave)
                err = _full_disk_save(mode, mnt, v)
                res.trials += 1
                res.bump("failed-cleanly" if err is not None else "fit")
                _expect_no_space(err, res, f"{mode} with {leave} B free")
                for t in temporaries(mnt) + temporaries(mnt / "mgr"):
                    res.problem("temp-leak", f"{mode} with {leave} B free left {t.name}")
                try:
                    check_whole(mnt / "base")
                    with fc.CheckpointManager(mnt / "mgr", read_only=True) as ro:
                        state_version(ro.restore_latest())
                except Exception as e:
                    res.problem("lost", f"{mode}: older checkpoint damaged: {e}", column="lost")
                filler.unlink()
                err = _full_disk_save(mode, mnt, v + 1)  # training continues
                if err is not None:
                    res.problem("cannot-continue", f"{mode} after freeing space: {err!r}")
                for p in visible(mnt):
                    if p.name not in ("base", "mgr"):
                        shutil.rmtree(p)
                v += 2
    return res


# --------------------------------------------------------------------------- destinations


def _expect_error(fn: Callable[[], Any], res: Result, tag: str, words: tuple[str, ...]) -> None:
    """``fn`` must raise a CheckpointError whose message has one of ``words``."""
    res.trials += 1
    try:
        fn()
    except fc.CheckpointError as e:
        if words and not any(w in str(e).lower() for w in words):
            res.problem("unclear-error", f"{tag}: {e}")
        return
    except Exception as e:
        res.problem("unclear-error", f"{tag}: {type(e).__name__}: {e}")
        return
    res.problem("no-error", f"{tag}: succeeded")


def _read_only_cases(base: Path, res: Result) -> None:
    mnt = base / "ro"
    why = mount_tmpfs(mnt, "8m")
    if why is not None:
        res.skipped = why
        return
    try:
        with fc.CheckpointManager(mnt / "run") as mgr:
            mgr.maybe_save(make_state(1, big=0, small=4), step=1)
        remount(mnt, "ro")
        words = ("read-only", "permission", "read only")
        st = make_state(2, big=0, small=4)
        _expect_error(lambda: fc.save(mnt / "ck", st), res, "ro: fc.save", words)
        _expect_error(lambda: fc.save_async(mnt / "ck", st).result(), res, "ro: async", words)
        _expect_error(
            lambda: fc.CheckpointManager(mnt / "run"), res, "ro: CheckpointManager(root)", words
        )
        res.trials += 1
        try:
            with fc.CheckpointManager(mnt / "run", read_only=True) as ro:
                state_version(ro.restore_latest())
        except Exception as e:
            res.problem("ro-reader", f"read-only manager on a read-only mount: {e!r}")
    finally:
        umount(mnt)


def _vanish_trial(base: Path, rng: random.Random, window: float, res: Result) -> None:
    """Remove the destination's parent while a large save writes into it."""
    parent = base / "vanish" / "run"
    parent.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()

    def remover() -> None:
        time.sleep(rng.uniform(0, window))
        while not stop.is_set():
            try:
                shutil.rmtree(parent)
                return
            except FileNotFoundError:
                return
            except OSError:
                continue  # a file appeared while we removed: try again

    th = threading.Thread(target=remover)
    th.start()
    res.trials += 1
    try:
        fc.save(parent / "ck", make_state(3, big=16, small=10))
        res.bump("saved-before-removal")
    except fc.CheckpointError:
        res.bump("failed-cleanly")
    except Exception as e:
        res.problem("unclear-error", f"destination removed: {type(e).__name__}: {e}")
    finally:
        stop.set()
        th.join()
    for t in temporaries(parent):
        res.problem("temp-leak", f"{t}")
    shutil.rmtree(base / "vanish", ignore_errors=True)
    try:
        fc.save(parent / "ck", make_state(4, big=0, small=2))  # training continues
        check_whole(parent / "ck")
    except Exception as e:
        res.problem("cannot-continue", f"after removal: {e!r}")
    shutil.rmtree(base / "vanish", ignore_errors=True)


def _file_cases(base: Path, res: Result) -> None:
    f = base / "a-file"
    f.write_text("not a checkpoint")
    st = make_state(1, big=0, small=2)
    _expect_error(lambda: fc.save(f, st), res, "file: fc.save(file)", ("not a checkpoint",))
    _expect_error(lambda: fc.save(f / "ck", st), res, "file: fc.save(file/ck)", ())
    _expect_error(lambda: fc.save_async(f, st).result(), res, "file: save_async(file)", ())
    _expect_error(lambda: fc.restore(f), res, "file: fc.restore(file)", ("file",))
    _expect_error(lambda: fc.verify(f), res, "file: fc.verify(file)", ("file",))
    _expect_error(lambda: fc.CheckpointManager(f), res, "file: CheckpointManager(file)", ())

    def reader() -> Any:
        return fc.CheckpointManager(f, read_only=True).restore_latest()

    _expect_error(reader, res, "file: read-only manager restore_latest(file)", ())
    if f.read_text() != "not a checkpoint":
        res.problem("clobbered", f"{f} was modified", column="lost")


def scenario_destinations(scale: Scale, base: Path, seed: int) -> Result:
    res = Result("read-only / vanishing / file destination")
    rng = random.Random(seed)
    _read_only_cases(base, res)
    t0 = time.perf_counter()
    fc.save(base / "probe", make_state(3, big=16, small=10))
    window = time.perf_counter() - t0
    shutil.rmtree(base / "probe")
    for _ in range(scale.vanish_trials):
        _vanish_trial(base, rng, window, res)
    _file_cases(base, res)
    if res.skipped:
        res.skipped = f"read-only cases skipped: {res.skipped}"
    return res


# --------------------------------------------------------------------------- corruption


def flip_bit(path: Path, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ (1 << bit)]))


def _mutations(files: list[Path], other: Path, scale: Scale, rng: random.Random) -> list[Any]:
    """(label, file name, action) for every corruption tried on one checkpoint."""
    out: list[Any] = []
    for f in files:
        size = f.stat().st_size
        if f.name == naming.COMMIT_MARKER and scale.exhaustive_marker:
            offsets = [(o, b) for o in range(size) for b in range(8)]
        elif f.suffix == ".distcp":
            # half in the first blob's zip headers, half anywhere (mostly tensor bytes)
            n = scale.flips_per_file
            offsets = [(rng.randrange(min(size, 256)), rng.randrange(8)) for _ in range(n // 2)]
            offsets += [(rng.randrange(size), rng.randrange(8)) for _ in range(n - n // 2)]
        else:
            n = scale.flips_per_file
            offsets = [(rng.randrange(size), rng.randrange(8)) for _ in range(n)]
        for o, b in offsets:
            out.append((f"bit flip @{o}.{b}", f.name, lambda p, o=o, b=b: flip_bit(p, o, b)))
        cut = rng.randrange(size) if size else 0
        out.append((f"truncate to {cut}", f.name, lambda p, cut=cut: os.truncate(p, cut)))
        out.append(("truncate to 0", f.name, lambda p: os.truncate(p, 0)))
        out.append(("delete", f.name, lambda p: os.unlink(p)))
        if f.suffix == ".distcp" and (other / f.name).exists():
            out.append(
                (
                    "swapped from another checkpoint",
                    f.name,
                    lambda p: shutil.copy(other / p.name, p),
                )
            )
    return out


def _detected_by_verify(path: Path) -> bool:
    try:
        return not fc.verify(path).ok
    except fc.CheckpointError:
        return True


def _detected_by_restore(path: Path, res: Result, label: str) -> bool:
    try:
        state = fc.restore(path)
    except fc.CheckpointError:
        return True
    except Exception as e:
        res.problem("unclear-error", f"{label}: restore raised {type(e).__name__}: {e}")
        return True
    try:
        if state_version(state) != 2:
            raise AssertionError("wrong version")
    except Exception as e:
        res.problem("wrong-data", f"{label}: restore returned damaged data: {e}", column="torn")
    return False


def scenario_corruption(scale: Scale, base: Path, seed: int) -> Result:
    """Every file of the newest checkpoint damaged in turn; verify, restore and resume see it."""
    res = Result("corruption: bit flips / truncation / deletion / swap")
    rng = random.Random(seed)
    root = base / "corrupt"
    small = {"big": 1, "small": 12}
    with fc.CheckpointManager(root) as mgr:
        mgr.maybe_save(make_state(1, **small), step=1)
        mgr.maybe_save(make_state(2, **small), step=2)
    newest = root / "step_000000002"
    pristine = base / "pristine"
    shutil.copytree(newest, pristine)
    other = base / "other"
    fc.save(other, make_state(7, **small))
    files = sorted(p for p in pristine.iterdir() if p.is_file())
    for label, name, action in _mutations(files, other, scale, rng):
        shutil.rmtree(newest)
        shutil.copytree(pristine, newest)
        action(newest / name)
        full = f"{name}: {label}"
        res.trials += 1
        res.corruptions += 1
        by_verify = _detected_by_verify(newest)
        by_restore = _detected_by_restore(newest, res, full)
        # ``.metadata`` is for stock readers: a restore never reads it (its tensors are
        # intact and restored exactly, checked above); verify must report it.
        unread = name == naming.DCP_METADATA
        res.bump("verify", by_verify)
        res.bump("restore", by_restore)
        if by_verify and (by_restore or unread):
            res.detected += 1
        else:
            missed = [
                w for w, ok in (("verify", by_verify), ("restore", by_restore or unread)) if not ok
            ]
            res.bump(f"missed:{name}")
            if len(res.problems) < 40:
                res.problems.append(f"missed-by-{'+'.join(missed)}: {full}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reader = fc.CheckpointManager(root, read_only=True)
            try:
                got = reader.restore_latest()
                ok = got is not None and state_version(got) == reader.restored_step
                fell_back = reader.restored_step == 1
            except Exception as e:
                res.problem("resume", f"{full}: restore_latest raised {e!r}")
                continue
        if not ok:
            res.problem("wrong-data", f"{full}: restore_latest returned bad data", column="torn")
        elif by_restore and not fell_back:
            res.problem("resume", f"{full}: manager did not fall back to step 1")
        res.bump("manager-fell-back", fell_back)
    return res


# --------------------------------------------------------------------------- hostile


class Payload:
    """Pickles to ``os.system("touch MARKER")``: it must never run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _signed_version(raw: bytes) -> int:
    """The version an attacker signs ``raw`` with: the one it says, so that only what
    it holds is tested (1 for bytes that do not decode to a manifest)."""
    try:
        version = codec.decode(raw).get("version")  # type: ignore[union-attr]
    except Exception:
        return 1
    return version if type(version) is int and version >= 1 else 1


def resign(path: Path, raw: bytes) -> None:
    """Install ``raw`` as the manifest and sign it, as an attacker owning the files would."""
    (path / naming.MANIFEST).write_bytes(raw)
    os.unlink(path / naming.COMMIT_MARKER)
    commit.write_commit_marker(path, raw, version=_signed_version(raw))


def edit_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    manifest = codec.decode((path / naming.MANIFEST).read_bytes())
    assert isinstance(manifest, dict)
    edit(manifest)
    resign(path, codec.encode(manifest))


def _tensor_entries(m: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in m["entries"] if e.get("kind") == "tensor" and "alias" not in e]


def _shard_names(m: dict[str, Any]) -> list[str]:
    return [n for n in m["files"] if n.endswith(".distcp")]


def _rename_file(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        shard = _shard_names(m)[0]
        m["files"][name] = m["files"].pop(shard)
        for e in m["entries"]:
            if e.get("file") == shard:
                e["file"] = name

    return edit


def _declare(e: dict[str, Any], shape: list[int], nbytes: int) -> None:
    """Give a tensor entry (and its chunk records, if the format has them) a new size."""
    e["shape"] = shape
    targets = e.get("chunks") or [e]
    for c in targets:
        c["nbytes"] = nbytes
        if "sizes" in c:
            c["sizes"] = list(shape)
            c["offsets"] = [0] * len(shape)


def _huge_tensor(m: dict[str, Any]) -> None:
    e = next(e for e in _tensor_entries(m) if e["dtype"] == "float32")
    _declare(e, [1 << 40], 4 << 40)


def _zero_overflow(m: dict[str, Any]) -> None:
    _declare(_tensor_entries(m)[0], [0, 1 << 64], 0)


def _raw_manifest(raw: bytes) -> Callable[[Path], None]:
    return lambda p: resign(p, raw)


def _symlink_each(name: str, outside: Path) -> Callable[[Path], None]:
    def act(p: Path) -> None:
        target = outside / f"{p.name}-{name}"
        shutil.copy(p / name, target)
        os.unlink(p / name)
        os.symlink(target, p / name)

    return act


def _all_symlinks(outside: Path) -> Callable[[Path], None]:
    def act(p: Path) -> None:
        real = outside / "real-copy"
        shutil.copytree(p, real)
        for f in list(p.iterdir()):
            os.unlink(f)
            os.symlink(real / f.name, f)

    return act


def _hostile_metadata(marker: Path, resigned: bool) -> Callable[[Path], None]:
    def act(p: Path) -> None:
        raw = pickle.dumps(Payload(marker))
        (p / naming.DCP_METADATA).write_bytes(raw)
        if resigned:
            import zlib

            def edit(m: dict[str, Any]) -> None:
                m["files"][naming.DCP_METADATA] = {"size": len(raw), "crc32": zlib.crc32(raw)}

            edit_manifest(p, edit)

    return act


def _stock_dcp_pickle(marker: Path) -> Callable[[Path], None]:
    def act(p: Path) -> None:
        for f in list(p.iterdir()):
            os.unlink(f)
        (p / naming.DCP_METADATA).write_bytes(pickle.dumps(Payload(marker)))

    return act


def _sparse(name: str, size: int) -> Callable[[Path], None]:
    """Replace ``name`` by a sparse file of ``size`` bytes (costs no disk, reads as zeros)."""

    def act(p: Path) -> None:
        with open(p / name, "r+b") as f:
            f.truncate(size)

    return act


#: Cases that damage only a file derived from the manifest (``.metadata``): our readers
#: never read it, so restoring the intact tensors exactly is correct; verify reports it.
DERIVED_ONLY = {
    ".metadata pickle runs os.system",
    ".metadata pickle, re-signed in the manifest",
    "1.5 GiB sparse .metadata",
    ".metadata is a symlink outside",
}


def hostile_cases(marker: Path, outside: Path) -> list[tuple[str, Callable[[Path], None]]]:
    """(name, tamper) for each hostile checkpoint, applied to a fresh valid checkpoint."""
    cases: list[tuple[str, Callable[[Path], None]]] = [
        (".metadata pickle runs os.system", _hostile_metadata(marker, False)),
        (".metadata pickle, re-signed in the manifest", _hostile_metadata(marker, True)),
        ("stock-DCP dir with a hostile .metadata", _stock_dcp_pickle(marker)),
        (
            "manifest names ../escape.distcp",
            lambda p: edit_manifest(p, _rename_file("../x.distcp")),
        ),
        ("manifest names /etc/passwd", lambda p: edit_manifest(p, _rename_file("/etc/passwd"))),
        ("manifest names ..", lambda p: edit_manifest(p, _rename_file(".."))),
        ("tensor declares 4 TiB", lambda p: edit_manifest(p, _huge_tensor)),
        ("tensor shape [0, 2**64]", lambda p: edit_manifest(p, _zero_overflow)),
        ("10^6-deep nested arrays", _raw_manifest(b"\x91" * 1_000_000 + b"\xc0")),
        ("map declaring 2^32-1 entries", _raw_manifest(b"\xdf\xff\xff\xff\xff")),
        ("array declaring 2^32-1 items", _raw_manifest(b"\xdd\xff\xff\xff\xff")),
        ("bin declaring 1 GiB", _raw_manifest(b"\xc6\x40\x00\x00\x00" + b"\0" * 16)),
        ("str declaring 4 GiB", _raw_manifest(b"\xdb\xff\xff\xff\xff" + b"a" * 16)),
        ("1.5 GiB sparse manifest", _sparse(naming.MANIFEST, 3 << 29)),
        ("1.5 GiB sparse .metadata", _sparse(naming.DCP_METADATA, 3 << 29)),
        ("checkpoint dir full of symlinks", _all_symlinks(outside)),
    ]
    for name in ("__0_0.distcp", naming.DCP_METADATA, naming.MANIFEST, naming.COMMIT_MARKER):
        cases.append((f"{name} is a symlink outside", _symlink_each(name, outside)))
    return cases


def _probe_load(path: Path) -> dict[str, Any]:
    """In the child: restore, verify and resume a hostile checkpoint; report outcomes and RSS."""
    out: dict[str, Any] = {}
    reset = peak_rss_reset()
    rss0, _ = rss_and_peak()
    template = {"model": {"big0": torch.zeros(1 << 18)}}
    for what, fn in (
        ("restore", lambda: fc.restore(path)),
        ("restore(template)", lambda: fc.restore(path, template, partial=True)),
        ("verify", lambda: fc.verify(path)),
        ("manager", lambda: fc.CheckpointManager(path.parent, read_only=True).restore_latest()),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                value = fn()
            ok = value.ok if isinstance(value, fc.checkpoint.VerifyReport) else True
            exact = ""
            if what in ("restore", "manager") and value is not None:
                try:
                    exact = "exact" if state_version(value) == 1 else "wrong"
                except AssertionError as e:
                    exact = f"wrong: {e}"
            out[what] = ["ok" if ok else "reported", exact]
        except BaseException as e:
            out[what] = [type(e).__name__, str(e)[:300]]
    _, hwm = rss_and_peak()
    out["peak_rss_growth"] = hwm - rss0 if reset else -1
    return out


SAFE_ERRORS = {
    "UnsafeCheckpoint",
    "CorruptCheckpoint",
    "CheckpointNotFound",
    "IncompleteCheckpoint",
    "CheckpointError",
}


def scenario_hostile(scale: Scale, base: Path, seed: int) -> Result:
    """Hostile checkpoints loaded in a forked child under a memory limit and a hang guard."""
    res = Result("hostile checkpoints")
    marker = base / "PWNED"
    outside = base / "outside"
    outside.mkdir()
    limit = vm_size() + (768 << 20)
    for i, (name, tamper) in enumerate(hostile_cases(marker, outside)):
        root = base / f"hostile{i}"
        path = root / "step_000000001"
        fc.save(path, make_state(1, big=1, small=4))
        tamper(path)
        res.trials += 1
        out = run_forked(lambda path=path: _probe_load(path), timeout=60, mem_limit=limit)
        if marker.exists():
            res.problem("executed", name, column="executed")
            marker.unlink()
        if out is None or out.get("hang"):
            res.problem("hang", f"{name}: no answer within 60 s")
            continue
        res.corruptions += 1
        caught = True
        for what in ("restore", "restore(template)", "verify", "manager"):
            kind, msg = out[what]
            if kind == "ok" and name in DERIVED_ONLY and what != "verify":
                # Only a derived file is hostile; our readers never use it, the tensors
                # are intact: restoring them exactly is right, verify must report it.
                if msg.startswith("wrong"):
                    res.problem("torn", f"{name}: {what} returned {msg}", column="torn")
                continue
            if kind in ("ok",):
                caught = False
                if what != "restore(template)" and len(res.problems) < 40:
                    res.problems.append(f"accepted: {name}: {what} accepted it")
                res.bump(f"accepted:{what}")
            elif kind not in SAFE_ERRORS and kind != "reported":
                caught = False
                tag = "allocation" if kind in ("MemoryError", "RuntimeError") else "unclear-error"
                res.problem(tag, f"{name}: {what} raised {kind}: {msg}")
        if out["peak_rss_growth"] > (256 << 20):
            res.problem("allocation", f"{name}: peak RSS grew {out['peak_rss_growth'] >> 20} MiB")
        if caught:
            res.detected += 1
        shutil.rmtree(root, ignore_errors=True)
    return res


# --------------------------------------------------------------------------- concurrency


def _writer(root: Path, secs: float) -> None:  # pragma: no cover - child
    with fc.CheckpointManager(root, keep=fc.keep_last(2)) as mgr:
        v = (mgr.latest_step() or 0) + 1
        end = time.monotonic() + secs
        while time.monotonic() < end:
            mgr.maybe_save(make_state(v, big=1, small=10), step=v)
            v += 1


def _two_writers(base: Path, res: Result) -> None:
    root = base / "two"
    with fc.CheckpointManager(root):
        _expect_error(lambda: fc.CheckpointManager(root), res, "second writer", ("another",))
    r, w = os.pipe()

    def hold() -> None:
        with fc.CheckpointManager(root):
            os.write(w, b"x")
            time.sleep(60)

    pid = fork_child(hold)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    _expect_error(
        lambda: fc.CheckpointManager(root), res, "writer in another process", ("another",)
    )
    kill(pid)
    res.trials += 1
    try:
        fc.CheckpointManager(root).close()  # a SIGKILLed holder's lock is taken over
    except Exception as e:
        res.problem("lock-takeover", f"after the holder was killed: {e!r}")


def _follow(root: Path, secs: float, res: Result) -> None:
    """Readers (manager and bare fc.restore) following a writer that saves and prunes."""
    pid = fork_child(lambda: _writer(root, secs))
    end = time.monotonic() + secs
    reader = fc.CheckpointManager(root, read_only=True)
    try:
        while time.monotonic() < end:
            res.trials += 1
            try:
                state = reader.restore_latest()
                if state is not None and state_version(state) != reader.restored_step:
                    res.problem("torn", "restore_latest: version != step", column="torn")
                res.bump("manager-read")
            except fc.CheckpointError as e:
                res.bump("manager-raced")
                res.problem("resume", f"restore_latest while following: {e}")
            except AssertionError as e:
                res.problem("torn", f"restore_latest returned mixed data: {e}", column="torn")
            cands = [p for p in visible(root) if (p / naming.COMMIT_MARKER).exists()]
            if not cands:
                continue
            res.trials += 1
            try:
                state_version(fc.restore(cands[-1]))
                res.bump("restore-read")
            except fc.CheckpointError:
                res.bump("restore-raced")  # pruned while we read it: a clear error
            except AssertionError as e:
                res.problem("torn", f"fc.restore returned mixed data: {e}", column="torn")
            except Exception as e:
                res.problem("unclear-error", f"prune racing fc.restore: {type(e).__name__}: {e}")
    finally:
        _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        res.problem("writer-failed", f"the followed writer ended with status {status}")


def scenario_concurrency(scale: Scale, base: Path, seed: int) -> Result:
    res = Result("concurrency: 2 writers / follower / prune vs restore")
    _two_writers(base, res)
    _follow(base / "follow", scale.follow_secs, res)
    return res


# --------------------------------------------------------------------------- storage hardening


class SyscallLog:
    """Records creations, fsyncs (path, size at the time) and renames, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> SyscallLog:
        real_fsync, real_open, real_rename = os.fsync, os.open, os.rename
        real_mkdir = Path.mkdir
        self._saved = {"fsync": real_fsync, "open": real_open, "rename": real_rename}
        self._mkdir = real_mkdir

        def fsync(fd: Any) -> None:
            fd = fd if isinstance(fd, int) else fd.fileno()
            real_fsync(fd)
            st = os.fstat(fd)
            size = -1 if os.path.isdir(f"/proc/self/fd/{fd}") else st.st_size
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), size))

        def open_(path: Any, flags: int, *a: Any, **k: Any) -> int:
            if flags & os.O_CREAT:
                self.events.append(("create", os.path.abspath(path), 0))
            return real_open(path, flags, *a, **k)

        def rename(a: Any, b: Any, *args: Any, **kwargs: Any) -> None:
            real_rename(a, b, *args, **kwargs)
            self.events.append(("renamed", os.path.abspath(b), 0))

        def mkdir(path: Path, *a: Any, **k: Any) -> None:
            real_mkdir(path, *a, **k)
            self.events.append(("mkdir", str(path.absolute()), 0))

        real_exchange = commit._exchange

        def exchange(a: Path, b: Path) -> bool:
            done = real_exchange(a, b)
            if done:
                self.events.append(("renamed", os.path.abspath(b), 0))
            return done

        self._exchange = real_exchange
        os.fsync, os.open, os.rename = fsync, open_, rename  # type: ignore[assignment]
        Path.mkdir = mkdir  # type: ignore[method-assign]
        commit._exchange = exchange
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync = self._saved["fsync"]
        os.open = self._saved["open"]
        os.rename = self._saved["rename"]
        Path.mkdir = self._mkdir  # type: ignore[method-assign]
        commit._exchange = self._exchange

    def first(self, kind: str, pred: Callable[[str, int], bool]) -> int:
        for i, (k, name, size) in enumerate(self.events):
            if k == kind and pred(name, size):
                return i
        return -1


def durability_violations(log: SyscallLog, dest: Path, created: list[Path]) -> list[str]:
    """What a power loss at the wrong moment could take: files, directory, ancestors."""
    out: list[str] = []
    marker = log.first("create", lambda n, _: n.endswith("/" + naming.COMMIT_MARKER))
    if marker < 0:
        return ["no commit marker was written"]
    tmp = Path(log.events[marker][1]).parent
    for f in sorted(dest.iterdir()):
        size = f.stat().st_size
        at = log.first("fsync", lambda n, s, f=f, size=size: n == str(tmp / f.name) and s == size)
        if at < 0 or (f.name != naming.COMMIT_MARKER and at > marker):
            out.append(f"{f.name} not fsynced at its final size ({size} B) before the marker")
    synced = log.first("fsync", lambda n, s: n == str(tmp) and s == -1)
    renamed = log.first("renamed", lambda n, _: n == str(dest.absolute()))
    after = [
        i
        for i, (k, n, _) in enumerate(log.events)
        if k == "fsync" and n == str(dest.parent.absolute()) and i > renamed
    ]
    if not 0 <= synced < renamed or not after:
        out.append("directory not fsynced before the rename, or parent not after it")
    for d in created:
        made = log.first("mkdir", lambda n, _, d=d: n == str(d.absolute()))
        ok = [
            i
            for i, (k, n, _) in enumerate(log.events)
            if k == "fsync" and n == str(d.parent.absolute()) and i > made >= 0
        ]
        if not ok:
            out.append(f"new directory {d.name} never fsynced into its parent")
    return out


def scenario_durability(scale: Scale, base: Path, seed: int) -> Result:
    """Syscall order of every way to save: fsync at final size, marker last, ancestors."""
    res = Result("durability: fsync order of save / async / manager / overwrite")
    for i in range(max(1, scale.vanish_trials)):
        for mode in ("save", "async", "manager", "overwrite", "dist-commit"):
            top = base / f"d{i}-{mode}"
            dest = top / "x" / "ck"
            created = [top, top / "x"]
            if mode == "overwrite":
                fc.save(dest, make_state(1, big=1, small=4))
                created = []
            with SyscallLog() as log:
                if mode in ("save", "overwrite"):
                    fc.save(dest, make_state(2, big=1, small=4), overwrite=mode == "overwrite")
                elif mode == "async":
                    fc.save_async(dest, make_state(2, big=1, small=4)).result()
                elif mode == "manager":
                    with fc.CheckpointManager(top / "x") as mgr:
                        mgr.maybe_save(make_state(2, big=1, small=4), step=2)
                    dest = top / "x" / "step_000000002"
                else:
                    _commit_like_coordinator(dest)
            res.trials += 1
            bad = durability_violations(log, dest, created)
            res.bump("files-checked", sum(1 for _ in dest.iterdir()))
            for b in bad:
                res.problem("durability", f"{mode}: {b}", column="lost")
            shutil.rmtree(top, ignore_errors=True)
    return res


def _commit_like_coordinator(dest: Path) -> None:
    """The commit the distributed coordinator makes too (``local.finalize``), in one process."""
    fc.save(dest, make_state(2, big=1, small=4))


_SPECIAL_KINDS = ("fifo", "directory", "symlink", "device")


def _make_special(target: Path, kind: str) -> bool:
    if target.exists() or target.is_symlink():
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            os.unlink(target)
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "directory":
        target.mkdir()
    elif kind == "symlink":
        os.symlink("/dev/zero", target)
    else:
        try:
            os.mknod(target, 0o600 | 0o020000, os.stat("/dev/null").st_rdev)
        except OSError:
            return False
    return True


def _special_probe(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for what, fn in (
        ("restore", lambda: fc.restore(path)),
        ("inspect", lambda: fc.inspect(path)),
        ("verify", lambda: fc.verify(path)),
        ("manager", lambda: fc.CheckpointManager(path.parent, read_only=True).restore_latest()),
    ):
        try:
            value = fn()
            ok = value.ok if isinstance(value, fc.checkpoint.VerifyReport) else True
            out[what] = ["ok" if ok else "reported", "" if ok else str(value)]
        except BaseException as e:
            out[what] = [type(e).__name__, str(e)[:300]]
    return out


def scenario_special_files(scale: Scale, base: Path, seed: int) -> Result:
    """A FIFO, directory, symlink or device in place of every file, on every read path."""
    res = Result("special files on every read path")
    names = [naming.COMMIT_MARKER, naming.MANIFEST, naming.DCP_METADATA, "__0_0.distcp"]
    heads = names[:2]
    for name in names:
        for kind in _SPECIAL_KINDS:
            root = base / f"sp-{name.strip('.')}-{kind}"
            path = root / "step_000000001"
            fc.save(path, make_state(1, big=1, small=4))
            if not _make_special(path / name, kind):
                res.bump("device-skipped")
                continue
            res.trials += 1
            res.corruptions += 1
            out = run_forked(lambda path=path: _special_probe(path), timeout=30)
            if out is None or out.get("hang"):
                res.problem("hang", f"{name} as a {kind}: no answer within 30 s")
                continue
            if scale.cli_each or (name == naming.DCP_METADATA and kind == "fifo"):
                out["cli"] = _cli_inspect(path)
            caught = True
            for what, (kind_, msg) in out.items():
                if kind_ == "hang":
                    res.problem("hang", f"{name} as a {kind}: fckpt inspect hung")
                    caught = False
                elif kind_ == "ok" and what == "manager":
                    continue  # nothing else to fall back to: it reports no checkpoint
                elif kind_ == "ok" and name == naming.DCP_METADATA and what != "verify":
                    continue  # for stock readers: never read by ours; verify reports it
                elif kind_ == "ok" and what in ("inspect", "cli") and name not in heads:
                    continue  # inspect reads the marker and the manifest alone
                elif kind_ == "ok":
                    caught = False
                    res.problem("accepted", f"{name} as a {kind}: {what} accepted it")
                elif kind_ not in SAFE_ERRORS and kind_ != "reported":
                    caught = False
                    res.problem("unclear-error", f"{name} as a {kind}: {what}: {kind_}: {msg}")
                elif name not in msg:
                    res.problem("unnamed", f"{name} as a {kind}: {what} did not name the file")
            res.detected += caught
            shutil.rmtree(root, ignore_errors=True)
    return res


def _cli_inspect(path: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "functional_ckpt", "inspect", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        return ["hang", ""]
    if proc.returncode == 0:
        return ["ok", ""]
    if "Traceback" in proc.stderr:
        return ["traceback", proc.stderr[-300:]]
    return ["CheckpointError", proc.stdout + proc.stderr]


def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _u(text: str) -> bytes:
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


_DCP_MD = "torch.distributed.checkpoint.metadata"

#: Pickle fragments that try to change the loading process, each followed (in
#: ``unpickler_attacks``) by a genuine DCP ``Metadata``, so a loader that only
#: filters globals would return a valid result after the damage is done.
ATTACK_PREFIXES: dict[str, bytes] = {
    "BUILD slot state on PosixPath (patch __truediv__)": _g("pathlib", "PosixPath")
    + b"N}"
    + _u("__truediv__")
    + _g("collections", "OrderedDict")
    + b"s\x86b0",
    "BUILD dict state on torch.serialization._get_layout (poison its cache)": _g(
        "torch.serialization", "_get_layout"
    )
    + b"}"
    + _u("cache")
    + b"}"
    + _u("torch.strided")
    + _g("torch", "sparse_coo")
    + b"ssb0",
    "BUILD on a shared enum member": _g(_DCP_MD, "_MEM_FORMAT_ENCODING")
    + b"K\x00\x85R}"
    + _u("_value_")
    + b"K\x07sb0",
    "BUILD slot state on the Metadata class": _g(_DCP_MD, "Metadata")
    + b"N}"
    + _u("__eq__")
    + _g("torch", "Size")
    + b"s\x86b0",
    "BUILD on TensorProperties class (default dtype)": _g(_DCP_MD, "TensorProperties")
    + b"N}"
    + _u("dtype")
    + _g("torch", "float64")
    + b"s\x86b0",
    "SETITEM on a class": _g("collections", "OrderedDict") + _u("x") + b"Ns0",
    "APPEND to a class": _g("torch", "Size") + b"Na0",
    "REDUCE os.system": _g("os", "system") + _u("true") + b"\x85R0",
    "REDUCE _get_layout with a poisoned name": _g("torch.serialization", "_get_layout")
    + _u("torch.sparse_coo")
    + b"\x85R0",
    "copyreg._reconstructor": _g("copyreg", "_reconstructor") + b"0",
    "protocol-0 INST": b"(i" + b"pathlib\nPosixPath\n" + b"0",
}


def genuine_metadata(base: Path) -> bytes:
    """A real ``.metadata`` of this library's writer, as protocol-2 pickle without PROTO."""
    path = base / "genuine"
    if not path.exists():
        fc.save(path, make_state(1, big=1, small=4))
    md = pickle.loads((path / naming.DCP_METADATA).read_bytes())
    return pickle.dumps(md, protocol=2)[2:]


def unpickler_attacks(base: Path) -> dict[str, bytes]:
    tail = genuine_metadata(base)
    return {name: b"\x80\x02" + prefix + tail for name, prefix in ATTACK_PREFIXES.items()}


def allowed_snapshot() -> dict[str, Any]:
    """Every attribute of every allow-listed global (and its type), and torch's caches."""
    from functional_ckpt._src.format import unpickler

    out: dict[str, Any] = {}
    seen: set[int] = set()
    for key, obj in unpickler.ALLOWED.items():
        for o in (obj, type(obj), *getattr(obj, "__mro__", ())):
            if id(o) in seen or o is object or o is type:
                continue
            seen.add(id(o))
            d = getattr(o, "__dict__", None)
            if d is not None:
                out[f"{key}:{id(o)}"] = {k: id(v) for k, v in dict(d).items()}
            for attr in ("__code__", "__defaults__", "__kwdefaults__"):
                if hasattr(o, attr):
                    out[f"{key}:{attr}"] = id(getattr(o, attr))
    import torch.serialization as ser

    out["layout-cache"] = dict(getattr(ser._get_layout, "cache", {}))
    for member in unpickler._MEM_FORMAT_ENCODING:
        out[f"enum:{member.name}"] = dict(vars(member))
    return out


def _install_metadata(path: Path, raw: bytes) -> None:
    import zlib

    (path / naming.DCP_METADATA).write_bytes(raw)

    def edit(m: dict[str, Any]) -> None:
        m["files"][naming.DCP_METADATA] = {"size": len(raw), "crc32": zlib.crc32(raw)}

    edit_manifest(path, edit)


def _unpickler_probe(raw: bytes, base: Path) -> dict[str, Any]:
    from functional_ckpt._src.format import unpickler

    before = allowed_snapshot()
    out: dict[str, Any] = {}
    stock = base / "stock"
    stock.mkdir()
    (stock / naming.DCP_METADATA).write_bytes(raw)
    ours = base / "ours"
    fc.save(ours, make_state(1, big=1, small=4))
    _install_metadata(ours, raw)
    for what, fn in (
        ("load", lambda: unpickler.load_foreign(raw, base / ".metadata")),
        ("stock restore", lambda: fc.restore(stock, {"model": {}}, partial=True)),
        ("stock inspect", lambda: fc.inspect(stock)),
        ("verify", lambda: fc.verify(ours)),
    ):
        try:
            value = fn()
            ok = value.ok if isinstance(value, fc.checkpoint.VerifyReport) else True
            out[what] = "ok" if ok else "reported"
        except BaseException as e:
            out[what] = type(e).__name__
    out["changed"] = sorted(k for k, v in allowed_snapshot().items() if before.get(k) != v)
    return out


def scenario_unpickler(scale: Scale, base: Path, seed: int) -> Result:
    """Pickles that set attributes on allowed classes/functions, then build real Metadata."""
    res = Result("unpickler attribute attacks")
    for i, (name, raw) in enumerate(unpickler_attacks(base).items()):
        work = base / f"u{i}"
        work.mkdir()
        res.trials += 1
        res.corruptions += 1
        out = run_forked(lambda raw=raw, work=work: _unpickler_probe(raw, work), timeout=60)
        if out is None or out.get("hang"):
            res.problem("hang", f"{name}: no answer within 60 s")
            continue
        if out["changed"]:
            res.problem("attribute-changed", f"{name}: {out['changed'][:5]}", column="executed")
        res.bump("attributes-changed", len(out["changed"]))
        refused = all(out[w] in ("UnsafeCheckpoint", "reported") for w in out if w != "changed")
        if refused:
            res.detected += 1
        else:
            res.problem("accepted", f"{name}: {out}")
    return res


def _derived_cases() -> list[tuple[str, bool, Callable[[Any, Path], Any]]]:
    """(name, honest, edit of the loaded Metadata) for .metadata-vs-manifest disagreements."""

    def abs_path(md: Any, base: Path) -> None:
        for info in md.storage_data.values():
            info.relative_path = str(base / "elsewhere.distcp")

    def length(md: Any, base: Path) -> None:
        next(iter(md.storage_data.values())).length += 8

    def offset(md: Any, base: Path) -> None:
        next(iter(md.storage_data.values())).offset += 1

    def dtype(md: Any, base: Path) -> None:
        next(iter(md.state_dict_metadata.values())).properties.dtype = torch.int32

    def size(md: Any, base: Path) -> None:
        smd = next(iter(md.state_dict_metadata.values()))
        smd.size = torch.Size([*smd.size, 1])

    def chunk(md: Any, base: Path) -> None:
        next(iter(md.state_dict_metadata.values())).chunks[0].offsets = torch.Size([1])

    def planner(md: Any, base: Path) -> None:
        key = next(iter(md.planner_data))
        md.planner_data[key] = ("elsewhere",)

    def missing(md: Any, base: Path) -> None:
        md.state_dict_metadata.pop(next(iter(md.state_dict_metadata)))

    def extra(md: Any, base: Path) -> None:
        md.state_dict_metadata["injected"] = next(iter(md.state_dict_metadata.values()))

    def honest(md: Any, base: Path) -> None:
        pass

    return [
        ("storage points at an absolute path", False, abs_path),
        ("storage length differs", False, length),
        ("storage offset differs", False, offset),
        ("dtype differs", False, dtype),
        ("size differs", False, size),
        ("chunk box differs", False, chunk),
        ("key path (planner data) differs", False, planner),
        ("a tensor is missing", False, missing),
        ("an extra tensor", False, extra),
        ("same content, other pickle bytes (another torch)", True, honest),
    ]


def scenario_derived(scale: Scale, base: Path, seed: int) -> Result:
    """A re-signed .metadata that disagrees with the manifest: verify must report it."""
    res = Result("derived file (.metadata) vs manifest")
    for i, (name, honest, edit) in enumerate(_derived_cases()):
        path = base / f"dv{i}"
        fc.save(path, make_state(1, big=1, small=4))
        md = pickle.loads((path / naming.DCP_METADATA).read_bytes())
        edit(md, base)
        _install_metadata(path, pickle.dumps(md, protocol=2))
        res.trials += 1
        try:
            if state_version(fc.restore(path)) != 1:
                raise AssertionError("wrong version")
        except Exception as e:
            res.problem("restore", f"{name}: restore failed on intact tensors: {e}", column="torn")
        ok = fc.verify(path).ok
        if honest:
            res.bump("honest-accepted", ok)
            if not ok:
                res.problem("false-alarm", f"{name}: verify reported an honest .metadata")
        else:
            res.corruptions += 1
            res.detected += not ok
            if ok:
                res.problem("accepted", f"{name}: verify said OK")
    return res


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def scenario_overwrite_scope(scale: Scale, base: Path, seed: int) -> Result:
    """overwrite=True aimed at things that are not checkpoints: refused, left intact."""
    res = Result("overwrite scope")
    root = base / "run"
    with fc.CheckpointManager(root, keep=fc.keep_last(5)) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(make_state(step, big=1, small=4), step=step)
    (root / "notes.txt").write_text("mine")
    src = base / "project"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("x = 1\n")
    nonempty = base / "data"
    nonempty.mkdir()
    (nonempty / "a.bin").write_bytes(b"123")
    ck = base / "ck"
    fc.save(ck, make_state(1, big=1, small=4))
    state = make_state(9, big=1, small=4)
    attempts: list[tuple[str, Path, Callable[[Path], Any]]] = []
    for label, target in (("manager root", root), ("source tree", src), ("data dir", nonempty)):
        attempts += [
            (f"fc.save onto a {label}", target, lambda t: fc.save(t, state, overwrite=True)),
            (
                f"fc.save_async onto a {label}",
                target,
                lambda t: fc.save_async(t, state, overwrite=True).result(),
            ),
            (
                f"export onto a {label}",
                target,
                lambda t: fc.export_safetensors(ck, t, overwrite=True),
            ),
        ]
        if scale.cli_each or label == "source tree":
            attempts.append(
                (f"fckpt export --overwrite onto a {label}", target, lambda t: _cli_export(ck, t))
            )
    for label, target, act in attempts:
        before = _tree(target)
        res.trials += 1
        try:
            act(target)
            res.problem("accepted", f"{label}: it was replaced", column="lost")
        except fc.errors.CheckpointExists:
            res.bump("refused")
        except Exception as e:
            res.problem("unclear-error", f"{label}: {type(e).__name__}: {e}")
        if _tree(target) != before:
            res.problem("lost", f"{label}: files changed or deleted", column="lost")
    return res


def _cli_export(ck: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "functional_ckpt", "export", str(ck), str(out), "--overwrite"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if proc.returncode == 0:
        return
    if "Traceback" in proc.stderr:
        raise RuntimeError(proc.stderr[-300:])
    raise fc.errors.CheckpointExists(proc.stderr.strip())


def scenario_overwrite_race(scale: Scale, base: Path, seed: int) -> Result:
    """Readers racing fc.save(..., overwrite=True): A or B exactly, never "corrupt"."""
    res = Result("reader vs overwrite race")
    path = base / "ck"
    fc.save(path, make_state(1, big=1, small=8))
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        v = 2
        try:
            while not stop.is_set():
                fc.save(path, make_state(v, big=1, small=8), overwrite=True)
                v = 3 - v
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    end = time.monotonic() + scale.follow_secs
    try:
        while time.monotonic() < end:
            for what, fn in (("restore", fc.restore), ("verify", fc.verify)):
                res.trials += 1
                try:
                    value = fn(path)
                    if what == "restore" and state_version(value) not in (1, 2):
                        raise AssertionError("unknown version")
                    if what == "verify" and not value.ok:
                        res.problem("false-damage", f"verify: {value}", column="torn")
                    res.bump(f"{what}-read")
                except fc.errors.CheckpointNotFound:
                    res.bump(f"{what}-replaced")
                except fc.CheckpointError as e:
                    res.problem("false-damage", f"{what}: {type(e).__name__}: {e}", column="torn")
                except AssertionError as e:
                    res.problem("torn", f"{what}: mixed data: {e}", column="torn")
    finally:
        stop.set()
        t.join()
    if errors:
        res.problem("writer-failed", repr(errors[0]))
    return res


# --------------------------------------------------------------------------- reader fuzzing

FUZZ_TARGETS = (
    "manifest",
    "manifest+sign",
    "marker",
    "metadata",
    "metadata+sign",
    "msgpack+sign",
    "tamper+sign",
)
FUZZ_KINDS = ("flip", "truncate", "splice", "replace")


def _flood_pickle(n: int) -> bytes:
    """A pickled dict of ``n`` integer keys sharing one hash (``k * (2**61 - 1)``)."""
    return pickle.dumps({k * (2**61 - 1): 0 for k in range(1, n + 1)}, protocol=4)


def _tamper(m: dict[str, Any], choice: int, pos: int) -> dict[str, Any] | bytes:
    """One structural attack on a decoded manifest (or a whole new ``.metadata``): the
    classes an outside attack suite found, so the fuzzer keeps looking near them."""
    files, entries = m["files"], m["entries"]
    data = next(iter(f for f in files if f.endswith(".distcp")))
    tensor = next(e for e in entries if e.get("kind") == "tensor")
    attacks = [
        lambda: files.__setitem__(naming.COMMIT_MARKER, {"size": 1}),  # the marker as data
        lambda: files.__setitem__(naming.MANIFEST, {"size": 1}),
        lambda: files.__setitem__(pos % 97, {"size": 1}),  # an integer file name
        lambda: files.__setitem__("../" + data, files[data]),  # out of the directory
        lambda: files.__setitem__("/etc/" + data, files[data]),
        lambda: entries.append({**tensor, "path": [*tensor["path"], "under"]}),  # key under leaf
        lambda: entries.append({"path": [*tensor["path"], "v"], "kind": "value", "value": 1}),
        lambda: entries.append(dict(tensor)),  # the same key twice
        lambda: tensor["chunks"][0].__setitem__("offset", (pos + 1) << 40),  # far past the file
        lambda: tensor["chunks"][0].__setitem__("length", -1 - pos),
        lambda: tensor.__setitem__("shape", [(pos + 1) << 30, 1 << 30]),  # a huge tensor
        lambda: files.__setitem__(data, {"size": -pos}),
    ]
    if choice % (len(attacks) + 1) == len(attacks):
        return _flood_pickle(200 + pos % 4000)  # a hash flood in .metadata
    attacks[choice % len(attacks)]()
    return m


def fuzz_mutate(path: Path, target: str, kind: str, pos: int, data: bytes) -> bool:
    """Damage one file of ``path``; True when the manifest was re-signed afterwards."""
    import zlib

    name = {
        "manifest": naming.MANIFEST,
        "marker": naming.COMMIT_MARKER,
        "metadata": naming.DCP_METADATA,
        "msgpack": naming.MANIFEST,
        "tamper": naming.MANIFEST,
    }[target.split("+")[0]]
    raw = bytearray((path / name).read_bytes())
    if target.startswith("tamper"):
        tampered = _tamper(codec.decode(bytes(raw)), data[0] if data else 0, pos)  # type: ignore[arg-type]
        if isinstance(tampered, bytes):
            name, raw = naming.DCP_METADATA, bytearray(tampered)
        else:
            raw = bytearray(codec.encode(tampered))
    elif target.startswith("msgpack"):
        raw = bytearray(data)
    elif kind == "flip" and raw:
        raw[pos % len(raw)] ^= 1 << (data[0] % 8 if data else 0)
    elif kind == "truncate":
        del raw[pos % (len(raw) + 1) :]
    elif kind == "splice":
        at = pos % (len(raw) + 1)
        raw[at : at + len(data) // 2] = data
    else:
        raw = bytearray(data)
    (path / name).write_bytes(bytes(raw))
    if not target.endswith("+sign"):
        return False
    if name == naming.MANIFEST:
        os.unlink(path / naming.COMMIT_MARKER)
        commit.write_commit_marker(path, bytes(raw), version=_signed_version(bytes(raw)))
    else:
        try:
            m = codec.decode((path / naming.MANIFEST).read_bytes())
            m["files"][name] = {"size": len(raw), "crc32": zlib.crc32(bytes(raw))}  # type: ignore[index]
            resign(path, codec.encode(m))
        except Exception:
            return False
    return True


def fuzz_one(path: Path, signed: bool, budget_s: float) -> str:
    """Read a mutated checkpoint every way; the outcome, or AssertionError on a violation.

    Unsigned damage must be refused (CheckpointError) or change nothing; signed
    damage (an attacker owning the files) must end in a CheckpointError or a
    state; never another exception, never over the budget of CPU seconds (CPU time,
    not wall time: a hash flood or a quadratic parse burns CPU, a busy machine only
    makes the wall clock longer).
    """
    outcomes = []
    for what, fn in (
        ("restore", lambda: fc.restore(path)),
        ("inspect", lambda: fc.inspect(path)),
        ("verify", lambda: fc.verify(path)),
    ):
        t0 = time.process_time()
        try:
            value = fn()
            if what == "restore" and not signed and state_version(value) != 1:
                raise AssertionError("unsigned damage changed the restored state")
            outcome = "ok"
        except fc.CheckpointError as e:
            outcome = type(e).__name__
        elapsed = time.process_time() - t0
        if elapsed > budget_s:
            raise AssertionError(f"{what} took {elapsed:.1f} CPU s (budget {budget_s} s)")
        outcomes.append(f"{what}:{outcome}")
    return " ".join(outcomes)


def scenario_fuzz(scale: Scale, base: Path, seed: int) -> Result:
    """Random mutations of real manifests, markers and .metadata files (bounded)."""
    res = Result("reader fuzzing (manifest / marker / .metadata)")
    rng = random.Random(seed)
    pristine = base / "pristine"
    fc.save(pristine, make_state(1, big=1, small=4))
    path = base / "ck"
    for _ in range(scale.fuzz_examples):
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(pristine, path)
        target = rng.choice(FUZZ_TARGETS)
        kind = rng.choice(FUZZ_KINDS)
        data = rng.randbytes(rng.randrange(1, 64))
        if target.startswith("msgpack"):
            data = _random_msgpack(rng)
        signed = fuzz_mutate(path, target, kind, rng.randrange(1 << 20), data)
        res.trials += 1
        peak_rss_reset()
        rss0, _ = rss_and_peak()
        try:
            res.bump(fuzz_one(path, signed, budget_s=5.0).split()[0])
        except AssertionError as e:
            res.problem("violation", f"{target}/{kind}: {e}", column="torn")
        except Exception as e:
            res.problem("unclear-error", f"{target}/{kind}: {type(e).__name__}: {e}")
        _, hwm = rss_and_peak()
        if hwm - rss0 > (256 << 20):
            res.problem("allocation", f"{target}/{kind}: peak RSS grew {(hwm - rss0) >> 20} MiB")
    return res


def _random_msgpack(rng: random.Random, depth: int = 0) -> bytes:
    import msgpack

    def value(d: int) -> Any:
        r = rng.random()
        if d > 4 or r < 0.4:
            return rng.choice(
                [
                    None,
                    True,
                    rng.randrange(-(2**63), 2**64),
                    rng.random(),
                    "x" * rng.randrange(8),
                    b"\0",
                ]
            )
        if r < 0.7:
            return [value(d + 1) for _ in range(rng.randrange(4))]
        return {
            rng.choice(["format", "files", "entries", "ranks", "version", "k"]): value(d + 1)
            for _ in range(rng.randrange(4))
        }

    top = {"format": naming.FORMAT_NAME, "version": 1, "files": value(1), "entries": value(1)}
    return bytes(msgpack.packb(top))


# --------------------------------------------------------------------------- manager roots


def _die_at_call(k: int, names: tuple[str, ...] = ("rename", "replace", "unlink", "fsync")) -> None:
    """In a child: SIGKILL ourselves right before the ``k``-th call of any of ``os.<names>``.

    Kill points at system-call boundaries reach the narrow windows (between the two
    renames of an overwrite, between a rollback's moves) that a timer rarely hits.
    """
    calls = [0]

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        return call

    for name in names:
        setattr(os, name, wrap(getattr(os, name)))


def _reap(pid: int, timeout: float) -> str:
    """Wait for a child that kills itself: 'killed', 'finished', 'failed' or 'hang'."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            kill(pid)
            return "hang"
        time.sleep(0.002)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return "killed"
    return "finished" if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else "failed"


_LOCK_VICTIM = b"precious bytes that a lock must never touch\n" * 4


def _lock_attacks(root: Path, victim: Path) -> dict[str, Callable[[Path], None]]:
    """``.lock`` replaced by a link or a special file; each names what must stay unchanged."""
    ck = root / step_name(1)

    def symlink(target: Path) -> Callable[[Path], None]:
        return lambda lock: os.symlink(target, lock)

    def subdir(lock: Path) -> None:
        lock.mkdir()
        (lock / "inside").write_bytes(_LOCK_VICTIM)

    return {
        "symlink to a file outside": symlink(victim),
        "symlink to the checkpoint's COMMITTED": symlink(ck / naming.COMMIT_MARKER),
        "symlink to the checkpoint's manifest": symlink(ck / naming.MANIFEST),
        "relative symlink to a file outside": lambda lock: os.symlink(
            os.path.relpath(victim, lock.parent), lock
        ),
        "dangling symlink": symlink(victim.parent / "not-there"),
        "symlink to a directory": symlink(victim.parent),
        "symlink to a FIFO": symlink(victim.parent / "fifo"),
        "hard link to a file outside": lambda lock: os.link(victim, lock),
        "hard link to the checkpoint's shard": lambda lock: os.link(ck / "__0_0.distcp", lock),
        "FIFO": lambda lock: os.mkfifo(lock),
        "directory": subdir,
    }


def _fingerprint(paths: list[Path]) -> dict[str, Any]:
    """Names, types, sizes, mtimes and bytes of regular files (links not followed)."""
    out: dict[str, Any] = {}
    for top in paths:
        for p in [top, *sorted(top.rglob("*"))] if top.is_dir() else [top]:
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
            out[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_nlink, data)
    return out


def _lock_probe(root: Path) -> list[str]:
    try:
        fc.CheckpointManager(root, keep=fc.keep_last(1)).close()
    except fc.CheckpointError as e:
        return ["refused", str(e)]
    except BaseException as e:
        return [type(e).__name__, str(e)]
    return ["accepted", ""]


def scenario_lock_links(scale: Scale, base: Path, seed: int) -> Result:
    """A ``.lock`` symlink, hard link, FIFO or directory: the writer refuses, changes nothing."""
    res = Result("lock-file links (.lock symlink / hard link / FIFO / dir)")
    outside = base / "outside"
    outside.mkdir()
    victim = outside / "victim.txt"
    victim.write_bytes(_LOCK_VICTIM)
    os.mkfifo(outside / "fifo")
    for i, name in enumerate(_lock_attacks(base / "x", victim)):
        root = base / f"lock{i}"
        with fc.CheckpointManager(root) as mgr:
            mgr.maybe_save(make_state(1, big=1, small=4), step=1)
        os.unlink(root / ".lock")
        _lock_attacks(root, victim)[name](root / ".lock")
        before = _fingerprint([root, outside])
        res.trials += 1
        res.corruptions += 1
        out = run_forked(lambda root=root: _lock_probe(root), timeout=30)
        if not isinstance(out, list):
            res.problem("hang", f"{name}: a writing manager did not answer within 30 s")
            continue
        kind, msg = out
        if kind == "refused" and ".lock" in msg:
            res.detected += 1
        elif kind == "refused":
            res.problem("unnamed", f"{name}: refused without naming the lock: {msg}")
        elif kind == "accepted":
            res.problem("accepted", f"{name}: a writing manager opened the root")
        else:
            res.problem("unclear-error", f"{name}: {kind}: {msg}")
        after = _fingerprint([root, outside])
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if changed:
            res.problem("changed", f"{name}: {changed[:4]} changed", column="lost")
        try:
            with fc.CheckpointManager(root, read_only=True) as ro:  # readers never need it
                if state_version(ro.restore_latest()) != 1:
                    raise AssertionError("wrong version")
        except Exception as e:
            res.problem("lost", f"{name}: the checkpoint is unreadable: {e!r}", column="lost")
    return res


LEFTOVER_MODES = ("overwrite", "manager")


def _no_exchange() -> None:  # pragma: no cover - child
    """What a file system without ``renameat2(RENAME_EXCHANGE)`` (NFS, FUSE, macOS) gives."""
    commit._exchange = lambda a, b: False


def _leftover_child(mode: str, root: Path, start: int, k: int) -> None:  # pragma: no cover
    _no_exchange()
    if k > 0:
        _die_at_call(k)
    elif k < 0:  # right inside the window: the old checkpoint moved aside, the new not in
        real_rename = os.rename

        def rename(a: Any, b: Any, *args: Any, **kwargs: Any) -> None:
            real_rename(a, b, *args, **kwargs)
            if naming.TRASH_INFIX in os.fspath(b):
                os.kill(os.getpid(), signal.SIGKILL)

        os.rename = rename  # type: ignore[assignment]
    v = start
    if mode == "overwrite":  # re-save the newest steps in place, as a resumed run might
        while True:
            fc.save(root / step_name(v % 3 + 1), make_state(v, big=1, small=4), overwrite=True)
            v += 1
    with fc.CheckpointManager(root, keep=fc.keep_last(2)) as mgr:
        v = (mgr.latest_step() or 0) + 1
        while True:
            mgr.maybe_save(make_state(v, big=1, small=4), step=v)
            v += 1


def _leftover_trial(
    mode: str, root: Path, rng: random.Random, window: float, res: Result, *, in_window: bool
) -> None:
    keep = 2 if mode == "manager" else None
    before = snapshot(visible(root), res, check_whole)
    start = max(before.values(), default=0) + 1
    timed = not in_window and rng.random() < 0.3
    k = -1 if in_window else 0 if timed else rng.randrange(1, 80)
    pid = fork_child(lambda: _leftover_child(mode, root, start, k))
    if timed:
        time.sleep(rng.uniform(0.0, window))
        kill(pid)
        outcome = "killed"
    else:
        outcome = _reap(pid, 60)
    res.trials += 1
    res.bump(f"kill:{'timer' if timed else 'window' if in_window else 'syscall'}")
    if outcome != "killed":
        res.problem("child-" + outcome, f"{mode}: the saver ended '{outcome}' before its kill")
        return
    committed_left = [t for t in temporaries(root) if (t / naming.COMMIT_MARKER).is_file()]
    res.bump("committed-leftovers", len(committed_left))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fc.CheckpointManager(root, keep=fc.keep_last(2)).close()  # recovers leftovers
        except Exception as e:
            res.problem("writer-refused", f"{mode}: a writer could not open: {e!r}")
            return
    res.bump("recovered", sum("recovered from" in str(w.message) for w in caught))
    after = snapshot(visible(root), res, check_whole)
    check_kept(before, after, keep, res)
    newest_before = max(before.values(), default=0)
    if max(after.values(), default=0) < newest_before:
        res.problem("lost", f"{mode}: newest step went back from {newest_before}", column="lost")
    for t in temporaries(root):
        if (t / naming.COMMIT_MARKER).is_file() and (root / t.name.split(".")[0]).is_dir():
            res.bump("kept-leftover")  # committed, its step exists: kept, never deleted
            probe = root.parent / "kept-probe"
            os.rename(t, probe)  # under a plain name: readers refuse temporary names
            try:
                check_whole(probe)
            except Exception as e:
                res.problem("torn", f"kept leftover {t.name}: {e}", column="torn")
            commit.remove_tree(probe)
        else:
            res.problem("temp-leak", f"{t.name} survived a writer's start")
            commit.remove_tree(t)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reader = fc.CheckpointManager(root, read_only=True)
        state = reader.restore_latest()
    newest = max(after.values(), default=None)
    got = None if state is None else state_version(state)
    if mode == "manager" and (got != newest or reader.restored_step != newest):
        res.problem("resume", f"restore_latest gave {got}/{reader.restored_step}, newest {newest}")


def scenario_leftovers(scale: Scale, base: Path, seed: int) -> Result:
    """SIGKILLs of overwrites and pruning manager saves where no atomic exchange exists."""
    res = Result("SIGKILL without RENAME_EXCHANGE (leftover recovery)")
    rng = random.Random(seed)
    t0 = time.perf_counter()
    fc.save(base / "probe", make_state(1, big=1, small=4))
    window = 4 * (time.perf_counter() - t0) + 0.05
    for mode in LEFTOVER_MODES:
        root = base / f"left-{mode}"
        with fc.CheckpointManager(root) as mgr:
            mgr.maybe_save(make_state(1, big=1, small=4), step=1)
        for i in range(scale.leftover_kills):
            in_window = mode == "overwrite" and i % 4 == 0
            _leftover_trial(mode, root, rng, window, res, in_window=in_window)
    return res


ROLLBACK_STEPS = (1, 2, 3, 4, 5)


def _rollback_child(root: Path, to: int, newer: str, k: int) -> None:  # pragma: no cover
    mgr = fc.CheckpointManager(root)
    _die_at_call(k, ("rename", "replace", "unlink", "fsync", "rmdir"))
    mgr.rollback(to, newer=newer, branch="b" if newer == "branch" else None)  # type: ignore[arg-type]


def _rollback_trial(base: Path, i: int, rng: random.Random, res: Result) -> None:
    root = base / f"rb{i}"
    with fc.CheckpointManager(root) as mgr:
        for s in ROLLBACK_STEPS:
            mgr.maybe_save(make_state(s, big=0, small=4), step=s)
    to = rng.choice(ROLLBACK_STEPS[:-1])
    newer = rng.choice(("branch", "delete"))
    k = rng.randrange(1, 6 + 5 * (len(ROLLBACK_STEPS) - to))
    pid = fork_child(lambda: _rollback_child(root, to, newer, k))
    outcome = _reap(pid, 60)
    res.trials += 1
    res.bump(f"child-{outcome}")
    if outcome in ("hang", "failed"):
        res.problem(f"child-{outcome}", f"rollback({to}, newer={newer}) ended '{outcome}'")
        return
    label = f"rollback({to}, newer={newer!r}) killed at call {k}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with fc.CheckpointManager(root) as mgr:  # a writer opens: finishes the rollback
                trunk, branches = mgr.steps(), mgr.branches()
        except Exception as e:
            res.problem("writer-refused", f"{label}: reopening failed: {e!r}")
            return
    for w in caught:
        if _damage_warning(w.category):
            res.problem("damaged", f"{label}: {w.message}", column="torn")
    leftovers = [n.name for n in root.iterdir() if n.name not in (".lock", "branches", "run.json")]
    leftovers = [n for n in leftovers if parse_step(n) is None]
    if leftovers:
        res.problem("leftover", f"{label}: {leftovers} left in the root")
    all_steps, kept = list(ROLLBACK_STEPS), [s for s in ROLLBACK_STEPS if s <= to]
    newer_steps = [s for s in ROLLBACK_STEPS if s > to]
    if trunk == all_steps and not branches:
        res.bump("never-started")
    elif trunk == kept and branches == ({"b": newer_steps} if newer == "branch" else {}):
        res.bump("completed")
    else:
        res.problem("half-done", f"{label}: trunk {trunk}, branches {branches}", column="torn")
    where = {s: root / step_name(s) for s in trunk}
    where |= {s: root / "branches" / "b" / step_name(s) for s in branches.get("b", [])}
    must = all_steps if newer == "branch" or trunk == all_steps else kept
    for s in must:
        try:
            if s not in where or check_whole(where[s]) != s:
                raise AssertionError("missing")
        except Exception as e:
            res.problem("lost", f"{label}: step {s}: {e}", column="lost")
    shutil.rmtree(root)


def scenario_rollback(scale: Scale, base: Path, seed: int) -> Result:
    """SIGKILL at random system calls of CheckpointManager.rollback, then reopen."""
    res = Result("SIGKILL during rollback")
    rng = random.Random(seed)
    for i in range(scale.rollback_kills):
        _rollback_trial(base, i, rng, res)
    return res


def _bad_templates() -> dict[str, Callable[[], Any]]:
    """Templates (the caller's input) that cannot describe the saved state."""
    import collections

    def recursive() -> Any:
        d: dict[str, Any] = {"step": 0}
        d["self"] = d
        return d

    def shape() -> Any:
        t = make_state(0, big=1, small=4)
        t["model"]["s0"] = torch.zeros(3)
        return t

    def leaf(value: Any) -> Callable[[], Any]:
        def make() -> Any:
            t = make_state(0, big=1, small=4)
            t["model"]["s0"] = value  # where a tensor was saved
            return t

        return make

    return {
        "defaultdict at the top": lambda: collections.defaultdict(
            list, make_state(0, big=1, small=4)
        ),
        "defaultdict inside": lambda: {"model": collections.defaultdict(list), "step": 0},
        "wrong shape": shape,
        "unknown keys": lambda: {"other": torch.zeros(2)},
        "unsupported leaf (object)": leaf(object()),
        "unsupported leaf (lambda)": leaf(lambda: 0),
        "sparse tensor leaf": leaf(torch.zeros(2, 2).to_sparse()),
        "recursive template": recursive,
        "a list": lambda: [torch.zeros(2)],
        "a string": lambda: "model",
    }


def scenario_template_errors(scale: Scale, base: Path, seed: int) -> Result:
    """Bad templates through every manager path: the caller's error, never quarantine.

    Each call runs on a fresh copy of a root of three healthy checkpoints. A template
    the library can use is fine (a rollback it allows may then move steps); a refused
    one must be a CheckpointError that is not damage, with every checkpoint in place.
    """
    res = Result("template/caller errors never quarantine")
    pristine = base / "pristine"
    with fc.CheckpointManager(pristine) as mgr:
        for s in (1, 2, 3):
            mgr.maybe_save(make_state(s, big=1, small=4), step=s)
    names = sorted(os.listdir(pristine))
    calls: dict[str, Callable[[fc.CheckpointManager, Any], Any]] = {
        "restore_latest": lambda m, t: m.restore_latest(t),
        "restore(3)": lambda m, t: m.restore(3, t),
        "rollback(1)": lambda m, t: m.rollback(1, t),
    }
    root = base / "run"
    for name, make in _bad_templates().items():
        for call, fn in calls.items():
            for ro in (False, True) if call == "restore_latest" else (False,):
                label = f"{name}: {'read-only ' if ro else ''}{call}"
                shutil.rmtree(root, ignore_errors=True)
                shutil.copytree(pristine, root, symlinks=True)
                res.trials += 1
                refused = True
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        with fc.CheckpointManager(root, read_only=ro) as mgr:
                            fn(mgr, make())
                        res.bump("usable template")
                        refused = False
                    except fc.CheckpointError as e:
                        if is_damage(e):
                            res.problem("as-damage", f"{label}: {type(e).__name__}: {e}")
                        else:
                            res.bump(type(e).__name__)
                    except Exception as e:
                        res.problem("unclear-error", f"{label}: {type(e).__name__}: {e}")
                for w in caught:
                    if _damage_warning(w.category):
                        res.problem("warned", f"{label}: {w.message}")
                now = sorted(os.listdir(root))
                if any(QUARANTINE_INFIX in n for n in now) or (refused and now != names):
                    res.problem("moved", f"{label}: the root became {now}", column="lost")
                for s in (1, 2, 3) if refused else ():
                    try:
                        check_whole(root / step_name(s))
                    except Exception as e:
                        res.problem("lost", f"{label}: step {s}: {e}", column="lost")
    return res


def _odd_manifests() -> dict[str, tuple[bool, Callable[[dict[str, Any]], None]]]:
    """(damaged?, edit) of a re-signed manifest: odd values, or a malformed entry."""

    def meta(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
        def edit(m: dict[str, Any]) -> None:
            m["metadata"][key] = value

        return edit

    def manager(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
        def edit(m: dict[str, Any]) -> None:
            m["metadata"]["manager"][key] = value

        return edit

    def created(value: Any) -> Callable[[dict[str, Any]], None]:
        def edit(m: dict[str, Any]) -> None:
            m["created"] = value

        return edit

    def alias(m: dict[str, Any]) -> None:
        e = next(e for e in m["entries"] if e.get("kind") == "tensor")
        e["alias"] = [["x"]]

    def value(v: Any) -> Callable[[dict[str, Any]], None]:
        def edit(m: dict[str, Any]) -> None:
            next(e for e in m["entries"] if e["path"] == ["step"])["value"] = v

        return edit

    return {
        "created = 1e300": (False, created(1e300)),
        "created = NaN": (False, created(float("nan"))),
        "created = -inf": (False, created(float("-inf"))),
        "created = 2**80": (False, created(2**80)),
        "created = 'yesterday'": (False, created("yesterday")),
        "metrics as a list": (False, manager("metrics", [1, 2])),
        "metrics = {'loss': 'x'}": (False, manager("metrics", {"loss": "x"})),
        "metrics = {'loss': 10**400}": (False, manager("metrics", {"loss": 10**400})),
        "manager record as a list": (False, meta("manager", [1])),
        "metadata int of 5000 digits": (False, meta("big", 10**5000)),
        "value int of 5000 digits": (False, value(10**5000)),
        "alias as [['x']]": (True, alias),
    }


def _cli(argv: list[str]) -> list[Any]:
    """``fckpt argv`` in this process: [exit status, stdout, stderr]; a traceback is caught."""
    import io

    from functional_ckpt._src.cli.main import main as fckpt

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code: Any = fckpt(argv)
        except BaseException:
            code = "traceback"
            err.write(traceback.format_exc())
    return [code, out.getvalue(), err.getvalue()]


def _cli_probe(root: Path, odd: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for what, argv in (
        ("ls", ["ls", str(root)]),
        ("ls --json", ["ls", str(root), "--json"]),
        ("ls --verify", ["ls", str(root), "--verify"]),
        ("inspect", ["inspect", str(odd)]),
        ("inspect --json", ["inspect", str(odd), "--json"]),
        ("verify", ["verify", str(odd)]),
        ("verify root", ["verify", str(root)]),
    ):
        out[what] = _cli(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            reader = fc.CheckpointManager(root, read_only=True)
            state = reader.restore_latest()
            out["restore_latest"] = [reader.restored_step, state is not None]
        except BaseException as e:
            out["restore_latest"] = [type(e).__name__, str(e)[:300]]
    try:
        out["str(inspect)"] = ["ok", len(str(fc.inspect(odd)))]
    except fc.CheckpointError as e:
        out["str(inspect)"] = ["refused", type(e).__name__]
    except BaseException as e:
        out["str(inspect)"] = [type(e).__name__, str(e)[:300]]
    return out


def _cli_expect(what: str, damaged: bool) -> int:
    """The documented exit status (docs/cli.md) of a command on the odd root / checkpoint."""
    if what in ("ls", "ls --json"):
        return 0  # the listing reads the manifest's header only; --verify reads it all
    return 1 if damaged else 0  # ls --verify too: "damaged" is status 1 wherever it is found


def _judge_cli(label: str, damaged: bool, out: dict[str, Any], res: Result) -> bool:
    good = True
    others = (step_name(1), step_name(2))
    for what, (code, stdout, stderr) in (
        (k, v) for k, v in out.items() if k.startswith(("l", "i", "v"))
    ):
        text = f"{label}: fckpt {what}"
        if code == "traceback" or "Traceback" in stderr:
            res.problem("traceback", f"{text}: {stderr[-300:]}")
            good = False
            continue
        if code != _cli_expect(what, damaged):
            res.problem("exit-status", f"{text}: exit {code}: {stderr.strip()[:200]}")
            good = False
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        if code == 2 or (lines and not damaged):
            res.problem("error-text", f"{text}: stderr {lines[:3]}")
            good = False
        elif len(lines) > 1 or (lines and not lines[0].startswith("fckpt: error:")):
            res.problem("error-text", f"{text}: not one line: {lines[:3]}")
            good = False
        if what.startswith(("ls", "verify root")) and not all(n in stdout for n in others):
            res.problem("hidden", f"{text}: the other checkpoints are not listed", column="torn")
            good = False
    step, restored = out["restore_latest"]
    if step != (2 if damaged else 3) or restored is not True:
        res.problem("resume", f"{label}: restore_latest gave {step} {restored}")
        good = False
    if out["str(inspect)"][0] not in ("ok", "refused") or (
        out["str(inspect)"][0] == "refused" and not damaged
    ):
        res.problem("inspect", f"{label}: fc.inspect: {out['str(inspect)']}")
        good = False
    return good


def scenario_cli_odd(scale: Scale, base: Path, seed: int) -> Result:
    """fckpt ls / inspect / verify on re-signed manifests with odd values, beside good ones."""
    res = Result("CLI on odd manifests (ls / inspect / verify)")
    for i, (label, (damaged, edit)) in enumerate(_odd_manifests().items()):
        root = base / f"cli{i}"
        with fc.CheckpointManager(root) as mgr:
            for s in (1, 2, 3):
                mgr.maybe_save(make_state(s, big=0, small=2), step=s, metrics={"loss": 1.0 / s})
        odd = root / step_name(3)
        edit_manifest(odd, edit)
        res.trials += 1
        res.corruptions += damaged
        out = run_forked(lambda root=root, odd=odd: _cli_probe(root, odd), timeout=120)
        if out is None or out.get("hang"):
            res.problem("hang", f"{label}: fckpt did not answer within 120 s")
            continue
        good = _judge_cli(label, damaged, out, res)
        res.detected += damaged and good
        if scale.cli_each or label == "alias as [['x']]":
            code = _cli_process(["ls", str(root)])
            if code != 0:
                res.problem("process", f"{label}: the fckpt process: {code}")
        shutil.rmtree(root)
    return res


def _cli_process(argv: list[str]) -> Any:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-m", "functional_ckpt", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return "traceback" if "Traceback" in proc.stderr else proc.returncode


# --------------------------------------------------------------------------- values and manifests


def _sibling(name: str) -> Any:
    """A module next to this script, however this script was loaded (run, or by a test)."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


#: faults_values.py classes: (table title, whether each trial is an attack to detect).
VALUE_CLASSES: dict[str, tuple[str, bool]] = {
    "decoder-complexity": ("decoder complexity (hash floods)", True),
    "decoder-memory": ("decoder memory budget", False),
    "view-bit-aliasing": ("view-bit aliasing (conj / neg)", False),
    "limit-symmetry": ("save/load limit symmetry", False),
    "chunk-coverage": ("chunk coverage (overlaps, holes)", True),
    "unstaged-bypass": ("unstaged bypass (.data / numpy)", False),
}


def scenario_values(name: str, scale: Scale, base: Path, seed: int) -> Result:
    """One class of benchmarks/faults_values.py, in this table's columns.

    ``wrong`` (a wrong value restored, a hostile input accepted, a save that cannot
    be loaded) is *torn visible*; ``raw`` (not a CheckpointError) is *other*.
    """
    title, attack = VALUE_CLASSES[name]
    report = _sibling("faults_values").run(quick=scale.values_quick, classes=[name])
    (r,) = report["results"]
    res = Result(title, trials=r["trials"], torn=r["wrong"], other=r["raw"])
    if attack:
        res.corruptions, res.detected = r["trials"], r["ok"]
    res.counts = {"ok": r["ok"], **r["notes"]}
    res.figures = {"worst_s": r["worst_s"], "worst_mem": r["worst_mem"]}
    res.problems = list(r["problems"])
    return res


# --------------------------------------------------------------------------- driver

SCENARIOS: dict[str, Callable[[Scale, Path, int], Result]] = {
    **{f"kill-{k}": (lambda s, b, seed, k=k: scenario_kill(k, s, b, seed)) for k in KINDS},
    "disk-full": scenario_disk_full,
    "destinations": scenario_destinations,
    "corruption": scenario_corruption,
    "hostile": scenario_hostile,
    "concurrency": scenario_concurrency,
    "durability": scenario_durability,
    "special-files": scenario_special_files,
    "unpickler": scenario_unpickler,
    "derived": scenario_derived,
    "overwrite-scope": scenario_overwrite_scope,
    "overwrite-race": scenario_overwrite_race,
    "fuzz": scenario_fuzz,
    "lock-links": scenario_lock_links,
    "leftovers": scenario_leftovers,
    "rollback": scenario_rollback,
    "template-errors": scenario_template_errors,
    "cli-odd": scenario_cli_odd,
    **{
        f"values-{k}": (lambda s, b, seed, k=k: scenario_values(k, s, b, seed))
        for k in VALUE_CLASSES
    },
    **{
        k: (lambda s, b, seed, k=k: _sibling("faults_trust").SCENARIOS[k](s, b, seed))
        for k in _sibling("faults_trust").SCENARIOS
    },
}


def run_scenario(name: str, scale: Scale, seed: int = 0, base: Path | None = None) -> Result:
    """Run one scenario in a fresh scratch directory (removed afterwards)."""
    own = base is None
    work = Path(tempfile.mkdtemp(prefix=f"fc-faults-{name}-")) if own else base
    assert work is not None
    t0 = time.perf_counter()
    try:
        res = SCENARIOS[name](scale, work, seed)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)
    res.seconds = time.perf_counter() - t0
    return res


def table(results: list[Result]) -> str:
    head = ("scenario", "trials", "lost", "torn visible", "detected", "code executed", "other")
    rows = [head]
    for r in results:
        det = f"{r.detected}/{r.corruptions}" if r.corruptions else "-"
        if r.skipped and not r.trials:
            rows.append((r.scenario, "skipped", "", "", "", "", r.skipped[:60]))
            continue
        rows.append(
            (
                r.scenario,
                str(r.trials),
                str(r.lost),
                str(r.torn),
                det,
                str(r.executed),
                str(r.other),
            )
        )
    kills = sum(r.trials for r in results if r.scenario.startswith("SIGKILL"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"SIGKILL trials in total: {kills}")
    for r in results:
        if r.figures:
            mem = r.figures.get("worst_mem", 0.0)
            tail = f", peak traced memory {mem:.1f}x the input" if mem else ""
            lines.append(f"{r.scenario}: slowest trial {r.figures['worst_s']:.2f} s{tail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ci", action="store_true", help="the short form (what the tests run)")
    ap.add_argument("--trials", type=int, help="SIGKILL trials per kind (4 kinds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--scenarios", nargs="*", choices=sorted(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("-v", "--verbose", action="store_true", help="print each problem")
    args = ap.parse_args(argv)
    scale = CI if args.ci else LONG
    if args.trials is not None:
        scale = Scale(args.trials, *list(asdict(scale).values())[1:])
    results = []
    for i, name in enumerate(args.scenarios):
        res = run_scenario(name, scale, args.seed + i)
        print(f"{name}: {res.trials} trials in {res.seconds:.1f} s", file=sys.stderr, flush=True)
        if args.verbose:
            for p in res.problems:
                print(f"    {p}", file=sys.stderr)
        results.append(res)
    print(table(results))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "form": "ci" if args.ci else "long",
                    "scale": asdict(scale),
                    "torch": str(torch.__version__),
                    "results": [asdict(r) for r in results],
                },
                indent=2,
            )
        )
    bad = any(r.lost or r.torn or r.executed for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
