"""The hardened reader of ``.metadata`` files: a stock checkpoint's, or one being verified.

Stock DCP checkpoints have no manifest, so their ``.metadata`` must be parsed, and
``fc.verify`` parses ours to compare it with the manifest. A pure-Python unpickler
whose opcodes are vetted one by one does it: it resolves only the names of DCP's
metadata classes and a few plain types, to plain stand-ins (:mod:`.dcp_standins`:
no torch is imported, and no torch object is within its reach), builds objects
only of those classes, sets attributes only on instances it created itself (never
on a class, function, module or shared singleton), and checks the type of every
field of the result (:func:`load_standins`). :func:`load_foreign` then makes DCP's
own objects of the checked fields for a stock checkpoint's reader.
:func:`scan_pickle` reads a pickle's opcodes statically to tell a hostile file
from a damaged one.
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

#: Largest foreign ``.metadata`` parsed (the pure-Python unpickler is slow and hostile
#: files are bounded by it).
MAX_BYTES = 1 << 30

#: Classes whose instances the unpickler may create and fill (``NEWOBJ`` + ``BUILD``).
_DATA_CLASSES: dict[type, tuple[str, ...]] = {cls: cls.FIELDS for cls in sd.DATA_CLASSES}
_DATA_CLASSES[TensorProperties] = ()  # state is DCP's 5-tuple, checked by _properties

_PATHS = sd.PATHS


def _refuse(what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"refusing {what}: DCP metadata may only hold DCP's own metadata")


def _plain_ints(args: Any) -> bool:
    return isinstance(args, tuple) and all(type(a) is int for a in args)


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
        elif cls in _PATHS and all(type(a) is str for a in args):
            obj = cls(*args)
        elif cls is collections.OrderedDict and not args:
            obj = collections.OrderedDict()
        else:
            raise _refuse(f"to create {getattr(cls, '__name__', cls)!r}")
        self._fresh[id(obj)] = obj
        return obj

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._new(cls, args, None))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._new(cls, args, kwargs))

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
        elif func in _PATHS and all(type(a) is str for a in args):
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

    def _container(self, obj: Any, kinds: tuple[type, ...]) -> None:
        # Every dict, list and set on the stack was made by this load's own opcodes
        # (no allowed global is one), so only the type needs checking.
        if type(obj) not in kinds:
            raise _refuse(f"to modify a {type(obj).__name__}")

    def _marked(self) -> Any:
        if not self.metastack or not self.metastack[-1]:
            raise CorruptCheckpoint("malformed pickle (no object before a mark)")
        return self.metastack[-1][-1]

    def _count(self, table: Any, keys: list[Any]) -> None:
        """Refuse keys that would flood ``table``, however many opcodes fill it.

        The bound is the msgpack decoder's (``LIMITS.equal_hashes`` keys per hash
        value), counted over every key the table ever receives, in linear time.
        """
        held = self._hashes.get(id(table))
        if held is None:
            held = self._hashes[id(table)] = (table, collections.Counter())
        counts = held[1]
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
        self._container(self.stack[-3], (dict, collections.OrderedDict))
        self._count(self.stack[-3], [self.stack[-2]])
        super().load_setitem()  # type: ignore[misc]

    def load_setitems(self) -> None:
        table = self._marked()
        self._container(table, (dict, collections.OrderedDict))
        self._count(table, self.stack[::2])
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
        self._container(self.stack[-2], (list,))
        super().load_append()  # type: ignore[misc]

    def load_appends(self) -> None:
        self._container(self._marked(), (list,))
        super().load_appends()  # type: ignore[misc]

    def load_additems(self) -> None:
        table = self._marked()
        self._container(table, (set,))
        self._count(table, self.stack)
        super().load_additems()  # type: ignore[misc]

    def load_inst(self) -> None:
        raise _refuse("protocol-0 instances")

    def load_obj(self) -> None:
        raise _refuse("protocol-1 instances")

    def load_ext(self) -> None:
        # copyreg's extension cache hands back objects without asking find_class
        raise _refuse("extension codes (copyreg)")

    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.BUILD[0]] = load_build
    dispatch[pickle.SETITEM[0]] = load_setitem
    dispatch[pickle.SETITEMS[0]] = load_setitems
    dispatch[pickle.APPEND[0]] = load_append
    dispatch[pickle.APPENDS[0]] = load_appends
    dispatch[pickle.ADDITEMS[0]] = load_additems
    dispatch[pickle.DICT[0]] = load_dict
    dispatch[pickle.FROZENSET[0]] = load_frozenset
    dispatch[pickle.INST[0]] = load_inst
    dispatch[pickle.OBJ[0]] = load_obj
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = load_ext
    del _op


def _properties(state: Any) -> None:
    if not (
        isinstance(state, tuple)
        and len(state) == 5
        and type(state[0]) is sd.DType
        and type(state[1]) is sd.Layout
        and type(state[2]) is bool
        and isinstance(state[3], _MEM_FORMAT_ENCODING)
        and type(state[4]) is bool
    ):
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
            setattr_default = getattr(cls, name, None)
            object.__setattr__(obj, name, setattr_default)


def _size(v: Any, where: str) -> None:
    if type(v) is not sd.Size or not all(type(d) is int and d >= 0 for d in v):
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
    if type(v) in (dict, collections.OrderedDict):
        seen.add(id(v))
        return all(
            is_plain(k, depth + 1, seen) and is_plain(x, depth + 1, seen) for k, x in v.items()
        )
    return False


def check(md: Any) -> Metadata:
    """The loaded object, if it is exactly DCP metadata (as stand-ins) of plain fields."""
    _check_fields(md, Metadata, "the root")
    sdm = md.state_dict_metadata
    if type(sdm) not in (dict, collections.OrderedDict):
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
        if not (
            type(p.dtype) is sd.DType
            and type(p.layout) is sd.Layout
            and type(p.memory_format) is sd.MemoryFormat
        ):
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
        if type(storage) not in (dict, collections.OrderedDict):
            raise _bad("storage_data is not a dict")
        for k, v in storage.items():
            _check_fields(k, MetadataIndex, "a storage key")
            if type(k.fqn) is not str or not (k.offset is None or type(k.offset) is sd.Size):
                raise _bad("a storage key")
            _check_fields(v, _StorageInfo, f"storage of {k.fqn!r}")
            if not (
                type(v.relative_path) is str
                and type(v.offset) is int
                and type(v.length) is int
                and v.offset >= 0
                and v.length >= 0
                and (
                    v.transform_descriptors is None
                    or (
                        type(v.transform_descriptors) in (list, tuple)
                        and all(type(t) is str for t in v.transform_descriptors)
                    )
                )
            ):
                raise _bad(f"storage of {k.fqn!r}")
    if md.storage_meta is not None:
        _check_fields(md.storage_meta, StorageMeta, "storage_meta")
        sm = md.storage_meta
        if not (
            type(sm.checkpoint_id) in (type(None), str, *_PATHS)
            and is_plain(sm.save_id)
            and is_plain(sm.load_id)
            and is_plain(sm.modules)
        ):
            raise _bad("storage_meta")
    if not (is_plain(md.planner_data) and type(md.version) in (str, type(None))):
        raise _bad("planner_data or version")
    return md  # type: ignore[no-any-return]


def load_standins(raw: bytes, source: Path) -> Metadata:
    """Parse a ``.metadata``, running nothing in it: DCP's ``Metadata`` as plain stand-ins
    (:mod:`.dcp_standins`), every field checked; torch is not needed."""
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
    """Parse a ``.metadata`` we did not derive ourselves into DCP's own ``Metadata``.

    It is read and checked as stand-ins first (:func:`load_standins`); DCP's objects
    are then made from the checked fields by their constructors, so nothing in the
    file reaches a torch object before it is vetted.
    """
    return to_dcp(load_standins(raw, source))


def to_dcp(md: Metadata) -> DcpMetadata:
    """DCP's ``Metadata`` holding what the checked stand-ins ``md`` hold."""
    import torch
    from torch.distributed.checkpoint import metadata as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo as DcpStorageInfo

    def size(v: Any) -> torch.Size:
        return torch.Size(v)

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
    """Does a pickle name anything outside the allow-list? Read statically, never run.

    Tells a hostile ``.metadata`` from a merely damaged one without unpickling it.
    """
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
