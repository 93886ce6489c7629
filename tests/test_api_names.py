"""The import paths docs/api.md gives exist (a module that moves takes its documented path with it: docs/api.md
changes in the same commit, no re-export is left behind)."""

from __future__ import annotations

import importlib

import pytest

import maskkv_cli

DOCUMENTED = [
    ("maskkv_cli.engine.step_runner", "StepOptions"),
    ("maskkv_cli.prompting", "chat_prompt_ids"),
    ("maskkv_cli.prompting", "load_tokenizer"),
    ("maskkv_cli.defaults", "DEFAULT_POLICY"),
    ("maskkv_cli.errors", "ModelLoadError"),
    ("maskkv_cli.models.dream", "Dream"),
    ("maskkv_cli.models.placement", "place_model"),
    ("maskkv_cli.sampling.dream", "generate_dream"),
    ("maskkv_cli.sampling.dream", "DreamGenerationConfig"),
    ("maskkv_cli.sampling", "generate_dream"),
    ("maskkv_cli.sampling", "DreamGenerationConfig"),
    ("maskkv_cli.sampling", "sample"),
    ("maskkv_cli.sampling", "DreamOptions"),
    ("maskkv_cli.app.pipeline", "ask"),
    ("maskkv_cli.app.pipeline", "prepare"),
    ("maskkv_cli.policies", "get_policy"),
    ("maskkv_cli.policies.base", "register"),
    ("maskkv_cli.kv.budgets", "distribute_exact"),
    ("maskkv_cli.engine.plan", "resolve_importance"),
    ("maskkv_cli.runtime.stats", "now"),
    ("maskkv_cli.cli", "app"),
]


@pytest.mark.parametrize("module,name", DOCUMENTED)
def test_documented_import_paths(module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name)


def test_lazy_top_level_names() -> None:
    for name in maskkv_cli.__all__:
        assert getattr(maskkv_cli, name) is not None, name


def test_the_top_level_names_api_md_lists_are_those_there() -> None:
    """docs/api.md said everything is importable from ``maskkv_cli``; ask_many, run_batch, plan_cache, ... are not.
    It lists the top-level names now: the list is ``__all__``."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    listed = text[text.index("importable from `maskkv_cli` (") : text.index("heavy modules load on first use")]
    assert set(re.findall(r"`(\w+)`", listed)) - {"maskkv_cli"} == set(maskkv_cli.__all__) - {"__version__"}
