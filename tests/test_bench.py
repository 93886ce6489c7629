"""bench speed / bench memory: rows, the limit's shapes, results folders and reuse, the CLI (tiny shapes only)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from maskkv_cli.bench import limit as lim
from maskkv_cli.bench.cases import random_model, random_prompt
from maskkv_cli.bench.memory import MemoryCase, compare, run_memory_case
from maskkv_cli.bench.results import ResultsFolder, read_jsonl
from maskkv_cli.bench.speed import run_sweep
from maskkv_cli.bench.speed_case import run_case, run_case_subprocess
from maskkv_cli.bench.speed_report import table_rows
from maskkv_cli.bench.speed_settings import SpeedCase, SpeedSettings
from maskkv_cli.cli.parsing import parse_count, parse_counts
from maskkv_cli.errors import UsageError
from maskkv_cli.models.config import named_config
from maskkv_cli.sampling.llada import GenerationConfig

TINY = dict(gen_length=16, steps=8, block_length=8, config="tiny", none_steps=2)
NUMERIC = ("prefill_s", "step_s", "total_s", "tokens_per_s", "peak_mem_bytes", "kv_bytes", "limit_s",
           "weights_bytes", "peak_above_weights_bytes", "measured_over_limit", "prompt_len")


@pytest.fixture(scope="module")
def model():
    return random_model(named_config("tiny"), seed=3, std=0.2)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.parametrize("policy,budget", [("none", None), ("full", None), ("maskkv", 8)])
def test_case_row_fields_are_numbers(policy, budget):
    row = run_case(SpeedCase(policy, budget, 48, **TINY))
    for name in NUMERIC:
        assert _is_number(row[name]), (name, row[name])
    assert row["policy"] == policy and row["budget"] == budget and row["prompt_len"] == 48
    assert row["limit_s"] > 0 and row["total_s"] > 0 and row["peak_mem_bytes"] > 0
    assert isinstance(row["extrapolated"], bool)
    assert row["tokens_per_s"] == pytest.approx(16 / row["total_s"])
    if policy == "none":
        # 2 timed steps out of 8: extrapolated from step 0 and the median later step
        assert row["extrapolated"] and row["steps_timed"] == 2 and row["steps_run"] == 8
        assert row["total_s"] == pytest.approx(row["prefill_s"] + 7 * row["step_s"])
        assert row["kv_bytes"] == 0 and row["limit_keys"] is None
    else:
        assert not row["extrapolated"] and row["steps_run"] == 8 and row["kv_bytes"] > 0
    if policy == "maskkv":
        assert row["evicted"] and row["kv_bytes"] < row["kv_full_bytes"]
        assert row["limit_keys"] == 8 + 16
    if policy == "full":
        assert row["kv_bytes"] == row["kv_full_bytes"] and row["limit_keys"] == 48 + 16


def test_none_runs_to_the_end_when_timed_steps_cover_it():
    row = run_case(SpeedCase("none", None, 32, **{**TINY, "none_steps": 8}))
    assert not row["extrapolated"] and row["steps_timed"] == 8


def test_rows_schedule_matches_the_sampler(model, monkeypatch):
    import maskkv_cli.sampling.driver as driver
    import maskkv_cli.sampling.llada as sampler
    from maskkv_cli.policies import get_policy

    gen = GenerationConfig(gen_length=16, steps=8, block_length=8)
    seen: list[int] = []
    real_prefill, real_step = driver.prefill_lanes, driver.step_logits

    def spy_prefill(model, lanes):
        seen.extend(len(lane.rows) for lane in lanes)
        return real_prefill(model, lanes)

    def spy_step(model, lanes):
        seen.extend(len(lane.rows) for lane in lanes)
        return real_step(model, lanes)

    monkeypatch.setattr(driver, "prefill_lanes", spy_prefill)
    monkeypatch.setattr(driver, "step_logits", spy_step)
    sampler.generate(model, random_prompt(model.config, 24, 0, torch.device("cpu")), gen, get_policy("full"))
    assert [n for _, n in lim.rows_schedule(gen)] == seen
    assert lim.rows_schedule(gen)[:5] == [(0, 8), (0, 6), (0, 4), (0, 2), (1, 8)]


def test_limit_step_attention_sees_budget_plus_response_keys(model, monkeypatch):
    shapes: list[tuple[int, int]] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        assert "attn_mask" not in kw or kw["attn_mask"] is None  # bare: no padding mask
        shapes.append((q.shape[2], k.shape[2]))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    m, budget, gen = 40, 6, GenerationConfig(gen_length=16, steps=8, block_length=8)
    prompt = random_prompt(model.config, m, 0, torch.device("cpu"))
    timing = lim.measure_limit(model, prompt, gen, budget)
    n_layers = model.config.n_layers
    full_pass, steps = shapes[:n_layers], shapes[n_layers:]
    assert full_pass == [(m + 16, m + 16)] * n_layers  # one plain forward over [prompt ; masks]
    assert len(steps) == (gen.steps - 1) * n_layers  # the prefill is step 0
    assert all(keys == budget + 16 for _, keys in steps)  # budget + response keys per layer
    # every layer runs the L response queries, except the last which runs the needed rows only
    assert [q for q, _ in steps[:n_layers]] == [16] * (n_layers - 1) + [6]
    assert timing.attention_keys == budget + 16 and len(timing.step_s) == gen.steps - 1
    assert timing.total_s == pytest.approx(timing.prefill_s + sum(timing.step_s)) and timing.total_s > 0


def test_limit_without_cache_is_steps_full_forwards(model):
    gen = GenerationConfig(gen_length=16, steps=8, block_length=8)
    timing = lim.measure_limit(model, random_prompt(model.config, 40, 0, torch.device("cpu")), gen, None)
    assert timing.extrapolated and timing.keys is None
    assert timing.total_s == pytest.approx(8 * timing.prefill_s)


def test_bare_forward_matches_the_model(model):
    ids = random_prompt(model.config, 30, 1, torch.device("cpu"))
    rows = torch.arange(20, 30)
    with torch.no_grad():
        ref = model(ids)[:, rows]
    got = lim.bare_full_forward(model, ids, rows, mlp_chunk=7)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def _counting_runner(calls: list[SpeedCase]):
    def runner(case: SpeedCase) -> dict:
        calls.append(case)
        return run_case(case)

    return runner


def test_sweep_writes_folder_and_rerun_reuses_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = SpeedSettings(prompt_lengths=(32, 48), budgets=(8,), **TINY)
    calls: list[SpeedCase] = []
    folder, rows = run_sweep(settings, runner=_counting_runner(calls))
    assert len(calls) == 6 and len(rows) == 6
    assert folder.path.parent.name == "runs" and folder.path.name.startswith("bench-speed-")
    for name in ("config.json", "results.jsonl", "summary.md"):
        assert (folder.path / name).is_file()
    assert len(read_jsonl(folder.path / "results.jsonl")) == 6
    config = json.loads((folder.path / "config.json").read_text())
    assert config["settings"]["prompt_lengths"] == [32, 48] and "machine" in config
    by = {(r["prompt_len"], r["method"]): r for r in rows}
    assert by[(48, "full")]["speedup_vs_full"] == pytest.approx(1.0)
    assert by[(48, "maskkv@8")]["speedup_vs_none"] == pytest.approx(
        by[(48, "none")]["total_s"] / by[(48, "maskkv@8")]["total_s"])
    assert "| 48 | maskkv@8 |" in (folder.path / "summary.md").read_text()

    # identical settings: same folder found, nothing measured again, same numbers
    again, rows2 = run_sweep(settings, runner=_counting_runner(calls))
    assert again.path == folder.path and len(calls) == 6 and again.reused == 6
    assert [r["total_s"] for r in rows2] == [r["total_s"] for r in rows]

    # one more length: only its cases run (explicit --out folder)
    bigger = SpeedSettings(prompt_lengths=(32, 48, 64), budgets=(8,), **TINY)
    _, rows3 = run_sweep(bigger, out=folder.path, runner=_counting_runner(calls))
    assert len(calls) == 9 and len(rows3) == 9
    assert all(c.prompt_len == 64 for c in calls[6:])

    # --fresh measures everything again in a new folder
    fresh, _ = run_sweep(settings, fresh=True, runner=_counting_runner(calls))
    assert fresh.path != folder.path and len(calls) == 15


def test_rows_of_a_checkpoint_are_not_reused_for_other_weights_at_its_path(tmp_path, tiny_dir):
    """Speed and memory rows were keyed by ``--model``'s path: new weights in the same folder (``train-tiny`` writes
    each run's model into the same ``final``) were shown as the old rows, "reused". The key now also holds the
    files' fingerprint: the same files keep their key, other weights at the same path get a new one."""
    import shutil

    from maskkv_cli.bench.memory import MemorySettings

    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    speed = SpeedSettings(prompt_lengths=(32,), policies=("full",), budgets=(8,), **{**TINY, "config": None},
                          model=str(folder))
    memory = MemorySettings(prompt_len=32, budget=8, gen_length=8, block_length=8, policies=("full",),
                            config=None, model=str(folder), profile=False)
    before = [speed.cases()[0].key(), memory.cases()[0].key()]
    assert before == [speed.cases()[0].key(), memory.cases()[0].key()]  # the same files: the same keys
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one weight's last byte
    weights.write_bytes(bytes(data))
    after = [speed.cases()[0].key(), memory.cases()[0].key()]
    assert after[0] != before[0] and after[1] != before[1]


def test_broken_jsonl_lines_are_skipped(tmp_path):
    (tmp_path / "config.json").write_text('{"kind": "speed", "settings": {"s": 1}}')
    (tmp_path / "results.jsonl").write_text('{"key": "a", "x": 1}\n{"key": "b", "x"\n')
    folder = ResultsFolder(tmp_path, "speed", {"s": 1}, ["a", "b"])
    assert folder.get("a") == {"key": "a", "x": 1} and folder.get("b") is None


def test_a_folder_of_something_else_is_refused_and_other_cases_rows_are_kept(tmp_path):
    """``--out`` naming a folder of another kind of run, a batch's answers or the user's own files is refused before
    anything is written (it was overwritten: config.json replaced, results.jsonl cut to this run's rows); a run of
    other settings into a folder of its kind keeps the rows of the cases it does not plan."""
    first = ResultsFolder(tmp_path / "run", "speed", {"s": 1}, ["a", "b"])
    first.put({"key": "a", "x": 1})
    first.put({"key": "b", "x": 2})
    config = (tmp_path / "run" / "config.json").read_text()
    with pytest.raises(UsageError, match="holds a bench speed run"):
        ResultsFolder(tmp_path / "run", "quality", {"q": 1}, ["c"])
    assert (tmp_path / "run" / "config.json").read_text() == config
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "batch").mkdir()
    (tmp_path / "batch" / "config.json").write_text('{"model": "m", "jobs": 3}')
    for folder in ("mine", "batch"):
        with pytest.raises(UsageError, match="not a maskkv bench run"):
            ResultsFolder(tmp_path / folder, "speed", {"s": 1}, ["a"])
    assert (tmp_path / "batch" / "config.json").read_text() == '{"model": "m", "jobs": 3}'
    (tmp_path / "empty").mkdir()
    ResultsFolder(tmp_path / "empty", "speed", {"s": 1}, ["a"])  # an empty folder is a new one

    other = ResultsFolder(tmp_path / "run", "speed", {"s": 2}, ["b", "c"])
    other.put({"key": "c", "x": 3})
    assert other.ordered() == [{"key": "b", "x": 2}, {"key": "c", "x": 3}]
    assert read_jsonl(tmp_path / "run" / "results.jsonl") == [{"key": "b", "x": 2}, {"key": "c", "x": 3},
                                                              {"key": "a", "x": 1}]
    fresh = ResultsFolder(tmp_path / "run", "speed", {"s": 2}, ["b"], fresh=True)  # measures b again, keeps a, c
    assert fresh.ordered() == [] and set(fresh.others) == {"a", "c"}


def test_case_in_a_fresh_process(tmp_path):
    case = SpeedCase("maskkv", 8, 32, **{**TINY, "warmup": False})
    row = run_case_subprocess(case, log_dir=tmp_path / "logs")
    assert row["key"] == case.key() and row["peak_reset"] in (True, False)
    assert row["peak_mem_bytes"] > 0 and row["limit_s"] > 0 and row["kv_bytes"] > 0
    assert (tmp_path / "logs" / f"{case.key()}.txt").is_file()  # a finished case's stderr is kept too


def test_memory_case_and_target():
    full = run_memory_case(MemoryCase("full", None, 64, 16, 8, "tiny"))
    mk = run_memory_case(MemoryCase("maskkv", 8, 64, 16, 8, "tiny"))
    for row in (full, mk):
        assert row["peak_mem_bytes"] > 0 and row["phases"] and row["peak_phase"].startswith("layer")
        assert {p["phase"] for p in row["phases"]} >= {"k projection + RoPE", "v projection", "q projection + RoPE",
                                                      "attention (SDPA)", "MLP", "LM head"}
        assert {p["layer"] for p in row["phases"]} == {-1, 0, 1, 2}  # start, two layers, the head
    assert "scoring (policy votes)" in {p["phase"] for p in mk["phases"]}
    assert mk["kv_bytes"] < full["kv_bytes"] == full["kv_full_bytes"]
    assert F.scaled_dot_product_attention.__module__ != "maskkv_cli.bench.memory"  # patches undone
    for row in (full, mk):  # the live reading: at least the kept cache, and every phase within the peak
        assert row["live_peak_above_weights_bytes"] >= row["kv_resident_bytes"] > 0
        assert max(p["live_above_weights_bytes"] for p in row["phases"]) == row["live_peak_above_weights_bytes"]
        assert row["live_after_prefill_bytes"] >= row["kv_resident_bytes"]
    # the share and the target use the live figure; the RSS ratio is reported beside it
    rows = compare([{**full, "live_peak_above_weights_bytes": 1000, "peak_above_weights_bytes": 900},
                    {**mk, "live_peak_above_weights_bytes": 200, "peak_above_weights_bytes": 300}])
    assert rows[0]["target_met"] is None and rows[1]["share_of_full"] == pytest.approx(0.2)
    assert rows[1]["rss_share_of_full"] == pytest.approx(1 / 3) and rows[1]["target_met"] is True
    rows = compare([{**full, "live_peak_above_weights_bytes": 1000}, {**mk, "live_peak_above_weights_bytes": 201}])
    assert rows[1]["target_met"] is False


def test_memory_baseline_is_read_after_the_free_heap_goes_back(monkeypatch):
    """The RSS baseline of a memory case (``loaded_mem_bytes``) is read right after the heap's free memory went back
    to the kernel (``runtime.stats.settle_memory``): freed blocks the heap keeps (up to its trim threshold) would
    otherwise sit in the baseline, and the prefill reusing them would read as less memory above it."""
    import maskkv_cli.bench.memory as memory
    import maskkv_cli.runtime.stats as stats

    calls: list[str] = []
    real_read = memory.read_current

    def read(device):
        calls.append("read")
        return real_read(device)

    monkeypatch.setattr(stats, "release_free_memory", lambda: calls.append("release") or True)
    monkeypatch.setattr(memory, "read_current", read)
    run_memory_case(MemoryCase("maskkv", 8, 64, 16, 8, "tiny", profile=False))
    assert calls[:2] == ["release", "read"]


def test_memory_live_reading_repeats_exactly():
    """The live figure counts tensors, not pages: the same case measured twice gives the same bytes."""
    case = MemoryCase("maskkv", 8, 64, 16, 8, "tiny", profile=False)
    first, second = run_memory_case(case), run_memory_case(case)
    assert first["live_peak_above_weights_bytes"] == second["live_peak_above_weights_bytes"] > 0


def test_memory_rows_without_the_live_reading_are_measured_again(tmp_path):
    from maskkv_cli.bench.memory import MemorySettings, run_memory
    from maskkv_cli.bench.results import ResultsFolder

    settings = MemorySettings(prompt_len=32, budget=8, gen_length=8, block_length=8, policies=("full", "maskkv"),
                              config="tiny", profile=False)
    cases = settings.cases()
    old = ResultsFolder(tmp_path, "memory", settings.as_dict(), [c.key() for c in cases])
    old.put({"key": cases[0].key(), "method": "full", "policy": "full", "peak_above_weights_bytes": 5})
    _, rows = run_memory(settings, tmp_path, isolate=False)
    assert [r["method"] for r in rows] == ["full", "maskkv@8"]
    assert all(r["live_peak_above_weights_bytes"] > 0 for r in rows)  # the old row was measured again
    seen = []
    run_memory(settings, tmp_path, isolate=False, on_case=lambda i, n, case, row: seen.append(row))
    assert [r["reused"] for r in seen if r is not None] == [True, True]  # rows with the live reading are reused


def test_parse_counts():
    assert parse_count("1k") == 1024 and parse_count("1.5K") == 1536 and parse_count("300") == 300
    assert parse_counts("1k, 2k,4096", "x") == (1024, 2048, 4096)
    for bad in ("0", "-1", "abc", "1.3"):
        with pytest.raises(UsageError):
            parse_count(bad)


runner = CliRunner()


def test_cli_bench_speed_json(tmp_path):
    from maskkv_cli.cli import app

    out = tmp_path / "res"
    args = ["bench", "speed", "--config", "tiny", "--prompt-lengths", "32", "--policies", "none,full,maskkv",
            "--budgets", "8", "--gen-length", "16", "--steps", "8", "--block-length", "8", "--none-steps", "2",
            "--in-process", "--out", str(out), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert list(data) == ["results"] and [r["method"] for r in data["results"]] == ["none", "full", "maskkv@8"]
    for r in data["results"]:
        for name in ("policy", "budget", "prompt_len", "total_s", "prefill_s", "step_s", "tokens_per_s",
                     "peak_mem_bytes", "kv_bytes", "limit_s", "extrapolated"):
            assert name in r
        assert r["limit_s"] > 0
    assert data["results"][0]["budget"] is None and data["results"][2]["budget"] == 8
    assert (out / "results.jsonl").is_file()
    # the table form
    result = runner.invoke(app, args[:-1])
    assert result.exit_code == 0 and "maskkv@8" in result.stdout and "reused" in result.stdout


def test_cli_bench_errors():
    from maskkv_cli.cli import app

    result = runner.invoke(app, ["bench", "speed", "--config", "tiny", "--policies", "nope", "--in-process"])
    assert result.exit_code == 2 and "unknown policy" in result.output
    result = runner.invoke(app, ["bench", "speed", "--config", "tiny", "--prompt-lengths", "1k,x"])
    assert result.exit_code == 2 and "not a count" in result.output
    result = runner.invoke(app, ["bench", "speed", "--config", "tiny", "--gen-length", "20", "--block-length", "8",
                                 "--in-process"])
    assert result.exit_code == 2 and "multiple" in result.output


@pytest.mark.parametrize("args", [
    ["speed", "--config", "bogus", "--prompt-lengths", "32"],
    ["speed", "--config", "tiny", "--prompt-lengths", "32", "--dtype", "float8"],
    ["memory", "--config", "bogus", "--prompt-length", "1k"], ["memory", "--prompt-length", "1k", "--dtype", "float8"],
    ["loading", "--config", "tiny", "--dtype", "float8"], ["quality", "--dtype", "float8"],
])
def test_a_bad_shape_or_dtype_is_refused_before_any_case_runs(tmp_path, monkeypatch, args):
    """Not a results folder of failed cases: one line, exit 2, and nothing written."""
    from maskkv_cli.cli import app

    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2, result.output
    assert "unknown model" in result.stderr or "unknown dtype" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


def test_gpu_script_is_valid_bash():
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "--config llada-8b" in text and "--gen-length 256" in text and "bench speed" in text


def _gpu_script_args(tmp_path, env: dict[str, str]) -> list[str]:
    """The arguments scripts/gpu_bench.sh gives `maskkv bench speed`: PYTHON is a stand-in that passes the GPU
    check and prints its arguments one per line."""
    import os
    import subprocess
    from pathlib import Path

    fake = tmp_path / "python"
    fake.write_text('#!/usr/bin/env bash\nif [[ "$1" == "-" ]]; then cat >/dev/null; exit 0; fi\n'
                    'printf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    script = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.sh"
    proc = subprocess.run(["bash", str(script), "--json"], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHON": str(fake), **env})
    return proc.stdout.splitlines()


def _value(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_gpu_script_defaults_fit_a_short_window_and_run_32k_first(tmp_path):
    args = _gpu_script_args(tmp_path, {"OUT": "/somewhere/else"})  # an exported OUT no longer redirects results
    assert args[:3] == ["-m", "maskkv_cli", "bench"] and args[3] == "speed" and args[-1] == "--json"
    assert _value(args, "--out") == "runs/bench-speed-h200"
    assert _value(args, "--prompt-lengths") == "1k,32k" and _value(args, "--budgets") == "256"
    assert "--longest-first" in args
    args = _gpu_script_args(tmp_path, {"MASKKV_BENCH_OUT": "runs/x", "LENGTHS": "32k", "BUDGETS": "64,256"})
    assert _value(args, "--out") == "runs/x" and _value(args, "--prompt-lengths") == "32k"
    assert _value(args, "--budgets") == "64,256"


def test_step_modes_make_their_own_cases_and_rows():
    settings = SpeedSettings(prompt_lengths=(32,), budgets=(8,), step_modes=("eager", "compile"), **TINY)
    methods = [c.method for c in settings.cases()]
    assert methods == ["none", "full", "full compile", "maskkv@8", "maskkv@8 compile"]  # none has no step to build
    row = run_case(SpeedCase("maskkv", 8, 32, step_mode="compile", **TINY))
    assert row["setup_s"] > 0 and row["step_mode"] == "compile" and row["steps_run"] == 8
    _, body = table_rows([{**row, "speedup_vs_none": None, "speedup_vs_full": None}])
    assert "compile setup" in body[0][-1] and body[0][1] == "maskkv@8 compile"
    with pytest.raises(UsageError, match="cuda"):
        SpeedSettings(prompt_lengths=(32,), step_modes=("cuda-graph",), **TINY).check()
    with pytest.raises(UsageError, match="step mode"):
        SpeedSettings(prompt_lengths=(32,), step_modes=("fast",), **TINY).check()


def test_speed_row_states_the_machines_matmul_ceiling_beside_the_prefill():
    from maskkv_cli.bench.ceiling import forward_flops, matmul_gflops

    cfg = named_config("tiny")
    model = random_model(cfg)
    m, L, d, n = 32, 16, cfg.d_model, cfg.n_layers
    linear = 4 * d * d + 3 * d * cfg.mlp_hidden_size  # q, k, v, out; SwiGLU's three matrices
    by_hand = 2 * (m + L) * n * linear + 4 * (m + L) ** 2 * d * n + 2 * L * d * cfg.vocab_size
    assert forward_flops(model, m, L) == by_hand
    gflops, size = matmul_gflops(torch.device("cpu"), torch.float32, size=64, repeats=3)
    assert gflops > 0 and size == 64
    row = run_case(SpeedCase("maskkv", 8, m, **TINY))
    assert row["prefill_flops"] == by_hand and row["matmul_size"] == 1024 and row["cpu_capability"]
    assert row["prefill_gflops"] == pytest.approx(by_hand / row["prefill_s"] / 1e9)
    head, body = table_rows([{**row, "speedup_vs_none": None, "speedup_vs_full": None}])
    cell = body[0][head.index("prefill GFLOP/s")]
    assert cell == f"{row['prefill_gflops']:.1f} of {row['matmul_gflops']:.1f}"
    no_limit = run_case(SpeedCase("maskkv", 8, m, limit=False, **TINY))
    assert table_rows([no_limit])[1][0][head.index("prefill GFLOP/s")] == "-"


def test_the_ceiling_counts_the_experts_a_token_runs():
    """A mixture of experts: each token runs its router's ``top_k`` experts and the shared one, not all of them."""
    from maskkv_cli.bench.ceiling import forward_flops

    cfg = named_config("llada-moe-tiny")  # layer 0 dense, layer 1 a mixture: 8 experts of 32, top 2, shared of 32
    moe, d, m, L = cfg.moe, cfg.d_model, 32, 16
    assert moe is not None and moe.layers == (False, True)
    attention = 4 * d * d  # q, k, v, out (as many KV heads as query heads here)
    dense = attention + 3 * d * cfg.mlp_hidden_size
    mixture = attention + moe.top_k * 3 * d * moe.expert_hidden + 3 * d * moe.shared_hidden
    by_hand = (2 * (m + L) * (dense + mixture) + 4 * (m + L) ** 2 * cfg.n_heads * cfg.head_dim * cfg.n_layers
               + 2 * L * d * cfg.vocab_size)
    assert forward_flops(random_model(cfg), m, L) == by_hand


# ----- batches of sequences (--batch-sizes) --------------------------------------------------------------------


def test_batch_size_one_keeps_its_keys_and_cases():
    from dataclasses import asdict

    from maskkv_cli.bench.results import settings_key

    case = SpeedCase("maskkv", 8, 32, **TINY)
    # the key of the fields a case had before batches (and before quantization, ``quantize`` "none")
    assert case.key() == settings_key({k: v for k, v in asdict(case).items()
                                       if k not in ("batch_size", "quantize", "model_id")})
    assert SpeedCase("maskkv", 8, 32, batch_size=2, **TINY).key() != case.key()
    assert "batch_sizes" not in SpeedSettings(**TINY).as_dict()
    settings = SpeedSettings(prompt_lengths=(32,), budgets=(8,), batch_sizes=(4, 1, 4), **TINY)
    assert settings.as_dict()["batch_sizes"] == [4, 1, 4]
    assert [(c.method, c.batch_size) for c in settings.cases()] == [
        ("none", 1), ("none", 4), ("full", 1), ("full", 4), ("maskkv@8", 1), ("maskkv@8", 4)]
    assert [c.key() for c in settings.cases() if c.batch_size == 1] == [
        c.key() for c in SpeedSettings(prompt_lengths=(32,), budgets=(8,), **TINY).cases()]


@pytest.mark.parametrize("policy,budget", [("none", None), ("full", None), ("maskkv", 8)])
def test_batch_case_row(policy, budget):
    single = run_case(SpeedCase(policy, budget, 40, **TINY))
    row = run_case(SpeedCase(policy, budget, 40, batch_size=2, **TINY))
    assert row["batch_size"] == 2 and row["method"] == single["method"]
    assert row["tokens_per_s"] == pytest.approx(2 * 16 / row["total_s"])
    assert row["seconds_per_sequence"] == pytest.approx(row["total_s"] / 2)
    assert row["limit_s"] > 0 and row["measured_over_limit"] == pytest.approx(row["total_s"] / row["limit_s"])
    assert row["limit_keys"] == single["limit_keys"]
    if policy == "none":
        assert row["extrapolated"] and row["steps_timed"] == 2 and row["steps_run"] == 8
        assert row["total_s"] == pytest.approx(row["prefill_s"] + 7 * row["step_s"])
        assert row["model_cache_per_sequence_bytes"] is None and row["kv_bytes"] == 0
        assert row["kv_full_bytes"] == 2 * single["kv_full_bytes"]
    else:
        assert not row["extrapolated"] and row["steps_run"] == row["steps_timed"] == 8
        assert row["total_s"] > row["prefill_s"] > 0 and row["step_s"] > 0
        assert row["kv_full_bytes"] == 2 * single["kv_full_bytes"]
        assert row["kv_bytes_per_sequence"] == row["kv_bytes"] // 2
        assert row["model_cache_per_sequence_bytes"] == single["model_cache_per_sequence_bytes"] > 0
        assert row["model_batch_bytes"] == (2 * (row["model_cache_per_sequence_bytes"]
                                                 + row["model_step_per_sequence_bytes"])
                                            + row["model_prefill_peak_bytes"])
    if policy == "full":
        assert row["kv_bytes"] == 2 * single["kv_bytes"]


def test_batch_limit_shares_the_prefill_and_attends_per_sequence(model, monkeypatch):
    shapes: list[tuple[int, int, int]] = []
    rows_in: list[int] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        shapes.append((q.shape[0], q.shape[2], k.shape[2]))
        return real(q, k, v, *a, **kw)

    first = model.blocks[0]
    real_qkv = first.qkv

    def spy_qkv(x, rope):
        rows_in.append(x.shape[0] * x.shape[1])
        return real_qkv(x, rope)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(first, "qkv", spy_qkv)
    m, budget, gen = 40, 6, GenerationConfig(gen_length=16, steps=8, block_length=8)
    prompts = random_prompt(model.config, m, 0, torch.device("cpu"), batch=2)
    timing = lim.measure_batch_limit(model, prompts, gen, budget)
    n_layers = model.config.n_layers
    prefills, steps = shapes[:n_layers], shapes[n_layers:]
    assert prefills == [(2, m + 16, m + 16)] * n_layers  # one full forward of both prompts (of one length)
    assert len(steps) == (gen.steps - 1) * n_layers * 2  # every later step: attention sequence by sequence
    assert all(b == 1 and keys == budget + 16 for b, _, keys in steps)
    assert [q for _, q, _ in steps[: 2 * n_layers]] == [16] * (2 * (n_layers - 1)) + [6, 6]
    assert rows_in == [2 * (m + 16)] + [2 * 16] * (gen.steps - 1)  # the projections take both sequences' rows
    assert len(timing.step_s) == gen.steps - 1 and timing.attention_keys == budget + 16 and timing.keys == budget
    assert timing.total_s == pytest.approx(timing.prefill_s + sum(timing.step_s)) and timing.total_s > 0

    shapes.clear()
    none = lim.measure_batch_limit(model, prompts, gen, None)  # no cache: one full forward of both, shared
    assert shapes == [(2, m + 16, m + 16)] * n_layers and none.extrapolated
    assert none.total_s == pytest.approx(8 * none.prefill_s)
    one = lim.measure_batch_limit(model, prompts[:1], gen, budget)
    assert one.attention_keys == budget + 16 and len(one.step_s) == gen.steps - 1


@pytest.mark.parametrize("per_sequence", [False, True])
def test_bare_steps_build_their_caches_before_any_step(model, monkeypatch, per_sequence):
    """The limit's timed steps run only the steps: the random caches they attend over are built at construction
    (the engine's caches come from its prefill), so a step draws nothing and allocates no cache."""
    bare = lim.BareSteps(model, 40, 6, 16, batch=2, per_sequence=per_sequence)
    drawn: list[tuple[int, ...]] = []
    real = torch.randn

    def spy(*a, **kw):
        drawn.append(tuple(a[0]) if a and isinstance(a[0], tuple) else ())
        return real(*a, **kw)

    monkeypatch.setattr(torch, "randn", spy)
    mask = torch.full((2, 16), model.config.mask_token_id)
    with torch.no_grad():
        for _ in range(2):
            logits = bare.step(mask, torch.arange(4))
    assert drawn == [] and logits.shape == (2, 4, model.config.vocab_size)


def test_batch_limit_of_block_causal_models_steps_each_sequence_over_its_own_entries(monkeypatch):
    """Two LLaDA2 sequences: every bare step attends per sequence over its own kept entries and blocks so far, as
    the engine's batched steps do; the prefill windows are one bare forward of both."""
    blocky = random_model(named_config("llada2-tiny"))
    prompts = random_prompt(blocky.config, 24, 0, torch.device("cpu"), batch=2)
    gen = GenerationConfig(gen_length=16, steps=8, block_length=8)
    batches: list[int] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        batches.append(q.shape[0])
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    two = lim.measure_batch_limit(blocky, prompts, gen, 8)
    assert two.keys == 8 and len(two.step_s) == len(lim.measure_limit(blocky, prompts[:1], gen, 8).step_s)
    assert 2 in batches and 1 in batches  # the windows batched, the steps per sequence


def test_cli_bench_speed_batch_sizes(tmp_path):
    from maskkv_cli.cli import app

    args = ["bench", "speed", "--config", "tiny", "--prompt-lengths", "32", "--policies", "full,maskkv",
            "--budgets", "8", "--gen-length", "16", "--steps", "8", "--block-length", "8", "--batch-sizes", "1,2",
            "--in-process", "--out", str(tmp_path / "res"), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert [(r["method"], r["batch_size"]) for r in rows] == [("full", 1), ("full", 2), ("maskkv@8", 1),
                                                              ("maskkv@8", 2)]
    by = {(r["method"], r["batch_size"]): r for r in rows}
    for r in rows:
        for name in ("tokens_per_s", "seconds_per_sequence", "peak_mem_bytes", "model_cache_per_sequence_bytes",
                     "model_prefill_peak_bytes", "limit_s", "measured_over_limit", "speedup_vs_batch1"):
            assert _is_number(r[name]), (name, r[name])
        single = by[(r["method"], 1)]
        assert r["speedup_vs_batch1"] == pytest.approx(r["tokens_per_s"] / single["tokens_per_s"])
        assert r["speedup_vs_full"] == pytest.approx(by[("full", r["batch_size"])]["total_s"] / r["total_s"])
    assert by[("full", 1)]["speedup_vs_batch1"] == pytest.approx(1.0)
    summary = (tmp_path / "res" / "summary.md").read_text()
    assert "| 32 | maskkv@8 | 2 |" in summary and "vs batch 1" in summary and "memory model" in summary
    result = runner.invoke(app, args[:-1])  # the table form, rows reused
    assert result.exit_code == 0 and "vs batch 1" in result.stdout and "cache/seq (model)" in result.stdout


def test_speed_table_without_batches_is_unchanged():
    row = run_case(SpeedCase("maskkv", 8, 32, **{**TINY, "limit": False}))
    head, body = table_rows([row])
    assert head == ["prompt", "method", "prefill s", "step ms", "total s", "tok/s", "vs none", "vs full", "peak mem",
                    "above weights", "KV kept", "limit s", "meas/limit", "prefill GFLOP/s", "note"]
    assert len(body[0]) == len(head)
    head2, body2 = table_rows([row, {**row, "batch_size": 2}])
    assert len(head2) == len(head) + 5 and all(len(b) == len(head2) for b in body2)
    assert head2[2] == "batch" and [b[2] for b in body2] == ["1", "2"]


@pytest.mark.parametrize("value", ["0", "x", "2,0", ""])
def test_cli_bench_speed_bad_batch_sizes(value):
    from maskkv_cli.cli import app

    result = runner.invoke(app, ["bench", "speed", "--config", "tiny", "--prompt-lengths", "32", "--batch-sizes",
                                 value, "--in-process"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--batch-sizes" in lines[0]


def test_cli_bench_speed_batches_refused_where_they_cannot_share_steps():
    from maskkv_cli.cli import app

    result = runner.invoke(app, ["bench", "speed", "--config", "tiny", "--prompt-lengths", "32", "--batch-sizes",
                                 "2", "--step-modes", "eager,compile", "--in-process"])
    assert result.exit_code == 2 and "eager" in result.output and len(result.output.strip().splitlines()) == 1


def test_block_causal_batches_in_bench_speed():
    """LLaDA2's sequences share the engine's steps: a batch case runs, with its limit line."""
    row = run_case(SpeedCase("maskkv", 8, 32, **{**TINY, "config": "llada2-tiny", "batch_size": 2}))
    assert row["batch_size"] == 2 and _is_number(row["limit_s"]) and _is_number(row["tokens_per_s"])


def test_repeats_run_round_by_round_and_keep_each_cases_median_run(tmp_path, monkeypatch):
    """``--repeats``: every case runs once per round, rounds one after another; a row is its case's median run
    (all its figures from that run) with every run's figures, and batch ratios come round by round too."""
    monkeypatch.chdir(tmp_path)
    settings = SpeedSettings(prompt_lengths=(32,), policies=("maskkv",), budgets=(8,), batch_sizes=(1, 2), repeats=3,
                             **TINY)
    order: list[int] = []
    totals = {1: iter([3.0, 1.0, 2.0]), 2: iter([4.0, 5.0, 2.5])}

    measured: dict[int, dict] = {}

    def runner(case: SpeedCase) -> dict:  # a real row of the case, with made-up times
        order.append(case.batch_size)
        if case.batch_size not in measured:
            measured[case.batch_size] = run_case(case)
        total = next(totals[case.batch_size])
        return {**measured[case.batch_size], "total_s": total, "tokens_per_s": case.batch_size * 16 / total,
                "prefill_s": total / 10}

    folder, rows = run_sweep(settings, runner=runner)
    assert order == [1, 2, 1, 2, 1, 2]
    one, two = rows
    assert one["total_s"] == 2.0 and one["prefill_s"] == pytest.approx(0.2) and one["repeats"] == 3
    assert one["total_s_runs"] == [3.0, 1.0, 2.0]
    assert two["total_s"] == 4.0 and two["speedup_vs_batch1"] == pytest.approx((32 / 4.0) / (16 / 2.0))
    assert two["speedup_vs_batch1_runs"] == pytest.approx([(32 / 4.0) / (16 / 3.0), (32 / 5.0) / 16, 32 / 2.5 / 8])
    summary = (folder.path / "summary.md").read_text()
    assert "round by round" in summary and "(median 1.50x)" in summary
    again, _ = run_sweep(settings, runner=runner)  # the same settings: the median rows are reused
    assert again.path == folder.path and len(order) == 6
    with pytest.raises(UsageError, match="--repeats"):
        SpeedSettings(repeats=0, **TINY).check()


# ----- the warm-up ---------------------------------------------------------------------------------------------


def test_warm_up_rule_own_length_prefill_on_cuda_always_elsewhere_up_to_4k():
    from maskkv_cli.bench.speed_settings import OWN_LENGTH_WARMUP_CPU, warms_own_length

    assert OWN_LENGTH_WARMUP_CPU == 4096
    for n in (1, 4096, 4097, 65536):
        assert warms_own_length(torch.device("cuda"), n) and warms_own_length(torch.device("cuda:1"), n)
    assert warms_own_length(torch.device("cpu"), 1) and warms_own_length(torch.device("cpu"), 4096)
    assert not warms_own_length(torch.device("cpu"), 4097) and not warms_own_length(torch.device("cpu"), 16384)


@pytest.mark.parametrize("batch", [1, 2])
def test_warm_up_at_the_cases_own_length_is_one_stopped_prefill(monkeypatch, batch):
    """With the rule on (CUDA, or a prompt of at most 4k tokens), the warm-up adds step 0 of the case's own
    generation, stopped there; with it off (a longer prompt off CUDA), the warm-up is the short run alone."""
    from sample_spy import counting_sample

    from maskkv_cli import sampling
    from maskkv_cli.bench import speed_case, speed_settings

    monkeypatch.setattr(speed_case, "WARMUP_PROMPT", 16)  # shorter than the case, so the two warm-ups differ
    runs: list[tuple[int, int]] = []  # per generation: (prompt length, steps seen, step 0 included)
    real_sample, real_many = sampling.sample, speed_case.sample_many

    def sample_many(model, jobs, *args, **kwargs):  # a batch: its length and, negated, its size
        runs.append((jobs[0].prompt.shape[1], -len(jobs)))
        return real_many(model, jobs, *args, **kwargs)

    monkeypatch.setattr(sampling, "sample", counting_sample(real_sample, runs))
    monkeypatch.setattr(speed_case, "sample_many", sample_many)
    case = SpeedCase("maskkv", 8, 48, batch_size=batch, **{**TINY, "limit": False})
    monkeypatch.setattr(speed_settings, "OWN_LENGTH_WARMUP_CPU", 47)  # the case's 48 tokens count as long here
    row = run_case(case)
    assert row["warmup_own_length"] is False
    assert runs == ([(16, 4), (48, 8)] if batch == 1 else [(16, -2), (48, -2)])  # short warm-up, measured run
    runs.clear()
    monkeypatch.setattr(speed_settings, "OWN_LENGTH_WARMUP_CPU", 48)  # and as short enough
    row = run_case(case)
    assert row["warmup_own_length"] is True and row["steps_run"] == 8
    # the case's own prefill in between, a single one stopped after step 0 (a batch: stopped at its first mark)
    assert runs == ([(16, 4), (48, 1), (48, 8)] if batch == 1 else [(16, -2), (48, -2), (48, -2)])


def test_a_bench_table_in_a_narrow_terminal_folds_its_cells_and_cuts_none(monkeypatch) -> None:
    """In a 100-column terminal the memory table dropped its method column and cut numbers ("45.2 M…", "31.…")."""
    from rich.console import Console

    import maskkv_cli.cli.commands.bench as bench_command

    console = Console(width=100, force_terminal=True, record=True, color_system=None)
    monkeypatch.setattr(bench_command, "report_console", lambda: console)
    head = ["method", "loaded", "peak", "above weights", "KV kept", "KV full", "saving", "vs full", "target", "note"]
    body = [["maskkv@16", "267.2 MiB", "317.1 MiB", "49.9 MiB", "0.6 MiB", "0.0 MiB", "2.9%", "0.713", "missed",
             "layer 1: q projection + RoPE"]] * 2
    bench_command._print_table("maskkv bench memory", head, body)
    shown = console.export_text()
    assert "…" not in shown and shown.count("maskkv") >= 2 and max(map(len, shown.splitlines())) <= 100
    assert "317.1" in shown and "0.713" in shown
