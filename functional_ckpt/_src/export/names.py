"""Export names: the tensors' state_dict names, with wrapper prefixes stripped or renamed.

A compiled, DDP-wrapped or Lightning-held model names its tensors with a prefix
(``_orig_mod.``, ``module.``, an attribute name) that ``from_pretrained`` does not
expect: it would warn and initialise those weights at random. Mapping the names
at export time is the fix; a warning says when names still look wrapped.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence

import torch

from functional_ckpt.errors import CheckpointError, CheckpointWarning

WRAPPER_PREFIXES = {"_orig_mod.": "torch.compile", "module.": "DDP or DataParallel"}

Rename = Mapping[str, str] | Callable[[str], str]


def prefixes(strip_prefix: str | Sequence[str] | None) -> tuple[str, ...]:
    if strip_prefix is None:
        return ()
    prefixes = (strip_prefix,) if isinstance(strip_prefix, str) else tuple(strip_prefix)
    if not all(isinstance(p, str) and p for p in prefixes):
        raise TypeError(
            f"strip_prefix={strip_prefix!r}: expected a prefix such as '_orig_mod.' or a "
            "sequence of them"
        )
    return prefixes


def check_rename(rename: Rename | None) -> None:
    if rename is None or callable(rename):
        return
    if not isinstance(rename, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in rename.items()
    ):
        raise TypeError(
            f"rename={rename!r}: expected a mapping of name prefixes to their replacement "
            "(e.g. {'model.': ''}) or a function of one name"
        )


def new_name(name: str, strip: tuple[str, ...], rename: Rename | None) -> str:
    """``name`` without the wrapper prefixes in ``strip``, then renamed."""
    left = list(strip)  # each prefix once: "model." of a wrapper, not HF's own "model."
    while hit := next((p for p in left if name.startswith(p)), None):
        name = name[len(hit) :]
        left.remove(hit)
    if callable(rename):
        new = rename(name)
        if not isinstance(new, str):
            raise TypeError(f"rename({name!r}) returned {new!r}, not a str")
        return new
    if rename:
        hits = [old for old in rename if name.startswith(old)]
        if hits:
            old = max(hits, key=len)  # the longest prefix is the most specific rule
            return rename[old] + name[len(old) :]
    return name


def map_names(
    tensors: dict[str, torch.Tensor],
    strip_prefix: str | Sequence[str] | None,
    rename: Rename | None,
) -> dict[str, torch.Tensor]:
    """Names as ``from_pretrained`` should see them; two tensors never get one name."""
    strip = prefixes(strip_prefix)
    check_rename(rename)
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for name, t in tensors.items():
        new = new_name(name, strip, rename)
        if not new:
            raise CheckpointError(f"export: the tensor {name!r} would get an empty name")
        if new in origin:
            raise CheckpointError(
                f"export: the tensors {origin[new]!r} and {name!r} would both be named {new!r}; "
                "check strip_prefix= and rename="
            )
        origin[new] = name
        out[new] = t
    warn_if_prefixed(list(out))
    return out


def warn_if_prefixed(names: list[str]) -> None:
    for prefix, by in WRAPPER_PREFIXES.items():
        wrapped = [n for n in names if n.startswith(prefix) or f".{prefix}" in n]
        everywhere = len(wrapped) == len(names)
        if wrapped and (prefix == "_orig_mod." or everywhere):
            warnings.warn(
                f"export: tensor names such as {wrapped[0]!r} carry the prefix {prefix!r} "
                f"that {by} adds; transformers would not find these weights and would "
                f"initialise them at random. Pass strip_prefix={prefix!r} (or rename=)",
                CheckpointWarning,
                stacklevel=5,
            )
