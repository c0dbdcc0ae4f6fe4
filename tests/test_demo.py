"""``fckpt demo`` end to end with few steps, and its report's building blocks."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.cli import demo
from tests import prefork
from tests.patience import HANG

STEPS, CRASH_AT = 40, 17
FCKPT = [sys.executable, "-m", "functional_ckpt"]


@pytest.fixture(scope="module")
def demo_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    root = tmp_path_factory.mktemp("demo") / "root"
    proc = prefork.run(
        [*FCKPT, "demo", "--root", str(root), "--steps", str(STEPS), "--crash-at", str(CRASH_AT)],
        capture_output=True,
        text=True,
        timeout=HANG,
        env={**os.environ, "NO_COLOR": "1"},
    )
    return root, proc


def test_demo_reports_bit_identical(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    _, proc = demo_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert f"killed at step {CRASH_AT} (exit -9, SIGKILL)" in out
    assert "IDENTICAL: the crashed and resumed run is, bit for bit" in out
    assert f"per-step losses      {STEPS}/{STEPS} bit-identical" in out
    assert "final parameters     7 tensors (1.1 MB): bit-identical" in out
    assert "full training state  bit-identical" in out
    assert "(async)" in out  # the manager has async saves: the demo uses them
    assert "blocked on saves" in out and "saves started" in out
    assert "\033[" not in out
    # Not a terminal: plain progress lines, the first one as each phase starts.
    for label, total in ((f"run until SIGKILL at {CRASH_AT}", CRASH_AT), ("resumed run", STEPS)):
        assert f"      {label}: step 0/{total}" in out, out


def attempt(events: Path) -> demo.ChildLog:
    tail = demo.EventTail(events)
    tail.poll()
    return demo.read_attempt(tail.events, 0)


def test_demo_resumed_from_a_checkpoint_before_the_crash(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    root, proc = demo_run
    assert proc.returncode == 0, proc.stderr
    first, second = (attempt(root / "logs" / f"run-{i}.events.jsonl") for i in (1, 2))
    assert first.last_step == CRASH_AT and min(first.losses) == 1
    assert second.resumed_from is not None and 0 < second.resumed_from <= CRASH_AT
    assert min(second.losses) == second.resumed_from + 1
    assert max(second.losses) == STEPS
    assert first.async_save and second.async_save
    mgr = fc.CheckpointManager(root / "run" / "checkpoints", read_only=True)
    assert mgr.latest_step() == STEPS and mgr.info(STEPS).is_final
    assert len(mgr.steps()) <= 5  # keep_last(3) | keep_best(2)


def test_demo_leaves_a_root_the_cli_understands(
    demo_run: tuple[Path, subprocess.CompletedProcess[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    root, _ = demo_run
    ckpts = root / "run" / "checkpoints"
    assert cli.main(["ls", str(ckpts)]) == 0
    out = capsys.readouterr().out
    assert "retention (recorded in the checkpoints): keep_last(3) | keep_best(2, 'val_loss')" in out
    assert "latest" in out
    assert cli.main(["verify", str(ckpts), "--quiet"]) == 0


def test_demo_reuses_its_own_root_but_no_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    code = cli.main(["demo", "--root", str(tmp_path), "--steps", "4"])
    err = capsys.readouterr().err
    assert code == 2
    assert "not empty and not an earlier demo directory" in err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--steps", "1"], "at least 2 steps"),
        (["--steps", "10", "--crash-at", "10"], "between 1 and 9"),
    ],
)
@pytest.mark.parametrize("root", [True, False])
def test_demo_bad_arguments(
    argv: list[str],
    fragment: str,
    root: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a demo without --root works
    code = cli.main(["demo", *(["--root", str(tmp_path / "r")] if root else []), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("fckpt: error: ") and fragment in err and err.count("\n") == 1
    assert os.listdir(tmp_path) == []  # nothing made before the refusal


def test_heartbeat_prints_a_line_at_most_every_few_seconds() -> None:
    now = [100.0]
    lines: list[str] = []
    beat = demo.Heartbeat("resumed run", 50, lines.append, every=5.0, clock=lambda: now[0])
    for t, step in ((100.0, 0), (101.0, 3), (104.9, 9), (105.0, 10), (109.0, 20), (111.0, 30)):
        now[0] = t
        beat.update(step)
    beat.close()
    assert lines == [
        "      resumed run: step 0/50",
        "      resumed run: step 10/50",
        "      resumed run: step 30/50",
    ]


def test_sparkline_marks_crash_and_resume() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    line, marks = demo.sparkline(values, 10, {41: "R", 50: "X"}, ascii_only=True).splitlines()
    assert len(line) == 10 and line[0] == "@" and line[-1] == "_"
    assert marks == "    X"  # steps 41 and 50 share column 4; the later mark wins
    line, marks = demo.sparkline(values, 100, {1: "R", 100: "X"}, ascii_only=False).splitlines()
    assert marks[0] == "R" and marks[-1] == "X" and set(line) <= set(demo.SPARKS)


def test_schedule_scales_with_steps() -> None:
    small, default = demo.Schedule.for_steps(40), demo.Schedule.for_steps(demo.DEFAULT_STEPS)
    assert small.eval_every == 2 and small.save_every == 16
    assert default.save_every % default.eval_every == 0
    assert default.lr_factor(0) < default.lr_factor(default.warmup) == pytest.approx(1.0)
    assert default.lr_factor(default.steps) == pytest.approx(0.1)
    assert demo.crash_step(100, None) == 40 and demo.crash_step(2, None) == 1
