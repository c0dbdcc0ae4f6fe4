"""The newest peers, driven the way their users drive them, for the benchmark scripts.

* ``torch_checkpointing`` (Meta, 0.1.1): its ``CheckpointManager`` with the sync and
  the async saver (a writer subprocess, shared-memory staging). It calls no fsync of
  its own: the *durable* variants add one through its hooks (``pre_finalize_callback``
  fsyncs every written file and directory before its rename, ``finalize_callback``
  the parent after it); the plain variants show it as shipped. ``use_direct_io=False``:
  O_DIRECT is refused on many file systems (tmpfs, overlay) and would bypass the page
  cache the other tools write through.
* stock ``dcp.async_save`` in ``PROCESS`` mode (a writer subprocess like
  torch_checkpointing's), on a one-rank gloo group, which that mode needs.

Each manager is made once and reused (its subprocess and staging buffers are its
warm state, as in a training run); :func:`close` ends them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from _common import free_port, fsync_dir, fsync_tree

TC_SAVE = "torch_checkpointing save+fsync hooks"
TC_SAVE_PLAIN = "torch_checkpointing save (no fsync)"
TC_LOAD_INTO = "torch_checkpointing load(into=template)"
TC_LOAD_NEW = "torch_checkpointing load() new tensors"
TC_ASYNC = "torch_checkpointing async save+fsync hooks"
TC_ASYNC_PLAIN = "torch_checkpointing async save (no fsync)"
DCP_PROCESS = "dcp.async_save(PROCESS)"

ITEM = "state"  # the one item every payload is saved as


def available() -> bool:
    try:
        import torch_checkpointing  # noqa: F401
    except ImportError:
        return False
    return True


def durable_files(args: Any) -> None:
    """Before the rename: every file and directory written, fsynced."""
    fsync_tree(Path(args.path))


def durable_rename(args: Any) -> None:
    """After the rename: the parent that now names the checkpoint, fsynced."""
    fsync_dir(Path(os.path.abspath(args.path)).parent)


_MANAGERS: dict[tuple[bool, bool], Any] = {}


def manager(*, asynchronous: bool, durable: bool) -> Any:
    """One reused ``CheckpointManager`` per kind (async or not, hooks or not)."""
    got = _MANAGERS.get((asynchronous, durable))
    if got is not None:
        return got
    import torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    gpu = torch.cuda.is_available()
    saver: Any = (
        AsyncCheckpointSaverConfig(
            staging_config=CheckpointStagerConfig(use_pinned_memory=gpu, use_non_blocking_copy=gpu)
        )
        if asynchronous
        else SyncCheckpointSaverConfig()
    )
    config = CheckpointManager.Config(
        save=saver,
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        pre_finalize_callback=durable_files if durable else None,
        finalize_callback=durable_rename if durable else None,
    )
    got = _MANAGERS[(asynchronous, durable)] = CheckpointManager(config)
    return got


def tc_save(dest: Path, state: dict[str, Any], *, durable: bool = True) -> None:
    manager(asynchronous=False, durable=durable).save(str(dest), {ITEM: state})


def tc_load_into(src: Path, template: dict[str, Any]) -> dict[str, Any]:
    """In place: the template's tensors are filled (its values replaced)."""
    out = manager(asynchronous=False, durable=True).load(str(src), into={ITEM: template})
    return dict(out[ITEM])


def tc_load_new(src: Path) -> dict[str, Any]:
    out = manager(asynchronous=False, durable=True).load(str(src), into={ITEM: None})
    return dict(out[ITEM])


def tc_async(dest: Path, state: dict[str, Any], *, durable: bool = True) -> tuple[float, float]:
    """(caller blocked, call to committed) of one async save: blocked until its
    ``lock()`` lets the caller change the state again (the capture is done)."""
    m = manager(asynchronous=True, durable=durable)
    t0 = time.perf_counter()
    future = m.save(str(dest), {ITEM: state})
    with m.lock():
        t1 = time.perf_counter()
    future.result()
    return t1 - t0, time.perf_counter() - t0


_GROUP: list[bool] = []
_STAGER: list[Any] = []


def dcp_process(dest: Path, state: dict[str, Any]) -> tuple[float, float]:
    """(caller blocked, call to committed) of stock ``dcp.async_save`` in PROCESS mode."""
    t0 = time.perf_counter()
    response = dcp_process_start(dest, state)
    response.staging_completion.result()
    t1 = time.perf_counter()
    response.upload_completion.result()
    return t1 - t0, time.perf_counter() - t0


def dcp_process_start(dest: Path, state: dict[str, Any]) -> Any:
    """Stock ``dcp.async_save`` in PROCESS mode, started: its ``AsyncSaveResponse``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
        _GROUP.append(True)
    if not _STAGER:
        gpu = torch.cuda.is_available()
        _STAGER.append(DefaultStager(StagingOptions(gpu, True, True, gpu)))
    return async_save(
        state,
        checkpoint_id=dest,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=_STAGER[0],
    )


def close() -> None:
    """End every manager (their writer processes) and the stager made here."""
    for m in _MANAGERS.values():
        m.close()
    _MANAGERS.clear()
    for s in _STAGER:
        s.close()
    _STAGER.clear()
    if _GROUP:
        import torch.distributed as dist

        dist.destroy_process_group()
        _GROUP.clear()
