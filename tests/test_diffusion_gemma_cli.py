"""DiffusionGemma as a model family behind the commands (issue #47, the wiring).

A folder as transformers' ``save_pretrained`` writes it (``tests/dgemma_folder.py``: a tiny random
``DiffusionGemmaForBlockDiffusion``, two sliding and two full layers, window 8, canvas 8, its vision tower included)
with a small BPE tokenizer of Gemma's special tokens and no chat template, and a ``generation_config.json`` as
transformers writes it (16 denoising steps, EOS ids 1 and 4, pad 0). Tokens are compared with transformers'
``generate`` in its deterministic limit (t_min 0, t_max 1e-6: every draw the argmax), which is what
``--temperature 0`` runs, under the same seed."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.diffusion_gemma",
                    reason="the installed transformers has no DiffusionGemma (needs transformers>=5.25)")

from dgemma_folder import CANVAS as C  # noqa: E402
from dgemma_folder import STEPS, build_folder, generation_config  # noqa: E402
from dgemma_folder import WINDOW as W  # noqa: E402
from transformers import DiffusionGemmaForBlockDiffusion  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from maskkv_cli.app import pipeline  # noqa: E402
from maskkv_cli.app.run_settings import RunSettings  # noqa: E402
from maskkv_cli.app.session import Session  # noqa: E402
from maskkv_cli.cli import app  # noqa: E402
from maskkv_cli.engine.plan import CacheConfig  # noqa: E402
from maskkv_cli.errors import UsageError  # noqa: E402
from maskkv_cli.models.catalog import inspect, remember_folder  # noqa: E402
from maskkv_cli.models.checkpoint import ModelFolder  # noqa: E402
from maskkv_cli.models.diffusion_gemma import DiffusionGemma, parameter_count  # noqa: E402
from maskkv_cli.models.loading import load_diffusion_gemma, load_model  # noqa: E402
from maskkv_cli.prompting import decode_answer, stop_ids  # noqa: E402
from maskkv_cli.sampling.diffusion_gemma import DiffusionGemmaOptions, sampling_settings  # noqa: E402

DOC = ("The special magic number for apple is 4821. The sky over the harbour was grey all morning. "
       "Cats sleep most of the day and hunt at night. The train left the station at noon.")
QUESTION = "What is the special magic number for apple?"
GEN = 24  # three canvases
runner = CliRunner()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_folder(tmp_path_factory.mktemp("dgemma") / "tiny-dgemma")


@pytest.fixture(scope="module")
def ref(folder):
    return DiffusionGemmaForBlockDiffusion.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def session(folder):
    return Session(folder)


@pytest.fixture
def doc(tmp_path) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text(DOC)
    return path


def _theirs(ref, ids: list[int], seed: int, **kwargs) -> list[int]:
    """transformers' ``generate`` of the prompt ``ids`` in its deterministic limit after ``torch.manual_seed``: the
    new tokens."""
    torch.manual_seed(seed)
    out = ref.generate(torch.tensor([ids]), max_new_tokens=GEN, t_min=0.0, t_max=1e-6, **kwargs).sequences
    return out[0, len(ids):].tolist()


def _gen(seed: int = 0, **kwargs):
    return RunSettings(gen_length=GEN, seed=seed, **kwargs).generation({})


def _ask_json(folder: Path, doc: Path, *args: str) -> dict:
    result = runner.invoke(app, ["ask", str(doc), *args, "--model", str(folder), "--gen-length", str(GEN), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ----- the family ----------------------------------------------------------------------------------------------------

def test_the_saved_folder_is_a_family_that_loads(folder):
    checkpoint = ModelFolder.of(folder)
    cfg = checkpoint.config
    assert cfg.family == "diffusion_gemma" and cfg.family_config is not None
    assert cfg.evicted_layers == cfg.family_config.full_layers == (1, 3)
    assert (cfg.max_sequence_length, cfg.n_kv_heads, cfg.head_dim) == (4096, 2, 16)  # the sliding layers' geometry
    assert cfg.stop_token_ids == (1, 4) and cfg.mask_token_id == cfg.pad_token_id == 0  # generation_config.json EOS ids
    model = load_model(folder)
    assert isinstance(model, DiffusionGemma) and model.config == cfg
    direct = load_diffusion_gemma(folder)
    for (name, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    listed = inspect(folder, str(folder), "folder")
    assert listed.loadable and listed.family == "diffusion_gemma"
    assert listed.params == parameter_count(cfg) + 2 * cfg.n_layers  # text weights and both sides' layer scalars
    assert listed.note is not None and listed.note.startswith("the vision tower (")
    remember_folder(folder)
    shown = json.loads(runner.invoke(app, ["models", "--json"]).stdout)["models"]
    mine = next(m for m in shown if m["path"] == str(folder.resolve()))
    assert mine["family"] == "diffusion_gemma" and mine["loadable"] and "vision tower" in mine["note"]
    with pytest.raises(UsageError, match="--device-map"):
        Session(folder, device_map="cpu")


def test_prompt_stop_ids_and_sampler_defaults(session):
    """No chat template in the folder: Gemma's turn format; the generation config's EOS ids stop an answer."""
    ids = session.prompt_ids("Hello there")
    text = session.tokenizer.decode(ids)
    assert text == "<bos><|turn>user\nHello there<turn|>\n<|turn>model\n"
    assert ids[0] == 2 and ids[1] == 3  # <bos>, <|turn> as single special ids
    assert {1, 4} <= stop_ids(session.tokenizer, session.model.config)
    opts = session.diffusion_gemma
    assert (opts.max_denoising_steps, opts.t_min, opts.t_max, opts.entropy_bound) == (STEPS, 0.4, 0.8, 0.1)
    assert (opts.stability_threshold, opts.confidence_threshold) == (1, 0.005)
    assert session.model.config.stop_token_ids == (1, 4) and session.model.config.pad_token_id == 0


def test_temperature_and_refused_options():
    opts = DiffusionGemmaOptions()
    greedy = sampling_settings(_gen(), opts, (1,), 0)
    assert (greedy.t_min, greedy.t_max, greedy.max_new_tokens, greedy.eos_token_ids) == (0.0, 1e-6, GEN, (1,))
    assert (sampling_settings(_gen(temperature=0.8), opts, (1,), 0).t_min,
            sampling_settings(_gen(temperature=0.4), opts, (1,), 0).t_min) == (pytest.approx(0.4), pytest.approx(0.2))
    RunSettings(gen_length=GEN, temperature=0.8, seed=3, policy="snapkv", budget=8).check_family("diffusion_gemma")
    with pytest.raises(UsageError, match=r"^--steps, --block-length, --cfg, --top-k are not options of the "):
        RunSettings(steps=4, block_length=8, cfg_scale=1.0, top_k=3).check_family("diffusion_gemma")
    RunSettings(steps=4, block_length=8, top_k=3).check_family("llada2")  # its own options
    with pytest.raises(UsageError, match=r"^--threshold is not an option"):
        sampling_settings(_gen(threshold=0.5), opts, (1,), 0)  # the Python API meets the same refusal


def test_other_samplers_options_are_refused_in_one_line(folder, doc, tmp_path):
    result = runner.invoke(app, ["ask", str(doc), QUESTION, "--model", str(folder), "--steps", "4"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.stderr.startswith("error: --steps is not an option of the diffusion_gemma sampler")
    assert result.stderr.count("\n") == 1
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"document": str(doc), "question": QUESTION}) + "\n")
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(tmp_path / "out"), "--model", str(folder),
                                 "--block-length", "8"])
    assert result.exit_code != 0 and "--block-length is not an option" in result.stderr


# ----- the same tokens as transformers -------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_answers_equal_transformers_generate(session, ref, folder, doc, seed):
    """With the prompt cache whole (``full``, a budget at least the prompt) and without one (``none``: the prompt
    encoded again at every step), the tokens of transformers' ``generate`` (which encodes the prompt in one pass; we
    encode the document's part first, then the rest)."""
    prompt = pipeline.prepare(session, DOC, QUESTION, GEN)
    assert 0 < prompt.document_len < len(prompt.ids)
    theirs = _theirs(ref, prompt.ids, seed)
    assert len(theirs) == GEN
    for policy, budget in (("none", None), ("full", None), ("maskkv", len(prompt.ids)), ("snapkv", 10_000)):
        answer = session.answer_ids(prompt.ids, _gen(seed), CacheConfig(policy=policy, budget=budget),
                                    document_len=prompt.document_len)
        assert answer.result.tokens[0].tolist() == theirs, policy
        assert answer.result.layer_budgets is None and answer.result.stats.gen_length == GEN
    expected = decode_answer(session.tokenizer, theirs, stop_ids(session.tokenizer, session.model.config), 0)
    for policy in ("none", "full"):
        data = _ask_json(folder, doc, QUESTION, "--temperature", "0", "--seed", str(seed), "--policy", policy)
        assert data["answers"][0]["answer"] == expected


def test_an_eos_ends_the_answer_as_in_transformers(folder, ref, tmp_path, doc):
    """The generation config's EOS ids: a canvas with one ends the generation, the tokens after it are pad."""
    session = Session(folder)
    prompt = pipeline.prepare(session, DOC, QUESTION, GEN)
    plain = _theirs(ref, prompt.ids, 0)
    eos = plain[3]
    first = plain.index(eos)
    copy = tmp_path / "eos"
    shutil.copytree(folder, copy)
    generation_config(copy, [eos])
    theirs = _theirs(DiffusionGemmaForBlockDiffusion.from_pretrained(copy).eval(), prompt.ids, 0)
    assert theirs == plain[: first + 1] + [0] * (C - first - 1)  # one canvas: it held the EOS, pad after it
    answer = Session(copy).answer_ids(prompt.ids, _gen(), CacheConfig(policy="full"), document_len=prompt.document_len)
    assert answer.result.tokens[0].tolist() == theirs
    assert answer.confidence is not None and answer.confidence.tokens == first
    data = _ask_json(copy, doc, QUESTION)
    assert data["answers"][0]["stats"]["gen_length"] == C


# ----- MaskKV on the full-attention layers ---------------------------------------------------------------------------

def test_maskkv_at_a_small_budget_evicts_the_full_layers_only(session, folder, doc):
    prompt = pipeline.prepare(session, DOC, QUESTION, GEN)
    m = len(prompt.ids)
    answer = session.answer_ids(prompt.ids, _gen(), CacheConfig(policy="maskkv", budget=4),
                                document_len=prompt.document_len)
    result = answer.result
    assert [r.layer for r in result.records] == [1, 3] and result.layer_budgets == [4, 4]
    assert all(r.head_budgets.tolist() == [[4]] for r in result.records)  # one KV head per full layer
    stats = result.stats
    # sliding layers keep their W - 1 latest entries (2 KV heads each), full layers 4 of m (1 KV head each)
    assert stats.kv_entries == 2 * 2 * (W - 1) + 2 * 4
    assert stats.kv_full_bytes == 4 * 2 * (2 * (W - 1) * 2 * 16 + 2 * m * 1 * 32)  # fp32 K and V, as kept whole
    assert stats.kv_bytes < stats.kv_full_bytes
    assert answer.budget == 4
    assert len(answer.notes) == 1
    assert answer.notes[0].startswith("no calibration profile for this model: uniform layer budgets")
    out = runner.invoke(app, ["profile", str(doc), QUESTION, "--model", str(folder), "--policies", "maskkv,full",
                              "--budgets", "4", "--gen-length", str(GEN), "--no-warmup", "--json"])
    assert out.exit_code == 0, out.output
    runs = {r["policy"]: r for r in json.loads(out.stdout)["runs"]}
    assert runs["maskkv"]["evicted"] and runs["maskkv"]["layer_budgets"] == [4, 4]
    assert runs["maskkv"]["head_budgets"] == [[4], [4]]  # the two full layers
    assert runs["maskkv"]["layers"] == [1, 3] and runs["full"]["layers"] == [1, 3]  # named by their indices
    assert not runs["full"]["evicted"] and runs["full"]["head_budgets"] == [[m], [m]]


def test_calibrate_measures_the_full_layers_and_maskkv_splits_its_budget_by_them(session, folder, doc):
    """``maskkv calibrate`` stores one I(l) per full layer (measured at the first step of a random canvas), the same
    for the same inputs; MaskKV's run then names the profile and splits its budget over the full layers by it."""
    args = ["calibrate", "--model", str(folder), "--samples", "2", "--max-tokens", "48", str(doc), "--json"]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    profile = json.loads(out.stdout)
    assert profile["n_layers"] == 2 and len(profile["importance"]) == 2  # layers 1 and 3
    assert all(0.0 < v <= 2.0 for v in profile["importance"]) and profile["inputs"] == 2
    assert profile["tokens"] == 2 * C
    again = runner.invoke(app, args)
    assert json.loads(again.stdout)["importance"] == profile["importance"]
    shown = " ".join(runner.invoke(app, args[:-1]).stdout.split())  # the table says whose tokens these are
    assert f"over 2 inputs, {2 * C} canvas tokens (each input's prompt encoded, then one random canvas)" in shown
    prompt = pipeline.prepare(session, DOC, QUESTION, GEN)
    answer = session.answer_ids(prompt.ids, _gen(), CacheConfig(policy="maskkv", budget=4),
                                document_len=prompt.document_len)
    assert answer.notes[0].startswith("using calibration profile")
    budgets = answer.result.layer_budgets
    assert budgets is not None and len(budgets) == 2 and sum(budgets) == 2 * 4
    uniform = session.answer_ids(prompt.ids, _gen(), CacheConfig(policy="mask-vote-uniform", budget=4),
                                 document_len=prompt.document_len)
    assert uniform.result.layer_budgets == [4, 4]


def test_profile_draws_the_full_layers_by_their_indices(folder, doc, tmp_path):
    """The heatmap and the layer chart name DiffusionGemma's full layers (L1, L3 here, not L0, L1), the GQA note
    counts their KV heads (1, of 4 query heads; the sliding layers have 2), and points at maskkv calibrate for a
    profile; the HTML report too."""
    html = tmp_path / "run.html"
    out = runner.invoke(app, ["profile", str(doc), QUESTION, "--model", str(folder), "--policies", "maskkv",
                              "--budgets", "4", "--gen-length", str(GEN), "--no-warmup", "--html", str(html)])
    assert out.exit_code == 0, out.output
    text = out.stdout + out.stderr
    rows = [line.split()[0] for line in out.stdout.splitlines() if line.strip().startswith("L")]
    assert "L1" in rows and "L3" in rows and "L0" not in rows and "L2" not in rows
    assert "(1 KV heads, 4 query heads each" in text and "layers 1, 3" in text
    assert "run `maskkv calibrate`" in text and "maskkv calibrate does not measure" not in text
    page = html.read_text()
    assert "<th>L1</th>" in page and "<th>L3</th>" in page and "<th>L0</th>" not in page


def test_policies_its_cache_cannot_run_are_refused_before_the_model_loads(folder, doc, monkeypatch):
    """maskkv-plus and maskkv-residual (residual entries) and the all-query votes are refused in one line where the
    command meets the model's config, before any weight is read (ask, profile's --policies)."""
    import maskkv_cli.cli.model_choice as model_choice

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_choice, "load_session", no_load)
    for args in (["ask", str(doc), QUESTION, "--policy", "maskkv-plus"],
                 ["ask", str(doc), QUESTION, "--policy", "maskkv-residual"],
                 ["profile", str(doc), QUESTION, "--policies", "maskkv,prompt-vote"]):
        result = runner.invoke(app, [*args, "--model", str(folder)])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert result.stderr.startswith("error: policy ") and "is not available for diffusion_gemma models" in \
            result.stderr and result.stderr.count("\n") == 1

def test_a_batch_jobs_own_policy_its_cache_cannot_run_is_refused_before_any_job(folder, doc, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"document": str(doc), "question": QUESTION}) + "\n"
                    + json.dumps({"document": str(doc), "question": QUESTION, "policy": "maskkv-plus"}) + "\n")
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(tmp_path / "out"), "--model", str(folder)])
    assert result.exit_code == 2 and result.stderr.startswith("error: policy maskkv-plus is not available for "
                                                              "diffusion_gemma models"), result.output
    assert not (tmp_path / "out" / "answers.jsonl").exists()


def test_the_window_check_counts_whole_canvases(session):
    """Room for text beside a response of n tokens: DiffusionGemma's response takes whole canvases of 8."""
    room = {n: pipeline.room_for_text(session, QUESTION, n) for n in (1, 8, 9, 16)}
    assert room[1] == room[8] and room[9] == room[16] == room[8] - C
    assert session.response_positions(9) == 16 and session.response_positions(16) == 16


# ----- one document, many questions ----------------------------------------------------------------------------------

def test_a_document_is_encoded_once_for_its_questions(folder, doc):
    """Two questions about one document: its prefix goes through the encoder once and is reused, and every answer
    has the tokens it gets without reuse (a session that keeps no document) and without a cache."""
    questions = [QUESTION, "Who sleeps most of the day?"]
    reusing = Session(folder)
    cache = CacheConfig(policy="maskkv", budget=6)
    gen = _gen(3)
    answers = [pipeline.ask(reusing, DOC, q, gen, cache) for q in questions]
    assert reusing.diffusion_gemma.documents is not None and reusing.diffusion_gemma.documents.computed == 1
    alone = Session(folder)
    alone.diffusion_gemma = replace(alone.diffusion_gemma, documents=None)
    for q, answer in zip(questions, answers, strict=True):
        fresh = pipeline.ask(alone, DOC, q, gen, cache)
        assert torch.equal(fresh.result.tokens, answer.result.tokens), q
        plain = pipeline.ask(alone, DOC, q, gen, CacheConfig(policy="full"))
        uncached = pipeline.ask(alone, DOC, q, gen, CacheConfig(policy="none"))
        assert torch.equal(plain.result.tokens, uncached.result.tokens), q
    together = pipeline.ask_many(Session(folder), [(DOC, q) for q in questions], gen, cache, batch_size=2)
    assert [a.result.tokens.tolist() for a in together] == [a.result.tokens.tolist() for a in answers]
    data = _ask_json(folder, doc, "-q", questions[0], "-q", questions[1], "--budget", "6", "--seed", "3")
    assert [a["answer"] for a in data["answers"]] == [a.text for a in answers]
    # auto runs them one at a time: a batch runs each prompt's passes alone, in turn, and would lose the reuse
    size, line = pipeline.batch_size_for(Session(folder), [(DOC, q) for q in questions], gen, cache, "truncate", None)
    assert size == 1 and line is not None and "runs each prompt's passes alone" in line


def test_summarize_runs(folder, doc):
    result = runner.invoke(app, ["summarize", str(doc), "--model", str(folder), "--length", "10", "--json"])
    assert result.exit_code == 0, result.output
    assert "summary" in json.loads(result.stdout)


def test_batch_and_the_servers_generation_service_run_it(folder, doc, tmp_path):
    """``maskkv batch`` answers as ``ask`` does; the server's ``GenerationService`` (other threads' generations run in
    its thread) gives every request the tokens it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    from maskkv_cli.sampling.service import GenerationService

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"document": str(doc), "question": QUESTION}) + "\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(out), "--model", str(folder), "-n", str(GEN),
                                 "--budget", "6", "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads((out / "answers.jsonl").read_text().splitlines()[0])
    asked = _ask_json(folder, doc, QUESTION, "--budget", "6")
    assert row["answer"] == asked["answers"][0]["answer"]
    session = Session(folder)
    prompts = [pipeline.prepare(session, DOC, q, GEN) for q in (QUESTION, "Who sleeps most of the day?")]
    cache = CacheConfig(policy="maskkv", budget=6)

    def tokens(p: pipeline.Prompt) -> list[int]:
        return session.answer_ids(p.ids, _gen(5), cache, document_len=p.document_len).result.tokens[0].tolist()

    alone = [tokens(p) for p in prompts]
    session.engine = GenerationService(session.model, 2)
    try:
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(tokens, prompts))
    finally:
        session.engine.close()
    assert together == alone


def test_bench_reuse_on_a_diffusion_gemma_shape():
    """``maskkv bench reuse --config diffusiongemma-tiny`` at a tiny size (its times are not checked here): every
    answer is token for token the one of the question asked on its own; the stored prefix is the document's."""
    from maskkv_cli.bench.reuse import ReuseCase, run_reuse

    row = run_reuse(ReuseCase(config="diffusiongemma-tiny", doc_tokens=40, questions=2, question_tokens=6,
                              gen_length=8, budget=8, repeats=1))
    assert row["answers_equal"] == 2 and row["prefix_bytes"] > 0
    assert 0 < row["reused_prefill_s"] and 0 < row["separate_prefill_s"] < row["separate_s"]
    assert row["budget"] == 8
    # a policy with no budget was titled none@256 with "budget": 256; a count below 1 named no option
    shown = runner.invoke(app, ["bench", "reuse", "--config", "diffusiongemma-tiny", "--doc-tokens", "40",
                                "--questions-per-doc", "2", "-n", "8", "--repeats", "1", "--policy", "none",
                                "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout)["budget"] is None, shown.output
    bad = runner.invoke(app, ["bench", "reuse", "--config", "diffusiongemma-tiny", "--questions-per-doc", "0"])
    assert bad.exit_code == 2 and "these must be positive: --questions-per-doc 0" in bad.stderr


def test_bench_memory_refuses_it_in_one_line(folder, tmp_path):
    """``bench memory`` measures the engine's prefill, which DiffusionGemma does not run: refused before loading,
    naming the commands that do give its memory."""
    out = runner.invoke(app, ["bench", "memory", "--model", str(folder), "--prompt-length", "64",
                              "--out", str(tmp_path / "mem")])
    assert out.exit_code != 0
    assert out.stderr.startswith("error: bench memory measures the engine's prefill") and "maskkv plan" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.output


def test_the_memory_model_reads_a_loaded_diffusion_gemma(session):
    """The loaded model's ``ModelConfig`` carries its own config: the memory model and the weight estimate read the
    same geometry from it as from the family's config."""
    from maskkv_cli.engine.batch_memory import config_geometry, diffusion_gemma_geometry, model_geometry
    from maskkv_cli.models.weights_estimate import weights_estimate

    own = session.model.gemma
    assert model_geometry(session.model) == config_geometry(session.model.config) == diffusion_gemma_geometry(own)
    assert weights_estimate(session.model.config, None, 4) == weights_estimate(own, None, 4)


def test_greedy_in_fp16_keeps_the_self_conditioning_signal_finite(folder, doc):
    """At the default temperature the tempered logits are about 1e7; cast to fp16 for the next step's
    self-conditioning they were inf, the softmax NaN, and generate and ask failed with "probability tensor contains
    either inf, nan or element < 0". The signal is clamped to fp16's range (bf16 and fp32 unchanged)."""
    for args in (["generate", "Hi"], ["ask", str(doc), "What?"]):
        result = runner.invoke(app, [*args, "--model", str(folder), "-n", "8", "--dtype", "fp16", "--json"])
        assert result.exit_code == 0, result.output


def test_online_layer_budgets_are_refused_before_the_model_runs(folder, doc, tmp_path):
    """--layer-budgets online and --long rope-scale were refused only inside the sampler: ask loaded the model
    first, batch wrote a failed row for every job, serve started and answered every request with a 400. Now one
    line where the command meets the model, as its other refused settings."""
    (tmp_path / "qs.txt").write_text("What?\nWhere?\n")
    for args in (["ask", str(doc), "What?"], ["batch", "--docs", str(doc), "--questions", str(tmp_path / "qs.txt"),
                                              "--out", str(tmp_path / "out")]):
        result = runner.invoke(app, [*args, "--model", str(folder), "--layer-budgets", "online"])
        assert result.exit_code == 2, result.output
        assert "--layer-budgets online is not available for diffusion_gemma models" in result.stderr
    assert not (tmp_path / "out" / "answers.jsonl").exists()
    for args in (["ask", str(doc), "What?"], ["batch", "--docs", str(doc), "--questions", str(tmp_path / "qs.txt"),
                                              "--out", str(tmp_path / "out")]):
        result = runner.invoke(app, [*args, "--model", str(folder), "--long", "rope-scale"])
        assert result.exit_code == 2 and "--long rope-scale is not available for diffusion_gemma" in result.stderr
    assert not (tmp_path / "out" / "answers.jsonl").exists()


def test_profile_and_serve_refuse_rope_scale_before_the_model_loads(folder, doc, monkeypatch):
    """profile loaded the weights and ran its warm-up before its sampler refused --long rope-scale (a long
    document); serve loaded them before the same line. Now both refuse where the command meets the model."""
    import maskkv_cli.cli.model_choice as model_choice

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(model_choice, "load_session", loaded)
    for args in (["profile", str(doc), "What?"], ["serve", "--port", "0"]):
        result = runner.invoke(app, [*args, "--model", str(folder), "--long", "rope-scale"])
        assert result.exit_code == 2, result.output
        assert "--long rope-scale is not available for diffusion_gemma" in result.stderr
    # profile takes one prompt: the two refusals sent the user from one to the other ("use --long parts or truncate"
    # for rope-scale, "--long truncate or rope-scale" for parts); both now offer what both allow
    for long in ("rope-scale", "parts"):
        result = runner.invoke(app, ["profile", str(doc), "What?", "--model", str(folder), "--long", long])
        assert result.exit_code == 2 and result.stderr.strip().endswith("--long truncate"), result.output


def test_profile_pictures_name_the_full_layers_they_show(folder, doc, tmp_path, monkeypatch):
    """DiffusionGemma's per-layer rows are its full-attention layers; --plot's heatmap and layer chart labelled them
    0, 1, ... while the table and the HTML named the model's layers."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    shown: list[list[str]] = []
    real = Figure.savefig

    def spy(self, *args, **kwargs):
        shown.extend([t.get_text() for t in ax.get_yticklabels()] for ax in self.axes if ax.get_ylabel() == "layer")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    result = runner.invoke(app, ["profile", str(doc), "What?", "--model", str(folder), "--policies", "maskkv",
                                 "--ratio", "0.3", "-n", "8", "--plot", str(tmp_path / "p.png"), "--json"])
    assert result.exit_code == 0, result.output
    layers = [str(layer) for layer in json.loads(result.stdout)["runs"][0]["layers"]]
    assert layers != [str(i) for i in range(len(layers))]  # the full layers are not 0, 1, ...
    assert shown and all(labels == layers for labels in shown), (shown, layers)


def test_a_setting_of_its_generation_config_the_sampler_cannot_take_names_the_file(folder, doc, tmp_path):
    """max_denoising_steps 0 in generation_config.json said "DiffusionGemma sampling: max_new_tokens and
    max_denoising_steps must be positive", naming no file, at the first answer."""
    import shutil

    copy = tmp_path / "dgemma"
    shutil.copytree(folder, copy)
    config = copy / "generation_config.json"
    data = json.loads(config.read_text()) if config.is_file() else {}
    config.write_text(json.dumps({**data, "max_denoising_steps": 0}))
    result = runner.invoke(app, ["ask", str(doc), QUESTION, "--model", str(copy), "-n", "8"])
    assert result.exit_code == 1 and f"error: {config}: DiffusionGemma sampling: max_new_tokens and " \
        "max_denoising_steps must be positive; fix or remove it" in result.stderr, result.output
