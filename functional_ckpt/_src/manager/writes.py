"""A manager's writes: one save in flight, its buffers and trust, exports, removals.

It decides nothing: the manager says what to write and when.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from functional_ckpt._src.export.exports import BackgroundExport, run_export, snapshot
from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.format.naming import parse_step
from functional_ckpt._src.manager.collective import gathered
from functional_ckpt._src.manager.options import AsyncSave
from functional_ckpt._src.policy.base import Event
from functional_ckpt._src.remote.tier import RemoteTier
from functional_ckpt._src.root.delete import remove_all
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.api import run_save, start_save
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.options import SaveOptions
from functional_ckpt._src.save.staging import PendingSave, Stager
from functional_ckpt._src.save.trust import TrustMemory
from functional_ckpt._src.state.tree import State


@dataclass(frozen=True)
class WriteSettings:
    """How a manager writes (``durable``: survives a power loss, as RAM's need not)."""

    per_rank: tuple[str, ...]
    async_save: AsyncSave | None
    incremental: bool
    distributed: bool
    coordinator: bool
    durable: bool = True
    parts: bool = False
    group: str | None = None  # None: the loop's ("control"), or an async save's thread's
    zstd_level: int = 0  # tensors stored as zstd frames of this level (0: raw)


class Writes:
    def __init__(self, view: RootView, settings: WriteSettings, remote: RemoteTier | None) -> None:
        self.view = view
        self.settings = settings
        self.remote = remote
        self.pending: PendingSave | None = None
        self.stager = Stager()
        self.trust = TrustMemory()
        self.exports = BackgroundExport()
        self._removal: threading.Thread | None = None

    def save(self, path: Path, state: State, metadata: Mapping[str, Any]) -> CheckpointInfo | None:
        """The one place a checkpoint is written; None while an async save runs."""
        options = SaveOptions(
            metadata=metadata,
            overwrite=path.exists(),
            per_rank=self.settings.per_rank,
            base=self._base_for(path) if self.settings.incremental else None,
            base_required=False,  # the previous checkpoint may have been moved aside
            trust=self.trust,
            parts=self.settings.parts or (self.remote is not None and self.remote.parts),
            durable=self.settings.durable,
            group=self.settings.group or ("save" if self.settings.async_save else "control"),
            zstd_level=self.settings.zstd_level,
        )
        remote = self.remote
        held = remote is not None  # uploads stand still while the state is staged
        if remote is not None:
            remote.store.pause_uploads()
        try:
            mode = self.settings.async_save
            if mode is not None:
                # A write that must not outgrow its RAM waits for the pruning before it.
                ready = None if self.settings.durable else self.removed
                self.pending = start_save(
                    path, state, options, mode.staging, self.stager, before_write=ready
                )
                if remote is not None:
                    self.pending.when_staged(remote.store.resume_uploads)
                    held = False
                return None
            return run_save(path, state, options)
        finally:
            if held and remote is not None:
                remote.store.resume_uploads()

    def _base_for(self, path: Path) -> Path | None:
        """The base of an incremental save: the newest other committed checkpoint."""
        others = [s for s in self.view.steps() if self.view.path(s) != path]
        return self.view.path(max(others)) if others else None

    def wait(self) -> CheckpointInfo | None:
        """The save in flight, committed; interrupted, it stays in flight (not finished)."""
        pending = self.pending
        if pending is None:
            return None
        try:
            return pending.result()
        finally:
            if pending.done():
                self.pending = None

    def wait_staged(self) -> None:
        """Until the state may be mutated again (with ``staging="none"``: committed)."""
        if self.pending is None:
            return
        mode = self.settings.async_save
        if mode is not None and mode.staging == "none":
            self.pending.result()
        else:
            self.pending.wait_staged()

    def finished(self) -> bool:
        """Whether the save in flight is done (its outcome not collected yet)."""
        return self.pending is not None and self.pending.done()

    def busy_steps(self) -> set[int]:
        """Steps retention must not delete now: a save or an export is using them."""
        saving = None if self.pending is None else parse_step(self.pending.path.name)
        return {s for s in (saving, self.exports.step) if s is not None}

    def export(self, state: State, export: Export, event: Event) -> Path | None:
        """Write the export of ``event`` now, on this thread."""
        if self.settings.distributed:
            state = gathered(state, export.select)
            if not self.settings.coordinator:
                return None
        return run_export(state, self.view.root, export, event.step, event.metrics or {})

    def export_in_background(self, state: State, export: Export, event: Event, saved: bool) -> None:
        """Export from the committed checkpoint of this step, or from a copy taken now."""
        self.exports.join()  # one export in flight; a failed one surfaces here
        pending = self.pending if saved else None
        source: State | Path = self.view.path(event.step) if saved else snapshot(state, export)
        failure = None if pending is None else pending.exception
        self.exports.start(source, self.view.root, export, event.step, event.metrics or {}, failure)

    def remove(self, trash: list[Path]) -> None:
        """Remove checkpoints already out of sight; off the training thread when saves are."""
        if self.settings.async_save is not None and trash:
            # close() waits for it; what a crash leaves, the next writer removes at open.
            self.removed()
            self._removal = threading.Thread(
                target=remove_all, args=(trash,), name="fc-prune", daemon=True
            )
            self._removal.start()
        else:
            remove_all(trash)

    def removed(self) -> None:
        """Until the removal in flight is done (from any thread)."""
        removal = self._removal
        if removal is not None:
            removal.join()
