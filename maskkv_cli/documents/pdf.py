"""PDF files: text per page with pypdf, unlocking, and repair of files whose page tree or cross-reference table
is broken (the pages are found by walking the tree with inherited attributes, else by scanning the objects)."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from io import BytesIO
from typing import Any

from maskkv_cli.documents.clean import clean_text
from maskkv_cli.documents.model import Page, format_page_ranges, pages_label, plural
from maskkv_cli.errors import DocumentError

__all__ = ["load_pdf"]


class _Collect(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record.getMessage())


@contextmanager
def _quiet_pypdf() -> Iterator[list[str]]:
    """Collect pypdf's log messages instead of letting them reach the terminal."""
    logger = logging.getLogger("pypdf")
    messages: list[str] = []
    handler = _Collect(messages)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _aes_error(display: str) -> DocumentError:
    return DocumentError(
        f"{display} is AES-encrypted and reading it needs the 'cryptography' package; "
        "run: pip install 'pypdf[crypto]'"
    )


def _unlock(reader: Any, password: str | None, display: str) -> None:
    from pypdf import PasswordType
    from pypdf.errors import DependencyError

    if not reader.is_encrypted:
        return
    try:
        if reader.decrypt("") != PasswordType.NOT_DECRYPTED:
            return
        if password is None:
            raise DocumentError(f"{display} is password-protected; pass its password with --password.")
        if reader.decrypt(password) == PasswordType.NOT_DECRYPTED:
            raise DocumentError(f"Wrong password for {display}; check the value passed with --password.")
    except DependencyError:
        raise _aes_error(display) from None
    except DocumentError:
        raise
    except Exception as exc:
        raise DocumentError(
            f"Cannot decrypt {display} ({exc}); its encryption is not supported. "
            "Save an unencrypted copy and load that."
        ) from None


def check_password(data: bytes, display: str, password: str | None) -> None:
    """Refuse ``password`` (DocumentError) where the PDF ``data`` is encrypted and it does not open it, as reading the
    file would: a stored copy of its text is handed out only to whoever could read the file itself."""
    if b"/Encrypt" not in data:  # an encrypted PDF names its encryption dictionary in its trailer
        return
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    with _quiet_pypdf():
        try:
            reader = PdfReader(BytesIO(data), strict=False)
        except DependencyError:
            raise _aes_error(display) from None
        except Exception:  # noqa: BLE001 - damaged: the stored copy was read as well as it could be
            return
        _unlock(reader, password, display)


def _with_inherited(page: Any, node: Any) -> Any:
    """Copy inheritable attributes (resources, boxes, rotation) from ``node``'s ancestors."""
    from pypdf.generic import DictionaryObject

    parent = node.get("/Parent")
    for _ in range(64):
        try:
            parent = parent.get_object() if parent is not None else None
        except Exception:
            break
        if not isinstance(parent, DictionaryObject):
            break
        for key in ("/Resources", "/MediaBox", "/CropBox", "/Rotate"):
            if key not in page and key in parent:
                page[key] = parent.raw_get(key)
        parent = parent.get("/Parent")
    return page


def _walk_page_tree(reader: Any) -> tuple[list[Any], int]:
    """Walk /Pages of a damaged file; return (slots, declared count), None for unreadable kids."""
    from pypdf import PageObject
    from pypdf.generic import DictionaryObject, IndirectObject

    root = reader.root_object.get("/Pages")
    root = root.get_object() if root is not None else None
    if not isinstance(root, DictionaryObject):
        raise ValueError("no page tree")
    slots: list[Any] = []
    seen: set[int] = set()

    def visit(node: Any, depth: int) -> None:
        if depth > 64 or id(node) in seen:
            return
        seen.add(id(node))
        try:
            kids = node.get("/Kids")
            kids = kids.get_object() if kids is not None else []
        except Exception:
            kids = []
        for kid in kids:
            try:
                obj = kid.get_object()
            except Exception:
                obj = None
            if not isinstance(obj, DictionaryObject) or not obj:
                slots.append(None)
            elif obj.get("/Type") == "/Pages" or "/Kids" in obj:
                visit(obj, depth + 1)
            else:
                if isinstance(kid, IndirectObject):
                    page = PageObject(reader, kid)
                else:
                    page = PageObject(reader, None)
                    page.update(obj)
                slots.append(_with_inherited(page, obj))

    visit(root, 0)
    try:
        declared = int(root.get("/Count", 0))
    except (TypeError, ValueError):
        declared = 0
    return slots, declared


def _scan_page_objects(reader: Any) -> list[Any]:
    """Find /Page objects anywhere in the file, in object-number order."""
    from pypdf import PageObject
    from pypdf.generic import DictionaryObject, IndirectObject

    numbers: dict[int, int] = {}
    for generation, table in reader.xref.items():
        for number in table:
            numbers.setdefault(number, generation)
    for number in reader.xref_objStm:
        numbers.setdefault(number, 0)
    pages: list[Any] = []
    for number in sorted(numbers):
        try:
            ref = IndirectObject(number, numbers[number], reader)
            obj = ref.get_object()
        except Exception:
            continue
        if isinstance(obj, DictionaryObject) and obj.get("/Type") == "/Page":
            pages.append(_with_inherited(PageObject(reader, ref), obj))
    return pages


def _open_repaired(
    data: bytes, display: str, password: str | None, limits: list[str]
) -> tuple[list[Any], int, bool]:
    """Re-open a PDF pypdf could not read, rebuilding its cross-reference table.

    Returns (page slots, expected page count, whether page order is a guess).  pypdf's safety
    limits hit on the way are appended to ``limits``; when nothing can be recovered they, not
    "damaged", are what the error names.
    """
    from pypdf import PdfReader
    from pypdf.errors import DependencyError
    from pypdf.generic import NameObject, NumberObject

    def unreadable() -> DocumentError:
        if limits:
            return _limit_error(display, limits[0])
        return DocumentError(
            f"{display} is damaged or truncated and no page could be recovered; "
            "get a fresh copy of the file (re-download or re-export it)."
        )

    # A trailing startxref of 0 makes pypdf rebuild its cross-reference table by scanning.
    try:
        reader = PdfReader(BytesIO(data + b"\nstartxref\n0\n%%EOF\n"), strict=False)
    except DependencyError:
        raise _aes_error(display) from None
    except Exception as exc:
        _note_limit(exc, limits)
        raise unreadable() from None
    _unlock(reader, password, display)
    if "/Size" not in reader.trailer:  # the trailer was lost; let pypdf search for the catalog
        numbers = [n for table in reader.xref.values() for n in table] + list(reader.xref_objStm)
        reader.trailer[NameObject("/Size")] = NumberObject(max(numbers, default=0) + 1)
    try:
        slots, declared = _walk_page_tree(reader)
    except DependencyError:
        raise _aes_error(display) from None
    except Exception as exc:
        _note_limit(exc, limits)
        slots, declared = [], 0
    guessed = False
    if not any(slot is not None for slot in slots):
        slots = _scan_page_objects(reader)
        declared, guessed = 0, True
    if not slots:
        raise unreadable()
    return slots, max(declared, len(slots)), guessed


# pypdf raises LimitReachedError both for its resource limits and for some reference cycles; a
# cycle is damage, so only the others count as "exceeds a safety limit".
_CYCLE_WORDS = re.compile(r"cycl|loop|self.reference", re.IGNORECASE)


def _limit_reason(exc: BaseException) -> str | None:
    """pypdf's message when ``exc`` is one of its resource limits, else None."""
    from pypdf.errors import LimitReachedError

    if not isinstance(exc, LimitReachedError) or _CYCLE_WORDS.search(str(exc)):
        return None
    return str(exc).strip() or type(exc).__name__


def _note_limit(exc: BaseException, limits: list[str]) -> None:
    reason = _limit_reason(exc)
    if reason is not None:
        limits.append(reason)


def _limit_detail(reason: str) -> str:
    """Say which of pypdf's limits was hit in words; pypdf's own message otherwise."""
    if "decompress" in reason.lower():
        return "a compressed stream inflates past the reader's decompression limit"
    match = re.search(r"Declared stream length of (\d+)", reason)
    if match:
        return f"a stream declares a length of {int(match.group(1)):,} bytes, over the reader's limit"
    return f"pypdf: {reason}"


def _limit_error(display: str, reason: str) -> DocumentError:
    return DocumentError(
        f"{display} exceeds a safety limit of the PDF reader ({_limit_detail(reason)}), so no text was read; "
        "such limits guard against decompression bombs. If you trust the file, re-export it (for example "
        "print it to a new PDF) or split it, and load that."
    )


def _extract(page: Any, display: str, limits: list[str]) -> str | None:
    """The page's text, or None when it cannot be read (a safety limit is appended to ``limits``)."""
    from pypdf.errors import DependencyError

    if page is None:
        return None
    try:
        if "/Contents" in page:
            # Resolve (and so decrypt) the content stream first: text extraction returns ""
            # without looking at it on pages without fonts, which would hide an AES error.
            _ = page["/Contents"]
        return str(page.extract_text())
    except DependencyError:
        raise _aes_error(display) from None
    except Exception as exc:
        _note_limit(exc, limits)
        return None


def load_pdf(data: bytes, display: str, password: str | None) -> tuple[list[Page], list[str]]:
    if b"%PDF-" not in data[:1024]:
        raise DocumentError(
            f"{display} is not a valid PDF (no PDF header); check the file or re-export it as PDF."
        )
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    with _quiet_pypdf():
        slots: list[Any] = []
        limits: list[str] = []  # pypdf's safety limits hit while reading, as its messages
        repaired = guessed = False
        expected = 0
        try:
            reader = PdfReader(BytesIO(data), strict=False)
        except DependencyError:
            raise _aes_error(display) from None
        except Exception as exc:
            _note_limit(exc, limits)
            reader = None
        if reader is not None:
            _unlock(reader, password, display)
            try:
                slots = list(reader.pages)
                expected = len(slots)
            except DependencyError:
                raise _aes_error(display) from None
            except Exception as exc:
                _note_limit(exc, limits)
                reader = None
        if reader is None:
            slots, expected, guessed = _open_repaired(data, display, password, limits)
            repaired = True
        raw: list[str | None] = []
        page_limits: dict[int, str] = {}  # page number -> the safety limit its text hit
        for number, page in enumerate(slots, 1):
            before = len(limits)
            raw.append(_extract(page, display, limits))
            if len(limits) > before:
                page_limits[number] = limits[before]
        limited = list(page_limits)

    numbers = list(range(1, len(raw) + 1))
    failed = [n for n, text in zip(numbers, raw, strict=True) if text is None and n not in limited]
    cleaned = clean_text([text or "" for text in raw])
    pages = [Page(number=n, text=t) for n, t in zip(numbers, cleaned, strict=True) if t]
    blank = [n for n, t, r in zip(numbers, cleaned, raw, strict=True) if not t and r is not None]
    missing = list(range(len(raw) + 1, expected + 1))

    if not pages:
        if limits:
            raise _limit_error(display, limits[0])
        if blank and not failed and not missing:
            raise DocumentError(
                f"{display} has no extractable text on any of its {plural(len(blank), 'page')} "
                f"({pages_label(blank)}); it looks scanned. Run OCR first "
                f"(e.g. ocrmypdf {display} ocr.pdf) and load the result."
            )
        raise DocumentError(
            f"{display} is damaged and no page with text could be recovered; "
            "get a fresh copy of the file (re-download or re-export it)."
        )

    notes: list[str] = []
    if limited:
        verb = "exceeds" if len(limited) == 1 else "exceed"
        notes.append(
            f"{display}: {pages_label(limited)} {verb} a safety limit of the PDF reader "
            f"({_limit_detail(page_limits[limited[0]])}); skipped."
        )
    if repaired:
        lost = sorted(set(failed + blank + missing) - set(limited))
        note = (
            f"{display} looks truncated or damaged; recovered text from "
            f"{len(pages)} of {plural(max(expected, len(raw)), 'page')}"
        )
        if lost:
            note += f"; skipped {pages_label(lost)} (unreadable or no text)"
        if guessed:
            note += "; page numbers are a best guess"
        notes.append(note + ".")
    else:
        if failed:
            notes.append(
                f"{display}: could not read {plural(len(failed), 'page')} "
                f"({format_page_ranges(failed)}); they were skipped."
            )
        if blank:
            notes.append(
                f"{display}: no extractable text on {plural(len(blank), 'page')} "
                f"({format_page_ranges(blank)}); they were skipped (scanned or blank?). "
                "Run OCR (e.g. ocrmypdf) if they matter."
            )
    return pages, notes
