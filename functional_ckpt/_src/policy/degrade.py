"""``on_degrade``: a rollback rule (a policy, so it composes and its state is stored)
that fires when a metric fell too far below its best *saved* value, for long enough."""

from __future__ import annotations

import math

from functional_ckpt._src.policy.base import (
    Event,
    LeafPolicy,
    PolicyState,
    SavePolicy,
    better,
    finite_number,
    metric_and_mode,
    metric_value,
    positive_int,
)

#: Which kept checkpoint a rollback returns to (see :func:`on_degrade`).
TARGETS = ("best", "last_good")


class OnDegrade(LeafPolicy):
    """See :func:`on_degrade`; the attributes are its arguments."""

    kind, params = "on_degrade", ("metric", "mode", "drop", "patience", "to")
    defaults = (("mode", "min"), ("to", "best"))
    initial = (("best", None), ("bad", 0))
    metric: str
    mode: str
    drop: float
    patience: int
    to: str

    def _fields(self, state: PolicyState) -> tuple[float | None, int]:
        fields = self.fields(state)
        best, bad = fields["best"], fields["bad"]
        return (None if best is None else float(best)), int(bad)

    def degraded(self, value: float, best: float | None) -> bool:
        """Worse than ``best`` by more than ``drop`` of its magnitude (NaN always is)."""
        if math.isnan(value):
            return True
        return best is not None and better(best, value, self.mode, self.drop * abs(best))

    def decide(self, state: PolicyState, event: Event) -> bool:
        best, bad = self._fields(state)
        value = metric_value(event, self.metric, nan=True)
        return value is not None and self.degraded(value, best) and bad + 1 >= self.patience

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        best, bad = self._fields(state)
        value = metric_value(event, self.metric, nan=True)
        if value is None:
            return state
        bad = bad + 1 if self.degraded(value, best) else 0
        if saved and not math.isnan(value) and better(value, best, self.mode):
            best = value
        return {"best": best, "bad": bad}


def on_degrade(
    metric: str, mode: str = "min", drop: float = 0.2, patience: int = 3, to: str = "best"
) -> SavePolicy:
    """Vote yes once ``metrics[metric]`` was NaN or worse than the best saved value by
    more than ``drop * abs(best)`` on ``patience`` evaluations in a row; ``to``: roll
    back to the ``"best"`` kept checkpoint or the newest not degraded (``"last_good"``).
    """
    metric, mode = metric_and_mode(metric, mode, "on_degrade")
    drop = finite_number(drop, "drop (a fraction)", f"on_degrade(drop={drop!r})")
    patience = positive_int(patience, "patience", f"on_degrade(patience={patience!r})")
    if to not in TARGETS:
        raise ValueError(f"on_degrade(to={to!r}): to must be one of {', '.join(TARGETS)}")
    return OnDegrade(metric, mode, drop, patience, to)
