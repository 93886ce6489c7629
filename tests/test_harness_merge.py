"""Merging the harness's results files of several (policy, budget) runs into one table (no harness needed)."""

from __future__ import annotations

import json
from pathlib import Path

from maskkv_cli.evaluation.merge import collect, main, markdown


def _write(path: Path, model_args: object, scores: dict[str, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    results = {task: {"alias": task, "score,none": value, "score_stderr,none": 0.01} for task, value in scores.items()}
    path.write_text(json.dumps({"config": {"model": "maskkv", "model_args": model_args}, "results": results}))


def test_columns_per_policy_and_budget_rows_per_task(tmp_path: Path, capsys) -> None:
    _write(tmp_path / "full" / "m" / "results_2026-01-01T00-00-00.json", {"model": "m", "policy": "full"},
           {"longbench_hotpotqa": 0.5, "longbench_trec": 0.25})
    _write(tmp_path / "mk" / "m" / "results_2026-01-01T01-00-00.json", "model=m,policy=maskkv,budget=256",
           {"longbench_hotpotqa": 0.4, "longbench_trec": 0.2})
    _write(tmp_path / "mk" / "m" / "results_2026-01-02T00-00-00.json", "model=m,policy=maskkv,budget=256",
           {"longbench_hotpotqa": 0.45})  # a later run of the same column replaces the earlier score
    _write(tmp_path / "sk" / "m" / "results_2026-01-01T02-00-00.json", {"policy": "snapkv", "budget": 16},
           {"longbench_hotpotqa": 0.1})
    table = collect(tmp_path)
    assert table == {"longbench_hotpotqa": {"full": 50.0, "maskkv@256": 45.0, "snapkv@16": 10.0},
                     "longbench_trec": {"full": 25.0, "maskkv@256": 20.0}}
    text = markdown(table)
    assert "| longbench_trec | 25.00 | 20.00 | - |" in text
    assert "| average (1 tasks) | 50.00 | 45.00 | 10.00 |" in text
    main([str(tmp_path)])
    assert capsys.readouterr().out == text
