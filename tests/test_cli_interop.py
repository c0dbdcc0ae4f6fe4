"""``fckpt`` where it meets other tools and people: stock DCP directories, exports,
the spellings users type, and output that shows progress as it goes."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.cli import listing, show, verify
from functional_ckpt._src.cli.parser import build_parser
from functional_ckpt._src.cli.ui import UI
from functional_ckpt._src.export.safetensors import parse_size
from functional_ckpt._src.format.naming import EXPORT_INDEX, EXPORT_WEIGHTS, step_name

KEEP = fc.keep_last(2)


def _state(step: int) -> Any:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 256), torch.nn.Linear(256, 3))
    return fc.capture(model=model, step=step)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1..4 with keep_last(2) recorded, and an export of every step, keeping two."""
    path = tmp_path / "run"
    export = fc.manager.Export(fc.every_steps(1), keep=fc.keep_last(2))
    with fc.CheckpointManager(path, keep=KEEP, export=export) as mgr:
        for step in range(1, 5):
            mgr.maybe_save(_state(step), step=step, metrics={"loss": 1.0 / step})
    return path


def stock_dcp(path: Path, value: float = 1.0) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": {"w": torch.full((3,), value)}}, checkpoint_id=str(path))
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_ls_verify_keeps_the_recorded_retention(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, plain, _ = run(["ls", str(root)], capsys)
    code, verified, _ = run(["ls", str(root), "--verify"], capsys)
    assert code == 0
    assert "retention (recorded in the checkpoints): keep_last(2)" in verified
    for name in (step_name(3), step_name(4)):
        row = next(line for line in verified.splitlines() if line.startswith(name))
        assert "intact" in row and "keep_last(2)" in row
    assert "retention (recorded in the checkpoints): keep_last(2)" in plain


def test_ls_shows_exports(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["ls", str(root)], capsys)
    assert code == 0
    section = out[out.index("exports") :]
    assert step_name(3) in section and step_name(4) in section
    assert step_name(2) not in section  # pruned by the export's own keep_last(2)
    code, out, _ = run(["ls", str(root), "--json"], capsys)
    rows = json.loads(out)
    exports = [r for r in rows if r.get("kind") == "export"]
    assert [r["step"] for r in exports] == [3, 4]
    assert exports[0]["metrics"] == {"loss": pytest.approx(1 / 3)}
    assert all(EXPORT_WEIGHTS in r["files"] for r in exports)
    assert {r["step"] for r in rows if r.get("kind") != "export"} == {3, 4}


def test_export_and_diff_of_stock_dcp_say_what_it_is(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = stock_dcp(tmp_path / "a"), stock_dcp(tmp_path / "b", 2.0)
    ours = str(root / step_name(4))
    for argv in (
        ["export", str(a), str(tmp_path / "out")],
        ["diff", str(a), str(b)],
        ["diff", ours, str(b)],
    ):
        code, _, err = run(argv, capsys)
        assert code == 2, argv
        line = err.strip()
        assert "\n" not in line and line.startswith("fckpt: error: ")
        assert "stock torch.distributed.checkpoint" in line and "fc.restore" in line, line
        assert f"fckpt inspect {argv[1] if argv[1] != ours else b}" in line
    assert not (tmp_path / "out").exists()


def test_errors_tell_cli_users_the_flag(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(root / step_name(4))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "sub").mkdir()  # not an export: refused even with --overwrite
    for argv in (
        ["export", ckpt, str(tmp_path / "taken")],
        ["export", ckpt, str(tmp_path / "taken"), "--overwrite"],
    ):
        code, _, err = run(argv, capsys)
        assert code == 2
        assert "overwrite=True" not in err and "pass overwrite" not in err, err
    code, _, err = run(["export", ckpt, str(tmp_path / "taken")], capsys)
    assert "pass --overwrite" in err


@pytest.mark.parametrize(
    ("size", "dtype"),
    [
        ("2K", "bf16"),
        ("2KB", "bfloat16"),
        ("2kb", "BF16"),
        ("2KiB", "torch.bfloat16"),
        ("0.002M", "bf16"),
    ],
)
def test_shard_size_and_dtype_spellings(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], size: str, dtype: str
) -> None:
    out = tmp_path / "hf"
    argv = ["export", str(root), str(out), "--max-shard-size", size, "--dtype", dtype]
    code, _, err = run(argv, capsys)
    assert code == 0, err
    index = json.loads((out / EXPORT_INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert all(t.dtype == torch.bfloat16 for f in files for t in load_file(out / f).values())


def test_5g_and_fp16_are_accepted(root: Path, tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["export", str(root), str(tmp_path / "o"), "--max-shard-size", "5G", "--dtype", "fp16"]
    )
    assert parse_size(args.max_shard_size) == 5 * 10**9
    assert show.parse_dtype(args.dtype) is torch.float16


def test_diff_shows_progress_on_a_terminal_only(root: Path) -> None:
    argv = ["diff", str(root / step_name(3)), str(root / step_name(4))]
    args = build_parser().parse_args(argv)
    for tty in (True, False):
        out, err = io.StringIO(), Tty() if tty else io.StringIO()
        assert show.cmd_diff(args, UI(out=out, err=err, env={})) == 0
        assert "tensor(s) differ" in out.getvalue()
        if tty:
            assert "reading A" in err.getvalue() and "reading B" in err.getvalue()
        else:
            assert err.getvalue() == ""


def test_verify_root_reports_each_checkpoint_as_it_goes(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stock_dcp(root / "imported")
    out = io.StringIO()
    seen: list[str] = []
    real = listing.verify_one

    def spy(path: Path) -> listing.Verified:
        seen.append(out.getvalue())  # what was printed before this checkpoint is read
        return real(path)

    monkeypatch.setattr(listing, "verify_one", spy)
    args = build_parser().parse_args(["verify", str(root)])
    assert verify.cmd_verify(args, UI(out=out, err=io.StringIO(), env={})) == 0
    assert len(seen) == 2
    assert f"OK       {root / step_name(3)}" in seen[1]  # reported before step 4 was read
    text = out.getvalue()
    assert f"SKIPPED  {root / 'imported'}" in text and "cannot be verified" in text
    assert "2 checkpoints intact; 1 stock DCP not verifiable" in text
