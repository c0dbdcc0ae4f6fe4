"""Save policies: pure, composable decisions about *when* to checkpoint. A policy holds
configuration only; the caller threads its ``PolicyState`` through ``decide`` (the
vote) and ``update`` (did a save occur?), so ``p | q`` combines votes and then advances
every leaf from the outcome, and a restart is exact. Only :func:`on_signal` is impure."""

from __future__ import annotations

from functional_ckpt._src.policy.base import (
    Event,
    PolicySpec,
    PolicyState,
    SavePolicy,
    run_policy,
)
from functional_ckpt._src.policy.config import policy_from_config
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
from functional_ckpt._src.policy.signals import SignalPolicy, on_signal

__all__ = ["Event", "PolicySpec", "PolicyState", "SavePolicy", "SignalPolicy", "always"]
__all__ += ["at_steps", "every_epochs", "every_secs", "every_steps", "never", "on_degrade"]
__all__ += ["on_final", "on_improve", "on_signal", "policy_from_config", "run_policy"]
