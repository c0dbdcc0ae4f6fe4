"""The forked children of tests/prefork.py report their own exit status."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.patience import HANG
from tests.prefork import REPO

# In a pid namespace of its own the next pid can be chosen (``ns_last_pid``): the kernel
# gives a child the pid of an earlier one, as it does anywhere once pids wrap around.
REUSE = """
import sys
from pathlib import Path
from tests import prefork

first = prefork.Popen([sys.executable, "-c", "raise SystemExit(1)"])
assert first.wait() == 1
Path("/proc/sys/kernel/ns_last_pid").write_text(str(first.pid - 1))
second = prefork.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
assert second.pid == first.pid, (first.pid, second.pid)
print(second.wait(), flush=True)
"""


def test_a_child_given_an_earlier_childs_pid_reports_its_own_exit_status() -> None:
    """Regression: a full suite run wraps pids around (pid_max 32768); a rank given the
    pid of an earlier child that failed got that child's status (1, with its own empty
    stderr) before it had even ended."""
    ns = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    if not shutil.which("unshare") or subprocess.run([*ns, "true"]).returncode:
        pytest.skip("no pid namespace of our own here")
    out = subprocess.run(
        [*ns, sys.executable, "-c", REUSE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0"]
