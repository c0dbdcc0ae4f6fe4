"""A training job SIGKILLed at a random step resumes bit-identically."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

import functional_ckpt as fc
from tests.exact import assert_exact

SCRIPT = Path(__file__).with_name("training.py")
STEPS = 40


def run(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
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
        timeout=300,
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
    assert_exact(fc.to_python(a), fc.to_python(b))
