"""Policies: pure, composable decisions about *when* to save and *which* checkpoints to
keep, and the readers of their plain-data form (``policy.spec``). See docs/policies.md."""

from functional_ckpt._src.policy.base import Event, PolicySpec, PolicyState, SavePolicy, run_policy
from functional_ckpt._src.policy.config import policy_from_config, retention_from_config
from functional_ckpt._src.policy.degrade import on_degrade
from functional_ckpt._src.policy.leaves import (
    always,
    at_steps,
    every_epochs,
    every_secs,
    every_steps,
    never,
    on_final,
    on_improve,
)
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
from functional_ckpt._src.policy.signals import SignalPolicy, on_signal

__all__ = ["CheckpointLike", "CheckpointRecord", "Event", "PolicySpec", "PolicyState"]
__all__ += ["RetentionPolicy", "SavePolicy", "SignalPolicy", "always", "at_steps", "best_steps"]
__all__ += ["every_epochs", "every_secs", "every_steps", "keep_all", "keep_best", "keep_every"]
__all__ += ["keep_last", "keep_within", "never", "on_degrade", "on_final", "on_improve"]
__all__ += ["on_signal", "plan_deletions", "policy_from_config", "retention_from_config"]
__all__ += ["run_policy"]
