"""The tiny models' outputs equal the recorded golden ones (tests/golden_cases.py says what is pinned)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden_cases import GOLDEN_DIR, build_models, cli_cases, token_cases


def load(name: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{name}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return build_models(tmp_path_factory.mktemp("golden"))


def test_tokens_equal_the_golden_ones(models: dict) -> None:
    golden = load("tokens")
    policies = list(dict.fromkeys(key.split("/")[1] for key in golden))
    now = token_cases(models, policies)
    moved = sorted(key for key in golden if now.get(key) != golden[key])
    assert not moved, f"{len(moved)} of {len(golden)} token cases moved, e.g. {moved[:5]}"


def test_command_json_equals_the_golden_one(models: dict, tmp_path: Path) -> None:
    golden = load("cli")
    now = json.loads(json.dumps(cli_cases(models["llada_dir"], tmp_path / "cli"), sort_keys=True))
    for name in golden:
        assert now[name] == golden[name], f"{name} moved"
