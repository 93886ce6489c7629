"""Damaged text layers (issue 39): pages whose text is mostly U+FFFD or private-use characters are dropped with a
note, a document mostly made of them fails with one line, and the threshold separates the test corpus."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdfs import font_pdf, text_layer_corpus
from typer.testing import CliRunner

from maskkv_cli.cli import app
from maskkv_cli.documents import parse_document
from maskkv_cli.documents.pdf import load_pdf
from maskkv_cli.documents.store import DocumentStore
from maskkv_cli.documents.textlayer import UNREADABLE_PAGE, unreadable_share
from maskkv_cli.errors import DocumentError

runner = CliRunner()
LINES = ["The harbour wakes at dawn and the boats come home.", "Gulls circle over the market stalls.",
         "The lighthouse keeper writes to his sister every week."]


def page(font: str) -> list[list[tuple[str, str]]]:
    return [[(font, line)] for line in LINES]


def test_unreadable_share_counts_replacement_private_use_and_controls_among_non_space_characters() -> None:
    assert unreadable_share("") == 0.0
    assert unreadable_share("plain text, 42 + 7 = 49 (ok)") == 0.0
    assert unreadable_share("\ufffd\ufffd \ufffd\ufffd") == 1.0
    assert unreadable_share("ab\ue000\ufffd") == 0.5
    assert unreadable_share("abc\x01") == 0.25
    assert unreadable_share("日本語のテキスト — émigré ∑ √2") == 0.0  # other scripts and symbols read fine


@pytest.mark.parametrize("seed", [1, 2])  # 1 chose the threshold, 2 confirms it (scripts/text_layer_threshold.py)
def test_the_threshold_keeps_every_clean_page_and_drops_every_damaged_one_of_the_corpus(seed: int) -> None:
    for label, kind, data in text_layer_corpus(seed, per_kind=4):
        pages, _ = load_pdf(data, "corpus.pdf", None)
        assert len(pages) == 1
        share = unreadable_share(pages[0].text)
        assert (share > UNREADABLE_PAGE) == (label == "damaged"), (kind, share)


def test_a_few_damaged_pages_are_dropped_with_a_note_naming_them() -> None:
    data = font_pdf([page("ok"), page("lost"), page("ok"), page("pua"), page("ok")])
    doc = parse_document(data, source="/x/report.pdf", kind="pdf")
    assert [p.number for p in doc.pages] == [1, 3, 5]
    assert "\ufffd" not in doc.text and not any("\ue000" <= c <= "\uf8ff" for c in doc.text)
    (note,) = [w for w in doc.warnings if "text layer" in w]
    assert note.startswith("report.pdf: skipped pages 2, 4 of 5: the text layer is damaged (all of their characters")


def test_a_document_mostly_damaged_fails_with_one_line() -> None:
    data = font_pdf([page("lost"), page("ok"), page("pua")])
    with pytest.raises(DocumentError) as caught:
        parse_document(data, source="/x/report.pdf", kind="pdf")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("report.pdf: the text layer is damaged: 2 of 3 pages unreadable (pages 1, 3:")
    assert "fresh copy" in message and "ocrmypdf" in message


def truncated_before_fonts(pages: int = 6) -> bytes:
    """A PDF cut before its font objects, as a download stopped early leaves it: the pages' content streams are
    there, the fonts at the end of the file are not."""
    data = font_pdf([page("ok") for _ in range(pages)])
    return data[: data.rindex(b"/Type /Font /Subtype /Type1 /BaseFont /Helvetica >>") - 20]


def test_ingest_of_a_file_truncated_before_its_fonts_fails_naming_the_damage_once(tmp_path: Path) -> None:
    path = tmp_path / "cut.pdf"
    path.write_bytes(truncated_before_fonts())
    result = runner.invoke(app, ["ingest", str(path)])
    assert result.exit_code == 1
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: {path}: the text layer is damaged: 6 of 6 pages unreadable")
    assert line.count("cut.pdf") == 2  # the path once, and the file name in the OCR command line
    assert DocumentStore().list() == []
    as_json = json.loads(runner.invoke(app, ["ingest", str(path), "--json"]).stdout)
    assert as_json["documents"][0]["status"] == "failed"
    assert "the text layer is damaged" in as_json["documents"][0]["error"]


REAL = Path("/usr/share/doc/libtasn1-doc/libtasn1.pdf")


@pytest.mark.skipif(not REAL.is_file(), reason="Debian's libtasn1-doc is not installed on this machine")
def test_the_truncated_libtasn1_manual_of_issue_39_fails(tmp_path: Path) -> None:
    path = tmp_path / "libtasn1.pdf"
    path.write_bytes(REAL.read_bytes()[:60000])
    with pytest.raises(DocumentError, match=r"the text layer is damaged: 26 of 26 pages unreadable"):
        parse_document(path.read_bytes(), source=str(path), kind="pdf")


def test_an_entry_stored_before_the_check_is_parsed_again(tmp_path: Path) -> None:
    path = tmp_path / "cut.pdf"
    path.write_bytes(font_pdf([page("ok"), page("lost"), page("ok")]))
    store = DocumentStore()
    doc, cached = store.ingest(path)
    assert not cached and [p.number for p in doc.pages] == [1, 3]
    entry = store.path_for(doc.sha256)
    record = json.loads(entry.read_text())
    record["format"] = 1  # as the reader before the check wrote it, with the garbage page kept
    record["pages"].insert(1, {"number": 2, "text": "\ufffd" * 40})
    entry.write_text(json.dumps(record))
    again, cached = store.ingest(path)
    assert not cached and [p.number for p in again.pages] == [1, 3]
    assert json.loads(entry.read_text())["format"] == 2
