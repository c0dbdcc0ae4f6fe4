"""What every ``fckpt`` command promises alike: ``--json``, exit statuses, junk input.

* ``--json`` on every command that prints a table or a report: stdout is one JSON
  document and nothing else; the exit status is the one without ``--json``.
* The same finding, the same status: damage is 1 wherever it is found (``verify``,
  ``ls`` with or without ``--verify``, a command that reads a damaged checkpoint),
  bad input 2, success 0.
* No input file makes a traceback: every subcommand that takes a path is fed junk
  (text, empty, a truncated zip, an HTML page, a git-lfs pointer, directories, a
  FIFO, a symlink loop) and answers with one line on stderr naming the path.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.restore.read import vetted_view
from tests import prefork
from tests.patience import HANG

HERE = Path(__file__).resolve().parent


def _state(step: int) -> Any:
    torch.manual_seed(step)
    return fc.capture(model=torch.nn.Linear(4, 3), step=step)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("contract") / "run"
    with fc.CheckpointManager(path, keep=fc.keep_last(5)) as mgr:
        for step in (10, 20, 30):
            mgr.maybe_save(_state(step), step=step, metrics={"loss": 1.0 / step})
    return path


def damage(ckpt: Path) -> None:
    """Flip one byte of a tensor's data: only a full read (verify, restore) sees it."""
    chunk = vetted_view(ckpt).tensors[("model", "weight")].chunks[0]
    with open(ckpt / chunk.file, "r+b") as f:
        f.seek(chunk.data_offset + 1)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def one_document(out: str) -> Any:
    """stdout parsed as exactly one JSON document (json.loads refuses anything more)."""
    return json.loads(out)


# --------------------------------------------------------------------------- --json


def test_verify_json(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["verify", str(root), "--json"], capsys)
    doc = one_document(out)
    assert code == 0 and err == ""
    assert doc["ok"] is True and doc["intact"] == 3 and doc["damaged"] == 0
    statuses = {Path(c["path"]).name: c["status"] for c in doc["checkpoints"]}
    assert statuses == {step_name(s): "intact" for s in (10, 20, 30)}
    assert all(c["files_checked"] > 0 and c["bytes_checked"] > 0 for c in doc["checkpoints"])

    bad = tmp_path / "bad"
    fc.save(bad, _state(1))
    damage(bad)
    code, out, _ = run(["verify", str(bad), "--json"], capsys)
    doc = one_document(out)
    assert code == 1 and doc["ok"] is False and doc["damaged"] == 1
    (entry,) = doc["checkpoints"]
    assert entry["status"] == "damaged" and "fails its checksum" in entry["problems"][0]


def test_diff_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(root / step_name(10)), str(root / step_name(20))
    code, out, err = run(["diff", a, b, "--json"], capsys)
    doc = one_document(out)
    assert code == 0 and err == ""
    assert doc["a"] == a and doc["b"] == b and doc["identical"] is False
    entries = {e["key"]: e for e in doc["entries"]}
    assert entries["step"]["kind"] == "value" and entries["step"]["detail"] == "10 -> 20"
    assert entries["model/weight"]["kind"] == "tensor"
    assert entries["model/weight"]["path"] == ["model", "weight"]
    assert "same" not in {e["kind"] for e in doc["entries"]}
    assert doc["counts"]["value"] == 1 and doc["counts"]["tensor"] >= 2
    assert len(doc["entries"]) == doc["counts"]["value"] + doc["counts"]["tensor"]
    code, out, _ = run(["diff", a, b, "--json", "--exit-code"], capsys)
    assert code == 1 and one_document(out)["identical"] is False
    code, out, _ = run(["diff", a, a, "--json", "--all", "--exit-code"], capsys)
    doc = one_document(out)
    assert code == 0 and doc["identical"] is True
    assert {e["kind"] for e in doc["entries"]} == {"same"}
    assert doc["counts"] == {"same": len(doc["entries"])}


def test_export_and_import_json(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = root / step_name(30)
    code, out, err = run(["export", str(root), str(tmp_path / "st"), "--json"], capsys)
    doc = one_document(out)
    assert code == 0 and err == ""
    assert doc["path"] == str(ckpt) and doc["out"] == str(tmp_path / "st")
    assert doc["format"] == "safetensors" and doc["select"] == "model"
    assert doc["files"] == [
        {
            "name": "model.safetensors",
            "size": (tmp_path / "st" / "model.safetensors").stat().st_size,
        }
    ]
    pt = tmp_path / "w.pt"
    code, out, _ = run(["export", str(ckpt), str(pt), "--format", "torch", "--json"], capsys)
    doc = one_document(out)
    assert code == 0 and doc["format"] == "torch" and doc["converted"] == []
    assert doc["files"] == [{"name": "w.pt", "size": pt.stat().st_size}]
    code, out, _ = run(["import", str(pt), str(tmp_path / "imp"), "--json"], capsys)
    doc = one_document(out)
    assert code == 0
    assert doc == {
        "file": str(pt),
        "path": str(tmp_path / "imp"),
        "layout": "state_dict",
        "num_tensors": 2,
        "num_values": fc.inspect(tmp_path / "imp").num_values,
        "tensor_bytes": 60,
    }


def test_prune_json(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    code, out, err = run(["prune", str(copy), "--keep-last", "1", "--json"], capsys)
    assert code == 2 and out == "" and "--yes or --dry-run" in err  # a JSON run cannot ask
    code, out, _ = run(["prune", str(copy), "--keep-last", "1", "--json", "--dry-run"], capsys)
    doc = one_document(out)
    assert code == 0 and doc["dry_run"] is True and doc["deleted"] == []
    actions = {c["step"]: c["action"] for c in doc["checkpoints"]}
    assert actions == {10: "delete", 20: "delete", 30: "keep"}
    assert (copy / step_name(10)).is_dir()
    code, out, _ = run(["prune", str(copy), "--keep-last", "1", "--json", "--yes"], capsys)
    doc = one_document(out)
    assert code == 0 and doc["deleted"] == [10, 20] and doc["freed"] > 0
    assert not (copy / step_name(10)).exists() and (copy / step_name(30)).is_dir()


def test_every_reporting_command_takes_json() -> None:
    """Each subcommand but ``run`` (whose stdout is the training command's) has --json."""
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.dest == "command")
    names = set(subs.choices)  # type: ignore[union-attr]
    assert names >= {"ls", "inspect", "verify", "diff", "export", "import", "prune", "demo"}
    for name in names - {"run"}:
        flags = {o for a in subs.choices[name]._actions for o in a.option_strings}  # type: ignore[index]
        assert "--json" in flags, name


def test_demo_json_keeps_progress_off_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's progress lines go to stderr under --json (its report is test_demo's)."""
    from functional_ckpt._src.cli import demo
    from functional_ckpt._src.cli.demo import cmd_demo
    from functional_ckpt._src.cli.ui import UI

    def fake_run_demo(root: Path, steps: int, crash_at: int | None, **kw: Any) -> Any:
        kw["say"]("[1/3] training")
        raise demo.DemoError("stopped here")

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    out, err = io.StringIO(), io.StringIO()
    args = cli.build_parser().parse_args(["demo", "--root", str(tmp_path / "d"), "--json"])
    assert cmd_demo(args, UI(out=out, err=err, env={})) == 1  # the demo failed: status 1
    assert out.getvalue() == ""
    assert "working in" in err.getvalue() and "[1/3] training" in err.getvalue()
    assert "stopped here" in err.getvalue()


# --------------------------------------------------------------------------- exit statuses


def test_damage_is_status_1_in_every_command(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(root, copy)
    damage(copy / step_name(30))
    good, bad = str(copy / step_name(20)), str(copy / step_name(30))
    for argv in (
        ["verify", str(copy)],
        ["verify", bad, "--json"],
        ["ls", str(copy), "--verify"],
        ["ls", str(copy), "--verify", "--json"],
        ["diff", good, bad],
        ["diff", good, bad, "--json"],
        ["export", bad, str(tmp_path / "e"), "--json"],
        ["export", bad, str(tmp_path / "e.pt"), "--format", "torch"],
    ):
        code, out, err = run(argv, capsys)
        assert code == 1, (argv, out, err)
    code, out, _ = run(["ls", str(copy), "--verify", "--json"], capsys)
    rows = {r["name"]: r["status"] for r in json.loads(out)}
    assert rows[step_name(30)] == "damaged" and rows[step_name(20)] == "intact"

    (copy / step_name(20) / "manifest.msgpack").write_bytes(b"torn")  # found by listing alone
    code, out, _ = run(["ls", str(copy)], capsys)
    assert code == 1 and "damaged" in out
    unmarked = tmp_path / "unmarked"
    shutil.copytree(root, unmarked)
    (unmarked / step_name(10) / "COMMITTED").unlink()  # a real name that lost its marker
    for argv in (
        ["ls", str(unmarked)],
        ["verify", str(unmarked)],
        ["verify", str(unmarked / step_name(10))],
        ["inspect", str(unmarked / step_name(10))],
    ):
        code, _, err = run(argv, capsys)
        assert code == 1, (argv, err)


def test_intact_and_bad_input_statuses(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["ls", str(root), "--verify"], ["verify", str(root)], ["ls", str(root)]):
        assert run(argv, capsys)[0] == 0, argv
    for argv in (
        ["verify", str(tmp_path / "missing"), "--json"],
        ["diff", str(root / step_name(10)), str(tmp_path / "missing"), "--json"],
        ["ls", str(root / step_name(10)), "--json"],
        ["verify", str(root), "--nope"],
    ):
        code, out, err = run(argv, capsys)
        assert code == 2 and out == "" and len(err.splitlines()) == 1, (argv, out, err)


# --------------------------------------------------------------------------- messages


def test_diff_damage_message_has_no_stray_separator(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a message listing its findings on lines after a colon was joined as
    ``damaged tensor data:; ('model', 'weight') ...``."""
    bad = tmp_path / "bad"
    fc.save(bad, _state(1))
    damage(bad)
    code, _, err = run(["diff", str(root / step_name(10)), str(bad)], capsys)
    assert code == 1
    assert ":;" not in err
    assert f"{bad}: damaged tensor data: ('model', 'weight') in " in err
    assert err.count("\n") == 1


# --------------------------------------------------------------------------- junk input


def _make_junk(where: Path) -> dict[str, Path]:
    where.mkdir()
    junk: dict[str, Path] = {}

    def add(name: str, data: bytes | None = None) -> Path:
        path = where / name
        if data is not None:
            path.write_bytes(data)
        junk[name] = path
        return path

    add("text.txt", b"hello world\nthis is not a checkpoint\n")
    add("empty", b"")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", b"x" * 1000)
        z.writestr("archive/data/0", b"\0" * 1000)
    add("truncated.zip", buf.getvalue()[:300])
    add("page.html", b"<!DOCTYPE html>\n<html><head><title>404</title></head><body>no</body>\n")
    add(
        "lfs-pointer",
        b"version https://git-lfs.github.com/spec/v1\n"
        b"oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        b"size 1234567\n",
    )
    add("empty-dir").mkdir()
    full = add("junk-dir")
    full.mkdir()
    (full / "notes.txt").write_text("junk\n")
    (full / "index.html").write_bytes(junk["page.html"].read_bytes())
    (full / "sub").mkdir()
    (full / "sub" / "x.bin").write_bytes(os.urandom(64))
    os.mkfifo(add("fifo"))
    os.symlink(where / "loop-b", add("loop-a"))
    os.symlink(where / "loop-a", where / "loop-b")
    return junk


def _commands(path: str, ckpt: str, out: str) -> dict[str, list[str]]:
    """Every way a subcommand takes a path, with ``path`` in that place."""
    return {
        "ls": ["ls", path],
        "ls --verify --json": ["ls", path, "--verify", "--json"],
        "inspect": ["inspect", path],
        "inspect --json": ["inspect", path, "--json"],
        "verify": ["verify", path],
        "verify --json": ["verify", path, "--json"],
        "diff A": ["diff", path, ckpt],
        "diff B --json": ["diff", ckpt, path, "--json"],
        "export": ["export", path, f"{out}-st"],
        "export --format torch": ["export", path, f"{out}.pt", "--format", "torch"],
        "export --config": ["export", ckpt, f"{out}-cfg", "--config", path],
        "import": ["import", path, f"{out}-imp"],
        "import --json": ["import", path, f"{out}-imp2", "--json"],
        "export to it": ["export", ckpt, path],
        "export --format torch to it": ["export", ckpt, path, "--format", "torch"],
        "import to it": ["import", f"{out}-given.pt", path],
        "prune": ["prune", path, "--keep-last", "1", "--dry-run"],
        "demo --root": ["demo", "--root", path, "--steps", "4"],
    }


JUNK = [
    "text.txt",
    "empty",
    "truncated.zip",
    "page.html",
    "lfs-pointer",
    "empty-dir",
    "junk-dir",
    "fifo",
    "loop-a",
]
COMMANDS = list(_commands("P", "C", "O"))
#: A directory holding no checkpoint is an empty root: listing it is an answer.
EMPTY_ROOT_OK = {"ls", "ls --verify --json", "prune"}


@pytest.fixture(scope="module")
def junk_results(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Any]:
    """Every (junk, command) pair, run by one driver process (a fork per command line)."""
    base = tmp_path_factory.mktemp("junk")
    junk = _make_junk(base / "in")
    (base / "out").mkdir()
    ckpt = str(root / step_name(10))
    jobs, keys = [], []
    for name in JUNK:
        torch.save({"w": torch.ones(2)}, base / "out" / f"{name}-given.pt")
        for command, argv in _commands(str(junk[name]), ckpt, str(base / "out" / name)).items():
            if command == "demo --root" and name == "empty-dir":
                continue  # an empty directory is where a demo may run: that is no junk
            jobs.append(argv)
            keys.append((name, command))
    (base / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "NO_COLOR": "1"}
    prefork.run(
        [sys.executable, str(HERE / "cli_driver.py"), str(base / "jobs.json"), str(base / "r")],
        check=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=HANG,  # a guard against a hang (a FIFO opened blocking), not a speed limit
    )
    results = json.loads((base / "r").read_text())
    return {key: {**r, "path": str(junk[key[0]])} for key, r in zip(keys, results, strict=True)}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", JUNK)
def test_junk_input_is_a_one_line_error(
    name: str, command: str, junk_results: dict[tuple[str, str], Any]
) -> None:
    if (name, command) not in junk_results:
        pytest.skip("not junk for this command")
    r = junk_results[(name, command)]
    shown = f"{r['argv']}: exit {r['code']}\nstdout: {r['out']}\nstderr: {r['err']}"
    assert "Traceback" not in r["out"] + r["err"], shown
    if name in ("empty-dir", "junk-dir") and command in EMPTY_ROOT_OK:
        assert r["code"] == 0 and r["err"] == "", shown
        return
    assert r["code"] in (1, 2), shown
    lines = r["err"].splitlines()
    assert len(lines) == 1 and lines[0].startswith("fckpt: error: "), shown
    assert r["path"] in lines[0], shown
    assert "overwrite=True" not in lines[0], shown  # the shell's spelling: --overwrite
