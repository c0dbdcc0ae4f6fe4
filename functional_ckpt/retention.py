"""Retention policies: pure decisions about *which* checkpoints to keep.

A retention policy maps the checkpoints that exist to the set of steps to keep;
``|`` is union. :func:`plan_deletions` adds the two rules no policy overrides: the
newest checkpoint and protected steps are never deleted. :func:`retention_from_config`
and :func:`retention_to_config` read and write a policy as configuration (a list is
the union). See docs/policies.md.
"""

from functional_ckpt._src.policy.config import retention_from_config, retention_to_config
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
    retention_from_spec,
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
    "retention_from_spec",
    "retention_to_config",
]
