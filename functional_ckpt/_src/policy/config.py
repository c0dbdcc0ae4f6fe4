"""Policies as configuration (YAML, JSON, a dict): one key, the policy's name, holding a
mapping of its arguments, the first one alone, or nothing; ``any``/``all``/``not``
combine, a list of retention policies is their union. A policy's ``spec`` is this
form. A manager config's keys and ``run`` block live here too, so ``fckpt run`` reads
them without loading the manager."""

from __future__ import annotations

import functools
import math
import operator
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, TypeVar

from functional_ckpt._src.policy import leaves, retention
from functional_ckpt._src.policy.base import AllOf, AnyOf, Not, SavePolicy
from functional_ckpt._src.policy.degrade import TARGETS, on_degrade
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.policy.signals import on_signal
from functional_ckpt.errors import ConfigError

_T = TypeVar("_T")
_Check = Callable[[object, str], _T]  # a check of one value at a key path


def at_key(path: str, key: str | int) -> str:
    """``path`` one level down: ``save.any`` + 1 is ``save.any[1]``."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def is_sequence(value: object) -> TypeGuard[Sequence[Any]]:
    """A list in a config (a ``ListConfig`` too), never a string."""
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_error(path: str, what: str, value: object) -> ConfigError:
    return ConfigError(f"{path}: expected {what}, got {_shown(value)}")


def check_keys(value: object, path: str, known: Sequence[str], what: str) -> dict[str, Any]:
    """``value`` as a dict with str keys, each one of ``known``."""
    if not isinstance(value, Mapping):
        raise config_error(path, f"a mapping of {what}", value)
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key not in known:
            raise ConfigError(
                f"{at_key(path, str(key))}: unknown {what[:-1] if what.endswith('s') else what}"
                f"; known: {', '.join(known)}"
            )
        out[str(key)] = item
    return out


def _rule(what: str, ok: Callable[[Any], bool], make: Callable[[Any], _T]) -> _Check[_T]:
    """A check of one value: ``make(value)`` if ``ok(value)``, else an error naming its path."""

    def check(value: object, path: str) -> _T:
        if not ok(value):
            raise config_error(path, what, value)
        return make(value)

    return check


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def one_of(*choices: str) -> _Check[str]:
    return _rule(" or ".join(repr(c) for c in choices), lambda v: v in choices, str)


check_bool = _rule("true or false", lambda v: isinstance(v, bool), bool)
check_str = _rule("a non-empty string", lambda v: isinstance(v, str) and v != "", str)
_int = _rule("an int", _is_int, int)
_positive_int = _rule("a positive int", lambda v: _is_int(v) and v > 0, int)
_number = _rule("a number >= 0", lambda v: _is_real(v) and v >= 0, float)
_positive_number = _rule("a positive number", lambda v: _is_real(v) and v > 0, float)
_mode, _target = one_of("min", "max"), one_of(*TARGETS)


def _steps(value: object, path: str) -> list[int]:
    if not is_sequence(value):
        raise config_error(path, "a list of steps", value)
    return [_int(v, at_key(path, i)) for i, v in enumerate(value)]


def signal_number(value: object, path: str) -> int:
    """A signal by name (``"SIGTERM"``, ``"TERM"``) or number."""
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else f"SIG{value.upper()}"
        if name in signal.Signals.__members__:
            return int(signal.Signals[name])
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            return int(signal.Signals(value))
        except ValueError:
            pass
    raise config_error(path, "a signal name such as 'SIGTERM', or its number", value)


#: A constructor, its arguments' checks by keyword, and how many of them are required.
_Kind = tuple[Callable[..., Any], dict[str, _Check[Any]], int]

#: Every save policy (and rollback rule) a config can name, with its arguments.
SAVE_KINDS: dict[str, _Kind] = {
    "always": (leaves.always, {}, 0),
    "never": (leaves.never, {}, 0),
    "on_final": (leaves.on_final, {}, 0),
    "every_steps": (leaves.every_steps, {"n": _positive_int, "offset": _int}, 1),
    "every_epochs": (leaves.every_epochs, {"n": _positive_int}, 1),
    "at_steps": (leaves.at_steps, {"steps": _steps}, 1),
    "every_secs": (leaves.every_secs, {"secs": _positive_number}, 1),
    "on_improve": (
        leaves.on_improve,
        {"metric": check_str, "mode": _mode, "min_delta": _number},
        1,
    ),
    "on_degrade": (
        on_degrade,
        {
            "metric": check_str,
            "mode": _mode,
            "drop": _number,
            "patience": _positive_int,
            "to": _target,
        },
        1,
    ),
    "on_signal": (on_signal, {"signum": signal_number}, 0),
}
_COMBINATORS = ("any", "all", "not")

_KEEP_KINDS: dict[str, _Kind] = {
    "keep_all": (retention.keep_all, {}, 0),
    "keep_last": (retention.keep_last, {"n": _positive_int}, 1),
    "keep_best": (retention.keep_best, {"k": _positive_int, "metric": check_str, "mode": _mode}, 2),
    "keep_every": (retention.keep_every, {"steps": _positive_int}, 1),
    "keep_within": (retention.keep_within, {"secs": _number}, 1),
}


def _one_key(value: object, path: str, known: Sequence[str], what: str) -> tuple[str, object]:
    """The name and value of ``"name"`` or ``{"name": value}``."""
    if isinstance(value, str):
        name, args = value, None
    elif isinstance(value, Mapping):
        if len(value) != 1:
            hint = " (to combine policies use {'any': [...]} or {'all': [...]})"
            raise ConfigError(
                f"{path}: expected one {what} name as the only key, got "
                f"{sorted(str(k) for k in value) or 'none'}{hint if len(value) > 1 else ''}"
            )
        ((name, args),) = value.items()
    else:
        raise config_error(
            path, f"a {what} (a name, or a mapping of one name to its arguments)", value
        )
    if name == "custom":  # the spec of a policy defined outside (base.custom_spec)
        raise ConfigError(
            f"{path}: {_shown(args)} is a {what} defined outside functional_ckpt; "
            "it has no configuration form"
        )
    if name not in known:
        raise ConfigError(f"{path}: unknown {what} {_shown(name)}; known: {', '.join(known)}")
    return str(name), args


def _build(kind: _Kind, args: object, path: str) -> Any:
    """The policy ``kind`` makes of ``args``: a mapping, the first argument alone, or none."""
    make, checks, required = kind
    names = list(checks)
    if args is None:
        given: dict[str, Any] = {}
    elif isinstance(args, Mapping):
        given = check_keys(args, path, names, "arguments")
    elif checks:
        given = {names[0]: args}  # the shorthand: the first argument alone
    else:
        raise config_error(path, "no arguments (an empty mapping or nothing)", args)
    out: dict[str, Any] = {}
    for i, (name, check) in enumerate(checks.items()):
        if name in given:
            where = at_key(path, name) if isinstance(args, Mapping) else path
            out[name] = check(given[name], where)
        elif i < required:
            raise ConfigError(f"{at_key(path, name)}: required (arguments: {', '.join(names)})")
    try:
        return make(**out)
    except (TypeError, ValueError) as exc:  # what the constructor checks beyond the table
        raise ConfigError(f"{path}: {exc}") from None


def policy_from_config(value: object, path: str = "save") -> SavePolicy:
    """The save policy (or rollback rule) that configuration ``value`` at ``path``
    describes (an ``on_signal`` installs its handler); :class:`ConfigError` if bad."""
    name, args = _one_key(value, path, [*_COMBINATORS, *SAVE_KINDS], "policy")
    here = at_key(path, name)
    if name == "not":
        return Not(policy_from_config(args, here))
    if name in ("any", "all"):
        if not is_sequence(args) or not args:
            raise config_error(here, "a non-empty list of policies", args)
        children = [policy_from_config(c, at_key(here, i)) for i, c in enumerate(args)]
        if len(children) == 1:
            return children[0]
        return AnyOf(children) if name == "any" else AllOf(children)
    made: SavePolicy = _build(SAVE_KINDS[name], args, here)
    return made


def retention_from_config(value: object, path: str = "keep") -> RetentionPolicy:
    """The retention policy that configuration ``value`` describes (a list: the union)."""
    if is_sequence(value):
        if not value:
            raise config_error(path, "a non-empty list of retention policies", value)
        parts = [retention_from_config(v, at_key(path, i)) for i, v in enumerate(value)]
        return functools.reduce(operator.or_, parts)
    name, args = _one_key(value, path, list(_KEEP_KINDS), "retention policy")
    made: RetentionPolicy = _build(_KEEP_KINDS[name], args, at_key(path, name))
    return made


def stored_spec(spec: object) -> object:
    """A spec read from a manifest in the configuration form; older manifests hold
    ``{"kind": name, **arguments}`` (``children``, ``child``, ``s``, a signal's number)."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("kind"), str):
        return spec
    kind, args = spec["kind"], {str(k): v for k, v in spec.items() if k != "kind"}
    if kind in ("any", "all", "union") and is_sequence(args.get("children")):
        children = [stored_spec(c) for c in args["children"]]
        return children if kind == "union" else {kind: children}
    if kind == "not":
        return {"not": stored_spec(args.get("child"))}
    if kind == "every_secs" and "s" in args:
        args = {"secs": args["s"]}
    if kind == "on_signal" and args.get("signum") in signal.Signals._value2member_map_:
        args["signum"] = signal.Signals(args["signum"]).name
    return {kind: args} if args else kind


#: The keys of a manager's configuration: its constructor's arguments, and ``run``.
MANAGER_KEYS: tuple[str, ...] = ("root", "save", "keep", "metadata", "read_only")
MANAGER_KEYS += ("async_save", "export", "tiers", "rollback", "per_rank", "run")


@dataclass(frozen=True)
class Relaunch:
    """How ``fckpt run`` relaunches a failed job (a config's ``run`` block): ``retries``
    times, pausing ``backoff`` seconds doubled up to ``max_backoff``; ``stall_limit``
    failures in a row without progress stop it (0: never)."""

    retries: int = 3
    backoff: float = 1.0
    max_backoff: float = 60.0
    stall_limit: int = 2


RELAUNCH_KEYS = ("retries", "backoff", "max_backoff", "stall_limit")


def relaunch_from_config(value: object, path: str = "run") -> Relaunch:
    """The ``run`` block: any of ``retries``, ``backoff``, ``max_backoff``, ``stall_limit``."""
    out: dict[str, Any] = {}
    for key, item in check_keys(value, path, RELAUNCH_KEYS, "options").items():
        where = at_key(path, key)
        out[key] = (_number if key.endswith("backoff") else _int)(item, where)
        if out[key] < 0 or (key == "stall_limit" and out[key] == 1):
            rule = "0 (never) or 2 or more" if out[key] == 1 else "an int >= 0"
            raise config_error(where, rule, item)
    return Relaunch(**out)
