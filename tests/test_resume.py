"""A training job SIGKILLed at a random step resumes bit-identically."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

import functional_ckpt as fc
from tests import prefork
from tests.exact import assert_exact
from tests.patience import HANG

SCRIPT = Path(__file__).with_name("training.py")
STEPS = 40


def run(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return prefork.run(
        [
            sys.executable,
            str(SCRIPT),
            str(root),
            "--steps",
            str(STEPS),
            "--save-every",
            "5",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=HANG,
    )


def losses(root: Path) -> list[tuple[int, str]]:
    lines = (root / "losses.txt").read_text().split()
    return [(int(a), b) for a, b in zip(lines[::2], lines[1::2], strict=True)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reference")
    proc = run(root)
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_random_step_resumes_bit_identically(
    reference: Path, tmp_path: Path, seed: int
) -> None:
    crash_at = random.Random(seed).randrange(3, STEPS - 2)
    crashed = run(tmp_path, "--crash-at", str(crash_at))
    assert crashed.returncode == -9, crashed.stderr  # really killed
    assert not (tmp_path / "final").exists()
    resumed = run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr

    ref = dict(losses(reference))
    got = losses(tmp_path)
    # every step logged by either process, including the replayed ones, is identical
    assert {s for s, _ in got} == set(ref)
    for step, loss in got:
        assert loss == ref[step], f"step {step}: {loss} != {ref[step]} (crash at {crash_at})"

    a = fc.restore(reference / "final")
    b = fc.restore(tmp_path / "final")
    assert_exact(fc.codec.to_python(a), fc.codec.to_python(b))


_NO_DESCRIPTORS = """
import os, sys, torch
import functional_ckpt as fc
root = sys.argv[1]
with fc.CheckpointManager(root) as m:
    m.maybe_save({"w": torch.zeros(4)}, step=1)
m = fc.CheckpointManager(root)
fds = []
try:
    while True:
        fds.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    m.restore_latest()
    print("RESULT no error")
except fc.CheckpointError as e:
    print("RESULT", type(e).__name__, e)
except OSError as e:
    print("RESULT raw", e)
finally:
    for fd in fds:
        os.close(fd)
"""


def test_running_out_of_file_descriptors_is_said_and_damages_nothing(tmp_path: Path) -> None:
    """Regression: with no free descriptors restore_latest raised a raw OSError; it must
    say what ran out, and never take the checkpoint for damage (moving it aside)."""
    import resource

    def few() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    root = tmp_path / "root"
    out = subprocess.run(
        [sys.executable, "-c", _NO_DESCRIPTORS, str(root)],
        capture_output=True,
        text=True,
        preexec_fn=few,
        check=True,
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
    assert line.startswith("RESULT CheckpointError") and "file descriptors" in line, out
    assert sorted(p.name for p in root.iterdir()) == [".lock", "run.json", "step_000000001"]
    assert fc.verify(root / "step_000000001").ok
