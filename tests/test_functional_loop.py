"""examples/functional_loop.py, SIGKILLed mid-run and resumed, ends bit-identical."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import functional_ckpt as fc
from tests import prefork
from tests.exact import assert_exact
from tests.patience import HANG

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "functional_loop.py"
ARGS = ["--steps", "150", "--every", "10"]


def command(root: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), str(root), *ARGS, *extra]


def finish(root: Path) -> str:
    proc = prefork.run(command(root), capture_output=True, text=True, timeout=HANG)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_functional_loop_killed_and_resumed_is_bit_identical(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    assert "start at step 0" in finish(reference)

    run = tmp_path / "run"
    victim = prefork.Popen(command(run, "--sleep", "0.02"), stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None
        for line in victim.stdout:
            if line.startswith("committed step_000040"):
                break
        else:
            raise AssertionError("the run ended before its fourth checkpoint")
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        victim.kill()
        victim.wait(timeout=HANG)
    assert victim.returncode == -signal.SIGKILL
    assert not (run / "final").exists()  # it really died mid-run

    out = finish(run)
    resumed = int(out.split("start at step ")[1].split()[0])
    assert 40 <= resumed < 150, out
    assert_exact(
        fc.codec.to_python(fc.restore(run / "final")),
        fc.codec.to_python(fc.restore(reference / "final")),
    )
    # Every checkpoint the resumed run wrote matches the uninterrupted run's too.
    for step in range(resumed + 10, 151, 10):
        name = f"step_{step:06d}"
        assert_exact(
            fc.codec.to_python(fc.restore(run / name)),
            fc.codec.to_python(fc.restore(reference / name)),
        )
