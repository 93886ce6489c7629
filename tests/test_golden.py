"""The tiny models' outputs equal the recorded golden ones (tests/golden_cases.py says what is pinned)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden_cases import BUDGETS, GOLDEN_DIR, build_models, cli_cases, token_cases
from golden_diff import moved_paths

from maskkv_cli.policies.base import policy_names


def load(name: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return build_models(tmp_path_factory.mktemp("golden"))


def test_every_registered_policy_is_pinned() -> None:
    """A policy added to the registry fails here until its golden tokens are recorded (``record.py``)."""
    pinned = list(dict.fromkeys(key.split("/")[1] for key in load("tokens")))
    assert sorted(pinned) == sorted(policy_names())


def test_tokens_equal_the_golden_ones(models: dict) -> None:
    golden = load("tokens")
    now = token_cases(models, policy_names())
    moved = moved_paths(golden, now)
    assert not moved, f"{len(moved)} token cases moved, e.g. {moved[:5]}"


def test_every_family_is_pinned() -> None:
    """The golden tokens cover all four families (and LLaDA2 in bf16)."""
    families = {key.split("/")[0] for key in load("tokens")}
    assert families == {"llada", "dream", "llada-moe", "llada2", "llada2-bf16"}


def test_llada2_golden_full_equals_none() -> None:
    """LLaDA2's recorded ``full`` tokens are its recorded no-cache tokens, in every mode, in fp32 and in bf16."""
    golden = load("tokens")
    pairs = [(key, key.replace("/none/", "/full/")) for key in golden
             if key.split("/")[0] in ("llada2", "llada2-bf16") and "/none/" in key]
    assert len(pairs) == 2 * len(BUDGETS) * 3
    for none, full in pairs:
        assert golden[full] == golden[none], full


def test_command_json_equals_the_golden_one(models: dict, tmp_path: Path) -> None:
    """Every case and every key of it, including keys and cases that the recording does not have."""
    golden = load("cli")
    now = json.loads(json.dumps(cli_cases(models["llada_dir"], tmp_path / "cli"), sort_keys=True))
    moved = moved_paths(golden, now)
    assert not moved, f"{len(moved)} values moved: {moved[:10]}"


def test_moved_paths_names_what_differs() -> None:
    old = {"a": 1, "b": {"c": [1, 2], "d": "x"}, "gone": 0}
    new = {"a": 1, "b": {"c": [1, 3], "d": "x", "e": None}, "new": 0}
    assert moved_paths(old, new) == ["b/c/1: 2 -> 3", "b/e (added)", "gone (removed)", "new (added)"]
    assert moved_paths({"x": [1]}, {"x": [1, 2]}) == ["x: [1] -> [1, 2]"]
    assert moved_paths({"x": 1}, {"x": 1.0}) == ["x: 1 -> 1.0"]
    assert moved_paths(old, old) == []
