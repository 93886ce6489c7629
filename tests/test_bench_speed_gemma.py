"""``maskkv bench speed`` on DiffusionGemma shapes (issue #47, item 4): its own sampler's cases, the limit line, the
refusals, run in this process on ``diffusiongemma-tiny`` (canvas 8). Nothing here is a timing: the checks are what
each row holds."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from maskkv_cli.bench.speed_case import run_case
from maskkv_cli.bench.speed_gemma import gemma_bench_model, measure_gemma_limit
from maskkv_cli.bench.speed_settings import SpeedCase, SpeedSettings
from maskkv_cli.cli import app
from maskkv_cli.errors import UsageError
from maskkv_cli.models.diffusion_gemma import DiffusionGemma

runner = CliRunner()
TINY = dict(config="diffusiongemma-tiny", gen_length=12, steps=3, none_steps=2, warmup=False)


def test_rows_of_each_policy():
    """none (extrapolated from 2 of its 6 passes), full and MaskKV at 16 on a 64-token prompt, 12 tokens asked: two
    canvases of 8 generated, 3 passes each; MaskKV keeps less than full, whose kept cache is the whole one; each
    row has its limit (the bare passes) and the memory model's figures."""
    rows = {name: run_case(SpeedCase(name, 16 if name == "maskkv" else None, 64, **TINY))
            for name in ("none", "full", "maskkv")}
    for row in rows.values():
        assert row["family"] == "diffusion_gemma" and row["generated_tokens"] == 16 and row["canvas_length"] == 8
        assert row["steps_run"] == 6 and row["total_s"] > 0 and row["limit_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(16 / row["total_s"])
    none, full, kept = rows["none"], rows["full"], rows["maskkv"]
    assert none["extrapolated"] and none["steps_timed"] == 2 and none["kv_bytes"] == 0
    assert none["model_cache_per_sequence_bytes"] is None and none["limit_keys"] is None
    assert not full["extrapolated"] and full["kv_bytes"] == full["kv_full_bytes"] and not full["evicted"]
    assert 0 < kept["kv_bytes"] < full["kv_bytes"] and kept["evicted"] and kept["method"] == "maskkv@16"
    assert kept["limit_keys"] == 16 + 8 and full["limit_keys"] == 64 + 8
    assert kept["model_cache_per_sequence_bytes"] < full["model_cache_per_sequence_bytes"]


def test_the_warm_up_adds_the_cases_own_prefill_by_the_same_rule(monkeypatch):
    """As for the other families (``speed_settings.warms_own_length``): with the rule on, the warm-up runs the case's
    own prefill (the encoder and the first decoder pass) after the short canvas and stops there; with it off, only
    the short canvas."""
    from sample_spy import counting_sample

    from maskkv_cli import sampling
    from maskkv_cli.bench import speed_gemma, speed_settings

    monkeypatch.setattr(speed_gemma, "WARMUP_PROMPT", 16)  # shorter than the case, so the two warm-ups differ
    runs: list[tuple[int, int]] = []  # per generation: (prompt length, passes seen)
    monkeypatch.setattr(sampling, "sample", counting_sample(sampling.sample, runs))
    case = SpeedCase("maskkv", 16, 48, **{**TINY, "warmup": True, "limit": False})
    monkeypatch.setattr(speed_settings, "OWN_LENGTH_WARMUP_CPU", 47)
    row = run_case(case)
    assert row["warmup_own_length"] is False and runs == [(16, 2), (48, 6)]  # short canvas, measured run
    runs.clear()
    monkeypatch.setattr(speed_settings, "OWN_LENGTH_WARMUP_CPU", 48)
    row = run_case(case)
    assert row["warmup_own_length"] is True and row["steps_run"] == 6
    assert runs == [(16, 2), (48, 1), (48, 6)]  # the case's own prefill in between, stopped after its first pass


def test_the_limit_counts_every_pass_and_commit():
    """The limit: prefill = a bare encode and a pass over the whole cache; total = that + the later passes at their
    median + one commit per canvas after the first; ``none``: every pass an encode and a whole pass."""
    model = gemma_bench_model("diffusiongemma-tiny", torch.device("cpu"), "auto", 0)
    assert isinstance(model, DiffusionGemma) and model.dtype == torch.float32
    prompt = torch.randint(3, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    cut = measure_gemma_limit(model, prompt, 8, canvases=2, steps=5, seed=0)
    assert len(cut.step_s) == 3 and cut.extrapolated and cut.attention_keys == 16
    assert cut.total_s > cut.prefill_s + 9 * cut.median_step_s  # and one commit
    none = measure_gemma_limit(model, prompt, None, canvases=2, steps=5, seed=0)
    assert none.total_s == pytest.approx(10 * none.prefill_s) and none.keys is None


def test_cli_json_and_the_steps_default(tmp_path):
    """The command on a DiffusionGemma shape: JSON rows, 48 passes per canvas unless --steps says."""
    assert SpeedSettings(prompt_lengths=(32,), config="diffusiongemma-tiny", steps=48).cases()[0].steps == 48
    args = ["bench", "speed", "--config", "diffusiongemma-tiny", "--prompt-lengths", "32", "--policies", "full,maskkv",
            "--budgets", "8", "-n", "8", "--steps", "2", "--in-process", "--no-limit", "--json"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "res")])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert [r["method"] for r in rows] == ["full", "maskkv@8"] and all(r["steps_run"] == 2 for r in rows)
    assert "DiffusionGemma: the gen length rounded up" in (tmp_path / "res" / "summary.md").read_text()


@pytest.mark.parametrize("args, words", [
    (["--batch-sizes", "1,2"], "one generation at a time"),
    (["--step-modes", "eager,compile"], "eager"),
    (["--policies", "maskkv-plus"], "not available for diffusion_gemma"),
])
def test_refused_in_one_line(args, words):
    result = runner.invoke(app, ["bench", "speed", "--config", "diffusiongemma-tiny", "--prompt-lengths", "32",
                                 "--in-process", *args])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output


def test_a_shape_that_does_not_fit_is_refused_before_anything_is_allocated(monkeypatch):
    """diffusiongemma-26b-a4b's weights counted on the meta device against the device's free memory: refused in one
    line (here: 1 GiB free), by the settings' check and by the loader alike."""
    import maskkv_cli.engine.batch_memory as batch_memory

    monkeypatch.setattr(batch_memory, "free_bytes", lambda device: 1 << 30)
    settings = SpeedSettings(prompt_lengths=(1024,), config="diffusiongemma-26b-a4b", steps=48)
    with pytest.raises(UsageError, match=r"diffusiongemma-26b-a4b: its random float32 weights take 94\.1 GiB"):
        settings.check()
    with pytest.raises(UsageError, match="bfloat16 weights take 47.0 GiB"):
        gemma_bench_model("diffusiongemma-26b-a4b", torch.device("cpu"), "bf16", 0)


def test_a_diffusion_gemma_checkpoint_runs_its_own_cases(tmp_path):
    """--model a DiffusionGemma folder (transformers' save_pretrained of a tiny random model): its family read from
    config.json before anything loads, so its cases take 48 passes per canvas and its own checks."""
    pytest.importorskip("transformers.models.diffusion_gemma")
    from tests.dgemma_folder import build_folder

    folder = build_folder(tmp_path / "dgemma")
    base = ["bench", "speed", "--model", str(folder), "--prompt-lengths", "24", "--in-process", "--no-limit"]
    result = runner.invoke(app, [*base, "--policies", "maskkv", "--budgets", "8", "-n", "8", "--json", "--out",
                                 str(tmp_path / "res")])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["results"][0]
    assert row["family"] == "diffusion_gemma" and row["steps"] == 48 and row["steps_run"] == 48
    refused = runner.invoke(app, [*base, "--batch-sizes", "1,2"])
    assert refused.exit_code == 2 and "one generation at a time" in refused.output
