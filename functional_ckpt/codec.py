"""The exact codec: :func:`register` the dataclasses, NamedTuples and Enums a state
holds (stored as tagged plain data, never a pickle; a reader without the class sees an
``Unregistered``); :func:`from_python` and :func:`to_python`, a TensorDict as plain
Python and back, every type kept. See docs/format.md."""

from functional_ckpt._src.codec import Unregistered, register
from functional_ckpt._src.state.tree import from_python, to_python

__all__ = ["Unregistered", "from_python", "register", "to_python"]
