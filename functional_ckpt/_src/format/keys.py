"""Key paths: how a leaf of the state is named, in the manifest, in messages and for DCP.

A key path is the tuple of keys from the root to a leaf. The manifest stores it as a
list of strings; a message shows it the way a user indexes a TensorDict; stock DCP
knows a tensor by its key path joined with dots (its *fqn*).
"""

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
