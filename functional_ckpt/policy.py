"""Save policies: pure, composable decisions about *when* to checkpoint.

A policy is a value made of pure functions, like an optax gradient transformation:
``state = policy.init()``, then per event ``policy.decide(state, event)`` and
``policy.update(state, event, saved)``. The leaf policies most runs need are also
at the top level (``fc.every_steps`` …); here are the rest, the protocol, the
rollback rule ``on_degrade``, :func:`policy_from_config`,
which reads a policy's one plain-data form (``policy.spec``: what a config file holds
and a checkpoint records). See docs/policies.md.
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

__all__ = [
    "Event",
    "PolicySpec",
    "PolicyState",
    "SavePolicy",
    "SignalPolicy",
    "always",
    "at_steps",
    "every_epochs",
    "every_secs",
    "every_steps",
    "never",
    "on_degrade",
    "on_final",
    "on_improve",
    "on_signal",
    "policy_from_config",
    "run_policy",
]
