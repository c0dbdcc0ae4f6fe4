"""Bounded fuzzing of the readers: mutated manifests, markers and ``.metadata`` files.

Each example damages one file of a small real checkpoint (bit flips, truncation,
splices, whole replacement, random msgpack), optionally re-signing it as an
attacker owning the files would, then restores, inspects and verifies it. Every
input must end in a correct restore or a ``CheckpointError``, within a budget of
CPU time and memory (CPU time: a busy machine stretches the wall clock, never the
CPU a hash flood burns). The long form is ``python benchmarks/faults.py --scenarios fuzz``.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_ckpt as fc
from tests.depth import examples

REPO = Path(__file__).resolve().parent.parent


def _faults() -> ModuleType:
    if "fc_faults" in sys.modules:
        return sys.modules["fc_faults"]
    spec = importlib.util.spec_from_file_location("fc_faults", REPO / "benchmarks" / "faults.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fc_faults"] = module
    spec.loader.exec_module(module)
    return module


faults = _faults()

#: Per-read budgets, in CPU seconds and bytes of Python objects; a hash flood or an
#: unbounded allocation blows through them by orders of magnitude.
TIME_BUDGET_S = 5.0
PY_MEMORY_BUDGET = 64 << 20


@pytest.fixture(scope="module")
def pristine() -> Iterator[Path]:
    work = Path(tempfile.mkdtemp(prefix="fc-fuzz-"))
    path = work / "pristine"
    fc.save(path, faults.make_state(1, big=1, small=4))
    yield path
    shutil.rmtree(work, ignore_errors=True)


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["format", "files", "entries", "path", "k", "COMMITTED", "../x", 7]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


@st.composite
def mutations(draw: st.DrawFn) -> tuple[str, str, int, bytes]:
    target = draw(st.sampled_from(faults.FUZZ_TARGETS))
    kind = draw(st.sampled_from(faults.FUZZ_KINDS))
    pos = draw(st.integers(min_value=0, max_value=1 << 16))
    if target.startswith("msgpack"):
        data = msgpack.packb(
            {
                "format": "functional_ckpt",
                "version": 1,
                "files": draw(plain),
                "entries": draw(plain),
            }
        )
    else:
        data = draw(st.binary(min_size=1, max_size=64))
    return target, kind, pos, data


@settings(
    max_examples=examples(400),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mutation=mutations())
def test_readers_refuse_or_restore_within_budget(
    pristine: Path, tmp_path_factory: pytest.TempPathFactory, mutation: tuple[str, str, int, bytes]
) -> None:
    target, kind, pos, data = mutation
    path = tmp_path_factory.mktemp("fz") / "ck"
    shutil.copytree(pristine, path)
    signed = faults.fuzz_mutate(path, target, kind, pos, data)
    tracemalloc.start()
    try:
        faults.fuzz_one(path, signed, budget_s=TIME_BUDGET_S)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < PY_MEMORY_BUDGET, f"{target}/{kind}: {peak >> 20} MiB of Python objects"
    if target.startswith("tamper"):  # each structural attack is one fc.verify names
        report = fc.verify(path)
        assert not report.ok, f"{target}/{data[:1]!r}: verify found nothing"
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.mark.parametrize("ranks", ["missing", "empty"])
def test_a_manifest_without_rank_views_is_reported_not_raised(
    pristine: Path, tmp_path: Path, ranks: str
) -> None:
    """Found by the fuzzer: a re-signed manifest whose per-rank table was renamed away
    made fc.verify fail with an IndexError instead of reporting."""
    from tests.forge import resign

    path = tmp_path / "ck"
    shutil.copytree(pristine, path)

    def edit(m: dict[str, Any]) -> None:
        if ranks == "missing":
            m["sanks"] = m.pop("ranks")
        else:
            m["ranks"] = []

    resign(path, edit)
    faults.fuzz_one(path, True, budget_s=TIME_BUDGET_S)
    report = fc.verify(path)
    assert isinstance(report.ok, bool)
