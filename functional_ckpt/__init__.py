"""functional_ckpt: functional, atomic, pickle-free checkpoints for PyTorch training state."""

from functional_ckpt._version import __version__
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    ModifiedDuringSave,
    TemplateMismatch,
    UnsafeCheckpoint,
    UnsupportedValue,
)
from functional_ckpt.io import (
    CheckpointInfo,
    CheckpointSummary,
    Problem,
    TensorSpec,
    VerifyReport,
    inspect,
    restore,
    save,
    verify,
)
from functional_ckpt.staging import PendingSave, Stager, save_async
from functional_ckpt.state import apply, capture
from functional_ckpt.tree import from_python, to_python

__all__ = [
    "CheckpointError",
    "CheckpointExists",
    "CheckpointInfo",
    "CheckpointNotFound",
    "CheckpointSummary",
    "CorruptCheckpoint",
    "IncompleteCheckpoint",
    "ModifiedDuringSave",
    "PendingSave",
    "Problem",
    "Stager",
    "TemplateMismatch",
    "TensorSpec",
    "UnsafeCheckpoint",
    "UnsupportedValue",
    "VerifyReport",
    "__version__",
    "apply",
    "capture",
    "from_python",
    "inspect",
    "restore",
    "save",
    "save_async",
    "to_python",
    "verify",
]
