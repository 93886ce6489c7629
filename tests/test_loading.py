from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from maskkv_cli import load_model, load_tokenizer
from maskkv_cli.errors import ModelLoadError, ModelNotDownloaded
from maskkv_cli.models.config import named_config
from maskkv_cli.models.families import parameter_shapes
from maskkv_cli.models.loading import save_model
from maskkv_cli.paths import resolve_model_path

# The table of the spec (shared/spec/models.md), written out independently of the model code.
SPEC_8B = {
    "model.transformer.wte.weight": (126464, 4096),
    "model.transformer.ln_f.weight": (4096,),
    "model.transformer.ff_out.weight": (126464, 4096),
}
for _i in range(32):
    _p = f"model.transformer.blocks.{_i}."
    SPEC_8B.update({
        _p + "attn_norm.weight": (4096,), _p + "ff_norm.weight": (4096,),
        _p + "q_proj.weight": (4096, 4096), _p + "k_proj.weight": (4096, 4096),
        _p + "v_proj.weight": (4096, 4096), _p + "attn_out.weight": (4096, 4096),
        _p + "ff_proj.weight": (12288, 4096), _p + "up_proj.weight": (12288, 4096),
        _p + "ff_out.weight": (4096, 12288),
    })


def test_llada_8b_key_table_and_parameter_count():
    shapes = parameter_shapes(named_config("llada-8b"))
    assert shapes == SPEC_8B
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert total == 8_015_581_184
    assert 2 * total == 16_031_162_368  # the index's total_size in bf16


def test_round_trip_gives_identical_logits(tiny_dir, tiny_model):
    loaded = load_model(tiny_dir)
    ids = torch.randint(0, tiny_model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids), tiny_model(ids))
    assert loaded.config == tiny_model.config
    assert all(p.device.type == "cpu" and not p.is_meta for p in loaded.parameters())
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["d_model"] == 64


def test_sharded_checkpoint_loads(tmp_path, tiny_model, tiny_tokenizer):
    folder = save_model(tiny_model, tmp_path / "sharded", tiny_tokenizer, max_shard_bytes=40_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.arange(12)[None] % tiny_model.config.vocab_size
    assert torch.equal(load_model(folder)(ids), tiny_model(ids))


def test_bf16_load(tiny_dir):
    model = load_model(tiny_dir, dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert model(torch.arange(5)[None]).shape[-1] == model.config.vocab_size


def _mutate(tmp_path, tiny_dir, change):
    folder = tmp_path / "bad"
    shutil.copytree(tiny_dir, folder)
    state = load_file(str(folder / "model.safetensors"))
    change(state)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def test_missing_key_is_named(tmp_path, tiny_dir):
    folder = _mutate(tmp_path, tiny_dir, lambda s: s.pop("model.transformer.blocks.1.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing keys: model\.transformer\.blocks\.1\.up_proj\.weight"):
        load_model(folder)


def test_unexpected_and_misshaped_keys_are_named(tmp_path, tiny_dir):
    def change(s):
        s["model.transformer.extra.weight"] = torch.zeros(3)
        s["model.transformer.ln_f.weight"] = torch.zeros(65)

    folder = _mutate(tmp_path, tiny_dir, change)
    with pytest.raises(ModelLoadError) as info:
        load_model(folder)
    msg = str(info.value)
    assert "unexpected keys: model.transformer.extra.weight" in msg
    assert "model.transformer.ln_f.weight [65] (expected [64])" in msg
    assert "\n" not in msg


def test_folder_without_weights_or_config(tmp_path, tiny_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(empty)
    folder = tmp_path / "noweights"
    shutil.copytree(tiny_dir, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="holds no weights"):
        load_model(folder)


def test_unsupported_model_type(tmp_path, tiny_dir):
    folder = tmp_path / "other"
    shutil.copytree(tiny_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "mistral"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="model_type 'mistral' is not supported"):
        load_model(folder)


def test_hf_id_resolves_from_local_cache_only(tmp_path, tiny_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotDownloaded, match="`maskkv pull GSAI-ML/LLaDA-8B-Instruct`"):
        resolve_model_path("GSAI-ML/LLaDA-8B-Instruct")
    repo = tmp_path / "hub" / "models--GSAI-ML--LLaDA-8B-Instruct"
    shutil.copytree(tiny_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert resolve_model_path("GSAI-ML/LLaDA-8B-Instruct") == repo / "snapshots" / "abc123"
    model = load_model("GSAI-ML/LLaDA-8B-Instruct")
    assert model.config.n_layers == 2
    assert load_tokenizer("GSAI-ML/LLaDA-8B-Instruct").mask_token_id == model.config.mask_token_id


def test_tokenizer_loads_with_chat_template(tiny_dir):
    from maskkv_cli.prompting import chat_prompt_ids, llada_template

    tok = load_tokenizer(tiny_dir)
    ids = chat_prompt_ids(tok, "  What is the river?  ")
    text = tok.decode(ids)
    assert text == llada_template([{"role": "user", "content": "What is the river?"}])
    assert ids[0] == tok.convert_tokens_to_ids("<|startoftext|>")


def test_save_is_atomic_on_failure(tmp_path, tiny_model):
    class Boom:
        def save_pretrained(self, path):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_model(tiny_model, tmp_path / "out", Boom())
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == []


def test_a_cut_short_weights_file_or_a_missing_vocabulary_is_named_and_models_still_lists(tmp_path, tiny_dir):
    """A weights file cut short (an interrupted download) fails ``--model`` in one line naming it, and ``maskkv
    models`` lists that folder as not loading, with the rest of the table (it failed as a whole: SafetensorError is
    no OSError). A folder whose tokenizer has no vocabulary file (tokenizer_config.json alone) is listed as not
    loading (it said "yes")."""
    from typer.testing import CliRunner

    from maskkv_cli.cli import app
    from maskkv_cli.models.catalog import inspect, remember_folder

    cut = tmp_path / "cut"
    shutil.copytree(tiny_dir, cut)
    data = (tiny_dir / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cannot read the weights file .*cut/model.safetensors"):
        load_model(str(cut))
    no_vocabulary = tmp_path / "novocab"
    shutil.copytree(tiny_dir, no_vocabulary)
    (no_vocabulary / "tokenizer.json").unlink()
    assert (no_vocabulary / "tokenizer_config.json").is_file()
    assert "no tokenizer vocabulary" in (inspect(no_vocabulary, "novocab", "folder").problem or "")
    from maskkv_cli.prompting.chat import tokenizer_from_folder  # the loader says it in the same words

    with pytest.raises(ModelLoadError, match=r"model folder .*novocab has no tokenizer vocabulary \(tokenizer.json, "
                                             r"tokenizer.model, vocab.json, vocab.txt\)"):
        tokenizer_from_folder(no_vocabulary)
    for folder in (cut, no_vocabulary, tiny_dir):
        remember_folder(folder)
    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    listed = {m["name"]: m for m in json.loads(result.stdout)["models"]}
    by_path = {str(f.resolve()): f for f in (cut, no_vocabulary, tiny_dir)}
    loads = {by_path[name].name: m["loadable"] for name, m in listed.items() if name in by_path}
    assert loads == {"cut": False, "novocab": False, tiny_dir.name: True}, listed


def test_a_device_this_torch_cannot_use_is_one_clear_error(tiny_dir, monkeypatch) -> None:
    """``Session(path, device="cuda")`` on a CPU-only build raised torch's "pin_memory=True requires a CUDA or other
    accelerator backend"; ``device="gpu"`` torch's list of device names. The command line's check, as a
    ``UsageError``."""
    import pytest
    import torch

    import maskkv_cli as mk
    from maskkv_cli.errors import UsageError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for call in (lambda: mk.Session(str(tiny_dir), device="cuda"), lambda: mk.load_model(str(tiny_dir), device="cuda")):
        with pytest.raises(UsageError, match="finds no CUDA GPU on this machine"):
            call()
    with pytest.raises(UsageError, match="unknown device 'gpu'"):
        mk.Session(str(tiny_dir), device="gpu")
