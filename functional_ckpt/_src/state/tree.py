"""The state as a tree: conversion from Python containers, key paths, flattening.

Containers TensorDict cannot express become sub-TensorDicts with one extra leaf,
:data:`NODE_KEY`, recording their kind and keys, so save and restore need no special
case. ``tensordict`` (seconds to import) is imported only where needed.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias

import torch

from functional_ckpt._src import codec
from functional_ckpt._src.codec.registration import is_tensorclass
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath, format_path
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import UnsafeCheckpoint, UnsupportedValue

if TYPE_CHECKING:
    from tensordict import NonTensorData, TensorDict, TensorDictBase

#: What the package accepts as a state: a TensorDict or a (nested) mapping of leaves.
State: TypeAlias = "TensorDictBase | Mapping[str, Any]"


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic GC paused while a large tree is flattened or rebuilt: it walks the whole heap."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def is_tensordict(value: object) -> bool:
    """``isinstance(value, TensorDictBase)``, without importing tensordict for it."""
    td = sys.modules.get("tensordict")
    return td is not None and isinstance(value, td.TensorDictBase)


def _contains_tensor(value: object) -> bool:
    # Iterative and visiting each container once, so a container that contains
    # itself (or is nested deeper than the recursion limit) is answered too; the
    # codec then refuses such a value by its depth, naming the key.
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if type(item) in ATOMS:
            continue
        if isinstance(item, torch.Tensor) or is_tensordict(item):
            return True
        if isinstance(item, dict | list | tuple):
            if id(item) in seen:
                continue
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item)
    return False


def from_python(
    value: Mapping[str, Any] | Any, path: KeyPath = (), _active: frozenset[int] = frozenset()
) -> TensorDict:
    """An unlocked TensorDict of nested Python containers, exactly (``_active``: the containers
    above, so one containing itself is refused before recursing)."""
    from tensordict import NonTensorData, TensorDict

    if is_tensordict(value):
        return value  # type: ignore[return-value]
    record, items = _node_items(value, path, _active)
    _active = _active | {id(value)}
    # Gathered first and made one TensorDict: a ``set`` per key costs ten times more.
    out: dict[str, Any] = {}
    if record is not None:
        out[NODE_KEY] = NonTensorData(data=record, batch_size=[])
    for name, v in items:
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif is_subtree(v):
            out[name] = from_python(v, (*path, name), _active)
        else:
            out[name] = NonTensorData(data=v, batch_size=[])  # checked by the codec when saved
    return TensorDict(out, batch_size=[])


def leaves_of(value: State) -> list[Leaf]:
    """``list(iter_leaves(as_state(value)))``, without building the TensorDict."""
    if is_tensordict(value) or not isinstance(value, Mapping):
        return list(iter_leaves(as_state(value)))  # one refused there, with its reason
    out: list[Leaf] = []
    _python_leaves(dict(value), (), frozenset(), out)
    return out


def root_record(value: State) -> dict[str, Any] | None:
    """The :func:`node_record` of ``as_state(value)``'s root, without building it."""
    return node_record(value) if is_tensordict(value) else None  # type: ignore[arg-type]


def _python_leaves(value: Any, path: KeyPath, _active: frozenset[int], out: list[Leaf]) -> None:
    """Append the leaves of ``from_python(value, path)``, in :func:`iter_leaves`'s order."""
    record, items = _node_items(value, path, _active)
    _active = _active | {id(value)}
    if record is not None:
        out.append(Leaf((*path, NODE_KEY), "value", record))
    new, tensor, add = tuple.__new__, torch.Tensor, out.append  # Leaf's __new__ is slower
    for name, v in items:
        p = (*path, name)
        if isinstance(v, tensor):
            add(new(Leaf, (p, "tensor", v)))
        elif type(v) in ATOMS or not is_subtree(v):
            add(new(Leaf, (p, "value", v)))
        elif is_tensordict(v):
            add(Leaf(p, "node", node_record(v)))
            out.extend(iter_leaves(v, p))
        else:
            add(Leaf(p, "node", None))
            _python_leaves(v, p, _active, out)


#: Leaves that are never a subtree, told apart at once (most values of a state).
ATOMS = frozenset({int, float, str, bool, type(None), bytes})


def is_subtree(v: object) -> bool:
    """Whether a container's item becomes a node of the tree (else a single leaf)."""
    return (type(v) is dict and _str_keys(v)) or is_tensordict(v) or _contains_tensor(v)


def _str_keys(d: Mapping[Any, Any]) -> bool:
    return set(map(type, d)) <= _STR  # the keys' types gathered in C: a state has many keys


_STR = frozenset({str})


def _node_items(
    value: Any, path: KeyPath, _active: frozenset[int]
) -> tuple[dict[str, Any] | None, Iterable[tuple[str, Any]]]:
    """A Python container as a node: its record (None for a plain dict) and named items;
    every rule about which containers a tree may hold, so both walks agree."""
    if id(value) in _active:
        raise UnsupportedValue(
            f"state[{format_path(path)}]: the container contains itself; a state must be a tree"
        )
    if len(path) > LIMITS.key_depth:
        raise UnsupportedValue(
            f"state[{format_path(path[:8])} ...]: nested {len(path)} levels deep; the format "
            f"allows key paths of at most {LIMITS.key_depth} keys"
        )
    record: dict[str, Any] | None = None
    if isinstance(value, dict) and _str_keys(value):
        if NODE_KEY in value:
            raise UnsupportedValue(
                f"state[{format_path(path)}]: the key {NODE_KEY!r} is reserved by functional_ckpt"
            )
        if type(value) is OrderedDict:
            # a module's state_dict: keep its type and its per-module version metadata
            record = {"kind": "OrderedDict"}
            meta = getattr(value, "_metadata", None)
            if meta is not None:
                record["metadata"] = meta
        elif type(value) is not dict:
            raise UnsupportedValue(
                f"state[{format_path(path)}]: {type(value).__name__} is not supported "
                "(only dict and OrderedDict mappings keep their type)"
            )
        return record, value.items()
    if isinstance(value, dict):
        keys = list(value.keys())
        names = [k if type(k) is str else repr(k) for k in keys]
        try:
            codec.check_hashes(keys, where=f"state[{format_path(path)}]")
        except UnsafeCheckpoint as exc:
            raise UnsupportedValue(f"{exc}; a reader would refuse these keys") from None
        if len(set(names)) != len(names):
            raise UnsupportedValue(
                f"state[{format_path(path)}]: dict keys {keys!r} collide once written as strings"
            )
        return {"kind": "dict", "keys": keys}, list(zip(names, value.values(), strict=True))
    if type(value) in (list, tuple):
        return {"kind": type(value).__name__}, [(str(i), v) for i, v in enumerate(value)]
    raise UnsupportedValue(
        f"state[{format_path(path)}]: expected a dict, list or tuple, got {type(value).__name__}"
    )


def to_python(value: Any) -> Any:
    """Turn a (sub-)TensorDict built by :func:`from_python` back into Python containers."""
    td = sys.modules.get("tensordict")
    if td is None:  # nothing is a TensorDict yet
        return value
    if isinstance(value, td.NonTensorData):
        return value.data
    if not isinstance(value, td.TensorDictBase):
        return value
    return _python_node({key: to_python(value.get(key)) for key in value.keys()})


def _python_node(out: dict[str, Any]) -> Any:
    """The container a node's converted entries stand for, by its :data:`NODE_KEY` record."""
    record = out.pop(NODE_KEY, None)
    if record is None:
        return out
    kind = record["kind"]
    if kind == "OrderedDict":
        ordered: OrderedDict[str, Any] = OrderedDict(out)
        if "metadata" in record:
            ordered._metadata = record["metadata"]  # type: ignore[attr-defined]
        return ordered
    if kind == "dict":
        keys = record["keys"]
        codec.check_hashes(keys, where=f"the keys of a {kind} node record")
        names = [k if type(k) is str else repr(k) for k in keys]
        # a partial restore may hold only some of the recorded keys
        return {k: out[n] for k, n in zip(keys, names, strict=True) if n in out}
    seq = [out[str(i)] for i in range(len(out))]
    return tuple(seq) if kind == "tuple" else seq


class Leaf(NamedTuple):
    """One entry of a flattened tree: a tensor, a plain value, or an (empty) node."""

    path: KeyPath
    kind: str  # "tensor" | "value" | "node"
    value: Any = None


def node_record(td: TensorDictBase) -> dict[str, Any] | None:
    """A (sub-)TensorDict's batch size and dimension names (None for ``batch_size=[]``)."""
    if td.batch_size == torch.Size([]):
        return None
    record: dict[str, Any] = {"batch_size": list(td.batch_size)}
    names = list(td.names)
    if any(n is not None for n in names):
        record["names"] = names
    return record


def iter_leaves(td: TensorDictBase, prefix: KeyPath = ()) -> Iterator[Leaf]:
    """Every node and leaf of a TensorDict in insertion order, each node before its children."""
    from tensordict import NonTensorData, NonTensorStack, TensorDictBase, is_tensorclass

    for key, item in td.items():
        path = (*prefix, key)
        if type(item) is torch.Tensor:  # most leaves: no abstract-class checks
            yield Leaf(path, "tensor", item)
        elif isinstance(item, NonTensorData):
            yield Leaf(path, "value", item.data)
        elif isinstance(item, NonTensorStack):
            raise UnsupportedValue(
                f"state[{format_path(path)}]: a stack of per-element non-tensor values is not "
                "supported; store the values as one plain list (e.g. in a sub-dict with "
                "batch_size=[]) or as a tensor"
            )
        elif isinstance(item, TensorDictBase):
            yield Leaf(path, "node", node_record(item))
            yield from iter_leaves(item, path)
        elif isinstance(item, torch.Tensor):
            yield Leaf(path, "tensor", item)
        elif is_tensorclass(item):
            raise UnsupportedValue(
                f"state[{format_path(path)}]: tensorclass {type(item).__name__} is not "
                "supported; store item.to_tensordict() (it keeps the batch size and names)"
            )
        else:
            raise UnsupportedValue(
                f"state[{format_path(path)}]: unsupported leaf type {type(item).__name__}"
            )


def as_state(value: State) -> TensorDictBase:
    """Accept a TensorDict (of any batch size) or a plain mapping wherever a state is expected."""
    if is_tensordict(value):
        return value  # type: ignore[return-value]
    if isinstance(value, Mapping):
        return from_python(dict(value))
    if is_tensorclass(value):
        raise UnsupportedValue(
            f"state: tensorclass {type(value).__name__} is not supported; pass "
            "state.to_tensordict()"
        )
    raise UnsupportedValue(f"state: expected a TensorDict or a dict, got {type(value).__name__}")


def _gather(
    leaves: list[Leaf], root: Mapping[str, Any] | None, wrap: Callable[[Any, Any], Any] | None
) -> tuple[dict[KeyPath, dict[str, Any]], dict[KeyPath, Any], list[KeyPath]]:
    """Each node's entries (values wrapped), each node's record, and the nodes below the root."""
    top: dict[str, Any] = {}
    kids: dict[KeyPath, dict[str, Any]] = {(): top}
    records: dict[KeyPath, Any] = {(): root}
    made: list[KeyPath] = []
    for path, kind, v in leaves:
        parent = top if len(path) == 1 else kids.get(path[:-1])
        if parent is None:  # a parent omitted by a partial restore
            parent = top
            for i in range(1, len(path)):
                sub = path[:i]
                if sub not in kids:
                    parent[sub[-1]] = None  # its place; the node is made below
                    kids[sub] = {}
                    records[sub] = None
                    made.append(sub)
                parent = kids[sub]
        if kind == "node":
            parent[path[-1]] = None
            kids[path] = {}
            records[path] = v
            made.append(path)
        else:
            parent[path[-1]] = v if wrap is None or kind != "value" else wrap(v, records[path[:-1]])
    return kids, records, made


def unflatten(leaves: list[Leaf], root: Mapping[str, Any] | None = None) -> TensorDict:
    """A locked TensorDict of :func:`iter_leaves`' leaves (``root``: the root's record)."""
    from tensordict import NonTensorData

    def value(v: Any, record: Any) -> NonTensorData:
        return NonTensorData(data=v, batch_size=record["batch_size"] if record else [])

    kids, records, made = _gather(leaves, root, value)
    for path in reversed(made):
        kids[path[:-1]][path[-1]] = new_node(records[path], kids[path])
    top = new_node(root, kids[()])
    top.lock_()
    return top


def unflatten_python(leaves: list[Leaf]) -> Any:
    """``to_python(unflatten(leaves))``, made without a TensorDict (batch sizes dropped)."""
    kids, _, made = _gather(leaves, None, None)
    for path in reversed(made):
        kids[path[:-1]][path[-1]] = _python_node(kids[path])
    return _python_node(kids[()])


def new_node(record: Mapping[str, Any] | None, entries: dict[str, Any] | None = None) -> TensorDict:
    """A TensorDict of ``entries`` with the batch size and names of a :func:`node_record`."""
    from tensordict import TensorDict

    if not record:
        return TensorDict(entries or {}, batch_size=[])
    return TensorDict(entries or {}, batch_size=record["batch_size"], names=record.get("names"))
