"""Save policies: pure, composable decisions about *when* to checkpoint.

A policy is a value made of pure functions, like an optax gradient transformation.
The object holds only configuration; everything that changes over a run lives in an
explicit ``PolicyState`` that the caller threads through::

    state = policy.init()
    for event in events:
        save = policy.decide(state, event)        # the vote, from (state, event) only
        state = policy.update(state, event, save)  # what happened: did a save occur?

``should_save(state, event) -> (save, new_state)`` is the two composed, for a policy
that decides alone. The split is what makes combinators exact: ``p | q`` first
combines the children's votes, then advances *every* leaf from the event and the
combined outcome, so ``on_improve`` compares with the best value actually saved,
``every_secs`` counts from the last actual save, and ``~(p | q)`` and ``~p & ~q``
move every leaf through the very same states.

Time comes in through the event (``Event(step, time=running_seconds)``); no policy
reads a clock, so equal inputs give equal decisions and a restart is exact. The
state is plain data (it goes through msgpack unchanged) and every policy has a
plain-data :attr:`~SavePolicy.spec`, its configuration form, that
:func:`policy_from_config` rebuilds it from:
a stored state is only ever handed back to the policy of the same spec.

The one deliberate exception to purity is :func:`on_signal`, whose "a signal
arrived" flag is process state: a signal is an event of this process, not of the
run, and must not be replayed after a restore.
"""

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
