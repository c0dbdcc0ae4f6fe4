"""Retention policies: pure decisions about *which* checkpoints to keep.

A retention policy maps the checkpoints that exist to the set of steps to keep;
``|`` is union. :func:`plan_deletions` adds the two rules no policy overrides: the
newest checkpoint and protected steps are never deleted. :func:`retention_from_config`
reads a policy's one plain-data form, ``policy.spec`` (a list is the union). See
docs/policies.md.
"""

from functional_ckpt._src.policy.config import retention_from_config
from functional_ckpt._src.policy.retention import (
    CheckpointLike,
    CheckpointRecord,
    RetentionPolicy,
    best_steps,
    keep_all,
    keep_best,
    keep_every,
    keep_last,
    keep_within,
    plan_deletions,
)

__all__ = [
    "CheckpointLike",
    "CheckpointRecord",
    "RetentionPolicy",
    "best_steps",
    "keep_all",
    "keep_best",
    "keep_every",
    "keep_last",
    "keep_within",
    "plan_deletions",
    "retention_from_config",
]
