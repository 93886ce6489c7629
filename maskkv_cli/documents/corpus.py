"""The English corpus shipped in the package (``assets/corpus``) as paragraphs: the haystack of the synthetic
tasks, the tiny model's training text and the default calibration text."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

__all__ = ["load_corpus", "split_paragraphs"]


def split_paragraphs(text: str) -> list[str]:
    """Split text on blank lines; whitespace inside a paragraph collapses to single spaces."""
    paragraphs: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        cleaned = " ".join(block.split())
        if cleaned:
            paragraphs.append(cleaned)
    return paragraphs


@lru_cache(maxsize=1)
def _corpus_paragraphs() -> tuple[str, ...]:
    root = resources.files("maskkv_cli.assets").joinpath("corpus")
    names = sorted(entry.name for entry in root.iterdir() if entry.name.endswith(".txt"))
    paragraphs: list[str] = []
    for name in names:
        paragraphs.extend(split_paragraphs(root.joinpath(name).read_text(encoding="utf-8")))
    return tuple(paragraphs)


def load_corpus() -> list[str]:
    """Paragraphs of the packaged English corpus (files in name order, paragraphs in file order)."""
    return list(_corpus_paragraphs())
