"""The first ``fc.*`` call imports torch and the package's heavy modules (seconds): it is
safe to fork around and to interrupt. Real child interpreters, a real ``fork`` from
another thread and real signals, each while that import runs."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from tests.patience import HANG

#: While one thread makes the first call, the main thread forks as soon as torch is
#: being imported; the child's own first call must not hang on the import's locks.
FORK = """
import os, sys, threading, time
import functional_ckpt as fc

path, hang = sys.argv[1], float(sys.argv[2])
assert "torch" not in sys.modules
first = threading.Thread(target=lambda: fc.restore)
first.start()
while "torch" not in sys.modules:
    time.sleep(0.001)
pid = os.fork()
if pid == 0:
    ok = float(fc.restore(path)["w"].sum()) == 6.0
    os._exit(0 if ok else 3)
first.join()
deadline = time.monotonic() + hang
while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child", os.waitstatus_to_exitcode(status))
        break
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        print("child hung")
        break
    time.sleep(0.01)
"""

#: A signal whose handler raises, delivered while the first call imports torch; the
#: call raises it (once the import is done), and the next call works.
SIGNAL = """
import os, signal, sys, threading, time
import functional_ckpt as fc

path, signum = sys.argv[1], int(sys.argv[2])

def timeout(signum, frame):
    raise TimeoutError("the first call took too long")

signal.signal(signal.SIGALRM, timeout)

def interrupt():
    while "torch" not in sys.modules:
        time.sleep(0.001)
    os.kill(os.getpid(), signum)

sender = threading.Thread(target=interrupt)
sender.start()
try:
    fc.restore(path)
    sender.join()
    for _ in range(100):  # a signal sent after the call lands here
        time.sleep(0.001)
    print("not interrupted (the handler's exception was lost)", flush=True)
except (KeyboardInterrupt, TimeoutError) as e:
    print("interrupted:", type(e).__name__, flush=True)
print("second call:", float(fc.restore(path)["w"].sum()))
"""


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    fc.save(tmp_path / "ck", {"w": torch.ones(6)})
    return tmp_path / "ck"


def run(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "child.py"
    path.write_text(script)
    return subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=HANG
    )


def test_a_fork_during_the_first_call_leaves_a_working_child(tmp_path: Path, saved: Path) -> None:
    proc = run(tmp_path, FORK, str(saved), str(HANG))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == "child 0"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGALRM])
def test_a_signal_during_the_first_call_leaves_a_working_package(
    tmp_path: Path, saved: Path, signum: int
) -> None:
    proc = run(tmp_path, SIGNAL, str(saved), str(int(signum)))
    assert proc.returncode == 0, proc.stderr
    expected = "KeyboardInterrupt" if signum == signal.SIGINT else "TimeoutError"
    assert proc.stdout.split("\n")[:2] == [f"interrupted: {expected}", "second call: 6.0"]
