"""A root's exports: where they live, what they record, their retention, their snapshots.
Each records its step and metrics in its safetensors header, so ``Export.keep`` chooses
among exports with no file beside those ``transformers`` reads; one made off the training
thread reads the committed checkpoint or a :func:`snapshot`, never the live tensors."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.codec import documents
from functional_ckpt._src.export.files import header_metadata
from functional_ckpt._src.format.header import metrics_of, save_time
from functional_ckpt._src.format.naming import EXPORTS_DIR, step_name
from functional_ckpt._src.policy.retention import plan_deletions
from functional_ckpt._src.root.listing import step_dirs
from functional_ckpt._src.storage.usage import dir_size
from functional_ckpt.errors import CheckpointError

if TYPE_CHECKING:
    import torch
    from tensordict import TensorDictBase

    from functional_ckpt._src.export.safetensors import Export

__all__ = ["HEADER_KEY", "BackgroundExport", "ExportInfo", "export_infos", "export_path"]
__all__ += ["prune_exports", "run_export", "snapshot"]

#: Key of the safetensors header metadata holding the manager's record of an export.
HEADER_KEY = "functional_ckpt"


def export_path(root: Path, step: int) -> Path:
    return root / EXPORTS_DIR / step_name(step)


@dataclass(frozen=True)
class ExportInfo:
    """One export as its retention and ``fckpt ls`` see it (``time``: recorded, else mtime)."""

    step: int
    path: Path
    time: float
    metrics: Mapping[str, float] = field(default_factory=dict, hash=False)
    size: int = 0
    files: tuple[str, ...] = ()


def header(step: int, metrics: Mapping[str, float], now: float) -> dict[str, str]:
    """What an export records of itself (safetensors metadata values are strings)."""
    record = {"step": step, "time": now, "metrics": {k: repr(v) for k, v in metrics.items()}}
    return {HEADER_KEY: json.dumps(record, sort_keys=True)}


def _recorded(path: Path) -> tuple[float | None, dict[str, float]]:
    """(time, metrics) an export recorded; (None, {}) when it recorded nothing usable."""
    try:
        record = documents.load(header_metadata(path).get(HEADER_KEY, "{}"), str(path))
    except (CheckpointError, OSError, ValueError, RuntimeError):
        return None, {}
    if not isinstance(record, dict):
        return None, {}
    raw = record.get("metrics")
    texts = raw.items() if isinstance(raw, dict) else ()
    return save_time(record.get("time")), metrics_of({k: _number(v) for k, v in texts})


def _number(text: object) -> object:
    """A metric as :func:`header` writes it (its ``repr``), parsed; else left as it is."""
    if isinstance(text, str):
        with contextlib.suppress(ValueError):
            return float(text)
    return text


def export_infos(root: Path) -> list[ExportInfo]:
    """Every ``root/exports/step_N`` directory, ascending by step."""
    out = []
    for step, path, _ in sorted(step_dirs(root / EXPORTS_DIR)):
        try:
            files = tuple(sorted(os.listdir(path)))
            mtime = os.stat(path).st_mtime
        except OSError:
            continue  # deleted meanwhile
        when, metrics = _recorded(path)
        out.append(
            ExportInfo(step, path, mtime if when is None else when, metrics, dir_size(path), files)
        )
    return out


def prune_exports(root: Path, export: Export) -> list[int]:
    """Delete the exports ``export.keep`` does not keep (never the newest one)."""
    from functional_ckpt._src.root.delete import delete, remove_all

    infos = export_infos(root)
    doomed = plan_deletions(export.keep, infos)
    if doomed:
        by_step = {e.step: e.path for e in infos}
        remove_all(delete(root / EXPORTS_DIR, [by_step[s] for s in doomed]))
    return doomed


def snapshot(state: TensorDictBase | Mapping[str, Any], export: Export) -> dict[str, Any]:
    """A copy of the tensors ``export`` selects, as a state that ``select`` still finds (a
    selected tensor under its own name); tied weights stay tied (one copy per view)."""
    from functional_ckpt._src.export import safetensors as st
    from functional_ckpt._src.state.tree import as_state

    path = st._select_path(export.select)
    try:
        tensors = st._collect(as_state(state), path)  # the walk the export makes
    except CheckpointError:
        return dict(as_state(state).items())  # let the export report what is missing
    copies: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = st.view_key(t)
        if key not in copies:
            copies[key] = t.detach().clone()
        return copies[key]

    inner = {name: copy(t) for name, t in tensors.items()}  # dotted names as single keys
    return functools.reduce(lambda value, key: {key: value}, reversed(path), inner)


def run_export(
    source: TensorDictBase | Mapping[str, Any] | Path,
    root: Path,
    export: Export,
    step: int,
    metrics: Mapping[str, float],
) -> Path:
    """Write the export of ``step`` from ``source`` (replacing one of the same step), prune."""
    from functional_ckpt._src.export.safetensors import export_safetensors

    fields = ("select", "dtype", "max_shard_size", "config", "extra_files", "strip_prefix")
    options = {f: getattr(export, f) for f in (*fields, "rename")}
    stamp = header(step, metrics, time.time())
    out = export_safetensors(
        source, export_path(root, step), overwrite=True, header=stamp, **options
    )
    prune_exports(root, export)
    return out


class BackgroundExport:
    """At most one export off the training thread; a failure surfaces at the next :meth:`join`.
    ``step``, the export in flight's, names a checkpoint retention must not delete."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.step: int | None = None

    def start(
        self,
        source: TensorDictBase | Mapping[str, Any] | Path,
        root: Path,
        export: Export,
        step: int,
        metrics: Mapping[str, float],
        save_failure: Callable[[], BaseException | None] | None = None,
    ) -> None:
        """Export ``source``: a snapshot, or the checkpoint a save in flight commits
        (``save_failure``, its error once done: when it failed, nothing is read)."""
        self.join()
        self.step = step

        def work() -> None:
            try:
                if save_failure is not None and save_failure() is not None:
                    return
                run_export(source, root, export, step, metrics)
            except BaseException as e:  # surfaced at the next call, never only logged
                self._error = e

        self._thread = threading.Thread(target=work, name="fc-export", daemon=True)
        self._thread.start()

    def finished(self) -> bool:
        """Whether an export was started and has ended (so :meth:`join` will not block)."""
        return self._thread is not None and not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the export in flight; raise its error, once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.step = None
        error, self._error = self._error, None
        if error is not None:
            raise error
