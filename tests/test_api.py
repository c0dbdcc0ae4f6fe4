"""The top-level API fits on one page; everything else stays reachable in its submodule."""

from __future__ import annotations

import functional_ckpt as fc


def test_the_top_level_has_at_most_21_names() -> None:
    public = [n for n in fc.__all__ if n != "__version__"]
    assert len(public) <= 21, public
    assert len(set(public)) == len(public)
    for name in fc.__all__:
        assert hasattr(fc, name), name


def test_the_top_level_names_are_these() -> None:
    assert sorted(n for n in fc.__all__ if n != "__version__") == sorted(
        [
            "CheckpointError",
            "CheckpointManager",
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
    )


def test_everything_else_is_reachable_in_its_submodule() -> None:
    assert issubclass(fc.errors.CorruptCheckpoint, fc.CheckpointError)
    assert issubclass(fc.errors.UnsupportedValue, fc.CheckpointError)
    assert fc.policy.always().spec == "always"
    assert isinstance(fc.policy.Event(step=1), fc.policy.Event)
    assert fc.policy.keep_all().select([]) == set()
    assert callable(fc.checkpoint.Stager)
    assert callable(fc.manager.Export)
    assert callable(fc.codec.from_python) and callable(fc.codec.to_python)
    assert callable(fc.recording.Recorder) and callable(fc.recording.Replay)
    assert callable(fc.manager.fork) and callable(fc.manager.remove_checkpoint)
    assert callable(fc.policy.run_policy) and callable(fc.policy.plan_deletions)
    for moved in ("Recorder", "Replay", "fork", "to_python", "retention", "tree", "dcp"):
        assert not hasattr(fc, moved), moved  # pre-1.0: no aliases for removed spellings
    assert callable(fc.checkpoint.VerifyReport)
    assert list(fc.policy.on_degrade("reward").spec) == ["on_degrade"]
    assert issubclass(fc.errors.NotRecorded, fc.CheckpointError)


def test_no_top_level_name_is_a_submodule() -> None:
    import types

    for name in fc.__all__:
        assert not isinstance(getattr(fc, name), types.ModuleType), name


#: The public namespaces beside the top level (and the integrations, imported by name).
NAMESPACES = ["checkpoint", "codec", "errors", "manager", "policy", "recording"]


def test_the_namespaces_are_the_same_in_the_package_the_docs_and_here() -> None:
    import re
    from pathlib import Path

    assert sorted(fc._NAMESPACES) == NAMESPACES
    assert fc.__doc__ is not None
    in_docstring = re.findall(r"^\* ``fc\.(\w+)``", fc.__doc__, re.M)
    assert sorted(in_docstring) == NAMESPACES
    api = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    in_docs = re.findall(r"^\| `fc\.(\w+)` \|", api, re.M)
    assert sorted(in_docs) == NAMESPACES
    assert "functional_ckpt.integrations.<client>" in fc.__doc__
    assert "functional_ckpt.integrations.<client>" in api


def test_each_namespace_shows_exactly_its_all() -> None:
    for name in NAMESPACES:
        module = getattr(fc, name)
        shown = {n for n in vars(module) if not n.startswith("_")}
        assert shown == set(module.__all__), name
        for item in module.__all__:
            assert getattr(module, item) is not None, (name, item)
