"""The hardened reader of ``.metadata`` files (a stock checkpoint's, or one being verified).

A pickle runs code, so a pure-Python unpickler vets every opcode: it resolves only
DCP's metadata names, to torch-free stand-ins (:mod:`.dcp_standins`), fills only
instances it created, and checks every field's type before DCP objects are made.
"""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from functional_ckpt._src.format import dcp_standins as sd
from functional_ckpt._src.format.dcp_standins import (
    _MEM_FORMAT_ENCODING,
    ALLOWED,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    _StorageInfo,
)
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata as DcpMetadata

#: Largest foreign ``.metadata`` parsed (the pure-Python unpickler is slow).
MAX_BYTES = 1 << 30

#: Classes whose instances the unpickler may create and fill (``NEWOBJ`` + ``BUILD``).
_DATA_CLASSES: dict[type, tuple[str, ...]] = {cls: cls.FIELDS for cls in sd.DATA_CLASSES}
_DATA_CLASSES[TensorProperties] = ()  # state is DCP's 5-tuple, checked by _properties


_DICTS = (dict, collections.OrderedDict)


def _refuse(what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"refusing {what}: DCP metadata may only hold DCP's own metadata")


def _plain_ints(args: Any) -> bool:
    return isinstance(args, tuple) and all(type(a) is int for a in args)


def _refuser(what: str) -> Callable[[Any], None]:
    def load(self: Any) -> None:
        raise _refuse(what)

    return load


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
        if cls is TensorProperties:
            _properties(state)
            inst.__setstate__(state)
            return
        fields = _DATA_CLASSES[cls]
        if not isinstance(state, dict) or not all(type(k) is str and k in fields for k in state):
            raise _refuse(f"state {type(state).__name__} for {cls.__name__}")
        vars(inst).update(state)

    def _fill(self, obj: Any, kinds: tuple[type, ...], keys: list[Any] | None = None) -> None:
        # Every dict, list and set on the stack was made by this load's own opcodes
        # (no allowed global is one), so only the type needs checking.
        if type(obj) not in kinds:
            raise _refuse(f"to modify a {type(obj).__name__}")
        if keys is not None:
            self._count(obj, keys)

    def _marked(self) -> Any:
        if not self.metastack or not self.metastack[-1]:
            raise CorruptCheckpoint("malformed pickle (no object before a mark)")
        return self.metastack[-1][-1]

    def _count(self, table: Any, keys: list[Any]) -> None:
        """Refuse keys that would flood ``table`` (the msgpack decoder's bound), over
        every key it ever receives."""
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

    def load_setitem(self) -> None:
        if len(self.stack) < 3:
            raise CorruptCheckpoint("malformed pickle (stack underflow)")
        self._fill(self.stack[-3], _DICTS, [self.stack[-2]])
        super().load_setitem()  # type: ignore[misc]

    def load_setitems(self) -> None:
        self._fill(self._marked(), _DICTS, self.stack[::2])
        super().load_setitems()  # type: ignore[misc]

    def load_dict(self) -> None:
        self._count(object(), self.stack[::2])  # a new table from the marked items
        super().load_dict()  # type: ignore[misc]

    def load_frozenset(self) -> None:
        self._count(object(), self.stack)
        super().load_frozenset()  # type: ignore[misc]

    def load_append(self) -> None:
        if len(self.stack) < 2:
            raise CorruptCheckpoint("malformed pickle (stack underflow)")
        self._fill(self.stack[-2], (list,))
        super().load_append()  # type: ignore[misc]

    def load_appends(self) -> None:
        self._fill(self._marked(), (list,))
        super().load_appends()  # type: ignore[misc]

    def load_additems(self) -> None:
        self._fill(self._marked(), (set,), self.stack)
        super().load_additems()  # type: ignore[misc]

    _VETTED = (
        "NEWOBJ NEWOBJ_EX REDUCE BUILD SETITEM SETITEMS APPEND APPENDS ADDITEMS DICT FROZENSET"
    )
    for _name in _VETTED.split():
        dispatch[getattr(pickle, _name)[0]] = locals()[f"load_{_name.lower()}"]
    # copyreg's extension cache hands back objects without asking find_class
    for _op, _what in (
        (pickle.INST, "protocol-0 instances"),
        (pickle.OBJ, "protocol-1 instances"),
        *((op, "extension codes (copyreg)") for op in (pickle.EXT1, pickle.EXT2, pickle.EXT4)),
    ):
        dispatch[_op[0]] = _refuser(_what)
    del _VETTED, _name, _op, _what


_PROPERTIES = [sd.DType, sd.Layout, bool, _MEM_FORMAT_ENCODING, bool]  # DCP's state tuple
_NAMED = [sd.DType, sd.Layout, sd.MemoryFormat]


def _properties(state: Any) -> None:
    if not (isinstance(state, tuple) and [type(x) for x in state] == _PROPERTIES):
        raise _refuse("malformed TensorProperties")


def _bad(where: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"malformed DCP metadata: {where}")


def _check_fields(obj: Any, cls: type, where: str) -> None:
    if type(obj) is not cls:
        raise _bad(f"{where} is a {type(obj).__name__}, not a {cls.__name__}")
    if cls is TensorProperties and "dtype" not in vars(obj):
        raise _bad(f"{where} has no state")
    if cls is not TensorProperties and set(vars(obj)) - set(_DATA_CLASSES[cls]):
        raise _bad(f"{where} has unexpected attributes")
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
    if id(v) in seen:
        return True
    if type(v) in (tuple, list):
        seen.add(id(v))
        return all(is_plain(x, depth + 1, seen) for x in v)
    if type(v) in _DICTS:
        seen.add(id(v))
        return all(
            is_plain(k, depth + 1, seen) and is_plain(x, depth + 1, seen) for k, x in v.items()
        )
    return False


def check(md: Any) -> Metadata:
    """The loaded object, if it is exactly DCP metadata (as stand-ins) of plain fields."""
    _check_fields(md, Metadata, "the root")
    sdm = md.state_dict_metadata
    if type(sdm) not in _DICTS:
        raise _bad("state_dict_metadata is not a dict")
    for fqn, smd in sdm.items():
        if type(fqn) is not str:
            raise _bad("a key is not a string")
        if type(smd) is BytesStorageMetadata:
            _check_fields(smd, BytesStorageMetadata, fqn)
            continue
        _check_fields(smd, TensorStorageMetadata, fqn)
        if type(smd.properties) is not TensorProperties:
            raise _bad(f"{fqn}: properties")
        p = smd.properties
        _check_fields(p, TensorProperties, f"{fqn}: properties")
        if [type(p.dtype), type(p.layout), type(p.memory_format)] != _NAMED:
            raise _bad(f"{fqn}: properties")
        _size(smd.size, f"{fqn}: size")
        if type(smd.chunks) is not list:
            raise _bad(f"{fqn}: chunks")
        for c in smd.chunks:
            _check_fields(c, ChunkStorageMetadata, f"{fqn}: chunk")
            _size(c.offsets, f"{fqn}: chunk offsets")
            _size(c.sizes, f"{fqn}: chunk sizes")
    storage = md.storage_data
    if storage is not None:
        if type(storage) not in _DICTS:
            raise _bad("storage_data is not a dict")
        for k, v in storage.items():
            _check_fields(k, MetadataIndex, "a storage key")
            if type(k.fqn) is not str or not (k.offset is None or type(k.offset) is sd.Size):
                raise _bad("a storage key")
            _check_fields(v, _StorageInfo, f"storage of {k.fqn!r}")
            td = v.transform_descriptors
            plain_td = td is None or (type(td) in (list, tuple) and all(type(t) is str for t in td))
            ok = type(v.relative_path) is str and _natural(v.offset) and _natural(v.length)
            if not (ok and plain_td):
                raise _bad(f"storage of {k.fqn!r}")
    if md.storage_meta is not None:
        _check_fields(md.storage_meta, StorageMeta, "storage_meta")
        sm = md.storage_meta
        if not (
            type(sm.checkpoint_id) in (type(None), str, *sd.PATHS)
            and is_plain(sm.save_id)
            and is_plain(sm.load_id)
            and is_plain(sm.modules)
        ):
            raise _bad("storage_meta")
    if not (is_plain(md.planner_data) and type(md.version) in (str, type(None))):
        raise _bad("planner_data or version")
    return md  # type: ignore[no-any-return]


def load_standins(raw: bytes, source: Path) -> Metadata:
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
    """DCP's own ``Metadata`` of a ``.metadata``, made by DCP's constructors from the
    checked stand-ins (:func:`load_standins`): nothing reaches torch before it is vetted."""
    import torch
    from torch.distributed.checkpoint import metadata as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo

    md = load_standins(raw, source)
    size = torch.Size

    def tensor(smd: Any) -> Any:
        if type(smd) is BytesStorageMetadata:
            return dcp.BytesStorageMetadata()
        p = smd.properties
        props = dcp.TensorProperties(
            dtype=getattr(torch, p.dtype.name),
            layout=getattr(torch, p.layout.name),
            requires_grad=p.requires_grad,
            memory_format=getattr(torch, p.memory_format.name),
            pin_memory=p.pin_memory,
        )
        chunks = [dcp.ChunkStorageMetadata(size(c.offsets), size(c.sizes)) for c in smd.chunks]
        return dcp.TensorStorageMetadata(props, size(smd.size), chunks)

    sdm = md.state_dict_metadata
    state = type(sdm)((fqn, tensor(smd)) for fqn, smd in sdm.items())
    storage = md.storage_data
    if storage is not None:
        storage = type(storage)(
            (
                dcp.MetadataIndex(k.fqn, k.offset, k.index),
                DcpStorageInfo(v.relative_path, v.offset, v.length, v.transform_descriptors),
            )
            for k, v in storage.items()
        )
    sm = md.storage_meta
    meta = None
    if sm is not None:
        meta = dcp.StorageMeta(sm.checkpoint_id, sm.save_id, sm.load_id, sm.modules)
    return dcp.Metadata(state, md.planner_data, storage, meta, md.version)


def scan_pickle(raw: bytes, source: Path) -> UnsafeCheckpoint | None:
    """Whether a pickle names anything outside the allow-list, read statically: tells a
    hostile ``.metadata`` from a merely damaged one."""
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
            elif name == "GLOBAL":
                mod, _, attr = str(arg).partition(" ")
                if (mod, attr) not in ALLOWED:
                    return UnsafeCheckpoint(f"{source}: refusing to load {mod}.{attr}")
                recent.append(None)
            elif name == "STACK_GLOBAL":
                module, qual = recent[-2:] if len(recent) >= 2 else (None, None)
                if module is not None and qual is not None and (module, qual) not in ALLOWED:
                    return UnsafeCheckpoint(f"{source}: refusing to load {module}.{qual}")
                recent.append(None)
            else:
                recent.append(None)
            del recent[:-4]
    except Exception:
        return None
    return None
