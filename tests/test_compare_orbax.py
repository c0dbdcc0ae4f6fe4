"""Smoke test of benchmarks/compare_orbax.py: it runs (--quick) and writes its JSON.

Runs only where the ``bench`` extra (jax, orbax-checkpoint) is installed; no timing
is asserted (the numbers are for people, see docs/comparison.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.patience import HANG

pytest.importorskip("jax", reason="the bench extra (jax[cpu]) is not installed")
pytest.importorskip(
    "orbax.checkpoint", reason="the bench extra (orbax-checkpoint) is not installed"
)

REPO = Path(__file__).resolve().parent.parent


def test_compare_orbax_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "orbax.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), env_path()])}
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "compare_orbax.py"),
            "--quick",
            "--allow-tmpfs",
            "--json",
            str(out),
            "--dir",
            str(tmp_path / "s"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    for state in ("big", "small"):
        r = data["results"][state]
        assert set(r["save"]) == {
            "fc.save",
            "fc.save_async",
            "fc.save_async(none)",
            "orbax sync",
            "orbax async",
        }
        assert set(r["restore"]) == {"fc.restore(like)", "fc.restore()", "orbax restore"}
        assert all(v is not None and v > 0 for v in r["ratios"].values())
    assert "async save: stall" in proc.stdout
    assert not any((tmp_path / "s").iterdir())  # scratch files removed


def env_path() -> str:
    return os.environ.get("PYTHONPATH", "")
