"""``out=`` tensors that several saved elements would land on are refused by key, before a
byte is written: an expanded tensor, two leaves that share memory without being one
tensor, and one tensor twice (a tie) where the checkpoint holds two values for its keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    fc.save(path, {"model": {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(3)}})
    return path


def test_an_expanded_out_tensor_is_refused_naming_its_key(saved: Path) -> None:
    row = torch.zeros(1, 3)
    into = {"model": {"weight": row.expand(2, 3), "bias": torch.zeros(3)}}
    with pytest.raises(fc.errors.TemplateMismatch, match=r"'model', 'weight'.*overlaps itself"):
        fc.restore(saved, out=into)
    assert not row.any() and not into["model"]["bias"].any()  # nothing was written


@pytest.mark.parametrize(
    "leaf",
    [
        lambda: torch.zeros(2, 3).to_sparse(),
        lambda: torch.nested.nested_tensor([torch.zeros(2, 3)]),
    ],
    ids=["sparse", "nested"],
)
def test_an_out_tensor_with_no_dense_buffer_is_refused_naming_its_key(
    saved: Path, leaf: Callable[[], torch.Tensor]
) -> None:
    """A sparse or nested leaf has no buffer of its shape: torch fails on it naming no key."""
    into = {"model": {"weight": leaf(), "bias": torch.zeros(3)}}
    with pytest.raises(fc.errors.TemplateMismatch, match=r"'model', 'weight'.*pass a dense one"):
        fc.restore(saved, out=into)
    assert not into["model"]["bias"].any()


@pytest.mark.parametrize("strides", [(1, 1), (2, 2), (2, 1)])
def test_an_out_tensor_overlapping_itself_without_a_zero_stride_is_refused(
    saved: Path, strides: tuple[int, int]
) -> None:
    backing = torch.zeros(16)
    into = {"model": {"weight": backing.as_strided((2, 3), strides), "bias": torch.zeros(3)}}
    with pytest.raises(fc.errors.TemplateMismatch, match=r"'model', 'weight'.*overlaps itself"):
        fc.restore(saved, out=into)
    assert not backing.any() and not into["model"]["bias"].any()


def test_out_tensors_strided_without_overlap_restore(saved: Path) -> None:
    backing = torch.zeros(3, 2)  # the weight lands transposed, the bias in every other slot
    spaced = torch.zeros(6)
    fc.restore(saved, out={"model": {"weight": backing.t(), "bias": spaced[::2]}})
    assert torch.equal(backing.t(), torch.arange(6.0).reshape(2, 3))
    assert torch.equal(spaced, torch.tensor([1.0, 0, 1, 0, 1, 0]))


def test_out_leaves_sharing_memory_are_refused_naming_both(saved: Path) -> None:
    flat = torch.zeros(8)
    into = {"model": {"weight": flat[:6].view(2, 3), "bias": flat[4:7]}}
    with pytest.raises(
        fc.errors.TemplateMismatch,
        match=r"'model', '(bias|weight)'.* shares memory with .*'model', '(weight|bias)'",
    ):
        fc.restore(saved, out=into)
    assert not flat.any()


def test_out_leaves_side_by_side_in_one_buffer_restore(saved: Path) -> None:
    flat = torch.zeros(9)
    into = {"model": {"weight": flat[:6].view(2, 3), "bias": flat[6:]}}
    fc.restore(saved, out=into)
    assert torch.equal(flat, torch.tensor([0.0, 1, 2, 3, 4, 5, 1, 1, 1]))


def _save(path: Path, state: dict[str, torch.Tensor], stock: bool) -> None:
    if stock:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=path)
    else:
        fc.save(path, state)


@pytest.mark.parametrize("how", ["one tensor", "two of the same bits", "stock DCP"])
def test_a_tied_pair_of_out_leaves_restores(tmp_path: Path, how: str) -> None:
    w = torch.tensor([1.0, -0.0, float("nan")])  # bits compared: NaN is NaN, -0.0 is not 0.0
    _save(
        tmp_path / "tied",
        {"a": w, "b": w if how == "one tensor" else w.clone()},
        how == "stock DCP",
    )
    t = torch.zeros(3)
    back = fc.restore(tmp_path / "tied", out={"a": t, "b": t})
    assert (
        back["a"] is t and back["b"] is t and torch.equal(t.view(torch.int32), w.view(torch.int32))
    )


@pytest.mark.parametrize("stock", [False, True], ids=["fc", "stock DCP"])
@pytest.mark.parametrize(
    "b", [torch.full((4,), 9.0), torch.tensor([7.0, 7, 7, -0.0])], ids=["9s", "-0.0 for 0.0"]
)
def test_a_tie_in_out_of_keys_saved_with_other_values_is_refused_naming_both(
    tmp_path: Path, stock: bool, b: torch.Tensor
) -> None:
    _save(tmp_path / "ck", {"a": torch.tensor([7.0, 7, 7, 0]), "b": b}, stock)
    t = torch.zeros(4)
    with pytest.raises(
        fc.errors.TemplateMismatch, match="'b' holds other saved values than its tie 'a'"
    ):
        fc.restore(tmp_path / "ck", out={"a": t, "b": t})
    assert not t.any()  # nothing was written


def test_a_stock_dcp_checkpoint_refuses_an_expanded_out_tensor(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"weight": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=tmp_path / "stock")
    row = torch.zeros(1, 3)
    with pytest.raises(fc.errors.TemplateMismatch, match=r"'weight'.*overlaps itself"):
        fc.restore(tmp_path / "stock", out={"weight": row.expand(2, 3)})
    assert not row.any()


def test_a_dtensor_tie_in_out_restores_only_where_its_saved_values_are_the_same(
    tmp_path: Path,
) -> None:
    """A save records no tie of DTensors (tied embeddings under FSDP2): a DTensor twice in
    out= is read back when both keys' saved bits are the same, else refused, unwritten."""
    from tests.test_write_staging_edges import one_rank

    got = one_rank(
        tmp_path,
        """
        w = torch.arange(16.0).reshape(4, 4)
        a = distribute_tensor(w, mesh, [Shard(0)])
        fc.save(base / "same", {"a": a, "b": a})
        fc.save(base / "other", {"a": a, "b": distribute_tensor(w + 1, mesh, [Shard(0)])})
        t = DTensor.from_local(torch.zeros(4, 4), mesh, [Shard(0)], run_check=False)
        back = fc.restore(base / "same", out={"a": t, "b": t})
        same = back["a"] is t and back["b"] is t and torch.equal(t.full_tensor(), w)
        try:
            fc.restore(base / "other", out={"a": t, "b": t})
            refused = ""
        except fc.errors.TemplateMismatch as e:
            refused = str(e)
        kept = torch.equal(t.full_tensor(), w)
        print(json.dumps({"same": bool(same), "refused": refused, "kept": bool(kept)}))
        """,
    )
    assert got["same"]
    assert "'b' holds other saved values than its tie 'a'" in got["refused"], got["refused"]
    assert got["kept"]


def test_a_dtensor_tie_in_out_of_a_stock_dcp_checkpoint_is_refused_where_its_values_differ(
    tmp_path: Path,
) -> None:
    """Stock DCP records no ties either: its DTensors' shards are what out= checks."""
    from tests.test_write_staging_edges import one_rank

    got = one_rank(
        tmp_path,
        """
        import torch.distributed.checkpoint as dcp
        w = torch.arange(16.0).reshape(4, 4)
        a, b = (distribute_tensor(x, mesh, [Shard(0)]) for x in (w, w + 1))
        dcp.save({"a": a, "b": b}, checkpoint_id=base / "stock")
        t = DTensor.from_local(torch.zeros(4, 4), mesh, [Shard(0)], run_check=False)
        try:
            fc.restore(base / "stock", out={"a": t, "b": t})
            refused = ""
        except fc.errors.TemplateMismatch as e:
            refused = str(e)
        print(json.dumps({"refused": refused, "kept": not t.to_local().any()}))
        """,
    )
    assert "'b' holds other saved values than its tie 'a'" in got["refused"], got["refused"]
    assert got["kept"]
