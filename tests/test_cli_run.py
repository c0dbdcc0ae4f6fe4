"""``fckpt run`` with real processes: relaunch after crashes, stop on success or on a signal.

The jobs are :mod:`tests.run_job` (a tiny state, a real CheckpointManager) or a
one-line Python command; pauses between attempts are a tenth of a second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.cli.run import Attempt, Resumable, exit_status, outcome_text
from functional_ckpt._src.format.naming import step_name
from tests.patience import HANG, eventually

REPO = Path(__file__).resolve().parent.parent
JOB = [sys.executable, str(REPO / "tests" / "run_job.py")]
FAIL = [sys.executable, "-c", "raise SystemExit(1)"]


def fckpt_run(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(["run", *argv])
    out, err = capfd.readouterr()
    return code, out, err


def log_lines(root: Path) -> list[str]:
    return Path(f"{root}.log").read_text().splitlines()


def test_a_job_that_crashes_twice_is_resumed_twice_and_finishes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    code, _, err = fckpt_run(
        capfd,
        "--retries=3",
        "--backoff=0.1",
        f"--root={root}",
        "--",
        *JOB,
        str(root),
        "--steps=30",
        "--save-every=5",
        "--fail=1:kill:12",
        "--fail=2:exit:23",
    )
    assert code == 0, err
    assert log_lines(root) == [
        "attempt 1: from 0, killed at 12",
        "attempt 2: from 10, failed at 23",
        "attempt 3: from 20, finished",
    ]
    assert "attempt 1 ended: SIGKILL" in err and "checkpoint step none -> 10" in err
    assert "attempt 2 ended: exit 1" in err and "checkpoint step 10 -> 20" in err
    assert "attempt 3 ended: exit 0" in err and "checkpoint step 20 -> 30" in err
    assert "attempt 4" not in err  # never relaunched after success
    assert err.count("relaunching in 0.1 s") == 2  # progress made: the pause starts over
    rows = [line.split() for line in err.splitlines() if line[:1].isdigit()]
    assert [r[:2] for r in rows] == [["1", "SIGKILL"], ["2", "exit"], ["3", "exit"]]
    assert "3 attempts, 2 relaunches" in err and "exit status 0" in err
    final = fc.restore(root / step_name(30))
    assert final["w"].tolist() == [30.0] * 4  # every step done exactly once in the end state


def test_an_always_failing_job_gets_every_retry_then_its_exit_status(
    capfd: pytest.CaptureFixture[str],
) -> None:
    code, _, err = fckpt_run(
        capfd, "--retries=3", "--backoff=0.1", "--max-backoff=0.2", "--stall-limit=0", "--", *FAIL
    )
    assert code == 1
    assert [f"attempt {n} ended: exit 1" in err for n in (1, 2, 3, 4)] == [True] * 4
    assert "attempt 5" not in err and "no retries left" in err
    pauses = [
        line.rsplit("relaunching in ", 1)[1]
        for line in err.splitlines()
        if "relaunching in" in line
    ]
    assert pauses == ["0.1 s", "0.2 s", "0.2 s"]  # doubled, then capped by --max-backoff
    assert "4 attempts, 3 relaunches" in err and "exit status 1" in err


def test_identical_quick_failures_stop_early(capfd: pytest.CaptureFixture[str]) -> None:
    code, _, err = fckpt_run(capfd, "--retries=5", "--backoff=0.1", "--", *FAIL)
    assert code == 1
    assert "attempt 2 ended: exit 1" in err and "attempt 3" not in err
    assert "stopping early" in err and "failed the same way (exit 1)" in err
    assert "2 attempts" in err


def test_no_checkpoint_progress_between_failures_stops_early(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    code, _, err = fckpt_run(
        capfd,
        "--retries=5",
        "--backoff=0.1",
        f"--root={root}",
        "--",
        *JOB,
        str(root),
        "--steps=30",
        "--save-every=5",
        "--fail=*:exit:7",
    )
    assert code == 1
    assert log_lines(root) == ["attempt 1: from 0, failed at 7", "attempt 2: from 5, failed at 7"]
    assert "stopping early" in err and "at step 5 (no checkpoint saved in between)" in err
    assert "attempt 3" not in err


def test_a_signal_by_death_gives_the_shell_status(capfd: pytest.CaptureFixture[str]) -> None:
    kill = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    code, _, err = fckpt_run(capfd, "--retries=0", "--", *kill)
    assert code == 128 + signal.SIGKILL
    assert "attempt 1 ended: SIGKILL" in err and "no retries left" in err


def _start(*argv: str) -> subprocess.Popen[str]:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "functional_ckpt", "run", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    eventually(path.exists, f"{path} to appear", alive=lambda: proc.poll() is None)


# Launchers between fckpt run and the job. One ignores SIGTERM and waits for the job (as
# torchrun does, roughly): the job hears the signal only because it goes to the whole
# process group. The other dies of the SIGTERM at once, leaving the job saving: fckpt
# run waits for it all the same.
LAUNCHERS = {
    "direct": ([], 0),
    "through-a-launcher": (
        [
            sys.executable,
            "-c",
            "import signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "sys.exit(subprocess.call(sys.argv[1:]))",
        ],
        0,
    ),
    "launcher-dies-first": (
        [sys.executable, "-c", "import subprocess, sys; subprocess.call(sys.argv[1:])"],
        128 + signal.SIGTERM,
    ),
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_sigterm_reaches_the_job_which_saves_and_is_not_relaunched(
    tmp_path: Path, launcher: str
) -> None:
    root, ready = tmp_path / "ckpt", tmp_path / "ready"
    prefix, status = LAUNCHERS[launcher]
    job = [*JOB, str(root), "--steps=100000", "--save-every=100000", "--step-time=0.005"]
    job.append(f"--ready={ready}")
    proc = _start("--retries=3", "--backoff=0.1", f"--root={root}", "--", *prefix, *job)
    _wait_for(ready, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == status, err
    (line,) = log_lines(root)
    stopped_at = int(line.rsplit(" ", 1)[1])
    assert line == f"attempt 1: from 0, stopped at {stopped_at}"
    assert fc.CheckpointManager(root, read_only=True).steps() == [stopped_at]  # on_signal saved
    assert "SIGTERM was passed on to it: not relaunching" in err
    assert "attempt 2" not in err and "1 attempt;" in err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_processes_a_failed_command_leaves_behind_are_ended_before_a_relaunch(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pids = tmp_path / "pids"
    leave = f"sleep 60 & echo $! >> {pids}; exit 1"
    code, _, err = fckpt_run(capfd, "--retries=1", "--backoff=0", "--", "sh", "-c", leave)
    assert code == 1
    first, second = (int(p) for p in pids.read_text().split())
    assert err.count("left processes behind") == 2
    assert not _alive(first) and not _alive(second)
    # the first sleep was gone before the second attempt started
    assert err.index("left processes behind") < err.index("attempt 2 of 2")


def test_a_stop_during_the_pause_prevents_the_relaunch() -> None:
    # The pause outlasts the hang guard: only a stop that ends it lets communicate() return.
    proc = _start("--retries=3", f"--backoff={2 * HANG:.0f}", "--stall-limit=0", "--", *FAIL)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "relaunching in" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=HANG)  # did not sit out the pause
    assert proc.returncode == 1  # the last attempt's status
    assert "SIGINT received: not relaunching" in rest and "attempt 2" not in rest


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "no command to run"),
        (["--"], "no command to run"),
        (["--retries=-1", "--", "true"], "integer >= 0"),
        (["--backoff=soon", "--", "true"], "expected seconds"),
        (["--stall-limit=1", "--", "true"], "2 or more"),
        (["--", "/nonexistent/train"], "command not found"),
    ],
)
def test_bad_input_is_one_line(
    argv: list[str], fragment: str, capfd: pytest.CaptureFixture[str]
) -> None:
    code, _, err = fckpt_run(capfd, *argv)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("fckpt: error:")]
    assert len(errors) == 1 and fragment in errors[0], err


@pytest.mark.parametrize(
    ("name", "fragment"),
    [("one", "is a checkpoint"), ("one/x", "inside a checkpoint"), ("notes.txt", "a file")],
)
def test_root_that_cannot_hold_checkpoints_is_refused(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], name: str, fragment: str
) -> None:
    fc.save(tmp_path / "one", {"x": 1})
    (tmp_path / "notes.txt").write_text("not a root\n")
    code, out, err = fckpt_run(capfd, f"--root={tmp_path / name}", "--", "true")
    assert code == 2 and out == ""
    (error,) = err.splitlines()
    assert error.startswith(f"fckpt: error: --root {tmp_path / name}: {fragment}"), err


def test_time_lost_counts_work_since_the_last_checkpoint() -> None:
    a = Attempt(1, started=100.0, resumed_from=None, ended=160.0, returncode=-9)
    a.reached, a.waited = Resumable(10, time=150.0), 2.0
    assert a.lost(root_known=True) == 12.0  # 10 s after the save began, plus the pause
    assert a.lost(root_known=False) == 62.0  # without a root: the whole attempt
    a.reached = Resumable(10, time=90.0)  # saved before this attempt began: nothing kept
    a.resumed_from = a.reached
    assert a.lost(root_known=True) == 62.0
    assert exit_status(-15) == 143 and outcome_text(-15) == "SIGTERM"
    assert outcome_text(3) == "exit 3"


# ------------------------------------------------------------- progress without a root


def test_a_job_crashing_later_each_time_gets_every_retry_without_a_root(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Its manager reports each commit through FCKPT_PROGRESS: progress, so relaunched."""
    root = tmp_path / "ckpt"
    fails = ["--fail=1:exit:17", "--fail=2:exit:23", "--fail=3:exit:29"]
    job = [*JOB, str(root), "--steps=40", "--save-every=5"]
    code, _, err = fckpt_run(capfd, "--retries=3", "--backoff=0.1", "--", *job, *fails)
    assert code == 0, err
    assert log_lines(root) == [
        "attempt 1: from 0, failed at 17",
        "attempt 2: from 15, failed at 23",
        "attempt 3: from 20, failed at 29",
        "attempt 4: from 25, finished",
    ]
    assert "stopping early" not in err
    assert "checkpoint step none -> 15" in err and "checkpoint step 15 -> 20" in err
    assert "checkpoint step 25 -> 40" in err and "4 attempts, 3 relaunches" in err
    # Failing every time, later each time: relaunched --retries times, then its status.
    root = tmp_path / "again"
    job = [*JOB, str(root), "--steps=40", "--save-every=5"]
    code, _, err = fckpt_run(
        capfd, "--retries=3", "--backoff=0.1", "--", *job, *fails, "--fail=4:exit:35"
    )
    assert code == 1
    assert len(log_lines(root)) == 4 and "no retries left" in err and "stopping early" not in err


def test_the_same_failure_without_progress_stops_early_without_a_root(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    job = [*JOB, str(root), "--steps=30", "--save-every=5", "--fail=*:exit:7"]
    code, _, err = fckpt_run(capfd, "--retries=5", "--backoff=0.1", "--", *job)
    assert code == 1
    assert log_lines(root) == ["attempt 1: from 0, failed at 7", "attempt 2: from 5, failed at 7"]
    assert "stopping early: attempts 1 and 2 both failed at step 5 (no checkpoint saved" in err
    assert "attempt 3" not in err


# --------------------------------------------------------------------------- --config


def test_retries_and_backoff_come_from_the_config(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "ckpt.json"
    run = {"retries": 2, "backoff": 0.1, "max_backoff": 0.2, "stall_limit": 0}
    cfg.write_text(json.dumps({"root": str(tmp_path / "r"), "run": run}))
    code, _, err = fckpt_run(capfd, f"--config={cfg}", "--", *FAIL)
    assert code == 1
    assert "attempt 3 ended: exit 1" in err and "attempt 4" not in err and "no retries left" in err
    pauses = [
        line.rsplit("relaunching in ", 1)[1]
        for line in err.splitlines()
        if "relaunching in" in line
    ]
    assert pauses == ["0.1 s", "0.2 s"]
    # A flag on the command line wins over the file.
    code, _, err = fckpt_run(capfd, f"--config={cfg}", "--retries=0", "--", *FAIL)
    assert "attempt 1 ended: exit 1" in err and "attempt 2" not in err


def test_a_yaml_config_block_of_a_larger_file(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("yaml")
    cfg = tmp_path / "train.yaml"
    cfg.write_text(
        "model: {layers: 2}\n"
        "trainer:\n"
        "  checkpoint:\n"
        "    save: {every_steps: 5}\n"
        "    run: {retries: 1, backoff: 0.1, stall_limit: 0}\n"
    )
    code, _, err = fckpt_run(
        capfd, f"--config={cfg}", "--config-key=trainer.checkpoint", "--", *FAIL
    )
    assert code == 1
    assert "attempt 2 ended: exit 1" in err and "attempt 3" not in err


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({"run": {"retry": 3}}, "run.retry: unknown option; known: retries, backoff"),
        ({"retries": 3}, "config.retries: unknown key; known: root, save"),
        ({"run": {"retries": "3"}}, "run.retries: expected an int, got '3'"),
    ],
)
def test_a_bad_config_is_one_line_naming_its_key(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], document: dict[str, object], fragment: str
) -> None:
    cfg = tmp_path / "ckpt.json"
    cfg.write_text(json.dumps(document))
    code, _, err = fckpt_run(capfd, f"--config={cfg}", "--", "true")
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("fckpt: error:")]
    assert len(errors) == 1 and fragment in errors[0], err
    code, _, err = fckpt_run(capfd, f"--config={tmp_path / 'missing.json'}", "--", "true")
    assert code == 2 and "no such file" in err


def test_a_job_resuming_further_from_ram_each_time_makes_progress(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    root, memory = tmp_path / "ckpt", tmp_path / "mem"
    job = [*JOB, str(root), "--steps=12", "--save-every=100", f"--memory={memory}"]
    argv = ["--retries=5", "--backoff=0.1", "--stall-limit=2", f"--root={root}", "--"]
    code, _, err = fckpt_run(capfd, *argv, *job, "--die-after=3")
    assert code == 0, err  # never declared stuck: each attempt got 3 steps further in RAM
    assert log_lines(root) == [
        "attempt 1: from 0, killed at 3",
        "attempt 2: from 3, killed at 6",
        "attempt 3: from 6, killed at 9",
        "attempt 4: from 9, killed at 12",
        "attempt 5: from 12, finished",
    ]
    assert "stopping early" not in err
