"""LongBench prompts: per-task templates and answer lengths, middle truncation, raw vs chat, ``--prompts``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from maskkv_cli.app.session import Session
from maskkv_cli.bench.quality import group_generation
from maskkv_cli.bench.quality_sources import TaskGroup, build_groups
from maskkv_cli.cli import app
from maskkv_cli.errors import UsageError
from maskkv_cli.prompting.fit import middle_cut
from maskkv_cli.sampling.llada import GenerationConfig
from maskkv_cli.tasks.longbench import (
    MAX_NEW_TOKENS,
    TEMPLATES,
    encode_longbench,
    load_templates,
    prompt_spec,
)
from maskkv_cli.tasks.taskio import Task


def task(context: str, question: str = "Where is the tower?", dataset: str = "hotpotqa") -> Task:
    return Task(context=context, input=question, answers=("Paris",), dataset=dataset, length=len(context.split()))


@pytest.fixture(scope="module")
def session(tiny_dir: Path) -> Session:
    return Session(str(tiny_dir))


def test_every_task_has_a_template_and_an_answer_length():
    assert set(TEMPLATES) == set(MAX_NEW_TOKENS) and len(TEMPLATES) == 21
    for name, template in TEMPLATES.items():
        assert "{context}" in template
        filled = template.format(context="CTX", input="QQ")
        assert "CTX" in filled and ("QQ" in filled or name in ("gov_report", "multi_news", "vcsum", "lcc",
                                                                 "passage_count"))
    assert [MAX_NEW_TOKENS[n] for n in ("hotpotqa", "multifieldqa_en", "narrativeqa", "gov_report")] == [32, 64,
                                                                                                          128, 512]


def test_prompt_spec_knows_longbench_and_e_names():
    spec = prompt_spec("hotpotqa_e")
    assert spec is not None and spec.dataset == "hotpotqa" and spec.max_new_tokens == 32 and spec.chat
    assert prompt_spec("trec") is not None and not prompt_spec("trec").chat  # type: ignore[union-attr]
    assert prompt_spec("niah_single") is None and prompt_spec("my_task") is None
    custom = prompt_spec("hotpotqa", {"hotpotqa": "Q {input} C {context}"})
    assert custom is not None and custom.template == "Q {input} C {context}"
    assert custom.fingerprint != spec.fingerprint and custom.fingerprint.startswith("longbench:")


def test_middle_cut_keeps_both_ends():
    assert middle_cut(list(range(10)), 20) == list(range(10))
    assert middle_cut(list(range(10)), 4) == [0, 1, 8, 9]
    assert middle_cut(list(range(10)), 5) == [0, 1, 7, 8, 9]


def test_long_prompt_is_cut_in_the_middle_to_fit_the_window(session: Session):
    context = "BEGINNING " + "The river runs past the old mill. " * 400 + " ENDING"
    spec = prompt_spec("hotpotqa")
    assert spec is not None
    prompts, cut = encode_longbench(session, [task(context), task("Short text about Paris.")], spec, 32)
    assert cut == 1
    assert len(prompts[0]) <= session.window - 32
    text = session.tokenizer.decode(prompts[0])
    # Template text from both ends survives; the chat template wraps the cut prompt.
    assert "Answer the question using the passages below" in text and "Where is the tower?" in text
    assert text.rstrip().endswith("assistant") or "assistant" in text[-40:]
    assert "Short text about Paris." in session.tokenizer.decode(prompts[1])


@pytest.mark.parametrize("gen_length", [8, 32, 50])
def test_every_cut_prompt_fits_the_window_beside_its_answer(session: Session, gen_length: int):
    """The template around a cut text can take a few tokens more than the two counted apart: cut again."""
    pages = ("Prices rose by 4% in März; the café closed. ", "数字是 4821。河流向北流。 ", "🙂 emoji, 👍🏽 ",
             "The river runs past the old mill. ")
    tasks = [task(" ".join(pages[i % 4] * (150 + 37 * i) for i in range(n)), q) for n in (1, 2, 3, 4)
             for q in ("Where is the tower?", "Wo ist der Turm?")]
    for dataset in ("hotpotqa", "trec"):
        spec = prompt_spec(dataset)
        assert spec is not None
        prompts, cut = encode_longbench(session, tasks, spec, gen_length)
        assert cut == len(tasks)
        assert max(len(p) for p in prompts) <= session.window - gen_length


def test_raw_tasks_start_with_bos_and_have_no_chat_header(session: Session):
    spec = prompt_spec("trec")
    assert spec is not None
    prompts, cut = encode_longbench(session, [task("Question: who? Type: Human", "Question: why?", "trec")], spec, 64)
    ids = prompts[0]
    assert cut == 0 and ids[0] == session.model.config.bos_token_id
    assert "assistant" not in session.tokenizer.decode(ids)


def test_file_groups_get_their_answer_length_unless_one_is_given(session: Session):
    groups = [("hotpotqa", None, [task("The tower stands in Paris.")]), ("mine", None, [task("x", dataset="mine")])]
    own = build_groups(session, gen_length=8, file_groups=groups)
    assert own[0].gen_length == 32 and own[0].prompt_format.startswith("longbench:")
    assert own[1].gen_length is None and own[1].prompt_format == "document_question"
    fixed = build_groups(session, gen_length=8, file_groups=groups, task_lengths=False)
    assert fixed[0].gen_length is None and fixed[0].prompt_format == own[0].prompt_format


def test_group_generation_one_token_per_step_and_a_dividing_block():
    gen = GenerationConfig(gen_length=8, steps=8, block_length=8)

    def group(length: int | None) -> TaskGroup:
        return TaskGroup("t", None, [], [], gen_length=length)

    assert group_generation(gen, group(None)) is gen
    assert (lambda g: (g.gen_length, g.steps, g.block_length))(group_generation(gen, group(32))) == (32, 32, 8)
    odd = GenerationConfig(gen_length=12, steps=12, block_length=12)
    assert (lambda g: (g.gen_length, g.steps, g.block_length))(group_generation(odd, group(32))) == (32, 32, 32)
    # a group the model was trained to decode in its own blocks (lead summaries) gets them
    own = TaskGroup("lead_summary", 512, [], [], gen_length=32, block_length=4)
    assert (lambda g: (g.gen_length, g.steps, g.block_length))(group_generation(gen, own)) == (32, 32, 4)


def test_load_templates_errors(tmp_path: Path):
    good = tmp_path / "p.json"
    good.write_text(json.dumps({"hotpotqa": "C: {context}\nQ: {input}\nA:"}))
    assert load_templates(good) == {"hotpotqa": "C: {context}\nQ: {input}\nA:"}
    cases: dict[str, Any] = {
        "missing.json": None,
        "notjson.json": "{nope",
        "list.json": json.dumps(["a"]),
        "nocontext.json": json.dumps({"hotpotqa": "Q: {input}"}),
        "badfield.json": json.dumps({"hotpotqa": "{context} {question}"}),
    }
    for name, text in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(UsageError):
            load_templates(path)


def test_cli_longbench_lengths_and_prompts(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text(json.dumps({"input": "Where is the tower?", "context": "The tower stands in Paris.",
                                "answers": ["Paris"], "dataset": "hotpotqa", "_id": "h1"}) + "\n")
    seen: list[tuple[int, str]] = []

    def answer_ids(self: Session, ids: list[int], gen: Any, cache: Any, on_event: Any = None) -> Any:
        from types import SimpleNamespace

        seen.append((gen.gen_length, self.tokenizer.decode(ids)))
        return SimpleNamespace(text="Paris", notes=[], result=None)

    monkeypatch.setattr(Session, "answer_ids", answer_ids)
    templates = tmp_path / "prompts.json"
    templates.write_text(json.dumps({"hotpotqa": "MYPROMPT {context} || {input} ->"}))
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "quality", "--model", str(tiny_dir), "--tasks", str(path), "--policies",
                                 "full", "--prompts", str(templates), "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["results"][0]
    assert row["gen_length"] == 32 and row["steps"] == 32 and row["accuracy"] == 100.0
    assert seen[0][0] == 32 and "MYPROMPT" in seen[0][1]
    assert "LongBench answer lengths" in (tmp_path / "o" / "summary.md").read_text()
    result = runner.invoke(app, ["bench", "quality", "--model", str(tiny_dir), "--tasks", "niah_single",
                                 "--prompts", str(templates)])
    assert result.exit_code == 2 and "--prompts applies to a LongBench --tasks file" in result.stderr
