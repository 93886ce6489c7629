"""PDFs built by the tests themselves (pypdf only): text pages, drawings, encryption."""

from __future__ import annotations

from io import BytesIO
from typing import Any

from pypdf import PdfWriter
from pypdf.generic import ContentStream, DictionaryObject, NameObject


def _escape(line: str) -> str:
    return line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def _font_resources() -> DictionaryObject:
    helvetica = DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
        }
    )
    return DictionaryObject({NameObject("/Font"): DictionaryObject({NameObject("/F1"): helvetica})})


def make_pdf(
    pages: list[list[str] | None],
    *,
    password: str | None = None,
    owner_password: str | None = None,
    algorithm: str = "RC4-128",
) -> bytes:
    """One PDF page per entry: a list of text lines, or None for a page with only a drawing."""
    writer = PdfWriter()
    for lines in pages:
        page = writer.add_blank_page(612, 792)
        content = ContentStream(None, writer)
        if lines is None:
            content.set_data(b"0.5 g 72 72 400 600 re f")  # a grey box: no text at all
        else:
            page[NameObject("/Resources")] = _font_resources()
            ops = ["BT", "/F1 11 Tf", "14 TL", "72 740 Td"]
            ops += [f"({_escape(line)}) Tj T*" for line in lines]
            ops.append("ET")
            content.set_data("\n".join(ops).encode("latin-1"))
        page.replace_contents(content)
    if password is not None:
        writer.encrypt(password, owner_password, algorithm=algorithm)
    out = BytesIO()
    writer.write(out)
    return out.getvalue()


BODY = [
    [
        "Chapter one begins with the harbour at dawn, where the fishing",
        "boats return with their catch and the gulls circle overhead in",
        "wide loops. The town slowly wakes.",
    ],
    [
        "In the second part the narrator walks to the market. Every stall",
        "sells something different: bread, fish, rope and lamp oil for the",
        "long winter evenings.",
    ],
    [
        "The third section describes the lighthouse keeper, a patient man",
        "who writes letters to his sister every week and never sends them.",
    ],
    [
        "Fourth, the storm arrives. Waves break over the harbour wall and",
        "the boats strain against their ropes through the night.",
    ],
    [
        "Finally the morning is calm again, and the story ends where it",
        "began, with the boats going out and the gulls following them.",
    ],
]


def write_objects(objects: list[bytes]) -> bytes:
    """A PDF file of ``objects`` (object 1 the catalog), numbered from 1, with a correct cross-reference table."""
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def raw_pdf(streams: list[tuple[bytes, bytes]]) -> bytes:
    """A PDF written by hand, one page per ``(stream dictionary, stream bytes)`` content stream.

    Nothing is checked or re-encoded, so a test can declare any /Length or /Filter; the
    cross-reference table is correct.
    """
    n = len(streams)
    font = 3 + 2 * n
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n)).encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % n]
    for i, (head, data) in enumerate(streams):
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       b"/Resources << /Font << /F1 %d 0 R >> >> /Contents %d 0 R >>" % (font, 4 + 2 * i))
        objects.append(head + b"\nstream\n" + data + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    return write_objects(objects)


def text_stream(line: str) -> tuple[bytes, bytes]:
    """An uncompressed content stream that shows one line of text."""
    data = f"BT /F1 12 Tf 72 700 Td ({_escape(line)}) Tj ET".encode("latin-1")
    return b"<< /Length %d >>" % len(data), data


def bomb_stream(inflated: int) -> tuple[bytes, bytes]:
    """A Flate content stream that inflates to ``inflated`` bytes (one line of text, then spaces)."""
    import zlib

    packer = zlib.compressobj(1)
    parts = [packer.compress(b"BT /F1 12 Tf 72 700 Td (inflated) Tj ET\n")]
    chunk = b" " * (1 << 20)
    for _ in range(inflated // len(chunk) + 1):
        parts.append(packer.compress(chunk))
    data = b"".join(parts) + packer.flush()
    return b"<< /Length %d /Filter /FlateDecode >>" % len(data), data


# ------------------------------------------------------------------------------------------------------------------
# Damaged text layers: the corpus the text-layer threshold (maskkv_cli/documents/textlayer.py) is chosen on.

# The fonts a line can be drawn in: Helvetica ("ok"); a font object the file does not hold ("lost": what a truncated
# file leaves, extracted as U+FFFD); Helvetica with a ToUnicode map into the private-use area ("pua": extracted as
# U+E000.., as subset and symbol fonts without a real map are).
FONTS = {"ok": "/F1", "lost": "/F2", "pua": "/F3"}
_PUA_CMAP = (b"/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /PUA def\n"
             b"1 begincodespacerange <00> <FF> endcodespacerange\n"
             b"1 beginbfrange <20> <FF> <E020> endbfrange\n"
             b"endcmap CMapName currentdict /CMap defineresource pop end end")


def font_pdf(pages: list[list[list[tuple[str, str]]]]) -> bytes:
    """A PDF written by hand: each page a list of lines, each line a list of ``(font, text)`` runs drawn one after
    the other (``font`` a key of ``FONTS``). The "lost" font names an object the file does not hold."""
    n = len(pages)
    first_font = 3 + 2 * n
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(n)).encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % n]
    fonts = b"<< /F1 %d 0 R /F2 %d 0 R /F3 %d 0 R >>" % (first_font, first_font + 100, first_font + 1)
    for i, lines in enumerate(pages):
        ops = ["BT", "14 TL", "72 740 Td"]
        for runs in lines:
            for font, text in runs:
                ops.append(f"{FONTS[font]} 11 Tf ({_escape(text)}) Tj")
            ops.append("T*")
        ops.append("ET")
        data = "\n".join(ops).encode("latin-1", errors="replace")
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font " + fonts
                       + b" >> /Contents %d 0 R >>" % (4 + 2 * i))
        objects.append(b"<< /Length %d >>\nstream\n" % len(data) + data + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /ToUnicode %d 0 R >>" % (first_font + 2))
    objects.append(b"<< /Length %d >>\nstream\n" % len(_PUA_CMAP) + _PUA_CMAP + b"\nendstream")
    return write_objects(objects)


# The kinds of page in the corpus, by label. Clean pages hold real text, some with the odd unreadable glyph real
# files have (a bullet or a symbol drawn in a font without a Unicode map); damaged pages are drawn in a broken font,
# some under an intact page number or running header.
CLEAN_KINDS = ("prose", "bullets-lost", "bullets-pua", "symbols-pua", "table", "short-list")
DAMAGED_KINDS = ("lost", "pua", "lost-body", "pua-body")


def _lines(rng: Any, paragraphs: list[str], count: int, width: int = 64) -> list[str]:
    words = " ".join(rng.choice(paragraphs) for _ in range(3)).encode("latin-1", "replace").decode("latin-1").split()
    start = rng.randrange(max(1, len(words) - count * 12))
    lines: list[str] = []
    line = ""
    for word in words[start:]:
        if len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
            if len(lines) == count:
                break
        else:
            line = f"{line} {word}".strip()
    return lines or [line]


def corpus_page(kind: str, rng: Any, paragraphs: list[str]) -> list[list[tuple[str, str]]]:
    """One page of the given kind (``CLEAN_KINDS``, ``DAMAGED_KINDS``, or ``mixed-F``: a share F of the lines in the
    lost font), its text drawn from ``paragraphs``."""
    lines = _lines(rng, paragraphs, rng.randint(4, 24))
    if kind == "prose":
        return [[("ok", line)] for line in lines]
    if kind in ("bullets-lost", "bullets-pua"):  # an unmapped bullet in front of every line
        font = kind.split("-")[1]
        return [[(font, "\x95"), ("ok", " " + line)] for line in lines]
    if kind == "short-list":  # one to three words per item, each behind an unmapped bullet: the worst clean case
        return [[("lost", "\x95"), ("ok", " " + " ".join(line.split()[: rng.randint(1, 3)]))] for line in lines]
    if kind == "symbols-pua":  # a symbol font without a map: two symbols in every line
        out = []
        for line in lines:
            words = line.split()
            cut = rng.randrange(1, max(2, len(words)))
            out.append([("ok", " ".join(words[:cut]) + " "), ("pua", "\xb6"), ("ok", " " + " ".join(words[cut:])),
                        ("pua", " \xa7")])
        return out
    if kind == "table":
        return [[("ok", "  ".join(str(rng.randrange(10 ** rng.randint(1, 6))) for _ in range(rng.randint(3, 7))))]
                for _ in lines]
    if kind in ("lost", "pua"):
        return [[(kind, line)] for line in lines]
    if kind in ("lost-body", "pua-body"):  # a broken body under an intact page number or running header
        font = kind.split("-")[0]
        head = rng.choice([str(rng.randint(1, 400)), f"Chapter {rng.randint(1, 20)}"])
        return [[("ok", head)], *[[(font, line)] for line in lines]]
    if kind.startswith("mixed-"):
        share = float(kind.split("-")[1])
        broken = set(rng.sample(range(len(lines)), round(share * len(lines))))
        return [[("lost" if i in broken else "ok", line)] for i, line in enumerate(lines)]
    raise ValueError(f"unknown page kind {kind!r}")


def text_layer_corpus(seed: int, per_kind: int = 12) -> list[tuple[str, str, bytes]]:
    """``(label, kind, one-page PDF)`` for ``per_kind`` pages of every clean and damaged kind, text and layout drawn
    with ``seed``: seed 1 chose the threshold, seed 2 (fixed with it) confirms it."""
    import random

    from maskkv_cli.documents.corpus import load_corpus

    rng = random.Random(seed)
    paragraphs = load_corpus()
    out = []
    for label, kinds in (("clean", CLEAN_KINDS), ("damaged", DAMAGED_KINDS)):
        for kind in kinds:
            out += [(label, kind, font_pdf([corpus_page(kind, rng, paragraphs)])) for _ in range(per_kind)]
    return out


# ------------------------------------------------------------------------------------------------------------------
# A long PDF for reading in parts: text the embedded model never saw (the held-out standard-library docstrings).


def long_pdf_pages(pages: int = 36, lines_per_page: int = 20, fact: str | None = None,
                   fact_page: int = 1) -> list[list[str]]:
    """The lines of a ``pages``-page document typeset from the held-out standard-library docstrings
    (``tasks.sources``'s ``stdlib-heldout``): a running header, ``lines_per_page`` wrapped lines, a page number;
    ``fact`` (a sentence) as a line of its own in the middle of page ``fact_page``."""
    import textwrap

    from maskkv_cli.tasks.sources import load_source

    body: list[str] = []
    for paragraph in load_source("stdlib-heldout"):
        body += textwrap.wrap(paragraph, 78) + [""]
        if len(body) >= pages * lines_per_page:
            break
    out = []
    for number in range(1, pages + 1):
        lines = body[(number - 1) * lines_per_page: number * lines_per_page]
        if fact is not None and number == fact_page:
            lines.insert(len(lines) // 2, fact)
        out.append(["Python Library Notes", "", *lines, "", f"Page {number}"])
    return out
