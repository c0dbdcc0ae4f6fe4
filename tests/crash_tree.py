"""The model an explored operation is replayed on: directories of entries, files of bytes.

A :class:`Tree` is what a reader would find below a root, by inode (hard links
share one, as on disk); an :class:`Op` is one recorded call that changes it. A
crash state is the tree before an operation with a choice of its ops applied
(``tests/crash_explorer.py``).
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

META = frozenset({"create", "mkdir", "symlink", "link", "unlink", "rmdir", "rename", "exchange"})
DATA = frozenset({"write", "truncate"})


@dataclass(frozen=True)
class Op:
    """One call: a change of directory entries (``META``), of a file's bytes (``DATA``),
    a barrier (``fsync``) or a hint that promises nothing (``hint``)."""

    kind: str
    text: str
    #: META: the entries set, (directory, name, inode or None for a removal)
    changes: tuple[tuple[int, str, int | None], ...] = ()
    #: META: the directories whose fsync (after it) makes it durable
    dirs: frozenset[int] = frozenset()
    ino: int = -1  # DATA and fsync: the inode
    offset: int = 0  # write: where; truncate: the new size
    data: bytes = b""
    observed: bool = False


@dataclass
class Tree:
    """Directories of entries and files of bytes, by inode; inode 0 is the root."""

    kinds: dict[int, str] = field(default_factory=dict)  # "d", "f" or "l"
    entries: dict[int, dict[str, int]] = field(default_factory=dict)
    data: dict[int, bytes] = field(default_factory=dict)
    targets: dict[int, str] = field(default_factory=dict)  # of symbolic links

    def copy(self) -> Tree:
        return Tree(
            dict(self.kinds),
            {d: dict(e) for d, e in self.entries.items()},
            dict(self.data),
            dict(self.targets),
        )

    def walk(self, ino: int = 0, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Every path reachable from ``ino`` (relative, ``/``-joined) and its inode."""
        for name, child in sorted(self.entries.get(ino, {}).items()):
            path = f"{prefix}{name}"
            yield path, child
            if self.kinds[child] == "d":
                yield from self.walk(child, path + "/")

    def lookup(self, rel: str) -> int | None:
        ino: int | None = 0
        for part in filter(None, rel.split("/")):
            if ino is None or self.kinds.get(ino) != "d":
                return None
            ino = self.entries[ino].get(part)
        return ino

    def shape(self, ino: int = 0) -> tuple[tuple[str, str, str], ...]:
        """What a reader sees below ``ino``: paths, kinds and contents (hard links equal)."""
        out = []
        for path, child in self.walk(ino):
            kind = self.kinds[child]
            body = (
                hashlib.sha1(self.data.get(child, b"")).hexdigest()
                if kind == "f"
                else self.targets.get(child, "")
            )
            out.append((path, kind, body))
        return tuple(out)

    def apply(self, op: Op) -> None:
        if op.kind in META:
            for d, name, target in op.changes:
                if target is None:
                    self.entries[d].pop(name, None)
                else:
                    self.entries[d][name] = target
        elif op.kind == "write":
            old = self.data.get(op.ino, b"")
            end = op.offset + len(op.data)
            pad = b"\0" * max(0, op.offset - len(old))
            self.data[op.ino] = old[: op.offset] + pad + op.data + old[end:]
        elif op.kind == "truncate":
            old = self.data.get(op.ino, b"")
            self.data[op.ino] = old[: op.offset] + b"\0" * max(0, op.offset - len(old))


def scan(root: Path) -> Tree:
    """The tree on disk below ``root`` (hard links share an inode, as on disk)."""
    tree = Tree(kinds={0: "d"}, entries={0: {}})
    seen: dict[int, int] = {}

    def visit(path: Path, ino: int) -> None:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            st = entry.stat(follow_symlinks=False)
            known = seen.get(st.st_ino)
            if known is None:
                known = seen[st.st_ino] = len(tree.kinds)
                if stat.S_ISDIR(st.st_mode):
                    tree.kinds[known], tree.entries[known] = "d", {}
                    visit(Path(entry.path), known)
                elif stat.S_ISLNK(st.st_mode):
                    tree.kinds[known] = "l"
                    tree.targets[known] = os.readlink(entry.path)
                else:
                    tree.kinds[known] = "f"
                    tree.data[known] = Path(entry.path).read_bytes()
            tree.entries[ino][entry.name] = known

    visit(root, 0)
    return tree
