"""Property test: any tree of supported leaves comes back identical in value and type."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings

import functional_ckpt as fc
from functional_ckpt._src.format.keys import NODE_KEY
from tests.exact import assert_exact, python_values
from tests.test_core import CPU_DTYPES, random_tensor

_counter = itertools.count()


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(CPU_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    t = random_tensor(dtype, shape, draw(st.integers(0, 1000)))
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)  # non-contiguous view
    return t


keys = st.text(min_size=0, max_size=8).filter(lambda k: k != NODE_KEY) | st.sampled_from(
    ["a.b", "c/d", "ünï", "0", "w"]
)


def trees(max_leaves: int = 20) -> st.SearchStrategy[Any]:
    leaves = tensors() | python_values(max_leaves=4)

    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return (
            st.dictionaries(keys, inner, max_size=4)
            | st.lists(inner, max_size=3)
            | st.lists(inner, max_size=3).map(tuple)
            | st.dictionaries(st.integers(-3, 50), inner, max_size=3)
        )

    return st.dictionaries(keys, st.recursive(leaves, extend, max_leaves=max_leaves), max_size=5)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(tree=trees())
def test_any_tree_round_trips_exactly(tree: dict[str, Any]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="fc-rt-"))
    try:
        state = fc.codec.from_python(tree)
        expected = fc.codec.to_python(state)  # the tree as the state holds it (views stay views)
        fc.save(tmp / "ck", state)
        back = fc.restore(tmp / "ck")
        assert_exact(fc.codec.to_python(back), expected)
        assert_exact(fc.codec.to_python(back), tree)
        assert fc.codec.to_python(fc.restore(tmp / "ck", state)) is not None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
