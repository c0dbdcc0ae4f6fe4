"""Plain stand-ins for the classes and torch values a DCP ``.metadata`` pickle names.

``.metadata`` is a pickle of DCP's ``Metadata``: its classes, ``torch.Size``, torch's
dtypes, layouts and memory formats. The hardened unpickler (:mod:`.unpickler`)
resolves every name it allows to the stand-ins here instead: plain classes of the
same names, fields and class-level defaults (so a missing field reads as it would
on DCP's class), built and checked under the same limits. Reading a ``.metadata``
therefore needs no torch: ``fc.verify`` (and ``fckpt verify``) compares the file with
the manifest torch-free, and a stock checkpoint's reader turns the vetted stand-ins
into DCP's own objects only afterwards (``unpickler.load_foreign``). Nothing the
unpickler can reach is a torch object, so no pickle can alter one.

``tests/test_storage_hardening.py`` checks these against torch: the same names
allowed, the same fields and defaults.
"""

from __future__ import annotations

import collections
import enum
import pathlib
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from functional_ckpt._src.codec.table import DTYPE_ALIASES, DTYPE_SIZES

DCP_MODULE: Final = "torch.distributed.checkpoint.metadata"
STORAGE_MODULE: Final = "torch.distributed.checkpoint.filesystem"

#: torch's tensor layouts and memory formats, by their names in ``torch``.
LAYOUTS: Final = (
    "_mkldnn", "jagged", "sparse_bsc", "sparse_bsr", "sparse_coo", "sparse_csc",
    "sparse_csr", "strided",
)  # fmt: skip
MEMORY_FORMATS: Final = (
    "channels_last", "channels_last_3d", "contiguous_format", "legacy_contiguous_format",
    "preserve_format",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class DType:
    """``torch.<name>``, a dtype (its canonical name: ``torch.float`` is ``float32``)."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True, slots=True)
class Layout:
    """``torch.<name>``, a tensor layout."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True, slots=True)
class MemoryFormat:
    """``torch.<name>``, a memory format."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


_DTYPES: Final = {n: DType(DTYPE_ALIASES.get(n, n)) for n in [*DTYPE_SIZES, *DTYPE_ALIASES]}
_LAYOUTS: Final = {name: Layout(name) for name in LAYOUTS}
_MEMORY_FORMATS: Final = {
    n: MemoryFormat("contiguous_format" if n == "legacy_contiguous_format" else n)  # one object
    for n in MEMORY_FORMATS
}
STRIDED: Final = _LAYOUTS["strided"]


class Size(tuple[int, ...]):
    """``torch.Size``: a tuple of dimensions."""

    __slots__ = ()


class _MEM_FORMAT_ENCODING(enum.Enum):  # DCP's name, as the pickle spells it
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMAT_OF: Final = {
    _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: "contiguous_format",
    _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: "channels_last",
    _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: "preserve_format",
}


class _Record:
    """A DCP dataclass's instance: fields in ``__dict__``, compared field by field, unhashable."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({inner})"


# Class-level defaults are those of DCP's dataclasses (a field with a default
# factory or none has no class attribute there, and none here).


class Metadata(_Record):
    FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    state_dict_metadata: Any
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class TensorStorageMetadata(_Record):
    FIELDS = ("properties", "size", "chunks")
    properties: Any
    size: Any
    chunks: Any


class BytesStorageMetadata(_Record):
    FIELDS = ()


class ChunkStorageMetadata(_Record):
    FIELDS = ("offsets", "sizes")
    offsets: Any
    sizes: Any


class TensorProperties(_Record):
    """Pickled as DCP's 5-tuple state (:meth:`set_state`), never as a dict."""

    FIELDS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    dtype: Any
    layout: Any = STRIDED
    requires_grad: Any = False
    memory_format: Any = _MEMORY_FORMATS["contiguous_format"]
    pin_memory: Any = False

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        """DCP's ``__setstate__``: the memory format travels as its encoding."""
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.memory_format = _MEMORY_FORMATS[_MEMORY_FORMAT_OF[encoding]]


class MetadataIndex(_Record):
    """A frozen dataclass in DCP: equal and hashed by ``fqn`` and ``offset``."""

    FIELDS = ("fqn", "offset", "index")
    fqn: Any
    offset: Any = None
    index: Any = None

    def __eq__(self, other: object) -> bool:
        if type(other) is not MetadataIndex:
            return NotImplemented
        return (self.fqn, self.offset) == (other.fqn, other.offset)

    def __hash__(self) -> int:  # type: ignore[override]
        return hash((self.fqn, self.offset))


class StorageMeta(_Record):
    FIELDS = ("checkpoint_id", "save_id", "load_id", "modules")
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: Any


class _StorageInfo(_Record):  # DCP's name
    FIELDS = ("relative_path", "offset", "length", "transform_descriptors")
    relative_path: Any
    offset: Any
    length: Any
    transform_descriptors: Any = None


def _get_layout(name: str) -> Layout:
    """``torch.serialization._get_layout``: how a pickle spells a layout, ``"torch.strided"``.

    The hardened unpickler never calls it (it knows the one argument it accepts).
    """
    return _LAYOUTS[name.removeprefix("torch.")]


#: Classes whose instances the unpickler may create and fill (``NEWOBJ`` + ``BUILD``).
DATA_CLASSES: Final[tuple[type[_Record], ...]] = (
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    StorageMeta,
    _StorageInfo,
)

PATHS: Final = tuple(
    getattr(pathlib, n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
)


def _allowed() -> dict[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {}
    for cls in DATA_CLASSES:
        module = STORAGE_MODULE if cls is _StorageInfo else DCP_MODULE
        found[(module, cls.__name__)] = cls
    found[(DCP_MODULE, "_MEM_FORMAT_ENCODING")] = _MEM_FORMAT_ENCODING
    found[("torch", "Size")] = Size
    found[("torch.serialization", "_get_layout")] = _get_layout
    found[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        found[("pathlib", name)] = getattr(pathlib, name)
        found[("pathlib._local", name)] = getattr(pathlib, name)
    for table in (_DTYPES, _LAYOUTS, _MEMORY_FORMATS):
        found.update({("torch", name): obj for name, obj in table.items()})
    return found


#: Every global a ``.metadata`` may name, and what it stands for.
ALLOWED: Final[dict[tuple[str, str], Any]] = _allowed()
