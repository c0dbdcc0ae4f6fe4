"""The state as a tree: a TensorDict built exactly from nested Python containers.

:func:`from_python` is the inverse of ``fc.to_python``: lists, tuples and dicts
with non-string keys become sub-TensorDicts that record their kind and keys, so
``fc.to_python(fc.tree.from_python(x)) == x`` with every type kept.
"""

from functional_ckpt._src.state.tree import from_python

__all__ = ["from_python"]
