"""The ``fckpt`` command line on real checkpoints, good input and bad.

Most cases call ``main(argv)`` in-process (fast); a few run
``python -m functional_ckpt`` in a subprocess to check the real entry point,
exit statuses and the one-line errors end to end.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.cli import listing, ui
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.restore.diff import same_value, tensor_delta
from functional_ckpt._src.restore.read import vetted_view
from tests import prefork
from tests.forge import resign
from tests.patience import HANG

KEEP = fc.keep_last(2) | fc.keep_best(1, "val_loss", mode="min")
VAL_LOSSES = {10: 0.9, 20: 0.5, 30: 0.7, 40: 0.8, 50: 0.6}


def _model_state(step: int) -> Any:
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return fc.capture(model=model, optimizer=opt, step=step)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A manager root: steps 10..50 saved, retention left 20 (best), 40 and 50 (last)."""
    path = tmp_path_factory.mktemp("cli") / "run"
    with fc.CheckpointManager(path, keep=KEEP, metadata={"retention": repr(KEEP)}) as mgr:
        for step, val in VAL_LOSSES.items():
            mgr.maybe_save(_model_state(step), step=step, metrics={"val_loss": val})
    return path


@pytest.fixture
def copy(root: Path, tmp_path: Path) -> Path:
    """A private copy of the root, for tests that damage or delete."""
    dest = tmp_path / "run"
    shutil.copytree(root, dest)
    return dest


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def corrupt_tensor_data(ckpt: Path, key: tuple[str, ...] = ("model", "2.weight")) -> None:
    """Flip one byte of ``key``'s tensor data (not of a blob header) in its shard file."""
    chunk = vetted_view(ckpt).tensors[key].chunks[0]
    with open(ckpt / chunk.file, "r+b") as f:
        f.seek(chunk.data_offset + chunk.nbytes // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def assert_one_line_error(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("fckpt: error: "), err
    for frag in fragments:
        assert frag in lines[0], err
    assert "Traceback" not in err


# --------------------------------------------------------------------------- parser


def test_help_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["--help"], capsys)
    assert code == 0 and "examples:" in out and "exit status" in out
    for cmd in ("ls", "inspect", "verify", "diff", "export", "prune", "demo"):
        code, out, _ = run([cmd, "--help"], capsys)
        assert code == 0, cmd
        assert "examples:" in out and f"fckpt {cmd}" in out, cmd


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        ([], "required"),
        (["bogus"], "invalid choice"),
        (["ls"], "root"),
        (["prune", "x"], "--keep-last"),
        (["prune", "x", "--keep-last", "0"], "positive integer"),
        (["demo", "--steps", "many"], "positive integer"),
    ],
)
def test_wrong_flags_are_one_line_usage_errors(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert_one_line_error(err, fragment, "--help")


URL = "s3://bucket/run"


@pytest.mark.parametrize(
    "argv",
    [
        ["diff", f"{URL}/step_000000001", "b"],
        ["export", URL, "out"],
        ["export", "ck", f"{URL}/out"],
        ["import", "model.pt", f"{URL}/step_000000001"],
        ["prune", URL, "--keep-last", "1", "--dry-run"],
        ["run", "--root", URL, "--", "true"],
        ["demo", "--root", URL],
    ],
    ids=lambda argv: argv[0],
)
def test_a_url_where_only_a_local_path_is_taken_is_refused_as_given(
    argv: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert_one_line_error(err, f"got '{URL}", "expected a local path")
    assert os.listdir(tmp_path) == []  # nothing made at a local path the URL was taken for


# --------------------------------------------------------------------------- ls


def test_ls_shows_steps_metrics_status_and_retention(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(["ls", str(root)], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["CHECKPOINT", "STEP", "SAVED"]
    rows = {line.split()[0]: line for line in lines[1:] if line.startswith("step_")}
    assert sorted(rows) == [step_name(s) for s in (20, 40, 50)]
    assert (
        "val_loss=0.5" in rows[step_name(20)] and "keep_best(1, 'val_loss')" in rows[step_name(20)]
    )
    assert "keep_last(2)" in rows[step_name(40)]
    assert "latest" in rows[step_name(50)]
    assert all(" ok " in row for row in rows.values())
    assert "retention (recorded in the checkpoints)" in out
    assert "\033[" not in out  # not a terminal: no colours


def test_ls_what_if_policy_from_flags(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["ls", str(root), "--keep-last", "1"], capsys)
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("step_")}
    assert "deleted by the next prune" in rows[step_name(20)]
    assert "deleted by the next prune" in rows[step_name(40)]
    assert "keep_last(1)" in rows[step_name(50)]
    assert "retention (flags): keep_last(1)" in out


def test_ls_json_and_unusual_entries(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shutil.copytree(copy / step_name(40), copy / (step_name(60) + ".tmp-abc"))
    corrupt = copy / step_name(40)
    (corrupt / "manifest.msgpack").write_bytes(b"torn")
    code, out, _ = run(["ls", str(copy), "--json"], capsys)
    assert code == 1  # a damaged checkpoint is listed, and the status says so
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows[step_name(50)]["status"] == "ok"
    assert rows[step_name(50)]["metrics"] == {"val_loss": 0.6}
    assert rows[step_name(40)]["status"] == "damaged"
    assert "checksum" in rows[step_name(40)]["detail"]
    assert rows[step_name(60) + ".tmp-abc"]["status"] == "uncommitted"


def test_ls_verify_finds_damaged_data(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corrupt_tensor_data(copy / step_name(40))
    code, out, _ = run(["ls", str(copy), "--verify"], capsys)
    assert code == 1  # damage found: the status verify gives
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("step_")}
    assert " damaged " in rows[step_name(40)]
    assert " intact " in rows[step_name(50)]


def test_ls_bad_input(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["ls", str(tmp_path / "missing")], capsys)
    assert code == 2
    assert_one_line_error(err, "missing", "no such file")
    code, _, err = run(["ls", str(root / step_name(50))], capsys)
    assert code == 2
    assert_one_line_error(err, "is a checkpoint", "fckpt inspect")
    code, out, _ = run(["ls", str(tmp_path)], capsys)
    assert code == 0 and "no checkpoints" in out


# --------------------------------------------------------------------------- inspect


def test_inspect_tree_and_metadata(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["inspect", str(root / step_name(50))], capsys)
    assert code == 0, err
    assert "format v1" in out and "tensors" in out
    assert "metadata" in out and "val_loss" in out
    assert "model/" in out and "0.weight  float32[8, 4]  128 B" in out
    assert "step  = 50" in out
    assert "__container__" not in out


def test_inspect_key_prefix_and_json(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(root / step_name(50))
    code, out, _ = run(["inspect", ckpt, "--key", "model/2."], capsys)
    assert code == 0
    assert "2.weight" in out and "2.bias" in out and "0.weight" not in out
    assert "optimizer" not in out
    code, out, _ = run(["inspect", ckpt, "--json"], capsys)
    doc = json.loads(out)
    entries = {e["key"]: e for e in doc["entries"]}
    assert entries["model/0.weight"] == {
        "key": "model/0.weight",
        "path": ["model", "0.weight"],
        "kind": "tensor",
        "dtype": "float32",
        "shape": [8, 4],
        "nbytes": 128,
    }
    assert entries["step"]["value"] == 50
    assert doc["metadata"]["manager"]["metrics"] == {"val_loss": 0.6}


def test_inspect_reads_no_tensor_data(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Damaged tensor bytes do not matter to inspect: it never reads them."""
    ckpt = copy / step_name(50)
    corrupt_tensor_data(ckpt)
    code, out, _ = run(["inspect", str(ckpt)], capsys)
    assert code == 0 and "0.weight" in out


def test_inspect_bad_input(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["inspect", str(root / step_name(50)), "--key", "nope"], capsys)
    assert code == 2
    assert_one_line_error(err, "no key starts with 'nope'", "model")
    code, _, err = run(["inspect", str(root)], capsys)
    assert code == 2
    assert_one_line_error(err, "directory of checkpoints", "fckpt ls")
    code, _, err = run(["inspect", str(tmp_path / "nothing")], capsys)
    assert code == 2
    assert_one_line_error(err, "nothing")


# --------------------------------------------------------------------------- verify


def test_verify_intact_checkpoint_and_root(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["verify", str(root / step_name(50))], capsys)
    assert code == 0 and out.startswith("OK") and "1 checkpoint intact" in out
    code, out, _ = run(["verify", str(root)], capsys)
    assert code == 0 and "3 checkpoints intact" in out


def test_verify_damage_exit_1_one_line_per_bad_key(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corrupt_tensor_data(copy / step_name(40))
    code, out, _ = run(["verify", str(copy), "--quiet"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == f"DAMAGED  {copy / step_name(40)}"
    bad = lines[1:-1]
    assert len(bad) == 1, bad
    assert "('model', '2.weight'): tensor data in __0_0.distcp fails its checksum" in bad[0]
    assert lines[-1] == "1 of 3 checkpoints damaged"


def test_verify_names_each_damaged_file_once(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = copy / step_name(40)
    (ckpt / ".metadata").unlink()
    (ckpt / "extra").write_text("x")
    code, out, _ = run(["verify", str(ckpt)], capsys)
    problems = out.splitlines()[1:-1]
    assert code == 1 and f"  {ckpt / '.metadata'}: file is missing from the checkpoint" in problems
    assert f"  {ckpt / 'extra'}: unexpected file in the checkpoint" in problems
    assert all(line.count(str(ckpt)) == 1 for line in problems), problems


def test_verify_torn_manifest_and_missing_marker(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (copy / step_name(20) / "manifest.msgpack").write_bytes(b"torn")
    (copy / step_name(40) / "COMMITTED").unlink()
    code, out, _ = run(["verify", str(copy)], capsys)
    assert code == 1
    assert "never committed: the COMMITTED marker is missing" in out
    assert "does not match its checksum" in out
    assert out.splitlines()[-1] == "2 of 3 checkpoints damaged"
    code, out, _ = run(["verify", str(copy / step_name(20))], capsys)
    assert code == 1 and "DAMAGED" in out


def test_verify_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["verify", str(tmp_path / "missing")], capsys)
    assert code == 2
    assert_one_line_error(err, "no such file")
    code, _, err = run(["verify", str(tmp_path)], capsys)
    assert code == 2
    assert_one_line_error(err, "no checkpoints to verify")


# --------------------------------------------------------------------------- diff


def test_diff_two_steps(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["diff", str(root / step_name(40)), str(root / step_name(50))], capsys)
    assert code == 0
    assert "~ value   step  40 -> 50" in out
    assert "~ tensor  model/0.weight  float32[8, 4]  max |Δ|" in out
    assert "elements differ" in out
    assert "value(s) changed" in out and "tensor(s) differ" in out


def test_diff_identical(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(root / step_name(50))
    code, out, _ = run(["diff", ckpt, ckpt, "--exit-code"], capsys)
    assert code == 0
    assert "identical states" in out and "~" not in out


def test_diff_structure_changes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = {
        "w": torch.zeros(3),
        "gone": torch.ones(2),
        "shape": torch.zeros(2, 2),
        "dtype": torch.zeros(4),
        "lr": 0.1,
        "same": torch.arange(5),
    }
    b = {
        "w": torch.tensor([0.0, 0.5, -2.0]),
        "new": torch.ones(1),
        "shape": torch.zeros(4),
        "dtype": torch.zeros(4, dtype=torch.float16),
        "lr": 0.2,
        "same": torch.arange(5),
    }
    fc.save(tmp_path / "a", a)
    fc.save(tmp_path / "b", b)
    code, out, _ = run(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--exit-code"], capsys)
    assert code == 1
    assert "+ added   new  float32[1]" in out
    assert "- removed gone  float32[2]" in out
    assert "~ shape   shape  float32[2, 2] -> float32[4]" in out
    assert "~ dtype   dtype  float32[4] -> float16[4]" in out
    assert "~ value   lr  0.1 -> 0.2" in out
    assert "~ tensor  w  float32[3]  max |Δ| 2 (2 of 3 elements differ)" in out
    assert "1 identical" in out


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (torch.tensor([True, False]), torch.tensor([True, True]), "max |Δ| 1 (1 of 2"),
        (torch.tensor([1, 2], dtype=torch.int64), torch.tensor([1, 7]), "max |Δ| 5 (1 of 2"),
        (
            torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
            torch.tensor([1.0, 3.0]).bfloat16(),
            "max |Δ| 1",
        ),
        (torch.tensor([1 + 1j]), torch.tensor([1 + 4j]), "max |Δ| 3 (1 of 1"),
        (torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]), "1 NaN vs number"),
        (
            torch.tensor([2, 3], dtype=torch.uint16),
            torch.tensor([2, 9], dtype=torch.uint16),
            "(1 of 2",
        ),
    ],
)
def test_tensor_delta_dtypes(a: torch.Tensor, b: torch.Tensor, expected: str) -> None:
    delta = tensor_delta(a, b)
    assert delta is not None and expected in delta, delta
    assert tensor_delta(a, a.clone()) is None


def test_tensor_delta_float8_and_nan_payloads() -> None:
    a = torch.tensor([1.0, 2.0, 4.0]).to(torch.float8_e4m3fn)
    b = torch.tensor([1.0, 2.0, 8.0]).to(torch.float8_e4m3fn)
    assert tensor_delta(a, b) == "max |Δ| 4 (1 of 3 elements differ)"
    nan = torch.tensor([float("nan")])
    assert tensor_delta(nan, nan.clone()) is None
    assert tensor_delta(torch.tensor([0.0]), torch.tensor([-0.0])) == (
        "max |Δ| 0 (1 of 1 elements differ)"
    )


def test_same_value_is_exact() -> None:
    assert same_value((1, 2.0), (1, 2.0))
    assert not same_value((1, 2.0), [1, 2.0])
    assert not same_value(1, 1.0)
    assert not same_value(0.0, -0.0)
    assert same_value(float("nan"), float("nan"))
    assert not same_value({1: "a", 2: "b"}, {2: "b", 1: "a"})


def test_diff_bad_input(root: Path, copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["diff", str(root / step_name(50)), str(copy / "nope")], capsys)
    assert code == 2
    assert_one_line_error(err, "nope", "no such file")
    corrupt_tensor_data(copy / step_name(50))
    code, _, err = run(["diff", str(root / step_name(50)), str(copy / step_name(50))], capsys)
    assert code == 1
    assert_one_line_error(err, "checksum")


# --------------------------------------------------------------------------- export


def test_export_loads_with_safetensors(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "weights"
    code, out, err = run(["export", str(root / step_name(50)), str(out_dir)], capsys)
    assert code == 0, err
    assert "model.safetensors" in out
    loaded = load_file(str(out_dir / "model.safetensors"))
    model = fc.restore(root / step_name(50))["model"]
    assert set(loaded) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, tensor in loaded.items():
        assert torch.equal(tensor, model[name])


def test_export_root_bf16_sharded(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "bf16"
    argv = ["export", str(root), str(out_dir), "--dtype", "bfloat16", "--max-shard-size", "100B"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    assert step_name(50) in out  # a root exports its newest checkpoint
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    model = fc.restore(root / step_name(50))["model"]
    assert set(index["weight_map"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, file in index["weight_map"].items():
        tensor = load_file(str(out_dir / file))[name]
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, model[name].to(torch.bfloat16))


def test_export_bad_input(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = str(root / step_name(50))
    (tmp_path / "exists").mkdir()
    cases = [
        (["export", ckpt, str(tmp_path / "exists")], ["already exists", "--overwrite"]),
        (["export", ckpt, str(tmp_path / "o1"), "--dtype", "int8"], ["--dtype int8", "bfloat16"]),
        (["export", ckpt, str(tmp_path / "o2"), "--max-shard-size", "lots"], ["--max-shard-size"]),
        (["export", ckpt, str(tmp_path / "o3"), "--select", "ema"], ["no state['ema']"]),
        (["export", str(tmp_path / "none"), str(tmp_path / "o4")], ["no such file"]),
    ]
    for argv, fragments in cases:
        code, _, err = run(argv, capsys)
        assert code == 2, argv
        assert_one_line_error(err, *fragments)
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists()


# --------------------------------------------------------------------------- prune


def test_prune_dry_run_and_yes(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["prune", str(copy), "--keep-last", "1", "--dry-run"], capsys)
    assert code == 0
    assert f"delete  {step_name(20)}" in out and f"keep    {step_name(50)}" in out
    assert "dry run" in out
    assert fc.CheckpointManager(copy, read_only=True).steps() == [20, 40, 50]
    code, out, _ = run(
        [
            "prune",
            str(copy),
            "--keep-last",
            "1",
            "--keep-best",
            "1",
            "--metric",
            "val_loss",
            "--yes",
        ],
        capsys,
    )
    assert code == 0 and "deleted 1 checkpoints" in out
    assert fc.CheckpointManager(copy, read_only=True).steps() == [20, 50]
    assert not [p for p in copy.iterdir() if ".trash-" in p.name]


def test_prune_never_deletes_newest(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(
        [
            "prune",
            str(copy),
            "--keep-best",
            "1",
            "--metric",
            "val_loss",
            "--keep-last",
            "1",
            "--mode",
            "max",
            "--yes",
        ],
        capsys,
    )
    assert code == 0
    assert fc.CheckpointManager(copy, read_only=True).steps() == [40, 50]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_prune_asks_on_a_terminal(
    copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", FakeTTY("n\n"))
    code, out, err = run(["prune", str(copy), "--keep-last", "1"], capsys)
    assert code == 1 and "[y/N]" in out
    assert_one_line_error(err, "nothing deleted")
    assert fc.CheckpointManager(copy, read_only=True).steps() == [20, 40, 50]
    monkeypatch.setattr(sys, "stdin", FakeTTY("y\n"))
    code, out, _ = run(["prune", str(copy), "--keep-last", "1"], capsys)
    assert code == 0 and "deleted 2 checkpoints" in out
    assert fc.CheckpointManager(copy, read_only=True).steps() == [50]


def test_prune_refuses_without_terminal_or_yes(
    copy: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))
    code, _, err = run(["prune", str(copy), "--keep-last", "1"], capsys)
    assert code == 2
    assert_one_line_error(err, "not a terminal", "--yes")
    assert fc.CheckpointManager(copy, read_only=True).steps() == [20, 40, 50]
    code, _, err = run(["prune", str(copy), "--keep-last", "1", "--keep-best", "2"], capsys)
    assert code == 2
    assert_one_line_error(err, "--keep-best needs --metric")
    for flag in (["--metric", "val_loss"], ["--mode", "max"]):
        code, _, err = run(["prune", str(copy), "--keep-last", "1", "--yes", *flag], capsys)
        assert code == 2
        assert_one_line_error(err, f"{flag[0]}: only with --keep-best K")
    assert fc.CheckpointManager(copy, read_only=True).steps() == [20, 40, 50]


def test_prune_refuses_while_a_writer_runs(copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fc.CheckpointManager(copy):
        code, _, err = run(["prune", str(copy), "--keep-last", "1", "--yes"], capsys)
    assert code == 2
    assert_one_line_error(err, "another writing CheckpointManager holds the lock")
    assert fc.CheckpointManager(copy, read_only=True).steps() == [20, 40, 50]


# --------------------------------------------------------------------------- helpers


def test_retention_parts_rebuild_only_keep_specs() -> None:
    policy = fc.keep_last(3) | fc.keep_best(2, "val_loss", mode="max")
    parts = listing.retention_parts(policy.spec)
    assert parts is not None
    assert [label for label, _ in parts] == ["keep_last(3)", "keep_best(2, 'val_loss', mode='max')"]
    records = [fc.policy.CheckpointRecord(s, 0.0, {"val_loss": float(s)}) for s in range(1, 7)]
    assert listing.kept_by(parts, records)[6] == [parts[0][0], parts[1][0], "latest"]
    older = {  # a spec as manifests written before it was the configuration form hold it
        "kind": "union",
        "children": [
            {"kind": "keep_last", "n": 3},
            {"kind": "keep_best", "k": 2, "metric": "val_loss", "mode": "max"},
        ],
    }
    assert [label for label, _ in listing.retention_parts(older) or []] == [
        label for label, _ in parts
    ]
    for bad in (
        "__import__('os').system('echo hi')",
        "keep_last(3)",  # a repr is text, not a spec
        {"kind": "keep_last", "n": "n"},
        {"kind": "print", "args": [1]},
        {"kind": "custom", "type": "Mine", "repr": "Mine()"},
        None,
    ):
        assert listing.retention_parts(bad) is None, bad


def test_colours_only_on_a_terminal() -> None:
    tty, plain = FakeTTY(), io.StringIO()
    assert ui.UI(out=tty, env={}).colour
    assert not ui.UI(out=tty, env={"NO_COLOR": "1"}).colour
    assert not ui.UI(out=plain, env={}).colour
    assert ui.UI(out=tty, env={}).paint("x", "ok") == "\033[32mx\033[0m"
    assert ui.UI(out=plain, env={}).paint("x", "ok") == "x"


def test_progress_bar_draws_only_on_a_terminal() -> None:
    stream = FakeTTY()
    with ui.Progress(stream, "verifying", 2048, "B", enabled=True) as bar:
        bar.update(1024, force=True)
    drawn = stream.getvalue()
    assert "verifying " in drawn and "50%" in drawn and "1.0/2.0 KiB" in drawn
    quiet = io.StringIO()
    with ui.Progress(quiet, "verifying", 10, "B", enabled=False) as bar:
        bar.update(5, force=True)
    assert quiet.getvalue() == ""


# --------------------------------------------------------------------------- end to end


def fckpt(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1"}
    return prefork.run(
        [sys.executable, "-m", "functional_ckpt", *argv],
        capture_output=True,
        text=True,
        timeout=HANG,
        env=env,
    )


def test_subprocess_entry_point(root: Path, copy: Path, tmp_path: Path) -> None:
    proc = fckpt("ls", str(root))
    assert proc.returncode == 0, proc.stderr
    assert step_name(50) in proc.stdout and proc.stderr == ""

    corrupt_tensor_data(copy / step_name(50))
    proc = fckpt("verify", str(copy / step_name(50)))
    assert proc.returncode == 1
    assert "DAMAGED" in proc.stdout and "fails its checksum" in proc.stdout

    proc = fckpt("diff", str(root / step_name(50)), str(tmp_path / "missing"))
    assert proc.returncode == 2
    assert_one_line_error(proc.stderr, "missing", "no such file")


# --------------------------------------------------------------------------- odd checkpoints


def _odd_root(tmp_path: Path) -> Path:
    """Five good steps, three of them re-signed with values ``fc.save`` or a bug could write."""
    root = tmp_path / "odd"
    with fc.CheckpointManager(root) as mgr:
        for step in (1, 2, 3, 4, 5):
            mgr.maybe_save({"w": torch.ones(2) * step}, step=step, metrics={"loss": 1.0 / step})

    def created(value: float) -> Any:
        return lambda m: m.__setitem__("created", value)

    resign(root / step_name(1), created(1e300))
    resign(root / step_name(2), created(float("nan")))
    resign(root / step_name(3), lambda m: m["metadata"]["manager"].__setitem__("metrics", [1, 2]))
    return root


def test_ls_and_inspect_survive_odd_but_authentic_manifests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _odd_root(tmp_path)
    code, out, err = run(["ls", str(root)], capsys)
    assert code == 0 and err == "", err
    for step in (1, 2, 3, 4, 5):  # one odd checkpoint never hides the others
        assert step_name(step) in out
    assert "loss=0.25" in out and "loss=0.2" in out
    code, out, err = run(["ls", str(root), "--json"], capsys)
    rows = {r["step"]: r for r in json.loads(out)}
    assert code == 0 and sorted(rows) == [1, 2, 3, 4, 5]
    assert rows[1]["time"] is None and rows[2]["time"] is None and rows[3]["metrics"] == {}
    for step in (1, 2, 3):
        code, out, err = run(["inspect", str(root / step_name(step))], capsys)
        assert code == 0 and err == "", err
        code, out, err = run(["inspect", str(root / step_name(step)), "--json"], capsys)
        assert code == 0 and json.loads(out)["path"].endswith(step_name(step))
    with fc.CheckpointManager(root, read_only=True) as mgr:
        assert mgr.steps() == [1, 2, 3, 4, 5] and mgr.info(3).metrics == {}


def test_inspect_shows_an_int_past_the_digit_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = 7**6000  # about 5070 digits: more than str() allows by default
    fc.save(tmp_path / "c", {"w": torch.ones(1), "big": big})
    assert "big: <int of about 50" in str(fc.inspect(tmp_path / "c"))
    code, out, err = run(["inspect", str(tmp_path / "c")], capsys)
    assert code == 0 and err == "" and "<int of about 50" in out
    code, out, err = run(["inspect", str(tmp_path / "c"), "--json"], capsys)
    values = {e["key"]: e.get("value") for e in json.loads(out)["entries"]}
    assert code == 0 and int(values["big"]["int"], 16) == big
    assert fc.restore(tmp_path / "c")["big"] == big


def test_an_unsafe_checkpoint_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fc.save(tmp_path / "c", {"w": torch.ones(1)})
    manifest = tmp_path / "c" / "manifest.msgpack"
    os.rename(manifest, tmp_path / "elsewhere")
    manifest.symlink_to(tmp_path / "elsewhere")  # a manifest that is a link: refused, unsafe
    for argv in (["inspect", str(tmp_path / "c")], ["ls", str(tmp_path)]):
        code, out, err = run(argv, capsys)
        if argv[0] == "ls":  # listing reports it as damaged, goes on, and exits 1
            assert code == 1 and "damaged" in out and "symbolic link" in out, out
            continue
        assert code == 1, err
        assert_one_line_error(err, "symbolic link")


def test_ls_tells_a_committed_leftover_from_a_half_written_one(
    copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.copytree(copy / step_name(50), copy / f"{step_name(60)}.tmp-0123456789ab")
    (copy / f"{step_name(70)}.tmp-0123456789ab").mkdir()
    code, out, _ = run(["ls", str(copy), "--json"], capsys)
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0
    complete = rows[f"{step_name(60)}.tmp-0123456789ab"]
    half = rows[f"{step_name(70)}.tmp-0123456789ab"]
    assert complete["step"] == 60 and "recovers it" in complete["detail"]
    assert half["step"] == 70 and "recovers" not in half["detail"]
    with pytest.warns(UserWarning, match="recovered"), fc.CheckpointManager(copy) as mgr:
        assert mgr.latest_step() == 60  # the complete one came back, the half one is gone
    assert not (copy / f"{step_name(70)}.tmp-0123456789ab").exists()


#: A key name that would move the cursor, clear the screen, set the window title,
#: return to the line start and flip the text direction if written raw.
HOSTILE_KEY = "k\x1b[2J\x1b]0;pwned\x07\rX\u202e\x9b31m\nline"
_RAW = ["\x1b", "\x07", "\r", "\x9b", "\u202e"]


def _terminal_safe(text: str, *, ours: bool = False) -> bool:
    """No character a terminal acts on; with ``ours``, our own colour codes allowed."""
    import re

    if ours:
        text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # SGR colour sequences we write
    return not any(c in text for c in _RAW)


def test_no_command_writes_control_characters_from_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: ``fckpt inspect`` wrote key names raw, so a checkpoint could rewrite
    what the user sees. Every command, plain and in colour, escapes them."""
    one, two = tmp_path / "one", tmp_path / "two"
    fc.save(one, {HOSTILE_KEY: torch.zeros(2), "v": {HOSTILE_KEY: HOSTILE_KEY}})
    fc.save(two, {HOSTILE_KEY: torch.ones(2), "v": {HOSTILE_KEY: 1}}, metadata={HOSTILE_KEY: 1})
    commands = [
        ["inspect", str(one)],
        ["inspect", str(two)],
        ["inspect", str(two), "--json"],
        ["diff", str(one), str(two)],
        ["verify", str(one)],
        ["export", str(one), str(tmp_path / "out")],
    ]
    for colour in (False, True):
        monkeypatch.setattr(ui.UI, "__init__", _forced(ui.UI.__init__, colour))
        for argv in commands:
            _, out, err = run(argv, capsys)
            assert _terminal_safe(out, ours=colour) and _terminal_safe(err), (argv, out, err)
            assert out or err
    _, out, _ = run(["inspect", str(one)], capsys)
    assert "k\\x1b[2J" in out  # escaped, not dropped: the key stays recognisable


def _forced(init: Any, colour: bool) -> Any:
    def forced(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["colour"] = colour
        init(self, *args, **kwargs)

    return forced
