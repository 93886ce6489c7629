"""Intervals and task-by-task comparisons of ``bench quality`` (``bench/paired.py``), alone and in a run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from answering import replace_answers
from typer.testing import CliRunner

from maskkv_cli.app.session import Session
from maskkv_cli.bench.paired import (
    add_intervals,
    paired_comparisons,
    paired_markdown,
    score_interval,
    sign_test,
    wilson_interval,
)
from maskkv_cli.cli import app


def test_wilson_interval_known_values() -> None:
    assert wilson_interval(26, 40) == (49.5, 77.9)  # 65% of 40 (textbook Wilson values)
    assert wilson_interval(40, 40) == (91.2, 100.0)  # all right: still not certain
    assert wilson_interval(0, 40) == (0.0, 8.8)
    assert wilson_interval(0, 0) == (0.0, 100.0)


def test_score_interval_uses_wilson_for_exact_match_and_the_normal_one_otherwise() -> None:
    assert score_interval([1.0] * 26 + [0.0] * 14) == wilson_interval(26, 40)
    low, high = score_interval([0.5, 0.7, 0.6, 0.4])
    assert low < 55.0 < high and (low, high) == pytest.approx((40.0, 70.0), abs=3.0)
    assert score_interval([0.3]) == (30.0, 30.0)
    assert score_interval([]) == (0.0, 100.0)


def test_sign_test_exact_values() -> None:
    assert sign_test(0, 0) == 1.0
    assert sign_test(3, 2) == 1.0
    assert sign_test(5, 0) == pytest.approx(2 / 32)
    assert sign_test(0, 6) == pytest.approx(2 / 64)
    assert sign_test(9, 1) == pytest.approx(2 * 11 / 1024)


def test_paired_comparisons_match_tasks_within_a_cell() -> None:
    rows = [
        {"key": "m8", "task": "t", "length": 256, "policy": "maskkv", "budget": 8, "accuracy": 75.0},
        {"key": "s8", "task": "t", "length": 256, "policy": "snapkv", "budget": 8, "accuracy": 50.0},
        {"key": "s16", "task": "t", "length": 256, "policy": "snapkv", "budget": 16, "accuracy": 100.0},
        {"key": "f", "task": "t", "length": 256, "policy": "full", "budget": None, "accuracy": 100.0},
    ]
    scores = {"m8": {"0": 1.0, "1": 1.0, "2": 0.0, "3": 1.0}, "s8": {"0": 0.0, "1": 1.0, "2": 1.0, "3": 0.0},
              "s16": {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}, "f": {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}}
    [one] = paired_comparisons(rows, scores)  # budget 16 has no maskkv row; full has no budget
    assert (one["policy"], one["budget"], one["wins"], one["losses"], one["ties"], one["n"]) == ("snapkv", 8, 2, 1,
                                                                                                   1, 4)
    assert one["p"] == 1.0
    assert "| t | 256 | 8 | snapkv | 75.0 | 50.0 | 2 | 1 | 1 |" in paired_markdown([one])  # p = 1
    assert paired_markdown([]) == ""
    with_ci = add_intervals(rows, scores | {"f": {}})
    assert with_ci[0]["ci95"] == list(wilson_interval(3, 4)) and with_ci[3]["ci95"] is None
    assert "ci95" not in rows[0]


def oracle_for(policy: str) -> Any:
    """Answers every needle task right for ``policy`` (read from the prompt) and wrong for the others."""

    def answer_ids(self: Session, ids: list[int], gen: Any, cache: Any, on_event: Any = None) -> Any:
        text = self.tokenizer.decode(ids)
        key = re.findall(r"magic number for (\w+)\?", text)[-1]
        number = re.search(rf"number for {key} is (\d+)", text)
        right = number.group(1) if number else ""
        return SimpleNamespace(text=right if cache.policy == policy else "0", notes=[], result=None)

    return answer_ids


def test_run_reports_intervals_and_the_paired_comparison(tiny_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    replace_answers(monkeypatch, oracle_for("maskkv"))
    out = tmp_path / "q"
    args = ["bench", "quality", "--model", str(tiny_dir), "--tasks", "niah_multikey", "--lengths", "60", "-n", "6",
            "--policies", "full,maskkv,snapkv", "--budgets", "8", "--out", str(out), "--gen-length", "8",
            "--steps", "8", "--block-length", "8"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    accuracy = {r["policy"]: r["accuracy"] for r in data["results"]}
    assert accuracy == {"full": 0.0, "maskkv": 100.0, "snapkv": 0.0}
    ci = {r["policy"]: r["ci95"] for r in data["results"]}
    assert ci["maskkv"] == list(wilson_interval(6, 6)) and ci["snapkv"] == list(wilson_interval(0, 6))
    [pair] = data["paired"]
    assert (pair["policy"], pair["wins"], pair["losses"], pair["p"]) == ("snapkv", 6, 0, 0.03125)
    summary = (out / "summary.md").read_text()
    assert "## maskkv against each policy, task by task" in summary
    assert "| niah_multikey | 60 | 8 | snapkv | 100.0 | 0.0 | 6 | 0 | 0.031 |" in summary
    # the table run (rows reused) ends with the one-line verdict
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert "ahead in 1, behind in 0 of 1 comparisons" in again.stderr


def test_the_papers_maskkv_is_the_reference_of_the_paired_comparison(tiny_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from maskkv_cli.bench.quality_plan import DEFAULT_POLICIES
    from maskkv_cli.defaults import DEFAULT_POLICY

    assert DEFAULT_POLICY == "maskkv" and DEFAULT_POLICIES[:3] == ("full", "maskkv", "maskkv-plus")
    replace_answers(monkeypatch, oracle_for("maskkv-plus"))
    args = ["bench", "quality", "--model", str(tiny_dir), "--tasks", "niah_multikey", "--lengths", "60", "-n", "4",
            "--policies", "full,maskkv-plus,maskkv", "--budgets", "8", "--out", str(tmp_path / "q"),
            "--gen-length", "8", "--steps", "8", "--block-length", "8", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    [pair] = json.loads(result.stdout)["paired"]
    assert (pair["reference"], pair["policy"], pair["wins"], pair["losses"]) == ("maskkv", "maskkv-plus", 0, 4)
