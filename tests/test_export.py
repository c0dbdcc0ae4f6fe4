"""Weights-only safetensors exports: HF layout, sharding, dtypes, ties, atomicity, manager."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import functional_ckpt as fc
from functional_ckpt._src.export import safetensors as export_mod
from functional_ckpt._src.export.safetensors import parse_size
from functional_ckpt._src.format.naming import EXPORT_INDEX, EXPORT_WEIGHTS


class TinyLM(torch.nn.Module):
    """Embedding tied to the output head, a norm, and an integer buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 16)
        self.block = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("position_ids", torch.arange(8))


def expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    del sd["head.weight"]  # the tied alias: the first name in state order is kept
    return sd


def load_export(out: Path) -> dict[str, torch.Tensor]:
    """Read an export the way transformers does: single file, or index + shards."""
    if (out / EXPORT_WEIGHTS).exists():
        assert not (out / EXPORT_INDEX).exists()
        return load_file(out / EXPORT_WEIGHTS)
    index = json.loads((out / EXPORT_INDEX).read_text())
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        part = load_file(out / file)
        assert not set(part) & set(tensors)
        tensors.update(part)
    assert set(index["weight_map"]) == set(tensors)  # the index resolves every tensor
    for name, file in index["weight_map"].items():
        assert name in load_file(out / file)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    return tensors


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(sorted(got)) == list(sorted(want))
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


@pytest.fixture
def model() -> TinyLM:
    return TinyLM()


def test_single_file_matches_model_and_drops_tied_alias(model: TinyLM, tmp_path: Path) -> None:
    state = fc.capture(model=model, step=3, note={"lr": 0.1})  # non-tensor leaves are skipped
    out = fc.export_safetensors(state, tmp_path / "export")
    assert out == tmp_path / "export"
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_WEIGHTS]
    assert_same(load_export(out), expected_weights(model))
    with safe_open(str(out / EXPORT_WEIGHTS), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_sharding_past_max_shard_size(model: TinyLM, tmp_path: Path) -> None:
    out = fc.export_safetensors(fc.capture(model=model), tmp_path / "e", max_shard_size=2000)
    names = sorted(p.name for p in out.iterdir())
    assert EXPORT_INDEX in names and EXPORT_WEIGHTS not in names
    shards = [n for n in names if n != EXPORT_INDEX]
    k = len(shards)
    assert k >= 3
    assert shards == [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
    assert_same(load_export(out), expected_weights(model))
    for shard in shards:  # no shard over the limit unless it holds one big tensor
        part = load_file(out / shard)
        assert len(part) == 1 or sum(t.nbytes for t in part.values()) <= 2000


def test_dtype_converts_floats_only(model: TinyLM, tmp_path: Path) -> None:
    out = fc.export_safetensors(fc.capture(model=model), tmp_path / "e", dtype=torch.bfloat16)
    want = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
        for k, v in expected_weights(model).items()
    }
    assert_same(load_export(out), want)
    assert load_export(out)["position_ids"].dtype == torch.int64


def test_export_from_a_checkpoint_path_and_nested_select(model: TinyLM, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    fc.save(ckpt, {"agent": {"policy": model.state_dict()}, "big": torch.zeros(1000)})
    out = fc.export_safetensors(ckpt, tmp_path / "e", select=("agent", "policy"))
    assert_same(load_export(out), expected_weights(model))


def test_overlapping_views_are_copied(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32)
    state = {"model": {"a": base[:6], "b": base[4:], "t": base.view(3, 4).t()}}
    out = fc.export_safetensors(state, tmp_path / "e")
    got = load_export(out)
    assert torch.equal(got["a"], base[:6]) and torch.equal(got["b"], base[4:])
    assert torch.equal(got["t"], base.view(3, 4).t())


def test_errors_name_what_is_wrong(model: TinyLM, tmp_path: Path) -> None:
    state = fc.capture(model=model)
    with pytest.raises(fc.CheckpointError, match=r"state\['weights'\]"):
        fc.export_safetensors(state, tmp_path / "e", select="weights")
    with pytest.raises(fc.CheckpointError, match="no tensors"):
        fc.export_safetensors({"model": {"x": 1}}, tmp_path / "e")
    fc.export_safetensors(state, tmp_path / "e")
    with pytest.raises(fc.errors.CheckpointExists, match="overwrite=True"):
        fc.export_safetensors(state, tmp_path / "e")
    fc.export_safetensors(state, tmp_path / "e", overwrite=True, dtype=torch.float16)
    assert load_export(tmp_path / "e")["block.weight"].dtype == torch.float16
    with pytest.raises(TypeError, match="floating-point"):
        fc.export_safetensors(state, tmp_path / "f", dtype=torch.int8)


def test_failed_export_leaves_nothing_visible(
    model: TinyLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch as st

    calls = [0]
    real = st.save_file

    def flaky(tensors: dict[str, torch.Tensor], filename: str, metadata: Any = None) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(28, "No space left on device")
        real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(st, "save_file", flaky)
    with pytest.raises(OSError, match="No space"):
        fc.export_safetensors(fc.capture(model=model), tmp_path / "e", max_shard_size=2000)
    assert list(tmp_path.iterdir()) == []  # neither the export nor its temporary sibling


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (123, 123),
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("10kb", 10_000),
        ("64KiB", 65536),
        ("7", 7),
        (" 2 TB ", 2 * 10**12),
    ],
)
def test_parse_size(size: int | str, expected: int) -> None:
    assert parse_size(size) == expected


@pytest.mark.parametrize("bad", ["", "GB", "5 parsecs", "-1MB", 0, -3, 1.5, True, "1e3"])
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError), match="max_shard_size"):
        parse_size(bad)


def test_manager_exports_on_its_own_policy(model: TinyLM, tmp_path: Path) -> None:
    exp = fc.manager.Export(fc.on_improve("loss"), dtype=torch.bfloat16, max_shard_size="2KB")
    losses = {1: 3.0, 2: 2.0, 3: 2.5, 4: 1.0}
    with fc.CheckpointManager(tmp_path, save=fc.every_steps(2), export=exp) as mgr:
        for step, loss in losses.items():
            mgr.maybe_save(fc.capture(model=model), step=step, metrics={"loss": loss})
    exports = sorted(p.name for p in (tmp_path / "exports").iterdir())
    assert exports == ["step_000000001", "step_000000002", "step_000000004"]
    assert fc.CheckpointManager(tmp_path, read_only=True).steps() == [2, 4]
    want = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v)
        for k, v in expected_weights(model).items()
    }
    assert_same(load_export(tmp_path / "exports" / "step_000000004"), want)
    # the export policy's state (best loss 1.0) continues after a restart
    with fc.CheckpointManager(tmp_path, save=fc.every_steps(2), export=exp) as mgr:
        mgr.restore_latest()
        mgr.maybe_save(fc.capture(model=model), step=5, metrics={"loss": 1.5})
        assert not (tmp_path / "exports" / "step_000000005").exists()
        mgr.maybe_save(fc.capture(model=model), step=6, metrics={"loss": 0.5})
        assert (tmp_path / "exports" / "step_000000006").exists()


def test_export_config_is_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="SavePolicy"):
        fc.manager.Export("every step")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_shard_size"):
        fc.manager.Export(fc.policy.always(), max_shard_size="lots")
    with pytest.raises(ValueError, match="select"):
        fc.manager.Export(fc.policy.always(), select=())
    state = {"model": {"w": torch.ones(2)}}
    for bad in ({"strip_prefix": 3}, {"header": {"a": 3}}, {"header": {"format": "np"}}):
        with pytest.raises(TypeError, match=f"{next(iter(bad))}="):
            fc.export_safetensors(state, tmp_path / "out", **bad)  # type: ignore[arg-type]
    assert not (tmp_path / "out").exists()
    assert export_mod.Export(fc.policy.always(), max_shard_size="1KB").max_shard_bytes == 1000


def test_config_and_side_files_are_written_and_carried_over(model: TinyLM, tmp_path: Path) -> None:
    out = tmp_path / "e"
    state = fc.capture(model=model)
    fc.export_safetensors(
        state,
        out,
        config={"model_type": "tiny", "dtype": "float32"},
        extra_files={"tokenizer.json": b"{}", "vocab.txt": "a\nb\n"},
        dtype=torch.float16,
    )
    assert json.loads((out / "config.json").read_text()) == {
        "model_type": "tiny",
        "dtype": "float16",
    }
    assert (out / "vocab.txt").read_text() == "a\nb\n"
    fc.export_safetensors(state, out, overwrite=True, extra_files={"vocab.txt": "c\n"})
    assert (out / "vocab.txt").read_text() == "c\n"  # given anew: rewritten
    assert (out / "tokenizer.json").read_bytes() == b"{}"  # not given: carried over
    assert "float16" in (out / "config.json").read_text()
    assert_same(load_export(out), expected_weights(model))
    (out / "tokenizer").mkdir()  # a folder is no file of an export: never dropped
    with pytest.raises(
        fc.errors.CheckpointExists,
        match="e: exists and holds tokenizer: not a file of a safetensors export",
    ):
        fc.export_safetensors(state, out, overwrite=True)
    assert (out / "tokenizer").is_dir() and (out / "vocab.txt").read_text() == "c\n"
    for bad in ({"../x": b""}, {"model.safetensors": b""}, {"a/b": b""}):
        with pytest.raises(ValueError, match="extra_files"):
            fc.export_safetensors(state, tmp_path / "f", extra_files=bad)
    with pytest.raises(TypeError, match="config"):
        fc.export_safetensors(state, tmp_path / "f", config=42)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "sub").mkdir()
    with pytest.raises(fc.errors.CheckpointExists, match="left intact"):
        fc.export_safetensors(state, tmp_path / "g", overwrite=True)
    assert not (tmp_path / "f").exists() and (tmp_path / "g" / "sub").is_dir()


def test_a_failed_background_export_surfaces(model: TinyLM, tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("a\n")
    exp = fc.manager.Export(fc.every_steps(1), extra_files={"vocab.txt": vocab})
    vocab.unlink()  # gone by the time the export runs
    with fc.CheckpointManager(tmp_path / "run", export=exp, async_save=True) as mgr:
        mgr.maybe_save(fc.capture(model=model), step=1)
        with pytest.raises(fc.CheckpointError, match=r"vocab\.txt"):
            mgr.wait_exports()
        mgr.wait()
        assert mgr.steps() == [1]  # the checkpoint is unaffected
    assert fc.CheckpointManager(tmp_path / "run", read_only=True).steps() == [1]
