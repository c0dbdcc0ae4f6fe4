"""Save policies: pure, composable decisions about *when* to checkpoint.

A policy is a value made of pure functions, like an optax gradient transformation:
``state = policy.init()``, then per event ``policy.decide(state, event)`` and
``policy.update(state, event, saved)``. The leaf policies most runs need are also
at the top level (``fc.every_steps`` …); here are the rest, the protocol, the
rollback rule ``on_degrade``, :func:`policy_from_config` and :func:`policy_to_config`
(a policy as configuration, the form a config file holds) and :func:`policy_from_spec`
(a policy from the record a checkpoint keeps). See docs/policies.md.
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
    policy_from_spec,
    policy_to_config,
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
    "policy_from_spec",
    "policy_to_config",
    "run_policy",
]
