"""Issue 39's "done when", with the embedded model: a fact planted at the start, middle or end of a 15k-token text
or of a 36-page PDF is found by the default ``ask``; a cut document never yields an unqualified "not in the
document". Texts the model never saw: the held-out standard-library docstrings (``tasks.sources``)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
from pdfs import long_pdf_pages, make_pdf
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.models.catalog import shipped_model

runner = CliRunner()
QUESTION = "What is the special magic number for harbor?"
FACT = "The special magic number for harbor is 4821."

pytestmark = pytest.mark.skipif(shipped_model() is None, reason="the embedded model is not in this checkout")


@lru_cache(maxsize=1)
def text_of_15k_tokens() -> str:
    from maskkv_cli.prompting import load_tokenizer
    from maskkv_cli.tasks.sources import load_source

    tokenizer = load_tokenizer(shipped_model())
    paragraphs: list[str] = []
    tokens = 0
    for paragraph in load_source("stdlib-heldout"):
        paragraphs.append(paragraph)
        tokens += len(tokenizer.encode(paragraph, add_special_tokens=False)) + 1
        if tokens >= 15000:
            return "\n\n".join(paragraphs)
    raise AssertionError("the held-out docstrings hold fewer than 15k tokens")


def planted(at: float) -> str:
    text = text_of_15k_tokens()
    cut = text.find("\n\n", int(at * len(text)))
    cut = len(text) if cut < 0 else cut
    return f"{text[:cut]}\n\n{FACT}{text[cut:]}"


def ask_json(path: Path, *extra: str) -> dict:
    result = runner.invoke(app, ["ask", str(path), QUESTION, "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["answers"][0]


@pytest.mark.parametrize("at", [0.02, 0.5, 0.97])
def test_a_fact_anywhere_in_a_15k_token_text_is_found(tmp_path: Path, at: float) -> None:
    path = tmp_path / "long.txt"
    path.write_text(planted(at), encoding="utf-8")
    answer = ask_json(path)
    assert answer["answer"] == "4821" and answer["claim"] == "answer"
    assert answer["read"]["complete"] and answer["read"]["parts"] >= 7 and answer["stats"]["prompt_len"] > 15000
    fact_at = path.read_text(encoding="utf-8").index(FACT)
    assert any(a <= fact_at < b for a, b in answer["source"]["spans"])


@pytest.mark.parametrize("page", [1, 18, 36])
def test_a_fact_on_any_page_of_a_36_page_pdf_is_found_and_its_page_named(tmp_path: Path, page: int) -> None:
    path = tmp_path / "report.pdf"
    path.write_bytes(make_pdf(long_pdf_pages(36, fact=FACT, fact_page=page)))
    if page == 18:  # as the user sees it
        result = runner.invoke(app, ["ask", str(path), QUESTION])
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "4821"
        (line,) = [x for x in result.stderr.splitlines() if x.startswith("confidence:")]
        assert "from pages" in line and "(read all 36 pages in" in line
        return
    answer = ask_json(path)
    assert answer["answer"] == "4821" and answer["claim"] == "answer"
    assert page in answer["source"]["pages"] and answer["read"]["pages"] == list(range(1, 37))


def test_a_cut_document_never_says_plainly_that_the_fact_is_not_there(tmp_path: Path) -> None:
    path = tmp_path / "long.txt"
    path.write_text(planted(0.5), encoding="utf-8")
    result = runner.invoke(app, ["ask", str(path), QUESTION, "--long", "truncate"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("not in the part read [read pages 1")
    answer = ask_json(path, "--long", "truncate")
    assert answer["claim"] == "absent-in-read" and not answer["read"]["complete"]


@pytest.mark.parametrize("long", ["parts", "truncate"])
def test_an_answer_as_long_as_the_window_is_refused_with_its_numbers(tmp_path: Path, long: str) -> None:
    """An answer longer than the window leaves no room for the document: the error names the answer's length, the
    prompt around the document and the window, and the longest answer that leaves room."""
    path = tmp_path / "doc.txt"
    path.write_text(FACT, encoding="utf-8")
    result = runner.invoke(app, ["ask", str(path), QUESTION, "--gen-length", "3000", "--long", long])
    assert result.exit_code == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "an answer of 3000 tokens" in line and "2128-token window" in line and "Traceback" not in result.output
    longest = int(line.rsplit("at most ", 1)[1].split()[0])
    overhead = int(line.split("document (", 1)[1].split()[0])
    assert longest == 2128 - overhead - 1
