"""Plain stand-ins for the classes and torch values a DCP ``.metadata`` pickle names.

The hardened unpickler resolves every name it allows to these (same names, fields and
defaults as DCP's), so no pickle can reach a torch object.
"""

from __future__ import annotations

import collections
import enum
import inspect
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
class _Named:
    """``torch.<name>``: a dtype (by its canonical name), a layout or a memory format."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class DType(_Named):
    __slots__ = ()


class Layout(_Named):
    __slots__ = ()


class MemoryFormat(_Named):
    __slots__ = ()


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


class _Record:
    """A DCP dataclass's instance: fields in ``__dict__``, compared field by field, unhashable."""

    FIELDS: ClassVar[tuple[str, ...]] = ()  # its annotated fields, in DCP's order

    def __init_subclass__(cls) -> None:
        cls.FIELDS = tuple(inspect.get_annotations(cls))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({inner})"


# Class-level defaults are those of DCP's dataclasses (a field with a default
# factory or none has no class attribute there, and none here).


class Metadata(_Record):
    state_dict_metadata: Any
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


class TensorStorageMetadata(_Record):
    properties: Any
    size: Any
    chunks: Any


class BytesStorageMetadata(_Record):
    pass


class ChunkStorageMetadata(_Record):
    offsets: Any
    sizes: Any


class TensorProperties(_Record):
    """Pickled as DCP's 5-tuple state (:meth:`set_state`), never as a dict."""

    dtype: Any
    layout: Any = STRIDED
    requires_grad: Any = False
    memory_format: Any = _MEMORY_FORMATS["contiguous_format"]
    pin_memory: Any = False

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        """DCP's ``__setstate__``: the memory format travels as its encoding."""
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.memory_format = _MEMORY_FORMATS[encoding.name.removeprefix("TORCH_").lower()]


class MetadataIndex(_Record):
    """A frozen dataclass in DCP: equal and hashed by ``fqn`` and ``offset``."""

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
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: Any


class _StorageInfo(_Record):  # DCP's name
    relative_path: Any
    offset: Any
    length: Any
    transform_descriptors: Any = None


def _get_layout(name: str) -> Layout:
    """``torch.serialization._get_layout`` (never called: the unpickler knows its argument)."""
    return _LAYOUTS[name.removeprefix("torch.")]


#: Classes whose instances the unpickler may create and fill (``NEWOBJ`` + ``BUILD``).
DATA_CLASSES: Final = tuple(_Record.__subclasses__())

_PATH_NAMES: Final = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")
PATHS: Final = tuple(getattr(pathlib, n) for n in _PATH_NAMES)


def _allowed() -> dict[tuple[str, str], Any]:
    found: dict[tuple[str, str], Any] = {}
    for cls in DATA_CLASSES:
        module = STORAGE_MODULE if cls is _StorageInfo else DCP_MODULE
        found[(module, cls.__name__)] = cls
    found[(DCP_MODULE, "_MEM_FORMAT_ENCODING")] = _MEM_FORMAT_ENCODING
    found[("torch", "Size")] = Size
    found[("torch.serialization", "_get_layout")] = _get_layout
    found[("collections", "OrderedDict")] = collections.OrderedDict
    for name in (*_PATH_NAMES, "Path"):
        found[("pathlib", name)] = getattr(pathlib, name)
        found[("pathlib._local", name)] = getattr(pathlib, name)
    for table in (_DTYPES, _LAYOUTS, _MEMORY_FORMATS):
        found.update({("torch", name): obj for name, obj in table.items()})
    return found


#: Every global a ``.metadata`` may name, and what it stands for.
ALLOWED: Final[dict[tuple[str, str], Any]] = _allowed()
