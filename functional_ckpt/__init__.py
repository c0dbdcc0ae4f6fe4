"""functional_ckpt: functional, atomic, pickle-free checkpoints for PyTorch training state.

The top level is the whole everyday API: capture and apply live objects, save and
restore states, the save and retention policies, the manager. Everything else
(the error classes, policy internals, staging, reports) lives in the submodule
that owns it: ``fc.errors``, ``fc.policy``, ``fc.retention``, ``fc.staging``,
``fc.export``, ``fc.io``, ``fc.manager``, ``fc.tree``, ``fc.recording``.
"""

from functional_ckpt import checkpoint as checkpoint
from functional_ckpt import codec as codec
from functional_ckpt import policy as policy
from functional_ckpt import retention as retention
from functional_ckpt import tree as tree
from functional_ckpt._src.policy import (
    at_steps,
    every_epochs,
    every_secs,
    every_steps,
    on_final,
    on_improve,
    on_signal,
)
from functional_ckpt._src.policy.retention import keep_best, keep_every, keep_last, keep_within
from functional_ckpt._src.restore.api import restore
from functional_ckpt._src.restore.inspect import inspect
from functional_ckpt._src.save.api import save, save_async
from functional_ckpt._src.state.capture import apply, capture
from functional_ckpt._src.state.tree import to_python
from functional_ckpt._src.storage.verify import verify
from functional_ckpt._src.version import __version__
from functional_ckpt.errors import CheckpointError
from functional_ckpt.export import export_safetensors
from functional_ckpt.forking import fork
from functional_ckpt.manager import CheckpointManager
from functional_ckpt.recording import Recorder, Replay

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "Recorder",
    "Replay",
    "__version__",
    "apply",
    "at_steps",
    "capture",
    "every_epochs",
    "every_secs",
    "every_steps",
    "export_safetensors",
    "fork",
    "inspect",
    "keep_best",
    "keep_every",
    "keep_last",
    "keep_within",
    "on_final",
    "on_improve",
    "on_signal",
    "restore",
    "save",
    "save_async",
    "to_python",
    "verify",
]
