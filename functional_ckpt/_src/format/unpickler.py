"""The hardened reader of ``.metadata`` files the project did not derive itself.

Stock DCP checkpoints have no manifest, so their ``.metadata`` must be parsed:
:func:`load_foreign` does it with a pure-Python unpickler whose opcodes are
vetted one by one. It resolves only DCP's metadata classes and a few plain types,
builds objects only of those classes, sets attributes only on instances it
created itself (never on a class, function, module or shared singleton), and
checks the type of every field of the result. :func:`scan_pickle` reads a pickle's
opcodes statically to tell a hostile file from a damaged one.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import pickletools
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.serialization
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint

#: Largest foreign ``.metadata`` parsed (the pure-Python unpickler is slow and hostile
#: files are bounded by it).
MAX_BYTES = 1 << 30


def _classes() -> dict[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {}
    md = "torch.distributed.checkpoint.metadata"
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _MEM_FORMAT_ENCODING,
    ):
        found[(md, cls.__name__)] = cls
    found[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    found[("torch", "Size")] = torch.Size
    found[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    found[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        found[("pathlib", name)] = getattr(pathlib, name)
        found[("pathlib._local", name)] = getattr(pathlib, name)
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
            found[("torch", name)] = obj
    return found


ALLOWED: dict[tuple[str, str], Any] = _classes()

#: Classes whose instances the unpickler may create and fill (``NEWOBJ`` + ``BUILD``).
_DATA_CLASSES: dict[type, tuple[str, ...]] = {
    Metadata: ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
    TensorStorageMetadata: ("properties", "size", "chunks"),
    BytesStorageMetadata: (),
    ChunkStorageMetadata: ("offsets", "sizes"),
    TensorProperties: (),  # state is DCP's 5-tuple, checked by _properties
    MetadataIndex: ("fqn", "offset", "index"),
    StorageMeta: ("checkpoint_id", "save_id", "load_id", "modules"),
    _StorageInfo: ("relative_path", "offset", "length", "transform_descriptors"),
}

_PATHS = tuple(
    getattr(pathlib, n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
)

_SET_PROPERTIES = TensorProperties.__setstate__


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
        if func is torch.Size and isinstance(args, tuple) and len(args) == 1:
            dims = args[0]
            if not _plain_ints(dims):
                raise _refuse("a torch.Size of non-integers")
            value: Any = torch.Size(dims)
        elif func is torch.serialization._get_layout and args in (("torch.strided",),):
            value = torch.strided
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
            _SET_PROPERTIES(inst, state)  # type: ignore[no-untyped-call]
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
        and isinstance(state[0], torch.dtype)
        and isinstance(state[1], torch.layout)
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
    if cls is not TensorProperties and set(vars(obj)) - set(_DATA_CLASSES[cls]):
        raise _bad(f"{where} has unexpected attributes")
    for name in _DATA_CLASSES[cls]:
        if name not in vars(obj):
            setattr_default = getattr(cls, name, None)
            object.__setattr__(obj, name, setattr_default)


def _size(v: Any, where: str) -> None:
    if type(v) is not torch.Size or not all(type(d) is int and d >= 0 for d in v):
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
    """The loaded object, if it is exactly DCP metadata of plain fields."""
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
        if not (
            isinstance(p.dtype, torch.dtype)
            and isinstance(p.layout, torch.layout)
            and isinstance(p.memory_format, torch.memory_format)
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
            if type(k.fqn) is not str or not (k.offset is None or type(k.offset) is torch.Size):
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


def load_foreign(raw: bytes, source: Path) -> Metadata:
    """Parse a ``.metadata`` we did not derive ourselves, running nothing in it."""
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
