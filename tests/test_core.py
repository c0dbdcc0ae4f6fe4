"""save / restore / inspect / verify on real files: exactness, templates, DCP compatibility."""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from tensordict import tensorclass

import functional_ckpt as fc
from tests.exact import assert_exact

CPU_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype``: every bit pattern, NaN payloads included."""
    size = torch.empty((), dtype=dtype).element_size()
    n = 1
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(6, 4)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def test_every_dtype_and_shape_round_trips(tmp_path: Path) -> None:
    tree: dict[str, object] = {}
    for i, dtype in enumerate(CPU_DTYPES):
        name = str(dtype).removeprefix("torch.")
        tree[name] = {
            "m": random_tensor(dtype, (3, 5), i),
            "scalar": random_tensor(dtype, (), i + 100),
            "empty": random_tensor(dtype, (0, 4), i),
        }
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tree["views"] = {
        "t": base.t(),
        "strided": base[:, ::2],
        "grad": torch.ones(3, requires_grad=True),
    }
    tree["keys"] = {"a.b": torch.ones(1), "c/d": torch.zeros(2), "ünï©ødé ✓": torch.ones(2)}
    state = fc.codec.from_python(tree)
    fc.save(tmp_path / "ck", state)
    back = fc.restore(tmp_path / "ck")
    assert back.is_locked and back.batch_size == torch.Size([])
    out = fc.codec.to_python(back)
    assert out["views"]["grad"].requires_grad
    tree["views"]["grad"] = tree["views"]["grad"].detach()
    out["views"]["grad"] = out["views"]["grad"].detach()
    assert_exact(out, tree)
    assert fc.verify(tmp_path / "ck").ok


def test_optimizer_hyperparameters_keep_their_python_types(tmp_path: Path) -> None:
    model, opt, sched = model_and_optimizer()
    state = fc.capture(model=model, optimizer=opt, scheduler=sched)
    fc.save(tmp_path / "ck", state)
    back = fc.codec.to_python(fc.restore(tmp_path / "ck"))
    group = back["optimizer"]["param_groups"][0]
    assert type(group["lr"]) is float and group["lr"] == opt.param_groups[0]["lr"]
    assert type(group["betas"]) is tuple and group["betas"] == (0.9, 0.95)
    assert list(back["optimizer"]["state"]) == list(opt.state_dict()["state"])  # int keys
    assert_exact(back["optimizer"], opt.state_dict())
    assert_exact(back["scheduler"], sched.state_dict())


def test_capture_apply_restores_live_objects(tmp_path: Path) -> None:
    model, opt, sched = model_and_optimizer()
    np.random.seed(5)
    random.seed(5)
    state = fc.capture(model=model, optimizer=opt, scheduler=sched, step=7, env={"pos": (1, 2)})
    fc.save(tmp_path / "ck", state)
    expected = (torch.rand(3), np.random.rand(3), random.random())

    model2 = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3)
    )
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    template = fc.capture(
        model=model2, optimizer=opt2, scheduler=sched2, step=0, env={"pos": (0, 0)}
    )
    back = fc.restore(tmp_path / "ck", template)  # fresh optimizer: empty state is filled
    fc.apply(back, model=model2, optimizer=opt2, scheduler=sched2)
    assert back["step"] == 7 and fc.codec.to_python(back["env"]) == {"pos": (1, 2)}
    assert_exact(opt2.state_dict(), opt.state_dict())
    assert_exact(model2.state_dict(), model.state_dict())
    assert sched2.state_dict() == sched.state_dict()
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_restore_out_reads_into_its_tensors_in_place(tmp_path: Path) -> None:
    src = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    fc.save(tmp_path / "ck", src)
    template = fc.codec.from_python({"w": torch.zeros(64, 64), "b": torch.zeros(64)})
    w_ptr = template["w"].data_ptr()
    back = fc.restore(tmp_path / "ck", out=template)
    assert back["w"].data_ptr() == w_ptr  # no second copy
    assert torch.equal(back["w"], src["w"]) and torch.equal(template["b"], src["b"])


def test_restore_returns_new_tensors_and_never_writes_like(tmp_path: Path) -> None:
    src = {"w": torch.randn(64, 64), "b": torch.randn(64), "step": 3}
    fc.save(tmp_path / "ck", src)
    like = fc.codec.from_python({"w": torch.zeros(64, 64), "b": torch.zeros(64), "step": 0})
    before = like.clone()
    back = fc.restore(tmp_path / "ck", like)
    assert back["w"].data_ptr() != like["w"].data_ptr()
    assert back["b"].data_ptr() != like["b"].data_ptr()
    assert torch.equal(back["w"], src["w"]) and torch.equal(back["b"], src["b"])
    assert back["step"] == 3 and back.is_locked
    assert_exact(fc.codec.to_python(like), fc.codec.to_python(before))  # untouched, bit for bit


def test_failed_restore_leaves_the_live_model_untouched(tmp_path: Path) -> None:
    model, opt, _ = model_and_optimizer()
    fc.save(tmp_path / "ck", fc.capture(model=model, optimizer=opt))
    data = tmp_path / "ck" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one tensor fails its checksum; the others are intact
    data.write_bytes(bytes(raw))
    live, live_opt, _ = model_and_optimizer()
    with torch.no_grad():
        for p in live.parameters():
            p.mul_(-2.0)  # differs from every saved tensor
    expected = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(fc.errors.CorruptCheckpoint):
        fc.restore(tmp_path / "ck", fc.capture(model=live, optimizer=live_opt))
    for k, v in live.state_dict().items():
        assert torch.equal(
            v.reshape(-1).view(torch.uint8), expected[k].reshape(-1).view(torch.uint8)
        ), k


def test_result_takes_each_like_leafs_dtype_device_and_grad(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"a": torch.tensor([1.5, 2.5]), "b": torch.arange(4), "c": 2.0})
    like = fc.codec.from_python(
        {
            "a": torch.zeros(2, dtype=torch.float64, requires_grad=True),
            "b": torch.empty(4, dtype=torch.int64, device="meta"),
            "c": 0.0,
        }
    )
    back = fc.restore(tmp_path / "ck", like, cast=True)
    assert back["a"].dtype == torch.float64 and back["a"].requires_grad
    assert back["a"].tolist() == [1.5, 2.5] and back["a"].is_leaf
    assert back["b"].device.type == "cpu" and back["b"].tolist() == [0, 1, 2, 3]
    assert like["a"].tolist() == [0.0, 0.0]
    with pytest.raises(fc.errors.TemplateMismatch, match="cast=True"):
        fc.restore(tmp_path / "ck", like)  # conversion only when asked for


def test_like_and_out_are_exclusive_and_template_is_no_spelling(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"w": torch.ones(3)})
    like = {"w": torch.zeros(3)}
    with pytest.raises(fc.CheckpointError, match="not both"):
        fc.restore(tmp_path / "ck", like, out=like)
    with pytest.raises(TypeError, match="template"):  # the old spelling is gone
        fc.restore(tmp_path / "ck", template=like)
    back = fc.restore(tmp_path / "ck", like=like)
    assert torch.equal(back["w"], torch.ones(3)) and torch.equal(like["w"], torch.zeros(3))


def test_meta_template_allocates_on_cpu(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"w": torch.arange(6.0).reshape(2, 3)})
    back = fc.restore(tmp_path / "ck", {"w": torch.empty(2, 3, device="meta")})
    assert back["w"].device.type == "cpu"
    assert torch.equal(back["w"], torch.arange(6.0).reshape(2, 3))
    back = fc.restore(tmp_path / "ck", {"w": torch.empty(2, 3, device="meta")}, device="cpu")
    assert torch.equal(back["w"], torch.arange(6.0).reshape(2, 3))
    back = fc.restore(tmp_path / "ck", out={"w": torch.empty(2, 3, device="meta")})
    assert torch.equal(back["w"], torch.arange(6.0).reshape(2, 3))


def test_template_mismatch_lists_every_offending_key(tmp_path: Path) -> None:
    fc.save(
        tmp_path / "ck", {"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(1), "v": 1}
    )
    template = {
        "a": torch.zeros(3, 2),
        "b": torch.zeros(4, dtype=torch.float64),
        "d": torch.zeros(1),
        "v": 2,
    }
    with pytest.raises(fc.errors.TemplateMismatch) as e:
        fc.restore(tmp_path / "ck", template)
    msg = str(e.value)
    assert "'a'" in msg and "float32[2, 3]" in msg and "float32[3, 2]" in msg
    assert "'b'" in msg and "float64" in msg and "cast=True" in msg
    assert "'d'" in msg and "missing" in msg
    assert "'c'" in msg and "partial=True" in msg


def test_cast_and_partial(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"a": torch.tensor([1.5, 2.5]), "b": torch.zeros(4), "n": {"x": 3}})
    back = fc.restore(
        tmp_path / "ck", {"a": torch.zeros(2, dtype=torch.float64)}, cast=True, partial=True
    )
    assert back["a"].dtype == torch.float64 and back["a"].tolist() == [1.5, 2.5]
    assert set(back.keys()) == {"a"}


def test_tied_parameters_are_written_once_and_stay_tied(tmp_path: Path) -> None:
    emb = torch.nn.Embedding(100, 32)
    head = torch.nn.Linear(32, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    state = fc.capture(model=model, rng=False)
    info = fc.save(tmp_path / "ck", state)
    assert info.tensor_bytes == 100 * 32 * 4
    back = fc.restore(tmp_path / "ck")
    assert back["model", "emb.weight"].data_ptr() == back["model", "head.weight"].data_ptr()
    sd = {"model": {"emb.weight": torch.empty(100, 32), "head.weight": torch.empty(100, 32)}}
    dcp.load(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert torch.equal(sd["model"]["head.weight"], emb.weight.detach())


def test_stock_dcp_load_reads_every_tensor(tmp_path: Path) -> None:
    tree = {
        "model": {
            f"layer{i}.{name}": random_tensor(d, (3, 4), i)
            for i, d in enumerate(CPU_DTYPES)
            for name in ("w",)
        },
        "scalar": torch.tensor(3.5),
        "step": 12,
    }
    fc.save(tmp_path / "ck", tree)
    target = {
        "model": {k: torch.empty_like(v) for k, v in tree["model"].items()},
        "scalar": torch.empty(()),
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    for k, v in tree["model"].items():
        assert torch.equal(target["model"][k].view(torch.uint8), v.view(torch.uint8)), k
    assert target["scalar"].item() == 3.5


def test_restore_of_stock_dcp_checkpoint(tmp_path: Path) -> None:
    sd = {
        "w": torch.randn(4, 4),
        "nested": {"b": torch.arange(3)},
        "obj": {"lr": 0.1, "tags": {"x"}},  # a set is not plain data: a pickle
    }
    dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    template = {"w": torch.zeros(4, 4), "nested": {"b": torch.zeros(3, dtype=torch.long)}}
    back = fc.restore(tmp_path / "d", template, partial=True)
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["nested"]["b"], sd["nested"]["b"])
    assert torch.equal(template["w"], torch.zeros(4, 4))  # like= is never written
    into = fc.codec.from_python(template)
    back = fc.restore(tmp_path / "d", out=into, partial=True)
    assert back["w"].data_ptr() == into["w"].data_ptr() and torch.equal(into["w"], sd["w"])
    like = {**template, "obj": {"lr": 0.0, "tags": set()}}
    with pytest.raises(fc.errors.UnsafeCheckpoint, match=r"'obj\.tags'") as err:
        fc.restore(tmp_path / "d", like)
    assert "dcp.load" in str(err.value) and "allow_pickle" not in str(err.value)
    back = fc.restore(tmp_path / "d", {**template, "obj": {"lr": 0.0}}, partial=True)
    assert back["obj"]["lr"] == 0.1  # plain data loads as plain data
    with pytest.raises(TypeError, match="allow_pickle"):  # no way to unpickle the set
        fc.restore(tmp_path / "d", like, allow_pickle=True)  # type: ignore[call-overload]
    summary = fc.inspect(tmp_path / "d")
    assert summary.foreign and summary.num_tensors == 2


def test_inspect_reads_no_tensor_data(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"w": torch.zeros(8, 8), "lr": 0.5}, metadata={"run": "r1"})
    os.truncate(tmp_path / "ck" / "__0_0.distcp", 0)  # tensors gone: inspect still works
    with pytest.raises(fc.errors.CorruptCheckpoint):
        fc.restore(tmp_path / "ck")
    (tmp_path / "ck2").mkdir()


def test_inspect_summary(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"w": torch.zeros(8, 8), "lr": 0.5}, metadata={"run": "r1"})
    s = fc.inspect(tmp_path / "ck")
    assert s.tree["w"].shape == (8, 8) and s.tree["lr"] == 0.5
    assert s.metadata["run"] == "r1" and "hostname" in s.metadata
    assert s.num_tensors == 1 and s.tensor_bytes == 256
    assert "w: float32[8, 8]" in str(s)


def test_overwrite_replaces_atomically(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"v": torch.zeros(3)})
    with pytest.raises(fc.errors.CheckpointExists, match="overwrite=True"):
        fc.save(tmp_path / "ck", {"v": torch.ones(3)})
    fc.save(tmp_path / "ck", {"v": torch.ones(3)}, overwrite=True)
    assert torch.equal(fc.restore(tmp_path / "ck")["v"], torch.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # nothing left behind


def test_save_works_without_process_group() -> None:
    import torch.distributed as dist

    assert not dist.is_initialized()


@tensorclass
class Pair:
    a: torch.Tensor


def test_state_must_be_a_tree(tmp_path: Path) -> None:
    with pytest.raises(fc.errors.UnsupportedValue, match=r"state\['env'\]"):
        fc.save(tmp_path / "ck", {"env": object()})
    with pytest.raises(fc.errors.UnsupportedValue, match="tensorclass"):
        fc.save(tmp_path / "ck", Pair(a=torch.zeros(2), batch_size=[2]))  # type: ignore[call-arg]
    assert not (tmp_path / "ck").exists()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda m: fc.apply(3, model=m), "state: expected a TensorDict or a dict, got int"),
        (lambda m: fc.apply(None, model=m), "state: expected a TensorDict or a dict"),
        (lambda m: fc.apply([1, 2], model=m), "state: expected a TensorDict or a dict"),
        (lambda m: fc.apply(fc.capture(model=m), model=m, rng="no"), r"fc\.apply\(rng='no'\)"),
        (lambda m: fc.capture(model=m, rng="yes"), r"fc\.capture\(rng='yes'\)"),
    ],
)
def test_capture_and_apply_name_a_bad_argument(call: Callable[[Any], Any], named: str) -> None:
    """Not an AttributeError of the state's missing ``keys``; a string flag is not True."""
    with pytest.raises(TypeError, match=named):
        call(torch.nn.Linear(2, 2))


def test_plain_dict_like_fits_a_captured_module(tmp_path: Path) -> None:
    """A template written as plain dicts restores a captured state_dict and vice versa.

    The container record (``__container__``) says how the *saved* subtree was built;
    it is not something a template has to spell out.
    """
    model = torch.nn.Linear(2, 2)
    fc.save(tmp_path / "captured", fc.capture(model=model, step=3))
    like = {"model": {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, "step": 0}
    got = fc.restore(tmp_path / "captured", like, partial=True)  # partial: rng is left out
    assert isinstance(fc.codec.to_python(got["model"]), OrderedDict)
    assert torch.equal(got["model"]["weight"], model.weight.detach())
    assert fc.codec.to_python(got["step"]) == 3

    fc.save(tmp_path / "plain", {"model": {"weight": torch.ones(2, 2), "bias": torch.ones(2)}})
    captured_like = {"model": fc.capture(model=model)["model"]}
    got = fc.restore(tmp_path / "plain", captured_like)
    fc.apply(got, model=model, rng=False)
    assert torch.equal(model.weight.detach(), torch.ones(2, 2))


def test_a_restored_state_is_locked_throughout_and_clone_or_unlock_makes_it_writable(
    tmp_path: Path,
) -> None:
    # What the guide promises an environment that writes into its restored state.
    fc.save(tmp_path / "c", {"env": {"obs": torch.zeros(2), "inner": {"t": torch.ones(1)}}})
    state = fc.restore(tmp_path / "c")
    assert state.is_locked and state["env"].is_locked and state["env", "inner"].is_locked
    state["env", "obs"].add_(1.0)  # in place: allowed
    with pytest.raises(RuntimeError, match="locked"):
        state["env", "obs"] = torch.zeros(2)
    writable = state.clone()
    assert not any(td.is_locked for td in (writable, writable["env"], writable["env", "inner"]))
    writable["env", "inner", "u"] = torch.zeros(1)
    assert "u" not in state["env", "inner"].keys()
    with state.unlock_():
        state["env", "inner", "u"] = torch.zeros(1)
    assert state.is_locked and state["env", "inner"].is_locked
    state.unlock_()
    assert not state["env", "inner"].is_locked
    state["env", "obs"] = torch.full((2,), 3.0)
    assert fc.restore(tmp_path / "c")["env", "obs"].sum() == 0  # the checkpoint is not touched
