"""Capture live training objects into one state tree, and apply a tree back to them:
everything a resumed run needs to be bit-identical. Tensors are captured by reference."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from tensordict import NonTensorData, TensorDict, TensorDictBase

from functional_ckpt._src.arguments import flag
from functional_ckpt._src.state.tree import as_state, from_python, to_python
from functional_ckpt.errors import TemplateMismatch, UnsupportedValue


@runtime_checkable
class Stateful(Protocol):
    """Anything checkpointable the PyTorch way: modules, optimizers, schedulers, loaders."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def capture_rng() -> dict[str, Any]:
    """The state of every random generator a training step may draw from."""
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(legacy=True),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = list(torch.cuda.get_rng_state_all())
    return rng


def apply_rng(rng: Mapping[str, Any]) -> None:
    """Put every random generator back where :func:`capture_rng` found it."""
    torch.set_rng_state(rng["torch"].cpu())
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    cuda = rng.get("cuda")
    if cuda is not None:
        if not torch.cuda.is_available():
            raise TemplateMismatch(
                "state['rng']['cuda']: the checkpoint holds CUDA generator states "
                "but CUDA is not available; pass rng=False to fc.apply to skip them"
            )
        if len(cuda) != torch.cuda.device_count():
            raise TemplateMismatch(
                f"state['rng']['cuda']: saved for {len(cuda)} CUDA devices, "
                f"this process sees {torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all([t.cpu() for t in cuda])


def is_sharded_module(model: Any) -> bool:
    """True for modules with DTensor parameters (FSDP2 ``fully_shard``, tensor parallel)."""
    return any(type(p).__name__ == "DTensor" for p in getattr(model, "parameters", list)())


def _named(
    model: Any, optimizer: Any, scheduler: Any, loader: Any, **extra: Any
) -> list[tuple[str, Any]]:
    named = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    return [(k, v) for k, v in {**named, **extra}.items() if v is not None]


def _subtree(name: str, value: Any) -> Any:
    if isinstance(value, torch.Tensor | TensorDictBase):
        return value
    if isinstance(value, Stateful):
        return from_python(value.state_dict(), (name,))
    if type(value) in (dict, list, tuple):
        return from_python(value, (name,))
    return NonTensorData(data=from_python({name: value}).get(name).data, batch_size=[])


def capture(
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
    rng: bool = True,
    **extra: Any,
) -> TensorDict:
    """Gather the whole training state into one locked TensorDict; ``extra`` holds user subtrees."""
    td = TensorDict({}, batch_size=[])
    if model is not None and optimizer is not None and is_sharded_module(model):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        fresh = not optimizer.state  # a fresh one keeps none of the state DCP makes for its shape
        model_sd, optim_sd = get_state_dict(model, optimizer)  # keys are FQNs
        if fresh:
            optimizer.state.clear()
        td.set("model", from_python(model_sd, ("model",)))
        td.set("optimizer", from_python(optim_sd, ("optimizer",)))
        model = optimizer = None
    for name, obj in _named(model, optimizer, scheduler, loader):
        if not isinstance(obj, Stateful):
            raise UnsupportedValue(
                f"fc.capture({name}=...): {type(obj).__name__} has no "
                "state_dict()/load_state_dict(); use a resumable object (e.g. torchdata's "
                "StatefulDataLoader) or put its state in **extra"
            )
        td.set(name, from_python(obj.state_dict(), (name,)))
    if model is not None and optimizer is not None:
        _record_param_names(td.get("optimizer"), model, optimizer)
    if flag(rng, "rng", "fc.capture"):
        td.set("rng", from_python(capture_rng(), ("rng",)))
    for name, value in extra.items():
        if name in td.keys():
            raise UnsupportedValue(f"fc.capture({name}=...): the name {name!r} is already used")
        td.set(name, _subtree(name, value))
    td.lock_()
    return td


def _record_param_names(sub: TensorDictBase, model: Any, optimizer: Any) -> None:
    """Record the optimizer's parameter names, so stock DCP sees its state by name."""
    from functional_ckpt._src.format import dcp_values as dcpbytes
    from functional_ckpt._src.format.keys import NODE_KEY

    names = dcpbytes.param_names(model, optimizer)
    if names is not None and NODE_KEY not in sub.keys():
        record = dcpbytes.optimizer_record(list(sub.keys()), names)
        sub.set(NODE_KEY, NonTensorData(data=record, batch_size=[]))  # type: ignore[arg-type]


def _entry(state: TensorDictBase, name: str, hint: str = "") -> Any:
    """``state[name]`` as Python containers; a clear error where the state has none."""
    if name not in state.keys():
        raise TemplateMismatch(
            f"fc.apply({name}=...): the state has no {name!r} entry (keys: "
            f"{list(state.keys())}){hint}"
        )
    return to_python(state.get(name))


def apply(
    state: TensorDictBase,
    model: Any = None,
    optimizer: Any = None,
    scheduler: Any = None,
    loader: Any = None,
    rng: bool = True,
    **extra: Any,
) -> None:
    """Write a state back into live objects (the inverse of :func:`capture`, ``extra`` too).

    The random generators are restored last: creating a data loader's iterator draws from
    them, so a loop resumed mid-epoch calls ``fc.apply(state, loader=loader, rng=False)``,
    ``it = iter(loader)``, ``fc.apply(state)``.
    """
    state, rng = as_state(state), flag(rng, "rng", "fc.apply")
    if model is not None and optimizer is not None and is_sharded_module(model):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_sd, optim_sd = _entry(state, "model"), _entry(state, "optimizer")
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        model = optimizer = None
    for name, obj in _named(model, optimizer, scheduler, loader, **extra):
        if not isinstance(obj, Stateful):
            raise UnsupportedValue(
                f"fc.apply({name}=...): {type(obj).__name__} has no load_state_dict()"
            )
        obj.load_state_dict(_entry(state, name))
    if rng:
        apply_rng(_entry(state, "rng", "; pass rng=False to skip it"))
