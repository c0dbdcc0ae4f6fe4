"""The manager of a root of checkpoints, what configures it and what it reports.

:class:`CheckpointManager` (also ``fc.CheckpointManager``) saves on a policy, keeps
on a retention policy and resumes from the newest good checkpoint. :class:`Export`
configures its Hugging Face exports, :class:`Memory`, :class:`Disk` and :class:`Remote`
its tiers and :class:`AsyncSave` its saves off the training thread;
:class:`StepInfo` describes one managed checkpoint; ``maybe_save`` returns a
:class:`SaveResult`, carrying a :class:`Rollback` when a rollback rule fired;
:func:`choose_target` is the step such a rule returns to. :func:`fork` starts a new
run (a new root) from a checkpoint; :func:`remove_checkpoint` deletes one checkpoint
directory so that no crash leaves a readable half of it. See docs/manager.md.
"""

from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.manager.fork import fork
from functional_ckpt._src.manager.manager import CheckpointManager
from functional_ckpt._src.manager.memory import Memory
from functional_ckpt._src.manager.options import AsyncSave, Disk
from functional_ckpt._src.manager.rollback_rule import Rollback, SaveResult, choose_target
from functional_ckpt._src.remote.options import Remote
from functional_ckpt._src.root.delete import remove_checkpoint
from functional_ckpt._src.root.listing import StepInfo

__all__ = [
    "AsyncSave",
    "CheckpointManager",
    "Disk",
    "Export",
    "Memory",
    "Remote",
    "Rollback",
    "SaveResult",
    "StepInfo",
    "choose_target",
    "fork",
    "remove_checkpoint",
]
