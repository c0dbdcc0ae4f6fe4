"""The exact codec: how a state's Python values are stored, and the state as plain Python.

Dataclasses, NamedTuples and Enums are stored as tagged plain data (never a pickle)
once their class is :func:`register`-ed; a reader that has not registered one sees it
as an ``Unregistered`` placeholder. :func:`from_python` builds a TensorDict from
nested Python containers exactly (lists, tuples and dicts with non-string keys become
sub-TensorDicts that record their kind and keys) and :func:`to_python` is its inverse:
``fc.codec.to_python(fc.codec.from_python(x)) == x`` with every type kept. See
docs/format.md for the tags and the rules.
"""

from functional_ckpt._src.codec import Unregistered, register
from functional_ckpt._src.state.tree import from_python, to_python

__all__ = ["Unregistered", "from_python", "register", "to_python"]
