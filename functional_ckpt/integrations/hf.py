"""Hugging Face ``Trainer`` checkpoints in this format (nothing pickled), resumed through
``train()`` itself with only its loading steps replaced, so the resumed run is
bit-identical. A stock ``checkpoint-N`` is read by its own loaders, which unpickle
nothing; one lacking a file needed to go on exactly is refused. Single process only."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.restore.api import restore
from functional_ckpt._src.root.delete import remove_checkpoint
from functional_ckpt._src.save.api import save
from functional_ckpt._src.state.capture import apply_rng, capture
from functional_ckpt._src.state.tree import to_python
from functional_ckpt.errors import CheckpointError, CheckpointNotFound

if TYPE_CHECKING:
    _Base = Trainer
else:
    _Base = object

__all__ = ["FunctionalTrainer", "FunctionalTrainerMixin"]
__all__ += ["is_stock_checkpoint", "load_trainer_checkpoint"]

#: What the stock ``Trainer`` writes into a ``checkpoint-N`` that a run goes on from.
_STOCK_STATE = "trainer_state.json"
_STOCK_WEIGHTS = tuple(
    n + s for n in ("model.safetensors", "pytorch_model.bin") for s in ("", ".index.json")
)
_STOCK_RESUME = ("optimizer.pt", "scheduler.pt", "rng_state.pth")


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_stock_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a ``checkpoint-N`` of the stock ``Trainer``: it holds the
    ``trainer_state.json`` the stock Trainer always writes, which this format never does."""
    path = Path(path)
    return classify(path) in (Kind.EXPORT, Kind.OTHER) and _regular(path / _STOCK_STATE)


def _check_stock(path: Path) -> None:
    """Refuse a stock checkpoint that lacks a file the run needs to go on exactly."""
    missing = [] if any(_regular(path / n) for n in _STOCK_WEIGHTS) else [_STOCK_WEIGHTS[0]]
    missing += [n for n in _STOCK_RESUME if not _regular(path / n)]
    if missing:
        raise CheckpointError(
            f"{path}: a checkpoint of the stock transformers Trainer (it has {_STOCK_STATE}) "
            f"without {', '.join(missing)}, so training cannot go on from it as it would have "
            "(saved with save_only_model=True, or by several processes?); load its weights with "
            "from_pretrained and start a new run, or continue from a checkpoint that has them"
        )


def load_trainer_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``checkpoint-N`` directory as plain data: model, trainer_state, optimizer, ..."""
    if is_stock_checkpoint(path):
        raise CheckpointError(
            f"{path}: a checkpoint of the stock transformers Trainer, not of this format; "
            "continue from it with FunctionalTrainer.train(resume_from_checkpoint=...), or "
            "load its weights with from_pretrained"
        )
    loaded = to_python(restore(Path(path)))
    missing = [k for k in ("model", "trainer_state") if k not in loaded]
    if missing:
        raise CheckpointError(
            f"{path}: not a Trainer checkpoint of FunctionalTrainerMixin (no {missing}); "
            "pass a checkpoint-N directory it wrote"
        )
    return dict(loaded)


def _checkpoints(run_dir: Path) -> list[Path]:
    """The ``checkpoint-N`` directories of ``run_dir``, by step (saves commit atomically)."""
    found: list[tuple[int, Path]] = []
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    with contextlib.suppress(FileNotFoundError):
        for p in run_dir.iterdir():
            step = p.name.removeprefix(prefix)
            if p.name.startswith(prefix) and step.isdigit() and p.is_dir():
                found.append((int(step), p))
    return [p for _, p in sorted(found)]


class FunctionalTrainerMixin(_Base):
    """Mix in before ``Trainer`` or a subclass: ``class T(FunctionalTrainerMixin, Trainer)``."""

    _fc_resume: dict[str, Any] | None = None
    _fc_stock = False  # resuming from a stock checkpoint: the Trainer's own loaders read it

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._fc_check_supported()
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = Path(self._get_output_dir(trial=trial))
        path = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        best = self.state.best_global_step
        if best:
            best_dir = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{best}"
            if best_dir.exists():
                self.state.best_model_checkpoint = str(best_dir)
        stateful: Any = self.state.stateful_callbacks  # filled by the Trainer: a dict
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if isinstance(stateful.get(name), list):
                    stateful[name].append(cb.state())
                else:
                    stateful[name] = cb.state()
        extra: dict[str, Any] = {"trainer_state": dataclasses.asdict(self.state)}
        if self.args.save_only_model:  # as the Trainer's own: weights to load, not to resume
            state = capture(model=self.model, rng=False, **extra)
        else:
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                extra["scaler"] = scaler
            state = capture(
                model=self.model, optimizer=self.optimizer, scheduler=self.lr_scheduler, **extra
            )
        if self.args.should_save:
            save(path, state, overwrite=True)
            self._fc_rotate(run_dir)

    def _fc_rotate(self, run_dir: Path) -> None:
        """``save_total_limit`` as the Trainer reads it, deleting crash-safely."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        # only the checkpoints written here count: a stock one is not this format's
        paths = [p for p in _checkpoints(run_dir) if not is_stock_checkpoint(p)]
        if len(paths) <= limit:
            return
        protected = {paths[-1]}
        if self.state.best_model_checkpoint is not None:
            protected.add(Path(self.state.best_model_checkpoint))
        remaining = len(paths)
        for p in paths:
            if remaining <= max(limit, len(protected)):
                break
            if p not in protected:
                remove_checkpoint(p, missing_ok=True)
                remaining -= 1

    def _fc_check_supported(self) -> None:
        if topology().distributed or self.args.world_size > 1:
            raise CheckpointError(
                "FunctionalTrainerMixin saves from one process; multi-process training is not "
                "supported (save with fc.save on every rank instead)"
            )
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise CheckpointError(
                "FunctionalTrainerMixin does not support DeepSpeed or FSDP; drop the mixin "
                "for those runs"
            )

    def train(
        self,
        resume_from_checkpoint: str | os.PathLike[str] | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train`` from a checkpoint of this format (``True``: the newest of
        ``output_dir``); the state JSON the Trainer reads goes to a temporary
        directory, never beside the checkpoint."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return super().train(None, trial, ignore_keys_for_eval, **kwargs)
        if resume_from_checkpoint is True:
            found = _checkpoints(Path(self.args.output_dir or "."))
            if not found:
                raise CheckpointNotFound(
                    f"{self.args.output_dir}: no checkpoint-N directory to resume from"
                )
            resume_from_checkpoint = found[-1]
        self._fc_check_supported()
        if is_stock_checkpoint(resume_from_checkpoint):
            _check_stock(Path(resume_from_checkpoint))
            self._fc_stock = True
            try:
                return super().train(
                    os.fspath(resume_from_checkpoint), trial, ignore_keys_for_eval, **kwargs
                )
            finally:
                self._fc_stock = False
        loaded = load_trainer_checkpoint(resume_from_checkpoint)
        missing = [k for k in ("optimizer", "scheduler", "rng") if k not in loaded]
        if missing:
            raise CheckpointError(
                f"{resume_from_checkpoint}: holds no {missing} (saved with save_only_model=True?); "
                "it has the weights to load, not the state to resume training from"
            )
        self._fc_resume = loaded
        try:
            with tempfile.TemporaryDirectory(prefix="fc-trainer-state-") as tmp:
                Path(tmp, "trainer_state.json").write_text(
                    json.dumps(self._fc_resume["trainer_state"], indent=2, sort_keys=True)
                )
                return super().train(tmp, trial, ignore_keys_for_eval, **kwargs)
        finally:
            self._fc_resume = None

    def _fc_loaded(self) -> dict[str, Any]:
        if self._fc_resume is None:
            raise CheckpointError(
                "FunctionalTrainerMixin: the Trainer asked to load a checkpoint outside "
                "train(resume_from_checkpoint=...)"
            )
        return self._fc_resume

    def _load_best_model(self) -> None:
        # The Trainer's own would find no weight file, warn, and keep the last weights.
        best = self.state.best_model_checkpoint
        if best is None:
            return
        if is_stock_checkpoint(best):
            super()._load_best_model()
            return
        model: Any = self.model
        model.load_state_dict(load_trainer_checkpoint(best)["model"])

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._fc_stock:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        target: Any = self.model if model is None else model
        target.load_state_dict(self._fc_loaded()["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self._fc_stock:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        objects: Any = {"optimizer": self.optimizer, "scheduler": self.lr_scheduler}
        for name, obj in objects.items():
            obj.load_state_dict(self._fc_loaded()[name])

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._fc_stock:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if checkpoint is not None and scaler is not None and "scaler" in self._fc_loaded():
            scaler.load_state_dict(self._fc_loaded()["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        # Called by the Trainer after it has skipped the trained batches: from here
        # on, every draw is the one the uninterrupted run made.
        if checkpoint is None or self._fc_stock:
            super()._load_rng_state(checkpoint)
            return
        rng = self._fc_loaded()["rng"]
        if "cuda" in rng and not torch.cuda.is_available():
            rng = {k: v for k, v in rng.items() if k != "cuda"}
        apply_rng(rng)


class FunctionalTrainer(FunctionalTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`FunctionalTrainerMixin`: a drop-in replacement."""
