"""The README's examples run: its quick start and its resumable manager loop."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import tomllib
import torch

import functional_ckpt as fc
from tests.test_docs import code_blocks, runnable

README = Path(__file__).resolve().parent.parent / "README.md"


class Loader:
    """A resumable data loader: yields batches from its position on."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = [
            (torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)
        ]
        self.pos = 0

    def __iter__(self) -> Any:
        while self.pos < len(self.data):
            self.pos += 1
            yield self.data[self.pos - 1]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.pos = sd["pos"]


def job(n: int) -> dict[str, Any]:
    """The names the README's examples leave to the reader's own training code."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)

    def train_forward_backward(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        return loss  # as the README's own: a tensor that requires grad

    return {
        "model": model,
        "opt": opt,
        "sched": sched,
        "loader": Loader(n),
        "step": 0,
        "fc": fc,  # imported by the first block
        "train_forward_backward": train_forward_backward,
    }


def block(marker: str) -> str:
    found = [
        b.source
        for b in runnable(code_blocks(README.read_text(encoding="utf-8")))
        if marker in b.source
    ]
    assert len(found) == 1, f"README.md: expected one python block with {marker!r}"
    return found[0]


def test_readme_quick_start_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns = job(3)
    live = ns["model"].weight.detach().clone()
    exec(block("fc.restore("), ns)
    assert torch.equal(ns["model"].weight, live)
    assert ns["state"]["step"] == 0


def test_readme_manager_loop_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    loop = block("CheckpointManager(")
    first = job(5)  # a job preempted after 5 batches
    exec(loop, first)
    saved = first["mgr"].steps()
    assert saved, "the loop saved nothing"
    second = job(12)  # the restart: same code, a checkpoint exists now
    exec(loop, second)
    assert second["mgr"].restored_step == saved[-1]
    assert second["loader"].pos == 12
    latest = second["mgr"].latest_step()
    assert latest > saved[-1]  # the resumed run went on saving
    assert fc.restore(second["mgr"].path(latest))["loader", "pos"] == latest + 1


def test_one_install_story() -> None:
    """Every page installs torch pinned before the project (a loose torch pulls a CUDA
    build), and the guide lists exactly the dependencies of pyproject.toml."""
    repo = README.parent
    pages = [README, *sorted((repo / "docs").glob("*.md"))]
    for page in pages:
        for line in page.read_text(encoding="utf-8").splitlines():
            if "pip install" in line and "-e ." in line.replace("'.[", "."):
                assert "pip install torch==" in line, f"{page.name}: {line.strip()}"
    deps = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!\[ ]", d, maxsplit=1)[0] for d in deps}
    guide = (repo / "docs" / "guide.md").read_text(encoding="utf-8")
    sentence = guide[guide.index("The dependencies are") :].split(", exactly the")[0]
    assert set(re.findall(r"`([\w-]+)`", sentence)) == names
    ci = (repo / ".ci" / "run").read_text()
    assert "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q" in ci
