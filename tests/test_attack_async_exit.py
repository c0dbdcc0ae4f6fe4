"""The async exit path attacked from its documentation (docs/async.md, "Failures" and
"What survives what"): signals that arrive while the exit hook waits, a full disk at
exit, daemon threads, forks and a manager left by an exception, each in a real child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import functional_ckpt as fc
from tests import prefork
from tests.patience import HANG

REPO = Path(__file__).parent.parent

#: A save whose files are opened only once the interpreter has begun to shut down, so
#: the exit hook is certainly waiting for it; ``SIGNAL`` is then sent to the process
#: (its main thread, waiting in the hook, handles it) before the files are written.
PROLOGUE = """
import os, signal, sys, threading, time
import torch
import functional_ckpt as fc
from functional_ckpt._src.storage import durable

opened = durable.open_new
sent = []

def open_at_exit(path, **kw):
    if ".tmp-" in os.path.basename(os.path.dirname(str(path))):
        while not threading._SHUTTING_DOWN:
            time.sleep(0.01)
        if os.environ.get("SIGNAL") and not sent:
            sent.append(1)
            os.kill(os.getpid(), int(os.environ["SIGNAL"]))
            time.sleep(1)  # the main thread handles the signal meanwhile
    return opened(path, **kw)

durable.open_new = open_at_exit
root = sys.argv[1]
state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 7}
"""


def run_child(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(PROLOGUE) + textwrap.dedent(body))
    return prefork.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )


def committed(path: Path) -> bool:
    try:
        return fc.verify(path).ok
    except fc.CheckpointError:
        return False


# Broken: "A pending save is an obligation: the process does not end ... while a save it
# started runs, whatever interrupts the waiting" (async.md, Failures): a SIGTERM whose
# handler exits, or a Ctrl-C, arriving while the exit hook waits ends the process with
# status 0 and the final save is lost (its .tmp directory left behind).
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_exit_hook_waits_never_loses_the_save_silently(
    tmp_path: Path, sig: signal.Signals
) -> None:
    body = """
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))
    fc.save_async(root + "/ck", state)
    """
    proc = run_child(tmp_path, body, SIGNAL=str(int(sig)))
    assert committed(tmp_path / "ck") or proc.returncode != 0, proc.stderr[-3000:]


# Holds: "1 if a save failed and its error was never read" (async.md, What survives
# what), for a file-size limit hit at exit even when the script says sys.exit(0).
@pytest.mark.parametrize("ending", ["", "sys.exit(0)\n"])
def test_a_disk_that_fills_at_exit_gives_status_1_and_commits_nothing(
    tmp_path: Path, ending: str
) -> None:
    body = """
    import resource
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
    fc.save_async(root + "/ck", {"w": torch.zeros(1 << 20)})
    """
    proc = run_child(tmp_path, body + ending)
    assert proc.returncode == 1 and "File too large" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["child.py"]  # nothing half-written


# Holds: a save started by a daemon thread is waited for at exit like any other
# ("ends normally ... committed before the interpreter exits", async.md).
def test_a_daemon_threads_save_is_committed_at_exit(tmp_path: Path) -> None:
    body = """
    started = threading.Event()
    def work():
        fc.save_async(root + "/ck", state)
        started.set()
        time.sleep(3600)
    threading.Thread(target=work, daemon=True).start()
    started.wait()
    """
    proc = run_child(tmp_path, body)
    assert proc.returncode == 0 and committed(tmp_path / "ck"), proc.stderr[-3000:]


# Holds: "forks: the parent's save goes on; the child has none of it" (async.md), also
# when the child saves on its own before it exits.
def test_a_fork_child_that_saves_on_its_own_leaves_both_saves_whole(tmp_path: Path) -> None:
    body = """
    pending = fc.save_async(root + "/ck", state)
    pid = os.fork()
    if pid == 0:
        durable.open_new = opened
        fc.save(root + "/child", {"x": torch.ones(3)})
        fc.save_async(root + "/child_async", {"x": torch.ones(3)})
        sys.exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    """
    proc = run_child(tmp_path, body)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(committed(tmp_path / n) for n in ("ck", "child", "child_async"))


# Holds: "raises an uncaught exception: committed" (async.md) for a manager's save when
# its `with` block ends by the exception; the next writer opens the root (lock free).
def test_a_manager_left_by_an_exception_commits_and_frees_its_lock(tmp_path: Path) -> None:
    body = """
    durable.open_new = opened  # the `with` block waits for the save as it ends
    with fc.CheckpointManager(root + "/run", async_save=True) as mgr:
        mgr.maybe_save(state, step=7, force=True)
        raise RuntimeError("boom")
    """
    proc = run_child(tmp_path, body)
    assert proc.returncode == 1 and "boom" in proc.stderr
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        assert mgr.steps() == [7]
