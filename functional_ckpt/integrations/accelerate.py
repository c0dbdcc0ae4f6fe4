"""accelerate without its pickles: ``fc.capture``/``fc.apply`` of what ``accelerator.prepare``
returned, the model unwrapped (DDP, ``torch.compile``) so that its names do not depend
on the wrapping, plus the fp16 gradient scaler and the accelerator's step counter."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tensordict import TensorDict, TensorDictBase

from functional_ckpt._src.state.capture import apply as fc_apply
from functional_ckpt._src.state.capture import capture as fc_capture
from functional_ckpt._src.state.tree import to_python
from functional_ckpt.errors import TemplateMismatch
from functional_ckpt.integrations import torchdata

__all__ = ["apply", "capture", "iter_resumed"]

_KEY = "accelerator"


def _objects(accelerator: Any, model: Any, objects: dict[str, Any]) -> dict[str, Any]:
    out = dict(objects)
    if model is not None:
        out["model"] = accelerator.unwrap_model(model, keep_torch_compile=False)
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        out["scaler"] = scaler
    return out


def capture(accelerator: Any, *, model: Any = None, rng: bool = True, **objects: Any) -> TensorDict:
    """``fc.capture`` of prepared objects (``optimizer=``, ``scheduler=``, ``loader=``, extras)."""
    return fc_capture(
        rng=rng,
        **_objects(accelerator, model, objects),
        **{_KEY: {"step": int(accelerator.step)}},
    )


def _step(state: TensorDictBase) -> int:
    if _KEY not in state.keys():
        raise TemplateMismatch(
            f"state[{_KEY!r}]: missing; apply a state captured with "
            "functional_ckpt.integrations.accelerate.capture"
        )
    return int(to_python(state.get(_KEY))["step"])


def apply(
    accelerator: Any, state: TensorDictBase, *, model: Any = None, rng: bool = True, **objects: Any
) -> None:
    """``fc.apply`` into prepared objects; the inverse of :func:`capture`."""
    step = _step(state)
    fc_apply(state, rng=rng, **_objects(accelerator, model, objects))
    accelerator.step = step


def iter_resumed(
    accelerator: Any,
    state: TensorDictBase,
    loader: Any,
    *,
    model: Any = None,
    rng: bool = True,
    **objects: Any,
) -> Iterator[Any]:
    """:func:`apply`, and the prepared ``loader``'s iterator resumed where the state was
    taken (see :func:`functional_ckpt.integrations.torchdata.iter_resumed`)."""
    step = _step(state)
    iterator = torchdata.iter_resumed(
        state, loader, rng=rng, **_objects(accelerator, model, objects)
    )
    accelerator.step = step
    return iterator
