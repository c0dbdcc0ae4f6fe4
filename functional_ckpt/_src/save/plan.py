"""The save plan: a state flattened once into manifest entries and the tensors to write.

Entries under per-rank roots (by default the top-level ``rng`` and ``loader``
subtrees) belong to the writing rank and are stored separately, so each rank gets
its own generators and data position back. Everything a reader would refuse is
refused here, before a byte is written, naming the key at fault.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from functional_ckpt._src import codec
from functional_ckpt._src.distributed.topology import is_dtensor as is_dtensor
from functional_ckpt._src.format import dcp_values as dcpbytes
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.keys import KeyPath, format_path, fqn_of, rank_fqn
from functional_ckpt._src.format.limits import LIMITS
from functional_ckpt._src.format.manifest import (
    Entry,
    NodeEntry,
    PerRankEntry,
    TensorEntry,
    ValueEntry,
    shape_problem,
)
from functional_ckpt._src.paths import PathLike as PathLike
from functional_ckpt._src.state.tree import as_state, iter_leaves, node_record
from functional_ckpt._src.storage import commit
from functional_ckpt.errors import CheckpointError, CheckpointExists, UnsupportedValue

#: Top-level subtrees that differ between ranks and are stored once per rank.
DEFAULT_PER_RANK = ("rng", "loader")


def _where(path: KeyPath) -> str:
    if len(path) > 16:  # a path refused for its depth would print hundreds of keys
        path = (*path[:8], f"...{len(path) - 14} levels...", *path[-6:])
    return f"state[{format_path(path)}]"


def check_path(path: KeyPath) -> None:
    """Refuse a key path that a reader would refuse."""
    if len(path) > LIMITS.key_depth:
        raise UnsupportedValue(
            f"{_where(path)}: the key path is {len(path)} levels deep; the format allows at "
            f"most {LIMITS.key_depth}, so flatten this part of the state"
        )


def check_tensor(t: torch.Tensor, path: KeyPath) -> None:
    """Refuse, before anything is written, a tensor the format cannot store or load back.

    Runs before anything else looks at the tensor (its alias key needs a data
    pointer, which sparse, nested and meta tensors do not have).
    """
    where = _where(path)
    if t.is_meta:
        raise UnsupportedValue(f"{where}: meta tensors hold no data and cannot be saved")
    if t.is_nested:
        raise UnsupportedValue(
            f"{where}: nested tensors are not supported; save their components "
            "(e.g. t.unbind()) as separate tensors"
        )
    if t.layout != torch.strided:
        raise UnsupportedValue(
            f"{where}: {t.layout} tensors are not supported; convert to dense (t.to_dense())"
        )
    if t.is_quantized:
        raise UnsupportedValue(
            f"{where}: quantized tensors are not supported; save t.int_repr() and the "
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
    problem = shape_problem(tuple(t.shape), t.dtype)
    if problem is not None:
        raise UnsupportedValue(
            f"{where}: a tensor of {problem} lies beyond the format's limits and could "
            "not be loaded back"
        )


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a lazy conjugate or negative bit applied to its values.

    Such a view shares its base's bytes but not its values; what is stored is
    always the values.
    """
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor: itself when it already is one, else a copy.

    The result may still require grad; whoever reads its bytes detaches it.
    """
    if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return t  # the common case, without a new tensor object
    t = resolved(t.detach())
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a tensor's values: two leaves with the same key are one tensor.

    Everything that makes two views of the same bytes read differently is part of
    it: where they start, their shape and strides, their dtype, and the lazy
    conjugate and negative bits.
    """
    if t.is_meta or t.numel() == 0 or is_dtensor(t):
        return None
    return (
        t.device,
        t.data_ptr(),
        t.shape,
        t.stride(),
        t.dtype,
        t.is_conj(),
        t.is_neg(),
    )


@dataclass
class Plan:
    """The flattened state ready to be written: manifest entries and tensors.

    ``entries`` is the shared tree, with a per-rank placeholder where a per-rank
    subtree stands; ``local`` holds this rank's per-rank entries. ``sources`` are
    the tensors to write and ``targets`` the entry each one fills (its chunks
    are filled in by the backend that writes them).
    """

    entries: list[Entry] = field(default_factory=list)
    local: list[Entry] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    targets: list[TensorEntry] = field(default_factory=list)
    num_values: int = 0
    optimizers: dict[KeyPath, list[str]] = field(default_factory=dict)  # parameter names
    root: dict[str, Any] | None = None  # the root's batch size and names, if batched
    has_dtensor: bool = False  # a DTensor's shards are written collectively
    checked: bool = False  # values and metadata passed check_encodable, no bytearray among them

    @property
    def keys(self) -> list[KeyPath]:
        return [t.path for t in self.targets]


def plan_save(
    state: TensorDictBase | Mapping[str, Any],
    *,
    per_rank: Sequence[str] = DEFAULT_PER_RANK,
    rank: int = 0,
) -> Plan:
    """Flatten a state into manifest entries and the tensors to write."""
    td = as_state(state)
    plan = Plan(root=node_record(td))
    fqns: dict[str, KeyPath] = {}
    seen: dict[tuple[Any, ...], TensorEntry] = {}
    roots = set(per_rank)
    for leaf in iter_leaves(td):
        path = leaf.path
        check_path(path)
        local = path[0] in roots
        entry: Entry
        if local and len(path) == 1:
            plan.entries.append(PerRankEntry(path))
        if leaf.kind == "node":
            entry = NodeEntry(path, leaf.value or None)
        elif leaf.kind == "value":
            entry = ValueEntry(path, leaf.value)
            plan.num_values += 1
            named = dcpbytes.optimizer_names(path, leaf.value)
            if named is not None and not local:
                plan.optimizers[named[0]] = named[1]
        else:
            t: torch.Tensor = leaf.value
            check_tensor(t, path)
            fqn = rank_fqn(rank, path) if local else fqn_of(path)
            other = fqns.get(fqn)
            if other is not None:
                raise UnsupportedValue(
                    f"state[{format_path(path)}] and state[{format_path(other)}] map to the "
                    f"same DCP key {fqn!r}; rename one of them"
                )
            fqns[fqn] = path
            entry = TensorEntry(path, fqn, t.dtype, tuple(t.shape), bool(t.requires_grad))
            if local:
                entry.dcp_path = (fqn.partition(".")[0], *path)
            key = _alias_key(t)
            if key is None and is_dtensor(t):
                plan.has_dtensor = True
            src = seen.get(key) if key is not None else None
            if src is not None and (src.path[0] in roots) == local:
                entry.alias = src.path
                entry.chunks = src.chunks  # one list: filled once, seen through both
            else:
                if key is not None:
                    seen[key] = entry
                plan.sources.append(resolved(t))
                plan.targets.append(entry)
        (plan.local if local else plan.entries).append(entry)
    if plan.optimizers:
        _name_optimizer_state(plan, fqns)
    plan.checked = not check_values(plan.entries + plan.local)
    return plan


def _name_optimizer_state(plan: Plan, fqns: dict[str, KeyPath]) -> None:
    """DCP keys of optimizer state by parameter name, as ``get_state_dict`` gives them."""
    for entry in plan.entries:
        if not isinstance(entry, TensorEntry):
            continue
        named = dcpbytes.dcp_path(entry.path, plan.optimizers)
        if named is None:
            continue
        fqn = fqn_of(named)
        other = fqns.get(fqn)
        if other is not None and other != entry.path:
            continue  # the name is taken: this tensor keeps its positional key
        del fqns[entry.fqn]
        fqns[fqn] = entry.path
        entry.fqn, entry.dcp_path = fqn, named


def byte_entries(plan: Plan) -> list[dcpbytes.ByteEntry]:
    """The shared values of a plan as DCP byte entries, for stock readers."""
    values = [(e.path, e.value) for e in plan.entries if isinstance(e, ValueEntry)]
    taken = {e.fqn for e in plan.entries + plan.local if isinstance(e, TensorEntry)}
    return dcpbytes.plan_bytes(values, taken, plan.optimizers)


def _text_bytes(s: str) -> int:
    """An upper bound on the encoded size of a string (header included)."""
    return 5 + (len(s) if s.isascii() else 4 * len(s))


def _entry_overhead(e: Entry) -> int:
    """An upper bound on the manifest bytes of an entry, its value aside.

    The constants are the encoded sizes of the fixed fields with every integer at
    its widest (a tensor entry with one chunk: 202 bytes), plus wide list headers.
    """
    n = 48 + sum(_text_bytes(k) for k in e.path)
    if isinstance(e, TensorEntry):
        n += 202 + 16 + _text_bytes(e.fqn) + 27 * len(e.shape)
    return n


def check_values(entries: list[Entry]) -> bool:
    """Fail before any byte is written if a value cannot be stored exactly.

    That includes the reader's budgets: the whole manifest must stay within
    ``LIMITS.manifest_bytes`` and the decode budget of containers. Returns
    whether a value holds a bytearray (see :func:`codec.check_encodable`).
    """
    held = [e for e in entries if isinstance(e, ValueEntry)]
    room = LIMITS.manifest_bytes - sum(_entry_overhead(e) for e in entries)
    try:
        return codec.check_encodable(
            [e.value for e in held], where="the state's values", max_bytes=room
        )
    except UnsupportedValue as exc:
        for e in held:  # name the leaf at fault, if one is
            codec.check_encodable(e.value, where=_where(e.path))
        # Only together are the values too large for a reader: name the largest.
        biggest = max(held, key=lambda e: len(codec.encode(e.value)), default=None)
        if biggest is None:
            raise UnsupportedValue(
                f"state: its {len(entries)} entries need more than the {LIMITS.manifest_bytes} "
                "manifest bytes a reader accepts; save it in parts"
            ) from None
        raise UnsupportedValue(
            f"{_where(biggest.path)} is the largest value of a state that a reader "
            f"would refuse: {exc}; store bulk data as tensors"
        ) from None


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


def auto_metadata() -> dict[str, Any]:
    """What every checkpoint records about where it came from."""
    from functional_ckpt._src.version import __version__

    return {
        "hostname": socket.gethostname(),
        "torch": str(torch.__version__),
        "functional_ckpt": __version__,
        "pid": os.getpid(),
    }


def prepare_save(
    path: PathLike,
    state: TensorDictBase | Mapping[str, Any],
    metadata: Mapping[str, Any] | None,
    overwrite: bool,
    *,
    per_rank: Sequence[str] = DEFAULT_PER_RANK,
    rank: int = 0,
    check_path: bool = True,
) -> tuple[Path, Plan, dict[str, Any]]:
    """Everything a save checks before writing a byte: destination, metadata, tree."""
    dest = Path(path)
    if check_path:
        check_destination(dest, overwrite)
    meta = {**auto_metadata(), **dict(metadata or {})}
    meta_has_bytearray = codec.check_encodable(meta, where="metadata")
    plan = plan_save(state, per_rank=per_rank, rank=rank)
    plan.checked = plan.checked and not meta_has_bytearray
    return dest, plan, meta
