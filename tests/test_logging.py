"""The ``functional_ckpt`` logger: one INFO record per operation, a WARNING per fallback.

Records are read with ``caplog`` from real saves, restores, deletions and resumes; the
numbers travel as ``extra`` fields. Without configuration nothing is printed (a fresh
process with a damaged checkpoint and warnings ignored writes nothing to stderr), no
message is built, and ``fckpt -v`` routes the records to stderr.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import log
from functional_ckpt._src.export.torch_save import export_torch
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.storage.ram import promote_newest
from functional_ckpt.errors import CheckpointWarning
from tests import prefork
from tests.patience import HANG


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((256,), float(step)), "step": step}


def _records(caplog: pytest.LogCaptureFixture, start: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(start)]


@pytest.mark.parametrize("name", [step_name(7), "step_7"])  # the names ``fckpt ls`` reads
def test_a_save_and_a_restore_each_log_one_info_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    caplog.set_level(logging.INFO, logger="functional_ckpt")
    path = tmp_path / name
    info = fc.save(path, _state(7))
    [saved] = _records(caplog, "saved step 7: ")
    assert saved.name == "functional_ckpt.save" and saved.levelno == logging.INFO
    assert (saved.step, saved.bytes, saved.path) == (7, info.nbytes, str(path))  # type: ignore[attr-defined]
    assert saved.seconds == info.duration and saved.throughput > 0  # type: ignore[attr-defined]
    assert saved.getMessage().endswith(f" to {path}") and "B/s)" in saved.getMessage()
    [committed] = _records(caplog, "committed step 7: ")
    assert committed.name == "functional_ckpt.storage"
    caplog.clear()
    fc.restore(path, like=_state(0))
    [restored] = _records(caplog, "restored step 7: ")
    assert restored.name == "functional_ckpt.restore"
    assert restored.bytes == 256 * 4 and restored.getMessage().endswith(f"from {path}")  # type: ignore[attr-defined]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_phases_are_debug_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="functional_ckpt")
    fc.save(tmp_path / "c", _state(1))
    fc.restore(tmp_path / "c")
    phases = [r.getMessage().split(" of ")[0] for r in caplog.records if r.levelno == logging.DEBUG]
    assert phases == ["plan", "write and commit", "open", "match", "read"]


def test_a_manager_logs_its_resume_decision_and_its_pruning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="functional_ckpt")
    with fc.CheckpointManager(tmp_path, save=fc.every_steps(1), keep=fc.keep_last(1)) as mgr:
        assert mgr.restore_latest() is None
        [fresh] = _records(caplog, "no checkpoint in ")
        assert fresh.name == "functional_ckpt.manager" and fresh.path == str(tmp_path)  # type: ignore[attr-defined]
        for step in (1, 2):
            mgr.maybe_save(_state(step), step=step)
    [deleted] = _records(caplog, "deleted step 1: ")
    assert deleted.name == "functional_ckpt.root" and deleted.step == 1  # type: ignore[attr-defined]
    assert deleted.path == str(tmp_path / step_name(1))  # type: ignore[attr-defined]
    caplog.clear()
    with fc.CheckpointManager(tmp_path, save=fc.every_steps(1), keep=fc.keep_last(1)) as mgr:
        mgr.restore_latest()
    [resumed] = _records(caplog, "resumed step 2: ")
    assert resumed.path == str(tmp_path / step_name(2))  # type: ignore[attr-defined]


def test_a_damaged_checkpoint_skipped_is_a_warning_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (1, 2):
        fc.save(tmp_path / step_name(step), _state(step))
    shard = tmp_path / step_name(2) / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-16])  # torn: shorter than the manifest says
    with (
        pytest.warns(CheckpointWarning, match="falling back"),
        fc.CheckpointManager(tmp_path, save=fc.every_steps(1)) as mgr,
    ):
        mgr.restore_latest()
    [warned] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warned.name == "functional_ckpt.root" and "falling back" in warned.getMessage()
    assert warned.category == "CheckpointWarning"  # type: ignore[attr-defined]
    assert mgr.restored_step == 1


def test_a_promotion_logs_its_copy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="functional_ckpt")
    fc.save(tmp_path / "ram" / step_name(3), _state(3))
    dest = promote_newest(tmp_path / "disk", [tmp_path / "ram" / step_name(3)], HANG)
    assert dest == tmp_path / "disk" / step_name(3)
    [promoted] = _records(caplog, "promoted step 3: ")
    assert promoted.name == "functional_ckpt.manager" and promoted.path == str(dest)  # type: ignore[attr-defined]


def test_no_message_is_built_while_nobody_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(n: float) -> str:
        raise AssertionError("a log message was formatted with logging disabled")

    monkeypatch.setattr(log, "size", refuse)
    # Nobody listens, whatever an earlier test in this process set on the root logger.
    logger = logging.getLogger("functional_ckpt")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        assert not logging.getLogger("functional_ckpt.save").isEnabledFor(logging.INFO)
        fc.save(tmp_path / "c", _state(1))
        fc.restore(tmp_path / "c")
    finally:
        logger.setLevel(level)


def test_nothing_is_printed_unless_the_application_configures_logging(tmp_path: Path) -> None:
    code = (
        "import warnings, torch, functional_ckpt as fc\n"
        "from functional_ckpt._src.format.naming import step_name\n"
        "warnings.simplefilter('ignore')\n"
        f"root = {str(tmp_path)!r}\n"
        "for s in (1, 2): fc.save(f'{root}/{step_name(s)}', {'w': torch.ones(64) * s})\n"
        "p = f'{root}/{step_name(2)}/__0_0.distcp'\n"
        "b = open(p, 'rb').read(); open(p, 'wb').write(b[:-16])\n"
        "with fc.CheckpointManager(root, save=fc.every_steps(1)) as m:\n"
        "    assert m.restore_latest() is not None and m.restored_step == 1\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = prefork.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG, env=env
    )
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_fckpt_verbose_prints_the_records(tmp_path: Path) -> None:
    fc.save(tmp_path / step_name(4), {"model": {"w": torch.ones(8)}})
    argv = [sys.executable, "-m", "functional_ckpt"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "NO_COLOR": "1"}
    export = ["export", str(tmp_path / step_name(4)), str(tmp_path / "out")]
    quiet = prefork.run([*argv, *export], capture_output=True, text=True, env=env)
    assert quiet.returncode == 0 and "functional_ckpt" not in quiet.stderr
    loud = prefork.run(
        [*argv, "-v", *export, "--overwrite"], capture_output=True, text=True, env=env
    )
    assert loud.returncode == 0
    assert "fckpt: functional_ckpt.export: exported: " in loud.stderr
    assert f"to {tmp_path / 'out'}" in loud.stderr


def test_warn_counts_its_stacklevel_as_warnings_does() -> None:
    def caller() -> None:
        log.warn("a fallback", CheckpointWarning, stacklevel=2)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        caller()  # the line the warning names
    lines = Path(__file__).read_text().splitlines()
    assert seen[0].filename == __file__
    assert lines[seen[0].lineno - 1].endswith("caller()  # the line the warning names")


def test_an_upload_logs_its_bytes(
    tmp_path: Path, mem: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="functional_ckpt")
    with fc.CheckpointManager(tmp_path, tiers=(fc.manager.Remote(mem),)) as mgr:
        mgr.maybe_save(_state(4), step=4)
        assert mgr.remote is not None and mgr.remote.wait()
    [uploaded] = _records(caplog, "uploaded step 4: ")
    local = tmp_path / step_name(4)
    size = sum(f.stat().st_size for f in local.iterdir() if f.name != "COMMITTED")  # its data
    assert uploaded.name == "functional_ckpt.remote" and uploaded.bytes == size  # type: ignore[attr-defined]
    assert uploaded.path == f"{mem}/{step_name(4)}"  # type: ignore[attr-defined]


def _a_policy_changed(root: Path) -> None:
    with fc.CheckpointManager(root, save=fc.every_steps(1)) as mgr:
        mgr.maybe_save(_state(1), step=1)
    with fc.CheckpointManager(root, save=fc.every_secs(5)) as mgr:
        mgr.restore_latest()


def _nothing_to_roll_back_to(root: Path) -> None:
    rule = fc.policy.on_degrade("reward", mode="max", patience=1)
    with fc.CheckpointManager(root, save=fc.policy.never(), rollback=rule) as mgr:
        mgr.maybe_save(_state(1), step=1, metrics={"reward": 1.0})
        mgr.maybe_save(_state(2), step=2, metrics={"reward": math.nan})


def _wrapped_names_exported(root: Path) -> None:
    fc.export_safetensors({"model": {"_orig_mod": {"w": torch.ones(2)}}}, root / "hf")


@pytest.mark.parametrize(
    ("fallback", "stage", "match"),
    [
        (_a_policy_changed, "manager", "that policy starts fresh"),
        (_nothing_to_roll_back_to, "manager", "nothing to roll back to"),
        (_wrapped_names_exported, "export", "strip_prefix="),
    ],
    ids=["policy", "rollback", "export"],
)
def test_every_fallback_warned_of_is_a_warning_record(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fallback: Any, stage: str, match: str
) -> None:
    with pytest.warns(CheckpointWarning, match=match) as caught:
        fallback(tmp_path)
    warned = [(f"functional_ckpt.{stage}", str(w.message), "CheckpointWarning") for w in caught]
    logged = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [(r.name, r.getMessage(), r.category) for r in logged] == warned  # type: ignore[attr-defined]


def _export(how: str, ck: Path, out: Path) -> Path:
    if how == "manager":
        export = fc.manager.Export(fc.every_steps(2))
        with fc.CheckpointManager(out, save=fc.every_steps(1), export=export) as mgr:
            for step in (1, 2):
                mgr.maybe_save({"model": {"w": torch.ones(8)}}, step=step)
        return out / "exports" / step_name(2)
    if how == "safetensors":
        return fc.export_safetensors(ck, out)
    export_torch(ck, out, select=None if how == "torch full" else "model")
    return out


@pytest.mark.parametrize(
    ("how", "step"), [("manager", 2), ("safetensors", None), ("torch", None), ("torch full", None)]
)
def test_every_export_is_one_record_with_the_step_its_path_names(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str, step: int | None
) -> None:
    ck = tmp_path / "ck"
    fc.save(ck, {"model": {"w": torch.ones(8)}})
    caplog.set_level(logging.INFO, logger="functional_ckpt")
    out = _export(how, ck, tmp_path / "out")
    [exported] = [r for r in caplog.records if r.name == "functional_ckpt.export"]
    assert (exported.path, exported.step) == (str(out), step)  # type: ignore[attr-defined]
    assert exported.getMessage().startswith(
        "exported: " if step is None else f"exported step {step}: "
    )
    assert exported.bytes > 0  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "step"), [("best", None), ("step_5", 5)])
def test_a_removed_checkpoints_record_names_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, name: str, step: int | None
) -> None:
    for each in ("last", name):
        fc.save(tmp_path / "runs" / each, _state(1))
    caplog.set_level(logging.INFO, logger="functional_ckpt")
    fc.manager.remove_checkpoint(tmp_path / "runs" / name)
    [deleted] = _records(caplog, "deleted")
    assert (deleted.path, deleted.step) == (str(tmp_path / "runs" / name), step)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("fast_retries")
def test_the_remote_retention_logs_each_deletion(
    tmp_path: Path, mem: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="functional_ckpt")
    remote = fc.manager.Remote(mem, keep=fc.keep_last(1))
    with fc.CheckpointManager(tmp_path, tiers=(remote,)) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(_state(step), step=step)
            assert mgr.remote is not None and mgr.remote.wait()
        assert mgr.remote.steps() == [3]
    deleted = [r for r in _records(caplog, "deleted") if r.name == "functional_ckpt.remote"]
    assert [(r.step, r.path) for r in deleted] == [(s, f"{mem}/{step_name(s)}") for s in (1, 2)]  # type: ignore[attr-defined]
