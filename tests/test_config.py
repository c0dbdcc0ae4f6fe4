"""Configuration as data: policies and managers from dicts, YAML, JSON and any Mapping.

Every policy and every manager option round-trips through its configuration form;
every bad value is refused with the path of its key and the names known there; a
``Mapping``/``Sequence`` that is no dict or list (an OmegaConf ``DictConfig``) reads
the same as the plain one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format.naming import EXPORTS_DIR, step_name
from functional_ckpt.errors import ConfigError
from functional_ckpt.policy import (
    always,
    at_steps,
    every_epochs,
    every_secs,
    every_steps,
    keep_all,
    keep_best,
    keep_every,
    keep_last,
    keep_within,
    never,
    on_degrade,
    on_final,
    on_improve,
    on_signal,
    policy_from_config,
    retention_from_config,
)
from tests import prefork

REPO = Path(__file__).resolve().parent.parent


class Frozen(Mapping[str, Any]):
    """A read-only mapping that is no dict (what a DictConfig looks like to a reader)."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = {k: wrap(v) for k, v in data.items()}

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Items(Sequence[Any]):
    """A sequence that is no list."""

    def __init__(self, data: Sequence[Any]) -> None:
        self._data = [wrap(v) for v in data]

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return self._data[i]

    def __len__(self) -> int:
        return len(self._data)


def wrap(value: Any) -> Any:
    if isinstance(value, dict):
        return Frozen(value)
    if isinstance(value, list):
        return Items(value)
    return value


# --------------------------------------------------------------------------- policies


def test_short_and_full_forms_build_the_same_policies() -> None:
    table: list[tuple[Any, fc.policy.SavePolicy]] = [
        ({"every_steps": 500}, every_steps(500)),
        ({"every_steps": {"n": 500, "offset": 0}}, every_steps(500)),
        ({"every_steps": {"n": 5, "offset": 5}}, every_steps(5, offset=5)),
        ({"every_secs": 3600}, every_secs(3600)),
        ({"every_secs": {"secs": 1.5}}, every_secs(1.5)),
        ({"every_epochs": 2}, every_epochs(2)),
        ({"at_steps": [3, 1]}, at_steps([1, 3])),
        ({"on_improve": "val_loss"}, on_improve("val_loss")),
        ({"on_improve": {"metric": "acc", "mode": "max", "min_delta": 0.1}},
         on_improve("acc", mode="max", min_delta=0.1)),
        ("on_final", on_final()),
        ({"on_final": {}}, on_final()),
        ({"always": None}, always()),
        ("never", never()),
        ({"on_degrade": {"metric": "reward", "mode": "max", "patience": 2}},
         on_degrade("reward", mode="max", patience=2)),
        ({"any": [{"every_steps": 5}, {"every_secs": 60}]}, every_steps(5) | every_secs(60)),
        ({"all": [{"every_epochs": 1}, {"on_improve": "loss"}]},
         every_epochs(1) & on_improve("loss")),
        ({"not": {"at_steps": [0]}}, ~at_steps([0])),
        ({"any": [{"every_steps": 7}]}, every_steps(7)),
    ]  # fmt: skip
    for cfg, expected in table:
        built = policy_from_config(cfg)
        assert repr(built) == repr(expected) and built.spec == expected.spec, cfg
        assert policy_from_config(wrap(cfg)).spec == expected.spec, cfg  # any Mapping
        written = built.spec
        assert policy_from_config(written).spec == expected.spec
        assert codec.decode(codec.encode(written)) == written  # plain data
        assert json.loads(json.dumps(written)) == written


def test_signals_by_name_or_number() -> None:
    for value in ("SIGUSR1", "usr1", int(signal.SIGUSR1)):
        p = policy_from_config({"on_signal": value})
        try:
            assert p.spec == {"on_signal": {"signum": "SIGUSR1"}}
        finally:
            p.uninstall()  # type: ignore[attr-defined]
    p = on_signal()
    try:
        assert p.spec == {"on_signal": {"signum": "SIGTERM"}}
    finally:
        p.uninstall()


def test_every_config_is_the_spelled_out_spec() -> None:
    """The full form holds what the spec holds (every argument), under readable names."""
    p = every_steps(5, offset=1) | every_secs(60) & ~at_steps([3])
    assert p.spec == {
        "any": [
            {"every_steps": {"n": 5, "offset": 1}},
            {"all": [{"every_secs": {"secs": 60.0}}, {"not": {"at_steps": {"steps": [3]}}}]},
        ]
    }
    assert policy_from_config(p.spec).spec == p.spec


def test_retention_forms() -> None:
    table: list[tuple[Any, fc.policy.RetentionPolicy]] = [
        ({"keep_last": 3}, keep_last(3)),
        ({"keep_last": {"n": 3}}, keep_last(3)),
        ("keep_all", keep_all()),
        ({"keep_best": {"k": 2, "metric": "val_loss"}}, keep_best(2, "val_loss")),
        ({"keep_best": {"k": 2, "metric": "acc", "mode": "max"}}, keep_best(2, "acc", "max")),
        ({"keep_every": 1000}, keep_every(1000)),
        ({"keep_within": 86400}, keep_within(86400)),
        ([{"keep_last": 3}, {"keep_every": 10}], keep_last(3) | keep_every(10)),
        ([{"keep_last": 3}], keep_last(3)),
    ]
    for cfg, expected in table:
        built = retention_from_config(cfg)
        assert repr(built) == repr(expected) and built.spec == expected.spec, cfg
        assert retention_from_config(wrap(cfg)).spec == expected.spec
        assert retention_from_config(built.spec).spec == expected.spec


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"any": [{"every_steps": 5}, {"every_secs": "x"}]},
         "save.any[1].every_secs: expected a positive number, got 'x'"),
        ({"every_step": 5},
         "save: unknown policy 'every_step'; known: any, all, not, always, never, on_final, "
         "every_steps, every_epochs, at_steps, every_secs, on_improve, on_degrade, on_signal"),
        ({"every_steps": {"m": 5}}, "save.every_steps.m: unknown argument; known: n, offset"),
        ({"every_steps": {"offset": 5}}, "save.every_steps.n: required (arguments: n, offset)"),
        ({"every_steps": 0}, "save.every_steps: expected a positive int, got 0"),
        ({"every_steps": True}, "save.every_steps: expected a positive int, got True"),
        ({"every_steps": 5, "every_secs": 60},
         "save: expected one policy name as the only key, got ['every_secs', 'every_steps']"),
        ({}, "save: expected one policy name as the only key, got none"),
        (5, "save: expected a policy (a name, or a mapping of one name to its arguments), got 5"),
        ({"any": []}, "save.any: expected a non-empty list of policies, got []"),
        ({"all": {"every_steps": 5}}, "save.all: expected a non-empty list of policies"),
        ({"not": {"on_improve": {"metric": "loss", "mode": "avg"}}},
         "save.not.on_improve.mode: expected 'min' or 'max', got 'avg'"),
        ({"at_steps": [1, "2"]}, "save.at_steps[1]: expected an int, got '2'"),
        ({"on_signal": "SIGNOPE"}, "save.on_signal: expected a signal name such as 'SIGTERM'"),
        ({"on_final": 3}, "save.on_final: expected no arguments"),
        ({"every_secs": float("inf")}, "save.every_secs: expected a positive number, got inf"),
    ],
)  # fmt: skip
def test_bad_policies_name_their_key(cfg: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        policy_from_config(cfg)
    assert str(caught.value).startswith(message)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, fc.CheckpointError)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"keep_lats": 3}, "keep: unknown retention policy 'keep_lats'; known: keep_all, "),
        ([{"keep_last": 3}, {"keep_best": {"k": 1}}],
         "keep[1].keep_best.metric: required (arguments: k, metric, mode)"),
        ({"keep_within": -1}, "keep.keep_within: expected a number >= 0, got -1"),
        ([], "keep: expected a non-empty list of retention policies"),
    ],
)  # fmt: skip
def test_bad_retention_names_its_key(cfg: Any, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        retention_from_config(cfg)
    assert str(caught.value).startswith(message), str(caught.value)


def test_a_policy_from_outside_has_no_config_form(tmp_path: Path) -> None:
    class Mine(fc.policy.SavePolicy):
        def init(self) -> None:
            return None

        def decide(self, state: Any, event: Any) -> bool:
            return True

        def update(self, state: Any, event: Any, saved: bool) -> None:
            return None

    with pytest.raises(ConfigError, match="defined outside functional_ckpt"):
        policy_from_config((every_steps(1) | Mine()).spec)
    with (
        fc.CheckpointManager(tmp_path, save=every_steps(1) | Mine()) as mgr,
        pytest.raises(ConfigError, match=r"^save: .*defined outside functional_ckpt"),
    ):
        mgr.config()


# --------------------------------------------------------------------------- the manager

FULL: dict[str, Any] = {
    "save": {"any": [{"every_steps": 2}, {"every_secs": 3600}, "on_final"]},
    "keep": [{"keep_last": 2}, {"keep_best": {"k": 1, "metric": "loss"}}],
    "metadata": {"experiment": "cfg", "lr": 0.1, "tags": ["a", "b"]},
    "read_only": False,
    "async_save": {"staging": "copy"},
    "tiers": {"disk": {"incremental": True}},
    "export": {
        "policy": {"every_epochs": 1},
        "select": "model",
        "dtype": "bfloat16",
        "max_shard_size": "1GB",
        "strip_prefix": ["module."],
        "rename": {"w": "weight"},
        "config": {"model_type": "tiny"},
        "extra_files": {"README.md": "weights of a tiny model"},
        "keep": {"keep_last": 2},
    },
    "rollback": {"on_degrade": {"metric": "loss", "drop": 0.5}},
    "per_rank": ["rng"],
    "run": {"retries": 5, "backoff": 2},
}


def test_a_manager_from_its_config_and_back(tmp_path: Path) -> None:
    cfg = {"root": str(tmp_path / "run"), **FULL}
    with fc.CheckpointManager.from_config(cfg) as mgr:
        assert repr(mgr.save_policy) == "every_steps(2) | every_secs(3600.0) | on_final()"
        assert repr(mgr.keep) == "keep_last(2) | keep_best(1, 'loss')"
        assert mgr.export is not None and mgr.export.dtype is torch.bfloat16
        assert mgr.export.strip_prefix == ["module."] and mgr.export.rename == {"w": "weight"}
        assert mgr.metadata == FULL["metadata"]
        written = mgr.config()
        for step in range(1, 5):
            state = {"model": {"w": torch.full((2,), float(step))}}
            mgr.maybe_save(state, step=step, epoch_end=step % 2 == 0, metrics={"loss": 1 / step})
        mgr.wait_exports()
        assert mgr.steps() == [2, 4]
    assert written["root"] == str(tmp_path / "run")
    assert written["save"] == policy_from_config(FULL["save"]).spec
    assert (
        written["async_save"] == {"staging": "copy"}
        and written["tiers"]["disk"]["incremental"] is True
    )
    assert written["export"]["dtype"] == "bfloat16"
    assert written["export"]["keep"] == {"keep_last": {"n": 2}}
    assert written["rollback"] == {
        "on_degrade": {"metric": "loss", "mode": "min", "drop": 0.5, "patience": 3, "to": "best"}
    }
    assert written["run"] == {"retries": 5, "backoff": 2.0, "max_backoff": 60.0, "stall_limit": 2}
    assert json.loads(json.dumps(written)) == written
    exported = sorted(p.name for p in (tmp_path / "run" / EXPORTS_DIR).iterdir())
    assert exported == [step_name(2), step_name(4)]
    # Written back, read again: the same configuration; stored in metadata as it is.
    with fc.CheckpointManager.from_config(written, metadata={"config": written}) as again:
        assert again.config()["save"] == written["save"]
        assert again.config()["export"] == written["export"]
        assert again.restore_latest() is not None
        again.maybe_save({"model": {"w": torch.zeros(2)}}, step=6)
        again.wait()  # saves are asynchronous in this configuration
        assert again.info(6).metadata["config"] == written


def test_defaults_and_any_mapping(tmp_path: Path) -> None:
    with fc.CheckpointManager.from_config(wrap({"root": str(tmp_path)})) as mgr:
        assert mgr.config() == {
            "root": str(tmp_path),
            "save": {"every_steps": {"n": 1, "offset": 0}},
            "keep": "keep_all",
            "metadata": {},
            "read_only": False,
            "async_save": False,
            "per_rank": ["rng", "loader"],
            "tiers": {"disk": {"incremental": False, "compression": None}},
        }
    with fc.CheckpointManager.from_config(wrap({"root": str(tmp_path / "b"), **FULL})) as mgr:
        assert mgr.config()["export"]["rename"] == {"w": "weight"}
        assert mgr.metadata["tags"] == ["a", "b"] and type(mgr.metadata) is dict


def test_keyword_arguments_replace_the_configs(tmp_path: Path) -> None:
    with fc.CheckpointManager.from_config({"keep": {"keep_last": 1}}, root=tmp_path / "r") as mgr:
        assert mgr.config()["root"] == str(tmp_path / "r")  # the root from the caller
    now = [0.0]
    cfg = {"root": str(tmp_path / "ignored"), "save": {"every_secs": 10}}
    with fc.CheckpointManager.from_config(cfg, root=tmp_path / "a", clock=lambda: now[0]) as mgr:
        assert mgr.root == tmp_path / "a"
        assert not mgr.maybe_save({"x": 1}, step=1)  # the first event starts the timer
        now[0] = 11.0
        assert mgr.maybe_save({"x": 2}, step=2)


def test_a_remote_tier_as_data_keeps_its_credentials_out(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    url = f"file://{tmp_path / 'remote'}"
    secret = {"key": "AKIA-not-to-be-written"}
    cfg = {
        "root": str(tmp_path / "local"),
        "tiers": {"remote": {"url": url, "keep": {"keep_last": 1}, "storage_options": secret}},
    }
    with fc.CheckpointManager.from_config(cfg) as mgr:
        remote = mgr._options[2]
        assert remote is not None and remote.storage_options == secret
        written = mgr.config()
    assert written["tiers"]["remote"] == {
        "url": url,
        "keep": {"keep_last": {"n": 1}},
        "prune_unuploaded": False,
    }
    assert "AKIA" not in json.dumps(written)
    cfg = {"root": str(tmp_path / "l2"), "tiers": {"remote": url}}
    with fc.CheckpointManager.from_config(cfg) as mgr:
        assert mgr.config()["tiers"]["remote"]["url"] == url


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({}, "root: required"),
        ({"root": "r", "sav": {"every_steps": 1}},
         "config.sav: unknown key; known: root, save, keep, metadata, read_only, async_save, "
         "export, tiers, rollback, per_rank, run"),
        ({"root": "r", "save": {"any": [{"every_steps": 1}, {"every_secs": "x"}]}},
         "save.any[1].every_secs: expected a positive number, got 'x'"),
        ({"root": "r", "keep": {"keep_last": "3"}},
         "keep.keep_last: expected a positive int, got '3'"),
        ({"root": "r", "read_only": "yes"}, "read_only: expected true or false, got 'yes'"),
        ({"root": "r", "async_save": {"staging": "copies"}},
         "async_save.staging: expected 'copy' or 'write' or 'none', got 'copies'"),
        ({"root": "r", "export": {"select": "model"}}, "export.policy: required"),
        ({"root": "r", "export": {"policy": "always", "dtype": "int8"}},
         "export.dtype: expected a floating-point dtype such as 'bfloat16', got 'int8'"),
        ({"root": "r", "export": {"policy": "always", "max_shard_size": "5 parsecs"}},
         "export.max_shard_size: expected a number of bytes or a size such as '5GB'"),
        ({"root": "r", "export": {"policy": {"every_epoch": 1}}},
         "export.policy: unknown policy 'every_epoch'"),
        ({"root": "r", "export": {"policy": "always", "keep": {"keep_last": 0}}},
         "export.keep.keep_last: expected a positive int, got 0"),
        ({"root": "r", "export": {"policy": "always", "sellect": "model"}},
         "export.sellect: unknown field; known: policy, select, dtype"),
        ({"root": "r", "tiers": {"remote": {"keep": "keep_all"}}}, "tiers.remote.url: required"),
        ({"root": "r", "tiers": {"remote": {"url": "s3://b", "storage_options": "secret"}}},
         "tiers.remote.storage_options: expected a mapping"),
        ({"root": "r", "tiers": {"disk": {"compression": "lz4"}}},
         "tiers.disk.compression: Disk(compression='lz4')"),
        ({"root": "r", "tiers": {"remote": {"url": None}}}, "tiers.remote.url: required"),
        ({"root": "r", "tiers": {"tape": {}}}, "tiers.tape: unknown tier; known: memory, disk"),
        ({"root": "r", "per_rank": "rng"},
         "per_rank: expected a list of top-level keys, got 'rng'"),
        ({"root": "r", "run": {"retries": -1}}, "run.retries: expected an int >= 0, got -1"),
        ({"root": "r", "run": {"retry": 3}},
         "run.retry: unknown option; known: retries, backoff, max_backoff, stall_limit"),
        ({"root": "r", "run": {"stall_limit": 1}}, "run.stall_limit: expected 0 (never) or 2"),
        ({"root": "r", "rollback": {"on_degrade": {"metric": "loss", "to": "worst"}}},
         "rollback.on_degrade.to: expected 'best' or 'last_good', got 'worst'"),
        ({"root": "r", "metadata": ["x"]}, "metadata: expected a mapping, got ['x']"),
        (["root"], "config: expected a mapping of keys, got ['root']"),
    ],
)  # fmt: skip
def test_bad_manager_configs_name_their_key(tmp_path: Path, cfg: Any, message: str) -> None:
    os.chdir(tmp_path)  # "r" would be created here, were it ever opened
    with pytest.raises(ConfigError) as caught:
        fc.CheckpointManager.from_config(cfg)
    assert str(caught.value).startswith(message), str(caught.value)
    assert not (tmp_path / "r").exists()  # refused before anything is opened


def test_what_has_no_plain_form_is_refused_by_config(tmp_path: Path) -> None:
    export = fc.manager.Export(fc.every_epochs(1), rename=str.upper)
    with (
        fc.CheckpointManager(tmp_path, export=export) as mgr,
        pytest.raises(ConfigError, match=r"export\.rename: a function has no configuration"),
    ):
        mgr.config()


def test_omegaconf_configs_are_read_as_they_come(tmp_path: Path) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"root": str(tmp_path), **FULL})
    with fc.CheckpointManager.from_config(cfg) as mgr:
        assert repr(mgr.save_policy) == "every_steps(2) | every_secs(3600.0) | on_final()"
        assert mgr.config()["export"]["strip_prefix"] == ["module."]


# --------------------------------------------------------------------------- the example file


def _example_dict() -> dict[str, Any]:
    """examples/config.yaml as a dict, written out (the form that needs no YAML parser)."""
    return {
        "root": "runs/configured",
        "save": {"any": [{"every_steps": 50}, {"every_secs": 3600}, "on_final"]},
        "keep": [{"keep_last": 3}, {"keep_best": {"k": 1, "metric": "loss"}}],
        "export": {
            "policy": {"every_epochs": 1},
            "select": "model",
            "dtype": "bfloat16",
            "keep": {"keep_last": 2},
        },
        "run": {"retries": 3, "backoff": 1},
    }


def test_the_example_config_as_a_dict_builds_its_manager(tmp_path: Path) -> None:
    with fc.CheckpointManager.from_config(_example_dict(), root=tmp_path) as mgr:
        assert repr(mgr.save_policy) == "every_steps(50) | every_secs(3600.0) | on_final()"
        assert mgr.config()["run"]["retries"] == 3


def test_the_example_yaml_file_is_the_dict_and_its_training_runs(tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    path = REPO / "examples" / "config.yaml"
    assert yaml.safe_load(path.read_text()) == _example_dict()
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = REPO / "examples" / "configured_train.py"
    out = prefork.run(
        [sys.executable, str(script), str(path), str(root)],
        capture_output=True, text=True, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [
        step_name(50), step_name(100), step_name(120)
    ]  # fmt: skip
    # Weights at the end of every epoch (40 steps each), the last two kept.
    assert sorted(p.name for p in (root / EXPORTS_DIR).iterdir()) == [step_name(80), step_name(120)]
    info = fc.CheckpointManager(root, read_only=True).info(120)
    assert info.metadata["config"] == _example_dict()


def test_a_memory_tier_as_data(tmp_path: Path) -> None:
    """The memory tier is configured like the other tiers, and written back whole."""
    ram = tmp_path / "ram"
    cfg = {
        "root": str(tmp_path / "run"),
        "tiers": {
            "memory": {
                "path": str(ram),
                "save": {"every_steps": 2},
                "keep": 1,
                "budget": 0.25,
                "promote_on": ["SIGTERM", "usr1"],
                "promote_within": 30,
                "replicas": 1,
            }
        },
    }
    with fc.CheckpointManager.from_config(cfg) as mgr:
        option = mgr._options[0]
        assert option is not None and option.keep == 1 and option.budget == 0.25
        assert option.promote_on == (int(signal.SIGTERM), int(signal.SIGUSR1))
        written = mgr.config()["tiers"]["memory"]
    assert written == {
        "path": str(ram),
        "save": policy_from_config({"every_steps": 2}).spec,
        "keep": 1,
        "budget": 0.25,
        "promote_on": ["SIGTERM", "SIGUSR1"],
        "promote_within": 30,
        "async_save": True,
        "incremental": True,
        "replicas": 1,
    }
    with fc.CheckpointManager.from_config({**cfg, "tiers": {"memory": written}}) as again:
        assert again.config()["tiers"]["memory"] == written
    for bad, fragment in (
        ({"keep": 3}, "tiers.memory.keep: Memory(keep=3): expected fc.keep_last(1) or fc.keep_"),
        ({"budget": True}, "tiers.memory.budget: Memory(budget=True): expected bytes"),
        ({"promote_on": ["SIGNOPE"]}, "tiers.memory.promote_on[0]: expected a signal name"),
        ({"sizes": 1}, "tiers.memory.sizes: unknown field"),
        ({"replicas": 0}, "tiers.memory.replicas: Memory(replicas=0): expected a number of copies"),
    ):
        with pytest.raises(fc.errors.ConfigError, match=re.escape(fragment)):
            fc.CheckpointManager.from_config(
                {"root": str(tmp_path / "x"), "tiers": {"memory": bad}}
            )
    placed = fc.manager.Memory(path=ram, domain=lambda rank: rank // 8)
    with (
        fc.CheckpointManager(tmp_path / "run2", tiers=(placed,)) as mgr,
        pytest.raises(fc.errors.ConfigError, match=r"memory\.domain=.*no plain form"),
    ):
        mgr.config()
