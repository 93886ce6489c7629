"""Pre-quantized checkpoints (``quantization_config`` in config.json, issue 48): a torchao int8 weight-only
checkpoint loads as it is and runs as ``--quantize int8``; every other format is refused in one line naming what
maskkv loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

pytest.importorskip("torchao")

from maskkv_cli.bench.cases import random_model  # noqa: E402
from maskkv_cli.cli import app  # noqa: E402
from maskkv_cli.errors import ModelLoadError  # noqa: E402
from maskkv_cli.models.config import named_config  # noqa: E402
from maskkv_cli.models.loading import SINGLE_FILE, load_model, save_model  # noqa: E402
from maskkv_cli.models.quantize import quantization_of, quantize_model, quantize_weight_of, targets  # noqa: E402
from maskkv_cli.models.rows import Linear  # noqa: E402

runner = CliRunner()


def save_torchao(model: Any, folder: Path, shards: int = 2) -> Path:
    """``model`` as transformers saves a torchao int8 weight-only model: every linear layer of the blocks an
    ``Int8Tensor`` flattened by ``torchao.prototype.safetensors`` (``<module>._weight_qdata`` / ``_scale`` /
    ``_zero_point``, the class and attributes in each file's metadata), config.json's ``quantization_config``."""
    from torchao.core.config import config_to_dict
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from torchao.quantization import Int8WeightOnlyConfig

    folder = save_model(model, folder)
    state = {model.checkpoint_key(k): v.detach().clone() for k, v in model.state_dict().items()}
    for name in targets(model):
        key = model.checkpoint_key(f"{name}.weight")
        layer = Linear(state[key].shape[1], state[key].shape[0], bias=False)
        layer.weight = torch.nn.Parameter(state[key], requires_grad=False)
        quantize_weight_of(layer, "int8")
        state[key] = layer.weight.detach()
    data, metadata = flatten_tensor_state_dict(state)
    (folder / SINGLE_FILE).unlink()
    keys = sorted(data)
    weight_map = {}
    for i in range(shards):
        part = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {k: data[k].contiguous() for k in keys[i::shards]}  # a tensor's parts may fall in two files
        save_file(chunk, str(folder / part), metadata=metadata)
        weight_map.update(dict.fromkeys(chunk, part))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "torchao",
                                     "quant_type": {"default": config_to_dict(Int8WeightOnlyConfig())}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("config", ["tiny", "llada2-tiny"])
def test_a_torchao_int8_checkpoint_runs_as_quantize_int8(tmp_path: Path, config: str) -> None:
    model = random_model(named_config(config), std=0.2)
    plain = save_model(model, tmp_path / "plain")
    pre = save_torchao(model, tmp_path / "int8")
    loaded = load_model(pre)
    assert quantization_of(loaded) == "int8"
    ids = torch.randint(6, 400, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same int8 values and scales as quantizing the plain checkpoint while loading
        assert torch.equal(loaded(ids), load_model(plain, quantize="int8")(ids))
        assert torch.equal(loaded(ids), quantize_model(load_model(plain), "int8")(ids))
    assert load_model(pre, quantize="int8") is not None  # the same mode asked: fine
    with pytest.raises(ModelLoadError, match="holds int8 weights already"):
        load_model(pre, quantize="int4")


def test_the_cli_reports_the_checkpoints_own_quantization(tmp_path: Path, tiny_model: Any, tiny_tokenizer: Any,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pre = save_torchao(tiny_model, tmp_path / "int8")
    tiny_tokenizer.save_pretrained(str(pre))
    doc = tmp_path / "doc.txt"
    doc.write_text("The special magic number for apple is 4512. " * 4)
    result = runner.invoke(app, ["ask", str(doc), "What is the number?", "--model", str(pre), "-n", "8", "--steps",
                                 "8", "--block-length", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["answers"][0]["stats"]["quantization"] == "int8"
    # a default quantization of another mode (the config file's) is named, not "--quantize", and refused in one line
    config = tmp_path / "config.toml"
    config.write_text('quantize = "int4"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    refused = runner.invoke(app, ["ask", str(doc), "What?", "--model", str(pre)])
    assert refused.exit_code == 2 and refused.stderr.count("\n") == 1
    assert f'holds int8 weights already (torchao, Int8WeightOnlyConfig) and `quantize = "int4"` in {config} asks' \
           in refused.stderr


REFUSED = [
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "fp8, fmt e4m3"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq, bits 4"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq, bits 4"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes, 4-bit"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "compressed-tensors, format pack-quantized"),
    ({"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig", "_data": {}}}},
     "torchao, Int4WeightOnlyConfig"),
]


@pytest.mark.parametrize("quantization, words", REFUSED)
def test_other_formats_are_refused_in_one_line(tmp_path: Path, tiny_dir: Path, quantization: dict[str, Any],
                                                words: str) -> None:
    import shutil

    folder = Path(shutil.copytree(tiny_dir, tmp_path / "pre"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ModelLoadError, match="holds pre-quantized weights") as err:
        load_model(folder)
    assert words in str(err.value) and "torchao int8 weight-only" in str(err.value)
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text.")
    result = runner.invoke(app, ["ask", str(doc), "Q?", "--model", str(folder)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "--quantize int8 or int4" in result.stderr


def test_a_gptq_export_without_a_quantization_config_is_refused(tmp_path: Path, tiny_dir: Path) -> None:
    import shutil

    folder = Path(shutil.copytree(tiny_dir, tmp_path / "gptq"))
    (folder / "quantize_config.json").write_text(json.dumps({"bits": 8, "group_size": 128}))
    with pytest.raises(ModelLoadError, match="gptq, bits 8"):
        load_model(folder)


def test_torchao_tensors_of_another_class_are_refused(tmp_path: Path) -> None:
    model = random_model(named_config("tiny"), std=0.2)
    pre = save_torchao(model, tmp_path / "int8", shards=1)
    path = next(pre.glob("model-*.safetensors"))
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        data, metadata = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())
    name = next(n for n in json.loads(metadata["tensor_names"]) if "Int8Tensor" in metadata[n])
    metadata[name] = metadata[name].replace('"Int8Tensor"', '"Int4TilePackedTo4dTensor"')
    save_file(data, str(path), metadata=metadata)
    with pytest.raises(ModelLoadError, match="holds torchao Int4TilePackedTo4dTensor weights"):
        load_model(pre)


def test_a_pre_quantized_diffusion_gemma_is_refused(tmp_path: Path) -> None:
    from maskkv_cli.models.diffusion_gemma_config import named_config as dgemma_config
    from maskkv_cli.models.diffusion_gemma_config import to_hf
    from maskkv_cli.models.loading import load_diffusion_gemma

    folder = tmp_path / "dgemma"
    folder.mkdir()
    config = {**to_hf(dgemma_config("diffusiongemma-tiny")), "quantization_config": {"quant_method": "fp8"}}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="holds pre-quantized weights \\(fp8\\)"):
        load_diffusion_gemma(folder)


def test_maskkv_models_says_which_pre_quantized_checkpoints_load(tmp_path: Path, tiny_model: Any,
                                                                  tiny_tokenizer: Any, tiny_dir: Path) -> None:
    import shutil

    from maskkv_cli.models.catalog import inspect

    pre = save_torchao(tiny_model, tmp_path / "int8")
    tiny_tokenizer.save_pretrained(str(pre))
    found = inspect(pre, "int8", "folder")
    assert found.loadable and "int8 weights (torchao)" in (found.dtype or "")
    fp8 = Path(shutil.copytree(tiny_dir, tmp_path / "fp8"))
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    assert "holds pre-quantized weights (fp8)" in (inspect(fp8, "fp8", "folder").problem or "")
