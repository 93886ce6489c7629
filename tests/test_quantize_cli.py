"""``--quantize`` on the commands that load a model (issue 48): the flag and the config file reach the loaded
weights, ``--json`` stats carry them, the keys of results tell quantized runs apart, and bad input is one line."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from prompts import NEEDLE_DOC
from typer.testing import CliRunner

pytest.importorskip("torchao")

from maskkv_cli.cli import app  # noqa: E402

runner = CliRunner()
QUESTION = "What is the special magic number for apple?"
SHORT = ["-n", "8", "--steps", "8", "--block-length", "8"]


def _doc(tmp_path: Path) -> Path:
    doc = tmp_path / "doc.txt"
    doc.write_text(NEEDLE_DOC)
    return doc


def _stats(args: list[str]) -> dict[str, Any]:
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["answers"][0]["stats"]


def test_ask_json_stats_carry_the_quantized_weights(tmp_path: Path, tiny_dir: Path) -> None:
    base = ["ask", str(_doc(tmp_path)), QUESTION, "--model", str(tiny_dir), *SHORT, "--json"]
    plain, int8, int4 = (_stats([*base, *extra]) for extra in ([], ["--quantize", "int8"], ["--quantize", "int4"]))
    assert (plain["quantization"], int8["quantization"], int4["quantization"]) == ("none", "int8", "int4")
    assert plain["weights_bytes"] > int8["weights_bytes"] > int4["weights_bytes"] > 0
    none = _stats([*base, "--quantize", "none"])
    assert (none["quantization"], none["weights_bytes"]) == ("none", plain["weights_bytes"])
    shown = runner.invoke(app, [*base[:-1], "--quantize", "int4"])  # the run's line names them (stderr)
    assert shown.exit_code == 0 and ", int4 weights " in shown.stderr
    assert " weights " not in runner.invoke(app, base[:-1]).stderr  # an unquantized run's line is as it was


def test_generate_summarize_and_profile_take_the_flag(tmp_path: Path, tiny_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import maskkv_cli.app.session as session

    loaded: list[str | None] = []
    real = session.load_checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        loaded.append(kwargs.get("quantize"))
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "load_checkpoint", spy)
    result = runner.invoke(app, ["generate", "Hello", "--model", str(tiny_dir), *SHORT, "--quantize", "int8",
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["stats"]["quantization"] == "int8"
    result = runner.invoke(app, ["summarize", str(_doc(tmp_path)), "--model", str(tiny_dir), "--length", "8",
                                 "--quantize", "int4", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["quantization"] == "int4"  # summarize and profile did not say it anywhere
    shown = runner.invoke(app, ["summarize", str(_doc(tmp_path)), "--model", str(tiny_dir), "--length", "8",
                                "--quantize", "int4"])
    assert re.search(r"note: int4 weights [\d.]+ [KM]iB", shown.stderr), shown.stderr
    result = runner.invoke(app, ["profile", str(_doc(tmp_path)), QUESTION, "--model", str(tiny_dir), *SHORT,
                                 "--policies", "full", "--quantize", "int4", "--json", "--no-warmup"])
    assert result.exit_code == 0, result.output
    assert loaded == ["int8", "int4", "int4", "int4"]
    assert '"quantization": "int4"' in result.stdout
    shown = runner.invoke(app, ["profile", str(_doc(tmp_path)), QUESTION, "--model", str(tiny_dir), *SHORT,
                                "--policies", "full", "--quantize", "int4", "--no-warmup"])
    assert "on cpu, int4 weights" in " ".join(shown.stdout.split())  # (the line wraps at the console's width)


def test_the_config_file_and_the_environment_set_the_default(tmp_path: Path, tiny_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["ask", str(_doc(tmp_path)), QUESTION, "--model", str(tiny_dir), *SHORT, "--json"]
    config = tmp_path / "config.toml"
    config.write_text('quantize = "int8"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    assert _stats(base)["quantization"] == "int8"
    assert _stats([*base, "--quantize", "none"])["quantization"] == "none"  # the flag wins
    monkeypatch.setenv("MASKKV_QUANTIZE", "int4")
    assert _stats(base)["quantization"] == "int4"  # the environment over the file, as MASKKV_MODEL


def test_bad_values_are_one_line(tmp_path: Path, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _doc(tmp_path)
    result = runner.invoke(app, ["ask", str(doc), QUESTION, "--model", str(tiny_dir), "--quantize", "int3"])
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "unknown quantization 'int3'; choose one of none, int8, int4" in result.output
    config = tmp_path / "config.toml"
    config.write_text('quantize = "fp8"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    result = runner.invoke(app, ["ask", str(doc), QUESTION, "--model", str(tiny_dir)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert f'`quantize = "fp8"` in {config}: unknown quantization' in result.stderr
    monkeypatch.delenv("MASKKV_CONFIG")
    result = runner.invoke(app, ["ask", str(doc), QUESTION, "--model", str(tiny_dir), "--quantize", "int8",
                                 "--device-map", "cpu,cpu"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert "--quantize int8: quantized weights with --device-map are not supported" in result.stderr
    # set by the environment, the refusal names it (it said "leave --quantize out" of a command without one)
    monkeypatch.setenv("MASKKV_QUANTIZE", "int8")
    result = runner.invoke(app, ["ask", str(doc), QUESTION, "--model", str(tiny_dir), "--device-map", "cpu,cpu"])
    assert result.exit_code == 2 and "error: MASKKV_QUANTIZE=int8: quantized weights with --device-map" in result.stderr
    assert "give --quantize none" in result.stderr


def test_without_torchao_the_error_names_the_extra(tmp_path: Path, tiny_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # what an import of a missing package does
    result = runner.invoke(app, ["ask", str(_doc(tmp_path)), QUESTION, "--model", str(tiny_dir), "--quantize",
                                 "int8"])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert "quantized weights need torchao" in result.stderr and "pip install -e '.[quant]'" in result.stderr


def test_what_torchao_cannot_run_is_refused_before_loading() -> None:
    from maskkv_cli.models.quantize import QuantizeError, check_supported

    for mode in ("int8", "int4"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            check_supported(mode, "cpu", dtype)  # every float dtype on the CPU
    with pytest.raises(QuantizeError, match="int4 on CUDA runs PyTorch's tinygemm kernel, which takes bf16 only"):
        check_supported("int4", "cuda", torch.float32)
    with pytest.raises(QuantizeError, match="runs on the CPU and on CUDA, not on mps"):
        check_supported("int8", "mps", torch.float32)
    with pytest.raises(QuantizeError, match="takes fp32, bf16 or fp16 weights, not float64"):
        check_supported("int8", "cpu", torch.float64)


def test_the_demo_and_calibrate_take_the_flag(tmp_path: Path, tiny_dir: Path) -> None:
    result = runner.invoke(app, ["demo", "--model", str(tiny_dir), "--length", "60", "--quantize", "int4", "--json"])
    assert result.exit_code == 0, result.output
    assert {r["stats"]["quantization"] for r in json.loads(result.stdout)["runs"]} == {"int4"}
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), "--samples", "1", "--max-tokens", "32",
                                 "--gen-length", "8", "--quantize", "int8", "--json"])
    assert result.exit_code == 0, result.output
    profile = json.loads(result.stdout)
    assert profile["quantization"] == "int8"
    from maskkv_cli.models.calibration import CalibrationProfile

    assert CalibrationProfile.from_dict(json.loads(Path(profile["path"]).read_text())).quantization == "int8"


def test_batch_keys_tell_quantized_runs_apart(tmp_path: Path, tiny_dir: Path) -> None:
    questions = tmp_path / "qs.txt"
    questions.write_text(QUESTION + "\n")
    out = tmp_path / "out"
    base = ["batch", "--docs", str(_doc(tmp_path)), "--questions", str(questions), "--model", str(tiny_dir),
            "--out", str(out), *SHORT, "--json"]
    first = runner.invoke(app, base)
    assert first.exit_code == 0 and json.loads(first.stdout)["ok"] == 1, first.output
    quant = runner.invoke(app, [*base, "--quantize", "int4"])
    assert quant.exit_code == 0, quant.output
    assert json.loads(quant.stdout)["reused"] == 0  # the unquantized row is not the int4 answer
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert [r["stats"]["quantization"] for r in rows] == ["none", "int4"]
    assert json.loads((out / "config.json").read_text())["quantize"] == "int4"
    again = runner.invoke(app, [*base, "--quantize", "int4"])
    assert json.loads(again.stdout)["reused"] == 1


def test_an_unquantized_key_is_the_one_from_before(tmp_path: Path) -> None:
    """Rows of runs made before --quantize existed stay reusable: no key of unquantized settings moved."""
    from maskkv_cli.batch.jobs import AnswerSettings, job_key
    from maskkv_cli.bench.memory import MemoryCase
    from maskkv_cli.bench.results import settings_key
    from maskkv_cli.bench.speed_settings import SpeedCase, SpeedSettings

    settings = AnswerSettings(policy="maskkv", budget=16)
    args: tuple[Any, ...] = ("a" * 64, "Q", "m", "fp32", "cpu", settings)
    assert job_key(*args) == job_key(*args, "none") != job_key(*args, "int8") != job_key(*args, "int4")
    case = SpeedCase("maskkv", 64, 128)
    from dataclasses import asdict

    assert case.key() == settings_key({k: v for k, v in asdict(case).items() if k not in ("batch_size",
                                                                                           "quantize", "model_id")})
    assert SpeedCase("maskkv", 64, 128, quantize="int4").key() != case.key()
    assert "quantize" not in SpeedSettings().as_dict()
    memory = MemoryCase("full", None)
    assert memory.key() == settings_key({k: v for k, v in asdict(memory).items() if k not in ("quantize",
                                                                                            "model_id")})


def test_bench_quality_rows_are_keyed_by_the_quantization(tmp_path: Path, tiny_dir: Path) -> None:
    base = ["bench", "quality", "--model", str(tiny_dir), "--tasks", "niah_single", "--lengths", "64", "-n", "2",
            "--policies", "full", "--gen-length", "8", "--steps", "8", "--block-length", "8", "--json"]
    out = tmp_path / "q"
    plain = runner.invoke(app, [*base, "--out", str(out)])
    assert plain.exit_code == 0, plain.output
    quant = runner.invoke(app, [*base, "--out", str(out), "--quantize", "int8"])
    assert quant.exit_code == 0, quant.output
    (row_plain,), (row_quant,) = json.loads(plain.stdout)["results"], json.loads(quant.stdout)["results"]
    assert row_plain["key"] != row_quant["key"]
    # the rows and the summary say which weights they are of (only config.json did)
    assert (row_plain["quantize"], row_quant["quantize"]) == ("none", "int8") and row_quant["dtype"] == "float32"
    assert "float32, int8 weights)" in (out / "summary.md").read_text()


def test_the_server_names_a_quantized_model_apart() -> None:
    pytest.importorskip("starlette")
    from maskkv_cli.server.app import model_id

    assert model_id("org/name") == "org/name"
    assert model_id("org/name", "int4") == "org/name:int4"


def test_serve_and_eval_pass_the_flag(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import maskkv_cli.server as server

    served: list[Any] = []
    monkeypatch.setattr(server, "serve", lambda app_, sock, **kwargs: served.append(app_.state.server))
    result = runner.invoke(app, ["serve", "--port", "0", "--model", str(tiny_dir), "--quiet", "--quantize", "int8"])
    assert result.exit_code == 0, result.output
    (state,) = served
    state.close()
    assert state.model == f"{tiny_dir.name}:int8"
    from maskkv_cli.models.quantize import quantized_layers

    assert quantized_layers(state.session.model)[0]


def test_eval_passes_the_flag_as_a_model_arg(eval_model_args: list[dict[str, Any]]) -> None:
    result = runner.invoke(app, ["eval", "--tasks", "x", "--quantize", "int4"])
    assert result.exit_code == 0, result.output
    assert eval_model_args[0]["quantize"] == "int4"


def test_the_harness_model_loads_quantized_weights(tiny_dir: Path) -> None:
    pytest.importorskip("lm_eval")
    from maskkv_cli.evaluation.harness_model import MaskKVLM

    lm = MaskKVLM(model=str(tiny_dir), device="cpu", quantize="int8")
    from maskkv_cli.models.quantize import quantization_of

    assert quantization_of(lm.engine.session.model) == "int8"


def test_bench_speed_compares_the_quantizations_round_by_round(tmp_path: Path) -> None:
    """``bench speed --quantize none,int8,int4 --repeats 2 --in-process``: the three alternate run after run in one
    process, each row its median run, the quantized rows with their step and prefill speedups over none."""
    from maskkv_cli.bench.speed import run_sweep
    from maskkv_cli.bench.speed_report import table_rows
    from maskkv_cli.bench.speed_settings import SpeedSettings

    settings = SpeedSettings(prompt_lengths=(32,), policies=("maskkv",), budgets=(8,), gen_length=16, steps=8,
                             block_length=8, config="llada2-tiny", quantize=("none", "int8", "int4"), repeats=2,
                             dtype="bf16", limit=False)
    assert [c.quantize for c in settings.cases()] == ["none", "int8", "int4"]
    order: list[str] = []

    from maskkv_cli.bench.speed_case import run_case

    def runner(case: Any) -> dict[str, Any]:
        order.append(case.quantize)
        return run_case(case)

    folder, rows = run_sweep(settings, out=tmp_path / "speed", runner=runner)
    assert order == ["none", "int8", "int4"] * 2  # alternating, round by round
    plain, int8, int4 = rows
    assert plain["weights_bytes"] > int8["weights_bytes"] > int4["weights_bytes"]
    for row in (int8, int4):
        expected = statistics.median(plain["step_s_runs"]) / statistics.median(row["step_s_runs"])
        assert row["step_speedup_vs_unquantized"] == pytest.approx(expected)
        assert len(row["prefill_speedup_vs_unquantized_runs"]) == 2
    head, body = table_rows(rows)
    assert head[head.index("method") + 1] == "weights" and [b[head.index("weights")] for b in body] == [
        "none", "int8", "int4"]
    assert "step vs unq" in head and "round by round: steps" in (folder.path / "summary.md").read_text()
    with pytest.raises(Exception, match="unknown quantization"):
        SpeedSettings(quantize=("int3",), config="tiny").check()


def test_ask_a_pdf_with_int4_weights_on_llada2_and_llada(tmp_path: Path, tiny_dir: Path, tiny_tokenizer: Any) -> None:
    """Issue 48's end: ``maskkv ask doc.pdf "..." --model FOLDER --quantize int4`` runs a LLaDA2 and a LLaDA
    checkpoint on the CPU (random tiny ones here)."""
    from pdfs import BODY, make_pdf

    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.loading import build_model, save_model

    cfg = named_config("llada2-tiny").with_(vocab_size=len(tiny_tokenizer))
    llada2 = save_model(build_model(cfg).init_weights(seed=3, std=0.25).eval(), tmp_path / "llada2", tiny_tokenizer)
    doc = tmp_path / "doc.pdf"
    doc.write_bytes(make_pdf(BODY))
    for folder in (llada2, tiny_dir):
        result = runner.invoke(app, ["ask", str(doc), "Who keeps the tide tables?", "--model", str(folder),
                                     "--quantize", "int4", "-n", "16", "--block-length", "8", "--json"])
        assert result.exit_code == 0, result.output
        stats = json.loads(result.stdout)["answers"][0]["stats"]
        assert stats["quantization"] == "int4" and stats["steps_run"] > 0


def test_int4_keeps_layers_its_kernels_cannot_pack_and_says_so(tmp_path: Path, tiny_tokenizer: Any) -> None:
    """A layer of an output width no multiple of 16 crashed the load ("_convert_weight_to_int4pack_cpu : expect N to
    be dividable by 16"); one of an input width no group size divides was kept unquantized without a word while the
    run line said "int4 weights". Both stay unquantized now, named in a note, and the plan counts them so."""
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.loading import build_model, save_model

    cfg = named_config("tiny").with_(vocab_size=len(tiny_tokenizer), mlp_hidden_size=100)  # up/gate: 100 outputs
    folder = save_model(build_model(cfg).init_weights(seed=3, std=0.25).eval(), tmp_path / "odd", tiny_tokenizer)
    base = ["generate", "Hello", "--model", str(folder), "--quantize", "int4", "-n", "8"]
    shown = runner.invoke(app, base)
    assert shown.exit_code == 0, shown.output
    assert re.search(r"note: int4: \d+ of \d+ layers keep their bfloat16 weights", shown.stderr), shown.stderr
    result = runner.invoke(app, [*base, "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    plan = runner.invoke(app, ["plan", "--model", str(folder), "--quantize", "int4", "--json"])
    assert plan.exit_code == 0, plan.output
    assert json.loads(plan.stdout)["rows"][0]["weights"] == stats["weights_bytes"]
