"""The smaller points of issue 39: a bad default model names where it was set, ingest counts tokens as ask does,
the calibration note is shown once, and a command that only reports a missing file answers at once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prompts import NEEDLE_DOC
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.cli.common import ONCE

runner = CliRunner()
QUESTION = "What is the special magic number for apple?"


def test_a_bad_default_model_names_the_variable_or_the_config_line(tmp_path: Path, monkeypatch) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(NEEDLE_DOC)
    monkeypatch.setenv("MASKKV_MODEL", str(tmp_path / "bad"))
    result = runner.invoke(app, ["ask", str(doc), QUESTION])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: MASKKV_MODEL={tmp_path / 'bad'} names no usable model (model folder")
    assert "unset it, or pass --model" in result.stderr
    monkeypatch.delenv("MASKKV_MODEL")
    config = tmp_path / "config.toml"
    config.write_text(f'model = "{tmp_path / "gone"}"\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    result = runner.invoke(app, ["summarize", str(doc)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f'error: `model = "{tmp_path / "gone"}"` in {config} names no usable model')


def test_a_config_file_setting_maskkv_does_not_read_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not silently ignored (a user who wrote ``budget = 64`` there expects it to apply)."""
    doc = tmp_path / "doc.txt"
    doc.write_text(NEEDLE_DOC)
    config = tmp_path / "config.toml"
    config.write_text('quantize = "none"\nbudget = 64\n')
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    result = runner.invoke(app, ["ask", str(doc), QUESTION])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1
    assert f"config file {config}: budget is not read by maskkv; it reads model and quantize" in result.stderr


@pytest.mark.parametrize(("content", "message"), [
    (b"model = 5\n", "model must be a non-empty string in quotes"),
    (b'model = ""\n', "model must be a non-empty string in quotes"),
    (b'quantize = "int8"\nmodel = "\xff"\n', "it must be UTF-8 TOML"),
    (None, "is a folder; point MASKKV_CONFIG at a TOML file"),
])
def test_a_config_file_of_the_wrong_kind_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  content: bytes | None, message: str) -> None:
    """``model = 5`` was read as "5", ``model = ""`` as no setting (the embedded model ran), a Latin-1 file gave a
    raw UnicodeDecodeError and MASKKV_CONFIG naming a folder was ignored: each is one line naming the file."""
    doc = tmp_path / "doc.txt"
    doc.write_text(NEEDLE_DOC)
    config = tmp_path / "config.toml"
    if content is None:
        config.mkdir()
    else:
        config.write_bytes(content)
    monkeypatch.setenv("MASKKV_CONFIG", str(config))
    result = runner.invoke(app, ["ask", str(doc), QUESTION])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert str(config) in result.stderr and message in result.stderr


def test_ingest_counts_tokens_as_ask_does(tmp_path: Path) -> None:
    from maskkv_cli.documents import load_document
    from maskkv_cli.models.catalog import shipped_model
    from maskkv_cli.prompting import load_tokenizer

    doc = tmp_path / "doc.txt"
    doc.write_text(NEEDLE_DOC * 3)
    result = runner.invoke(app, ["ingest", str(doc)])
    assert result.exit_code == 0, result.output
    tokenizer = load_tokenizer(shipped_model())  # what ask's session counts with
    expected = len(tokenizer.encode(load_document(doc).text, add_special_tokens=False))
    assert f", {expected} tokens;" in result.stdout
    assert "tokens counted with: the tokenizer of tiny-llada (the model ask uses by default" in result.stderr
    again = json.loads(runner.invoke(app, ["ingest", str(doc), "--json"]).stdout)["documents"][0]
    assert again["tokens"] == expected


def test_the_calibration_note_is_shown_the_first_time_only(tmp_path: Path, tiny_dir: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(NEEDLE_DOC)
    args = ["ask", str(doc), QUESTION, "--model", str(tiny_dir), "-n", "8", "--steps", "8", "--block-length", "8"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "note: no calibration profile for this model" in first.stderr
    second = runner.invoke(app, args)
    assert second.exit_code == 0 and "calibration" not in second.stderr
    other = runner.invoke(app, ["ask", str(doc), QUESTION, "--budget", "8"])  # another model: its own note
    assert "note: no calibration profile for this model" in other.stderr


def test_the_notes_shown_once_are_the_engine_s_calibration_notes(tiny_dir: Path) -> None:
    from maskkv_cli.engine.plan import resolve_importance
    from maskkv_cli.policies.base import PolicyOptions

    _, note = resolve_importance(str(tiny_dir), PolicyOptions(), "maskkv", "auto")
    assert note is not None and note.startswith(ONCE)


def test_a_missing_document_is_reported_without_importing_torch(tmp_path: Path) -> None:
    code = ("import sys\nfrom maskkv_cli.cli import main\nsys.argv = ['maskkv', 'ask', 'nope.pdf', 'Who?']\n"
            "try:\n    main()\nexcept SystemExit as exc:\n    print(exc.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "1 False", done.stderr
    assert done.stderr.strip() == "error: File not found: nope.pdf. Check the path and try again."


def test_a_reader_that_goes_away_stops_the_command_quietly(capfd, monkeypatch) -> None:
    """``maskkv plan ... | head -3``: the write after ``head`` left raised BrokenPipeError, printed as an error
    ("error: BrokenPipeError: [Errno 32] Broken pipe", exit 1); now the command stops with no message and the
    shell's SIGPIPE status, and stdout no longer points at the pipe."""
    import os

    import typer

    from maskkv_cli.cli.common import guarded

    read, write = os.pipe()
    saved = os.dup(1)
    os.dup2(write, 1)
    os.close(write)
    os.close(read)  # the reader has gone
    monkeypatch.setattr(sys, "stdout", open(1, "w", closefd=False))  # noqa: SIM115  (fd 1, as in a real run)

    @guarded
    def command() -> None:
        sys.stdout.write("a table row\n")
        sys.stdout.flush()

    try:
        with pytest.raises(typer.Exit) as stopped:
            command()
        os.write(1, b"what the interpreter flushes at exit\n")  # /dev/null now: no second error
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    assert stopped.value.exit_code == 141
    assert capfd.readouterr().err == ""
