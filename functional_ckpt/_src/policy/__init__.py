"""Save policies: pure, composable decisions about *when* to checkpoint. A policy holds
configuration only; the caller threads its ``PolicyState`` through ``decide`` (the
vote) and ``update`` (did a save occur?), so ``p | q`` combines votes and then advances
every leaf from the outcome, and a restart is exact. Only :func:`on_signal` is impure."""
