"""Exports that transformers loads as it loads save_pretrained's output, bit for bit.

Tiny models built from configs (nothing is downloaded): a Llama and a GPT-2, tied
embeddings, sharded with an index, bf16; config and side files in the export;
prefixed names from torch.compile; manager exports with retention, off the
training thread.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.export import exports as exporting
from functional_ckpt._src.export.safetensors import CONFIG_FILE
from functional_ckpt._src.format.naming import EXPORT_INDEX, EXPORT_WEIGHTS

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
AutoModelForCausalLM = transformers.AutoModelForCausalLM

IDS = torch.tensor([[1, 5, 9, 33, 2, 7, 60, 3]])


def tiny_llama(**kw: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kw,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    return AutoModelForCausalLM.from_config(config).eval()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(IDS).logits
    return out


def load(out: Path, dtype: torch.dtype = torch.float32) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    return model.eval()


def assert_bit_exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_from_pretrained_loads_the_export_bit_exactly(build: Any, tmp_path: Path) -> None:
    model = build(**({"tie_word_embeddings": True} if build is tiny_llama else {}))
    want = logits(model)
    out = fc.export_safetensors(fc.capture(model=model), tmp_path / "hf", config=model.config)
    assert (out / CONFIG_FILE).is_file() and (out / EXPORT_WEIGHTS).is_file()
    loaded = load(out)
    assert_bit_exact(logits(loaded), want)
    head = loaded.get_output_embeddings().weight
    assert head.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()  # still tied


def test_sharded_bf16_export_with_an_index(tmp_path: Path) -> None:
    model = tiny_llama(tie_word_embeddings=False)
    # The reference: the same weights in bf16, in a model transformers built in bf16
    # (which keeps its rotary buffers in float32, as from_pretrained does).
    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16).eval()
    ref.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    want = logits(ref)
    out = fc.export_safetensors(
        fc.capture(model=model),
        tmp_path / "hf",
        config=model.config,
        dtype=torch.bfloat16,
        max_shard_size="8KB",
    )
    index = json.loads((out / EXPORT_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert json.loads((out / CONFIG_FILE).read_text())["dtype"] == "bfloat16"
    loaded = load(out, torch.bfloat16)
    for name, t in ref.state_dict().items():
        assert_bit_exact(loaded.state_dict()[name], t)
    assert_bit_exact(logits(loaded), want)


def test_export_from_a_checkpoint_path_with_side_files_kept_on_overwrite(tmp_path: Path) -> None:
    model = tiny_gpt2()
    fc.save(tmp_path / "ckpt", fc.capture(model=model))
    gen = transformers.GenerationConfig(max_new_tokens=5, do_sample=False)
    out = tmp_path / "hf"
    fc.export_safetensors(
        tmp_path / "ckpt",
        out,
        config=model.config,
        extra_files={
            "generation_config.json": gen,
            "special_tokens_map.json": {"eos_token": "</s>"},
            "README.md": "tiny\n",
            "vocab.txt": _file(tmp_path / "vocab.txt", b"a\nb\n"),
        },
    )
    before = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith("model")}
    assert set(before) == {
        CONFIG_FILE,
        "generation_config.json",
        "special_tokens_map.json",
        "README.md",
        "vocab.txt",
    }
    (out / "notes.txt").write_text("written by hand")
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # tied: changes the embedding too
    fc.export_safetensors(
        fc.capture(model=model), out, overwrite=True, extra_files={"README.md": "v2\n"}
    )
    after = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.startswith("model")}
    assert after == {**before, "README.md": b"v2\n", "notes.txt": b"written by hand"}
    assert_bit_exact(logits(load(out)), logits(model))
    assert transformers.GenerationConfig.from_pretrained(out).max_new_tokens == 5


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_compiled_model_names_are_stripped_and_warned_about(tmp_path: Path) -> None:
    model = tiny_llama()
    compiled = torch.compile(model)  # lazy: nothing is compiled until it is called
    state = fc.capture(model=compiled)
    with pytest.warns(fc.errors.CheckpointWarning, match=r"strip_prefix='_orig_mod\.'"):
        fc.export_safetensors(state, tmp_path / "raw", config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fc.errors.CheckpointWarning)
        out = fc.export_safetensors(
            state, tmp_path / "hf", config=model.config, strip_prefix="_orig_mod."
        )
    assert_bit_exact(logits(load(out)), logits(model))


def test_rename_maps_a_lightning_attribute_and_refuses_collisions(tmp_path: Path) -> None:
    model = tiny_gpt2()
    state = {"module": {"net": model.state_dict()}}  # a LightningModule holding it as .net
    out = fc.export_safetensors(
        state, tmp_path / "hf", select="module", config=model.config, rename={"net.": ""}
    )
    assert_bit_exact(logits(load(out)), logits(model))
    llama = tiny_llama()  # its own names start with "model." too: stripped once only
    lit = {"state_dict": {f"model.{k}": v for k, v in llama.state_dict().items()}}
    out = fc.export_safetensors(
        lit, tmp_path / "lit", select="state_dict", config=llama.config, strip_prefix="model."
    )
    assert_bit_exact(logits(load(out)), logits(llama))
    with pytest.raises(fc.CheckpointError, match="would both be named"):
        fc.export_safetensors(
            {"model": {"a.w": torch.zeros(2), "b.w": torch.ones(2)}},
            tmp_path / "x",
            rename=lambda name: name.split(".")[-1],
        )


def test_select_errors_never_show_internal_keys(tmp_path: Path) -> None:
    state = fc.capture(model=torch.nn.Sequential(torch.nn.Linear(2, 2)))
    fc.save(tmp_path / "ckpt", {"model": [{"w": torch.zeros(2)}], "step": 3})
    for source in (state, tmp_path / "ckpt"):
        with pytest.raises(fc.CheckpointError) as info:
            fc.export_safetensors(source, tmp_path / "e", select=("model", "_orig_mod"))
        assert "__container__" not in str(info.value)


def test_manager_exports_load_are_pruned_and_run_off_the_training_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_llama(tie_word_embeddings=True)
    threads: list[str] = []
    real = exporting.run_export

    def spy(*args: Any, **kw: Any) -> Path:
        threads.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr("functional_ckpt._src.export.exports.run_export", spy)
    export = fc.manager.Export(
        fc.every_steps(1),
        config=model.config,
        extra_files={"generation_config.json": transformers.GenerationConfig(max_new_tokens=3)},
        keep=fc.keep_last(2),
    )
    snapshots = {}
    with fc.CheckpointManager(
        tmp_path, save=fc.every_steps(2), export=export, async_save=True
    ) as mgr:
        for step in range(1, 6):
            state = fc.capture(model=model)
            mgr.maybe_save(state, step=step, metrics={"loss": 1.0 / step})
            mgr.wait_staged()
            snapshots[step] = logits(model)
            with torch.no_grad():  # the next optimizer step, while the export runs
                for p in model.parameters():
                    p.add_(0.25)
        mgr.wait_exports()
    assert threads and all(name == "fc-export" for name in threads)
    assert [e.step for e in exporting.export_infos(tmp_path)] == [4, 5]
    for step in (4, 5):
        out = exporting.export_path(tmp_path, step)
        assert transformers.GenerationConfig.from_pretrained(out).max_new_tokens == 3
        assert_bit_exact(logits(load(out)), snapshots[step])


# --------------------------------------------------------------------------- fckpt export --config


def _model_dir(path: Path, model: Any) -> Path:
    """A model directory as a user has one: save_pretrained's output and a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(path)
    (path / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (path / "pytorch_model.bin").write_bytes(b"old weights")
    (path / "onnx").mkdir()
    return path


def _fckpt(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from functional_ckpt._src import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_cli_export_with_a_model_directory_loads_with_from_pretrained(tmp_path: Path) -> None:
    model = tiny_gpt2()
    base = _model_dir(tmp_path / "base", model)
    with torch.no_grad():  # trained since: the export must hold the checkpoint's weights
        for p in model.parameters():
            p.add_(0.5)
    fc.save(tmp_path / "ckpt", fc.capture(model=model))
    out = tmp_path / "hf"
    code, text, err = _fckpt("export", str(tmp_path / "ckpt"), str(out), "--config", str(base))
    assert code == 0, err
    names = {p.name for p in out.iterdir()}
    assert names == {
        CONFIG_FILE,
        EXPORT_WEIGHTS,
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert "not taken from" in text and "pytorch_model.bin" in text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModel.from_pretrained(out)
        tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    want = model.state_dict()
    got = loaded.state_dict()
    assert got and all(torch.equal(t, want[f"transformer.{k}"]) for k, t in got.items())
    assert_bit_exact(logits(load(out)), logits(model))
    assert tokenizer("a b")["input_ids"] == [1, 2]

    code, _, err = _fckpt("export", str(tmp_path / "ckpt"), str(out), "--config", str(base))
    assert code == 2 and "--overwrite" in err  # never replaced unasked
    code, text, err = _fckpt(
        "export", str(tmp_path / "ckpt"), str(out), "--config", str(base / CONFIG_FILE),
        "--dtype", "bf16", "--overwrite", "--json",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads(text)
    assert doc["config"] == str(base / CONFIG_FILE) and doc["left_out"] == []
    assert json.loads((out / CONFIG_FILE).read_text())["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").is_file()  # kept from the export it replaced


def test_cli_export_config_never_follows_links_or_reads_special_files(tmp_path: Path) -> None:
    import os

    fc.save(tmp_path / "ckpt", fc.capture(model=torch.nn.Linear(2, 2)))
    secret = tmp_path / "secret"
    secret.write_text('{"not": "yours"}')
    cases: dict[str, tuple[Path, str]] = {}
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / CONFIG_FILE).write_text("{}")
    os.symlink(secret, linked / "tokenizer.json")
    cases["a link inside"] = (linked, "symbolic link")
    fifo_dir = tmp_path / "fifo_dir"
    fifo_dir.mkdir()
    (fifo_dir / CONFIG_FILE).write_text("{}")
    os.mkfifo(fifo_dir / "vocab.txt")
    cases["a FIFO inside"] = (fifo_dir, "a FIFO")
    os.symlink(secret, tmp_path / "config_link.json")
    cases["a linked config"] = (tmp_path / "config_link.json", "symbolic link")
    (tmp_path / "list.json").write_text("[1, 2]")
    cases["a config that is no object"] = (tmp_path / "list.json", "not a JSON config")
    (tmp_path / "none").mkdir()
    cases["no config.json"] = (tmp_path / "none", "holds no config.json")
    for i, (what, (config, fragment)) in enumerate(cases.items()):
        out = tmp_path / f"out{i}"
        code, text, err = _fckpt(
            "export", str(tmp_path / "ckpt"), str(out), "--config", str(config)
        )
        assert code == 2 and text == "", what
        assert err.count("\n") == 1 and fragment in err and str(config) in err, (what, err)
        assert not out.exists(), what
