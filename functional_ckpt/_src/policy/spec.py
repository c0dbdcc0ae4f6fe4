"""Policy specs: a save policy as plain data (kind and arguments), and back.

A stored policy state is handed back only to the policy of the same spec, and the
``fckpt`` command shows and rebuilds policies from specs without running any code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from functional_ckpt._src.policy.base import AllOf, AnyOf, Not, SavePolicy
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
from functional_ckpt._src.policy.signals import on_signal
from functional_ckpt.errors import PolicyError

__all__ = ["policy_from_spec"]


def _spec_args(spec: Mapping[str, Any], names: Iterable[str]) -> list[Any]:
    wanted = set(names)
    given = set(spec) - {"kind"}
    if given != wanted:
        raise PolicyError(
            f"policy spec {dict(spec)!r}: expected the arguments {sorted(wanted)}, got "
            f"{sorted(given)}"
        )
    return [spec[n] for n in names]


def policy_from_spec(spec: Mapping[str, Any]) -> SavePolicy:
    """Rebuild a save policy from its :attr:`~SavePolicy.spec` (plain data, no code).

    Rebuilding an ``on_signal`` spec installs its signal handler, as calling
    :func:`on_signal` does. A spec of unknown kind or with wrong arguments raises
    :class:`PolicyError`.
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("kind"), str):
        raise PolicyError(f"policy spec {spec!r}: expected a dict with a str 'kind'")
    kind = spec["kind"]
    try:
        if kind in ("any", "all"):
            (children,) = _spec_args(spec, ["children"])
            if not isinstance(children, list) or len(children) < 2:
                raise PolicyError(f"policy spec {dict(spec)!r}: needs a list of >= 2 children")
            built = [policy_from_spec(c) for c in children]
            return AnyOf(built) if kind == "any" else AllOf(built)
        if kind == "not":
            (child,) = _spec_args(spec, ["child"])
            return Not(policy_from_spec(child))
        simple: dict[str, Any] = {"always": always, "never": never, "on_final": on_final}
        if kind in simple:
            _spec_args(spec, [])
            made: SavePolicy = simple[kind]()
            return made
        if kind == "every_steps":
            return every_steps(*_spec_args(spec, ["n", "offset"]))
        if kind == "every_epochs":
            return every_epochs(*_spec_args(spec, ["n"]))
        if kind == "at_steps":
            return at_steps(*_spec_args(spec, ["steps"]))
        if kind == "every_secs":
            return every_secs(*_spec_args(spec, ["s"]))
        if kind == "on_improve":
            return on_improve(*_spec_args(spec, ["metric", "mode", "min_delta"]))
        if kind == "on_degrade":
            return on_degrade(*_spec_args(spec, ["metric", "mode", "drop", "patience", "to"]))
        if kind == "on_signal":
            return on_signal(*_spec_args(spec, ["signum"]))
    except PolicyError:
        raise
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"policy spec {dict(spec)!r}: {exc}") from None
    raise PolicyError(f"policy spec {dict(spec)!r}: unknown kind {kind!r}")
