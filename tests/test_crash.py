"""SIGKILL during fc.save at random moments: a checkpoint is absent or whole, never half."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from tests import prefork

SCRIPT = Path(__file__).with_name("save_loop.py")


def check_whole(path: Path) -> int:
    """Restore and verify one visible checkpoint; return its version."""
    state = fc.restore(path)
    version = state["version"]
    for key, t in state.items(include_nested=True, leaves_only=True):
        if isinstance(t, torch.Tensor):
            assert bool((t == float(version)).all()), f"{path} {key}: mixed versions"
    assert fc.codec.to_python(state["meta"]) == {"v": [version] * 10}
    assert fc.verify(path).ok
    return int(version)


def kill_at_random(root: Path, mode: str, delay: float) -> None:
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parent.parent)}
    proc = prefork.Popen(
        [sys.executable, str(SCRIPT), str(root), mode], stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"
    assert proc.stdout.readline().strip() == b"1"  # one save committed, however slow the machine
    time.sleep(delay)  # then a kill at a random moment of the saves that follow
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("mode", ["new", "overwrite", "async"])
def test_sigkill_during_save_never_leaves_a_readable_half(tmp_path: Path, mode: str) -> None:
    rng = random.Random(len(mode))
    last_version = 0
    for trial in range(4):
        root = tmp_path / f"t{trial}"
        root.mkdir()
        kill_at_random(root, mode, rng.uniform(0.0, 1.0))
        visible = [p for p in root.iterdir() if not naming.is_temporary_name(p.name)]
        for p in visible:
            last_version = check_whole(p)
        for p in root.iterdir():
            if naming.is_temporary_name(p.name):
                with pytest.raises(fc.errors.IncompleteCheckpoint):
                    fc.restore(p)
    assert last_version > 0  # every trial committed one save before the kill
