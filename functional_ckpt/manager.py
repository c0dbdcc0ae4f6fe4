"""The manager of a root of checkpoints, its options, tiers and reports; :func:`fork` starts a
new run from a checkpoint, :func:`remove_checkpoint` deletes one crash-safely. See
docs/manager.md."""

from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.manager.fork import fork
from functional_ckpt._src.manager.manager import CheckpointManager
from functional_ckpt._src.manager.memory import Memory
from functional_ckpt._src.manager.options import AsyncSave, Disk
from functional_ckpt._src.manager.rollback_rule import Rollback, SaveResult, choose_target
from functional_ckpt._src.remote.options import Remote
from functional_ckpt._src.root.delete import remove_checkpoint
from functional_ckpt._src.root.listing import StepInfo

__all__ = ["AsyncSave", "CheckpointManager", "Disk", "Export", "Memory", "Remote", "Rollback"]
__all__ += ["SaveResult", "StepInfo", "choose_target", "fork", "remove_checkpoint"]
