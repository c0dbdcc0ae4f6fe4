"""The hardened reader of ``.metadata`` files (a stock checkpoint's, or one being verified),
and whether one says what the manifest says.

A pickle runs code, so every opcode is vetted: only DCP's metadata names resolve, to
torch-free stand-ins, and every field's type is checked. A file is compared with its
manifest by what ``dcp.load`` finds things by (kinds, dtypes, shapes, chunks, offsets,
key paths), without torch.
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import pickletools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from functional_ckpt._src.format import dcp_standins as sd
from functional_ckpt._src.format.dcp_standins import _MEM_FORMAT_ENCODING, ALLOWED
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import TensorEntry
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata as DcpMetadata

#: Largest foreign ``.metadata`` parsed (the pure-Python unpickler is slow).
MAX_BYTES = 1 << 30

#: Classes whose instances the unpickler may create and fill (``NEWOBJ`` + ``BUILD``).
_DATA_CLASSES: dict[type, tuple[str, ...]] = {cls: cls.FIELDS for cls in sd.DATA_CLASSES}
_DATA_CLASSES[sd.TensorProperties] = ()  # state is DCP's 5-tuple, checked by _properties


_DICTS = (dict, collections.OrderedDict)


def _refuse(what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"refusing {what}: DCP metadata may only hold DCP's own metadata")


def _plain_ints(args: Any) -> bool:
    return isinstance(args, tuple) and all(type(a) is int for a in args)


def _refusing(what: str, self: Any) -> None:
    raise _refuse(what)


def _filler(
    name: str, kinds: tuple[type, ...] | None, at: int, keys: slice | None
) -> Callable[[Any], None]:
    """Pickle's ``load_<name>``, vetted: it fills one of ``kinds`` and floods no table."""
    load = getattr(pickle._Unpickler, f"load_{name.lower()}")

    def vetted(self: Any) -> None:
        if len(self.stack) < -at:
            raise CorruptCheckpoint("malformed pickle (stack underflow)")
        table = object() if kinds is None else self.stack[at] if at else self._marked()
        if kinds is not None and type(table) not in kinds:
            raise _refuse(f"to modify a {type(table).__name__}")
        if keys is not None:
            self._count(table, self.stack[keys])
        load(self)

    return vetted


class RestrictedUnpickler(pickle._Unpickler):
    """A pure-Python unpickler whose every object-making opcode is vetted."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]
    metastack: list[list[Any]]
    append: Callable[[Any], None]

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._fresh: dict[int, Any] = {}  # objects this load created (kept alive)
        # per hash table being filled: the table (kept alive) and its keys' hash counts
        self._hashes: dict[int, tuple[Any, collections.Counter[int]]] = {}

    def find_class(self, module: str, name: str) -> Any:
        obj = ALLOWED.get((module, name))
        if obj is None:
            raise _refuse(f"to load {module}.{name}")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise _refuse("persistent ids")

    def _new(self, cls: Any, args: Any, kwargs: Any) -> Any:
        if kwargs or not isinstance(cls, type):
            raise _refuse(f"to create {cls!r}")
        if cls in _DATA_CLASSES:
            if args:
                raise _refuse(f"arguments to {cls.__name__}.__new__")
            obj: Any = object.__new__(cls)
        elif cls in sd.PATHS and all(type(a) is str for a in args):
            obj = cls(*args)
        elif cls is collections.OrderedDict and not args:
            obj = collections.OrderedDict()
        else:
            raise _refuse(f"to create {getattr(cls, '__name__', cls)!r}")
        self._fresh[id(obj)] = obj
        return obj

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, None)

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        self.stack[-1] = self._new(self.stack[-1], args, kwargs)

    def load_reduce(self) -> None:
        args = self.stack.pop()
        func = self.stack[-1]
        if func is sd.Size and isinstance(args, tuple) and len(args) == 1:
            dims = args[0]
            if not _plain_ints(dims):
                raise _refuse("a torch.Size of non-integers")
            value: Any = sd.Size(dims)
        elif func is sd._get_layout and args in (("torch.strided",),):
            value = sd.STRIDED
        elif func is _MEM_FORMAT_ENCODING and _plain_ints(args) and len(args) == 1:
            value = _MEM_FORMAT_ENCODING(args[0])
        elif func is collections.OrderedDict and args == ():
            value = collections.OrderedDict()
            self._fresh[id(value)] = value
        elif func in sd.PATHS and all(type(a) is str for a in args):
            value = func(*args)
        else:
            raise _refuse(f"to call {getattr(func, '__name__', func)!r}")
        self.stack[-1] = value

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        cls = type(inst)
        if id(inst) not in self._fresh or cls not in _DATA_CLASSES:
            raise _refuse(f"to set attributes on {getattr(inst, '__name__', cls.__name__)}")
        if cls is sd.TensorProperties:
            _properties(state)
            inst.__setstate__(state)
            return
        fields = _DATA_CLASSES[cls]
        if not isinstance(state, dict) or not all(type(k) is str and k in fields for k in state):
            raise _refuse(f"state {type(state).__name__} for {cls.__name__}")
        vars(inst).update(state)

    def _marked(self) -> Any:
        if not self.metastack or not self.metastack[-1]:
            raise CorruptCheckpoint("malformed pickle (no object before a mark)")
        return self.metastack[-1][-1]

    def _count(self, table: Any, keys: list[Any]) -> None:
        """Refuse keys that would flood ``table``, over every key it ever receives."""
        counts = self._hashes.setdefault(id(table), (table, collections.Counter()))[1]
        for key in keys:
            try:
                h = hash(key)
            except TypeError:
                raise CorruptCheckpoint("malformed pickle (an unhashable key)") from None
            counts[h] += 1
            if counts[h] > LIMITS.equal_hashes:
                raise UnsafeCheckpoint(
                    f"{counts[h]} keys share one hash value "
                    f"(at most {LIMITS.equal_hashes} may): a hash flood"
                )

    # Each opcode that fills a container: the kinds it may fill (None: a new one), where
    # that lies (on the stack, or 0: below the mark) and the keys it adds. Every dict,
    # list and set on the stack was made by this load's own opcodes (no allowed global
    # is one), so only the type needs checking.
    for _name, _kinds, _at, _keys in (
        ("SETITEM", _DICTS, -3, slice(-2, -1)),
        ("SETITEMS", _DICTS, 0, slice(None, None, 2)),
        ("DICT", None, 0, slice(None, None, 2)),
        ("FROZENSET", None, 0, slice(None)),
        ("APPEND", (list,), -2, None),
        ("APPENDS", (list,), 0, None),
        ("ADDITEMS", (set,), 0, slice(None)),
    ):
        dispatch[getattr(pickle, _name)[0]] = _filler(_name, _kinds, _at, _keys)
    for _name in ("NEWOBJ", "NEWOBJ_EX", "REDUCE", "BUILD"):
        dispatch[getattr(pickle, _name)[0]] = locals()[f"load_{_name.lower()}"]
    # copyreg's extension cache hands back objects without asking find_class
    for _op, _what in (
        (pickle.INST, "protocol-0 instances"),
        (pickle.OBJ, "protocol-1 instances"),
        *((op, "extension codes (copyreg)") for op in (pickle.EXT1, pickle.EXT2, pickle.EXT4)),
    ):
        dispatch[_op[0]] = functools.partial(_refusing, _what)
    del _name, _kinds, _at, _keys, _op, _what


_PROPERTIES = [sd.DType, sd.Layout, bool, _MEM_FORMAT_ENCODING, bool]  # DCP's state tuple
_NAMED = [sd.DType, sd.Layout, sd.MemoryFormat]


def _properties(state: Any) -> None:
    if not (isinstance(state, tuple) and [type(x) for x in state] == _PROPERTIES):
        raise _refuse("malformed TensorProperties")


def _bad(where: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"malformed DCP metadata: {where}")


def _check_fields(obj: Any, cls: type, where: str) -> None:
    """``obj`` is a ``cls`` (its fields only); fields its pickle left out take DCP's defaults."""
    if type(obj) is not cls:
        raise _bad(f"{where} is a {type(obj).__name__}, not a {cls.__name__}")
    if cls is sd.TensorProperties and "dtype" not in vars(obj):
        raise _bad(f"{where} has no state")
    for name in _DATA_CLASSES[cls]:
        if name not in vars(obj):
            object.__setattr__(obj, name, getattr(cls, name, None))


def _natural(v: Any) -> bool:
    return type(v) is int and v >= 0


def _size(v: Any, where: str) -> None:
    if type(v) is not sd.Size or not all(map(_natural, v)):
        raise _bad(f"{where} is not a size")


def is_plain(v: Any, depth: int = 0, seen: set[int] | None = None) -> bool:
    """None, numbers, strings, and lists, tuples and dicts of them; shared containers once."""
    if depth > 32:
        return False
    if v is None or type(v) in (str, int, bool, float):
        return True
    seen = set() if seen is None else seen
    if id(v) in seen or type(v) not in (tuple, list, *_DICTS):
        return id(v) in seen
    seen.add(id(v))
    items = (x for kv in v.items() for x in kv) if type(v) in _DICTS else v
    return all(is_plain(x, depth + 1, seen) for x in items)


def check(md: Any) -> sd.Metadata:
    """The loaded object, if it is exactly DCP metadata (as stand-ins) of plain fields."""
    _check_fields(md, sd.Metadata, "the root")
    sdm = md.state_dict_metadata
    if type(sdm) not in _DICTS:
        raise _bad("state_dict_metadata is not a dict")
    for fqn, smd in sdm.items():
        if type(fqn) is not str:
            raise _bad("a key is not a string")
        if type(smd) is sd.BytesStorageMetadata:
            _check_fields(smd, sd.BytesStorageMetadata, fqn)
            continue
        _check_fields(smd, sd.TensorStorageMetadata, fqn)
        p = smd.properties
        _check_fields(p, sd.TensorProperties, f"{fqn}: properties")
        if [type(p.dtype), type(p.layout), type(p.memory_format)] != _NAMED:
            raise _bad(f"{fqn}: properties")
        _size(smd.size, f"{fqn}: size")
        if type(smd.chunks) is not list:
            raise _bad(f"{fqn}: chunks")
        for c in smd.chunks:
            _check_fields(c, sd.ChunkStorageMetadata, f"{fqn}: chunk")
            _size(c.offsets, f"{fqn}: chunk offsets")
            _size(c.sizes, f"{fqn}: chunk sizes")
    storage = md.storage_data
    if storage is not None and type(storage) not in _DICTS:
        raise _bad("storage_data is not a dict")
    for k, v in (storage or {}).items():
        _check_fields(k, sd.MetadataIndex, "a storage key")
        if type(k.fqn) is not str or not (k.offset is None or type(k.offset) is sd.Size):
            raise _bad("a storage key")
        _check_fields(v, sd._StorageInfo, f"storage of {k.fqn!r}")
        td = v.transform_descriptors
        plain_td = td is None or (type(td) in (list, tuple) and all(type(t) is str for t in td))
        ok = type(v.relative_path) is str and _natural(v.offset) and _natural(v.length)
        if not (ok and plain_td):
            raise _bad(f"storage of {k.fqn!r}")
    sm = md.storage_meta
    if sm is not None:
        _check_fields(sm, sd.StorageMeta, "storage_meta")
        ok = type(sm.checkpoint_id) in (type(None), str, *sd.PATHS)
        if not (ok and is_plain(sm.save_id) and is_plain(sm.load_id) and is_plain(sm.modules)):
            raise _bad("storage_meta")
    if not (is_plain(md.planner_data) and type(md.version) in (str, type(None))):
        raise _bad("planner_data or version")
    return md  # type: ignore[no-any-return]


def load_standins(raw: bytes, source: Path) -> sd.Metadata:
    """A ``.metadata`` as checked stand-ins, running nothing in it (torch-free)."""
    if len(raw) > MAX_BYTES:
        raise CorruptCheckpoint(f"{source}: {len(raw)} bytes of DCP metadata is more than allowed")
    try:
        md = RestrictedUnpickler(raw).load()
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{source}: {e}") from None
    except RecursionError:
        raise UnsafeCheckpoint(f"{source}: DCP metadata nested too deeply") from None
    except Exception as e:  # any malformed pickle
        raise CorruptCheckpoint(f"{source}: unreadable DCP metadata ({e})") from None
    try:
        return check(md)
    except CorruptCheckpoint as e:
        raise CorruptCheckpoint(f"{source}: {e}") from None


def load_foreign(raw: bytes, source: Path) -> DcpMetadata:
    """DCP's own ``Metadata`` of a ``.metadata``, made from the checked stand-ins."""
    import torch
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as dcp

    made: dict[int, Any] = {}  # each object once, shared as in the pickle (no copy flood)

    def real(v: Any) -> Any:
        got = made.get(id(v))
        if got is not None:
            return got
        t = type(v)
        if t is sd.Size:
            out: Any = torch.Size(v)
        elif isinstance(v, sd.DType | sd.Layout | sd.MemoryFormat):
            out = getattr(torch, v.name)
        elif t in _DATA_CLASSES:
            cls = getattr(filesystem if t is sd._StorageInfo else dcp, t.__name__)
            out = cls(**{k: real(x) for k, x in vars(v).items()})
        elif t in _DICTS:
            out = t((real(k), real(x)) for k, x in v.items())
        elif t is list:
            out = [real(x) for x in v]
        else:
            return v
        made[id(v)] = out
        return out

    return real(load_standins(raw, source))  # type: ignore[no-any-return]


def scan_pickle(raw: bytes, source: Path) -> UnsafeCheckpoint | None:
    """Whether a pickle names anything outside the allow-list: hostile, not merely damaged."""
    recent: list[str | None] = []  # what the last opcodes pushed (strings only)
    memo: dict[int, str | None] = {}
    try:
        for op, arg, _ in pickletools.genops(raw):
            name = op.name
            if name in ("PROTO", "FRAME", "MARK", "STOP"):
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(str(arg))] = recent[-1] if recent else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(int(str(arg))))
            elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
                recent.append(str(arg))
            elif name in ("GLOBAL", "STACK_GLOBAL"):  # STACK_GLOBAL: the last two strings
                got = str(arg).partition(" ")[::2] if name == "GLOBAL" else tuple(recent[-2:])
                if len(got) == 2 and None not in got and got not in ALLOWED:
                    return UnsafeCheckpoint(f"{source}: refusing to load {got[0]}.{got[1]}")
                recent.append(None)
            else:
                recent.append(None)
            del recent[:-4]
    except Exception:
        return None
    return None


#: A ``.metadata`` as ``dcp.load`` uses it: per key (dtype, shape, chunk boxes) or
#: ``"bytes"``; per stored piece (key, offsets) its (file, offset, length, transforms);
#: the key paths.
View = tuple[dict[str, Any], dict[tuple[str, Any], Any], Any]


def manifest_view(groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry]) -> View:
    """What the ``.metadata`` derived from these entries says (later entries of a key win)."""
    chunks: dict[str, Any] = {}
    storage: dict[tuple[str, Any], Any] = {}
    planner: dict[str, Any] = {}
    for e in (e for group in groups for e in group):
        chunks[e.fqn] = (sd.DType(e.dtype_name), tuple(e.shape), _boxes(e.chunks))
        planner[e.fqn] = tuple(e.path if e.dcp_path is None else e.dcp_path)
        for c in e.chunks:
            storage[(e.fqn, tuple(c.offsets))] = (c.file, c.offset, c.length, c.transforms)
    for b in blobs:
        chunks[b.fqn] = "bytes"
        planner[b.fqn] = tuple(b.path)
        storage[(b.fqn, None)] = (b.file, b.offset, b.length, None)
    return chunks, storage, planner


def file_view(md: Any) -> View:
    """What a parsed ``.metadata`` (:func:`load_standins`) says."""
    chunks: dict[str, Any] = {}
    for fqn, smd in md.state_dict_metadata.items():
        tensor = type(smd) is sd.TensorStorageMetadata
        chunks[fqn] = (
            (smd.properties.dtype, tuple(smd.size), _boxes(smd.chunks)) if tensor else "bytes"
        )
    data = md.storage_data if isinstance(md.storage_data, dict) else {}
    storage: dict[tuple[str, Any], Any] = {}
    for k, v in data.items():
        key = (k.fqn, None if k.offset is None else tuple(k.offset))
        storage[key] = (v.relative_path, v.offset, v.length, v.transform_descriptors)
    return chunks, storage, md.planner_data


def _boxes(chunks: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)


def compare(
    md: sd.Metadata, groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry]
) -> list[str]:
    """Every way ``md`` would make stock DCP read other than the manifest says, at most 20."""
    found, expected = file_view(md), manifest_view(groups, blobs)
    problems: list[str] = []
    a, b = found[0], expected[0]
    for fqn in sorted(set(a) | set(b)):
        if fqn not in b:
            problems.append(f"tensor {fqn!r} is not in the manifest")
        elif fqn not in a:
            problems.append(f"tensor {fqn!r} of the manifest is missing")
        elif a[fqn] != b[fqn]:
            problems.append(f"tensor {fqn!r}: {a[fqn]} where the manifest says {b[fqn]}")
    sa, sb = found[1], expected[1]
    for key in sorted(set(sa) | set(sb), key=repr):
        if sa.get(key) != sb.get(key):
            problems.append(
                f"storage of {key[0]!r} at {key[1]}: {sa.get(key)} where the manifest says "
                f"{sb.get(key)}"
            )
    if found[2] != expected[2]:
        problems.append("planner data (key paths) differ from the manifest")
    return problems[:20]
