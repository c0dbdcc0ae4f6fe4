"""TensorDicts with a batch size (vectorised environment state) round-trip with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorData, TensorDict, tensorclass

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import committed, durable
from tests import forge
from tests.exact import assert_exact

NUM_ENVS = 4


def env_state(seed: int = 0) -> TensorDict:
    """A vectorised environment of shape [num_envs], nested in a training state."""
    g = torch.Generator().manual_seed(seed)
    env = TensorDict(
        {
            "obs": torch.randn(NUM_ENVS, 3, generator=g),
            "done": torch.zeros(NUM_ENVS, dtype=torch.bool),
            "steps": torch.arange(NUM_ENVS),
            "agents": TensorDict(
                {"pos": torch.randn(NUM_ENVS, 2, 5, generator=g)}, batch_size=[NUM_ENVS, 2]
            ),
            "task": NonTensorData(data="walk", batch_size=[NUM_ENVS]),
        },
        batch_size=[NUM_ENVS],
        names=["env"],
    )
    state = TensorDict({"model": {"w": torch.randn(3, 3, generator=g)}}, batch_size=[])
    state.set("env", env)
    state.set("step", NonTensorData(data=seed, batch_size=[]))
    return state.lock_()


def check_same(back: TensorDict, state: TensorDict) -> None:
    assert back["env"].batch_size == torch.Size([NUM_ENVS])
    assert back["env"].names == ["env"]
    assert back["env", "agents"].batch_size == torch.Size([NUM_ENVS, 2])
    assert back["env", "agents"].names == ["env", None]
    assert back["env", "task"] == "walk" and back["step"] == state["step"]
    assert back.batch_size == torch.Size([])
    assert_exact(fc.codec.to_python(back), fc.codec.to_python(state))


def test_batched_env_state_round_trips(tmp_path: Path) -> None:
    state = env_state()
    fc.save(tmp_path / "ck", state)
    check_same(fc.restore(tmp_path / "ck"), state)
    assert fc.verify(tmp_path / "ck").ok


@pytest.mark.parametrize("staging", ["copy", "write", "none"])
def test_batched_env_state_saved_async(tmp_path: Path, staging: str) -> None:
    state = env_state()
    fc.save_async(tmp_path / "ck", state, staging=staging).result()  # type: ignore[arg-type]
    check_same(fc.restore(tmp_path / "ck"), state)


def test_batched_env_state_restored_like_and_out(tmp_path: Path) -> None:
    state = env_state(1)
    fc.save(tmp_path / "ck", state)
    like = env_state(2)
    back = fc.restore(tmp_path / "ck", like)
    check_same(back, state)
    assert not torch.equal(like["env", "obs"], state["env", "obs"])  # like is untouched
    into = env_state(3)
    back = fc.restore(tmp_path / "ck", out=into)
    check_same(back, state)
    assert back["env", "obs"].data_ptr() == into["env", "obs"].data_ptr()
    meta = env_state(4).to("meta")
    check_same(fc.restore(tmp_path / "ck", meta), state)


def test_batched_root_round_trips(tmp_path: Path) -> None:
    root = TensorDict(
        {"obs": torch.randn(NUM_ENVS, 3), "inner": {"x": torch.ones(NUM_ENVS)}},
        batch_size=[NUM_ENVS],
        names=["env"],
    )
    fc.save(tmp_path / "ck", root)
    back = fc.restore(tmp_path / "ck")
    assert back.batch_size == torch.Size([NUM_ENVS]) and back.names == ["env"]
    assert back["inner"].batch_size == torch.Size([NUM_ENVS])
    assert torch.equal(back["obs"], root["obs"])
    assert fc.inspect(tmp_path / "ck").tree.batch_size == (NUM_ENVS,)  # type: ignore[attr-defined]


def test_inspect_shows_batch_sizes(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", env_state())
    summary = fc.inspect(tmp_path / "ck")
    env = summary.tree["env"]
    assert env.batch_size == (NUM_ENVS,) and env.names == ["env"]
    assert env["agents"].batch_size == (NUM_ENVS, 2)
    assert summary.tree["model"].batch_size == ()
    assert f"env/ batch_size=[{NUM_ENVS}]" in str(summary)


def _rewrite_manifest(path: Path, edit: Any) -> None:
    """Change a committed manifest and re-sign it (what an older writer produced)."""
    manifest = committed.read_manifest(path)
    edit(manifest)
    data = codec.encode(manifest, where="manifest")
    (path / naming.MANIFEST).unlink()
    (path / naming.COMMIT_MARKER).unlink()
    durable.write_new(path / naming.MANIFEST, data)
    forge.sign(path, data)


def test_manifest_without_batch_sizes_reads_as_unbatched(tmp_path: Path) -> None:
    state = fc.codec.from_python({"env": {"obs": torch.randn(NUM_ENVS, 3)}, "n": 1})
    fc.save(tmp_path / "ck", state)
    manifest = committed.read_manifest(tmp_path / "ck")
    assert all("batch_size" not in e for e in manifest["entries"]) and "root" not in manifest

    fc.save(tmp_path / "batched", env_state())

    def strip(m: dict[str, Any]) -> None:
        for e in m["entries"]:
            e.pop("batch_size", None)
            e.pop("names", None)

    _rewrite_manifest(tmp_path / "batched", strip)
    back = fc.restore(tmp_path / "batched")
    assert back["env"].batch_size == torch.Size([])
    assert fc.inspect(tmp_path / "batched").tree["env"].batch_size == ()


def test_hostile_batch_sizes_are_refused(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", env_state())

    def lie(m: dict[str, Any]) -> None:
        for e in m["entries"]:
            if e["path"] == ["env"]:
                e["batch_size"] = [NUM_ENVS + 1]

    _rewrite_manifest(tmp_path / "ck", lie)
    with pytest.raises(fc.errors.CorruptCheckpoint, match="does not fit"):
        fc.restore(tmp_path / "ck")

    def bad_names(m: dict[str, Any]) -> None:
        for e in m["entries"]:
            if e["path"] == ["env"]:
                e["batch_size"] = [NUM_ENVS]
                e["names"] = ["a", "b"]

    _rewrite_manifest(tmp_path / "ck", bad_names)
    with pytest.raises(fc.errors.CorruptCheckpoint, match="dimension names"):
        fc.restore(tmp_path / "ck")


@tensorclass
class Particles:
    pos: torch.Tensor


def test_tensorclass_is_refused_naming_the_key(tmp_path: Path) -> None:
    state = TensorDict({"env": Particles(pos=torch.zeros(3, 2), batch_size=[3])}, batch_size=[])
    with pytest.raises(fc.errors.UnsupportedValue, match=r"state\['env'\].*to_tensordict"):
        fc.save(tmp_path / "ck", state)
    assert not (tmp_path / "ck").exists()
