"""``maskkv bench quality``: rows, LongBench files and their metrics, retention, reuse of finished rows."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from answering import replace_answers
from typer.testing import CliRunner

from maskkv_cli.app.session import Session
from maskkv_cli.bench.quality_plan import plan_cases
from maskkv_cli.bench.quality_report import add_retention, display_order, no_answer_markdown, summary_markdown
from maskkv_cli.cli import app

runner = CliRunner()
FAST = ["--gen-length", "8", "--steps", "8", "--block-length", "8"]
ROW_FIELDS = {"policy", "budget", "task", "length", "n", "accuracy", "retention", "budget_share",
              "mean_prompt_tokens", "seconds", "seconds_per_sample", "key", "metric"}


def bench(*args: str) -> Any:
    return runner.invoke(app, ["bench", "quality", *args])


def fixed_answer(text: str, calls: list[int] | None = None) -> Any:
    def answer_ids(self: Session, ids: list[int], gen: Any, cache: Any, on_event: Any = None) -> Any:
        if calls is not None:
            calls.append(len(ids))
        return SimpleNamespace(text=text, notes=[], result=None)

    return answer_ids


def test_json_rows_have_the_fields_and_counts(tiny_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "q"
    result = bench("--model", str(tiny_dir), "--tasks", "niah_single,niah_multikey", "--lengths", "48", "-n", "2",
                   "--policies", "full,snapkv", "--budgets", "8,16", "--out", str(out), "--json", *FAST)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert len(rows) == 2 * 3  # two tasks x (full + snapkv at two budgets)
    for row in rows:
        assert ROW_FIELDS <= row.keys()
        assert row["n"] == 2 and row["length"] == 48 and 0.0 <= row["accuracy"] <= 100.0
        assert row["metric"] == "exact_match"
        assert row["mean_prompt_tokens"] > 48
    assert {(r["task"], r["policy"], r["budget"]) for r in rows} == {
        (task, policy, budget) for task in ("niah_single", "niah_multikey")
        for policy, budget in (("full", None), ("snapkv", 8), ("snapkv", 16))}
    for row in rows:
        if row["policy"] == "full":
            assert row["budget"] is None and row["budget_share"] is None
            assert row["retention"] == (1.0 if row["accuracy"] > 0 else None)
        else:
            assert row["budget_share"] == pytest.approx(row["budget"] / row["mean_prompt_tokens"], abs=1e-4)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(
        ["config.json", "results.jsonl", "predictions.jsonl", "summary.md"]
        + (["quality.png"] if _has_matplotlib() else []))
    assert len((out / "results.jsonl").read_text().splitlines()) == 6
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(predictions) == 6 * 2
    assert {"id", "policy", "budget", "prediction", "gold", "score"} <= predictions[0].keys()
    for line in predictions:  # each answer's confidence, as ask shows it (none for an empty answer)
        conf = line.get("confidence")
        assert (conf is None) == (line["prediction"] == "")
        assert conf is None or 0 < conf["min"] <= conf["mean"] <= 1
    config = json.loads((out / "config.json").read_text())
    assert config["kind"] == "quality" and config["settings"]["samples"] == 2
    assert "| niah_single | 48 | snapkv | 8 | 2 |" in (out / "summary.md").read_text()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_longbench_file_is_scored_with_each_datasets_metric(tiny_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    records = [
        {"input": "Where is the tower?", "context": "The tower stands in Paris. " * 20, "answers": ["Paris France"],
         "length": 100, "dataset": "hotpotqa", "language": "en", "all_classes": None, "_id": "hq-1"},
        {"input": "What is the number?", "context": "The number is 4821. " * 20, "answers": ["4821"],
         "dataset": "my_private_task", "_id": "mine-1"},
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    replace_answers(monkeypatch, fixed_answer("Paris 4821"))
    out = tmp_path / "lb"
    result = bench("--model", str(tiny_dir), "--tasks", str(path), "--policies", "full,snapkv", "--budgets", "8",
                   "--out", str(out), "--json", *FAST)
    assert result.exit_code == 0, result.output
    rows = {(r["task"], r["policy"]): r for r in json.loads(result.stdout)["results"]}
    assert set(rows) == {("hotpotqa", "full"), ("hotpotqa", "snapkv"), ("my_private_task", "full"),
                         ("my_private_task", "snapkv")}
    # hotpotqa: QA F1 of "paris 4821" against "paris france" = 0.5; unknown dataset: exact match (4821 found).
    for policy in ("full", "snapkv"):
        assert rows[("hotpotqa", policy)]["accuracy"] == 50.0
        assert rows[("hotpotqa", policy)]["metric"] == "qa_f1"
        assert rows[("my_private_task", policy)]["accuracy"] == 100.0
        assert rows[("my_private_task", policy)]["metric"] == "exact_match"
        assert rows[("hotpotqa", policy)]["length"] is None and rows[("hotpotqa", policy)]["n"] == 1
    assert rows[("hotpotqa", "snapkv")]["retention"] == 1.0
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {(p["id"], p["score"]) for p in predictions} == {("hq-1", 0.5), ("mine-1", 1.0)}


def test_tasks_file_errors_are_one_line(tiny_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "q", "context": "c", "answers": ["a"]}\nnot json\n')
    result = bench("--model", str(tiny_dir), "--tasks", str(bad), "--out", str(tmp_path / "o"))
    assert result.exit_code == 2 and "line 2: invalid JSON" in result.stderr
    result = bench("--model", str(tiny_dir), "--tasks", "niah_single,needle_in_space")
    assert result.exit_code == 2 and "unknown task kind 'needle_in_space'" in result.stderr
    result = bench("--model", str(tiny_dir), "--policies", "full,bogus")
    assert result.exit_code == 2 and "unknown policy 'bogus'" in result.stderr


def test_retention_from_rows() -> None:
    def row(task: str, length: int | None, policy: str, budget: int | None, accuracy: float) -> dict[str, Any]:
        return {"task": task, "length": length, "policy": policy, "budget": budget, "n": 10, "accuracy": accuracy}

    rows = [
        row("niah_single", 256, "maskkv", 8, 40.0),
        row("niah_single", 256, "full", None, 80.0),
        row("niah_single", 512, "full", None, 0.0),
        row("niah_single", 512, "maskkv", 8, 10.0),
        row("niah_multikey", 256, "maskkv", 8, 30.0),  # no full row for this cell
        row("hotpotqa", None, "full", None, 50.0),
        row("hotpotqa", None, "snapkv", 16, 60.0),
    ]
    out = add_retention(rows)
    assert [r["retention"] for r in out] == [0.5, 1.0, None, None, None, 1.0, 1.2]
    assert "retention" not in rows[0]  # copies, the input is untouched
    ordered = display_order(out)
    assert [(r["task"], r["length"], r["policy"]) for r in ordered][:2] == [("niah_single", 256, "full"),
                                                                            ("niah_single", 256, "maskkv")]
    text = summary_markdown(out, {"model": "m", "generation": {}})
    assert "| niah_single | 256 | maskkv | 8 | 10 | 40.0 | - | 0.50 |" in text  # no scores, no interval


def test_summary_counts_false_no_answers_per_cell_and_in_all() -> None:
    def row(task: str, policy: str, budget: int | None, said: int | None) -> dict[str, Any]:
        return {"task": task, "length": 512, "policy": policy, "budget": budget, "n": 20, "accuracy": 50.0,
                "no_answers": said}

    rows = [row("niah_single", "full", None, 1), row("niah_multikey", "full", None, 2),
            row("niah_multikey", "maskkv", 16, 0), row("niah_none", "full", None, 15)]
    text = summary_markdown(rows, {"model": "m", "generation": {}})
    assert "| niah_multikey | 512 | full | - | 20 | 2 |" in text
    assert "| niah_multikey | 512 | maskkv | 16 | 20 | 0 |" in text
    assert "niah_none | 512 | full | - | 20 | 15 |" not in text  # there "not in the document" is right
    assert "In all: full 3 of 40; maskkv@16 0 of 20." in text
    # without unanswerable tasks the section appears only when an answerable question got that answer
    assert no_answer_markdown([row("niah_single", "full", None, 0)]) == ""
    assert "| niah_single | 512 | full | - | 20 | 1 |" in no_answer_markdown([row("niah_single", "full", None, 1)])
    assert no_answer_markdown([row("hotpotqa", "full", None, None), row("niah_none", "full", None, 3)]) == ""


def test_plan_cases_budgets_only_for_evicting_policies() -> None:
    cases = plan_cases(["full", "maskkv", "none"], [8, 64])
    assert [(c.policy, c.budget) for c in cases] == [("full", None), ("maskkv", 8), ("maskkv", 64), ("none", None)]


def test_rerun_reuses_finished_rows(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    replace_answers(monkeypatch, fixed_answer("nothing", calls))
    out = tmp_path / "rerun"
    base = ["--model", str(tiny_dir), "--tasks", "niah_single", "--lengths", "40", "-n", "3",
            "--policies", "full,streamingllm", "--out", str(out), *FAST]
    first = bench(*base, "--budgets", "8")
    assert first.exit_code == 0, first.output
    assert len(calls) == 3 * 2
    # not a terminal and not --quiet: one line per (policy, budget) on stderr
    assert "[1/2] full: niah_single@40 0.0" in first.stderr and "[2/2] streamingllm B=8:" in first.stderr
    results = (out / "results.jsonl").read_text()

    second = bench(*base, "--budgets", "8", "--json")
    assert second.exit_code == 0, second.output
    assert len(calls) == 6  # nothing ran again
    assert [r["key"] for r in json.loads(second.stdout)["results"]] == [
        json.loads(line)["key"] for line in results.splitlines()]

    third = bench(*base, "--budgets", "8,16", "--json")
    assert third.exit_code == 0, third.output
    assert len(calls) == 6 + 3  # only streamingllm at budget 16 is new
    assert len(json.loads(third.stdout)["results"]) == 3
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 9

    fourth = bench(*base, "--budgets", "8", "--seed", "1", "--json")  # another seed: other tasks, new rows
    assert fourth.exit_code == 0, fourth.output
    assert len(calls) == 9 + 6


def test_row_keys_carry_the_policy_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from maskkv_cli.bench.quality import policy_rule, row_key
    from maskkv_cli.bench.quality_plan import Case
    from maskkv_cli.bench.quality_sources import TaskGroup, TaskSource
    from maskkv_cli.policies.maskkv import MaskKVResidual

    assert policy_rule("maskkv-residual") == {"residual_spread": 0.75}
    assert policy_rule("maskkv") == policy_rule("snapkv") == policy_rule("full") == {}
    assert policy_rule("maskkv-plus") == {"residual_spread": 0.75, "neighbours": [3, 0.5]}
    assert policy_rule("maskkv-pooled") == {"vote_pool": 3}
    assert policy_rule("pyramidkv") == {"window": "per run"}
    assert policy_rule("no-such-policy") == {}
    group = TaskGroup(task="niah_single", length=40, tasks=[], prompts=[])
    kwargs = {"seed": 0, "model_id": "m", "dtype": "float32", "gen": {}, "source": TaskSource("corpus", "", "")}
    before = row_key(group, Case("maskkv-residual", 8), **kwargs)
    other = row_key(group, Case("maskkv", 8), **kwargs)
    monkeypatch.setattr(MaskKVResidual, "residual_default", 0.3)  # a changed rule: stored rows are not reused
    assert row_key(group, Case("maskkv-residual", 8), **kwargs) != before
    assert row_key(group, Case("maskkv", 8), **kwargs) == other


def test_haystack_document(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text("\n\n".join(f"Paragraph {i} says the harbor opens at dawn and the boats leave at noon."
                               for i in range(12)))
    seen: list[int] = []
    replace_answers(monkeypatch, fixed_answer("", seen))
    out = tmp_path / "hay"
    result = bench("--model", str(tiny_dir), "--tasks", "niah_single", "--lengths", "60", "-n", "2",
                   "--policies", "full", "--haystack", str(doc), "--out", str(out), "--json", *FAST)
    assert result.exit_code == 0, result.output
    assert len(seen) == 2
    config = json.loads((out / "config.json").read_text())
    assert config["settings"]["source"]["kind"] == "haystack"
    assert config["settings"]["source"]["name"] == "notes.txt"


def test_exported_tasks_give_the_same_cells_as_generating_them(tiny_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "needles.jsonl"
    result = runner.invoke(app, ["bench", "tasks", str(path), "--model", str(tiny_dir), "--lengths", "40,64",
                                 "-n", "2"])
    assert result.exit_code == 0, result.output
    assert "wrote 8 tasks" in result.stderr and len(path.read_text().splitlines()) == 8
    again = runner.invoke(app, ["bench", "tasks", str(path), "--model", str(tiny_dir)])
    assert again.exit_code == 2 and "--force" in again.stderr and len(path.read_text().splitlines()) == 8

    def cells(*args: str) -> dict[tuple[str, int], tuple[float, float, int]]:
        run = bench("--model", str(tiny_dir), "-n", "2", "--policies", "full", "--json", "--out",
                    str(tmp_path / ("q-file" if "--tasks" in args else "q-gen")), *FAST, *args)
        assert run.exit_code == 0, run.output
        return {(r["task"], r["length"]): (r["accuracy"], r["mean_prompt_tokens"], r["n"])
                for r in json.loads(run.stdout)["results"]}

    generated = cells("--lengths", "40,64")
    assert cells("--tasks", str(path)) == generated and len(generated) == 4


def test_model_fingerprint_ignores_notes_but_not_weights_or_config(tiny_dir: Path, tmp_path: Path) -> None:
    import shutil

    from maskkv_cli.models.fingerprint import model_fingerprint

    copy = tmp_path / "model"
    shutil.copytree(tiny_dir, copy)
    base = model_fingerprint(copy)
    assert model_fingerprint(tiny_dir) == base  # where the folder lives does not matter
    (copy / "training.json").write_text('{"note": "edited"}')
    (copy / "README.md").write_text("# notes\n")
    assert model_fingerprint(copy) == base
    config = copy / "config.json"
    data = json.loads(config.read_text())
    data["rope_theta"] = float(data["rope_theta"]) * 2
    config.write_text(json.dumps(data))
    assert model_fingerprint(copy) != base


def _distractor_answerer(self: Session, ids: list[int], gen: Any, cache: Any, on_event: Any = None) -> Any:
    """Answers with the number of a needle whose key is not the one asked about (the wrong key matched)."""
    import re

    text = self.tokenizer.decode(ids)
    asked = re.findall(r"What is the special magic number for (\w+)\?", text)[-1]
    others = [value for key, value in re.findall(r"The special magic number for (\w+) is (\d+)\.", text)
                if key != asked]
    return SimpleNamespace(text=others[0] if others else "0", notes=[], result=None)


def test_wrong_answers_that_are_another_needles_number_are_counted(tiny_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from maskkv_cli.tasks.metrics import distractor_values
    from maskkv_cli.tasks.synthetic import generate_tasks

    task = generate_tasks("niah_multikey", 1, 120, seed=3, distractors=4)[0]
    assert len(distractor_values(task)) == 4 and task.answers[0] not in distractor_values(task)
    assert distractor_values(generate_tasks("niah_single", 1, 120, seed=3)[0]) == set()

    replace_answers(monkeypatch, _distractor_answerer)
    out = tmp_path / "q"
    result = bench("--model", str(tiny_dir), "--tasks", "niah_single,niah_multikey", "--lengths", "64", "-n", "3",
                   "--policies", "full", "--out", str(out), "--json", *FAST)
    assert result.exit_code == 0, result.output
    rows = {row["task"]: row for row in json.loads(result.stdout)["results"]}
    assert rows["niah_multikey"]["distractor_answers"] == 3 and rows["niah_multikey"]["accuracy"] == 0.0
    assert rows["niah_single"]["distractor_answers"] is None
    multikey = rows["niah_multikey"]
    assert multikey["wrong_digits"] > 0 and multikey["distractor_digits"] == multikey["wrong_digits"]
    assert rows["niah_single"]["wrong_digits"] is None
    lines = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert all(line["distractor"] for line in lines if line["task"] == "niah_multikey")
    assert not any("distractor" in line for line in lines if line["task"] == "niah_single")
    summary = (out / "summary.md").read_text()
    assert "| niah_multikey | 64 | full | - | 3 | 3 | 0 |" in summary
    assert "| niah_single | 64 |" not in summary.split("## Wrong answers")[1]


def test_digit_mixing_counts_places_taken_from_a_distractor() -> None:
    from maskkv_cli.tasks.metrics import digit_mixing

    assert digit_mixing("5695", "3695", ["5123", "9"]) == (1, 1)
    assert digit_mixing(" 12", "34", ["1"]) == (2, 1)  # the second place: no distractor has a 2 there
    assert digit_mixing("4786", "4786815", ["4786815"]) == (0, 0)  # cut short: no place differs
    assert digit_mixing("3310", "3310", ["3310"]) == (0, 0)


def test_summary_of_a_tasks_file_shows_its_lengths_its_counts_and_its_haystack() -> None:
    """A LongBench file's rows showed "| hotpotqa | None | full |" in the no-answer table, the header "samples per
    cell: 50" where each dataset had one record, and a haystack run named no haystack file."""
    rows = [{"task": "hotpotqa", "length": None, "policy": "full", "budget": None, "n": 1, "accuracy": 0.0,
             "no_answers": 1}]
    text = summary_markdown(rows, {"model": "m", "generation": {}, "samples": 50, "source": {"kind": "file",
                                                                                              "name": "lb.jsonl"}})
    assert "| hotpotqa | - | full | - | 1 | 1 |" in text and "| None |" not in text
    assert "- tasks: file lb.jsonl" in text and "samples per cell: up to 50 (a cell's n is how many it had)" in text
    full = [dict(rows[0], n=50)]
    assert "samples per cell: 50;" in summary_markdown(full, {"model": "m", "generation": {}, "samples": 50,
                                                              "source": {"kind": "corpus", "name": ""}})


def test_a_haystack_it_cannot_read_is_named_with_what_it_takes(tmp_path: Path) -> None:
    """An encrypted PDF said "pass its password with --password" (bench has no such option); a name that is neither
    a file nor a named source said "File not found" without the sources."""
    from pdfs import make_pdf

    from maskkv_cli.bench.quality_sources import read_haystack
    from maskkv_cli.errors import UsageError

    locked = tmp_path / "locked.pdf"
    locked.write_bytes(make_pdf([["The harbor opens at dawn."]], password="pw"))
    with pytest.raises(UsageError, match=r"--haystack .*locked.pdf is password-protected: bench takes no password"):
        read_haystack(locked)
    with pytest.raises(UsageError, match=r"--haystack bogus-source: no such file, nor a named source \(corpus, "):
        read_haystack("bogus-source")
