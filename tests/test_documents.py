"""Tests for maskkv_cli.documents: loading PDFs and text files, cleaning, paging, errors.

Every PDF is built here with pypdf (Helvetica text drawn by hand-written content streams).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from pdfs import BODY, make_pdf

from maskkv_cli.documents import (
    TEXT_PAGE_CHARS,
    Document,
    Page,
    clean_text,
    format_page_ranges,
    load_document,
    split_text_pages,
)
from maskkv_cli.errors import DocumentError

# --------------------------------------------------------------------------------------------
# PDF builders


def write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)
    return path


def assert_error(path: Path, *fragments: str, password: str | None = None) -> str:
    with pytest.raises(DocumentError) as info:
        load_document(path, password=password)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# --------------------------------------------------------------------------------------------
# PDFs


def test_pdf_pages_text_and_metadata(tmp_path: Path) -> None:
    data = make_pdf(BODY)
    path = write(tmp_path, "story.pdf", data)
    doc = load_document(path)
    assert doc.kind == "pdf"
    assert doc.source == str(path)
    assert doc.sha256 == hashlib.sha256(data).hexdigest()
    assert doc.warnings == ()
    assert [p.number for p in doc.pages] == [1, 2, 3, 4, 5]
    # lines wrapped inside a paragraph are joined again
    assert doc.pages[0].text == (
        "Chapter one begins with the harbour at dawn, where the fishing boats return with their "
        "catch and the gulls circle overhead in wide loops. The town slowly wakes."
    )
    assert "lamp oil for the long winter evenings." in doc.pages[1].text
    assert doc.text == "\n\n".join(p.text for p in doc.pages)
    for number, start, end in doc.page_spans():
        assert doc.text[start:end] == doc.pages[number - 1].text
        assert doc.page_at(start) == number
        assert doc.page_at(end - 1) == number


def test_pdf_hyphenation_and_running_headers(tmp_path: Path) -> None:
    topics = ["sales", "staff", "travel", "outlook"]
    pages = [
        ["Annual Report 2024", f"This page talks about {topic} and a long-", f"winded {topic} exam-",
         f"ple of a sentence on {topic} that Conti-", f"Nues with {topic} here.", f"Page {n} of 4"]
        for n, topic in enumerate(topics, start=1)
    ]
    doc = load_document(write(tmp_path, "report.pdf", make_pdf(pages)))
    assert len(doc.pages) == 4
    for page, topic in zip(doc.pages, topics, strict=True):
        assert "Annual Report" not in page.text
        assert "of 4" not in page.text
        assert page.text.startswith(f"This page talks about {topic} and a longwinded {topic} example of")
        assert "Conti- Nues" in page.text  # no join when the next line starts uppercase


def test_pdf_password_rc4(tmp_path: Path) -> None:
    path = write(tmp_path, "secret.pdf", make_pdf(BODY[:2], password="s3cret", algorithm="RC4-128"))
    assert_error(path, "secret.pdf", "password-protected", "--password")
    assert_error(path, "Wrong password", "--password", password="nope")
    doc = load_document(path, password="s3cret")
    assert [p.number for p in doc.pages] == [1, 2]
    assert "harbour at dawn" in doc.pages[0].text


def test_pdf_empty_user_password_opens_without_password(tmp_path: Path) -> None:
    data = make_pdf(BODY[:1], password="", owner_password="owner-only", algorithm="RC4-128")
    doc = load_document(write(tmp_path, "locked-edit.pdf", data))
    assert "harbour at dawn" in doc.text
    # a password for a file that needs none is harmless
    doc = load_document(write(tmp_path, "plain.pdf", make_pdf(BODY[:1])), password="unused")
    assert "harbour at dawn" in doc.text


class _IdentityAES:
    """Stands in for AES while writing (the 'cryptography' package is not installed)."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def encrypt(self, data: bytes) -> bytes:
        return bytes(16) + data

    def decrypt(self, data: bytes, *, strict: bool = True) -> bytes:
        return data[16:]


def test_pdf_aes_without_crypto_dependency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pypdf._encryption as encryption
    from pypdf._crypt_providers import _fallback

    monkeypatch.setattr(encryption, "CryptAES", _IdentityAES)
    data = make_pdf(BODY[:1], password="", algorithm="AES-128")
    # read as pypdf does when 'cryptography' is missing, whatever is installed here
    monkeypatch.setattr(encryption, "CryptAES", _fallback.CryptAES)
    path = write(tmp_path, "aes.pdf", data)
    assert_error(path, "aes.pdf", "AES", "pip install 'pypdf[crypto]'")


def test_pdf_without_text_looks_scanned(tmp_path: Path) -> None:
    path = write(tmp_path, "scan.pdf", make_pdf([None, None, None]))
    assert_error(path, "scan.pdf", "no extractable text", "pages 1-3", "scanned", "OCR", "ocrmypdf")


def test_pdf_some_pages_without_text_warns(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "mixed.pdf", make_pdf([BODY[0], None, BODY[2], None])))
    assert [p.number for p in doc.pages] == [1, 3]
    assert len(doc.warnings) == 1
    assert "no extractable text on 2 pages (2, 4)" in doc.warnings[0]
    assert doc.page_at(len(doc.pages[0].text) + 2) == 3


def test_pdf_truncated_recovers_leading_pages(tmp_path: Path) -> None:
    data = make_pdf(BODY)
    cut = data.index(b"(Fourth, the storm")  # inside page 4's content stream
    doc = load_document(write(tmp_path, "cut.pdf", data[:cut]))
    assert [p.number for p in doc.pages] == [1, 2, 3]
    assert "lighthouse keeper" in doc.pages[2].text
    assert len(doc.warnings) == 1
    warning = doc.warnings[0]
    assert "truncated or damaged" in warning
    assert "3 of 5 pages" in warning
    assert "pages 4-5" in warning


def test_pdf_missing_xref_only_recovers_everything(tmp_path: Path) -> None:
    data = make_pdf(BODY)
    doc = load_document(write(tmp_path, "noxref.pdf", data[: data.rindex(b"xref")]))
    assert [p.number for p in doc.pages] == [1, 2, 3, 4, 5]
    assert "5 of 5 pages" in doc.warnings[0]


def test_pdf_truncated_beyond_recovery(tmp_path: Path) -> None:
    data = make_pdf(BODY)
    path = write(tmp_path, "stub.pdf", data[:60])
    assert_error(path, "stub.pdf", "damaged or truncated", "fresh copy")


def test_pdf_extension_on_non_pdf(tmp_path: Path) -> None:
    path = write(tmp_path, "fake.pdf", "just some words, not a PDF at all\n")
    assert_error(path, "fake.pdf", "not a valid PDF")


def test_pdf_sniffed_without_extension(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "README", make_pdf(BODY[:1])))
    assert doc.kind == "pdf"


# --------------------------------------------------------------------------------------------
# File-level errors


def test_missing_file(tmp_path: Path) -> None:
    assert_error(tmp_path / "nope.pdf", "File not found", "nope.pdf", "Check the path")


def test_a_web_address_is_named_as_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for given in ("https://example.com/report.pdf", Path("http://example.com/a.txt")):  # a Path folds the "//"
        address = str(given).replace(":/", "://", 1) if isinstance(given, Path) else given
        assert_error(given, f"{address} is a web address", "reads local files", f"curl -LO {address}")


def test_directory(tmp_path: Path) -> None:
    assert_error(tmp_path, "is a directory", ".pdf")


def test_unknown_extension_lists_supported(tmp_path: Path) -> None:
    path = write(tmp_path, "slides.docx", b"PK\x03\x04")
    assert_error(path, "unsupported file type '.docx'", ".pdf", ".txt", ".text", ".md", ".markdown")


def test_empty_file(tmp_path: Path) -> None:
    assert_error(write(tmp_path, "empty.txt", b""), "empty.txt", "is empty")
    assert_error(write(tmp_path, "empty.pdf", b""), "empty.pdf", "is empty")


def test_whitespace_only_file(tmp_path: Path) -> None:
    assert_error(write(tmp_path, "blank.md", " \n\t\n \n"), "only whitespace")


# --------------------------------------------------------------------------------------------
# Text files


def test_binary_with_nul_bytes(tmp_path: Path) -> None:
    assert_error(write(tmp_path, "blob.txt", b"ELF\x00\x01\x02binary\x00\x00"), "blob.txt", "looks binary")


def test_utf32_utf16_without_its_mark_and_a_stray_nul_are_read(tmp_path: Path) -> None:
    """UTF-32 with its marker was decoded as UTF-16 (its marker starts as UTF-16's) and refused as binary; UTF-16
    without a marker, and a text with one NUL byte, were refused as binary."""
    text = "The special magic number for lemon is 7123. Caf\u00e9 \u6e2f.\n" * 5
    for name, data in (("u32.txt", text.encode("utf-32")), ("le.txt", text.encode("utf-16-le")),
                       ("be.txt", text.encode("utf-16-be")), ("nul.txt", text.encode() + b"\x00" + text.encode())):
        doc = load_document(write(tmp_path, name, data))
        assert doc.text.count("7123") == (10 if name == "nul.txt" else 5) and "\u6e2f" in doc.text, name
    assert any("read as UTF-16-LE" in w for w in load_document(tmp_path / "le.txt").warnings)


def test_binary_with_control_characters(tmp_path: Path) -> None:
    data = bytes(range(1, 9)) * 40 + b"a little text"
    assert_error(write(tmp_path, "junk", data), "junk", "looks binary")


def test_undecodable_text(tmp_path: Path) -> None:
    data = b"header " + bytes([0x81, 0x8D, 0x90, 0x9D]) * 40
    assert_error(write(tmp_path, "odd.txt", data), "not UTF-8", "convert it to UTF-8")


def test_utf8_with_bom(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "bom.txt", "\ufeffCafé au lait\n".encode()))
    assert doc.text == "Café au lait"
    assert doc.warnings == ()


def test_utf16_with_bom(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "wide.txt", "Grüße aus Köln\r\nZweite Zeile\r\n".encode("utf-16")))
    assert doc.text == "Grüße aus Köln\nZweite Zeile"


def test_cp1252_fallback_warns(tmp_path: Path) -> None:
    data = "He said \u201cbonjour\u201d at the café \u2013 twice.".encode("cp1252")
    doc = load_document(write(tmp_path, "legacy.txt", data))
    assert doc.text == "He said \u201cbonjour\u201d at the café \u2013 twice."
    assert any("Windows-1252" in w for w in doc.warnings)


def test_text_file_without_extension(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "NOTES", "first line\nsecond line\n"))
    assert doc.kind == "text"
    assert doc.text == "first line\nsecond line"


def test_text_form_feeds_are_pages(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "ff.txt", "one\fsecond page\f\ffourth page\n"))
    assert [(p.number, p.text) for p in doc.pages] == [(1, "one"), (2, "second page"), (4, "fourth page")]


def test_one_form_feed_after_a_long_text_does_not_make_it_one_page(tmp_path: Path) -> None:
    """A 4 MB text ending in one form feed was one page of 4.4M characters (every answer "page 1 of 1"): text
    between form feeds longer than any printed page is paged as a text without them, with a note."""
    paragraphs = [f"Paragraph {i}: " + "lorem ipsum dolor sit amet " * 12 for i in range(400)]
    doc = load_document(write(tmp_path, "long.txt", "\n\n".join(paragraphs) + "\n\f"))
    plain = load_document(write(tmp_path, "plain.txt", "\n\n".join(paragraphs) + "\n"))
    assert len(doc.pages) == len(plain.pages) > 30 and doc.text == plain.text
    assert any("form feeds are no page breaks" in w for w in doc.warnings)


def test_text_long_file_split_at_paragraphs(tmp_path: Path) -> None:
    paragraphs = [f"Paragraph {i}: " + "lorem ipsum dolor sit amet " * (10 + i % 7) for i in range(60)]
    text = "\n\n".join(p.strip() for p in paragraphs)
    doc = load_document(write(tmp_path, "long.txt", text))
    assert len(doc.pages) > 3
    assert [p.number for p in doc.pages] == list(range(1, len(doc.pages) + 1))
    assert all(len(p.text) <= TEXT_PAGE_CHARS for p in doc.pages)
    assert doc.text == text  # pages joined by blank lines give the text back
    assert all(p.text.startswith("Paragraph ") for p in doc.pages)  # cut at paragraph starts
    again = load_document(write(tmp_path, "copy.txt", text))
    assert again.pages == doc.pages  # stable page numbers
    assert doc.page_at(doc.n_chars) == doc.pages[-1].number


def test_text_single_huge_paragraph_is_cut_at_spaces() -> None:
    text = "word " * 2000
    pages = split_text_pages(text.strip(), "text", limit=1000)
    assert all(len(p) <= 1000 for p in pages)
    assert " ".join(pages).split() == text.split()


def test_text_hyphen_join_but_no_unwrap(tmp_path: Path) -> None:
    doc = load_document(write(tmp_path, "wrap.txt", "An exam-\nple of\twrapped   text.\r\nNext line.\n"))
    assert doc.text == "An example of wrapped text.\nNext line."


def test_markdown_keeps_structure(tmp_path: Path) -> None:
    code = "```python\ndef f():\n\n    return 1\n```"
    text = "# Title\n\nIntro text.\n\n## Section\n\n- item one\n  - nested item\n\n" + code + "\n"
    doc = load_document(write(tmp_path, "notes.md", text))
    assert doc.kind == "markdown"
    assert doc.text == text.strip()
    assert "    return 1" in doc.text


def test_markdown_pages_start_at_headings() -> None:
    section = "## Part {n}\n\n" + "\n\n".join(["Some sentence about the topic. " * 8] * 3)
    text = "\n\n".join(section.format(n=n) for n in range(8))
    pages = split_text_pages(text, "markdown")
    assert len(pages) > 1
    assert all(page.startswith("## Part") for page in pages)
    fenced = "```\n" + "\n\n".join(["x = 1"] * 50) + "\n```"
    pages = split_text_pages("intro\n\n" + fenced, "markdown", limit=10_000)
    assert pages == ["intro\n\n" + fenced]


# --------------------------------------------------------------------------------------------
# clean_text alone


def test_clean_joins_hyphenated_words_only_before_lowercase() -> None:
    assert clean_text(["exam-\nple"]) == ["example"]
    assert clean_text(["Anglo-\nSaxon"]) == ["Anglo- Saxon"]
    assert clean_text(["exam-\nple"], unwrap_lines=False) == ["example"]
    assert clean_text(["exam-\nple"], join_hyphens=False, unwrap_lines=False) == ["exam-\nple"]


def test_clean_unwraps_paragraph_lines_but_keeps_breaks() -> None:
    page = (
        "This is a long line of running text that wraps at the margin and\n"
        "continues on the next line without a real break in the sentence.\n"
        "\n"
        "Short heading\n"
        "A new paragraph starts here and it is also quite long, long enough.\n"
        "- a list item\n"
        "- another item"
    )
    (cleaned,) = clean_text([page])
    assert cleaned == (
        "This is a long line of running text that wraps at the margin and continues on the next "
        "line without a real break in the sentence.\n\n"
        "Short heading\n"
        "A new paragraph starts here and it is also quite long, long enough.\n"
        "- a list item\n"
        "- another item"
    )
    assert clean_text(["one\ntwo"], unwrap_lines=False) == ["one\ntwo"]


def test_clean_normalises_odd_whitespace() -> None:
    raw = "a\u00a0b\tc\r\nd\u200be\ufeff  f\u2009g\u00adh \u202fi\r\n\r\n\r\n\r\nj\ufb01k  "
    assert clean_text([raw], unwrap_lines=False) == ["a b c\nde f gh i\n\njfik"]


def test_clean_keeps_the_joiners_words_and_emoji_are_spelt_with() -> None:
    """U+200C and U+200D were dropped as zero-width spaces: "می‌خواهم" lost its non-joiner and a family emoji
    became three people."""
    persian, family = "می‌خواهم", "👨‍👩‍👧"
    assert clean_text([f"{persian} {family}​!"], unwrap_lines=False) == [f"{persian} {family}!"]


def test_clean_drops_repeated_headers_and_footers() -> None:
    words = ["apples", "pears", "plums", "figs", "limes"]
    pages = [f"ACME Corp — Quarterly 2024\nPage {n}\nAbout {w}.\nMore on {w}.\n- {n} -" for n, w in
             enumerate(words, start=1)]
    cleaned = clean_text(pages, unwrap_lines=False)
    assert cleaned == [f"About {w}.\nMore on {w}." for w in words]
    # on half the pages is enough
    pages = ["Header 1\nbody a\nx", "Header 2\nbody b\ny", "Intro\nbody c\nz", "Other\nbody d\nw"]
    assert [c.split("\n")[0] for c in clean_text(pages, unwrap_lines=False)] == [
        "body a", "body b", "Intro", "Other"
    ]


def test_clean_keeps_sentences_that_repeat_at_the_pages_edges() -> None:
    """A page total or a fact restated at the foot of pages is body text: digits ignored, "Total for this page: 980
    units." was taken for a footer on every page, and a needle ending two of four pages was dropped from both (the
    answer then "not in the document"). Short lines without a sentence's end still go."""
    bodies = ["About apples.", "About pears.", "About plums.", "About figs."]
    totals = [f"Running title\n{b}\nTotal for this page: {n} units.\nPage {n}" for n, b in enumerate(bodies, 1)]
    assert clean_text(totals, unwrap_lines=False) == [f"{b}\nTotal for this page: {n} units." for n, b in
                                                      enumerate(bodies, 1)]
    fact = "The special magic number for lemon is 7123."
    pages = [f"{b}\n{fact}" if n % 2 else b + "\nMore." for n, b in enumerate(bodies)]
    assert sum(fact in page for page in clean_text(pages, unwrap_lines=False)) == 2


def test_clean_keeps_headers_with_fewer_than_three_pages() -> None:
    pages = ["Header\nbody one", "Header\nbody two"]
    assert clean_text(pages, unwrap_lines=False) == pages


def test_clean_never_empties_a_page() -> None:
    pages = ["Same line\nSame end"] * 4
    assert all(clean_text(pages, unwrap_lines=False))


# --------------------------------------------------------------------------------------------
# Document helpers


def test_document_spans_page_at_and_round_trip() -> None:
    doc = Document(
        source="/docs/a.txt",
        kind="text",
        pages=(Page(1, "abc"), Page(3, "defg")),
        sha256="0" * 64,
        warnings=("note",),
    )
    assert doc.text == "abc\n\ndefg"
    assert doc.n_chars == 9
    assert doc.page_spans() == [(1, 0, 3), (3, 5, 9)]
    assert [doc.page_at(i) for i in range(10)] == [1, 1, 1, 1, 1, 3, 3, 3, 3, 3]
    with pytest.raises(ValueError):
        doc.page_at(10)
    with pytest.raises(ValueError):
        doc.page_at(-1)
    assert Document.from_dict(doc.to_dict()) == doc
    with pytest.raises(ValueError):
        Document.from_dict({"source": "x"})


def test_format_page_ranges() -> None:
    assert format_page_ranges([7, 1, 2, 3, 9, 10]) == "1-3, 7, 9-10"
    assert format_page_ranges([4]) == "4"


# --------------------------------------------------------------------------------------------
# Token counting (maskkv_cli.documents.tokens)


@pytest.fixture
def fresh_tokencount(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Reset the module's memo and record any attempt to open a network connection."""
    import socket

    from maskkv_cli.documents import tokens as tokencount

    attempts: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise OSError("network access attempted in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    tokencount._reset_for_tests()
    yield attempts
    tokencount._reset_for_tests()


def test_count_tokens_with_model_tokenizer(fresh_tokencount: list[object]) -> None:
    from maskkv_cli.documents.tokens import count_tokens

    class Plain:
        def encode(self, text: str) -> list[int]:
            return [1] * len(text.split())

    class HuggingFaceLike:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [0] * (len(text.split()) + (2 if add_special_tokens else 0))

    class EncodingLike:
        def __init__(self, n: int) -> None:
            self.ids = list(range(n))

    class TokenizersLike:
        def encode(self, text: str) -> EncodingLike:
            return EncodingLike(len(text))

    assert count_tokens("a b c", Plain()) == (3, "model tokenizer")
    assert count_tokens("a b c", HuggingFaceLike()) == (3, "model tokenizer")  # no special tokens
    assert count_tokens("abcd", TokenizersLike()) == (4, "model tokenizer")


def test_count_tokens_offline_estimate_without_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_tokencount: list[object]
) -> None:
    from maskkv_cli.documents import tokens as tokencount

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.warns(tokencount.TokenCountWarning, match="estimates"):
        count, method = tokencount.count_tokens("x" * 41)
    assert (count, method) == (11, "estimate (~4 chars/token; tiktoken encoding not cached locally)")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would fail here
        assert tokencount.count_tokens("abcd")[0] == 1
    assert fresh_tokencount == []
    assert list(tmp_path.iterdir()) == []


def test_count_tokens_cache_disabled(monkeypatch: pytest.MonkeyPatch, fresh_tokencount: list[object]) -> None:
    from maskkv_cli.documents import tokens as tokencount

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    assert tokencount.tiktoken_cache_dir() is None
    with pytest.warns(tokencount.TokenCountWarning):
        assert tokencount.count_tokens("")[1].startswith("estimate")
    assert fresh_tokencount == []


def test_tiktoken_cache_dir_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from maskkv_cli.documents.tokens import tiktoken_cache_dir

    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    monkeypatch.delenv("DATA_GYM_CACHE_DIR", raising=False)
    assert tiktoken_cache_dir() == Path(tempfile.gettempdir()) / "data-gym-cache"
    monkeypatch.setenv("DATA_GYM_CACHE_DIR", str(tmp_path / "gym"))
    assert tiktoken_cache_dir() == tmp_path / "gym"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tk"))
    assert tiktoken_cache_dir() == tmp_path / "tk"


def test_cached_encoding_needs_the_right_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_tokencount: list[object]
) -> None:
    from maskkv_cli.documents import tokens as tokencount

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    blob = tmp_path / hashlib.sha1(tokencount.CL100K_URL.encode()).hexdigest()
    blob.write_bytes(b"not the real file")
    assert tokencount.cached_encoding_path() is None  # wrong content counts as absent
    monkeypatch.setattr(tokencount, "CL100K_SHA256", hashlib.sha256(b"not the real file").hexdigest())
    assert tokencount.cached_encoding_path(sha256=tokencount.CL100K_SHA256) == blob
    # Our check passes but tiktoken rejects the file and would download it: that download is
    # refused, and we fall back to the estimate.
    monkeypatch.setattr(tokencount, "cached_encoding_path", lambda *a, **k: blob)
    with pytest.warns(tokencount.TokenCountWarning):
        count, method = tokencount.count_tokens("abcdefgh")
    assert (count, method) == (2, tokencount.METHOD_ESTIMATE_NOT_CACHED)
    assert not blob.exists()  # tiktoken dropped the bad file, then tried to fetch it again
    assert fresh_tokencount == []


def test_count_tokens_loads_tiktoken_only_from_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_tokencount: list[object]
) -> None:
    import tiktoken

    from maskkv_cli.documents import tokens as tokencount

    class FakeEncoding:
        def encode(self, text: str, disallowed_special: object = "all") -> list[int]:
            assert disallowed_special == ()  # special-token text is counted, not rejected
            return [7] * len(text.split())

    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: FakeEncoding())
    monkeypatch.setattr(tokencount, "cached_encoding_path", lambda *a, **k: tmp_path / "blob")
    assert tokencount.count_tokens("one two <|endoftext|>") == (3, "tiktoken cl100k_base")


def test_count_tokens_uses_tiktoken_when_cached(
    monkeypatch: pytest.MonkeyPatch, fresh_tokencount: list[object]
) -> None:
    from maskkv_cli.documents import tokens as tokencount

    if tokencount.cached_encoding_path() is None:
        pytest.skip("cl100k_base is not in tiktoken's local cache on this machine")
    assert tokencount.count_tokens("hello world") == (2, "tiktoken cl100k_base")
    assert fresh_tokencount == []


@pytest.mark.filterwarnings("ignore::maskkv_cli.documents.tokens.TokenCountWarning")  # no tokenizer: an estimate
def test_a_pipe_named_like_a_document_fails_instead_of_waiting(tmp_path) -> None:
    """A FIFO named ``pipe.txt`` blocked ``load_document`` (and a whole ``ingest_all``) for ever, waiting for a
    writer; it is refused as not a regular file, and an ingest of its folder goes on with the other files."""
    import os

    from maskkv_cli.documents.ingest import discover, ingest_all
    from maskkv_cli.documents.store import DocumentStore

    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "notes.txt").write_text("The river runs past the mill.\n")
    with pytest.raises(DocumentError, match="not a regular file"):
        load_document(tmp_path / "pipe.txt")
    outcomes = list(ingest_all(DocumentStore(tmp_path / "store"), discover([tmp_path]).files))
    assert len(outcomes) == 2 and sum(1 for o in outcomes if o.error) == 1
