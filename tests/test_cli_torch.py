"""``fckpt import`` and ``export --format torch``: bit-exact both ways, no code ever runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.export.torch_save import export_torch, load_torch_file
from tests.exact import assert_exact


def fckpt(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fckpt: error: "), err
    return lines[0]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3)
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _lightning_checkpoint() -> dict[str, Any]:
    model, opt, sched = _trained()
    return {
        "epoch": 3,
        "global_step": 120,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": model.state_dict(),
        "loops": {"fit_loop": {"epoch_progress": {"total": {"ready": 4, "completed": 3}}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'val_loss'}": {"best_model_score": 0.25}},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "hyper_parameters": {"lr": 1e-2, "widths": (4, 8, 2), "name": None, "big": 2**80},
    }


def test_a_state_dict_round_trips_bit_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = _trained()[0].state_dict()
    torch.save(original, tmp_path / "model.pt")
    code, out, err = fckpt(capsys, "import", str(tmp_path / "model.pt"), str(tmp_path / "ckpt"))
    assert code == 0, err
    assert "under 'model'" in out
    assert list(fc.inspect(tmp_path / "ckpt").tree) == ["model"]
    assert_exact(fc.codec.to_python(fc.restore(tmp_path / "ckpt"))["model"], original)

    code, out, err = fckpt(
        capsys, "export", str(tmp_path / "ckpt"), str(tmp_path / "back.pt"), "--format=torch"
    )
    assert code == 0, err
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert_exact(back, original)  # an OrderedDict, the same names, the same bits
    assert back._metadata == original._metadata  # module versions for load_state_dict
    fresh = _model()
    fresh.load_state_dict(back)
    assert_exact(fresh.state_dict(), original)
    assert sorted(os.listdir(tmp_path)) == ["back.pt", "ckpt", "model.pt"]  # no temp file left


def test_a_training_checkpoint_round_trips_bit_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = _lightning_checkpoint()
    torch.save(original, tmp_path / "last.ckpt")
    code, _, err = fckpt(capsys, "import", str(tmp_path / "last.ckpt"), str(tmp_path / "ckpt"))
    assert code == 0, err
    assert set(fc.inspect(tmp_path / "ckpt").tree) == set(original)  # kept as it is
    assert_exact(fc.codec.to_python(fc.restore(tmp_path / "ckpt")), original)

    code, _, err = fckpt(
        capsys,
        "export",
        str(tmp_path / "ckpt"),
        str(tmp_path / "full.pt"),
        "--format=torch",
        "--full",
    )
    assert code == 0, err
    assert_exact(torch.load(tmp_path / "full.pt", weights_only=True), original)

    code, _, err = fckpt(
        capsys,
        "export",
        str(tmp_path / "ckpt"),
        str(tmp_path / "weights.pt"),
        "--format=torch",
        "--key=state_dict",
    )
    assert code == 0, err
    assert_exact(torch.load(tmp_path / "weights.pt", weights_only=True), original["state_dict"])


def test_a_captured_checkpoint_exports_and_imports_back_exactly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, opt, sched = _trained()
    state = fc.capture(model=model, optimizer=opt, scheduler=sched, step=7)
    fc.save(tmp_path / "a", state)
    code, out, err = fckpt(
        capsys, "export", str(tmp_path / "a"), str(tmp_path / "full.pt"), "--format=torch", "--full"
    )
    assert code == 0, err
    assert "numpy values saved as tensors" in out and "rng/numpy/1" in out
    code, _, err = fckpt(capsys, "import", str(tmp_path / "full.pt"), str(tmp_path / "b"))
    assert code == 0, err
    saved = fc.codec.to_python(fc.restore(tmp_path / "a"))
    back = fc.codec.to_python(fc.restore(tmp_path / "b"))
    # weights_only=True builds no numpy: the numpy RNG state's array comes back as a tensor
    # of the same dtype and bytes; everything else is exactly as saved.
    key_array = saved["rng"]["numpy"][1]
    assert isinstance(key_array, np.ndarray) and key_array.dtype == np.uint32
    assert_exact(back["rng"]["numpy"][1], torch.from_numpy(key_array))
    saved["rng"]["numpy"] = back["rng"]["numpy"]
    assert_exact(back, saved)

    code, _, err = fckpt(
        capsys,
        "export",
        str(tmp_path / "a"),
        str(tmp_path / "half.pt"),
        "--format=torch",
        "--key=model",
        "--dtype=bfloat16",
    )
    assert code == 0, err
    half = torch.load(tmp_path / "half.pt", weights_only=True)
    assert half["0.weight"].dtype == torch.bfloat16
    assert torch.equal(half["0.weight"], model.state_dict()["0.weight"].bfloat16())
    assert half["1.num_batches_tracked"].dtype == torch.int64  # integer buffers keep their type


class _Payload:
    """Unpickling this would create a file: the proof that code ran."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.target,))


def test_a_hostile_pickle_is_refused_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    witness = tmp_path / "pwned"
    torch.save({"model": {"w": torch.ones(2)}, "x": _Payload(witness)}, tmp_path / "evil.pt")
    code, out, err = fckpt(capsys, "import", str(tmp_path / "evil.pt"), str(tmp_path / "ckpt"))
    assert code == 1 and out == ""
    line = one_error_line(err)
    assert "evil.pt: refused" in line and "weights_only=True" in line and "nothing in it" in line
    assert not witness.exists()
    assert not (tmp_path / "ckpt").exists()
    assert sorted(os.listdir(tmp_path)) == ["evil.pt"]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "not a readable torch.save file"),
        (b"not a pickle at all", "torch.save file"),
        (None, "not a regular file"),
    ],
)
def test_what_is_not_a_torch_file_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, fragment: str
) -> None:
    src = tmp_path / "in.pt"
    if content is None:
        src.mkdir()
    else:
        src.write_bytes(content)
    code, _, err = fckpt(capsys, "import", str(src), str(tmp_path / "ckpt"))
    assert code == 2
    assert fragment in one_error_line(err)
    assert not (tmp_path / "ckpt").exists()


def test_import_refuses_what_is_not_a_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    code, _, err = fckpt(capsys, "import", str(tmp_path / "list.pt"), str(tmp_path / "ckpt"))
    assert code == 2 and "holds a list" in one_error_line(err)
    torch.save({"w": torch.ones(1)}, tmp_path / "ok.pt")
    fc.save(tmp_path / "ckpt", {"keep": 1})
    code, _, err = fckpt(capsys, "import", str(tmp_path / "ok.pt"), str(tmp_path / "ckpt"))
    assert code == 2 and "exists" in one_error_line(err)
    assert fc.codec.to_python(fc.restore(tmp_path / "ckpt")) == {"keep": 1}  # left intact
    code, _, err = fckpt(
        capsys, "import", str(tmp_path / "ok.pt"), str(tmp_path / "ckpt"), "--overwrite"
    )
    assert code == 0, err
    assert list(fc.inspect(tmp_path / "ckpt").tree) == ["model"]


def test_export_refuses_values_the_safe_loader_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fc.save(tmp_path / "a", {"model": {"w": torch.ones(2)}, "run": {"tags": frozenset({"a"})}})
    code, _, err = fckpt(
        capsys, "export", str(tmp_path / "a"), str(tmp_path / "f.pt"), "--format=torch", "--full"
    )
    assert code == 2
    line = one_error_line(err)
    assert "state[('run', 'tags')]" in line and "weights_only=True" in line
    assert sorted(os.listdir(tmp_path)) == ["a"]  # nothing written, no temp file
    code, _, err = fckpt(
        capsys, "export", str(tmp_path / "a"), str(tmp_path / "f.pt"), "--format=torch"
    )
    assert code == 0, err  # the weights alone are fine
    assert_exact(torch.load(tmp_path / "f.pt", weights_only=True), {"w": torch.ones(2)})


def test_export_replaces_a_file_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fc.save(tmp_path / "a", {"model": {"w": torch.arange(3.0)}})
    target = tmp_path / "out.pt"
    target.write_bytes(b"precious")
    argv = ["export", str(tmp_path / "a"), str(target), "--format=torch"]
    code, _, err = fckpt(capsys, *argv)
    assert code == 2 and "already exists" in one_error_line(err)
    assert target.read_bytes() == b"precious"
    code, _, err = fckpt(capsys, *argv, "--overwrite")
    assert code == 0, err
    assert_exact(torch.load(target, weights_only=True), {"w": torch.arange(3.0)})
    (tmp_path / "d").mkdir()
    code, _, err = fckpt(
        capsys, "export", str(tmp_path / "a"), str(tmp_path / "d"), "--format=torch", "--overwrite"
    )
    assert code == 2 and "is a directory" in one_error_line(err)
    assert sorted(os.listdir(tmp_path)) == ["a", "d", "out.pt"]


def test_export_never_writes_into_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    fc.save(ck, fc.capture(model=torch.nn.Linear(4, 3), rng=False))
    names = sorted(os.listdir(ck))
    for target in [ck / name for name in names] + [ck / "new.pt", ck / "sub" / "new.pt"]:
        argv = ["export", str(ck), str(target), "--format=torch", "--overwrite"]
        code, _, err = fckpt(capsys, *argv)
        assert code == 2 and f"{target}: inside a checkpoint" in one_error_line(err), target
        assert fc.verify(ck).ok and sorted(os.listdir(ck)) == names
    assert fckpt(capsys, "export", str(ck), str(tmp_path / "hf"))[0] == 0
    code, _, err = fckpt(
        capsys, "export", str(ck), str(tmp_path / "hf" / "model.pt"), "--format=torch"
    )
    assert code == 0, err  # an export takes other files: a torch file beside its safetensors


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--full"], "only with --format torch"),
        (["--format=torch", "--max-shard-size=1GB"], "one file"),
        (["--format=torch", "--full", "--dtype=bfloat16"], "--dtype"),
        (["--format=torch", "--key=model", "--full"], "--key/--select: for the weights; --full"),
        (["--format=torch", "--full", "--select=model"], "--key/--select"),
        (["--format=pickle"], "invalid choice"),
    ],
)
def test_export_flag_combinations(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], fragment: str
) -> None:
    fc.save(tmp_path / "a", {"model": {"w": torch.ones(1)}})
    code, _, err = fckpt(capsys, "export", str(tmp_path / "a"), str(tmp_path / "o"), *flags)
    assert code == 2 and fragment in one_error_line(err)
    assert not (tmp_path / "o").exists()


def test_the_functions_under_the_commands() -> None:
    with pytest.raises(fc.errors.CheckpointNotFound, match="no such file"):
        load_torch_file("/nonexistent/model.pt")
    with pytest.raises(ValueError, match="dtype"):
        export_torch("/nonexistent", "/nonexistent.pt", select=None, dtype=torch.float16)


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("import", "export", "run"):
        code, out, _ = fckpt(capsys, cmd, "--help")
        assert code == 0 and "examples:" in out and f"fckpt {cmd}" in out, cmd
    assert "--format torch" in fckpt(capsys, "export", "--help")[1]
