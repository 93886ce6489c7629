"""``maskkv batch`` without Ray: job files, keys, answers equal to ``ask``, resuming, failures as rows."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from pdfs import BODY, make_pdf
from typer.testing import CliRunner

from maskkv_cli.app.run_settings import resolve_generation
from maskkv_cli.batch.folder import AnswersFolder, read_rows
from maskkv_cli.batch.jobs import AnswerSettings, JobSpec, cross_product, job_key, read_jobs_file, read_questions
from maskkv_cli.batch.run import Runner, run_batch
from maskkv_cli.cli import app
from maskkv_cli.errors import UsageError
from maskkv_cli.sampling.llada import GenerationConfig

runner = CliRunner()
FAST = ["-n", "8", "--steps", "8", "--block-length", "8"]
QUESTIONS = ["What does the keeper write?", "Who comes at night?"]


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, Path]:
    story = tmp_path / "story.pdf"
    story.write_bytes(make_pdf(BODY))
    notes = tmp_path / "notes.txt"
    notes.write_text("The river runs past the old mill. The special magic number for apple is 48213.\n")
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(make_pdf(BODY)[:300])  # cut short: no page can be recovered
    return {"story": story, "notes": notes, "broken": broken}


def _jobs_file(path: Path, docs: list[Path], questions: list[str]) -> Path:
    rows = [{"id": f"{d.stem}-{i}", "document": str(d), "question": q} for d in docs for i, q in enumerate(questions)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jobs_from_jsonl_csv_and_cross_product(tmp_path: Path, corpus: dict[str, Path]) -> None:
    (tmp_path / "jobs.jsonl").write_text('{"document": "story.pdf", "question": "Who?", "budget": 16}\n\n'
                                         '{"id": "x", "document": "notes.txt", "question": "What?", '
                                         '"policy": "snapkv", "gen_length": "8"}\n')
    specs = read_jobs_file(tmp_path / "jobs.jsonl")
    assert [(s.id, Path(s.document).name, s.budget, s.policy, s.gen_length) for s in specs] == [
        ("1", "story.pdf", 16, None, None), ("x", "notes.txt", None, "snapkv", 8)]
    (tmp_path / "jobs.csv").write_text("document,question,budget\nstory.pdf,\"Who, then?\",\nnotes.txt,When?,32\n")
    specs = read_jobs_file(tmp_path / "jobs.csv")
    assert [(s.question, s.budget) for s in specs] == [("Who, then?", None), ("When?", 32)]
    assert Path(specs[0].document) == corpus["story"]  # relative to the jobs file
    (tmp_path / "bad.jsonl").write_text('{"document": "a.txt", "question": "Q", "colour": "red"}\n')
    with pytest.raises(UsageError, match="unknown column"):
        read_jobs_file(tmp_path / "bad.jsonl")
    (tmp_path / "bad.csv").write_text("document,question,budget\na.txt,Q,-3\n")
    with pytest.raises(UsageError, match="budget must be positive"):
        read_jobs_file(tmp_path / "bad.csv")
    (tmp_path / "policy.jsonl").write_text('{"document": "a.txt", "question": "Q"}\n'
                                           '{"document": "a.txt", "question": "Q", "policy": "bogus"}\n')
    with pytest.raises(UsageError, match="policy.jsonl:2: unknown policy 'bogus'; choose one of: none, full"):
        read_jobs_file(tmp_path / "policy.jsonl")  # named with its line when read, before any model is chosen
    (tmp_path / "notes.rst").write_text("Notes\n")
    with pytest.raises(UsageError, match="a jobs file is .jsonl or .csv; to ask about documents: --docs"):
        read_jobs_file(tmp_path / "notes.rst")  # a document given where the jobs file goes
    # a comma in a field not quoted cut the question at it ("Tell me"), the rest dropped without a word; an id of 0
    # became the line number
    (tmp_path / "comma.csv").write_text("document,question\nstory.pdf,Tell me, who comes?\n")
    with pytest.raises(UsageError, match=r"comma.csv:2: 3 fields for 2 columns; put a field that holds a comma"):
        read_jobs_file(tmp_path / "comma.csv")
    (tmp_path / "zero.jsonl").write_text('{"id": 0, "document": "a.txt", "question": "Q"}\n')
    assert read_jobs_file(tmp_path / "zero.jsonl")[0].id == "0"
    # two jobs of one id gave two rows of that id, and summary.md's "same as" named either
    (tmp_path / "twice.jsonl").write_text('{"id": "a", "document": "a.txt", "question": "Q"}\n'
                                          '{"id": "a", "document": "b.txt", "question": "Q"}\n')
    with pytest.raises(UsageError, match=r"twice.jsonl:2: the id 'a' is also the id of the job at .*twice.jsonl:1"):
        read_jobs_file(tmp_path / "twice.jsonl")
    (tmp_path / "twice.csv").write_text("id,document,question\n,a.txt,Q\n1,b.txt,Q\n")
    with pytest.raises(UsageError, match=r"twice.csv:3: the id '1' is also the id of the job at .*twice.csv:2"):
        read_jobs_file(tmp_path / "twice.csv")  # the first job's id is its row's number
    specs = cross_product([str(tmp_path / "*.pdf"), str(corpus["notes"])], ["Q1", "Q2"])
    assert [(Path(s.document).name, s.question) for s in specs] == [
        ("broken.pdf", "Q1"), ("broken.pdf", "Q2"), ("story.pdf", "Q1"), ("story.pdf", "Q2"), ("notes.txt", "Q1"),
        ("notes.txt", "Q2")]
    folder = cross_product([str(tmp_path)], ["Q"])  # a folder: its .pdf/.txt/.md files, as ingest finds them
    assert sorted(Path(s.document).name for s in folder) == ["broken.pdf", "notes.txt", "story.pdf"]
    with pytest.raises(UsageError, match="matches no file"):
        cross_product([str(tmp_path / "*.docx")], ["Q"])


def test_generation_resolution_matches_ask() -> None:
    """A batch job's settings give the generation settings ``ask``'s options give, through the same builder."""
    from maskkv_cli.batch.answering import run_settings
    from maskkv_cli.cli.run_options import RunOptions

    for defaults in ({}, {"gen_length": 16, "steps": 8, "block_length": 16}, {"gen_length": 48}):
        for gen_length in (None, 8, 24, 40):
            for steps in (None, 4):
                for block in (None, 8):
                    got = resolve_generation(defaults, gen_length, steps, block)
                    job = run_settings(AnswerSettings(policy="maskkv", gen_length=gen_length, steps=steps,
                                                      block_length=block))
                    try:
                        want = RunOptions(gen_length=gen_length, steps=steps, block_length=block).generation(defaults)
                    except UsageError:  # an invalid combination: ask refuses it, and so does batch's planning
                        with pytest.raises(UsageError):
                            GenerationConfig(*got)
                        with pytest.raises(UsageError):
                            job.generation(defaults)
                        continue
                    assert job.generation(defaults) == want
                    assert got == (want.gen_length, want.steps, want.block_length)
                    assert resolve_generation(defaults, *got) == got  # resolved values are a fixed point


def test_key_changes_with_every_setting_that_changes_the_answer() -> None:
    base = AnswerSettings(policy="maskkv", budget=16, gen_length=8, steps=8, block_length=8)
    key = job_key("a" * 64, "Q", "model", "fp32", "cpu", base)
    assert key == job_key("a" * 64, "Q", "model", "fp32", "cpu", AnswerSettings(**base.as_dict()))
    others = [job_key("b" * 64, "Q", "model", "fp32", "cpu", base),
              job_key("a" * 64, "Q2", "model", "fp32", "cpu", base),
              job_key("a" * 64, "Q", "model2", "fp32", "cpu", base),
              job_key("a" * 64, "Q", "model", "bf16", "cpu", base),
              job_key("a" * 64, "Q", "model", "fp32", "cuda", base)]
    for change in ({"policy": "snapkv"}, {"budget": 32}, {"gen_length": 16}, {"steps": 4}, {"block_length": 4},
                   {"temperature": 0.5}, {"seed": 1}, {"long": "rope-scale"}, {"layer_budgets": "uniform"},
                   {"threshold": 0.9}, {"alg": "origin"}):
        others.append(job_key("a" * 64, "Q", "model", "fp32", "cpu", AnswerSettings(**{**base.as_dict(), **change})))
    assert len({key, *others}) == len(others) + 1


def test_batch_answers_equal_ask_and_a_broken_pdf_is_a_recorded_failure(tmp_path: Path, corpus: dict[str, Path],
                                                                         tiny_dir: Path) -> None:
    jobs = _jobs_file(tmp_path / "jobs.jsonl", [corpus["story"], corpus["broken"], corpus["notes"]], QUESTIONS)
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(out), "--model", str(tiny_dir), "--budget", "16",
                                 "--json", *FAST])
    assert result.exit_code == 1, result.output  # some job failed
    summary = json.loads(result.stdout)
    assert (summary["jobs"], summary["ok"], summary["failed"]) == (6, 4, 2)
    rows, broken = read_rows(out / "answers.jsonl")
    assert not broken and len(rows) == 6
    failed = [r for r in rows if r["error"]]
    assert {r["id"] for r in failed} == {"broken-0", "broken-1"}
    assert all("\n" not in r["error"] and "broken.pdf" in r["error"] for r in failed)
    for doc in (corpus["story"], corpus["notes"]):
        asked = runner.invoke(app, ["ask", str(doc), "--model", str(tiny_dir), "--budget", "16", "--json", *FAST,
                                    *[a for q in QUESTIONS for a in ("-q", q)]])
        assert asked.exit_code == 0, asked.output
        answers = json.loads(asked.stdout)["answers"]
        fields = ("answer", "claim", "confidence", "note", "read", "source", "budget", "prompt_tokens",
                  "dropped_tokens", "rope_factor")
        want = {a["question"]: tuple(a.get(f) for f in fields) for a in answers}
        got = {r["question"]: tuple(r[f] for f in fields) for r in rows if r["document"] == str(doc)}
        assert got == want
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "fp32" and config["device"] == "cpu" and "machine" in config
    assert "## Failed" in (out / "summary.md").read_text()


def test_summary_and_console_line_show_each_answer_s_confidence(tmp_path: Path, corpus: dict[str, Path],
                                                                 tiny_dir: Path) -> None:
    jobs = _jobs_file(tmp_path / "jobs.jsonl", [corpus["story"]], QUESTIONS)
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(out), "--model", str(tiny_dir), *FAST])
    assert result.exit_code == 0, result.output
    rows, _ = read_rows(out / "answers.jsonl")
    low = sum(1 for r in rows if r["confidence"] and r["confidence"]["low"])
    assert low > 0  # the random test model guesses
    assert f"2 answered (0 from earlier runs, {low} LOW CONFIDENCE)" in result.stderr
    summary = (out / "summary.md").read_text()
    assert "| id | document | question | answer | confidence | read |" in summary
    for r in rows:
        conf = r["confidence"]
        down = (lambda x: math.floor(x * 100) / 100) if conf and conf["low"] else (lambda x: x)  # (never the cut)
        cell = "-" if conf is None else f"{'LOW ' if conf['low'] else ''}{down(conf['mean']):.2f} / " \
            f"{down(conf['min']):.2f}"
        assert f"| {cell} | all 5 pages |" in summary


def test_batch_with_the_embedded_model_labels_questions_of_another_form(tmp_path: Path,
                                                                         corpus: dict[str, Path]) -> None:
    jobs = _jobs_file(tmp_path / "jobs.jsonl", [corpus["notes"]],
                      ["What is the special magic number for apple?", "Who wrote this?"])
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "1 not of the embedded model's question form" in result.stderr
    summary = (out / "summary.md").read_text()
    assert "| What is the special magic number for apple? | 48213 | 0.99 / 0.96 | its 1 page |" in summary
    assert "| (not shown: untrained question) | untrained question | its 1 page |" in summary
    assert "1 question(s) are not of the form the embedded model was trained on" in summary


def test_rerun_skips_finished_repairs_a_torn_line_and_retries_failures(tmp_path: Path, corpus: dict[str, Path],
                                                                      tiny_dir: Path) -> None:
    specs = [JobSpec(f"j{i}", str(corpus["notes"]), q) for i, q in enumerate(["A?", "B?", "C?", "D?"])]
    settings = AnswerSettings(policy="maskkv", budget=8, gen_length=8, steps=8, block_length=8)
    first = run_batch(specs[:3], settings, str(tiny_dir), tmp_path / "out")
    assert (first.ran, first.ok, first.failed) == (3, 3, 0)
    answers = tmp_path / "out" / "answers.jsonl"
    rows, _ = read_rows(answers)
    failed = {**rows[2], "answer": None, "error": "the device ran out of memory"}
    torn = json.dumps(rows[1])[:40]  # a driver killed mid-write
    answers.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + json.dumps(failed) + "\n" + torn)
    second = run_batch(specs, settings, str(tiny_dir), tmp_path / "out")
    assert (second.reused, second.ran, second.ok) == (2, 2, 4)  # j2 failed before and runs again; j3 is new
    final, broken = read_rows(answers)
    assert not broken
    assert sorted(r["id"] for r in final) == ["j0", "j1", "j2", "j3"]
    assert {r["answer"] for r in final if r["id"] == "j2"} == {rows[2]["answer"]}
    assert "- this run: 2 jobs answered in" in (tmp_path / "out" / "summary.md").read_text()
    again = run_batch(specs, settings, str(tiny_dir), tmp_path / "out")
    assert (again.reused, again.ran) == (4, 0)
    summary = (tmp_path / "out" / "summary.md").read_text()  # not "0 jobs answered in 0.0 s (0.0 jobs per minute)"
    assert "- this run: no job was left to run\n" in summary and "jobs per minute" not in summary
    assert "policy maskkv, budget 8," in summary
    from maskkv_cli.batch.run import _budget_label

    assert _budget_label({"policy": "maskkv", "budget": None, "ratio": None}) == "256 (default)"  # (said "default")
    assert _budget_label({"policy": "full", "budget": None, "ratio": None}) == "none (the whole prompt kept)"
    assert _budget_label({"policy": "snapkv", "budget": None, "ratio": 0.25}) == "0.25 of each prompt"



def test_a_job_whose_document_came_back_leaves_no_failure_row(tmp_path: Path, corpus: dict[str, Path],
                                                              tiny_dir: Path) -> None:
    """A job failed for a missing document, then answered once the file was there: answers.jsonl kept both rows for
    good (the failure's key came from the path, the answer's from the bytes), a failure for a job that has its
    answer."""
    later = tmp_path / "later.txt"
    spec = [JobSpec("j", str(later), "What is the special magic number for apple?")]
    settings = AnswerSettings(policy="maskkv", budget=8, gen_length=8, steps=8, block_length=8)
    assert run_batch(spec, settings, str(tiny_dir), tmp_path / "out").failed == 1
    later.write_bytes(corpus["notes"].read_bytes())
    assert run_batch(spec, settings, str(tiny_dir), tmp_path / "out").ok == 1
    rows, _ = read_rows(tmp_path / "out" / "answers.jsonl")
    assert [(r["id"], r["error"]) for r in rows] == [("j", None)]


def test_one_driver_per_folder(tmp_path: Path) -> None:
    with AnswersFolder(tmp_path).open([]), pytest.raises(UsageError, match="another maskkv batch"):
        AnswersFolder(tmp_path).open([])


def test_two_worker_processes_give_the_same_answers_and_retry_a_killed_workers_job(
        tmp_path: Path, corpus: dict[str, Path], tiny_dir: Path) -> None:
    specs = [JobSpec(f"j{i}", str(doc), q) for i, (doc, q) in
             enumerate((d, q) for d in (corpus["story"], corpus["notes"]) for q in QUESTIONS)]
    settings = AnswerSettings(policy="maskkv-plus", budget=16, gen_length=8, steps=8, block_length=8)
    run_batch(specs, settings, str(tiny_dir), tmp_path / "one")
    killed: list[str] = []

    def kill_first(pool: Any, worker: int, job: Any) -> None:
        if not killed:  # its worker process dies with the job in flight: the job runs again on another worker
            killed.append(job.key)
            pool.procs[worker].kill()

    two = run_batch(specs, settings, str(tiny_dir), tmp_path / "two", runner=Runner(devices=("cpu", "cpu")),
                    on_submit=kill_first)
    assert "2 worker process" in two.runner and (two.ok, two.failed) == (4, 0)
    one_rows = {r["key"]: r["answer"] for r in read_rows(tmp_path / "one" / "answers.jsonl")[0]}
    two_rows = {r["key"]: r for r in read_rows(tmp_path / "two" / "answers.jsonl")[0]}
    assert one_rows == {k: r["answer"] for k, r in two_rows.items()} and len(one_rows) == 4
    assert two_rows[killed[0]]["attempts"] == 2


def test_cli_errors_are_one_line(tmp_path: Path, corpus: dict[str, Path]) -> None:
    result = runner.invoke(app, ["batch", "--docs", str(corpus["notes"]), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--docs needs --questions" in result.stderr
    result = runner.invoke(app, ["batch", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "give a jobs file" in result.stderr
    result = runner.invoke(app, ["batch", str(tmp_path / "none.jsonl"), "--questions", str(tmp_path / "q.txt"),
                                 "--out", str(tmp_path / "o")])  # (--questions was ignored beside a jobs file)
    assert result.exit_code == 2 and "--questions goes with --docs" in result.stderr
    result = runner.invoke(app, ["batch", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "--out" in result.stderr
    result = runner.invoke(app, ["batch", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o"), "--workers",
                                 "2", "--devices", "cuda:0"])
    assert result.exit_code == 2 and "not both" in result.stderr
    result = runner.invoke(app, ["batch", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o"), "--devices",
                                 "cpu,gpu0"])
    assert result.exit_code == 2 and "unknown device 'gpu0'" in result.stderr
    for empty in ("", " , "):  # ('' ran in this process without a word)
        result = runner.invoke(app, ["batch", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o"),
                                     "--devices", empty])
        assert result.exit_code == 2 and "--devices is empty" in result.stderr


def test_ray_missing_names_the_extra(tmp_path: Path, corpus: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    jobs = _jobs_file(tmp_path / "jobs.jsonl", [corpus["notes"]], ["Q?"])
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(tmp_path / "o"), "--ray", "auto"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: Ray is not installed: pip install 'maskkv[ray]'"


def test_bench_quality_sharded_over_worker_processes_gives_the_same_rows(tmp_path: Path, tiny_dir: Path) -> None:
    args = ["bench", "quality", "--tasks", "niah_single", "--lengths", "128", "-n", "2", "--policies",
            "full,maskkv", "--budgets", "8,16", "--model", str(tiny_dir), "--json"]
    one = runner.invoke(app, [*args, "--out", str(tmp_path / "one")])
    two = runner.invoke(app, [*args, "--out", str(tmp_path / "two"), "--workers", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)

    def rows(result: object) -> list[dict[str, object]]:
        timing = ("seconds", "seconds_per_sample", "prefill_s")
        return [{k: v for k, v in r.items() if k not in timing} for r in json.loads(result.stdout)["results"]]

    assert rows(two) == rows(one) and len(rows(one)) == 3
    assert (tmp_path / "two" / "predictions.jsonl").read_text() == (tmp_path / "one" / "predictions.jsonl").read_text()
    again = runner.invoke(app, [*args, "--out", str(tmp_path / "two"), "--workers", "2"])
    assert again.exit_code == 0 and rows(again) == rows(one)  # every row reused: no worker is started


def test_a_job_that_fails_while_answering_is_a_row_and_the_run_goes_on(
        tmp_path: Path, corpus: dict[str, Path], tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from maskkv_cli.app.session import Session

    class OutOfMemoryError(RuntimeError):  # the name torch.cuda.OutOfMemoryError has
        pass

    real = Session.answer_ids

    def answer_ids(self: Session, ids: list[int], gen: object, cache: object, on_event: object = None,
                   **more: object) -> object:
        if "Who?" in self.tokenizer.decode(ids):
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")
        return real(self, ids, gen, cache, **more)  # type: ignore[arg-type]

    monkeypatch.setattr(Session, "answer_ids", answer_ids)
    specs = [JobSpec("long", str(corpus["story"]), "Who?"), JobSpec("short", str(corpus["notes"]), "What?")]
    settings = AnswerSettings(policy="maskkv", budget=8, gen_length=8, steps=8, block_length=8)
    result = run_batch(specs, settings, str(tiny_dir), tmp_path / "out")
    assert (result.ok, result.failed) == (1, 1)
    rows = {r["id"]: r for r in read_rows(tmp_path / "out" / "answers.jsonl")[0]}
    assert rows["long"]["error"].startswith("the device ran out of memory") and rows["long"]["answer"] is None
    assert rows["short"]["error"] is None and rows["short"]["answer"] is not None


def test_a_failed_jobs_memory_is_freed_before_the_next_job(monkeypatch: pytest.MonkeyPatch,
                                                            no_cycle_collector: None) -> None:
    """A generation keeps its error (``driver.Generation.error``) and the error's traceback keeps the generation's
    frames: a cycle. The worker collects it as the job's row is made, so an out-of-memory job's tensors do not wait
    for the collector's next full run while the next jobs need the memory."""
    import weakref

    import torch

    from maskkv_cli.batch import worker as worker_module

    held: list[weakref.ref[torch.Tensor]] = []

    class Generation:
        error: BaseException | None = None

    def answer_job(session: object, text: object, question: str, settings: AnswerSettings) -> dict[str, Any]:
        gen = Generation()
        gen.cache = torch.zeros(16)  # type: ignore[attr-defined]
        held.append(weakref.ref(gen.cache))  # type: ignore[attr-defined]
        try:
            raise RuntimeError("CUDA out of memory")
        except RuntimeError as exc:
            gen.error = exc
        raise gen.error

    monkeypatch.setattr(worker_module, "answer_job", answer_job)
    worker = worker_module.Worker.__new__(worker_module.Worker)  # no model: the job fails before it needs one
    worker.session, worker.name = None, "test"  # type: ignore[assignment]
    row = worker.run({"key": "k", "question": "Who?", "settings": {"policy": "maskkv"}}, "text")
    assert row["error"] == "RuntimeError: CUDA out of memory" and row["answer"] is None
    assert held and held[0]() is None


def test_batch_sizes_give_the_same_rows_and_a_failing_group_runs_job_by_job(
        tmp_path: Path, corpus: dict[str, Path], tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs answered in groups (--batch-size 3 and auto) give the rows of one job at a time; a group whose batched
    run fails is run again job by job, so only the job that fails is a failed row."""
    import maskkv_cli.batch.worker as worker_module
    import maskkv_cli.sampling.driver as driver

    specs = [JobSpec(f"j{i}", str(doc), q) for i, (doc, q) in
             enumerate((d, q) for d in (corpus["story"], corpus["notes"]) for q in [*QUESTIONS, "Where?"])]
    settings = AnswerSettings(policy="maskkv", budget=16, gen_length=8, steps=8, block_length=8)
    lanes: list[int] = []
    real_many = driver.step_logits
    monkeypatch.setattr(driver, "step_logits", lambda model, given: lanes.append(len(given)) or real_many(model, given))
    fields = ("answer", "claim", "confidence", "read", "source", "prompt_tokens", "stats")

    def rows(folder: str, size: int | None) -> dict[str, tuple[Any, ...]]:
        result = run_batch(specs, settings, str(tiny_dir), tmp_path / folder, runner=Runner(batch_size=size))
        assert (result.ok, result.failed) == (6, 0)
        got = read_rows(tmp_path / folder / "answers.jsonl")[0]
        for r in got:
            r["stats"] = {k: v for k, v in r["stats"].items() if not k.endswith("_s") and "mem" not in k}
        return {r["key"]: tuple(r[f] for f in fields) for r in got}

    alone = rows("one", 1)
    assert set(lanes) == {1}
    assert rows("three", 3) == alone and max(lanes) == 3
    lanes.clear()
    # the story's prompts are longer than the rows joined, so auto would run them one at a time
    # (tests/test_batch_work.py); here it batches by memory alone
    monkeypatch.setattr("maskkv_cli.engine.batch_work.MIN_SHARED", 0.0)
    assert rows("auto", None) == alone and max(lanes) > 3

    real_answer_jobs = worker_module.answer_jobs

    def failing(session: Any, texts: Any, messages: list[dict[str, Any]], size: Any) -> Any:
        if any(m["question"] == "Where?" for m in messages):
            raise RuntimeError("a batched run failed")
        return real_answer_jobs(session, texts, messages, size)

    monkeypatch.setattr(worker_module, "answer_jobs", failing)
    result = run_batch(specs, settings, str(tiny_dir), tmp_path / "retry", runner=Runner(batch_size=3))
    assert (result.ok, result.failed) == (6, 0)  # each job of the failed groups answered alone
    retried = read_rows(tmp_path / "retry" / "answers.jsonl")[0]
    assert {r["batch_size"] for r in retried} == {1}


def test_cli_batch_size_option(tmp_path: Path, corpus: dict[str, Path], tiny_dir: Path) -> None:
    jobs = _jobs_file(tmp_path / "jobs.jsonl", [corpus["notes"], corpus["story"]], QUESTIONS)
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(out), "--model", str(tiny_dir), "--budget", "16",
                                 "--json", "--batch-size", "2", *FAST])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["batch_sizes"] == [2]
    assert {r["batch_size"] for r in read_rows(out / "answers.jsonl")[0]} == {2}
    bad = runner.invoke(app, ["batch", str(jobs), "--out", str(tmp_path / "bad"), "--model", str(tiny_dir),
                              "--batch-size", "many"])
    assert bad.exit_code != 0 and "--batch-size must be a positive number or auto" in bad.output
    assert "Traceback" not in bad.output


def test_rows_are_written_at_once_and_synced_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row is in the file when ``append`` returns (a killed driver keeps it); the disk syncs come once for the
    rows of an interval and at close, not once a row."""
    import maskkv_cli.batch.folder as folder

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(folder.os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    monkeypatch.setattr(folder, "SYNC_INTERVAL_S", 0.2)
    answers = AnswersFolder(tmp_path).open([])
    for i in range(50):
        answers.append({"key": f"k{i}", "answer": str(i)})
        assert len(read_rows(tmp_path / "answers.jsonl")[0]) == i + 1
    assert len(synced) <= 1  # fifty rows well within one interval
    deadline = time.monotonic() + 5
    while not synced and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(synced) == 1  # the timer synced them
    answers.append({"key": "last", "answer": "x"})
    answers.close()
    assert len(synced) == 2  # close syncs what the timer has not
    time.sleep(0.3)
    assert len(synced) == 2  # and no timer fires after it


def test_a_worker_retries_the_jobs_of_a_failed_group_alone_with_their_own_text(
        tmp_path: Path, corpus: dict[str, Path], tiny_dir: Path) -> None:
    """A group of jobs on one document where one job cannot run (its question leaves no room for the answer): the
    group is retried job by job on the worker process, each job sent its own document text (a group's texts are a
    dict by hash; a job on the same document once took that dict for its text and every job failed)."""
    long_question = "Which " + "very " * 3000 + "long question?"
    specs = [JobSpec(f"j{i}", str(corpus["notes"]), q) for i, q in
             enumerate(["What is the special magic number for apple?", long_question, "Who?", "Where?"])]
    settings = AnswerSettings(policy="maskkv", budget=16, gen_length=8, steps=8, block_length=8)
    result = run_batch(specs, settings, str(tiny_dir), tmp_path / "out",
                       runner=Runner(devices=("cpu",), batch_size=None))
    rows = {r["id"]: r for r in read_rows(tmp_path / "out" / "answers.jsonl")[0]}
    assert (result.ok, result.failed) == (3, 1)
    assert "no room" in rows["j1"]["error"] and all(rows[j]["error"] is None for j in ("j0", "j2", "j3"))


def test_a_document_store_that_cannot_be_written_does_not_fail_the_jobs(
        tmp_path: Path, corpus: dict[str, Path], tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """batch only reads its documents: a read-only or full store (a cluster's home) leaves each document read, as
    ask does; only ``maskkv ingest``, whose point is storing, fails then."""
    from maskkv_cli.documents.store import DocumentStore

    def read_only(self: DocumentStore, doc: Any) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(DocumentStore, "put", read_only)
    specs = [JobSpec("j0", str(corpus["notes"]), "What is the special magic number for apple?")]
    settings = AnswerSettings(policy="maskkv", budget=16, gen_length=8, steps=8, block_length=8)
    result = run_batch(specs, settings, str(tiny_dir), tmp_path / "out")
    assert (result.ok, result.failed) == (1, 0)
    ingest = runner.invoke(app, ["ingest", str(corpus["notes"])])
    assert ingest.exit_code != 0 and "Could not save notes.txt to the document store" in ingest.output


def test_jobs_files_keep_line_breaks_inside_a_question(tmp_path: Path, corpus: dict[str, Path]) -> None:
    """A quoted CSV field may hold a line break, and a JSON string a U+2028 (as json.dumps(ensure_ascii=False)
    writes it): both stay inside their question (the CSV's was joined without it, the JSONL line was cut)."""
    (tmp_path / "jobs.csv").write_text('document,question\nnotes.txt,"What is the number\nfor apple?"\n'
                                       'notes.txt,Where?\n')
    specs = read_jobs_file(tmp_path / "jobs.csv")
    assert [(s.id, s.question) for s in specs] == [("1", "What is the number\nfor apple?"), ("2", "Where?")]
    row = {"document": "notes.txt", "question": "Which\u2028line?"}
    (tmp_path / "jobs.jsonl").write_text(json.dumps(row, ensure_ascii=False) + "\n", encoding="utf-8")
    (spec,) = read_jobs_file(tmp_path / "jobs.jsonl")
    assert spec.question == "Which\u2028line?"


def test_a_rerun_shows_reused_answers_under_this_runs_ids(tmp_path: Path, corpus: dict[str, Path],
                                                          tiny_dir: Path) -> None:
    """A question put first in the questions file shifts the others' ids (``#q2`` -> ``#q3``): their answers are
    reused (same document, question and settings) and summary.md lists them under the new ids, each id once;
    answers.jsonl names them by the new ids too (its rows kept the ids of the run that answered them)."""
    settings = AnswerSettings(policy="maskkv", budget=16, gen_length=8, steps=8, block_length=8)
    first = ["What is the special magic number for apple?", "Where?"]
    run_batch(cross_product([str(corpus["notes"])], first), settings, str(tiny_dir), tmp_path / "out")
    again = run_batch(cross_product([str(corpus["notes"])], ["Who?", *first]), settings, str(tiny_dir),
                      tmp_path / "out")
    assert again.reused == 2
    summary = (tmp_path / "out" / "summary.md").read_text()
    for n in (1, 2, 3):
        assert summary.count(f"notes.txt#q{n}") == 1, summary
    rows = [json.loads(line) for line in (tmp_path / "out" / "answers.jsonl").read_text().splitlines()]
    by_question = {row["question"]: row["id"] for row in rows}
    assert by_question == {"Who?": "notes.txt#q1", first[0]: "notes.txt#q2", first[1]: "notes.txt#q3"}
    assert len(rows) == 3


def test_questions_and_jobs_files_in_latin_1_are_read_as_documents_are(tmp_path: Path) -> None:
    """A Latin-1 questions or jobs file was refused ("'utf-8' codec can't decode byte 0xe9"), where a Latin-1
    document is read with a note; now read the same way, with the same note."""
    (tmp_path / "q.txt").write_bytes("Où est la rivière?\n".encode("latin-1"))
    (tmp_path / "jobs.csv").write_bytes("document,question\nd.txt,Où?\n".encode("latin-1"))
    told: list[str] = []
    assert read_questions(tmp_path / "q.txt", told.append) == ["Où est la rivière?"]
    (spec,) = read_jobs_file(tmp_path / "jobs.csv", told.append)
    assert spec.question == "Où?"
    assert len(told) == 2 and all("is not UTF-8; it was read as Windows-1252" in m for m in told)
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01\x02binary")
    with pytest.raises(UsageError, match="cannot read the questions file .*looks binary"):
        read_questions(tmp_path / "bin.txt")


def test_docs_names_an_existing_file_with_glob_characters_as_itself(tmp_path: Path) -> None:
    """``--docs 'report[1].txt'`` is that file (it was read as a glob: no match, or report1.txt instead)."""
    (tmp_path / "report[1].txt").write_text("The number for apple is 48213.\n")
    (tmp_path / "report1.txt").write_text("Another document.\n")
    (spec,) = cross_product([str(tmp_path / "report[1].txt")], ["Which number?"])
    assert Path(spec.document).name == "report[1].txt"
    assert [Path(s.document).name for s in cross_product([str(tmp_path / "report?.txt")], ["Q?"])] == ["report1.txt"]


def test_documents_of_one_name_in_two_folders_get_ids_of_their_own(tmp_path: Path) -> None:
    """Two report.txt in different folders: their jobs' ids name each one's folder (both were report.txt#q1);
    documents of distinct names keep their bare names."""
    for folder in ("sub", "with space"):
        (tmp_path / "docs" / folder).mkdir(parents=True)
        (tmp_path / "docs" / folder / "report.txt").write_text(f"The {folder} report.\n")
    (tmp_path / "docs" / "notes.txt").write_text("Notes.\n")
    ids = sorted(s.id for s in cross_product([str(tmp_path / "docs")], ["Q?"]))
    assert ids == ["notes.txt#q1", "sub/report.txt#q1", "with space/report.txt#q1"]


def test_results_files_are_readable_as_open_makes_them(tmp_path: Path, corpus: dict[str, Path],
                                                       tiny_dir: Path) -> None:
    """A results folder is for reading and sharing: its files get the permissions ``open()`` gives (0o666 less
    the umask), not the 0o600 of the temporary files they are written through (the document store keeps 0o600)."""
    from maskkv_cli.runtime.fileio import open_file_mode

    settings = AnswerSettings(policy="maskkv", budget=16, gen_length=8, steps=8, block_length=8)
    run_batch([JobSpec("j0", str(corpus["notes"]), "Where?")], settings, str(tiny_dir), tmp_path / "out")
    for name in ("config.json", "summary.md", "answers.jsonl"):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == open_file_mode() & 0o666, name


def test_duplicate_jobs_are_named_with_the_job_answered_for_them(tmp_path: Path, corpus: dict[str, Path],
                                                                 tiny_dir: Path) -> None:
    """Two files of the same bytes: the copy's jobs were run once, under the first file's ids, and summary.md said
    only "1 duplicate job(s) in the input were run once", no id a user could look up."""
    copy = tmp_path / "notes-copy.txt"
    copy.write_bytes(corpus["notes"].read_bytes())
    jobs = _jobs_file(tmp_path / "jobs.jsonl", [corpus["notes"], copy], QUESTIONS[:1])
    out = tmp_path / "out"
    result = runner.invoke(app, ["batch", str(jobs), "--out", str(out), "--model", str(tiny_dir), "--json", *FAST])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["duplicates"] == 1 and summary["same_as"] == {"notes-copy-0": "notes-0"}
    assert "`notes-copy-0` (as `notes-0`)" in (out / "summary.md").read_text()


def test_a_ray_address_is_checked_and_an_unreachable_one_refused_at_once(tmp_path: Path) -> None:
    """--ray nonsense was a raw ValueError (exit 1) after the documents were read; --ray HOST:PORT with nothing
    there waited for ever (Ray's client retries without end)."""
    import socket
    import time

    from maskkv_cli.batch.ray_pool import connect, ray_address

    assert ray_address("auto") is None and ray_address("10.0.0.2:6379") == ("10.0.0.2", 6379)
    assert ray_address("ray://head:10001") == ("head", 10001)
    for bad in ("nonsense", "localhost", "host:port", "host:0"):
        with pytest.raises(UsageError, match="--ray takes auto, HOST:PORT"):
            ray_address(bad)
    result = runner.invoke(app, ["batch", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o"), "--ray",
                                 "nonsense"])
    assert result.exit_code == 2 and "--ray takes auto" in result.stderr
    pytest.importorskip("ray")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(UsageError, match=f"cannot reach the Ray cluster at 127.0.0.1:{port}"):
        connect(f"127.0.0.1:{port}")
    assert time.monotonic() - started < 30


def test_quiet_and_json_leave_ray_s_own_log_lines_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--quiet printed Ray's "Started a local Ray instance." and its token warning."""
    import logging

    ray = pytest.importorskip("ray")
    from maskkv_cli.batch import ray_pool

    levels: list[int] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: levels.append(options["logging_level"]))
    assert ray_pool.connect("auto", quiet=True) and ray_pool.connect("auto")
    assert levels == [logging.ERROR, logging.INFO]
    (tmp_path / "a.txt").write_text("The special magic number for apple is 4821.\n")
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"document": "a.txt", "question": "Q?"}\n')
    asked: list[bool] = []

    def connect(address: str, quiet: bool = False) -> bool:
        asked.append(quiet)
        raise UsageError("no cluster here")

    monkeypatch.setattr(ray_pool, "connect", connect)
    for extra, quiet in (([], False), (["--quiet"], True), (["--json"], True)):
        result = runner.invoke(app, ["batch", str(jobs), "--out", str(tmp_path / "o"), "--ray", "auto", *extra])
        assert result.exit_code == 2 and "no cluster here" in result.stderr
        assert asked.pop() is quiet


def test_a_job_s_own_gen_length_that_does_not_fit_names_the_job() -> None:
    """It said "--gen-length 10 must be a multiple of --block-length 8" for a jobs file's gen_length."""
    from maskkv_cli.batch.jobs import job_settings

    def generation(gen_length: int | None) -> tuple[int, int, int]:
        triple = resolve_generation({}, gen_length, None, 8)
        GenerationConfig(*triple)
        return triple

    base = AnswerSettings(policy="maskkv", gen_length=None, steps=None, block_length=8)
    assert job_settings(JobSpec("j0", "a.txt", "Q", gen_length=16), base, generation).gen_length == 16
    with pytest.raises(UsageError, match=r"^job 'j1': its gen_length 10 must be a multiple of --block-length 8$"):
        job_settings(JobSpec("j1", "a.txt", "Q", gen_length=10), base, generation)
    bad = replace(base, gen_length=10)
    with pytest.raises(UsageError, match=r"^--gen-length 10 must be a multiple"):  # the option's own: named so
        job_settings(JobSpec("j2", "a.txt", "Q"), bad, generation)


def test_the_batch_size_note_of_groups_of_several_sizes_says_it_is_the_first_group_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import maskkv_cli.batch.run as batch_run
    from maskkv_cli.batch.run import BatchResult

    (tmp_path / "a.txt").write_text("The special magic number for apple is 4821.\n")
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"document": "a.txt", "question": "Q?"}\n')
    line = "batch size auto: 4 (all 4 prompts at once; 64 would fit)"
    for sizes, shown in (([4], f"note: {line}"), ([2, 4], f"note: the first group: {line}")):
        done = BatchResult(tmp_path, 1, 1, 0, 0, 1, 0, 1.0, 60.0, answered=1, batch_sizes=sizes, batch_note=line)
        monkeypatch.setattr(batch_run, "run_batch", lambda *args, done=done, **kwargs: done)
        result = runner.invoke(app, ["batch", str(jobs), "--out", str(tmp_path / "o")])
        assert result.exit_code == 0, result.output
        assert shown in result.stderr
