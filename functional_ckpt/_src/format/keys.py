"""Key paths (the keys from the root to a leaf): in the manifest, in messages, for DCP."""

from __future__ import annotations

KeyPath = tuple[str, ...]

#: Reserved key of the record that turns a sub-TensorDict back into a list,
#: tuple or dict with non-string keys.
NODE_KEY = "__container__"


def format_path(path: KeyPath) -> str:
    """Render a key path the way users index a TensorDict: ``('model', 'w')``."""
    return repr(tuple(path)) if len(path) != 1 else repr(path[0])


def fqn_of(path: KeyPath) -> str:
    """The DCP key of a tensor: its key path joined by dots, as DCP flattens dicts."""
    return ".".join(path)


def rank_fqn(rank: int, path: KeyPath) -> str:
    """The DCP key of a per-rank tensor, distinct for every rank."""
    return f"__rank{rank}__." + fqn_of(path)
