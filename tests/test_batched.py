"""Many sequences in one forward: a sequence's tokens never depend on what else is in the batch or on its size."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from golden_cases import BUDGETS, GOLDEN_DIR, build_models, dream_modes, llada_modes, prompt_ids
from prompts import TEXTS

import maskkv_cli.sampling.commits as commits
import maskkv_cli.sampling.driver as driver
from maskkv_cli.engine.batch_memory import (
    auto_batch_size,
    batch_memory,
    config_geometry,
    model_geometry,
    parse_batch_size,
)
from maskkv_cli.engine.lanes import RopeMemo, StepLane, prefill_memo
from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.step import step_logits
from maskkv_cli.errors import UsageError
from maskkv_cli.policies.base import get_policy, policy_names
from maskkv_cli.prompting import chat_prompt_ids, document_question
from maskkv_cli.sampling import DreamOptions, GenerationConfig, SamplerOptions
from maskkv_cli.sampling.stream import BatchJob, sample_many

shared_prefills: list[int] = []  # lanes per shared prefill, filled by the ``lanes_per_step`` fixture
joined_commits: list[int] = []  # generations per joined commit (``sampling/commits.py``), filled by it too
OTHERS = [(0, 1, "Where?"), (1, 2, "What is the special magic number for pear?"), (2, 3, "Who?"), (0, 2, "x"),
          (3, 1, "How many?"), (1, 3, "Why is it so?"), (2, 2, "When")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return build_models(tmp_path_factory.mktemp("batched"))


@pytest.fixture
def lanes_per_step(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many sequences each shared forward ran (so a test knows that batching happened)."""
    seen: list[int] = []
    steps, prefills = driver.step_logits, driver.prefill_lanes

    def count_steps(model, lanes):  # type: ignore[no-untyped-def]
        seen.append(len(lanes))
        return steps(model, lanes)

    def count_prefill(model, lanes):  # type: ignore[no-untyped-def]
        shared_prefills.append(len(lanes))
        return prefills(model, lanes)

    def count_commits(runs, rows, *rest):  # type: ignore[no-untyped-def]
        joined_commits.append(len(runs))
        return commit_rows(runs, rows, *rest)

    commit_rows = commits.commit_rows
    joined_commits.clear()
    monkeypatch.setattr(driver, "prefill_lanes", count_prefill)
    monkeypatch.setattr(driver, "step_logits", count_steps)
    monkeypatch.setattr(commits, "commit_rows", count_commits)
    yield seen


def _settings(family: str, gen):  # type: ignore[no-untyped-def]
    """The shared settings and sampler options of a golden mode (Dream's modes are its own config)."""
    if family == "llada":
        return gen, SamplerOptions()
    shared = GenerationConfig(gen_length=gen.gen_length, steps=gen.steps, block_length=gen.gen_length,
                              temperature=gen.temperature, seed=gen.seed)
    return shared, SamplerOptions(dream=DreamOptions(alg=gen.alg, top_p=gen.top_p, top_k=gen.top_k))


def _job(model, ids: torch.Tensor, gen: GenerationConfig, policy: str, budget: int) -> BatchJob:  # type: ignore[no-untyped-def]
    plan = CachePlan.build(model, get_policy(policy), budget, ids.shape[-1], block_length=gen.block_length)
    return BatchJob(ids, gen, plan)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_golden_cases_alone_in_a_batch_of_eight_and_repeated(models: dict, family: str,
                                                             lanes_per_step: list[int],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Every golden token case (every policy, both budgets, every decoding mode) gives its recorded tokens in a
    batch of 8 with prompts of other lengths, policies and budgets, and in a batch of itself repeated. Prefills are
    joined without a row cap here, so that eight of them share one pass."""
    monkeypatch.setattr(driver, "join_rows", lambda model: 1 << 20)
    golden = json.loads((GOLDEN_DIR / "tokens.json").read_text(encoding="utf-8"))
    tok, model = models["tokenizer"], models[family]
    ids = prompt_ids(tok)
    others = [torch.tensor([chat_prompt_ids(tok, document_question("".join(TEXTS[i:i + k]), q))])
              for i, k, q in OTHERS]
    assert len({o.shape[1] for o in others} | {ids.shape[1]}) == len(others) + 1  # all lengths differ
    modes = llada_modes() if family == "llada" else dream_modes()
    checked = 0
    for mode, raw in modes.items():
        gen, options = _settings(family, raw)
        jobs, keys = [], []
        for n, (policy, budget) in enumerate((p, b) for p in policy_names() for b in BUDGETS):
            jobs.append(_job(model, ids, gen, policy, budget))
            keys.append(f"{family}/{policy}/{budget}/{mode}")
            other = others[n % len(others)]
            jobs.append(_job(model, other, gen, policy, budget))
            keys.append("")
        for key, result in zip(keys, sample_many(model, jobs, 8, options), strict=True):
            if key:
                assert result.tokens[0].tolist() == golden[key], key
                checked += 1
        for result in sample_many(model, [jobs[2]] * 8, 8, options):
            assert result.tokens[0].tolist() == golden[keys[2]]
    assert checked == len(modes) * len(policy_names()) * len(BUDGETS)
    assert max(lanes_per_step) == 8  # steps were shared by eight sequences
    assert max(shared_prefills) >= 4  # and prefills (those of the no-cache policy are plain shared steps)
    assert max(joined_commits) == 8  # and commits: the repeated job's eight generations in one write


def test_sequences_leave_and_join(models: dict, lanes_per_step: list[int]) -> None:
    """Sequences that need different numbers of steps (their own schedules, threshold decoding) finish at different
    times: each that finishes leaves, the next waiting one joins the running batch, and every result is the one it
    gets alone."""
    from maskkv_cli.sampling.llada import denoise_llada

    tok, model = models["tokenizer"], models["llada"]
    gens = [GenerationConfig(gen_length=16, steps=16, block_length=8),
            GenerationConfig(gen_length=16, steps=4, block_length=8),
            GenerationConfig(gen_length=16, steps=16, block_length=8, threshold=0.1)]
    prompts = [torch.tensor([chat_prompt_ids(tok, document_question("".join(TEXTS[i % 4:i % 4 + 1 + i % 3]),
                                                                    f"Question {i}?"))]) for i in range(9)]
    jobs = [_job(model, p, gens[i % 3], ["maskkv", "snapkv", "full"][i % 3], 8) for i, p in enumerate(prompts)]
    finished: list[int] = []
    results = sample_many(model, jobs, 3, on_result=lambda i, r: finished.append(i))
    alone = [denoise_llada(model, j.prompt, j.gen, j.plan) for j in jobs]
    for together, single in zip(results, alone, strict=True):
        assert together.tokens.tolist() == single.tokens.tolist()
        assert together.stats.steps_run == single.stats.steps_run
    assert sorted(finished) == list(range(9)) and finished != list(range(9))  # some finished out of order
    assert max(lanes_per_step) == 3
    assert len({s.stats.steps_run for s in alone}) > 1  # the sequences really took different numbers of steps


def test_cfg_and_no_cache_lanes(models: dict) -> None:
    """Guidance (two rows per sequence) and the no-cache policy (whole sequences of one length together)."""
    from maskkv_cli.sampling.llada import denoise_llada

    tok, model = models["tokenizer"], models["llada"]
    gen = GenerationConfig(gen_length=8, steps=8, block_length=8, cfg_scale=1.0)
    prompts = [torch.tensor([chat_prompt_ids(tok, document_question(TEXTS[i], "Where?"))]) for i in range(4)]
    jobs = [_job(model, p, gen, policy, 8) for p in prompts for policy in ("maskkv", "none")]
    jobs += [jobs[1]] * 3  # the same no-cache sequence: same length, steps shared
    for job, result in zip(jobs, sample_many(model, jobs, 5), strict=True):
        assert result.tokens.tolist() == denoise_llada(model, job.prompt, gen, job.plan).tokens.tolist()


def test_ask_many_equals_ask(tiny_dir: Path) -> None:
    """Questions about one document, one of them read in parts, answered together equal each asked alone."""
    from maskkv_cli.app.pipeline import ask, ask_many
    from maskkv_cli.app.session import Session
    from maskkv_cli.engine.plan import CacheConfig

    session = Session(str(tiny_dir))
    short = TEXTS[0]
    long = "\n".join(TEXTS[i % 4] * 3 for i in range(40))
    assert session.count_tokens(long) > session.window
    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    cache = CacheConfig(policy="maskkv", budget=16)
    items = [(short, "What is the special magic number for apple?"), (long, "Where does the river run?"),
             (short, "Who wrote it?")]
    together = ask_many(session, items, gen, cache, long="parts", batch_size=4)
    for (context, question), answer in zip(items, together, strict=True):
        single = ask(session, context, question, gen, cache, long="parts")
        assert answer.text == single.text
        assert answer.result.tokens.tolist() == single.result.tokens.tolist()
        assert answer.fitted == single.fitted
        assert answer.prompt_len == single.prompt_len
    assert together[1].fitted.parts > 1


def test_batch_size_option_and_memory_model(tiny_config) -> None:  # type: ignore[no-untyped-def]
    assert parse_batch_size("auto") is None and parse_batch_size("8") == 8
    for bad in ("0", "-2", "many"):
        with pytest.raises(UsageError, match="--batch-size"):
            parse_batch_size(bad)
    memory = batch_memory(config_geometry(tiny_config), 1000, 32, 64, 4)
    assert memory.total(2) - memory.total(1) == memory.cache_per_sequence + memory.step_per_sequence
    per = memory.cache_per_sequence + memory.step_per_sequence
    free = int((memory.prefill_peak + 5 * per) / 0.8) + 1
    size, line = auto_batch_size(memory, free, 100)
    assert size == 5 and "most that fits" in line
    assert auto_batch_size(memory, free, 3)[0] == 3
    assert auto_batch_size(memory, 0, 3)[0] == 1
    # keeping fewer entries makes a sequence smaller
    assert batch_memory(config_geometry(tiny_config), 1000, 32, 1000, 4).cache_per_sequence > memory.cache_per_sequence


def test_memory_model_reads_each_layers_geometry(tiny_config) -> None:  # type: ignore[no-untyped-def]
    """The memory model sums each layer's own key/value heads and head size: a model whose layers all match the
    config gives the config's figures; one layer with other heads changes the cache by exactly its share."""
    from maskkv_cli.models.families import build_model

    with torch.device("meta"):
        model = build_model(tiny_config)
    assert model_geometry(model) == config_geometry(tiny_config)
    before = batch_memory(model_geometry(model), 1000, 32, 64, 4).cache_per_sequence
    block = model.blocks[0]
    old = 2 * block.n_kv_heads * block.head_dim
    block.n_kv_heads, block.head_dim = 1, 2 * block.head_dim  # a layer of its own geometry
    after = batch_memory(model_geometry(model), 1000, 32, 64, 4).cache_per_sequence
    assert after - before == (2 * block.n_kv_heads * block.head_dim - old) * 4 * (64 + 32)


def test_bench_quality_rows_do_not_depend_on_the_batch_size(tiny_dir: Path, tmp_path: Path,
                                                             lanes_per_step: list[int]) -> None:
    """A row's tasks answered together (--batch-size 4) give the predictions of one at a time (--batch-size 1)."""
    from typer.testing import CliRunner

    from maskkv_cli.cli import app

    def predictions(size: str) -> list[dict]:
        out = tmp_path / f"q{size}"
        result = CliRunner().invoke(app, ["bench", "quality", "-n", "4", "--lengths", "128", "--policies",
                                          "full,maskkv", "--budgets", "8", "--model", str(tiny_dir), "--out",
                                          str(out), "--fresh", "--json", "--batch-size", size])
        assert result.exit_code == 0, result.output
        lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
        return [{k: v for k, v in line.items() if k not in ("seconds", "prefill_s")} for line in lines]

    alone = predictions("1")
    assert set(lanes_per_step) == {1}  # batch size 1: one sequence a forward
    assert predictions("4") == alone and max(lanes_per_step) == 4


def test_a_sequence_that_fails_ends_alone(models: dict) -> None:
    """A generation whose progress callback raises (a server's client gone) ends with that error; the sequences
    stepping with it finish with the tokens they get alone; sample_many raises the error after they finish."""
    from maskkv_cli.sampling.llada import denoise_llada
    from maskkv_cli.sampling.stream import sample_stream

    tok, model = models["tokenizer"], models["llada"]
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8)
    prompts = [torch.tensor([chat_prompt_ids(tok, document_question(TEXTS[i], "Where?"))]) for i in range(4)]

    class Gone(Exception):
        pass

    def stop_at_third_step(event) -> None:  # type: ignore[no-untyped-def]
        if event.step == 3:
            raise Gone()

    jobs = [_job(model, p, gen, "maskkv", 8) for p in prompts]
    jobs[1] = BatchJob(jobs[1].prompt, gen, jobs[1].plan, stop_at_third_step)
    waiting = list(enumerate(jobs))
    outcomes: dict[int, object] = {}
    sample_stream(model, lambda room, wait: [waiting.pop(0) for _ in range(min(room, len(waiting)))], 4,
                  lambda i, result, error: outcomes.__setitem__(i, error if error is not None else result))
    assert isinstance(outcomes[1], Gone)
    for i in (0, 2, 3):
        alone = denoise_llada(model, jobs[i].prompt, gen, jobs[i].plan)
        assert outcomes[i].tokens.tolist() == alone.tokens.tolist()  # type: ignore[attr-defined]
    with pytest.raises(Gone):
        sample_many(model, jobs, 4)


@pytest.mark.parametrize(("config", "dtype"), [("tiny", "fp32"), ("dream-tiny", "fp32"), ("llada-moe-tiny", "fp32"),
                                               ("llada2-tiny", "fp32"), ("llada-moe-tiny", "bf16"),
                                               ("llada2-tiny", "bf16")])
def test_every_probability_is_bit_identical_for_each_family(config: str, dtype: str, threads: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only the tokens: every committed token's probability is the same float alone and in a batch of eight
    prompts of different lengths, every policy kind in one batch (the plain forward, the full cache, MaskKV, online
    layer budgets), at one and two threads (two threads' few-rows kernel reaches 11 rows on this project's
    machines: every product keeps the row floor, models/rows.py). The block-causal family steps its blocks in the
    same forwards as the others (its finished blocks' passes, spanning the canvas masked, among them). In bf16 too,
    whose few-rows kernels (1-2 rows) the floor covers as well."""
    from maskkv_cli.bench.cases import random_model
    from maskkv_cli.engine.plan import CacheConfig, plan_cache
    from maskkv_cli.models.config import named_config
    from maskkv_cli.sampling import sample

    model = random_model(named_config(config), dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size - 100
    prompts = [torch.randint(6, vocab, (1, n), generator=g) for n in (40, 57, 63, 75, 90, 101, 33, 48)]
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8)
    kinds = [CacheConfig("maskkv", 16), CacheConfig("full"), CacheConfig("none"),
             CacheConfig("maskkv", 16, layer_budgets="online")]
    jobs = [BatchJob(p, gen, plan_cache(model, kinds[i % len(kinds)], p.shape[1], block_length=gen.block_length))
            for i, p in enumerate(prompts)]
    shared: list[int] = []  # sequences per greedy pick the driver ran over several sequences' rows at once
    picks = driver.pick_lanes

    def count(pick, joined, sizes, shapes, scratch):  # type: ignore[no-untyped-def]
        shared.append(sum(shape[0] for shape in shapes))  # a cohort's pick is one (G, n) part
        return picks(pick, joined, sizes, shapes, scratch)

    monkeypatch.setattr(driver, "pick_lanes", count)
    together_all = sample_many(model, jobs, 8)
    assert max(shared) >= 6  # the sampler step is shared too (the plain lanes' logits join the others')
    monkeypatch.undo()
    for job, together in zip(jobs, together_all, strict=True):
        alone = sample(model, job.prompt, gen, job.plan)
        assert together.tokens.tolist() == alone.tokens.tolist()
        assert torch.equal(together.token_probs.nan_to_num(-1.0), alone.token_probs.nan_to_num(-1.0)), job.plan


def test_rope_scaled_prompts_batch_with_others(tiny_dir: Path) -> None:
    """Under ``--long rope-scale`` each prompt carries its own RoPE base scaling (its lanes' tables), so a text
    beyond the window read whole answers the same beside other questions as alone."""
    from maskkv_cli.app.pipeline import ask, ask_many
    from maskkv_cli.app.session import Session
    from maskkv_cli.engine.plan import CacheConfig

    session = Session(str(tiny_dir))
    long = "\n".join(TEXTS[i % 4] * 3 for i in range(40))
    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    cache = CacheConfig(policy="maskkv", budget=16)
    items = [(long, "Where does the river run?"), (TEXTS[0], "Who wrote it?"), (long, "What is it about?")]
    together = ask_many(session, items, gen, cache, long="rope-scale", batch_size=3)
    assert together[0].fitted.rope_factor > 1 and together[1].fitted.rope_factor == 1
    for (context, question), answer in zip(items, together, strict=True):
        single = ask(session, context, question, gen, cache, long="rope-scale")
        assert answer.result.tokens.tolist() == single.result.tokens.tolist()
        assert torch.equal(answer.result.token_probs.nan_to_num(-1.0), single.result.token_probs.nan_to_num(-1.0))


@pytest.mark.parametrize(("mlp_chunk", "query_chunk"), [(16, 8), (60, 24), (64, 512), (2048, 512)])
def test_a_shared_prefill_equals_each_prefill_alone(mlp_chunk: int, query_chunk: int) -> None:
    """``prefill_lanes`` over prompts of several lengths (an online lane, a CFG lane of two rows among them), with
    chunks smaller and larger than a prompt (a product then holds the rows of one lane, part of one, or several
    lanes'; with query chunks that hold every lane, queries, keys and values come from ``chunked_qkv`` in one or
    several row chunks), gives each prompt the logits, kept cache entries and importance of its prefill alone."""
    from maskkv_cli.bench.cases import random_model
    from maskkv_cli.engine.lanes import PrefillLane
    from maskkv_cli.engine.prefill import prefill, prefill_lanes, selection_sink
    from maskkv_cli.models.config import named_config

    model = random_model(named_config("tiny"))
    g = torch.Generator().manual_seed(2)
    mask_id = model.config.mask_token_id
    policy = get_policy("maskkv")
    lanes, settings = [], []
    for m, rows, online in ((40, 1, False), (7, 1, False), (75, 2, False), (22, 1, True)):
        ids = torch.cat([torch.randint(0, 200, (rows, m), generator=g), torch.full((rows, 8), mask_id)], 1)
        budgets = list(CachePlan.build(model, policy, 6, m).layer_budgets)  # type: ignore[arg-type]
        sink, measure = selection_sink(policy, budgets, m, 8, len(model.blocks), online)
        lanes.append(PrefillLane(ids, m, torch.arange(m, m + 8), sink, measure=measure))
        settings.append((budgets, online))
    together = prefill_lanes(model, lanes, mlp_chunk=mlp_chunk, query_chunk=query_chunk)
    for lane, (budgets, online), (logits, importance) in zip(lanes, settings, together, strict=True):
        assert lane.sink is not None
        cache, records = lane.sink.finish(importance)
        alone, cache_alone, records_alone = prefill(model, lane.ids, lane.prompt_len, policy, budgets, lane.rows,
                                                    mlp_chunk=mlp_chunk, query_chunk=query_chunk,
                                                    online_importance=online)
        assert torch.equal(logits, alone)
        assert [r.importance for r in records] == [r.importance for r in records_alone]
        for layer, layer_alone in zip(cache.layers, cache_alone.layers, strict=True):
            kept = layer.prompt_slots  # the response slots are written by the steps
            assert torch.equal(layer.k[:, :, :kept], layer_alone.k[:, :, :kept])
            assert torch.equal(layer.v[:, :, :kept], layer_alone.v[:, :, :kept])
            assert torch.equal(layer.positions, layer_alone.positions)


def test_prefills_join_up_to_the_row_cap_and_long_ones_run_alone(models: dict, lanes_per_step: list[int]) -> None:
    """Prefills go through the engine in runs of at most ``join_rows`` rows (a longer prompt alone); every sequence's
    tokens are still the ones it gets alone."""
    from maskkv_cli.engine.chunks import JOIN_ROWS
    from maskkv_cli.engine.lanes import PrefillLane
    from maskkv_cli.engine.prefill import join_rows
    from maskkv_cli.models.config import named_config
    from maskkv_cli.models.families import build_model
    from maskkv_cli.sampling.llada import denoise_llada

    with torch.device("meta"):  # a layer's weights against a row's activations: 54.5 MB / 16 kB
        assert join_rows(build_model(named_config("llada-small"))) == 54_534_144 // ((1024 + 3072) * 4)

    lane = PrefillLane(torch.zeros(1, 40, dtype=torch.long), 32, torch.arange(32, 40), None)
    long = PrefillLane(torch.zeros(2, 300, dtype=torch.long), 280, torch.arange(280, 300), None)
    sizes = [len(g) for g in driver.prefill_groups([(None, lane)] * 3 + [(None, long)] + [(None, lane)] * 2,
                                                   100)]  # type: ignore[list-item]
    assert sizes == [2, 1, 1, 2]  # 80 rows, then 40 (120 > 100), the 600-row lane alone, then 80

    tok, model = models["tokenizer"], models["llada"]
    gen = GenerationConfig(gen_length=16, steps=16, block_length=8)
    short = [torch.tensor([chat_prompt_ids(tok, document_question(TEXTS[i], "Where?"))]) for i in range(3)]
    longer = torch.tensor([chat_prompt_ids(tok, document_question("".join(TEXTS) * 2, "Who?"))])
    jobs = [_job(model, p, gen, "maskkv", 8) for p in [*short, longer]]
    shared_prefills.clear()
    assert join_rows(model) == JOIN_ROWS  # a tiny model's layer weighs less than JOIN_ROWS rows' activations
    assert sum(j.prompt.shape[-1] + 16 for j in jobs[:3]) <= JOIN_ROWS < longer.shape[-1] + 16
    results = sample_many(model, jobs, 4)
    assert shared_prefills == [3, 1]  # the three short prompts together, the long one on its own
    for together, job in zip(results, jobs, strict=True):
        assert together.tokens.tolist() == denoise_llada(model, job.prompt, job.gen, job.plan).tokens.tolist()


def test_the_prefills_rope_memo_is_bounded_by_bytes_and_shared_per_model(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """``prefill_memo``: one memo per model; a table larger than its bytes is computed but not kept, and the memo
    starts afresh when the next table would take it past its bytes."""
    cpu = torch.device("cpu")
    assert prefill_memo(tiny_model) is prefill_memo(tiny_model)
    per_position = 2 * tiny_model.layer_rope(0, torch.arange(1)).cos.numel() * 4  # cos and sin, fp32
    memo = RopeMemo(kept=8, max_bytes=10 * per_position)
    big = memo.get(tiny_model, 0, 0, 11, 1.0, cpu)
    assert memo.get(tiny_model, 0, 0, 11, 1.0, cpu) is not big  # over the bytes: never kept
    six = memo.get(tiny_model, 0, 0, 6, 1.0, cpu)
    assert memo.get(tiny_model, 0, 0, 6, 1.0, cpu) is six
    five = memo.get(tiny_model, 0, 0, 5, 1.0, cpu)  # 11 positions' bytes: the memo starts afresh with it
    assert memo.get(tiny_model, 0, 0, 5, 1.0, cpu) is five and memo.get(tiny_model, 0, 0, 6, 1.0, cpu) is not six
    fresh = tiny_model.layer_rope(0, torch.arange(0, 5))
    assert torch.equal(five.cos, fresh.cos) and torch.equal(five.sin, fresh.sin)


def test_a_generations_rope_tables_are_kept_and_equal_fresh_ones(tiny_model) -> None:  # type: ignore[no-untyped-def]
    """``RopeMemo``: a generation's later steps take the tables of its positions from the memo: the same numbers as
    tables computed for the step, computed once per kind of layer, positions and factor."""
    cpu = torch.device("cpu")
    memo = RopeMemo()
    kept = memo.get(tiny_model, 0, 24, 40, 1.0, cpu)
    fresh = tiny_model.layer_rope(0, torch.arange(24, 40))
    assert torch.equal(kept.cos, fresh.cos) and torch.equal(kept.sin, fresh.sin)
    assert memo.get(tiny_model, 3, 24, 40, 1.0, cpu) is kept  # every layer of this model rotates alike
    assert memo.get(tiny_model, 0, 24, 40, 2.0, cpu) is not kept  # another RoPE scaling
    assert memo.get(tiny_model, 0, 24, 41, 1.0, cpu) is not kept  # other positions
    ids = torch.randint(6, tiny_model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    rows = torch.arange(30, 40)
    (alone,) = step_logits(tiny_model, [StepLane(ids, rows, 0)])
    for _ in range(2):  # the first step fills the memo, the second reads it
        (with_memo,) = step_logits(tiny_model, [StepLane(ids, rows, 0, tables=memo)])
        assert torch.equal(with_memo, alone)


def test_plans_from_one_pyramidkv_keep_their_own_window(models: dict) -> None:
    """PyramidKV's observation window is its run's (``min(32, B / 2, M - 1)``): plans built from one policy object
    at different budgets each keep their own, and each sequence of a batch of them gets the tokens it gets alone."""
    from maskkv_cli.sampling.llada import denoise_llada

    tok, model = models["tokenizer"], models["llada"]
    policy, budgets = get_policy("pyramidkv"), (16, 96)
    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)
    prompts = [torch.tensor([chat_prompt_ids(tok, document_question("".join(TEXTS[: 2 + i]), "Where?"))])
               for i in range(2)]
    plans = [CachePlan.build(model, policy, budget, p.shape[1]) for p, budget in zip(prompts, budgets, strict=True)]
    assert all(plan.evicts for plan in plans)
    assert [plan.policy.window(plan.layer_budgets[0], plan.split) for plan in plans] == [8, 32]
    results = sample_many(model, [BatchJob(p, gen, plan) for p, plan in zip(prompts, plans, strict=True)], 2)
    for p, budget, result in zip(prompts, budgets, results, strict=True):
        alone = denoise_llada(model, p, gen, CachePlan.build(model, get_policy("pyramidkv"), budget, p.shape[1]))
        assert result.tokens.tolist() == alone.tokens.tolist()
