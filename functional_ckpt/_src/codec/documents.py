"""Untrusted JSON and YAML documents (configs, state files), bounded by the decoder's
budgets: depth, containers per byte, and an expanded size within the text's length, a
YAML alias counted once per use (a 420-byte "billion laughs" is refused). YAML is read as
events first, stopping at the first level too deep, before PyYAML's recursive composer."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence, Set
from typing import Any

from functional_ckpt._src.codec.table import container_budget
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import ConfigError

#: What an in-memory document (no text to measure) may expand to: a state file's size.
_IN_MEMORY_BYTES = LIMITS.state_file_bytes


def _children(value: object) -> Iterator[tuple[object, object]] | None:
    if isinstance(value, Mapping):
        return iter(value.items())
    if isinstance(value, (str, bytes, bytearray)):
        return None
    if isinstance(value, (Sequence, Set)):
        return enumerate(value)
    return None


def _cost(value: object) -> int:
    return 1 + len(value) if isinstance(value, (str, bytes, bytearray)) else 1


def _at(where: str, path: list[object]) -> str:
    keys = "".join(f"[{k!r}]" if not isinstance(k, str) else f".{k}" for k in path)
    return f"{where} (at {keys.lstrip('.')})" if keys else where


def check_bounded(doc: object, where: str, text_bytes: int | None = None) -> None:
    """Refuse (``ConfigError`` naming ``where`` and the key path) a document deeper or
    larger when expanded than the budgets of a ``text_bytes`` text (default: a state file)."""
    n = _IN_MEMORY_BYTES if text_bytes is None else text_bytes
    free = LIMITS.decode_free_containers
    budget = (container_budget(n, free), free + n)
    containers, size = budget
    stack: list[Iterator[tuple[object, object]]] = []
    path: list[object] = []
    value = doc
    while True:
        size -= _cost(value)
        children = _children(value)
        if children is not None:
            containers -= 1
            if len(stack) >= LIMITS.decode_depth:
                raise ConfigError(
                    f"{_at(where, path)}: nested deeper than {LIMITS.decode_depth} levels"
                )
            stack.append(children)
            path.append(None)
        if containers < 0 or size < 0:
            raise ConfigError(
                f"{_at(where, path[:-1] if children is not None else path)}: the document "
                f"expands beyond its budget of {budget[0]} containers and {budget[1]} nodes "
                "and characters (a YAML alias counts once per use)"
            )
        while stack:
            item = next(stack[-1], None)
            if item is not None:
                key, value = item
                size -= _cost(key)
                path[-1] = key
                break
            stack.pop()
            path.pop()
        else:
            return


def load(text: bytes | str, where: str, *, yaml: bool = False) -> Any:
    """The document a JSON (or, with ``yaml``, YAML) text holds, checked by :func:`check_bounded`;
    a :class:`~..errors.ConfigError` naming ``where`` for any bad text."""
    if isinstance(text, bytes):
        try:
            text = text.decode()
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where}: not UTF-8 text ({exc})") from None
    try:
        doc = _yaml(text, where) if yaml else json.loads(text)
    except RecursionError:
        raise ConfigError(f"{where}: nested deeper than {LIMITS.decode_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    except ValueError as exc:  # an integer past Python's digit limit, in JSON or YAML
        raise ConfigError(f"{where}: {exc}") from None
    check_bounded(doc, where, len(text.encode()))
    return doc


def _yaml(text: str, where: str) -> Any:
    import yaml  # type: ignore[import-untyped, unused-ignore]

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C one, where PyYAML has it
    try:
        depth = 0
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > LIMITS.decode_depth:
                    raise ConfigError(f"{where}: nested deeper than {LIMITS.decode_depth} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
        return yaml.load(text, Loader=loader)  # a safe loader: plain data only
    except yaml.YAMLError as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(f"{where}: not valid YAML ({message})") from None
