"""Bounded document loading attacked from its documentation (docs/reliability.md: "Every
untrusted document is bounded before it is expanded ... a ConfigError naming the key" and
"fckpt: error: ..."): hostile run records and config files."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from tests import prefork
from tests.patience import HANG

REPO = Path(__file__).parent.parent
CLI = "import sys; from functional_ckpt._src.cli import main; sys.exit(main(sys.argv[1:]))"
HUGE_INT = b"1" + b"0" * 5000  # past Python's 4300-digit int conversion limit


def root_with_one_step(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    with fc.CheckpointManager(root, save=fc.every_steps(1)) as mgr:
        mgr.maybe_save({"w": torch.ones(2)}, step=1)
    return root


# A directory in place of run.json is a CheckpointError naming it, never a bare
# IsADirectoryError from a rename (reliability.md says the same of .lock: "a FIFO or a directory in
# its place makes a writing manager refuse with a CheckpointError naming it").
def test_a_directory_named_run_json_is_a_checkpoint_error(tmp_path: Path) -> None:
    root = root_with_one_step(tmp_path)
    (root / "run.json").unlink()
    (root / "run.json").mkdir()
    with pytest.raises(fc.CheckpointError, match=r"run\.json"):
        fc.CheckpointManager(root, save=fc.every_steps(1)).close()
    assert fc.verify(root / "step_000000001").ok


def _write(data: bytes) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(data)


# Holds: garbage, bombs and special files in place of run.json never hang or crash a
# writing manager, and its checkpoints stay (reliability.md, bounded documents).
@pytest.mark.parametrize(
    "make",
    [
        _write(b"[" * 200_000 + b"]" * 200_000),
        _write(b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        _write(b'{"run": 1e999999999, "secret": "x"}'),
        _write(b'{"run": ' + HUGE_INT + b', "secret": "x"}'),
        _write(b'{"run": "a", "run": "b", "secret": "x"}'),
        _write(b'{"run": "\xff\xfe", "secret": "x"}'),
        _write(b'{"run": NaN, "secret": Infinity}'),
        _write(b""),
        os.mkfifo,
        lambda p: p.symlink_to("/dev/zero"),
    ],
    ids=[
        "deep-list",
        "deep-map",
        "big-float",
        "huge-int",
        "dup-keys",
        "non-utf8",
        "nan",
        "empty",
        "fifo",
        "devzero",
    ],
)
def test_a_hostile_run_json_is_survived(tmp_path: Path, make: Callable[[Path], None]) -> None:
    root = root_with_one_step(tmp_path)
    (root / "run.json").unlink()
    make(root / "run.json")
    with fc.CheckpointManager(root, save=fc.every_steps(1)) as mgr:
        assert mgr.restore_latest() is not None
        mgr.maybe_save({"w": torch.ones(2)}, step=2)
    assert mgr.steps() == [1, 2]


# Broken: "Both give one line (fckpt: error: ...)" naming what is at fault (reliability.md,
# bounded documents): a 5001-digit integer in `fckpt run --config FILE` gives Python's int
# conversion message, naming neither the file nor the key.
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_fckpt_run_names_the_config_holding_a_huge_integer(tmp_path: Path, suffix: str) -> None:
    config = tmp_path / f"job{suffix}"
    text = (
        b'{"run": {"retries": ' + HUGE_INT + b"}}"
        if suffix == ".json"
        else b"run:\n  retries: " + HUGE_INT
    )
    config.write_bytes(text + b"\n")
    proc = prefork.run(
        [
            sys.executable,
            "-c",
            CLI,
            "run",
            "--config",
            str(config),
            "--",
            sys.executable,
            "-c",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=HANG,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2 and "fckpt: error:" in proc.stderr
    assert config.name in proc.stderr, proc.stderr
