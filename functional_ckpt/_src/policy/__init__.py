"""Save policies: pure, composable decisions about *when* to checkpoint.

A policy holds only configuration; what changes over a run lives in an explicit
``PolicyState`` the caller threads through::

    state = policy.init()
    for event in events:
        save = policy.decide(state, event)        # the vote, from (state, event) only
        state = policy.update(state, event, save)  # what happened: did a save occur?

The split makes combinators exact: ``p | q`` combines the votes, then advances
*every* leaf from the combined outcome. Time comes in through the event, so equal
inputs give equal decisions and a restart is exact. The one impure policy is
:func:`on_signal`: a signal is an event of this process, not of the run."""

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
