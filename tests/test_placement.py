from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import maskkv_cli.engine.lanes as lanes
import maskkv_cli.engine.prefill as prefill_module
import maskkv_cli.engine.step as step_module
from maskkv_cli.app.session import Session
from maskkv_cli.cli import app
from maskkv_cli.engine.plan import CacheConfig
from maskkv_cli.errors import UsageError
from maskkv_cli.models.placement import parse_device_map, split_layers
from maskkv_cli.sampling.llada import GenerationConfig

CPU = torch.device("cpu")


def test_split_layers_contiguous_and_even():
    a, b = torch.device("cuda:0"), torch.device("cuda:1")
    assert split_layers(5, [a, b]) == [a, a, a, b, b]
    assert split_layers(2, [CPU, CPU]) == [CPU, CPU]
    with pytest.raises(UsageError):
        split_layers(3, [])


def test_parse_device_map():
    assert parse_device_map(None, 4) is None
    assert parse_device_map("cpu,cpu", 4) == [CPU] * 4
    assert parse_device_map(" cpu , cpu ", 4) == [CPU] * 4
    for spec, entry in (("cpu,,cpu", 2), ("cpu,cpu,", 3), (" ,cpu", 1)):  # a device left out changed the split
        with pytest.raises(UsageError, match=f"--device-map {spec}: entry {entry} is empty; give one device per"):
            parse_device_map(spec, 4)
    if torch.cuda.device_count() < 2:
        assert parse_device_map("auto", 4) is None
    with pytest.raises(UsageError, match="--device-map cpu,nonsense-device: unknown device 'nonsense-device'; use"):
        parse_device_map("cpu,nonsense-device", 4)
    if not torch.cuda.is_available():  # a device this machine lacks is named as such
        with pytest.raises(UsageError, match="--device-map cuda:0,cuda:1: device cuda:0: .* finds no CUDA GPU"):
            parse_device_map("cuda:0,cuda:1", 4)


def test_cpu_map_runs_the_same_path_and_answers_the_same(tiny_dir, monkeypatch):
    seen = []
    real = lanes.on_layer

    def spy(model, i, x):
        seen.append((i, getattr(model, "layer_devices", None)))
        return real(model, i, x)

    monkeypatch.setattr(prefill_module, "on_layer", spy)
    monkeypatch.setattr(step_module, "on_layer", spy)
    gen = GenerationConfig(gen_length=8, steps=4, block_length=8)
    cache = CacheConfig(policy="maskkv", budget=8)
    plain = Session(str(tiny_dir)).answer("the river " * 20, gen, cache)
    mapped_session = Session(str(tiny_dir), device_map="cpu,cpu")
    mapped = mapped_session.answer("the river " * 20, gen, cache)
    assert mapped_session.model.layer_devices == [CPU, CPU]
    assert torch.equal(mapped.result.tokens, plain.result.tokens)
    assert (1, [CPU, CPU]) in seen  # the engine consulted the map at every layer


def test_cli_device_map(tiny_dir, tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text("The river runs past the mill. " * 20)
    result = CliRunner().invoke(app, ["ask", str(doc), "Where?", "--model", str(tiny_dir), "--device-map", "cpu,cpu",
                                      "-n", "8", "--steps", "4", "--block-length", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["answers"][0]["stats"]["steps_run"] == 4


def test_device_map_auto_with_fewer_than_two_gpus_says_it_runs_on_one_device(tmp_path):
    """It ran on the CPU without a word, while --help says "auto (every visible GPU)"."""
    if torch.cuda.device_count() > 1:
        pytest.skip("two GPUs here: auto spreads the model")
    doc = tmp_path / "doc.txt"
    doc.write_text("The special magic number for apple is 4821.\n")
    result = CliRunner().invoke(app, ["ask", str(doc), "What is the special magic number for apple?",
                                      "--device-map", "auto", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert (f"note: --device-map auto: {torch.cuda.device_count()} GPU(s) visible, so the model is not spread over "
            "devices; it runs on cpu") in result.stderr
