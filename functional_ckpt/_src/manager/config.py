"""A manager as configuration: the plain-data form of every ``CheckpointManager`` argument
(``from_config`` reads it, ``config()`` writes it; docs/manager.md).

Any ``Mapping``/``Sequence`` will do (an OmegaConf ``DictConfig`` as it comes); a bad
key is refused with its path and the names known there, before anything is opened.
What is no plain data (a callable, a clock, credentials) is never written.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Mapping
from typing import Any

import torch

from functional_ckpt._src.codec import documents
from functional_ckpt._src.export.safetensors import Export, parse_size
from functional_ckpt._src.manager.memory import Memory
from functional_ckpt._src.manager.options import TIERS, AsyncSave, Disk, TierOptions
from functional_ckpt._src.policy.base import SavePolicy
from functional_ckpt._src.policy.config import (
    Relaunch,
    at_key,
    check_bool,
    check_keys,
    check_str,
    config_error,
    is_sequence,
    one_of,
    policy_from_config,
    relaunch_from_config,
    retention_from_config,
    signal_number,
)
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.remote.options import Remote
from functional_ckpt._src.save.staging import STAGINGS
from functional_ckpt.errors import ConfigError

__all__ = ["config_of", "manager_arguments"]

_Codec = Callable[[Any, str], Any]  # a value and its key path: the value in the other form


def _plain(value: object, path: str) -> Any:
    """Mappings and sequences as dicts and lists, bounded first: parsed YAML shares an
    aliased node, which a copy would expand once per reference."""
    documents.check_bounded(value, path)
    return _copy(value, path)


def _copy(value: object, path: str) -> Any:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise config_error(at_key(path, str(k)), "string keys", k)
            out[k] = _copy(v, at_key(path, k))
        return out
    if is_sequence(value):
        return [_copy(v, at_key(path, i)) for i, v in enumerate(value)]
    return value


def _same(value: Any, path: str) -> Any:
    return value


def _mapping(value: object, path: str) -> Any:
    if not isinstance(value, Mapping):
        raise config_error(path, "a mapping", value)
    return _plain(value, path)


def _names(value: object, path: str) -> str | list[str]:
    """A key, or a list of keys (``select``, ``strip_prefix``)."""
    if isinstance(value, str):
        return check_str(value, path)
    if is_sequence(value) and value:
        return [check_str(v, at_key(path, i)) for i, v in enumerate(value)]
    raise config_error(path, "a string or a non-empty list of strings", value)


def _dtype(value: object, path: str) -> torch.dtype:
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise config_error(path, "a floating-point dtype such as 'bfloat16'", value)
    return dtype


def _size(value: object, path: str) -> object:
    try:
        parse_size(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise config_error(path, "a number of bytes or a size such as '5GB'", value) from None
    return value


def _signals(value: object, path: str) -> tuple[int, ...]:
    if not is_sequence(value):
        raise config_error(path, "a list of signals (names or numbers)", value)
    return tuple(signal_number(s, at_key(path, i)) for i, s in enumerate(value))


def _secret(value: object, path: str) -> Any:
    if not isinstance(value, Mapping):  # its values are never shown: they may be credentials
        raise ConfigError(f"{path}: expected a mapping")
    return _plain(value, path)


def _keys(value: object, path: str) -> list[str]:
    if not is_sequence(value):
        raise config_error(path, "a list of top-level keys", value)
    return [check_str(k, at_key(path, i)) for i, k in enumerate(value)]


def _spec(policy: SavePolicy | RetentionPolicy, path: str) -> Any:
    """``policy.spec``; a ConfigError if part of it was defined outside this package."""

    def outside(spec: object) -> bool:
        if isinstance(spec, dict):
            return "custom" in spec or any(outside(v) for v in spec.values())
        return isinstance(spec, list) and any(outside(v) for v in spec)

    if outside(policy.spec):
        raise ConfigError(
            f"{path}: {policy!r} holds a policy defined outside functional_ckpt; it has no "
            "configuration form"
        )
    return policy.spec


def _data(value: object, path: str) -> Any:
    """A field of an export as plain data, or a ConfigError saying why it is none."""
    to_dict = getattr(value, "to_dict", None)
    value = to_dict() if callable(to_dict) else value  # a transformers config: its fields
    if not isinstance(value, Mapping):
        what = "function" if callable(value) else type(value).__name__
        raise ConfigError(f"{path}: a {what} has no configuration form; use a mapping")
    return _plain(value, path)


def _files(files: Mapping[str, Any], path: str) -> dict[str, Any]:
    return {
        name: item if isinstance(item, str) else _data(item, f"{path}[{name!r}]")
        for name, item in files.items()
    }


@dataclasses.dataclass(frozen=True)
class _Field:
    """How one field is read and written back (``write`` None: never, as credentials)."""

    read: _Codec
    write: _Codec | None = _same
    required: str = ""


_POLICY = _Field(policy_from_config, _spec)
_KEEP = _Field(retention_from_config, _spec)
_BOOL, _STR = _Field(check_bool), _Field(check_str)
_NAMES = _Field(_names, lambda v, _: v if isinstance(v, str) else list(v))

#: Each option value's fields, in the order its messages list them.
_OPTIONS: dict[type[Any], dict[str, _Field]] = {
    AsyncSave: {"staging": _Field(one_of(*STAGINGS))},
    Disk: {"incremental": _BOOL, "compression": _STR},
    Memory: {
        "path": _Field(check_str, lambda v, _: str(v)),
        "save": _POLICY,
        "keep": _Field(_same, lambda v, _: Memory(keep=v).held),  # keep_last(n) as n
        "budget": _Field(_same),
        "promote_on": _Field(_signals, lambda v, _: [signal.Signals(s).name for s in v]),
        "promote_within": _Field(_same),
        "async_save": _BOOL,
        "incremental": _BOOL,
        "replicas": _Field(_same),
    },
    Remote: {
        "url": _Field(check_str, required="an fsspec URL"),
        "keep": _KEEP,
        "storage_options": _Field(_secret, None),
        "prune_unuploaded": _BOOL,
    },
    Export: {
        "policy": _Field(policy_from_config, _spec, required="when to export"),
        "select": _NAMES,
        "dtype": _Field(_dtype, lambda v, _: str(v).removeprefix("torch.")),
        "max_shard_size": _Field(_size),
        "config": _Field(_mapping, _data),
        "extra_files": _Field(_mapping, _files),
        "strip_prefix": _NAMES,
        "rename": _Field(_mapping, _data),
        "keep": _KEEP,
    },
}


def _read(fields: Mapping[str, _Field], value: object, path: str, what: str) -> dict[str, Any]:
    """The fields ``value`` gives, each read at its key path (None: the default)."""
    given = check_keys(value, path or "config", list(fields), what)
    args: dict[str, Any] = {}
    for name, field in fields.items():
        if given.get(name) is not None:
            args[name] = field.read(given[name], at_key(path, name))
        elif field.required:
            raise ConfigError(f"{at_key(path, name)}: required ({field.required})")
    return args


def _write(fields: Mapping[str, _Field], values: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``values`` in their plain form (None as it is)."""
    return {
        name: None if value is None else write(value, at_key(path, name))
        for name, value in values.items()
        if (write := fields[name].write) is not None
    }


def _option(kind: type[Any], value: object, path: str) -> Any:
    args = _read(_OPTIONS[kind], value, path, "fields")
    try:
        return kind(**args)
    except (TypeError, ValueError) as exc:  # named by the field the option names
        field = next((k for k in args if f"({k}=" in str(exc)), None)
        raise ConfigError(f"{at_key(path, field) if field else path}: {exc}") from None


def _option_config(option: Any, path: str) -> dict[str, Any]:
    fields = _OPTIONS[type(option)]
    return _write(fields, {name: getattr(option, name) for name in fields}, path)


def _async(value: object, path: str) -> bool | AsyncSave:
    return value if isinstance(value, bool) else _option(AsyncSave, value, path)


def _tiers(value: object, path: str) -> list[Memory | Disk | Remote]:
    out = []
    for key, given in check_keys(value, path, tuple(TIERS), "tiers").items():
        if given not in (None, False):
            given = {"url": given} if key == "remote" and isinstance(given, str) else given
            out.append(_option(TIERS[key], {} if given is True else given, at_key(path, key)))
    return out


def _tiers_config(options: TierOptions, path: str) -> dict[str, Any]:
    memory = options[0]
    if memory is not None and memory.domain is not None:
        raise ConfigError(
            f"{path}.memory.domain={memory.domain!r}: a function has no plain form; leave it "
            "out (the default domains are the nodes, from LOCAL_RANK) or build the manager "
            "in code"
        )
    return {
        key: _option_config(option, at_key(path, key))
        for key, option in zip(TIERS, options, strict=True)
        if option is not None
    }


#: The manager's keys (``policy.config.MANAGER_KEYS``): how each is read and written.
_MANAGER: dict[str, _Field] = {
    "root": _STR,
    "save": _POLICY,
    "keep": _KEEP,
    "metadata": _Field(_mapping, _plain),
    "read_only": _BOOL,
    "async_save": _Field(_async, lambda v, p: v if v is False else _option_config(v, p)),
    "export": _Field(lambda v, p: _option(Export, v, p), _option_config),
    "tiers": _Field(_tiers, _tiers_config),
    "rollback": _POLICY,
    "per_rank": _Field(_keys, lambda v, _: list(v)),
    "run": _Field(relaunch_from_config, lambda v, _: dataclasses.asdict(v)),
}


def manager_arguments(
    cfg: object, *, root_given: bool = False
) -> tuple[str | None, dict[str, Any], Relaunch | None]:
    """The root, the constructor's keyword arguments and the ``run`` block of ``cfg``
    (``root_given``: the caller has the root, the config need not)."""
    documents.check_bounded(cfg, "config")
    kwargs = _read(_MANAGER, cfg, "", "keys")
    if "root" not in kwargs and not root_given:
        raise ConfigError("root: required (the directory of the run's checkpoints)")
    return kwargs.pop("root", None), kwargs, kwargs.pop("run", None)


def config_of(mgr: Any) -> dict[str, Any]:
    """``mgr``'s configuration, every value spelled, without a remote tier's
    ``storage_options``: a configuration is written where anyone may read it."""
    settings = mgr._writes.settings
    values = {
        "root": str(mgr.root),
        "save": mgr.save_policy,
        "keep": mgr.keep,
        "metadata": mgr.metadata,
        "read_only": mgr.read_only,
        "async_save": settings.async_save or False,
        "export": mgr.export,
        "tiers": mgr._options,
        "rollback": mgr._watch.rule,
        "per_rank": settings.per_rank,
        "run": mgr._relaunch,
    }
    return _write(_MANAGER, {k: v for k, v in values.items() if v is not None}, "")
