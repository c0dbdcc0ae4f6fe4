"""A manager as configuration: the plain-data form of every ``CheckpointManager`` argument
(``from_config`` reads it, ``config()`` writes it; docs/manager.md).

Any ``Mapping``/``Sequence`` will do (an OmegaConf ``DictConfig`` as it comes); a bad
key is refused with its path and the names known there, before anything is opened.
What is no plain data (a callable, a clock, credentials) is never written.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from typing import Any

import torch

from functional_ckpt._src.codec import documents
from functional_ckpt._src.export.safetensors import Export, parse_size
from functional_ckpt._src.manager.memory import Memory
from functional_ckpt._src.manager.options import AsyncSave, Disk
from functional_ckpt._src.policy import SavePolicy
from functional_ckpt._src.policy.config import (
    MANAGER_KEYS,
    Relaunch,
    at_key,
    check_bool,
    check_keys,
    check_str,
    config_error,
    is_sequence,
    policy_from_config,
    relaunch_from_config,
    relaunch_to_config,
    retention_from_config,
    signal_number,
)
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.remote.options import Remote
from functional_ckpt._src.save.staging import STAGINGS
from functional_ckpt.errors import ConfigError

__all__ = ["EXPORT_KEYS", "MEMORY_KEYS", "REMOTE_KEYS", "config_of", "manager_arguments"]

EXPORT_KEYS = (
    "policy",
    "select",
    "dtype",
    "max_shard_size",
    "config",
    "extra_files",
    "strip_prefix",
    "rename",
    "keep",
)
REMOTE_KEYS = ("url", "keep", "storage_options", "prune_unuploaded")
MEMORY_KEYS = (
    "path",
    "save",
    "keep",
    "budget",
    "promote_on",
    "promote_within",
    "async_save",
    "incremental",
    "replicas",
)


def _plain(value: object, path: str) -> Any:
    """Mappings and sequences (a DictConfig's too) as dicts and lists, all the way down;
    bounded first, as an untrusted document (parsed YAML shares an aliased node, which
    a copy would expand once per reference)."""
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


def _async(value: object, path: str) -> bool | AsyncSave:
    if isinstance(value, bool):
        return value
    given = check_keys(value, path, ("staging",), "options")
    staging = given.get("staging", "copy")
    if staging not in STAGINGS:
        raise config_error(at_key(path, "staging"), " or ".join(map(repr, STAGINGS)), staging)
    return AsyncSave(staging=staging)


def _export(value: object, path: str) -> Export:
    given = check_keys(value, path, EXPORT_KEYS, "fields")
    if "policy" not in given:
        raise ConfigError(f"{at_key(path, 'policy')}: required (when to export)")
    args: dict[str, Any] = {"policy": policy_from_config(given["policy"], at_key(path, "policy"))}
    for key in ("select", "strip_prefix"):
        if given.get(key) is not None:
            args[key] = _names(given[key], at_key(path, key))
    if given.get("dtype") is not None:
        args["dtype"] = _dtype(given["dtype"], at_key(path, "dtype"))
    if "max_shard_size" in given:
        size = given["max_shard_size"]
        try:
            parse_size(size)
        except (TypeError, ValueError):
            raise config_error(
                at_key(path, "max_shard_size"), "a number of bytes or a size such as '5GB'", size
            ) from None
        args["max_shard_size"] = size
    for key in ("config", "extra_files", "rename"):
        if given.get(key) is not None:
            if not isinstance(given[key], Mapping):
                raise config_error(at_key(path, key), "a mapping", given[key])
            args[key] = _plain(given[key], at_key(path, key))
    if "keep" in given:
        args["keep"] = retention_from_config(given["keep"], at_key(path, "keep"))
    try:
        return Export(**args)
    except (TypeError, ValueError) as exc:  # what Export checks beyond the keys
        raise ConfigError(f"{path}: {exc}") from None


def _signals(value: object, path: str) -> tuple[int, ...]:
    if not is_sequence(value):
        raise config_error(path, "a list of signals (names or numbers)", value)
    return tuple(signal_number(s, at_key(path, i)) for i, s in enumerate(value))


def _secret(value: object, path: str) -> Any:
    if not isinstance(value, Mapping):  # its values are never shown: they may be credentials
        raise ConfigError(f"{path}: expected a mapping")
    return _plain(value, path)


_BOOLS, _STRS = ("async_save", "incremental", "prune_unuploaded"), ("path", "url", "compression")
_PLAIN: dict[str, Any] = {**dict.fromkeys(_BOOLS, check_bool), **dict.fromkeys(_STRS, check_str)}
#: Each tier's option by its key, its fields, and how those not plain are read (the
#: option itself checks the rest, naming the field).
_TIERS: dict[str, tuple[type[Memory | Disk | Remote], tuple[str, ...], dict[str, Any]]] = {
    "memory": (Memory, MEMORY_KEYS, {"save": policy_from_config, "promote_on": _signals}),
    "disk": (Disk, ("incremental", "compression"), {}),
    "remote": (Remote, REMOTE_KEYS, {"keep": retention_from_config, "storage_options": _secret}),
}


def _tiers(value: object) -> list[Memory | Disk | Remote]:
    out: list[Memory | Disk | Remote] = []
    for key, given in check_keys(value, "tiers", tuple(_TIERS), "tiers").items():
        kind, known, read = _TIERS[key]
        path = at_key("tiers", key)
        if given in (None, False):
            continue
        given = {"url": given} if key == "remote" and isinstance(given, str) else given
        given = check_keys({} if given is True else given, path, known, "fields")
        if key == "remote" and given.get("url") is None:
            raise ConfigError(f"{at_key(path, 'url')}: required (an fsspec URL)")
        args: dict[str, Any] = {
            k: (read.get(k) or _PLAIN.get(k) or (lambda v, _: v))(v, at_key(path, k))
            for k, v in given.items()
            if v is not None
        }
        try:
            out.append(kind(**args))
        except (TypeError, ValueError) as exc:  # named by the field the option names
            field = next((k for k in args if f"({k}=" in str(exc)), None)
            raise ConfigError(f"{at_key(path, field) if field else path}: {exc}") from None
    return out


def manager_arguments(
    cfg: object, *, root_given: bool = False
) -> tuple[str | None, dict[str, Any], Relaunch | None]:
    """The root, the constructor's keyword arguments and the ``run`` block of ``cfg``
    (``root_given``: the caller has the root, the config need not)."""
    documents.check_bounded(cfg, "config")
    given = check_keys(cfg, "config", MANAGER_KEYS, "keys")
    if "root" not in given and not root_given:
        raise ConfigError("root: required (the directory of the run's checkpoints)")
    root = check_str(given["root"], "root") if "root" in given else None
    kwargs: dict[str, Any] = {}
    if given.get("save") is not None:
        kwargs["save"] = policy_from_config(given["save"], "save")
    if given.get("keep") is not None:
        kwargs["keep"] = retention_from_config(given["keep"], "keep")
    if given.get("rollback") is not None:
        kwargs["rollback"] = policy_from_config(given["rollback"], "rollback")
    if given.get("metadata") is not None:
        if not isinstance(given["metadata"], Mapping):
            raise config_error("metadata", "a mapping", given["metadata"])
        kwargs["metadata"] = _plain(given["metadata"], "metadata")
    if "read_only" in given:
        kwargs["read_only"] = check_bool(given["read_only"], "read_only")
    if "async_save" in given:
        kwargs["async_save"] = _async(given["async_save"], "async_save")
    if given.get("export") is not None:
        kwargs["export"] = _export(given["export"], "export")
    if given.get("tiers") is not None:
        kwargs["tiers"] = _tiers(given["tiers"])
    if "per_rank" in given:
        per_rank = given["per_rank"]
        if not is_sequence(per_rank):
            raise config_error("per_rank", "a list of top-level keys", per_rank)
        kwargs["per_rank"] = [check_str(k, at_key("per_rank", i)) for i, k in enumerate(per_rank)]
    run = relaunch_from_config(given["run"]) if given.get("run") is not None else None
    return root, kwargs, run


def _data(value: object, path: str) -> Any:
    """A field of an export as plain data, or a ConfigError saying why it is none."""
    if value is None or isinstance(value, Mapping):
        return _plain(value, path)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):  # a transformers config: its fields
        return _plain(to_dict(), path)
    raise ConfigError(f"{path}: a {type(value).__name__} has no configuration form")


def _spec(policy: SavePolicy | RetentionPolicy, path: str) -> Any:
    """``policy.spec``, or a ConfigError if part of it was defined outside this package
    (recorded by type and repr, it has no configuration form)."""

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


def _export_config(export: Export) -> dict[str, Any]:
    out: dict[str, Any] = {
        "policy": _spec(export.policy, "export.policy"),
        "select": export.select if isinstance(export.select, str) else list(export.select),
        "dtype": None if export.dtype is None else str(export.dtype).removeprefix("torch."),
        "max_shard_size": export.max_shard_size,
        "keep": _spec(export.keep, "export.keep"),
    }
    if export.strip_prefix is not None:
        strip = export.strip_prefix
        out["strip_prefix"] = strip if isinstance(strip, str) else list(strip)
    if export.config is not None:
        out["config"] = _data(export.config, "export.config")
    if export.extra_files is not None:
        files: dict[str, Any] = {}
        for name, item in export.extra_files.items():
            where = f"export.extra_files[{name!r}]"
            files[name] = item if isinstance(item, str) else _data(item, where)
        out["extra_files"] = files
    if export.rename is not None:
        if not isinstance(export.rename, Mapping):
            raise ConfigError("export.rename: a function has no configuration form; use a mapping")
        out["rename"] = _plain(export.rename, "export.rename")
    return out


def config_of(mgr: Any) -> dict[str, Any]:
    """A manager's (``mgr``) configuration, every value spelled; ``manager_arguments``
    reads it back.

    A remote tier's ``storage_options`` are left out: they may hold credentials, and a
    configuration is written where anyone may read it (a checkpoint's metadata).
    """
    settings, export, rollback = mgr._writes.settings, mgr.export, mgr._watch.rule
    out: dict[str, Any] = {
        "root": str(mgr.root),
        "save": _spec(mgr.save_policy, "save"),
        "keep": _spec(mgr.keep, "keep"),
        "metadata": _plain(mgr.metadata, "metadata"),
        "read_only": mgr.read_only,
        "async_save": False if (mode := settings.async_save) is None else {"staging": mode.staging},
        "per_rank": list(settings.per_rank),
    }
    memory, disk, remote = mgr._options
    out["tiers"] = {"disk": {"incremental": disk.incremental, "compression": disk.compression}}
    if export is not None:
        out["export"] = _export_config(export)
    if remote is not None:
        out["tiers"]["remote"] = {k: getattr(remote, k) for k in ("url", "prune_unuploaded")}
        out["tiers"]["remote"]["keep"] = _spec(remote.keep, "tiers.remote.keep")
    if memory is not None:
        if memory.domain is not None:
            raise ConfigError(
                f"tiers.memory.domain={memory.domain!r}: a function has no plain form; leave it "
                "out (the default domains are the nodes, from LOCAL_RANK) or build the manager "
                "in code"
            )
        out["tiers"]["memory"] = {k: getattr(memory, k) for k in MEMORY_KEYS} | {
            "path": None if memory.path is None else str(memory.path),
            "save": _spec(memory.save, "tiers.memory.save"),
            "keep": memory.held,  # keep_last(n), as its int shorthand
            "promote_on": [signal.Signals(s).name for s in memory.promote_on],
        }
    if rollback is not None:
        out["rollback"] = _spec(rollback, "rollback")
    if mgr._relaunch is not None:
        out["run"] = relaunch_to_config(mgr._relaunch)
    return out
