"""One exception hierarchy, so callers can catch every checkpoint failure at once.

Each subclass answers a different question a user asks after a failure: is there
anything at that path, was it finished, is it damaged, does it fit my state, or is
it hostile. Messages always name the offending path, file or key.
"""

import errno as _errno


class CheckpointError(Exception):
    """Base class of every error raised by functional_ckpt."""


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """Nothing that looks like a checkpoint exists at the given path."""


class CheckpointExists(CheckpointError, FileExistsError):
    """The destination already holds a checkpoint and ``overwrite`` was not set."""


class IncompleteCheckpoint(CheckpointError):
    """A directory exists but was never committed (a crash or a save in progress)."""


class CorruptCheckpoint(CheckpointError):
    """A committed checkpoint whose bytes do not match what its manifest recorded."""


class TemplateMismatch(CheckpointError):
    """The saved tree does not fit the template given to ``restore``."""


class UnsafeCheckpoint(CheckpointError):
    """The checkpoint tries something a loader must never do (code, path escape, bombs)."""


class UnregisteredType(CheckpointError):
    """A restored value is of a class this process has not registered (``fc.codec.register``):
    not damage, nothing is imported from a checkpoint, so the reader must register the class."""


class UnsupportedValue(CheckpointError, TypeError):
    """A leaf of the state has a type the exact codec cannot store."""


class ModifiedDuringSave(CheckpointError):
    """A tensor was changed in place while an unstaged save was reading it."""


class RemoteError(CheckpointError):
    """The remote tier (an fsspec object store) failed; the message names the URL."""


class RemoteUnreachable(RemoteError, ConnectionError):
    """The object store's endpoint did not answer (wrong URL, network down, timeout)."""


class RemoteAccessDenied(RemoteError, PermissionError):
    """The object store refused the credentials, or they lack a permission."""


class RemoteBucketMissing(RemoteError, FileNotFoundError):
    """The bucket (or container) named by the remote URL does not exist."""


class RemoteVanished(RemoteError):
    """A remote checkpoint was deleted (or replaced) while it was being read."""


class UploadFailed(RemoteError):
    """A background upload failed after its retries; the local checkpoint is intact."""


class PolicyError(CheckpointError, ValueError):
    """A save policy was given a state, event or spec it cannot use."""


class ConfigError(CheckpointError, ValueError):
    """Configuration (plain data) that describes no manager or policy; names the key path."""


class NotARecording(CheckpointError):
    """The path given as a recording is not one (missing, a checkpoint, anything else)."""


class NotRecorded(CheckpointError, LookupError):
    """A replay was asked for a step that the recording does not hold."""


class RankFailed(CheckpointError):
    """Other ranks failed a step every rank must pass (a failing rank raises its own error);
    ``failures`` (rank: error type, message) lets a healthy rank report them all."""

    def __init__(self, what: str, failures: dict[int, tuple[str, str]]) -> None:
        self.what = what
        self.failures = dict(sorted(failures.items()))
        told = "; ".join(
            f"rank {r} failed: {kind}: {msg}" for r, (kind, msg) in self.failures.items()
        )
        super().__init__(f"{what}: {told}; nothing was committed")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.what, self.failures))


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or a stored policy state was discarded."""


class LeftoverWarning(CheckpointWarning):
    """A committed leftover of a crash was recovered, or kept because its name is taken."""


class RemoteWarning(CheckpointWarning):
    """A background upload failed (the local checkpoint is intact; training goes on)."""


class MemoryTierWarning(CheckpointWarning):
    """A memory-tier save, read or promotion failed (the disk tier is intact; training goes on)."""


#: What a checkpoint's own bytes can raise: only these say it is damaged (and only damage
#: moves a checkpoint aside; a bad template or argument is the caller's error).
DAMAGE: tuple[type[CheckpointError], ...] = (
    CorruptCheckpoint,
    UnsafeCheckpoint,
    IncompleteCheckpoint,
    CheckpointNotFound,
)


_RESOURCES = frozenset({_errno.EMFILE, _errno.ENFILE, _errno.ENOMEM, _errno.ENOSPC})


def is_damage(err: BaseException) -> bool:
    """Is ``err`` about the checkpoint (skip it) rather than the caller (raise it)?
    A bad template or argument says nothing about the checkpoint; an I/O error does."""
    if isinstance(err, CheckpointError):
        return isinstance(err, DAMAGE)
    # the machine running out (descriptors, memory, disk) says nothing of the checkpoint
    return isinstance(err, OSError) and err.errno not in _RESOURCES


__all__ = [name for name in dir() if not name.startswith("_")]
