"""Choose the unreadable-page threshold of ingest on the damaged-PDF corpus the tests build, confirm it on a second
corpus and on truncated copies of real PDFs.

Usage: python scripts/text_layer_threshold.py [PDF ...]   (default: every PDF under /usr/share/doc)

1. Choice: ``tests/pdfs.py`` ``text_layer_corpus(seed=1)``: one-page PDFs of every clean kind (prose, bullets and
   symbols drawn in fonts without a Unicode map, tables, short lists) and every damaged kind (the whole page, or
   its body under an intact page number, drawn in a lost font or a private-use-mapped one). Each page's
   ``unreadable_share`` is measured on the text pypdf extracts; the cut is the middle of the gap between the highest
   clean page and the lowest damaged one, rounded down to 0.05 (when they overlap: the cut in steps of 0.05 that
   drops the most damaged pages less clean ones).
2. Confirmation (fixed with the choice, before it ran): ``text_layer_corpus(seed=2)``, and pages with a share of
   their lines damaged (``mixed-F``), to say where a partly damaged page falls.
3. Real files: each PDF read whole (no page may be dropped), then its first 10%, 15%, ..., 95% of bytes (the
   truncated download of issue 39). A recovered page counts as readable when 80% or more of its words (3 letters or
   more) are words of the whole file; the table counts readable pages dropped and unreadable pages kept.
"""

from __future__ import annotations

import random
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from pdfs import corpus_page, font_pdf, text_layer_corpus  # noqa: E402

from maskkv_cli.documents.pdf import load_pdf  # noqa: E402
from maskkv_cli.documents.reading import parse_document  # noqa: E402
from maskkv_cli.documents.textlayer import UNREADABLE_PAGE, unreadable_share  # noqa: E402
from maskkv_cli.errors import DocumentError  # noqa: E402

WORD = re.compile(r"[A-Za-z]{3,}")


def page_scores(corpus: list[tuple[str, str, bytes]]) -> list[tuple[str, str, float]]:
    out = []
    for label, kind, data in corpus:
        pages, _ = load_pdf(data, "corpus.pdf", None)
        out += [(label, kind, unreadable_share(page.text)) for page in pages]
    return out


def choose(scores: list[tuple[str, str, float]]) -> float:
    clean = [s for label, _, s in scores if label == "clean"]
    damaged = [s for label, _, s in scores if label == "damaged"]
    if max(clean) < min(damaged):
        return int((max(clean) + min(damaged)) / 2 * 20) / 20
    cuts = [i / 20 for i in range(1, 20)]
    return max(cuts, key=lambda c: sum(s > c for s in damaged) / len(damaged) - sum(s > c for s in clean) / len(clean))


def by_kind(scores: list[tuple[str, str, float]], cut: float) -> None:
    groups: dict[tuple[str, str], list[float]] = defaultdict(list)
    for label, kind, s in scores:
        groups[(label, kind)].append(s)
    print("| label | kind | pages | min | median | max | dropped at the cut |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (label, kind), values in groups.items():
        print(f"| {label} | {kind} | {len(values)} | {min(values):.3f} | {statistics.median(values):.3f} | "
              f"{max(values):.3f} | {sum(v > cut for v in values)} |")


def mixed(cut: float) -> None:
    from maskkv_cli.documents.corpus import load_corpus

    rng, paragraphs = random.Random(3), load_corpus()
    print("| lines damaged | pages | median share | dropped |")
    print("|---:|---:|---:|---:|")
    for share in (0.1, 0.3, 0.5, 0.7, 0.9):
        values = []
        for _ in range(12):
            pages, _ = load_pdf(font_pdf([corpus_page(f"mixed-{share}", rng, paragraphs)]), "mixed.pdf", None)
            values += [unreadable_share(p.text) for p in pages]
        print(f"| {share:.0%} | {len(values)} | {statistics.median(values):.3f} | {sum(v > cut for v in values)} |")


def _truncations(path: Path, data: bytes, vocabulary: set[str], cut: float) -> None:
    for share in range(10, 100, 5):
        try:
            pages, _ = load_pdf(data[: len(data) * share // 100], path.name, None)
        except DocumentError:
            print(f"| {path.name} | first {share}% of bytes | 0 | - | - | - | - | - |")
            continue
        readable, unreadable = [], []
        for page in pages:
            words = [w.lower() for w in WORD.findall(page.text)]
            known = sum(w in vocabulary for w in words) / len(words) if words else 0.0
            (readable if known >= 0.8 else unreadable).append(unreadable_share(page.text))
        print(f"| {path.name} | first {share}% of bytes | {len(pages)} | {len(readable)} | "
              f"{sum(s > cut for s in readable)} | {sum(s <= cut for s in unreadable)} | "
              f"{max(readable, default=float('nan')):.3f} | {min(unreadable, default=float('nan')):.3f} |")


def pua_fonts(data: bytes, chosen: dict[int, set[str] | None]) -> bytes:
    """``data`` with the fonts of some pages given a ToUnicode map into the private-use area: ``chosen`` maps a
    page index to the font names to break (None: all of them)."""
    from io import BytesIO

    from pypdf import PdfReader, PdfWriter
    from pypdf.generic import DictionaryObject, NameObject, StreamObject

    writer = PdfWriter(clone_from=PdfReader(BytesIO(data)))
    stream = StreamObject()
    stream.set_data(PUA_CMAP)
    cmap = writer._add_object(stream)
    for index, names in chosen.items():
        page = writer.pages[index]
        resources = DictionaryObject(page["/Resources"].get_object())
        fonts = DictionaryObject()
        for name, font in resources["/Font"].get_object().items():
            copy = DictionaryObject(font.get_object())
            if names is None or name in names:
                copy[NameObject("/ToUnicode")] = cmap
            fonts[NameObject(name)] = writer._add_object(copy)
        resources[NameObject("/Font")] = fonts
        page[NameObject("/Resources")] = resources
    out = BytesIO()
    writer.write(out)
    return out.getvalue()


PUA_CMAP = (b"/CIDInit /ProcSet findresource begin 12 dict begin begincmap /CMapName /PUA def\n"
            b"1 begincodespacerange <00> <FF> endcodespacerange\n1 beginbfrange <00> <FF> <E000> endbfrange\n"
            b"endcmap CMapName currentdict /CMap defineresource pop end end")


def _broken_fonts(path: Path, data: bytes, whole: list, cut: float, rng: random.Random) -> None:
    """Whole pages broken (a quarter, then three quarters of them), then one font of several on every page."""
    from io import BytesIO

    from pypdf import PdfReader

    n = len(whole)
    for share in (0.25, 0.75):
        chosen = sorted(rng.sample(range(n), round(share * n)))
        mutant = pua_fonts(data, dict.fromkeys(chosen))
        try:
            doc = parse_document(mutant, source=path.name, kind="pdf")
            kept = {p.number for p in doc.pages}
            outcome = f"stored, {n - len(kept)} pages dropped"
        except DocumentError as exc:
            kept, outcome = set(), f"failed: {str(exc)[:60]}..."
        broken = {i + 1 for i in chosen}
        print(f"| {path.name} | every font of {len(chosen)} of {n} pages | {outcome} | "
              f"broken pages kept: {len(broken & kept)} | intact pages dropped: "
              f"{len(set(range(1, n + 1)) - broken - kept) if kept else '-'} |")
    reader = PdfReader(BytesIO(data))
    chosen_fonts: dict[int, set[str] | None] = {}
    for i, page in enumerate(reader.pages):
        names = sorted(page["/Resources"].get_object().get("/Font", {}).get_object().keys())
        if len(names) > 1:
            chosen_fonts[i] = {rng.choice(names)}
    pages, _ = load_pdf(pua_fonts(data, chosen_fonts), path.name, None)
    wrong = []
    for page in pages:
        intact = WORD.findall(whole[page.number - 1].text)
        recall = len(WORD.findall(page.text)) / len(intact) if intact else 1.0
        share = unreadable_share(page.text)
        if (share > cut) != (recall < 0.5):
            wrong.append(f"page {page.number}: {recall:.0%} of its words read, share {share:.3f}")
        ONE_FONT.append((recall, share))
    print(f"| {path.name} | one font of several on {len(chosen_fonts)} pages | {len(pages)} pages | "
          f"dropped: {sum(s > cut for _, s in ONE_FONT[-len(pages):])} | against the half-the-words rule: "
          f"{'; '.join(wrong) or 'none'} |")


ONE_FONT: list[tuple[float, float]] = []  # (share of the page's words still read, unreadable share)


def real_files(paths: list[Path], cut: float) -> None:
    print("| file | bytes kept | pages recovered | readable | readable dropped | unreadable kept | highest readable |"
          " lowest unreadable |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    wholes = {}
    for path in paths:
        data = path.read_bytes()
        whole, _ = load_pdf(data, path.name, None)
        wholes[path] = (data, whole)
        vocabulary = {w.lower() for page in whole for w in WORD.findall(page.text)}
        print(f"| {path.name} | all | {len(whole)} | {len(whole)} | "
              f"{sum(unreadable_share(p.text) > cut for p in whole)} | 0 | "
              f"{max(unreadable_share(p.text) for p in whole):.3f} | - |")
        _truncations(path, data, vocabulary, cut)
    print("\n## Real PDFs with fonts mapped to the private-use area (seed 4)\n")
    print("| file | mutation | outcome | | |")
    print("|---|---|---|---|---|")
    rng = random.Random(4)
    for path, (data, whole) in wholes.items():
        _broken_fonts(path, data, whole, cut, rng)


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]] or sorted(Path("/usr/share/doc").rglob("*.pdf"))
    choice = page_scores(text_layer_corpus(seed=1))
    cut = choose(choice)
    print(f"## Choice (seed 1): cut {cut:.2f} (the constant in textlayer.py: {UNREADABLE_PAGE:.2f})\n")
    by_kind(choice, cut)
    print("\n## Confirmation (seed 2)\n")
    by_kind(page_scores(text_layer_corpus(seed=2)), cut)
    print("\n## Partly damaged pages (seed 3)\n")
    mixed(cut)
    print("\n## Real PDFs, whole and truncated\n")
    real_files(paths, cut)


if __name__ == "__main__":
    main()
