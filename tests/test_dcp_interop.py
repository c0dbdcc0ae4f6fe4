"""Stock ``torch.distributed.checkpoint`` and this format, both ways, with the real DCP.

* A checkpoint written here loads completely with stock ``dcp.load`` and the
  ``get_state_dict``/``set_state_dict`` recipe (optimizer state and
  ``param_groups``, scheduler, step), and ``dcp_to_torch_save`` converts it.
* A checkpoint written by stock ``dcp.save`` restores with ``fc.restore`` into a
  template captured from fresh objects.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import commit


def _objects(lr: float = 0.01, seed: int = 0) -> tuple[Any, Any, Any]:
    """A tiny model, an Adam with two param groups (not in model order) and a scheduler."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(
        [
            {"params": [model[2].weight]},
            {"params": [model[0].weight, model[0].bias, model[2].bias], "lr": lr * 3},
        ],
        lr=lr,
        betas=(0.8, 0.95),
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _trained() -> tuple[Any, Any, Any]:
    model, opt, sched = _objects()
    for i in range(3):
        model(torch.randn(5, 3, generator=torch.Generator().manual_seed(i))).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, (where, a, b)


def _assert_resumed(objs: tuple[Any, Any, Any], like: tuple[Any, Any, Any]) -> None:
    model, opt, sched = objs
    _assert_same(model.state_dict(), like[0].state_dict(), "model")
    _assert_same(opt.state_dict(), like[1].state_dict(), "optimizer")
    _assert_same(sched.state_dict(), like[2].state_dict(), "scheduler")


def test_stock_get_state_dict_recipe_loads_everything(tmp_path: Path) -> None:
    trained = _trained()
    model, opt, sched = trained
    fc.save(tmp_path / "ck", fc.capture(model=model, optimizer=opt, scheduler=sched, step=7))

    # a fresh run with different hyper-parameters: stale values must not survive
    fresh = _objects(lr=0.5, seed=1)
    m2, o2, s2 = fresh
    msd, osd = get_state_dict(m2, o2)
    sd: dict[str, Any] = {"model": msd, "optimizer": osd, "scheduler": s2.state_dict(), "step": 0}
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)  # no allow_partial_load
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    s2.load_state_dict(sd["scheduler"])
    assert sd["step"] == 7
    assert [g["lr"] for g in o2.param_groups] == [g["lr"] for g in opt.param_groups]
    assert o2.param_groups[0]["betas"] == (0.8, 0.95)
    _assert_resumed(fresh, trained)

    # the project's own reader is unaffected, and verify covers every byte
    back = fc.restore(
        tmp_path / "ck", fc.capture(model=model, optimizer=opt, scheduler=sched, step=0)
    )
    assert back["step"] == 7
    assert fc.verify(tmp_path / "ck").ok


def test_incremental_checkpoint_keeps_its_values_for_stock_readers(tmp_path: Path) -> None:
    """Byte entries are written anew by every save: one whose tensors all come from
    a deleted base still loads whole with the stock recipe and verifies."""
    model, opt, sched = _trained()
    fc.save(tmp_path / "a", fc.capture(model=model, optimizer=opt, scheduler=sched, step=6))
    sched.step()  # values change, tensors do not
    state = fc.capture(model=model, optimizer=opt, scheduler=sched, step=7)
    fc.save(tmp_path / "b", state, base=tmp_path / "a")
    commit.remove_tree(tmp_path / "a")
    assert fc.verify(tmp_path / "b").ok
    fresh = _objects(lr=0.5, seed=1)
    m2, o2, s2 = fresh
    msd, osd = get_state_dict(m2, o2)
    sd: dict[str, Any] = {"model": msd, "optimizer": osd, "scheduler": s2.state_dict(), "step": 0}
    dcp.load(sd, checkpoint_id=str(tmp_path / "b"), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    s2.load_state_dict(sd["scheduler"])
    assert sd["step"] == 7
    _assert_resumed(fresh, (model, opt, sched))


def test_an_optimizer_with_many_param_groups_loads_whole_with_the_stock_recipe(
    tmp_path: Path,
) -> None:
    """Layer-wise learning rates give one group per layer: 120 groups of about twelve
    values each must all reach a stock reader, and so must the values after them."""

    def objects(lr: float) -> tuple[Any, Any]:
        model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(60)])
        groups = [{"params": [p], "lr": lr * (i + 1)} for i, p in enumerate(model.parameters())]
        return model, torch.optim.AdamW(groups, lr=lr)

    model, opt = objects(0.01)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    fc.save(tmp_path / "ck", fc.capture(model=model, optimizer=opt, step=3))
    m2, o2 = objects(0.5)
    msd, osd = get_state_dict(m2, o2)
    sd: dict[str, Any] = {"model": msd, "optimizer": osd, "step": 0}
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert sd["step"] == 3 and len(o2.param_groups) == 120
    assert [g["lr"] for g in o2.param_groups] == [g["lr"] for g in opt.param_groups]
    _assert_same(o2.state_dict(), opt.state_dict(), "optimizer")


def test_manager_checkpoint_converts_with_dcp_to_torch_save(tmp_path: Path) -> None:
    model, opt, sched = _trained()
    with fc.CheckpointManager(tmp_path / "run") as mgr:
        mgr.maybe_save(
            fc.capture(model=model, optimizer=opt, scheduler=sched, step=7), step=7, force=True
        )
        path = mgr.path(7)
    dcp_to_torch_save(path, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    assert full["step"] == 7
    _assert_same(full["model"], dict(model.state_dict()), "model")
    groups = full["optimizer"]["param_groups"]
    assert [g["lr"] for g in groups] == [g["lr"] for g in opt.param_groups]
    assert groups[1]["params"] == ["0.weight", "0.bias", "2.bias"]
    exp_avg = opt.state[model[0].weight]["exp_avg"]
    assert torch.equal(full["optimizer"]["state"]["0.weight"]["exp_avg"], exp_avg)
    assert full["scheduler"] == sched.state_dict()


def test_byte_entries_are_checksummed_by_verify(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"w": torch.ones(2), "hp": {"lr": 0.25, "name": "adam"}})
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    info = md.storage_data[MetadataIndex("hp.name")]
    shard = tmp_path / "ck" / info.relative_path
    data = bytearray(shard.read_bytes())
    assert torch.load(io.BytesIO(bytes(data[info.offset : info.offset + info.length]))) == "adam"
    data[info.offset + info.length // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = fc.verify(tmp_path / "ck")
    assert not report.ok and any("hp.name" in str(p) for p in report.problems), report


def _stock_state(form: str) -> tuple[tuple[Any, Any, Any], dict[str, Any]]:
    trained = _trained()
    model, opt, sched = trained
    if form == "state_dict":
        msd, osd = model.state_dict(), opt.state_dict()
    else:
        msd, osd = get_state_dict(model, opt)
    return trained, {"model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "step": 7}


@pytest.mark.parametrize("form", ["state_dict", "get_state_dict"])
def test_restore_of_stock_dcp_training_state(tmp_path: Path, form: str) -> None:
    trained, sd = _stock_state(form)
    dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    fresh = _objects(lr=0.5, seed=1)
    m2, o2, s2 = fresh
    like = fc.capture(model=m2, optimizer=o2, scheduler=s2, step=0, rng=False)
    back = fc.restore(tmp_path / "d", like)  # plain values are read as plain data
    assert back["step"] == 7
    fc.apply(back, model=m2, optimizer=o2, scheduler=s2, rng=False)
    _assert_resumed(fresh, trained)


def test_stock_values_that_are_not_plain_are_refused(tmp_path: Path) -> None:
    sd = {"w": torch.ones(2), "tags": {"a", "b"}, "lr": 0.5}
    dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    like = {"w": torch.zeros(2), "tags": set(), "lr": 0.0}
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="not plain data") as err:
        fc.restore(tmp_path / "d", like)
    assert "'tags'" in str(err.value) and "'lr'" not in str(err.value)
    assert "dcp.load" in str(err.value) and "allow_pickle" not in str(err.value)
    with pytest.raises(TypeError, match="allow_pickle"):  # no parameter unpickles it
        fc.restore(tmp_path / "d", like, allow_pickle=True)  # type: ignore[call-overload]
    back = fc.restore(tmp_path / "d", {"w": torch.zeros(2), "lr": 0.0}, partial=True)
    assert back["lr"] == 0.5


def test_a_stock_value_that_floods_a_hash_table_is_not_plain(tmp_path: Path) -> None:
    """A pickled value of a stock checkpoint goes through the same hash-flood bound as
    ``.metadata``: a dict of keys k * (2**61 - 1) (all hash to 0) is plain data by type,
    but building it costs quadratic time, so it is refused."""
    flooded = (dict.fromkeys((k * (2**61 - 1) for k in range(1, 400)), 0),)
    few = (dict.fromkeys((k * (2**61 - 1) for k in range(1, 9)), 0),)
    sd = {"w": torch.ones(2), "v": flooded, "few": few, "lr": 0.5}
    dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    like = {"w": torch.zeros(2), "v": (), "few": (), "lr": 0.0}
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="not plain data") as err:
        fc.restore(tmp_path / "d", like)
    assert "'v'" in str(err.value) and "'few'" not in str(err.value)
    back = fc.restore(tmp_path / "d", {"w": torch.zeros(2), "few": (), "lr": 0.0}, partial=True)
    assert back["few"] == few and back["lr"] == 0.5


def test_a_stock_value_that_expands_beyond_its_bytes_is_not_plain(tmp_path: Path) -> None:
    """A pickle of a few hundred bytes can share one list at every level: 2**31 elements
    once walked. Taken for plain data it would hang whatever walks the restored state."""
    bomb: list[Any] = [1, 2]
    for _ in range(30):  # as deep as plain data may be
        bomb = [bomb, bomb]
    shared = [1, 2]
    # a tuple is a leaf to DCP's flattening, which would walk the list itself
    sd = {"w": torch.ones(2), "v": (bomb,), "pair": [shared, shared], "lr": 0.5}
    dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    like = {"w": torch.zeros(2), "v": 0, "pair": [], "lr": 0.0}
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="not plain data") as err:
        fc.restore(tmp_path / "d", like)
    assert "'v'" in str(err.value) and "'pair'" not in str(err.value)  # modest sharing is fine
    back = fc.restore(tmp_path / "d", {"w": torch.zeros(2), "pair": [], "lr": 0.0}, partial=True)
    assert back["pair"] == [[1, 2], [1, 2]] and back["lr"] == 0.5


def test_values_whose_dcp_keys_collide_are_left_to_the_manifest(tmp_path: Path) -> None:
    """``state['a.b']`` and ``state['a']['b']`` are both DCP key ``a.b``: a stock reader
    asking for one must not be handed the other's value."""
    fc.save(tmp_path / "ck", {"a.b": 1, "a": {"b": 2}, "c": 3, "w": torch.ones(2)})
    back = fc.restore(tmp_path / "ck")
    assert back["a.b"] == 1 and back["a", "b"] == 2
    for target in ({"a": {"b": 0}}, {"a.b": 0}):
        with pytest.raises(
            CheckpointException, match=r"Missing key in checkpoint state_dict: a\.b"
        ):
            dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    target = {"c": 0, "w": torch.zeros(2)}
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert target["c"] == 3 and fc.verify(tmp_path / "ck").ok


def test_own_reader_never_reads_byte_entries(tmp_path: Path) -> None:
    """A checkpoint of ours restores from the manifest even with its byte entries zeroed."""
    fc.save(tmp_path / "ck", {"w": torch.ones(2), "lr": 0.25})
    md = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    assert isinstance(md.state_dict_metadata["lr"], BytesStorageMetadata)
    info = md.storage_data[MetadataIndex("lr")]
    with open(tmp_path / "ck" / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(info.length))
    assert fc.restore(tmp_path / "ck")["lr"] == 0.25
    assert not fc.verify(tmp_path / "ck").ok
    assert naming.MANIFEST in {p.name for p in (tmp_path / "ck").iterdir()}


def test_two_rank_checkpoint_converts_with_dcp_to_torch_save(
    tmp_path: Path, shard_save: Callable[[int], Path]
) -> None:
    from tests.dist_job import full_tensors

    saved = shard_save(2)  # DTensor shards, a replicated tensor, a value
    dcp_to_torch_save(saved, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    want = full_tensors()
    assert full["step"] == 11  # written once, by the coordinator
    assert torch.equal(full["w"], want["w"]) and torch.equal(full["e"], want["e"])
    assert fc.verify(saved).ok


def test_partial_restore_of_a_captured_optimizer(tmp_path: Path) -> None:
    """The recorded parameter names never get in the way of a partial restore."""
    model, opt, _ = _trained()
    fc.save(tmp_path / "ck", fc.capture(model=model, optimizer=opt, rng=False))
    back = fc.restore(tmp_path / "ck", {"optimizer": {"param_groups": []}}, partial=True)
    groups = fc.codec.to_python(back["optimizer"])["param_groups"]
    assert [g["lr"] for g in groups] == [g["lr"] for g in opt.param_groups]
