"""Policies: pure, composable decisions about *when* to save and *which* checkpoints to keep.

A save policy is a value made of pure functions, like an optax gradient
transformation: ``state = policy.init()``, then per event ``policy.decide(state,
event)`` and ``policy.update(state, event, saved)``; :func:`run_policy` feeds it a list
of events. A retention policy maps the checkpoints that exist to the steps to keep
(``|`` is union); :func:`plan_deletions` adds the two rules no policy overrides: the
newest checkpoint and protected steps are never deleted. The leaf policies most runs
need are also at the top level (``fc.every_steps``, ``fc.keep_last`` …); here are the
rest, the protocols, the rollback rule ``on_degrade``, and :func:`policy_from_config`
and :func:`retention_from_config`, which read a policy's one plain-data form
(``policy.spec``: what a config file holds and a checkpoint records). See
docs/policies.md.
"""

from functional_ckpt._src.policy import (
    Event,
    PolicySpec,
    PolicyState,
    SavePolicy,
    SignalPolicy,
    always,
    at_steps,
    every_epochs,
    every_secs,
    every_steps,
    never,
    on_degrade,
    on_final,
    on_improve,
    on_signal,
    policy_from_config,
    run_policy,
)
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

__all__ = ["CheckpointLike", "CheckpointRecord", "Event", "PolicySpec", "PolicyState"]
__all__ += ["RetentionPolicy", "SavePolicy", "SignalPolicy", "always", "at_steps", "best_steps"]
__all__ += ["every_epochs", "every_secs", "every_steps", "keep_all", "keep_best", "keep_every"]
__all__ += ["keep_last", "keep_within", "never", "on_degrade", "on_final", "on_improve"]
__all__ += ["on_signal", "plan_deletions", "policy_from_config", "retention_from_config"]
__all__ += ["run_policy"]
