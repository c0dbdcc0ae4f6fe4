"""``fckpt`` starts without the tensor libraries when the command reads no tensor,
and ``fc.save`` of a plain dict without tensordict (whose import pulls in ``torch._dynamo``).

Each case runs the real entry point (``python -m functional_ckpt``) in a fresh
process, which then reports the modules it loaded: ``--help``, ``--version`` and
``ls``, ``inspect`` and ``verify`` must load neither torch nor tensordict, and
numpy only to rebuild a numpy value a manifest holds (the RNG states
``fc.capture`` records); ``verify`` still finds a ``.metadata`` that disagrees with
the manifest. Their output is
checked as well: starting lighter must not change what they say, and the plain
tables printed without ``rich`` are laid out exactly as ``rich`` lays them out.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_ckpt as fc
from functional_ckpt._src.cli import ui
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.naming import step_name
from tests.forge import resign
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


def test_help_loads_neither_the_listing_nor_the_manifest() -> None:
    """``fckpt --help`` prints the parser: nothing that reads a checkpoint is loaded."""
    code = (
        "import runpy, sys\n"
        "try:\n"
        "    runpy.run_module('functional_ckpt', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('functional_ckpt.')), file=sys.stderr)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=HANG
    )
    loaded = set(json.loads(proc.stderr.strip().splitlines()[-1].replace("'", '"')))
    assert "functional_ckpt._src.cli.parser" in loaded
    heavy = {
        "functional_ckpt._src.root.listing",
        "functional_ckpt._src.storage.committed",
        "functional_ckpt._src.format.manifest",
        "functional_ckpt._src.format.view",
        "functional_ckpt._src.codec",
    }
    assert loaded & heavy == set()


def test_a_save_of_a_plain_dict_loads_no_tensordict(tmp_path: Path) -> None:
    """The first ``fc.save`` of a job that keeps its state in dicts; a TensorDict saved
    by the same process afterwards is still one (tensordict loads once it is used)."""
    code = (
        "import sys, torch, functional_ckpt as fc\n"
        "state = {'model': {'w': torch.ones(3)}, 'step': 3, 'opt': {'state': {0: {'m': "
        "torch.zeros(2)}}, 'param_groups': [{'lr': 0.1, 'params': [0]}]}}\n"
        "fc.save(sys.argv[1] + '/a', state)\n"
        "print('tensordict' in sys.modules, 'torch._dynamo' in sys.modules)\n"
        "from tensordict import TensorDict\n"
        "fc.save(sys.argv[1] + '/b', TensorDict({'x': torch.ones(2, 3)}, batch_size=[2]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG,
        check=True,
    )
    assert proc.stdout.split() == ["False", "False"]
    a = fc.restore(tmp_path / "a")
    assert a["opt", "state", "0", "m"].shape == (2,) and fc.codec.to_python(a)["opt"]["state"][0]
    assert fc.restore(tmp_path / "b").batch_size == (2,)


def test_a_restore_into_a_plain_template_loads_no_tensordict(tmp_path: Path) -> None:
    """A job that keeps its state in dicts restores into the same plain containers
    (an OrderedDict, int keys and tuples kept), and never loads tensordict for it."""
    code = (
        "import sys, torch, functional_ckpt as fc\n"
        "from collections import OrderedDict\n"
        "state = {'model': OrderedDict(w=torch.ones(3)), 'step': 3, 'pair': (torch.ones(1), 2),"
        " 'opt': {'state': {0: {'m': torch.zeros(2)}}, 'param_groups': [{'lr': 0.1}]}}\n"
        "fc.save(sys.argv[1], state)\n"
        "like = {'model': OrderedDict(w=torch.zeros(3)), 'step': 0, 'pair': (torch.zeros(1), 0),"
        " 'opt': {'state': {0: {'m': torch.ones(2)}}, 'param_groups': [{'lr': 1.0}]}}\n"
        "new = fc.restore(sys.argv[1], like)\n"
        "assert type(new) is dict and type(new['model']) is OrderedDict, new\n"
        "assert new['step'] == 3 and type(new['pair']) is tuple and new['pair'][1] == 2, new\n"
        "assert torch.equal(new['opt']['state'][0]['m'], torch.zeros(2)), new\n"
        "assert new['opt']['param_groups'] == [{'lr': 0.1}], new\n"
        "assert torch.equal(like['model']['w'], torch.zeros(3))  # the template is untouched\n"
        "part = fc.restore(sys.argv[1], {'step': 0}, partial=True)\n"
        "assert part == {'step': 3}, part\n"
        "print('tensordict' in sys.modules, 'torch._dynamo' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "a")],
        capture_output=True,
        text=True,
        timeout=HANG,
        check=True,
    )
    assert proc.stdout.split() == ["False", "False"]
    assert fc.restore(tmp_path / "a").is_locked  # without a template: a TensorDict


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


def test_verify_loads_no_tensor_library(plain_root: Path, managed_root: Path) -> None:
    for root, n, allowed in ((plain_root, 3, set()), (managed_root, 2, {"numpy"})):
        code, out, loaded = fckpt("verify", str(root))
        assert code == 0 and out.splitlines()[-1] == f"{n} checkpoints intact"
        assert loaded <= allowed


@pytest.fixture
def two_ranks(shard_save: Callable[[int], Path]) -> Path:
    """A checkpoint two gloo ranks saved: DTensors sharded on different dimensions, a
    replicated one, a plain tensor, values and each rank's own subtree (``loader``)."""
    return shard_save(2)


def test_inspect_of_a_two_rank_checkpoint_loads_no_tensor_library(two_ranks: Path) -> None:
    code, out, loaded = fckpt("inspect", str(two_ranks))
    assert code == 0 and loaded == set()
    assert "written by 2 ranks" in out.splitlines()[1]
    specs = dict(re.findall(r"^  (\w+) +(\w+\[[\d, ]*\])  ", out, re.M))
    assert specs == {"w": "float32[10, 6]", "e": "bfloat16[5, 3, 2]", "r": "float32[10, 6]"} | {
        "b": "int64[7]"
    }
    code, out, loaded = fckpt("inspect", str(two_ranks), "--json")
    assert code == 0 and loaded == set()
    doc = json.loads(out)
    by_key = {e["key"]: e for e in doc["entries"]}
    assert (by_key["e"]["dtype"], by_key["e"]["shape"], by_key["e"]["nbytes"]) == (
        "bfloat16",
        [5, 3, 2],
        60,
    )
    assert by_key["loader/pos"]["value"] == 0 and by_key["step"]["value"] == 11  # rank 0's view
    assert doc["world_size"] == 2 and doc["num_tensors"] == 4


def test_verify_of_a_two_rank_checkpoint_loads_no_tensor_library(two_ranks: Path) -> None:
    code, out, loaded = fckpt("verify", str(two_ranks), "--json")
    assert code == 0 and loaded == set()
    doc = json.loads(out)
    assert (doc["ok"], doc["intact"], doc["checkpoints"][0]["problems"]) == (True, 1, [])
    # both ranks' shard files and the .metadata derived from both ranks' entries
    assert (two_ranks / naming.DCP_METADATA).is_file()
    assert doc["checkpoints"][0]["files_checked"] == 3


def test_verify_finds_a_misleading_dcp_metadata_without_torch(
    plain_root: Path, tmp_path: Path
) -> None:
    """A ``.metadata`` (re-signed) that would send stock ``dcp.load`` to other bytes."""
    bad = tmp_path / "bad"
    shutil.copytree(plain_root / step_name(3), bad)
    md = pickle.loads((bad / naming.DCP_METADATA).read_bytes())
    info = md.storage_data[next(k for k in md.storage_data if k.fqn == "model.w")]
    info.length += 1
    raw = pickle.dumps(md, protocol=2)
    (bad / naming.DCP_METADATA).write_bytes(raw)

    def edit(m: dict[str, Any]) -> None:
        m["files"][naming.DCP_METADATA] = {"size": len(raw), "crc32": zlib.crc32(raw)}

    resign(bad, edit)
    code, out, loaded = fckpt("verify", str(bad))
    assert code == 1 and loaded == set()
    assert "disagrees with the manifest" in out and "'model.w' at (0, 0)" in out
    assert f"{info.length}, None) where the manifest says" in out


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
