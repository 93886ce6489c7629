"""Documents in: reading PDF, text and Markdown into pages of clean text, the ingest store, token counts."""

from maskkv_cli.documents.clean import clean_text
from maskkv_cli.documents.model import KINDS, Document, Page, format_page_ranges
from maskkv_cli.documents.reading import EXTENSIONS, detect_kind, load_document, parse_document, read_source
from maskkv_cli.documents.text import TEXT_PAGE_CHARS, split_text_pages

__all__ = ["EXTENSIONS", "KINDS", "TEXT_PAGE_CHARS", "Document", "Page", "clean_text", "detect_kind",
           "format_page_ranges", "load_document", "parse_document", "read_source", "split_text_pages"]
