"""Layer importance, calibration profiles, ``resolve_importance``, online layer budgets and ``maskkv calibrate``."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from prompts import EVICTING, random_ids
from typer.testing import CliRunner

import maskkv_cli.sampling.forward as sampler_mod
from maskkv_cli.cli import app
from maskkv_cli.engine.importance import ImportanceResult, layer_importance, measure_importance
from maskkv_cli.engine.plan import resolve_importance
from maskkv_cli.engine.prefill import prefill
from maskkv_cli.engine.selection import StoredView
from maskkv_cli.engine.step import response_logits
from maskkv_cli.errors import UsageError
from maskkv_cli.kv.budgets import boundary_layer_budgets
from maskkv_cli.models.calibration import (
    find_profile,
    load_profile,
    make_profile,
    model_key,
    profile_path,
    save_profile,
)
from maskkv_cli.models.llada import LLaDA
from maskkv_cli.paths import config_file
from maskkv_cli.policies import PolicyOptions, get_policy
from maskkv_cli.sampling.llada import GenerationConfig, generate

GEN = GenerationConfig(gen_length=16, steps=8, block_length=8)
runner = CliRunner()


def ids_of(model, n=40, seed=0, masks=0):
    ids = random_ids(model, n, seed)
    if masks:
        ids = torch.cat([ids, torch.full((1, masks), model.config.mask_token_id)], 1)
    return ids


@pytest.fixture(scope="module")
def deep_model(tiny_config):
    """A 4-layer tiny model: two boundary and two middle layers, so boundary-aware budgets differ by layer."""
    return LLaDA(tiny_config.with_(n_layers=4)).init_weights(seed=2, std=0.2).eval()


# --------------------------------------------------------------------------------------------- importance


def test_importance_in_range_and_deterministic(tiny_model):
    batches = [ids_of(tiny_model, 30, 0, masks=8), ids_of(tiny_model, 50, 1)]
    first = layer_importance(tiny_model, batches)
    assert len(first) == tiny_model.config.n_layers
    assert all(0.0 <= x <= 2.0 for x in first) and any(x > 0 for x in first)
    assert layer_importance(tiny_model, batches) == first


def test_importance_is_a_token_weighted_mean(tiny_model):
    a, b = ids_of(tiny_model, 20, 3), ids_of(tiny_model, 60, 4)
    both = measure_importance(tiny_model, [a, b])
    assert (both.inputs, both.tokens) == (2, 80)
    ia, ib = layer_importance(tiny_model, [a]), layer_importance(tiny_model, [b])
    for x, y, z in zip(both.importance, ia, ib, strict=True):
        assert x == pytest.approx((20 * y + 60 * z) / 80, rel=1e-9)


def test_zeroed_attention_output_gives_zero_importance(tiny_model):
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        model.blocks[1].attn_out.weight.zero_()
    batches = [ids_of(model, 30, masks=8)]
    imp = layer_importance(model, batches)
    assert imp[1] == 0.0
    assert imp[0] > 0.0 and imp[0] == layer_importance(tiny_model, batches)[0]


def test_no_input_is_a_usage_error(tiny_model):
    with pytest.raises(UsageError):
        layer_importance(tiny_model, [])


# ----------------------------------------------------------------------------------------------- profiles


def test_profile_round_trip(tiny_dir):
    profile = make_profile(tiny_dir, ImportanceResult([0.25, 0.5], 3, 120))
    path = save_profile(profile)
    assert path == profile_path(tiny_dir) == config_file().parent / "calibration" / f"{model_key(tiny_dir)}.json"
    assert load_profile(tiny_dir) == profile
    assert profile.n_layers == 2 and profile.importance == (0.25, 0.5) and profile.model == model_key(tiny_dir)
    data = json.loads(path.read_text())
    assert set(data) == {"model", "model_path", "n_layers", "importance", "inputs", "tokens", "created",
                         "maskkv_version", "weights"}
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind


def _config_folder(root: Path, cfg: dict) -> Path:
    folder = root / "LLaDA-8B-Instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_key_depends_on_config_not_only_folder_name(tmp_path):
    a = _config_folder(tmp_path / "a", {"n_layers": 32, "d_model": 4096})
    b = _config_folder(tmp_path / "b", {"n_layers": 16, "d_model": 4096})
    c = _config_folder(tmp_path / "c", {"d_model": 4096, "n_layers": 32})  # same content, other key order
    (c / "config.json").write_text(json.dumps({"d_model": 4096, "n_layers": 32}, indent=4))
    assert model_key(a) != model_key(b)
    assert model_key(a) == model_key(c)
    assert model_key(a).startswith("LLaDA-8B-Instruct-")


def test_bad_profiles_are_ignored_with_a_reason(tiny_dir):
    path = profile_path(tiny_dir)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    profile, reason = find_profile(tiny_dir)
    assert profile is None and "not valid JSON" in reason
    good = make_profile(tiny_dir, ImportanceResult([0.1, 0.2], 1, 10)).to_dict()
    path.write_text(json.dumps({**good, "n_layers": 3, "importance": [0.1, 0.2, 0.3]}))
    profile, reason = find_profile(tiny_dir)
    assert profile is None and "3 layers" in reason
    path.write_text(json.dumps({**good, "importance": [0.1, float("nan")]}))
    assert find_profile(tiny_dir)[0] is None
    options, note = resolve_importance(tiny_dir, PolicyOptions(), "maskkv")
    assert options.importance is None and note.startswith(f"ignoring calibration profile {path}:")
    path.write_text(json.dumps(good))
    assert find_profile(tiny_dir) == (load_profile(tiny_dir), None)


def test_a_profile_of_other_weights_under_the_same_key_is_not_used(tiny_dir, tmp_path):
    """Two training runs' ``checkpoint`` folders of one config share a key: the profile measured on one was used
    by the other. It records the weights' fingerprint; the other model ignores it with a reason, and a profile
    written before the field existed is still used."""
    import shutil

    first, second = tmp_path / "t3" / "checkpoint", tmp_path / "t4" / "checkpoint"
    for folder in (first, second):
        shutil.copytree(tiny_dir, folder)
    weights = second / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_key(first) == model_key(second)
    profile = make_profile(first, ImportanceResult([0.25, 0.5], 3, 120))
    save_profile(profile)
    assert load_profile(first) == profile
    found, reason = find_profile(second)
    assert found is None and "measured on other weights" in reason and str(first.resolve()) in reason
    older = {k: v for k, v in profile.to_dict().items() if k != "weights"}
    profile_path(first).write_text(json.dumps(older))
    assert load_profile(second) is not None  # no fingerprint recorded: used, as before


def test_calibrate_says_when_its_inputs_are_longer_than_the_window(tiny_dir, tmp_path, tiny_config):
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the old mill and under the stone bridge. " * 400)
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), "--samples", "1", "--max-tokens",
                                 str(tiny_config.max_sequence_length + 50), "-n", "8", str(doc)])
    assert result.exit_code == 0, result.output
    assert f"longer than the model's {tiny_config.max_sequence_length}-token window" in result.stderr


def test_the_embedded_models_calibrate_hint_names_no_folder(monkeypatch, tmp_path):
    """The embedded model's hint says `maskkv calibrate` (what that command alone calibrates where no other default
    model is configured), not its folder inside the installed package; with another default configured, the
    folder again, as for any model. Its "no profile" note does not ask for a profile: for this model uniform
    budgets keep the needles better (docs/tiny-model.md, "Calibrated layer budgets")."""
    from maskkv_cli.engine.plan import calibrate_hint
    from maskkv_cli.models.checkpoint import ModelFolder
    from maskkv_cli.paths import shipped_model_folder

    shipped = shipped_model_folder()
    assert shipped is not None
    embedded = ModelFolder.of(shipped)
    assert calibrate_hint(embedded) == "run `maskkv calibrate`"
    _, note = resolve_importance(embedded, PolicyOptions(), "maskkv")
    assert note is not None and note.startswith("no calibration profile for this model: uniform layer budgets, which")
    assert "maskkv calibrate" not in note and "docs/tiny-model.md" in note
    monkeypatch.setenv("MASKKV_MODEL", "org/other")
    assert calibrate_hint(embedded) == f"run `maskkv calibrate --model {embedded.name}`"
    monkeypatch.delenv("MASKKV_MODEL")
    (tmp_path / "config.toml").write_text('model = "org/other"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(tmp_path / "config.toml"))
    assert calibrate_hint(embedded) == f"run `maskkv calibrate --model {embedded.name}`"


def test_resolve_importance_notes(tiny_dir):
    base = PolicyOptions(alpha=0.2)
    options, note = resolve_importance(tiny_dir, base, "maskkv")
    assert options == base and options.importance is None
    assert note == ("no calibration profile for this model: uniform layer budgets "
                    f"(run `maskkv calibrate --model {tiny_dir}` to create one)")
    path = save_profile(make_profile(tiny_dir, ImportanceResult([0.3, 0.7], 1, 10)))
    options, note = resolve_importance(tiny_dir, base, "maskkv")
    assert options.importance == (0.3, 0.7) and options.alpha == 0.2
    assert note == f"using calibration profile {path} for layer budgets"
    for policy in ("snapkv", "mask-vote-uniform", "full"):
        assert resolve_importance(tiny_dir, base, policy) == (base, None)
    assert resolve_importance(tiny_dir, base, "maskkv", "uniform") == (base, None)
    options, note = resolve_importance(tiny_dir, base, "maskkv", "online")
    assert options.importance is None and "online" in note
    for mode in ("sometimes", "off"):  # the values --layer-budgets takes, nothing else
        with pytest.raises(UsageError, match="^--layer-budgets must be auto, online or uniform"):
            resolve_importance(tiny_dir, base, "maskkv", mode)


def test_prompts_answered_together_look_the_profile_up_once(tiny_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Session.answer_many`` makes every prompt's plan with one lookup of the calibration profile
    (``importance_choice``), and each plan is the one ``plan_cache`` makes for that prompt alone: the same
    importance, source and note."""
    import maskkv_cli.engine.plan as plan_mod
    from maskkv_cli.app.session import Session
    from maskkv_cli.engine.plan import CacheConfig, plan_cache

    path = save_profile(make_profile(tiny_dir, ImportanceResult([0.8, 0.2], 1, 10)))
    session = Session(str(tiny_dir))
    cache = CacheConfig(policy="maskkv", budget=6)
    prompts = [random_ids(session.model, n, seed=n)[0].tolist() for n in (12, 17, 9)]
    lookups: list[object] = []
    real = plan_mod.resolve_importance

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        lookups.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_mod, "resolve_importance", counted)
    answers = session.answer_many(prompts, GenerationConfig(gen_length=4, steps=4, block_length=4), cache, 2)
    assert len(lookups) == 1
    for ids, answer in zip(prompts, answers, strict=True):
        alone = plan_cache(session.model, cache, len(ids), session.folder, block_length=4)
        got = answer.result.plan
        assert got is not None
        assert (got.importance, got.importance_source, got.note) == (alone.importance, alone.importance_source,
                                                                     alone.note)
        assert got.importance == (0.8, 0.2) and got.note == f"using calibration profile {path} for layer budgets"


@pytest.mark.parametrize(("importance", "boundary_gets_more"), [
    ((0.5, 0.1, 0.1, 0.1, 0.1, 0.6), True),
    ((0.01, 0.3, 0.25, 0.4, 0.2, 0.02), False),
])
def test_maskkv_profile_budgets(importance, boundary_gets_more):
    policy = get_policy("maskkv", PolicyOptions(importance=importance))
    budgets = policy.layer_budgets(6, 32, 10_000)
    assert sum(budgets) == 6 * 32
    low_boundary, high_middle = min(budgets[0], budgets[5]), max(budgets[1:5])
    if boundary_gets_more:
        assert low_boundary > high_middle
    else:
        assert max(budgets[0], budgets[5]) < min(budgets[1:5]) and high_middle > 32


def test_generate_with_profile_importance(tiny_model, tiny_dir):
    save_profile(make_profile(tiny_dir, ImportanceResult([0.9, 0.1], 1, 10)))
    options, _ = resolve_importance(tiny_dir, PolicyOptions(), "maskkv")
    out = generate(tiny_model, ids_of(tiny_model), GEN, get_policy("maskkv", options), 6)
    assert out.layer_budgets is not None and sum(out.layer_budgets) == 2 * 6


# ------------------------------------------------------------------------------------------------- online


def _online(monkeypatch, budget: int | None = None):
    """Route the sampler's prefill through online mode (with a fixed uniform plan of ``budget`` if given)."""
    real = sampler_mod.selection_sink

    def patched(policy, layer_budgets, prompt_len, response_slots, n_layers, online):
        if budget is not None:
            layer_budgets = [budget] * n_layers
        return real(policy, layer_budgets, prompt_len, response_slots, n_layers, True)

    monkeypatch.setattr(sampler_mod, "selection_sink", patched)


def test_online_importance_matches_calibration(deep_model):
    x = ids_of(deep_model, 40, masks=16)
    rows = torch.arange(40, 56)
    _, _, records = prefill(deep_model, x, 40, get_policy("maskkv"), [8] * 4, rows, online_importance=True)
    expected = layer_importance(deep_model, [x])
    assert [r.importance for r in records] == expected


@pytest.mark.parametrize("budget", [40, 41, 500])
def test_online_budget_at_least_prompt_reproduces_full(deep_model, monkeypatch, budget):
    ids = ids_of(deep_model)
    full = generate(deep_model, ids, GEN, get_policy("full")).tokens
    _online(monkeypatch, budget)
    out = generate(deep_model, ids, GEN, get_policy("maskkv"), budget)
    assert torch.equal(out.tokens, full)
    assert all(r.positions is None and int(r.head_budgets.min()) == 40 for r in out.records)


def test_online_keeps_exactly_the_budgets_it_reports(deep_model, monkeypatch):
    ids = ids_of(deep_model, 48)
    budget = 6
    _online(monkeypatch)
    out = generate(deep_model, ids, GEN, get_policy("maskkv"), budget)
    cfg = deep_model.config
    importance = [r.importance for r in out.records]
    reported = [r.layer_budget for r in out.records]
    assert reported == boundary_layer_budgets(importance, budget, 0.4)
    assert sum(reported) == cfg.n_layers * budget and len(set(reported)) > 1
    for rec in out.records:
        heads = rec.head_budgets[0]
        assert int(heads.sum()) == cfg.n_heads * rec.layer_budget
        for h in range(cfg.n_heads):
            kept = rec.positions[0, h, : int(heads[h])]
            assert len(set(kept.tolist())) == int(heads[h])
    assert out.stats.kv_entries == cfg.n_heads * cfg.n_layers * budget


def test_online_equals_offline_with_the_same_importance(deep_model):
    """Online mode = offline mode fed the importance this input measures: same logits, cache and later steps."""
    m, n = 40, 16
    x = ids_of(deep_model, m, masks=n)
    rows = torch.arange(m, m + n)
    policy = get_policy("maskkv")
    logits_on, cache_on, rec_on = prefill(deep_model, x, m, policy, [5] * 4, rows, online_importance=True)
    budgets = [r.layer_budget for r in rec_on]  # uniform plan in, boundary-aware plan out
    assert budgets != [5] * 4 and sum(budgets) == 4 * 5
    logits_off, cache_off, rec_off = prefill(deep_model, x, m, policy, budgets, rows)
    assert torch.equal(logits_on, logits_off)
    for a, b in zip(rec_on, rec_off, strict=True):
        assert torch.equal(a.head_budgets, b.head_budgets) and torch.equal(a.positions, b.positions)
    step_rows = torch.arange(n)
    assert torch.equal(response_logits(deep_model, cache_on, x[:, m:], step_rows),
                       response_logits(deep_model, cache_off, x[:, m:], step_rows))


@pytest.mark.parametrize("policy", EVICTING)
def test_online_mode_works_for_every_policy(deep_model, policy):
    m = 40
    x = ids_of(deep_model, m, masks=16)
    _, cache, records = prefill(deep_model, x, m, get_policy(policy, PolicyOptions(window=4)), [8] * 4,
                                torch.arange(m, m + 16), online_importance=True)
    assert sum(r.layer_budget for r in records) == 4 * 8
    for rec in records:
        assert int(rec.head_budgets.sum()) == deep_model.config.n_heads * rec.layer_budget
    assert cache.logical_entries() == deep_model.config.n_heads * 4 * 8


def test_stored_view_refuses_new_query_attention(deep_model):
    k = torch.randn(1, 2, 12, 8)
    view = StoredView(0, 1, torch.empty(1, 2, 12, 8, device="meta"), k, 8, 0.5)
    assert view.response_len == 4
    with pytest.raises(RuntimeError):
        view.query_mass(0, 8)
    with pytest.raises(RuntimeError):
        view.mask_mass()


# ---------------------------------------------------------------------------------------------------- CLI


def _profile_file(tiny_dir) -> Path:
    return Path(os.environ["MASKKV_CONFIG"]).parent / "calibration" / f"{model_key(tiny_dir)}.json"


def test_calibrate_command_writes_the_profile(tiny_dir, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the old mill and under the stone bridge. " * 20)
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), "--samples", "3", "--max-tokens", "24",
                                 "-n", "8", str(doc)])
    assert result.exit_code == 0, result.output
    target = _profile_file(tiny_dir)
    assert target.is_file() and f"saved calibration profile to {target}" in result.stdout
    assert "I(l)" in result.stdout
    profile = load_profile(tiny_dir)
    assert profile is not None and profile.inputs == 3 and profile.n_layers == 2


def test_calibrate_json_on_builtin_corpus(tiny_dir):
    pytest.importorskip("maskkv_cli.tasks.synthetic")
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), "--samples", "2", "--max-tokens", "32",
                                 "-n", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["path"] == str(_profile_file(tiny_dir)) and data["inputs"] == 2
    assert data["tokens"] > 2 * 32 and len(data["importance"]) == 2


def test_calibrate_missing_document_is_one_line(tiny_dir, tmp_path):
    missing = tmp_path / "nope.txt"
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), str(missing)])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: File not found: {missing}. Check the path and try again."
    assert not _profile_file(tiny_dir).exists()
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"abc\x00\x01\x02def")  # read as every command reads a document, with its message
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), str(binary)])
    assert result.exit_code == 1 and result.stderr.startswith("error: data.txt looks binary")
    assert not _profile_file(tiny_dir).exists()


def test_skewed_profile_on_a_short_prompt_keeps_d_h_b_entries(deep_model):
    """Layer budgets above what a layer holds (H x M) move to the other layers, offline and online."""
    m, budget = 40, 30
    x = ids_of(deep_model, m, masks=16)
    cfg = deep_model.config
    policy = get_policy("maskkv", PolicyOptions(importance=(5.0, 0.1, 0.1, 5.0)))
    plan = policy.layer_budgets(cfg.n_layers, budget, m)
    assert max(plan) == m and sum(plan) == cfg.n_layers * budget
    _, cache, records = prefill(deep_model, x, m, policy, plan, torch.arange(m, m + 16))
    assert cache.logical_entries() == cfg.n_layers * cfg.n_heads * budget
    assert [int(r.head_budgets.sum()) for r in records] == [cfg.n_heads * b for b in plan]
    _, cache, _ = prefill(deep_model, x, m, get_policy("maskkv"), [budget] * cfg.n_layers, torch.arange(m, m + 16),
                          online_importance=True)
    assert cache.logical_entries() == cfg.n_layers * cfg.n_heads * budget


def test_ask_says_which_profile_it_uses_or_why_it_ignores_one(tiny_dir, tmp_path):
    """End to end through ``ask``: a profile made for another layer count is ignored with its reason (uniform layer
    budgets), a good one is used, each said in one note; the answer runs either way."""
    doc = tmp_path / "doc.txt"
    doc.write_text("The river runs past the old mill. The special magic number for apple is 48213. " * 12)
    args = ["ask", str(doc), "What is the special magic number for apple?", "--model", str(tiny_dir), "--budget",
            "8", "-n", "8", "--steps", "8"]
    good = make_profile(tiny_dir, ImportanceResult([0.2, 0.8], 1, 10)).to_dict()
    path = profile_path(tiny_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**good, "n_layers": 3, "importance": [0.1, 0.2, 0.3]}))
    stale = runner.invoke(app, args)
    assert stale.exit_code == 0, stale.output
    assert f"note: ignoring calibration profile {path}:" in stale.stderr and "3 layers" in stale.stderr
    path.write_text(json.dumps(good))
    used = runner.invoke(app, args)
    assert used.exit_code == 0, used.output
    assert f"using calibration profile {path} for layer budgets" in used.stderr and "ignoring" not in used.stderr


def test_calibrate_and_demo_check_their_folder_before_the_work(tmp_path, tiny_dir, monkeypatch):
    """A calibration folder that cannot be made (its config "folder" is a file) failed after the whole measurement
    with "error: NotADirectoryError: ..."; demo likewise after its runs. Now one line before anything runs."""
    import maskkv_cli.engine.importance as importance

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("MASKKV_CONFIG", str(blocker / "config.toml"))
    monkeypatch.setattr(importance, "measure_importance", lambda *a, **k: pytest.fail("measured"))
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), "--samples", "1", "--max-tokens", "32"])
    assert result.exit_code == 1 and "cannot write the calibration profile in" in result.stderr
    assert "set MASKKV_CONFIG" in result.stderr and "NotADirectoryError" not in result.stderr
    monkeypatch.setenv("MASKKV_HOME", str(blocker))
    import maskkv_cli.cli.commands.demo as demo

    monkeypatch.setattr(demo, "load_session", lambda *a, **k: pytest.fail("loaded"))
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 1 and "cannot write the demo's document in" in result.stderr


def test_calibrate_refuses_a_bad_dtype_first(tiny_dir):
    """--dtype float64 stopped calibrate with exit 1, without the option's name, after its inputs were tokenized."""
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_dir), "--dtype", "float64"])
    assert result.exit_code == 2 and "--dtype: unknown dtype 'float64'" in result.stderr
