"""One process of test_memory's SIGTERM tests: managers with memory tiers save steps
into RAM (their disk tiers never save on their own), then the process group gets
SIGTERM, as a scheduler sends it. A process the signal does not end prints ``LIVED``.

    python sigterm_job.py BASE two [--user]
    python sigterm_job.py BASE remote URL ENDPOINT
    python sigterm_job.py BASE keep1 [--sync]
    python sigterm_job.py BASE slowdisk
    python sigterm_job.py BASE collective
    python sigterm_job.py BASE locked URL

``two``: two managers (roots ``BASE/a`` and ``BASE/b``) save steps 1..3; with ``--user``
a handler of the user's, installed first, prints ``USER`` each time it is called and the
process goes on. ``remote``: one manager with a remote tier at ``URL`` (an S3 server at
``ENDPOINT``) saves steps 1..3. ``keep1``: one manager with ``Memory(keep=1)`` saves
steps 1..3, and the signal comes while the save of step 4 (which replaces step 3) is
written, before it commits: on the write's thread (``--sync``: the training thread),
which then commits once the training thread handles the signal. ``slowdisk``: the
disk tier's async save of step 3 never commits, and the memory tier (``promote_within``
0.2 s) holds steps 2 and 3; an exception the signal raises is printed as ``RAISED``.
``collective``: as ``keep1``, but the signal comes while the save of step 4 is in its
agreement over ranks (``fail_together``), before it made room. ``locked``: a memory
and a remote tier (at ``URL``) save steps 1..3; the signal comes while the training
thread holds the remote tier's lock, whose taking again by that thread prints
``DEADLOCK`` and ends the process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.manager import memory_tier
from functional_ckpt._src.storage import commit


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 64), float(step)), "step": step}


def terminate() -> None:
    os.killpg(os.getpgid(0), signal.SIGTERM)


def handling() -> bool:
    """Whether the training thread waits for something inside the memory tier's handler."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    names = []
    while frame is not None:
        names.append((Path(frame.f_code.co_filename).name, frame.f_code.co_name))
        frame = frame.f_back
    return ("threading.py", "wait") in names and any(n == "memory_tier.py" for n, _ in names)


def signal_inside_step_4(folder: Path) -> None:
    real = commit.commit_checkpoint

    def committing(tmp: Path, final: Path, **kwargs: Any) -> None:
        if final == folder / step_name(4):
            terminate()
            while threading.current_thread() is not threading.main_thread() and not handling():
                time.sleep(0.01)  # committed only once the handler waits for it
        real(tmp, final, **kwargs)

    commit.commit_checkpoint = committing  # type: ignore[assignment]


class Owned:
    """A lock that signals once it is held by the training thread (then ``armed``)."""

    def __init__(self, lock: Any) -> None:
        self.lock, self.owner, self.armed = lock, None, True

    def __enter__(self) -> None:
        if self.owner == threading.get_ident():
            print("DEADLOCK", flush=True)
            os._exit(3)
        self.lock.acquire()
        self.owner = threading.get_ident()
        if self.armed and threading.current_thread() is threading.main_thread():
            self.armed = False
            terminate()

    def __exit__(self, *exc: object) -> None:
        self.owner = None
        self.lock.release()


def main() -> None:
    base, mode = Path(sys.argv[1]), sys.argv[2]
    never = fc.policy.never()
    managers = []
    if mode == "two":
        if "--user" in sys.argv:
            signal.signal(signal.SIGTERM, lambda signum, frame: print("USER", flush=True))
        for name in "ab":
            tier = fc.manager.Memory(path=base / f"mem-{name}", async_save=False)
            managers.append(fc.CheckpointManager(base / name, save=never, tiers=(tier,)))
    elif mode == "remote":
        url, endpoint = sys.argv[3], sys.argv[4]
        options = {"client_kwargs": {"endpoint_url": endpoint}}
        tiers = (
            fc.manager.Memory(path=base / "mem"),
            fc.manager.Remote(url, storage_options=options),
        )
        managers.append(fc.CheckpointManager(base / "root", save=never, tiers=tiers))
    elif mode == "locked":
        tiers = (
            fc.manager.Memory(path=base / "mem", promote_within=0.5),
            fc.manager.Remote(sys.argv[3]),
        )
        managers.append(fc.CheckpointManager(base / "root", save=never, tiers=tiers))
    elif mode == "slowdisk":
        tier = fc.manager.Memory(path=base / "mem", async_save=False, promote_within=0.2)
        disk = fc.at_steps([3])
        managers.append(
            fc.CheckpointManager(base / "root", save=disk, async_save=True, tiers=(tier,))
        )
        real = commit.commit_checkpoint

        def never(tmp: Path, final: Path, **kwargs: Any) -> None:
            if final == base / "root" / step_name(3):
                threading.Event().wait()
            real(tmp, final, **kwargs)

        commit.commit_checkpoint = never  # type: ignore[assignment]
    else:  # keep1, collective
        tier = fc.manager.Memory(path=base / "mem", keep=1, async_save="--sync" not in sys.argv)
        managers.append(fc.CheckpointManager(base / "root", save=never, tiers=(tier,)))
    for step in (1, 2, 3):
        for mgr in managers:
            mgr.maybe_save(state(step), step=step)
            if mode != "slowdisk":
                mgr.wait()
    if mode == "keep1":
        signal_inside_step_4(base / "mem")
        managers[0].maybe_save(state(4), step=4)
    elif mode == "collective":
        real_together = memory_tier.fail_together

        @contextlib.contextmanager
        def together(group: Any, what: str) -> Iterator[None]:
            if what == "memory-tier step 4":
                terminate()
            with real_together(group, what):
                yield

        memory_tier.fail_together = together  # type: ignore[assignment]
        managers[0].maybe_save(state(4), step=4)
    elif mode == "locked":
        remote = managers[0].remote
        assert remote is not None
        remote._lock = Owned(remote._lock)  # type: ignore[assignment]
        remote.steps()
    else:
        try:
            terminate()
        except BaseException as e:
            print("RAISED", repr(e), flush=True)
            os._exit(1)
    if "--user" not in sys.argv:
        time.sleep(20)  # what the signal should have ended
    print("LIVED", flush=True)
    for mgr in managers:
        mgr.close()


if __name__ == "__main__":
    main()
