"""A pending save is an obligation: Ctrl-C while waiting for it forgets nothing.

A real child process, a real SIGINT delivered while its main thread waits in
``close()`` / ``wait()``, and a real second writer process trying the root.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from tests import prefork
from tests.patience import HANG

CHILD = """
import os, signal, subprocess, sys, threading, time
import torch
import functional_ckpt as fc
from functional_ckpt._src.storage import durable

root, how = sys.argv[1], sys.argv[2]
gate = os.path.join(os.path.dirname(root), "go")
reached = threading.Event()
opened = durable.open_new

def held(path, **kw):  # the save waits here until the file ``go`` exists
    if ".tmp-" not in os.path.basename(os.path.dirname(str(path))):
        return opened(path, **kw)  # not a checkpoint's file (the root's run record)
    reached.set()
    while not os.path.exists(gate):
        time.sleep(0.01)
    return opened(path, **kw)

durable.open_new = held
main = threading.main_thread().ident

def interrupt():  # SIGINT once the main thread waits for the save's result
    reached.wait()
    while "result" not in [f.f_code.co_name for f in _stack(sys._current_frames()[main])]:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)

def _stack(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back

mgr = fc.CheckpointManager(root, async_save=True)
mgr.maybe_save({"w": torch.arange(1000.0), "step": 1}, step=1, force=True)
threading.Thread(target=interrupt, daemon=True).start()
try:
    mgr.close() if how == "close" else mgr.wait()
except KeyboardInterrupt:
    print("interrupted", flush=True)
second = subprocess.run(
    [sys.executable, "-c", "import sys, functional_ckpt as fc; fc.CheckpointManager(sys.argv[1])",
     root], capture_output=True, text=True)
print("second writer:", "refused" if second.returncode else "opened", flush=True)
open(gate, "w").close()
mgr.close()
print("closed", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "wait"])
def test_ctrl_c_while_waiting_keeps_the_save_and_the_lock(tmp_path: Path, how: str) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = prefork.run(
        [sys.executable, str(script), str(tmp_path / "run"), how],
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["interrupted", "second writer: refused", "closed"]
    with fc.CheckpointManager(tmp_path / "run") as mgr:  # the lock is free again
        assert mgr.steps() == [1]
        assert torch.equal(mgr.restore(1)["w"], torch.arange(1000.0))
