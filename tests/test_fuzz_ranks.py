"""Bounded fuzzing of what the ranks of a save agree on, and of the messages they read.

Each example draws the arguments of two ranks (the destination, the base, whether to
overwrite, the staging mode, the per-rank subtrees, a tier's settings), equal or
differing in any of them: a save's first round must let them through exactly when
they are equal, and otherwise name the first argument that differs and both ranks.
Random and mutated first-round and written-chunk messages (what a peer sends) end in
a ``CheckpointError`` or a valid reading, never another exception. The real rounds,
with two processes on gloo, are in tests/test_dist_ranks.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.save import exchange
from functional_ckpt._src.save.job import SaveJob
from functional_ckpt._src.save.options import SaveOptions
from tests.depth import examples

_NAMES = st.sampled_from(["step_1", "step_2", "b", "c"])
_DIRS = st.sampled_from(["root", "/mnt/root", "other"])


@st.composite
def jobs(draw: st.DrawFn) -> SaveJob:
    """One rank's save: its destination, options and staging mode."""
    base = draw(st.none() | st.builds(lambda d, n: Path(d) / n, _DIRS, _NAMES))
    options = SaveOptions(
        overwrite=draw(st.booleans()),
        per_rank=tuple(draw(st.lists(st.sampled_from(["rng", "loader", "env"]), max_size=3))),
        base=base,
        parts=draw(st.booleans()),
        durable=draw(st.booleans()),
    )
    dest = Path(draw(_DIRS)) / draw(_NAMES)
    staging = draw(st.sampled_from([None, "copy", "write", "none"]))
    return SaveJob(dest, None, options, topology(), True, staging=staging)


@settings(max_examples=examples(300), deadline=None)
@given(jobs(), jobs(), st.integers(1, 4095))
def test_arguments_pass_exactly_when_equal_and_a_difference_is_named(
    first: SaveJob, other: SaveJob, rank: int
) -> None:
    name, told = exchange.parse_first_round(exchange.first_round("x.tmp-0123456789ab", first))
    assert name == "x.tmp-0123456789ab" and told is not None
    mine = exchange.arguments(other)
    error = exchange.disagreement(other, told, rank, "save x")
    if mine == told:
        assert error is None
        return
    assert error is not None
    differs = next(k for k in mine if told.get(k, object()) != mine[k])
    text = str(error)
    assert f"the ranks disagree on {differs}: rank 0 passed " in text
    assert f", rank {rank} {mine[differs]!r};" in text


_FIRST = exchange.first_round(
    "ck.tmp-0123456789ab",
    SaveJob(Path("r/ck"), None, SaveOptions(base=Path("r/a")), topology(), True),
)
_WRITTEN = exchange.written_payload([], part={"__1_0.distcp": 12})


@settings(max_examples=examples(300), deadline=None)
@given(
    st.sampled_from([_FIRST, _WRITTEN]),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
    st.integers(0, 1 << 16),
    st.binary(max_size=64),
)
def test_a_peers_message_is_read_or_refused(
    message: bytes, flips: list[tuple[int, int]], cut: int, junk: bytes
) -> None:
    data = bytearray(message[: max(1, cut % (len(message) + 1))] + junk)
    for at, value in flips:
        data[at % len(data)] = value
    for read in (exchange.parse_first_round, lambda d: exchange.parse_written(d, 1)):
        with contextlib.suppress(fc.CheckpointError):  # refused, or read
            read(bytes(data))


@pytest.mark.parametrize(
    "args",
    [[], [1, {}], ["ck.tmp-0123456789ab"], ["ck.tmp-0123456789ab", []], [None, {}]],
)
def test_first_rounds_of_the_wrong_shape_are_refused(args: list[object]) -> None:
    with pytest.raises(fc.CheckpointError, match="invalid first round"):
        exchange.parse_first_round(codec.encode(args))
