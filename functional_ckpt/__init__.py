"""functional_ckpt: functional, atomic, pickle-free checkpoints for PyTorch training state.

The top level is the everyday API; everything else a user names lives in a namespace:

* ``fc.errors``: every exception and warning the package raises;
* ``fc.policy``: the other save and retention policies, their protocols, ``run_policy``,
  ``plan_deletions``, ``on_degrade``;
* ``fc.manager``: ``CheckpointManager``, its options and reports, ``fork``,
  ``remove_checkpoint``;
* ``fc.checkpoint``: what the functions on one checkpoint return, ``Stager``;
* ``fc.codec``: ``register``, ``Unregistered``, ``to_python`` and ``from_python``;
* ``fc.recording``: ``Recorder``, ``Replay``: a small state recorded every k steps;
* ``functional_ckpt.integrations.<client>``: Lightning, Hugging Face, accelerate,
  torchdata, and ``dcp`` (``Writer``, ``Reader``).

Names are imported on first use, so ``import functional_ckpt`` (and ``fckpt``) loads
no tensor library until something needs one.
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
    from functional_ckpt._src.export.safetensors import export_safetensors as export_safetensors
    from functional_ckpt._src.manager.manager import CheckpointManager as CheckpointManager
    from functional_ckpt._src.policy.leaves import at_steps as at_steps
    from functional_ckpt._src.policy.leaves import every_epochs as every_epochs
    from functional_ckpt._src.policy.leaves import every_secs as every_secs
    from functional_ckpt._src.policy.leaves import every_steps as every_steps
    from functional_ckpt._src.policy.leaves import on_final as on_final
    from functional_ckpt._src.policy.leaves import on_improve as on_improve
    from functional_ckpt._src.policy.retention import keep_best as keep_best
    from functional_ckpt._src.policy.retention import keep_every as keep_every
    from functional_ckpt._src.policy.retention import keep_last as keep_last
    from functional_ckpt._src.policy.retention import keep_within as keep_within
    from functional_ckpt._src.policy.signals import on_signal as on_signal
    from functional_ckpt._src.restore.api import restore as restore
    from functional_ckpt._src.restore.contents import inspect as inspect
    from functional_ckpt._src.save.api import save as save
    from functional_ckpt._src.save.api import save_async as save_async
    from functional_ckpt._src.state.capture import apply as apply
    from functional_ckpt._src.state.capture import capture as capture
    from functional_ckpt._src.storage.verify import verify as verify
    from functional_ckpt.errors import CheckpointError as CheckpointError

#: Where each public name lives: ``name -> module``.
_WHERE = {
    name: f"functional_ckpt.{module}"
    for module, names in (
        ("errors", "CheckpointError"),
        ("_src.manager.manager", "CheckpointManager"),
        ("_src.state.capture", "apply capture"),
        ("_src.policy.leaves", "at_steps every_epochs every_secs every_steps on_final on_improve"),
        ("_src.export.safetensors", "export_safetensors"),
        ("_src.restore.contents", "inspect"),
        ("_src.policy.retention", "keep_best keep_every keep_last keep_within"),
        ("_src.policy.signals", "on_signal"),
        ("_src.restore.api", "restore"),
        ("_src.save.api", "save save_async"),
        ("_src.storage.verify", "verify"),
    )
    for name in names.split()
}

#: The public namespaces, each a module of its own.
_NAMESPACES = ("checkpoint", "codec", "errors", "manager", "policy", "recording")

__all__ = ["__version__", *sorted(_WHERE)]


#: Held while a name's module is imported on first use. A fork waits for it: a child
#: forked mid-import would inherit import locks held by a thread it lacks, and hang.
#: ``logging`` is imported above so that its fork hook (run after this one) does not
#: take logging's lock, which the import needs, before this one has waited.
_LOADING = threading.RLock()
os.register_at_fork(
    before=_LOADING.acquire, after_in_parent=_LOADING.release, after_in_child=_LOADING.release
)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Python signal handlers run once the block is done: one raising mid-import would
    leave torch half-imported for good. Only the main thread runs handlers."""
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
