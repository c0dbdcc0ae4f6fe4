"""Policies as configuration: the plain-data form people write in YAML, JSON or a dict.

A policy is one key, its name, holding its arguments: a mapping
(``{"every_steps": {"n": 500}}``), the first argument alone (``{"every_steps": 500}``)
or nothing (``"on_final"``). Combinations are ``{"any": [...]}``, ``{"all": [...]}``
and ``{"not": ...}``; a list of retention policies is their union. Any ``Mapping`` or
``Sequence`` will do (an OmegaConf ``DictConfig``), and a bad value is refused naming
its key and what is known there. A policy's ``spec`` is this form. A manager
config's keys and its ``run`` block live here too, so ``fckpt run`` reads them
without loading the manager."""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from functional_ckpt._src.policy import leaves, retention
from functional_ckpt._src.policy.base import AllOf, AnyOf, Not, SavePolicy
from functional_ckpt._src.policy.degrade import TARGETS, on_degrade
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.policy.signals import on_signal
from functional_ckpt.errors import ConfigError

__all__ = ["MANAGER_KEYS", "RELAUNCH_KEYS", "Param", "Relaunch", "SAVE_KINDS", "at_key"]
__all__ += ["check_bool", "check_keys", "check_number", "check_str", "config_error"]
__all__ += ["is_sequence", "policy_from_config", "relaunch_from_config", "relaunch_to_config"]
__all__ += ["retention_from_config", "signal_number", "stored_spec"]


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


def check_bool(value: object, path: str) -> bool:
    if not isinstance(value, bool):
        raise config_error(path, "true or false", value)
    return value


def check_str(value: object, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise config_error(path, "a non-empty string", value)
    return value


def _int(value: object, path: str, *, positive: bool = False) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and (value > 0 or not positive):
        return value
    raise config_error(path, "a positive int" if positive else "an int", value)


def check_number(value: object, path: str, *, positive: bool = False) -> float:
    """A finite number (``positive``: > 0, else >= 0)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
        if math.isfinite(number) and (number > 0 if positive else number >= 0):
            return number
    raise config_error(path, "a positive number" if positive else "a number >= 0", value)


def _positive_int(value: object, path: str) -> int:
    return _int(value, path, positive=True)


def _one_of(*choices: str) -> Callable[[object, str], str]:
    def check(value: object, path: str) -> str:
        if value not in choices:
            raise config_error(path, " or ".join(repr(c) for c in choices), value)
        return str(value)

    return check


_mode, _target = _one_of("min", "max"), _one_of(*TARGETS)


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


@dataclass(frozen=True)
class Param:
    """One argument: its name (the constructor's keyword), its check, if it is required."""

    name: str
    check: Callable[[object, str], Any]
    required: bool = False


_Kind = tuple[Callable[..., Any], tuple[Param, ...]]

#: Every save policy (and rollback rule) a config can name, with its arguments.
SAVE_KINDS: dict[str, _Kind] = {
    "always": (leaves.always, ()),
    "never": (leaves.never, ()),
    "on_final": (leaves.on_final, ()),
    "every_steps": (leaves.every_steps, (Param("n", _positive_int, True), Param("offset", _int))),
    "every_epochs": (leaves.every_epochs, (Param("n", _positive_int, True),)),
    "at_steps": (leaves.at_steps, (Param("steps", _steps, True),)),
    "every_secs": (
        leaves.every_secs,
        (Param("secs", lambda v, p: check_number(v, p, positive=True), True),),
    ),
    "on_improve": (
        leaves.on_improve,
        (Param("metric", check_str, True), Param("mode", _mode), Param("min_delta", check_number)),
    ),
    "on_degrade": (
        on_degrade,
        (
            Param("metric", check_str, True),
            Param("mode", _mode),
            Param("drop", check_number),
            Param("patience", _positive_int),
            Param("to", _target),
        ),
    ),
    "on_signal": (on_signal, (Param("signum", signal_number),)),
}
_COMBINATORS = ("any", "all", "not")

_KEEP_KINDS: dict[str, _Kind] = {
    "keep_all": (retention.keep_all, ()),
    "keep_last": (retention.keep_last, (Param("n", _positive_int, True),)),
    "keep_best": (
        retention.keep_best,
        (Param("k", _positive_int, True), Param("metric", check_str, True), Param("mode", _mode)),
    ),
    "keep_every": (retention.keep_every, (Param("steps", _positive_int, True),)),
    "keep_within": (retention.keep_within, (Param("secs", check_number, True),)),
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
            f"{path}: {_shown(args)} is a {what} defined outside functional_ckpt; it has no "
            "configuration form"
        )
    if name not in known:
        raise ConfigError(f"{path}: unknown {what} {_shown(name)}; known: {', '.join(known)}")
    return str(name), args


def kind_args(kind: _Kind, args: object, path: str) -> dict[str, Any]:
    """The checked keyword arguments of ``args``: a mapping, the first one alone, or none."""
    _, params = kind
    names = [p.name for p in params]
    if args is None:
        given: dict[str, Any] = {}
    elif isinstance(args, Mapping):
        given = check_keys(args, path, names, "arguments")
    elif params:
        given = {params[0].name: args}  # the shorthand: the first argument alone
    else:
        raise config_error(path, "no arguments (an empty mapping or nothing)", args)
    out: dict[str, Any] = {}
    for p in params:
        if p.name in given:
            where = at_key(path, p.name) if isinstance(args, Mapping) else path
            out[p.name] = p.check(given[p.name], where)
        elif p.required:
            raise ConfigError(f"{at_key(path, p.name)}: required (arguments: {', '.join(names)})")
    return out


def _build(kind: _Kind, args: dict[str, Any], path: str) -> Any:
    make, _ = kind
    try:
        return make(**args)
    except (TypeError, ValueError) as exc:  # what the constructor checks beyond the table
        raise ConfigError(f"{path}: {exc}") from None


def policy_from_config(value: object, path: str = "save") -> SavePolicy:
    """The save policy (or rollback rule) that configuration ``value`` describes.

    ``path`` names ``value``'s key in messages. Building an ``on_signal`` installs its
    handler, as calling :func:`on_signal` does. A bad value raises :class:`ConfigError`.
    """
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
    kind = SAVE_KINDS[name]
    made: SavePolicy = _build(kind, kind_args(kind, args, here), here)
    return made


def retention_from_config(value: object, path: str = "keep") -> RetentionPolicy:
    """The retention policy that configuration ``value`` describes (a list: the union).

    A bad value raises :class:`ConfigError` naming its key.
    """
    if is_sequence(value):
        if not value:
            raise config_error(path, "a non-empty list of retention policies", value)
        parts = [retention_from_config(v, at_key(path, i)) for i, v in enumerate(value)]
        out = parts[0]
        for p in parts[1:]:
            out = out | p
        return out
    name, args = _one_key(value, path, list(_KEEP_KINDS), "retention policy")
    here = at_key(path, name)
    kind = _KEEP_KINDS[name]
    made: RetentionPolicy = _build(kind, kind_args(kind, args, here), here)
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
MANAGER_KEYS: tuple[str, ...] = (
    "root",
    "save",
    "keep",
    "metadata",
    "read_only",
    "async_save",
)
MANAGER_KEYS += ("export", "tiers", "rollback", "per_rank", "run")


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
    given = check_keys(value, path, RELAUNCH_KEYS, "options")
    out: dict[str, Any] = {}
    for key in ("retries", "stall_limit"):
        if key in given:
            out[key] = _int(given[key], at_key(path, key))
            if out[key] < 0:
                raise config_error(at_key(path, key), "an int >= 0", given[key])
    if out.get("stall_limit") == 1:
        raise config_error(at_key(path, "stall_limit"), "0 (never) or 2 or more", 1)
    for key in ("backoff", "max_backoff"):
        if key in given:
            out[key] = check_number(given[key], at_key(path, key))
    return Relaunch(**out)


def relaunch_to_config(relaunch: Relaunch) -> dict[str, Any]:
    return {key: getattr(relaunch, key) for key in RELAUNCH_KEYS}
