"""Named haystack sources: real text every machine with Python has, to hide needles in.

The tiny model is trained on some of these families and evaluated on one it never saw (``HELD_OUT``):

- ``corpus``: the package's own English corpus (``maskkv_cli/assets/corpus``).
- ``pydoc-topics``: the language reference topics behind ``help()`` (``pydoc_data.topics``).
- ``stdlib-train`` / ``stdlib-heldout``: docstrings (module, class, function) of the standard library's top-level
  modules, read with ``ast`` (nothing is imported or run). A module is held out when the first byte of the
  SHA-256 of its name is below 64 (a quarter of the modules): the split depends only on the name, so it is the
  same on every Python version, although the text of each module may differ between versions.
- ``pdf-train`` / ``pdf-heldout``: the same docstrings typeset into a PDF by ``pypdf`` (wrapped lines with
  hyphenated breaks, a running header and page-number footer, tables of numbers), then read back by the same
  code as ``maskkv ask`` on a user's PDF, so the text looks as extracted PDF text does.
- ``docs``: the project's own ``docs/*.md`` (only in a source checkout; never shipped in the package).
- ``license``: the license texts of the Python installation (``LICENSE.txt`` beside the standard library).

Nothing here is shipped with the model: the texts are read at training or benchmark time from the machine.
"""

from __future__ import annotations

import ast
import hashlib
import random
import sys
import sysconfig
import textwrap
from functools import lru_cache
from io import BytesIO
from pathlib import Path

from maskkv_cli.documents.corpus import load_corpus, split_paragraphs

HELD_OUT = "stdlib-heldout"
SOURCES: tuple[str, ...] = ("corpus", "pydoc-topics", "stdlib-train", "stdlib-heldout", "pdf-train", "pdf-heldout",
                            "docs", "license")
HELD_OUT_FAMILY: frozenset[str] = frozenset({"stdlib-heldout", "pdf-heldout"})
_HELD_OUT_BELOW = 64  # first byte of sha256(module name) below this: held out (1 module in 4)
_MIN_PARAGRAPH_CHARS = 40
_PDF_LINE_CHARS = 78
_PDF_LINES_PER_PAGE = 46


def is_held_out_module(name: str) -> bool:
    """Whether a standard-library module belongs to the held-out family (by a hash of its name only)."""
    return hashlib.sha256(name.encode()).digest()[0] < _HELD_OUT_BELOW


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if not p.name.startswith("_") and p.stem not in ("this", "antigravity"))


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out: list[str] = []
    for node in ast.walk(tree):  # the module first, then its classes and functions
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                out.append(doc)
    return list(dict.fromkeys(out))


def _keep(paragraphs: list[str]) -> list[str]:
    """Paragraphs long enough to be text, without the needle phrase (the project's docs quote the task)."""
    return [p for p in paragraphs if len(p) >= _MIN_PARAGRAPH_CHARS and "special magic number" not in p.lower()]


@lru_cache(maxsize=2)
def _stdlib(held_out: bool) -> tuple[str, ...]:
    paragraphs: list[str] = []
    for path in _stdlib_files():
        if is_held_out_module(path.stem) == held_out:
            for doc in _docstrings(path):
                paragraphs.extend(split_paragraphs(doc))
    return tuple(_keep(paragraphs))


def _pydoc_topics() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    paragraphs: list[str] = []
    for name in sorted(topics):
        paragraphs.extend(split_paragraphs(topics[name]))
    return tuple(_keep(paragraphs))


def _docs() -> tuple[str, ...]:
    root = Path(__file__).resolve().parents[2] / "docs"
    paragraphs: list[str] = []
    for path in sorted(root.glob("*.md")):
        paragraphs.extend(split_paragraphs(path.read_text(encoding="utf-8")))
    return tuple(_keep(paragraphs))


def _license() -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    paragraphs: list[str] = []
    for path in sorted(root.glob("LICENSE*")):
        paragraphs.extend(split_paragraphs(path.read_text(encoding="utf-8", errors="replace")))
    return tuple(_keep(paragraphs))


def _wrap_hyphenated(paragraph: str, width: int, rng: random.Random) -> list[str]:
    """Lines of at most about ``width`` characters; some long words are broken with a hyphen, as typesetters do."""
    lines = textwrap.wrap(paragraph, width, break_long_words=True)
    out: list[str] = []
    for i, line in enumerate(lines):
        words = lines[i + 1].split(" ", 1) if i + 1 < len(lines) else []
        if words and len(words[0]) >= 8 and words[0].isalpha() and rng.random() < 0.5:
            cut = len(words[0]) // 2
            line = f"{line} {words[0][:cut]}-"
            lines[i + 1] = words[0][cut:] + (f" {words[1]}" if len(words) > 1 else "")
        out.append(line)
    return out


def _table(rng: random.Random) -> list[str]:
    cols = rng.randint(3, 5)
    head = " ".join(rng.choice(("Name", "Size", "Count", "Rate", "Total", "Mean", "Time", "Error", "Level"))
                    for _ in range(cols))
    rows = [head]
    for r in range(rng.randint(3, 7)):
        cells = [f"item{r + 1}"] + [str(round(rng.uniform(0, 1000), rng.choice((0, 1, 2)))) for _ in range(cols - 1)]
        rows.append(" ".join(cells))
    return rows


def pdf_lines(paragraphs: tuple[str, ...], seed: int) -> list[list[str]]:
    """Pages of text lines for a PDF of ``paragraphs``: header, wrapped body with a blank line between
    paragraphs, a table every few paragraphs, a page-number footer."""
    rng = random.Random(seed)
    body: list[str] = []
    for number, paragraph in enumerate(paragraphs):
        body.extend(_wrap_hyphenated(paragraph, _PDF_LINE_CHARS, rng))
        body.append("")
        if number % 7 == 6:
            body.extend(_table(rng))
            body.append("")
    pages: list[list[str]] = []
    per_page = _PDF_LINES_PER_PAGE - 4
    for start in range(0, len(body), per_page):
        page_no = len(pages) + 1
        pages.append(["Python Library Notes", "", *body[start:start + per_page], "", f"Page {page_no}"])
    return pages


def _write_pdf(pages: list[list[str]]) -> bytes:
    from pypdf import PdfWriter
    from pypdf.generic import ContentStream, DictionaryObject, NameObject

    font = DictionaryObject({NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"),
                             NameObject("/BaseFont"): NameObject("/Helvetica")})
    writer = PdfWriter()
    for lines in pages:
        page = writer.add_blank_page(612, 792)
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
        escaped = [ln.encode("latin-1", "replace").decode("latin-1").replace("\\", "\\\\").replace("(", "\\(")
                   .replace(")", "\\)") for ln in lines]
        ops = ["BT", "/F1 10 Tf", "15 TL", "60 760 Td", *(f"({ln}) Tj T*" for ln in escaped), "ET"]
        content = ContentStream(None, writer)
        content.set_data("\n".join(ops).encode("latin-1"))
        page.replace_contents(content)
    out = BytesIO()
    writer.write(out)
    return out.getvalue()


@lru_cache(maxsize=2)
def _pdf(held_out: bool, max_paragraphs: int = 900) -> tuple[str, ...]:
    from maskkv_cli.documents import parse_document

    paragraphs = _stdlib(held_out)
    # A spread sample keeps the PDF (and its extraction) a few seconds of work.
    stride = max(1, len(paragraphs) // max_paragraphs)
    data = _write_pdf(pdf_lines(paragraphs[::stride], seed=int(held_out)))
    doc = parse_document(data, source="pdf-heldout.pdf" if held_out else "pdf-train.pdf", kind="pdf")
    return tuple(_keep(split_paragraphs(doc.text)))


def load_source(name: str) -> list[str]:
    """Paragraphs of a named source (``SOURCES``); ValueError for an unknown name or a source with no text here."""
    loaders = {
        "corpus": lambda: tuple(load_corpus()),
        "pydoc-topics": _pydoc_topics,
        "stdlib-train": lambda: _stdlib(False),
        "stdlib-heldout": lambda: _stdlib(True),
        "pdf-train": lambda: _pdf(False),
        "pdf-heldout": lambda: _pdf(True),
        "docs": _docs,
        "license": _license,
    }
    if name not in loaders:
        raise ValueError(f"unknown haystack source {name!r}; choose from {', '.join(SOURCES)} or give a file")
    paragraphs = list(loaders[name]())
    if not paragraphs:
        raise ValueError(f"haystack source {name!r} has no text on this machine (Python {sys.version.split()[0]})")
    return paragraphs


def source_digest(paragraphs: list[str]) -> str:
    """SHA-256 of a source's paragraphs (the text differs between Python versions; results record which)."""
    return hashlib.sha256("\n\n".join(paragraphs).encode()).hexdigest()
