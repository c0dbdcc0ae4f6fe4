"""``fckpt`` starts without the tensor libraries when the command reads no tensor.

Each case runs the real entry point (``python -m functional_ckpt``) in a fresh
process, which then reports the modules it loaded: ``--help``, ``--version`` and
``ls`` must load neither torch nor tensordict, and numpy only to rebuild a numpy
value a manifest holds (the RNG states ``fc.capture`` records). Their output is
checked as well: starting lighter must not change what they say, and the plain
tables printed without ``rich`` are laid out exactly as ``rich`` lays them out.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_ckpt as fc
from functional_ckpt._src.cli import ui
from functional_ckpt._src.format.naming import step_name
from tests.patience import HANG

#: Runs the entry point as ``python -m functional_ckpt`` does, then names the heavy
#: top-level packages it loaded (on stderr, after the command's own output).
_WRAPPER = """\
import runpy, sys
code = 0
try:
    runpy.run_module("functional_ckpt", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else 0
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "tensordict", "numpy"})
print("LOADED=" + ",".join(loaded), file=sys.stderr)
raise SystemExit(code)
"""


def fckpt(*argv: str) -> tuple[int, str, set[str]]:
    """(exit status, stdout, heavy packages loaded) of one ``fckpt`` run."""
    proc = subprocess.run(
        [sys.executable, "-c", _WRAPPER, *argv],
        capture_output=True,
        text=True,
        timeout=HANG,
        check=False,
        env={**os.environ, "NO_COLOR": "1"},
    )
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("LOADED="), proc.stderr[-2000:]
    loaded = {m for m in last.removeprefix("LOADED=").split(",") if m}
    return proc.returncode, proc.stdout, loaded


def _plain_state(step: int) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((3, 4), float(step)), "b": torch.zeros(4, dtype=torch.bfloat16)},
        "step": step,
        "config": {"lr": 0.1, "sizes": (1, 2), "name": "run"},
    }


@pytest.fixture(scope="module")
def plain_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three checkpoints of tensors and plain values (no numpy value anywhere)."""
    root = tmp_path_factory.mktemp("startup") / "plain"
    for step in (1, 2, 3):
        fc.save(
            root / step_name(step), _plain_state(step), metadata={"metrics": {"loss": 1 / step}}
        )
    return root


@pytest.fixture(scope="module")
def managed_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A manager's root of captured states (model, optimizer, RNG states), with metrics."""
    root = tmp_path_factory.mktemp("startup") / "managed"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    with fc.CheckpointManager(root, save=fc.every_steps(1), keep=fc.keep_last(2)) as mgr:
        for step in (1, 2, 3):
            state = fc.capture(model=model, optimizer=opt, step=step)
            mgr.maybe_save(state, step=step, metrics={"loss": 1.0 / step})
    return root


def test_version_loads_no_tensor_library() -> None:
    code, out, loaded = fckpt("--version")
    assert (code, out.strip()) == (0, f"fckpt {fc.__version__}")
    assert loaded == set()


@pytest.mark.parametrize("argv", [[], ["ls"], ["inspect"], ["verify"], ["export"], ["demo"]])
def test_help_loads_no_tensor_library(argv: list[str]) -> None:
    code, out, loaded = fckpt(*argv, "--help")
    assert code == 0 and out.startswith("usage: fckpt")
    if not argv:
        assert all(c in out for c in ("ls", "inspect", "verify", "export", "prune", "demo"))
    assert loaded == set()


def test_ls_of_plain_states_loads_no_tensor_library(plain_root: Path) -> None:
    code, out, loaded = fckpt("ls", str(plain_root))
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[1:4]] == [step_name(s) for s in (1, 2, 3)]
    assert "3 committed checkpoints" in out
    assert loaded == set()
    code, out, loaded = fckpt("ls", str(plain_root), "--json")
    assert code == 0 and loaded == set()
    rows = json.loads(out)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "ok"), (2, "ok"), (3, "ok")]


def test_ls_of_a_manager_root_loads_neither_torch_nor_tensordict(managed_root: Path) -> None:
    code, out, loaded = fckpt("ls", str(managed_root))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["CHECKPOINT", "STEP"]
    assert [line.split()[0] for line in lines[1:3]] == [step_name(2), step_name(3)]
    assert "loss=0.3333" in lines[2] and "keep_last(2)" in lines[2]
    assert "retention (recorded in the checkpoints): keep_last(2)" in out
    assert loaded <= {"numpy"}  # the RNG states fc.capture records are numpy arrays


def test_verify_loads_no_tensordict(plain_root: Path, managed_root: Path) -> None:
    # torch builds the DCP metadata that .metadata is compared with; tensordict is not needed
    for root, n in ((plain_root, 3), (managed_root, 2)):
        code, out, loaded = fckpt("verify", str(root))
        assert code == 0 and out.splitlines()[-1] == f"{n} checkpoints intact"
        assert "tensordict" not in loaded


def _printed_table(head: list[str], rows: list[list[str]], *, plain: bool) -> str:
    out = io.StringIO()
    styles = [["dim"] * len(head) for _ in rows]
    with pytest.MonkeyPatch.context() as mp:
        if not plain:  # the layout rich makes of the same table
            mp.setattr(ui, "_plain_cells", lambda *_: False)
        ui.UI(out=out, colour=False).table(head, rows, styles)
    return out.getvalue()


_CELL = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(_CELL, min_size=n, max_size=n),
            st.lists(st.lists(_CELL, min_size=n, max_size=n), max_size=6),
        )
    )
)
def test_a_plain_table_is_laid_out_as_rich_lays_it_out(table: tuple[list[str], Any]) -> None:
    head, rows = table
    assert _printed_table(head, rows, plain=True) == _printed_table(head, rows, plain=False)


def test_a_table_of_other_text_is_left_to_rich() -> None:
    rows = [["step_1", "ok"], ["wide \u5b57", "\x1b[31mred"]]
    assert not ui._plain_cells(["A", "B"], rows, [["", ""]] * 2)
    assert ui._plain_cells(["A", "B"], rows[:1], [["", ""]])
    assert not ui._plain_cells(["A", "B"], [["x"]], [[""]])  # a short row: rich decides
