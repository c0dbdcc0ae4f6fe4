"""functional_ckpt: functional, atomic, pickle-free checkpoints for PyTorch training state.

The top level is the whole everyday API: capture and apply live objects, save and
restore states, the save and retention policies, the manager. Everything else a
user names lives in one of a few public namespaces:

* ``fc.errors``: every exception and warning the package raises;
* ``fc.policy``: save and retention policies beyond the everyday ones, their
  protocols, ``run_policy``, ``plan_deletions``, ``on_degrade``;
* ``fc.manager``: ``CheckpointManager``, its option objects and what it reports,
  ``fork``, ``remove_checkpoint``;
* ``fc.checkpoint``: what the functions on one checkpoint return, ``Stager``;
* ``fc.codec``: ``register``, for the dataclasses, NamedTuples and Enums a state holds,
  ``Unregistered``, what a reader without their class sees; ``to_python`` and
  ``from_python``, a TensorDict as plain Python and back;
* ``fc.recording``: ``Recorder``, ``Replay``: a small state recorded every k steps;
* ``functional_ckpt.integrations.<client>``: Lightning, Hugging Face, accelerate,
  torchdata, and ``dcp`` (``Writer``, ``Reader``: ``dcp.save``/``dcp.load`` in this format).

Everything else (``functional_ckpt._src``) is the implementation. Names are imported
on first use, so ``import functional_ckpt`` (and the ``fckpt`` command) loads no
tensor library until something needs one.
"""

from __future__ import annotations

import logging  # noqa: F401  (before the fork hook below: see _LOADING)
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import import_module
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.version import __version__ as __version__

if TYPE_CHECKING:
    from functional_ckpt import checkpoint as checkpoint
    from functional_ckpt import codec as codec
    from functional_ckpt import errors as errors
    from functional_ckpt import manager as manager
    from functional_ckpt import policy as policy
    from functional_ckpt import recording as recording
    from functional_ckpt._src.export.safetensors import export_safetensors
    from functional_ckpt._src.manager.manager import CheckpointManager
    from functional_ckpt._src.policy.leaves import (
        at_steps,
        every_epochs,
        every_secs,
        every_steps,
        on_final,
        on_improve,
    )
    from functional_ckpt._src.policy.retention import keep_best, keep_every, keep_last, keep_within
    from functional_ckpt._src.policy.signals import on_signal
    from functional_ckpt._src.restore.api import restore
    from functional_ckpt._src.restore.contents import inspect
    from functional_ckpt._src.save.api import save, save_async
    from functional_ckpt._src.state.capture import apply, capture
    from functional_ckpt._src.storage.verify import verify
    from functional_ckpt.errors import CheckpointError

#: Where each public name lives: ``name -> module`` (the module itself for a namespace).
_WHERE = {
    "CheckpointError": "functional_ckpt.errors",
    "CheckpointManager": "functional_ckpt._src.manager.manager",
    "apply": "functional_ckpt._src.state.capture",
    "at_steps": "functional_ckpt._src.policy.leaves",
    "capture": "functional_ckpt._src.state.capture",
    "every_epochs": "functional_ckpt._src.policy.leaves",
    "every_secs": "functional_ckpt._src.policy.leaves",
    "every_steps": "functional_ckpt._src.policy.leaves",
    "export_safetensors": "functional_ckpt._src.export.safetensors",
    "inspect": "functional_ckpt._src.restore.contents",
    "keep_best": "functional_ckpt._src.policy.retention",
    "keep_every": "functional_ckpt._src.policy.retention",
    "keep_last": "functional_ckpt._src.policy.retention",
    "keep_within": "functional_ckpt._src.policy.retention",
    "on_final": "functional_ckpt._src.policy.leaves",
    "on_improve": "functional_ckpt._src.policy.leaves",
    "on_signal": "functional_ckpt._src.policy.signals",
    "restore": "functional_ckpt._src.restore.api",
    "save": "functional_ckpt._src.save.api",
    "save_async": "functional_ckpt._src.save.api",
    "verify": "functional_ckpt._src.storage.verify",
}

#: The public namespaces, each a module of its own.
_NAMESPACES = ("checkpoint", "codec", "errors", "manager", "policy", "recording")

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "__version__",
    "apply",
    "at_steps",
    "capture",
    "every_epochs",
    "every_secs",
    "every_steps",
    "export_safetensors",
    "inspect",
    "keep_best",
    "keep_every",
    "keep_last",
    "keep_within",
    "on_final",
    "on_improve",
    "on_signal",
    "restore",
    "save",
    "save_async",
    "verify",
]


#: Held while a name's module is imported on first use (seconds: torch comes with it).
#: A fork waits for it (``os.register_at_fork``): a child forked in the middle of an
#: import would inherit the import's locks held by a thread it does not have, and hang
#: in its own first call. Hooks run newest first before a fork: ``logging`` is imported
#: above so that its hook (which takes logging's lock, and the import needs that lock)
#: runs after this one has waited, not before.
_LOADING = threading.RLock()
os.register_at_fork(
    before=_LOADING.acquire, after_in_parent=_LOADING.release, after_in_child=_LOADING.release
)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Signals with a Python handler (Ctrl-C's, a timeout's SIGALRM) handled once the
    block is done: an exception a handler raises in the middle of importing torch
    leaves it half-imported for the rest of the process. Only the main thread runs
    handlers (and may set them); elsewhere nothing is deferred, nor needs to be."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    saved = {}
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler):
            saved[sig] = handler
            signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for signum in caught:  # as if it came now: its handler runs (and may raise) here
            signal.raise_signal(signum)


def _load(module: str) -> Any:
    """``module``, imported whole: not torn by a signal, nor by a fork meanwhile."""
    found = sys.modules.get(module)
    if found is not None and getattr(found.__spec__, "_initializing", False) is False:
        return found
    with _LOADING, _signals_deferred():
        return import_module(module)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(_load(_WHERE[name]), name)
    elif name in _NAMESPACES:
        value = _load(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # looked up once; the next access finds it directly
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, *_NAMESPACES])
