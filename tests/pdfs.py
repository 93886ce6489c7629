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
