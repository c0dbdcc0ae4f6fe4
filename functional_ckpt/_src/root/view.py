"""A checkpoint root as a manager sees it: steps, records, branches (read-only queries;
the manager adds writing, resuming and locking)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.format.naming import BRANCHES_DIR, step_name
from functional_ckpt._src.policy.retention import best_steps
from functional_ckpt._src.root import rollback
from functional_ckpt._src.root.listing import StepInfo, committed_steps, read_info, stamp, step_dirs
from functional_ckpt.errors import CheckpointError, CheckpointNotFound


def check_root(root: Path) -> None:
    """Refuse a root that is a file, a checkpoint or inside one (a slip for its parent)."""
    found = classify(root, by_name=False)
    if found is Kind.NOT_A_DIRECTORY:
        raise CheckpointError(f"{root}: a file, not a directory of checkpoints")
    if found.checkpoint:
        raise CheckpointError(
            f"{root}: is {found.value}, not a directory of checkpoints; a manager would "
            f"write into it. Did you mean its parent, {root.parent}?"
        )
    parent = classify(root.parent, by_name=False)
    if parent.checkpoint and found in (Kind.MISSING, Kind.EMPTY):
        raise CheckpointError(
            f"{root}: inside {parent.value} ({root.parent}); a manager would write into "
            f"it. Did you mean {root.parent.parent}?"
        )


class RootView:
    """The committed checkpoints of ``root``, minus those found unreadable here."""

    def __init__(self, root: Path) -> None:
        check_root(root)
        self.root = root
        self._bad: set[tuple[int, int]] = set()  # (step, dir inode) found unreadable
        # each step's summary, read again when its marker's stamp changed (saved again)
        self._summaries: dict[int, tuple[tuple[int, int, int], StepInfo]] = {}

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives (whether or not it exists)."""
        return self.root / step_name(step)

    def candidates(self) -> Iterator[tuple[int, Path]]:
        """Every canonical ``step_N`` directory not known to be unreadable."""
        for step, path, inode in step_dirs(self.root):
            if (step, inode) not in self._bad:
                yield step, path

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending (half-written ones never appear)."""
        return list(committed_steps(self.root, exclude=self._bad))

    def latest_step(self) -> int | None:
        """The newest committed step, excluding any this manager found unreadable."""
        return max(self.steps(), default=None)

    def found_unreadable(self, damaged: set[tuple[int, int]]) -> None:
        """Leave these ``(step, directory inode)`` out from now on (found damaged)."""
        self._bad |= damaged

    def forget(self, steps: list[int]) -> None:
        """These steps were deleted or moved: their summaries are stale."""
        for step in steps:
            self._summaries.pop(step, None)

    def info(self, step: int) -> StepInfo:
        """Step, time, metrics, epoch, size and full metadata of one checkpoint."""
        path = self.path(step)
        try:
            marker = stamp(path)
        except FileNotFoundError:
            raise CheckpointNotFound(
                f"{path}: no committed checkpoint for step {step} in {self.root} "
                f"(steps: {self._steps_text()})"
            ) from None
        cached = self._summaries.get(step)
        if cached is None or cached[0] != marker:
            cached = self._summaries[step] = (marker, read_info(path, step))
        return cached[1]

    def _steps_text(self) -> str:
        steps = self.steps()
        shown = ", ".join(map(str, steps[-10:])) or "none"
        return shown if len(steps) <= 10 else f"…, {shown}"

    def infos(self) -> list[StepInfo]:
        """:meth:`info` of every readable committed checkpoint, ascending by step."""
        out = []
        for step in self.steps():
            try:
                out.append(self.info(step))
            except (CheckpointError, OSError):
                continue  # unreadable or just pruned: not a candidate for anything
        return out

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The step ``keep_best(1, metric, mode)`` would keep (ties go to the newer step)."""
        return next(iter(best_steps(self.infos(), metric, mode)), None)

    def branches(self) -> dict[str, list[int]]:
        """Branches left by rollbacks (roots of their own), each with its committed steps."""
        return rollback.branches(self.root)

    def branch_root(self, name: str) -> Path:
        """Where branch ``name`` lives (a root of its own)."""
        return self.root / BRANCHES_DIR / rollback.check_branch_name(name)
