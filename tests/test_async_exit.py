"""A background save outlives whatever the process does next: every way a script ends.

Each case runs a real child interpreter whose save is held back until the
interpreter has begun to shut down (the shard file is opened only then), so the
save is certainly still running when the script ends, however it ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from tests import prefork
from tests.patience import HANG

#: The child's prologue: a save whose files in its temporary directory are opened only
#: once the interpreter has begun to shut down (``threading._SHUTTING_DOWN``), however
#: the script ends.
PROLOGUE = """
import os, signal, sys, threading, time
import torch
import functional_ckpt as fc
from functional_ckpt._src.storage import durable

opened = durable.open_new

def open_at_exit(path, **kw):
    if ".tmp-" not in os.path.basename(os.path.dirname(str(path))):
        return opened(path, **kw)  # not a checkpoint's file (a root's run record)
    while not threading._SHUTTING_DOWN:
        time.sleep(0.01)
    if os.environ.get("FC_TEST_FAIL"):
        raise OSError(28, "No space left on device (injected)", str(path))
    return opened(path, **kw)

durable.open_new = open_at_exit
root = sys.argv[1]
state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 7}
"""

ENDINGS = {
    "falls off the end": ('fc.save_async(root + "/ck", state)\n', 0),
    "sys.exit": ('fc.save_async(root + "/ck", state)\nsys.exit(0)\n', 0),
    "uncaught exception": ('fc.save_async(root + "/ck", state)\nraise ValueError("boom")\n', 1),
    "ctrl-c": (
        'fc.save_async(root + "/ck", state)\n'
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "while True:\n    time.sleep(1)\n",
        -signal.SIGINT,
    ),
    "SIGTERM with a handler that exits": (
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        'fc.save_async(root + "/ck", state)\n'
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "while True:\n    time.sleep(1)\n",
        143,
    ),
    "a fork child exits meanwhile": (
        'pending = fc.save_async(root + "/ck", state)\n'
        "pid = os.fork()\n"
        "if pid == 0:\n    sys.exit(0)  # through the interpreter's exit: no save of its own\n"
        "assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0\n",
        0,
    ),
    "unclosed async manager": (
        'mgr = fc.CheckpointManager(root + "/run", async_save=True)\n'
        "mgr.maybe_save(state, step=7, force=True)\n",
        0,
    ),
}


def run_child(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(PROLOGUE) + body)
    return prefork.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG,
        env={**os.environ, **env},
    )


def test_sigterm_without_a_handler_commits_nothing_and_the_next_writer_cleans_up(
    tmp_path: Path,
) -> None:
    body = (
        "os.makedirs(root + '/run')\n"
        'fc.save_async(root + "/run/step_000000007", state)\n'
        "while not [n for n in os.listdir(root + '/run') if '.tmp-' in n]:\n"
        "    time.sleep(0.01)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "while True:\n    time.sleep(1)\n"
    )
    proc = run_child(tmp_path, body)
    assert proc.returncode == -signal.SIGTERM  # killed at once, as by SIGKILL
    assert [p.name for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name]
    with fc.CheckpointManager(tmp_path / "run") as mgr:  # a writer removes the leftover
        assert mgr.steps() == []
    assert [p.name for p in (tmp_path / "run").iterdir() if ".tmp-" in p.name] == []


def committed(tmp_path: Path, ending: str) -> Path:
    if ending == "unclosed async manager":
        with fc.CheckpointManager(tmp_path / "run", read_only=True) as reader:
            assert reader.steps() == [7]
            return reader.path(7)
    return tmp_path / "ck"


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_a_final_save_async_is_committed_however_the_script_ends(
    tmp_path: Path, ending: str
) -> None:
    body, status = ENDINGS[ending]
    proc = run_child(tmp_path, body)
    assert proc.returncode == status, proc.stderr
    back = fc.restore(committed(tmp_path, ending))
    assert torch.equal(back["w"], torch.arange(1 << 16, dtype=torch.float32))
    assert back["step"] == 7


@pytest.mark.parametrize("ending", ["falls off the end", "sys.exit", "uncaught exception"])
def test_a_save_that_fails_at_exit_is_printed_and_the_status_is_not_zero(
    tmp_path: Path, ending: str
) -> None:
    proc = run_child(tmp_path, ENDINGS[ending][0], FC_TEST_FAIL="1")
    assert proc.returncode != 0
    assert "No space left on device (injected)" in proc.stderr
    assert str(tmp_path / "ck") in proc.stderr
    assert not (tmp_path / "ck").exists()


def test_a_failure_read_by_the_script_is_not_printed_again(tmp_path: Path) -> None:
    # not held back: the save fails at once, and the script reads why
    script = (
        "import sys, torch\nimport functional_ckpt as fc\n"
        "from functional_ckpt._src.storage import durable\n"
        "def fail(path, **kw):\n    raise OSError(5, 'injected failure')\n"
        "durable.open_new = fail\n"
        'p = fc.save_async(sys.argv[1] + "/ck", {"w": torch.zeros(4)})\n'
        "print('read:', p.exception() is not None)\n"
    )
    path = tmp_path / "child.py"
    path.write_text(script)
    proc = prefork.run(
        [sys.executable, str(path), str(tmp_path)], capture_output=True, text=True, timeout=HANG
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "read: True"
    assert "injected failure" not in proc.stderr
