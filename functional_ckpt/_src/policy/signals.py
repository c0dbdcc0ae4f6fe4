"""``on_signal``: save at the next event after a signal, the one impure policy: a
signal is an event of this process, not of the run, never replayed after a restore."""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from functional_ckpt._src.policy.base import Event, LeafPolicy, PolicySpec, PolicyState
from functional_ckpt.errors import CheckpointError


class SignalPolicy(LeafPolicy):
    """Returned by :func:`on_signal`; adds :meth:`trigger` and :meth:`uninstall`."""

    def __init__(self, signum: signal.Signals) -> None:
        self.signum = signum
        self._pending = False
        self._installed = False
        self.previous: Any = None
        _require_main_thread(f"{self!r}")
        try:
            self.previous = signal.signal(signum, self._handle)
        except (OSError, ValueError) as exc:
            raise ValueError(f"on_signal(signum={signum!r}): cannot handle it: {exc}") from exc
        self._installed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # uninstalled but still in a later handler's chain: only pass the signal on
        if self._installed:
            self._pending = True
        previous = self.previous  # SIG_DFL, SIG_IGN, None (set outside Python): not called
        if callable(previous):
            previous(signum, frame)

    def trigger(self) -> None:
        """Act as if the signal had arrived (for tests and for manual preemption)."""
        self._pending = True

    def uninstall(self) -> None:
        """Stop handling the signal and restore the previous handler, unless another was
        installed on top (it may chain to this one, which then passes it on)."""
        if not self._installed:
            return
        _require_main_thread(f"{self!r}.uninstall()")
        if signal.getsignal(self.signum) == self._handle:
            previous = self.previous if self.previous is not None else signal.SIG_DFL
            signal.signal(self.signum, previous)
        self._installed = False
        self._pending = False

    def decide(self, state: PolicyState, event: Event) -> bool:
        # The documented impurity: the vote consumes the process's flag.
        self.fields(state)
        pending, self._pending = self._pending, False
        return pending

    @property
    def spec(self) -> PolicySpec:
        return {"on_signal": {"signum": self.signum.name}}

    def __repr__(self) -> str:
        return f"on_signal(signal.{self.signum.name})"


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise CheckpointError(
            f"{what}: signal handlers can only be installed or removed from the main "
            "thread; create the policy there and pass it to other threads"
        )


def on_signal(signum: int = signal.SIGTERM) -> SignalPolicy:
    """Save at the next event after ``signum`` arrives (e.g. a preemption notice). Its
    handler chains to a previous Python one but never to ``SIG_DFL``, which would kill
    the process before the save the grace period is for."""
    try:
        sig = signal.Signals(signum)
    except ValueError:
        raise ValueError(f"on_signal(signum={signum!r}): not a valid signal number") from None
    return SignalPolicy(sig)
