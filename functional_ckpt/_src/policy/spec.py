"""Policy specs: the record of a save policy a checkpoint keeps (kind and arguments).

A stored policy state is handed back only to the policy of the same spec, and the
``fckpt`` command shows and rebuilds policies from specs without running any code.
A spec spells every argument, so it names one policy exactly whatever later
defaults become; it is read through the table of the configuration form
(:mod:`.config`), which is what people write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from functional_ckpt._src.policy.base import AllOf, AnyOf, Not, SavePolicy
from functional_ckpt._src.policy.config import SAVE_KINDS, kind_args
from functional_ckpt.errors import ConfigError, PolicyError

__all__ = ["policy_from_spec"]


def policy_from_spec(spec: Mapping[str, Any]) -> SavePolicy:
    """Rebuild a save policy from its :attr:`~SavePolicy.spec` (plain data, no code).

    Rebuilding an ``on_signal`` spec installs its signal handler, as calling
    :func:`on_signal` does. A spec of unknown kind or with wrong arguments raises
    :class:`PolicyError`.
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("kind"), str):
        raise PolicyError(f"policy spec {spec!r}: expected a dict with a str 'kind'")
    kind = spec["kind"]
    given = set(spec) - {"kind"}
    if kind in ("any", "all", "not"):
        wanted = {"child"} if kind == "not" else {"children"}
    elif kind in SAVE_KINDS:
        wanted = {p.in_spec for p in SAVE_KINDS[kind][1]}
    else:
        raise PolicyError(f"policy spec {dict(spec)!r}: unknown kind {kind!r}")
    if given != wanted:
        raise PolicyError(
            f"policy spec {dict(spec)!r}: expected the arguments {sorted(wanted)}, got "
            f"{sorted(given)}"
        )
    if kind == "not":
        return Not(policy_from_spec(spec["child"]))
    if kind in ("any", "all"):
        children = spec["children"]
        if not isinstance(children, list) or len(children) < 2:
            raise PolicyError(f"policy spec {dict(spec)!r}: needs a list of >= 2 children")
        built = [policy_from_spec(c) for c in children]
        return AnyOf(built) if kind == "any" else AllOf(built)
    make, params = SAVE_KINDS[kind]
    try:
        args = kind_args(SAVE_KINDS[kind], {p.name: spec[p.in_spec] for p in params}, kind)
        made: SavePolicy = make(**args)
    except (ConfigError, TypeError, ValueError) as exc:
        raise PolicyError(f"policy spec {dict(spec)!r}: {exc}") from None
    return made
