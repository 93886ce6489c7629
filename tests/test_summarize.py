"""``maskkv summarize`` (issue 39): --length is the final summary's budget and its most words, no word is cut in
the middle, and when the final pass only repeats the parts' summaries (a lead-summary model) they are shown with
their pages, with a note on what the model can do."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.models.catalog import shipped_model
from maskkv_cli.prompting.parts import adds_nothing, summary_tokens, trim_summary

runner = CliRunner()
SOURCE = "GNU GENERAL PUBLIC LICENSE. Version 3, 29 June 2007. Everyone is permitted to copy it."


def test_a_word_the_budget_cut_is_dropped() -> None:
    assert trim_summary("GNU GENERAL PUBLIC LICENS", None, SOURCE, ran_out=True) == "GNU GENERAL PUBLIC"
    assert trim_summary("GNU GENERAL PUBLIC LICENS", None, SOURCE, ran_out=False) == "GNU GENERAL PUBLIC"  # a prefix
    assert trim_summary("Everyone is permitted to copy", None, SOURCE, ran_out=False) == \
        "Everyone is permitted to copy"
    assert trim_summary("Version 3, 29 June 2007.", None, SOURCE, ran_out=True) == "Version 3, 29 June 2007."


def test_length_is_the_most_words_and_keeps_whole_sentences_when_it_can() -> None:
    text = "GNU GENERAL PUBLIC LICENSE. Version 3, 29 June 2007. Everyone is permitted to copy it."
    assert trim_summary(text, 9, SOURCE, ran_out=False) == "GNU GENERAL PUBLIC LICENSE. Version 3, 29 June 2007."
    assert trim_summary(text, 8, SOURCE, ran_out=False) == "GNU GENERAL PUBLIC LICENSE."
    assert trim_summary(text, 3, SOURCE, ran_out=False) == "GNU GENERAL PUBLIC"  # no sentence end to keep
    assert trim_summary(text, 100, SOURCE, ran_out=False) == text


def test_summary_tokens_are_whole_blocks_of_about_1_6_tokens_a_word() -> None:
    assert summary_tokens(150, 32) == 256 and summary_tokens(10, 32) == 32 and summary_tokens(5, 8) == 8


def test_a_final_summary_found_in_the_parts_adds_nothing() -> None:
    parts = ["GNU GENERAL PUBLIC LICENSE", "Some devices are designed to deny users access."]
    assert adds_nothing("GNU GENERAL  public license", parts)
    assert not adds_nothing("The license lets anyone copy the program.", parts)
    assert not adds_nothing("", parts)


@lru_cache(maxsize=1)
def three_part_text() -> str:
    from maskkv_cli.tasks.sources import load_source

    return "\f".join("\n\n".join(load_source("stdlib-heldout")[i * 12:(i + 1) * 12]) for i in range(3))


@pytest.mark.skipif(shipped_model() is None, reason="the embedded model is not in this checkout")
def test_the_embedded_model_shows_each_part_s_lead_with_its_pages_and_says_what_it_can_do(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text(three_part_text(), encoding="utf-8")
    result = runner.invoke(app, ["summarize", str(path)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) >= 2 and all(line.startswith(("page ", "pages ")) for line in lines)
    assert "writes lead summaries only" in result.stderr and "maskkv pull" in result.stderr
    assert "--length 150: this model writes at most its trained summary length" in result.stderr
    assert "each part's summary is shown with its pages" in result.stderr
    short = json.loads(runner.invoke(app, ["summarize", str(path), "--length", "5", "--json"]).stdout)
    assert short["length"] == {"words": 5, "tokens": 8} and len(short["summary"].split()) <= 5
    vocabulary = {w.strip(".,;:!?\"'()[]").casefold() for w in three_part_text().split()}
    assert not short["summary"] or short["summary"].split()[-1].strip(".,;:!?\"'()[]").casefold() in vocabulary
    assert short["shown"] == "parts" and len(short["parts"]) >= 2 and short["notes"]


SHORT_NEEDLE = ("The special magic number for ravenwood is 4821. Stone paper music tree tree river market river "
                "garden tree garden garden light city tree cloud river garden alpha music city city paper tree tree "
                "alpha water garden market water tree cloud paper river report alpha alpha alpha light engine.\n")


@pytest.mark.skipif(shipped_model() is None, reason="the embedded model is not in this checkout")
def test_a_short_length_never_shows_the_models_refusal_as_the_summary(tmp_path: Path) -> None:
    """With --length 1, 3 or 5 the one part's summary is asked again within 8 tokens, where the embedded model
    answers "not in the document" about this text: the summary was "not", "not in the", "not in the document".
    Now the part's own summary, cut to the length."""
    path = tmp_path / "small.txt"
    path.write_text(SHORT_NEEDLE, encoding="utf-8")
    for words in (1, 3, 5):
        result = runner.invoke(app, ["summarize", str(path), "--length", str(words), "--json"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert not data["summary"].casefold().startswith("not"), (words, data["summary"])
        assert data["summary"].split() == data["parts"][0]["summary"].split()[:words]


def test_another_model_writes_the_final_summary_within_length(tmp_path: Path, tiny_dir: Path, monkeypatch) -> None:
    import maskkv_cli.app.pipeline as pipeline

    seen = []
    real = pipeline.ask

    def spy(session, context, question, gen, cache, **hooks):
        seen.append(gen.gen_length)
        return real(session, context, question, gen, cache, **hooks)

    monkeypatch.setattr(pipeline, "ask", spy)
    path = tmp_path / "long.txt"
    path.write_text("\n\n".join(f"Paragraph {i} says something about the harbour. " * 40 for i in range(30)))
    result = runner.invoke(app, ["summarize", str(path), "--model", str(tiny_dir), "--length", "10", "--steps", "8",
                                 "--block-length", "8", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(seen) == {summary_tokens(10, 8)} == {16} and len(data["summary"].split()) <= 10
    assert data["length"] == {"words": 10, "tokens": 16}
    assert all("lead summaries" not in n for n in data["notes"])  # this model is not a lead-summary model


@pytest.mark.parametrize("text", [
    "河流流过古老的磨坊，守夜人在本子上写下每一艘经过的船。" * 200,  # no spaces at all: one "word"
    "The river runs past the old mill and the keeper writes down every boat. " * 300,
    "short words then " + "x" * 6000 + " and a few more words after it " * 40,  # one word longer than a part
])
def test_a_page_longer_than_a_part_is_cut_into_pieces_that_fit(text: str, tiny_tokenizer) -> None:
    """Every piece of a long page fits the part's room (text without spaces is cut at characters: Chinese or
    Japanese pages were one oversized piece, read cut in the middle), and the pieces keep all of the text."""
    from maskkv_cli.documents.model import Document, Page
    from maskkv_cli.prompting.parts import split_parts

    def count(s: str) -> int:
        return len(tiny_tokenizer.encode(s, add_special_tokens=False))

    doc = Document(source="x.txt", kind="text", pages=(Page(1, "short first page."), Page(2, text)), sha256="0")
    parts = split_parts(doc, count, 300)
    assert count(text) > 300 and all(p.tokens <= 300 and p.tokens == count(p.text) for p in parts)
    assert "".join(p.text for p in parts[1:]).replace(" ", "") == text.replace(" ", "")
    assert parts[0].text == "short first page." and all(p.first_page == 2 for p in parts[1:])


def test_words_between_runs_without_spaces_are_not_cut_into_tiny_parts(tiny_tokenizer) -> None:
    """A Chinese page with one English sentence in it: the sentence's words became parts of one to three tokens,
    each summarized on its own ("part 6/19 (pages 2-2, 1 tokens)"). Pieces that fit together are one part."""
    from maskkv_cli.documents.model import Document, Page
    from maskkv_cli.prompting.parts import split_parts

    def count(s: str) -> int:
        return len(tiny_tokenizer.encode(s, add_special_tokens=False))

    han = "河流流过古老的磨坊，守夜人在本子上写下每一艘经过的船。" * 30
    text = f"{han} The special magic number for lemon is 7123. {han}"
    doc = Document(source="x.txt", kind="text", pages=(Page(1, text),), sha256="0")
    parts = split_parts(doc, count, 300)
    assert all(p.tokens <= 300 for p in parts) and sum(p.tokens < 100 for p in parts) <= 2  # the words and the end
    assert len(parts) <= -(-count(text) // 300) + 2
    assert "".join(p.text for p in parts).replace(" ", "") == text.replace(" ", "")
