"""What ask and summarize show of an answer's confidence, and of an empty answer (never a blank line)."""

from __future__ import annotations

import json

import pytest
from prompts import NEEDLE_DOC, NEEDLE_PARAGRAPH
from typer.testing import CliRunner

import maskkv_cli.app.session as session_module
from maskkv_cli.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(NEEDLE_DOC)
    return path


def test_ask_shows_and_returns_the_confidence(doc):
    shown = run("ask", doc, "What is the special magic number for apple?")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.strip() == "4821"
    assert "confidence: mean" in shown.stderr
    data = json.loads(run("ask", doc, "What is the special magic number for apple?", "--json").stdout)
    conf = data["answers"][0]["confidence"]
    assert set(conf) == {"mean", "min", "tokens", "low", "threshold", "statistic"}
    assert 0 < conf["min"] <= conf["mean"] <= 1 and conf["tokens"] >= 1 and conf["low"] is False
    assert "note" not in data["answers"][0]


def test_absent_key_is_not_in_the_document(doc):
    # the embedded model (stage 24) was trained to tell a key with no needle from one with a needle
    data = json.loads(run("ask", doc, "-q", "What is the special magic number for banana?",
                          "-q", "What is the special magic number for apple?", "--json").stdout)
    absent, present = data["answers"]
    assert absent["answer"] == "not in the document" and absent["confidence"]["low"] is False
    assert present["answer"] == "4821"


def test_several_questions_carry_their_confidence_on_stdout(doc):
    shown = run("ask", doc, "-q", "What is the special magic number for apple?", "-q", "Who is the licensor?")
    assert shown.exit_code == 0, shown.output
    needle, other = shown.stdout.strip().split("\n\n")
    assert needle.splitlines()[2].lstrip().startswith(("confidence:", "LOW CONFIDENCE"))
    # the embedded model asked a question of another form: no answer shown, and no confidence of 1.00 beside it
    assert other.splitlines()[1] == "A: (no answer, see the note below)" and len(other.splitlines()) == 2
    assert "only answers questions of the form" in shown.stderr


def test_empty_answer_is_a_note_not_a_blank(doc, monkeypatch):
    monkeypatch.setattr(session_module, "decode_answer", lambda *args: "")
    shown = run("ask", doc, "What is the special magic number for apple?", "--quiet")
    assert shown.exit_code == 0 and shown.stdout == ""
    assert "the model gave no answer" in shown.stderr and "maskkv pull GSAI-ML/LLaDA-8B-Instruct" in shown.stderr
    data = json.loads(run("ask", doc, "What is the special magic number for apple?", "--json").stdout)
    assert data["answers"][0]["answer"] == "" and "needle-style facts" in data["answers"][0]["note"]


def test_summary_confidence_per_part_and_empty_parts_skip_the_merge(tmp_path, monkeypatch):
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("\n\n".join(f"Paragraph {i}. " + NEEDLE_PARAGRAPH * 4 for i in range(20)))
    data = json.loads(run("summarize", long_doc, "--length", "20", "--steps", "8", "--block-length", "32",
                          "--json").stdout)
    assert len(data["parts"]) > 1
    assert all(p["confidence"] is None or 0 < p["confidence"]["min"] <= 1 for p in data["parts"])
    assert "confidence" in data

    calls = []
    real = session_module.Session.answer_ids
    monkeypatch.setattr(session_module, "decode_answer", lambda *args: "")
    monkeypatch.setattr(session_module.Session, "answer_ids",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    empty = run("summarize", long_doc, "--length", "20", "--steps", "8", "--block-length", "32")
    assert empty.exit_code == 0 and empty.stdout == ""
    assert "the model gave no summary" in empty.stderr
    assert len(calls) == len(data["parts"])  # no merge run over nothing
    quiet = run("summarize", long_doc, "--length", "20", "--steps", "8", "--block-length", "32", "--quiet")
    assert quiet.exit_code == 0 and quiet.stdout == "" and "the model gave no summary" in quiet.stderr


def test_quiet_keeps_the_low_confidence_mark_and_drops_the_rest(doc, tiny_dir):
    guess = run("ask", doc, "What is the special magic number for apple?", "--model", tiny_dir, "--quiet",
                "-n", "8", "--steps", "8", "--block-length", "8")
    assert guess.exit_code == 0, guess.output
    assert guess.stderr.startswith("LOW CONFIDENCE (") and len(guess.stderr.splitlines()) == 1  # the random model
    sure = run("ask", doc, "What is the special magic number for apple?", "--quiet")
    assert sure.stdout.strip() == "4821" and sure.stderr == ""
