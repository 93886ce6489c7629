"""The model a command runs is resolved once, at the command's edge (``models.checkpoint.ModelFolder``), and its
config.json read and hashed once, not per prompt; the library's entry points still take a path string."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

import maskkv_cli.paths as paths
from maskkv_cli.cli import app

runner = CliRunner()
FAST = ["-n", "8", "--steps", "8", "--block-length", "8", "--budget", "8", "--json"]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Counts of ``paths.resolve_model_path`` calls (wherever a module bound the name), of config.json parses
    (``read_text``: ``models.loading.read_config``) and hashes (``read_bytes``: the calibration key)."""
    seen: Counter[str] = Counter()
    real = paths.resolve_model_path

    def resolve(name: object) -> Path:
        seen["resolve"] += 1
        return real(name)  # type: ignore[arg-type]

    import maskkv_cli.app.session  # noqa: F401  (the modules that bind the name on import, imported before the spy)

    for module in [m for name, m in list(sys.modules.items()) if name.startswith("maskkv_cli") and m is not None]:
        if hasattr(module, "resolve_model_path"):
            monkeypatch.setattr(module, "resolve_model_path", resolve)
    read_text, read_bytes = Path.read_text, Path.read_bytes

    def text(self: Path, *args: object, **kwargs: object) -> str:
        seen["parse"] += self.name == "config.json"
        return read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    def raw(self: Path) -> bytes:
        seen["hash"] += self.name == "config.json"
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_text", text)
    monkeypatch.setattr(Path, "read_bytes", raw)
    return seen


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text("The river runs past the old mill. The special magic number for river is 4821. " * 6)
    return path


def test_ask_with_three_questions_resolves_the_model_once(counted: Counter[str], doc: Path, tiny_dir: Path) -> None:
    # before the ModelFolder: 17 resolutions and 8 hashes of config.json for these three questions
    result = runner.invoke(app, ["ask", str(doc), "Where?", "-q", "Who?", "-q", "When?", "--batch-size", "3",
                                 "--model", str(tiny_dir), *FAST])
    assert result.exit_code == 0, result.output
    assert (counted["resolve"], counted["parse"], counted["hash"]) == (1, 1, 1)


def test_ask_with_auto_batch_size_resolves_the_model_once(counted: Counter[str], doc: Path,
                                                           tiny_dir: Path) -> None:
    result = runner.invoke(app, ["ask", str(doc), "Where?", "-q", "Who?", "-q", "When?", "--batch-size", "auto",
                                 "--model", str(tiny_dir), *FAST])
    assert result.exit_code == 0, result.output
    assert (counted["resolve"], counted["parse"], counted["hash"]) == (1, 1, 1)


def test_ask_one_at_a_time_resolves_the_model_once(counted: Counter[str], doc: Path, tiny_dir: Path) -> None:
    result = runner.invoke(app, ["ask", str(doc), "Where?", "-q", "Who?", "--batch-size", "1",
                                 "--model", str(tiny_dir), *FAST])
    assert result.exit_code == 0, result.output
    assert (counted["resolve"], counted["parse"], counted["hash"]) == (1, 1, 1)


def test_summarize_and_profile_resolve_the_model_once(counted: Counter[str], doc: Path, tiny_dir: Path) -> None:
    result = runner.invoke(app, ["summarize", str(doc), "--length", "10", "--model", str(tiny_dir), "--json"])
    assert result.exit_code == 0, result.output
    assert (counted["resolve"], counted["parse"], counted["hash"]) == (1, 1, 1)
    counted.clear()
    result = runner.invoke(app, ["profile", str(doc), "Where?", "--model", str(tiny_dir), "--budgets", "8,16",
                                 "-n", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert (counted["resolve"], counted["parse"], counted["hash"]) == (1, 1, 1)


def test_the_embedded_default_is_resolved_once_too(counted: Counter[str], doc: Path) -> None:
    result = runner.invoke(app, ["ask", str(doc), "Where?", "--json", "-n", "8", "--steps", "8"])
    assert result.exit_code == 0, result.output
    assert (counted["resolve"], counted["hash"]) == (1, 1)


def test_a_configured_default_is_resolved_once(counted: Counter[str], doc: Path, tiny_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASKKV_MODEL", str(tiny_dir))  # checked when chosen: that resolution is the one kept
    result = runner.invoke(app, ["ask", str(doc), "Where?", *FAST])
    assert result.exit_code == 0, result.output
    assert (counted["resolve"], counted["hash"]) == (1, 1)


def test_path_strings_still_work_at_the_library_entry_points(tiny_dir: Path) -> None:
    from maskkv_cli.app.session import Session
    from maskkv_cli.engine.plan import CacheConfig, plan_cache, resolve_importance
    from maskkv_cli.models.calibration import model_key, profile_path
    from maskkv_cli.models.checkpoint import ModelFolder
    from maskkv_cli.models.fingerprint import model_fingerprint
    from maskkv_cli.policies.base import PolicyOptions

    folder = ModelFolder.of(str(tiny_dir))
    assert ModelFolder.of(folder) is folder and folder.name == str(tiny_dir) and folder.path == tiny_dir
    assert folder.fingerprint == model_fingerprint(tiny_dir) and model_key(folder) == model_key(str(tiny_dir))
    assert profile_path(folder) == profile_path(tiny_dir)
    by_path, by_folder = Session(str(tiny_dir)), Session(folder)
    assert by_path.model_path == by_folder.model_path == str(tiny_dir)
    assert by_path.folder == folder  # equal values: the same checkpoint, resolved the same way
    cache = CacheConfig(policy="maskkv", budget=8)
    plans = [plan_cache(by_path.model, cache, 40, where, block_length=8) for where in (str(tiny_dir), folder)]
    first, second = ((p.budget, p.layer_budgets, p.importance_source, p.note) for p in plans)
    assert first == second and plans[0].note is not None and str(tiny_dir) in plans[0].note  # the hint names it
    assert resolve_importance(str(tiny_dir), PolicyOptions(), "maskkv") == resolve_importance(
        folder, PolicyOptions(), "maskkv")


def test_the_fingerprint_is_computed_on_first_use_only(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import maskkv_cli.models.checkpoint as checkpoint

    calls: list[Path] = []
    real = checkpoint.folder_fingerprint
    monkeypatch.setattr(checkpoint, "folder_fingerprint", lambda path: calls.append(path) or real(path))
    folder = checkpoint.ModelFolder.of(tiny_dir)
    assert calls == []  # resolving does not hash the weights
    assert folder.fingerprint == folder.fingerprint and calls == [tiny_dir]
