"""PDFs built by the tests themselves (pypdf only): text pages, drawings, encryption."""

from __future__ import annotations

from io import BytesIO

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
