"""The user's configuration as the commands read it: the config file, the environment, maskkv's own files in
MASKKV_HOME; each read as the user wrote it, or refused naming where it was set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.models.catalog import shipped_model

runner = CliRunner()
pytestmark = pytest.mark.skipif(shipped_model() is None, reason="the embedded model is not in this checkout")


def _doc(tmp_path: Path) -> Path:
    doc = tmp_path / "doc.txt"
    doc.write_text("The special magic number for apple is 4821.\n")
    return doc


def test_a_notes_file_of_another_shape_is_started_afresh(tmp_path: Path) -> None:
    """notes-shown.json holding null (or a number) ended ask with "TypeError: argument of type 'NoneType' is not
    iterable" after the answer was computed."""
    from maskkv_cli.paths import maskkv_home

    maskkv_home().mkdir(parents=True, exist_ok=True)
    for content in ("null", "5", '"abc"', '{"a": 1}'):
        (maskkv_home() / "notes-shown.json").write_text(content)
        result = runner.invoke(app, ["ask", str(_doc(tmp_path)), "What is the special magic number for apple?", "-n",
                                     "8", "--budget", "8"])  # (evicting: the calibration note is a one-time one)
        assert result.exit_code == 0, result.output
        assert "no calibration profile for this model" in result.stderr


def test_a_config_file_with_a_utf8_mark_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "Invalid statement (at line 1, column 1) (it must be UTF-8 TOML)" of a UTF-8 file with its mark."""
    from maskkv_cli.defaults import configured_model

    config = tmp_path / "config.toml"
    config.write_bytes(b'\xef\xbb\xbfmodel = "/somewhere"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    assert configured_model() == "/somewhere"


def test_the_hub_cache_is_found_as_huggingface_hub_finds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HOME='$DIR/hf' or '~/hf' was taken literally (a model huggingface_hub found "not on this machine", a pull
    into a folder named '~'); the older HUGGINGFACE_HUB_CACHE was not read."""
    from maskkv_cli.paths import hf_cache_dir

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MYDIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HOME", "$MYDIR/hf")
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", "~/hfx")
    assert hf_cache_dir() == tmp_path / "home" / "hfx" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", "$MYDIR/old")
    assert hf_cache_dir() == tmp_path / "old"
    monkeypatch.setenv("HF_HUB_CACHE", "$MYDIR/new")
    assert hf_cache_dir() == tmp_path / "new"


def test_a_default_model_not_downloaded_is_named_where_it_was_set(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """"model ORG/NAME is not on this machine" named neither MASKKV_MODEL nor the config file's line."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    config = tmp_path / "config.toml"
    config.write_text('model = "org/absent"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    doc = _doc(tmp_path)
    result = runner.invoke(app, ["ask", str(doc), "Q?"])
    assert result.exit_code == 1 and f'model org/absent (`model = "org/absent"` in {config}) is not on this ' \
        "machine" in result.stderr, result.output
    monkeypatch.setenv("MASKKV_MODEL", "org/gone")
    result = runner.invoke(app, ["generate", "hi"])
    assert result.exit_code == 1 and "model org/gone (MASKKV_MODEL=org/gone) is not on this machine" in result.stderr
    result = runner.invoke(app, ["ask", str(doc), "Q?", "--model", "org/given"])
    assert "model org/given is not on this machine" in result.stderr  # a --model given is named as itself


def test_the_models_table_off_a_terminal_keeps_the_whole_problem(tmp_path: Path) -> None:
    """Piped, the loads column cut the path of the file at fault ("…/snapsho…")."""
    from maskkv_cli.models.catalog import remember_folder

    broken = tmp_path / ("a-long-folder-name-" * 4) / "model"
    broken.mkdir(parents=True)
    (broken / "config.json").write_text(json.dumps([1]))
    remember_folder(broken)
    shown = runner.invoke(app, ["models"], env={"COLUMNS": None})
    assert shown.exit_code == 0 and "…" not in shown.stdout, shown.stdout
    assert "is not a model config (a JSON object)" in " ".join(shown.stdout.split())
