"""``maskkv batch``, the harness model (``tests/test_harness_batch.py``) and ``maskkv serve`` take the shared run
options (``cli/run_options.py``), LLaDA2's ``--editing-threshold`` and ``--max-post-steps`` included, and pass them
to the sampler the answers come from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from maskkv_cli.cli import app

runner = CliRunner()
LLADA2 = ["--editing-threshold", "0.5", "--max-post-steps", "2", "--top-k", "4"]


@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Path:
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.loading import build_model, save_model

    cfg = named_config("llada2-tiny").with_(vocab_size=len(tiny_tokenizer))
    model = build_model(cfg).init_weights(seed=3, std=0.25).eval()
    return save_model(model, tmp_path_factory.mktemp("llada2") / "llada2", tiny_tokenizer)


@pytest.fixture
def sampled_with(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The LLaDA2 options of the session each answer was sampled with."""
    import maskkv_cli.app.pipeline as pipeline

    seen: list[Any] = []
    for name in ("ask", "ask_many"):
        real = getattr(pipeline, name)

        def spy(session: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            seen.append(session.llada2)
            return _real(session, *args, **kwargs)

        monkeypatch.setattr(pipeline, name, spy)
    return seen


def test_batch_passes_the_llada2_options(tmp_path: Path, llada2_dir: Path, sampled_with: list[Any]) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the old mill. " * 12)
    questions = tmp_path / "qs.txt"
    questions.write_text("Where does the river run?\nWhat stands by it?\n")
    base = ["batch", "--docs", str(doc), "--questions", str(questions), "--model", str(llada2_dir), "-n", "16",
            "--block-length", "8", "--budget", "8", "--json"]
    for size in ("1", "2"):  # one job at a time (``answer_job``) and in groups (``answer_jobs``)
        sampled_with.clear()
        out = tmp_path / f"out-{size}"
        result = runner.invoke(app, [*base, "--out", str(out), "--batch-size", size, *LLADA2])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["ok"] == 2
        assert sampled_with and {(o.editing_threshold, o.max_post_steps, o.top_k) for o in sampled_with} == {
            (0.5, 2, 4)}
        settings = json.loads((out / "config.json").read_text())["settings"]
        assert (settings["editing_threshold"], settings["max_post_steps"], settings["top_k"]) == (0.5, 2, 4)
    plain = tmp_path / "plain"
    result = runner.invoke(app, [*base, "--out", str(plain)])
    assert result.exit_code == 0, result.output
    edited = {json.loads(x)["key"] for x in (tmp_path / "out-1" / "answers.jsonl").read_text().splitlines()}
    assert edited.isdisjoint(json.loads(x)["key"] for x in (plain / "answers.jsonl").read_text().splitlines())


def test_a_job_key_without_the_llada2_options_is_the_one_before_them() -> None:
    """Runs made before batch took ``--editing-threshold`` and ``--max-post-steps`` keep their finished rows."""
    import hashlib
    from dataclasses import asdict

    from maskkv_cli.batch.jobs import LATER_FIELDS, AnswerSettings, job_key

    settings = AnswerSettings(policy="maskkv", budget=16, gen_length=8, steps=8, block_length=8)
    before = {k: v for k, v in asdict(settings).items() if k not in LATER_FIELDS}
    payload = {"document": "a" * 64, "question": "Q", "model": "m", "dtype": "fp32", "device": "cpu",
               "settings": before}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    assert job_key("a" * 64, "Q", "m", "fp32", "cpu", settings) == hashlib.sha256(text.encode()).hexdigest()[:24]
    edited = AnswerSettings(**{**asdict(settings), "editing_threshold": 0.5})
    assert job_key("a" * 64, "Q", "m", "fp32", "cpu", edited) != job_key("a" * 64, "Q", "m", "fp32", "cpu", settings)


def test_batch_help_lists_the_shared_options() -> None:
    result = runner.invoke(app, ["batch", "--help"], terminal_width=200)
    assert result.exit_code == 0
    for flag in ("--editing-threshold", "--max-post-steps", "--policy", "--top-p", "--seed", "--model", "--yes"):
        assert flag in result.output, flag


def test_serve_passes_the_llada2_options(llada2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    import maskkv_cli.server as server

    served: list[Any] = []
    monkeypatch.setattr(server, "serve", lambda app_, sock, **kwargs: served.append(app_.state.server))
    result = runner.invoke(app, ["serve", "--port", "0", "--model", str(llada2_dir), "--quiet", *LLADA2])
    assert result.exit_code == 0, result.output
    (state,) = served
    state.close()  # its runner and generation service (uvicorn's shutdown would)
    options = state.session.llada2
    assert (options.editing_threshold, options.max_post_steps, options.top_k) == (0.5, 2, 4)
    settings = state.config.settings  # what a request that does not say starts from
    assert (settings.editing_threshold, settings.max_post_steps) == (0.5, 2)


def test_eval_passes_the_shared_options(tmp_path: Path, eval_model_args: list[dict[str, Any]]) -> None:
    from maskkv_cli.evaluation.engine_adapter import harness_settings

    result = runner.invoke(app, ["eval", "--tasks", "x", "--budget", "8", "--threshold", "0.9", *LLADA2])
    assert result.exit_code == 0, result.output
    (args,) = eval_model_args
    run = {k: v for k, v in args.items() if k not in ("model", "device", "dtype", "quantize", "mc_samples",
                                                      "batch_size", "progress")}
    settings = harness_settings(run)  # the harness model takes them as they are
    assert (settings.budget, settings.threshold, settings.editing_threshold, settings.max_post_steps,
            settings.top_k, settings.block_length) == (8, 0.9, 0.5, 2, 4, None)


def test_eval_help_offers_no_download_it_does_not_do() -> None:
    """eval takes no --yes (each rank would download): its --model help said an id is downloaded with --yes or the
    user's consent, as the commands that load one model do."""
    def help_text(command: str) -> str:
        return " ".join(runner.invoke(app, [command, "--help"]).output.replace("│", " ").split())  # unwrapped

    assert "--yes" not in help_text("eval") and "download an id first with maskkv pull" in help_text("eval")
    assert "--yes or your consent" in help_text("ask")
