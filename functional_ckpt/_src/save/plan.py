"""The save plan: a state flattened once into manifest entries and the tensors to write.
Everything a reader would refuse is refused here, before a byte is written, naming the key."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from functional_ckpt._src import codec
from functional_ckpt._src.codec.table import container_budget
from functional_ckpt._src.distributed.topology import is_dtensor
from functional_ckpt._src.format import dcp_values as dcpbytes
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.blobs import bytes_are_values
from functional_ckpt._src.format.keys import KeyPath, format_path, fqn_of, rank_fqn
from functional_ckpt._src.format.manifest import (
    Entry,
    NodeEntry,
    PerRankEntry,
    TensorEntry,
    Tree,
    ValueEntry,
    dtype_name,
    shape_problem,
)
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.save.options import DEFAULT_PER_RANK
from functional_ckpt._src.state.tree import leaves_of, root_record
from functional_ckpt._src.storage import commit
from functional_ckpt.errors import CheckpointError, CheckpointExists, UnsupportedValue

if TYPE_CHECKING:  # tensordict loads only where a state is one (seconds: torch._dynamo)
    from tensordict import TensorDictBase


def _where(path: KeyPath) -> str:
    if len(path) > 16:  # a path refused for its depth would print hundreds of keys
        path = (*path[:8], f"...{len(path) - 14} levels...", *path[-6:])
    return f"state[{format_path(path)}]"


#: ``uint1``..``uint7``, ``int1``..``int7``: torch can neither copy nor serialise them.
_SUB_BYTE: frozenset[torch.dtype] = frozenset(
    d
    for n in (f"{sign}int{bits}" for sign in ("u", "") for bits in range(1, 8))
    if isinstance(d := getattr(torch, n, None), torch.dtype)
)


def check_tensor(t: torch.Tensor, path: KeyPath) -> None:
    """Refuse a tensor the format cannot store or load back (before its data pointer is read)."""
    if t.is_meta:
        raise UnsupportedValue(f"{_where(path)}: meta tensors hold no data and cannot be saved")
    if t.is_nested:
        raise UnsupportedValue(
            f"{_where(path)}: nested tensors are not supported; save their components "
            "(e.g. t.unbind()) as separate tensors"
        )
    if t.layout != torch.strided:
        raise UnsupportedValue(
            f"{_where(path)}: {t.layout} tensors are not supported; convert to dense (t.to_dense())"
        )
    if t.dtype in _SUB_BYTE:
        raise UnsupportedValue(
            f"{_where(path)}: {t.dtype} tensors are not supported (torch cannot copy or "
            "serialise sub-byte dtypes); save t.view(torch.uint8) and view it back after restore"
        )
    if t.is_quantized:
        raise UnsupportedValue(
            f"{_where(path)}: quantized tensors are not supported; save t.int_repr() and the "
            "quantization parameters instead"
        )
    extent = LIMITS.tensor_extent
    numel = t.numel()  # global, for a DTensor
    if (
        t.dim() <= LIMITS.tensor_ndim
        and numel * t.element_size() < extent
        and (numel or all(d < extent for d in t.shape))
    ):
        return  # the common case, without building the message
    problem = shape_problem(tuple(t.shape), dtype_name(t.dtype))
    if problem is not None:
        raise UnsupportedValue(
            f"{_where(path)}: a tensor of {problem} lies beyond the format's limits and could "
            "not be loaded back"
        )


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a lazy conjugate or negative bit applied: what is stored is its values."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (maybe requiring grad): itself, or a copy."""
    if bytes_are_values(t):
        return t  # the common case, without a new tensor object
    t = resolved(t.detach())
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Everything that makes two views of the same bytes read differently."""
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())


def _may_alias(t: torch.Tensor) -> bool:
    """Whether another leaf could share ``t``'s bytes (never a DTensor's or none)."""
    return not t.is_meta and t.numel() != 0 and (type(t) is torch.Tensor or not is_dtensor(t))


class _Aliases:
    """Leaves by address; the full :func:`_alias_key` only for a second leaf there (rare)."""

    def __init__(self) -> None:
        self._first: dict[int, tuple[torch.Tensor, TensorEntry] | None] = {}
        self._keyed: dict[tuple[Any, ...], TensorEntry] = {}

    def find(self, t: torch.Tensor, ptr: int) -> TensorEntry | None:
        """The newest entry seen with ``t``'s identity, if any."""
        if ptr not in self._first:
            return None
        first = self._first[ptr]
        if first is not None:  # a second leaf at this address: key the first one now
            self._keyed.setdefault(_alias_key(first[0]), first[1])
            self._first[ptr] = None
        return self._keyed.get(_alias_key(t))

    def add(self, t: torch.Tensor, ptr: int, entry: TensorEntry) -> None:
        if ptr in self._first:
            self._keyed[_alias_key(t)] = entry
        else:
            self._first[ptr] = (t, entry)


@dataclass(frozen=True)
class Plan:
    """The flattened state ready to be written: ``entries`` the shared tree, ``local`` this rank's
    per-rank entries, ``sources`` the tensors to write, each filling its ``targets`` entry."""

    entries: tuple[Entry, ...]
    local: tuple[Entry, ...]
    sources: tuple[torch.Tensor, ...]
    targets: tuple[TensorEntry, ...]
    num_values: int = 0
    optimizers: Mapping[KeyPath, list[str]] = field(default_factory=dict)  # parameter names
    root: dict[str, Any] | None = None  # the root's batch size and names, if batched
    has_dtensor: bool = False  # a DTensor's shards are written collectively

    @property
    def keys(self) -> list[KeyPath]:
        return [t.path for t in self.targets]

    def tree(self) -> Tree:
        """The tree of a save by this process alone (its per-rank entries are rank 0's)."""
        return Tree(self.entries, (self.local,), self.root)


def plan_save(
    state: TensorDictBase | Mapping[str, Any],
    *,
    per_rank: Sequence[str] = DEFAULT_PER_RANK,
    rank: int = 0,
) -> Plan:
    """Flatten a state into entries and tensors to write, making every check a reader would."""
    entries: list[Entry] = []
    local: list[Entry] = []
    sources: list[torch.Tensor] = []
    targets: list[TensorEntry] = []
    optimizers: dict[KeyPath, list[str]] = {}
    fqns: dict[str, KeyPath] = {}
    aliases = _Aliases()
    budget = _Budget()
    roots = set(per_rank)
    has_dtensor = False
    new = tuple.__new__
    for leaf in leaves_of(state):
        path = leaf.path
        if len(path) > LIMITS.key_depth:
            raise UnsupportedValue(
                f"{_where(path)}: the key path is {len(path)} levels deep; the format allows "
                f"at most {LIMITS.key_depth}, so flatten this part of the state"
            )
        mine = path[0] in roots
        entry: Entry
        if mine and len(path) == 1:
            entries.append(PerRankEntry(path))
        if leaf.kind == "node":
            entry = NodeEntry(path, leaf.value or None)
        elif leaf.kind == "value":
            entry = ValueEntry(path, leaf.value, budget.encode(path, leaf.value))
            named = dcpbytes.optimizer_names(path, leaf.value)
            if named is not None and not mine:
                optimizers[named[0]] = named[1]
        else:
            t: torch.Tensor = leaf.value
            check_tensor(t, path)
            fqn = rank_fqn(rank, path) if mine else fqn_of(path)
            other = fqns.get(fqn)
            if other is not None:
                raise UnsupportedValue(
                    f"state[{format_path(path)}] and state[{format_path(other)}] map to the "
                    f"same DCP key {fqn!r}; rename one of them"
                )
            fqns[fqn] = path
            dcp_path = (fqn.partition(".")[0], *path) if mine else None
            ptr = t.data_ptr() if _may_alias(t) else None
            has_dtensor = has_dtensor or (ptr is None and is_dtensor(t))
            src = aliases.find(t, ptr) if ptr is not None else None
            alias = src.path if src is not None and (src.path[0] in roots) == mine else None
            grad = bool(t.requires_grad)
            entry = new(  # one per tensor: made without the named tuple's __new__
                TensorEntry,
                (path, fqn, dtype_name(t.dtype), tuple(t.shape), grad, (), alias, dcp_path),
            )
            if alias is None:
                if ptr is not None:
                    aliases.add(t, ptr, entry)
                sources.append(resolved(t))
                targets.append(entry)
        (local if mine else entries).append(entry)
        budget.overhead += _entry_overhead(entry)
    budget.check(entries + local)
    if optimizers:
        named_entries = _name_optimizer_state(entries, optimizers, fqns)
        entries = [named_entries.get(e.path, e) for e in entries]
        targets = [named_entries.get(e.path, e) for e in targets]
    return Plan(
        tuple(entries),
        tuple(local),
        tuple(sources),
        tuple(targets),
        budget.values,
        optimizers,
        root_record(state),
        has_dtensor,
    )


def _name_optimizer_state(
    entries: Sequence[Entry], optimizers: Mapping[KeyPath, list[str]], fqns: dict[str, KeyPath]
) -> dict[KeyPath, TensorEntry]:
    """DCP keys of optimizer state by parameter name, as ``get_state_dict`` gives them."""
    renamed: dict[KeyPath, TensorEntry] = {}
    for entry in entries:
        if not isinstance(entry, TensorEntry):
            continue
        named = dcpbytes.dcp_path(entry.path, optimizers)
        if named is None:
            continue
        fqn = fqn_of(named)
        other = fqns.get(fqn)
        if other is not None and other != entry.path:
            continue  # the name is taken: this tensor keeps its positional key
        del fqns[entry.fqn]
        fqns[fqn] = entry.path
        renamed[entry.path] = entry._replace(fqn=fqn, dcp_path=named)
    return renamed


def byte_entries(plan: Plan, *, snapshot: bool = False) -> list[dcpbytes.ByteEntry]:
    """The shared values as DCP byte entries; ``snapshot``: as planned (changed since, maybe)."""
    values = [
        (e.path, codec.decode(e.encoded) if snapshot and e.encoded is not None else e.value)
        for e in plan.entries
        if isinstance(e, ValueEntry)
    ]
    taken = {e.fqn for e in (*plan.entries, *plan.local) if isinstance(e, TensorEntry)}
    return dcpbytes.plan_bytes(values, taken, plan.optimizers)


def _entry_overhead(e: Entry) -> int:
    """An upper bound on an entry's manifest bytes, its value aside (every integer widest)."""
    keys = "".join(e.path)  # the keys' bounds summed: 5 bytes of header each
    n = 48 + 5 * len(e.path) + (len(keys) if keys.isascii() else 4 * len(keys))
    if isinstance(e, TensorEntry):  # and the fqn's: 5 bytes of header
        fqn = e.fqn
        n += 202 + 16 + 5 + (len(fqn) if fqn.isascii() else 4 * len(fqn)) + 27 * len(e.shape)
    return n


class _Budget:
    """A manifest's bytes and decode budget, counted while planning (each value encoded once)."""

    def __init__(self) -> None:
        self.values = 0
        self.value_bytes = 0
        self.containers = 0
        self.overhead = 0
        self.largest: tuple[int, KeyPath] = (-1, ())

    def encode(self, path: KeyPath, value: Any) -> bytes:
        data, containers = codec.encode_counted(value, where=_where(path))
        self.values += 1
        self.value_bytes += len(data)
        self.containers += containers
        self.largest = max(self.largest, (len(data), path))
        return data

    def check(self, entries: Sequence[Entry]) -> None:
        room = LIMITS.manifest_bytes - self.overhead
        if room < 0:
            raise UnsupportedValue(
                f"state: its {len(entries)} entries need more than the {LIMITS.manifest_bytes} "
                "manifest bytes a reader accepts; save it in parts"
            )
        free = LIMITS.decode_free_containers // 2  # the other half: the entries' own
        budget = container_budget(self.value_bytes, free)
        if self.value_bytes > room:
            problem = (
                f"the values encode to {self.value_bytes} bytes, more than the {room} the "
                "manifest has room for"
            )
        elif self.containers > budget:
            problem = (
                f"{self.containers} containers in {self.value_bytes} encoded bytes exceed the "
                f"decode budget ({budget})"
            )
        else:
            return
        raise UnsupportedValue(
            f"{_where(self.largest[1])} is the largest value of a state that a reader "
            f"would refuse: {problem}; store bulk data as tensors"
        )


def check_destination(path: Path, overwrite: bool) -> None:
    """Refuse, before anything is written, a destination a save may not replace."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise CheckpointExists(f"{path}: the destination exists and is not a checkpoint directory")
    if path.exists() and not overwrite:
        raise CheckpointExists(
            f"{path}: a checkpoint already exists here; pass overwrite=True to replace it"
        )
    if path.exists():
        commit.check_replaceable(path)
    if naming.is_temporary_name(path.name):
        raise CheckpointError(
            f"{path}: names containing {naming.TMP_INFIX!r} or {naming.TRASH_INFIX!r} are reserved"
        )


@dataclass(frozen=True)
class Prepared:
    """A save checked and planned, nothing written."""

    dest: Path
    plan: Plan
    metadata: dict[str, Any]
    metadata_bytes: bytes


def prepare_save(
    path: PathLike,
    state: TensorDictBase | Mapping[str, Any],
    metadata: Mapping[str, Any] | None,
    overwrite: bool,
    *,
    per_rank: Sequence[str] = DEFAULT_PER_RANK,
    rank: int = 0,
    check_path: bool = True,
) -> Prepared:
    """Everything a save checks before writing a byte: destination, metadata, tree."""
    from functional_ckpt._src.version import __version__

    dest = Path(path)
    if check_path:
        check_destination(dest, overwrite)
    host, pid = socket.gethostname(), os.getpid()
    auto = {"hostname": host, "torch": str(torch.__version__), "functional_ckpt": __version__}
    meta = {**auto, "pid": pid, **dict(metadata or {})}
    meta_bytes = codec.encode(meta, where="metadata")
    return Prepared(dest, plan_save(state, per_rank=per_rank, rank=rank), meta, meta_bytes)
