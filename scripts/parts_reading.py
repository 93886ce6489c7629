"""Measure reading a long document in parts (``ask --long parts``, the default) against cutting its middle
(``--long truncate``, the default before issue 39): facts planted in real texts, asked with the embedded model.

Usage: python scripts/parts_reading.py [--model PATH] [--sample A|B|timing] [--out FILE.jsonl] [--tables FILE.jsonl]

Every case plants "The special magic number for KEY is NUMBER." (the fact form the embedded model was trained to
find; KEY from the task generator's key words, NUMBER 4-7 digits not in the text) into a text longer than the
window, and asks "What is the special magic number for KEY?":

- ``start`` / ``middle`` / ``end``: one fact at 2%, 50% and 97% of the text (issue 39's planted-fact cases);
- ``uniform``: one fact at a random place;
- ``edge``: one fact across the edge between two parts as they would be with no overlap (the case overlap is for);
- ``distractors``: the fact and three facts for other keys, each at a random place;
- ``absent``: three facts for other keys, none for the key asked ("not in the document" is right);
- ``none``: no fact at all ("not in the document" is right).

Sample A (seed 1, choice of ``PART_OVERLAP``): GPL-3 and GPL-2 (``/usr/share/common-licenses``). Rule, written
before A ran: the smallest overlap of 0, 32, 128 and 256 tokens whose number of right answers on A equals the best.
Sample B (seed 2, held out, fixed with A): LGPL-2.1 and GFDL-1.3, the 36-page PDF the tests build
(``tests/pdfs.py`` ``long_pdf_pages``, typeset and read back as ``ask`` reads it), and Debian's 36-page
``libtasn1.pdf`` (the fact planted in its extracted text). Texts not on this machine are left out and named.
Every case is also asked with ``--long truncate``. ``timing``: ``ask`` on GPL-3 (fact in the middle) in both
modes: the model's load, the first answer (one-time costs), then the median of 5 answers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from maskkv_cli.app import pipeline  # noqa: E402
from maskkv_cli.app.run_settings import RunSettings  # noqa: E402
from maskkv_cli.app.session import Session  # noqa: E402
from maskkv_cli.models.catalog import shipped_model  # noqa: E402
from maskkv_cli.prompting.fit import char_offset, part_windows  # noqa: E402
from maskkv_cli.tasks.synthetic import KEY_WORDS, NEEDLE_TEMPLATE, QUESTION_SINGLE  # noqa: E402

LICENSES = Path("/usr/share/common-licenses")
LIBTASN1 = Path("/usr/share/doc/libtasn1-doc/libtasn1.pdf")
OVERLAPS = (0, 32, 128, 256)
KINDS = ("start", "middle", "end", "uniform", "edge", "distractors", "absent", "none")
PER_KIND = {"start": 1, "middle": 1, "end": 1, "uniform": 3, "edge": 3, "distractors": 3, "absent": 3, "none": 1}


def test_pdf_text() -> str:
    from pdfs import long_pdf_pages, make_pdf

    from maskkv_cli.documents import parse_document

    return parse_document(make_pdf(long_pdf_pages()), source="long.pdf", kind="pdf").text


def libtasn1_text() -> str:
    from maskkv_cli.documents import load_document

    return load_document(LIBTASN1).text


def texts(sample: str) -> dict[str, str]:
    found: dict[str, str] = {}
    wanted = {"A": ["GPL-3", "GPL-2"], "B": ["LGPL-2.1", "GFDL-1.3"], "timing": ["GPL-3"]}[sample]
    for name in wanted:
        path = LICENSES / name
        if path.is_file():
            found[name] = path.read_text(encoding="utf-8")
        else:
            print(f"left out: {path} is not on this machine", file=sys.stderr)
    if sample == "B":
        found["tests-36-page.pdf"] = test_pdf_text()
        if LIBTASN1.is_file():
            found["libtasn1.pdf"] = libtasn1_text()
        else:
            print(f"left out: {LIBTASN1} is not on this machine", file=sys.stderr)
    return found


def plant(text: str, at: int, sentence: str) -> str:
    """``sentence`` inserted at the first space at or after character ``at`` (at the end when there is none)."""
    cut = text.find(" ", at)
    cut = len(text) if cut < 0 else cut
    return f"{text[:cut]} {sentence}{text[cut:]}"


def number(rng: random.Random, text: str) -> str:
    while True:
        digits = rng.randint(4, 7)
        value = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if value not in text:
            return value


def make_case(kind: str, text: str, rng: random.Random, session: Session, gen_length: int) -> dict:
    """One planted case: the text with its facts, the question and the right answer."""
    key, *others = rng.sample(KEY_WORDS, 4)
    question = QUESTION_SINGLE.format(key=key)
    value = number(rng, text)
    needle = NEEDLE_TEMPLATE.format(key=key, value=value)
    answer = value
    if kind in ("start", "middle", "end", "uniform"):
        at = {"start": 0.02, "middle": 0.5, "end": 0.97}.get(kind, rng.random())
        text = plant(text, int(at * len(text)), needle)
    elif kind == "edge":
        ids = session.document_ids(text)
        room = pipeline.room_for_text(session, question, gen_length)
        edges = [start for start, _ in part_windows(len(ids), room, 0)][1:-1] or [room]
        edge = rng.choice(edges)
        text = plant(text, char_offset(session.tokenizer, ids, max(0, edge - 8), text), needle)
    elif kind in ("distractors", "absent"):
        facts = [NEEDLE_TEMPLATE.format(key=k, value=number(rng, text)) for k in others]
        if kind == "distractors":
            facts.append(needle)
        else:
            answer = "not in the document"
        for fact in facts:
            text = plant(text, int(rng.random() * len(text)), fact)
    else:
        answer = "not in the document"
    return {"kind": kind, "question": question, "answer": answer, "text": text}


def right(case: dict, answer: pipeline.Answer) -> bool:
    if case["answer"] == "not in the document":
        return pipeline.says_absent(answer.text)
    return answer.text.strip() == case["answer"]


def run_sample(sample: str, session: Session, out: Path | None) -> None:
    gen = RunSettings().generation(session.generation_defaults)
    cache = RunSettings().cache()
    rng = random.Random({"A": 1, "B": 2}[sample])
    modes = [f"parts@{o}" for o in OVERLAPS] + ["truncate"]
    if sample == "B":
        from maskkv_cli.prompting.fit import PART_OVERLAP

        modes = [f"parts@{PART_OVERLAP}", "truncate"]
    tally: dict[tuple[str, str], list[int]] = {}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    rows = []
    for name, text in texts(sample).items():
        for kind in KINDS:
            for _ in range(PER_KIND[kind]):
                case = make_case(kind, text, rng, session, gen.gen_length)
                ids = session.document_ids(case["text"])
                room = pipeline.room_for_text(session, case["question"], gen.gen_length)
                for mode in modes:
                    t0 = time.perf_counter()
                    if mode == "truncate":
                        answer = pipeline.ask(session, case["text"], case["question"], gen, cache, long="truncate")
                    else:
                        answer = pipeline.ask_in_parts(session, case["text"], ids, room, case["question"], gen,
                                                       cache, overlap=int(mode.split("@")[1]))
                    seconds[mode].append(time.perf_counter() - t0)
                    ok = right(case, answer)
                    tally.setdefault((kind, mode), []).append(int(ok))
                    row = {"sample": sample, "text": name, "tokens": len(ids), "kind": kind, "mode": mode,
                           "expected": case["answer"], "answer": answer.text, "right": ok,
                           "claim": pipeline.claim(answer, case["question"], True),
                           "confidence": answer.confidence.as_dict() if answer.confidence else None,
                           "parts": answer.fitted.parts, "seconds": round(seconds[mode][-1], 3)}
                    rows.append(row)
                    if not ok:
                        print(f"  wrong: {name} {kind} {mode}: {answer.text!r} (expected {case['answer']!r})",
                              file=sys.stderr)
    if out is not None:
        with out.open("a", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    print_tables(rows)


def print_tables(rows: list[dict]) -> None:
    """The table of one sample's rows: right answers per case and mode, wrong ones shown without a LOW CONFIDENCE
    mark (or, for truncate, without saying what was cut), and the mean seconds per answer."""
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    print(f"\n## Sample {rows[0]['sample']}: {', '.join(texts_seen(rows))}\n")
    print("| case | " + " | ".join(modes) + " |")
    print("|---|" + "---:|" * len(modes))

    def count(kind: str | None, mode: str, test) -> str:
        chosen = [r for r in rows if r["mode"] == mode and (kind is None or r["kind"] == kind)]
        return f"{sum(1 for r in chosen if test(r))} / {len(chosen)}"

    for kind in KINDS:
        print(f"| {kind} | " + " | ".join(count(kind, m, lambda r: r["right"]) for m in modes) + " |")
    print("| all | " + " | ".join(f"**{count(None, m, lambda r: r['right'])}**" for m in modes) + " |")

    def unflagged(r: dict) -> bool:
        low = bool(r["confidence"] and r["confidence"]["low"])
        return not r["right"] and not low and r["claim"] != "absent-in-read"

    print("| wrong, shown unflagged | " + " | ".join(count(None, m, unflagged) for m in modes) + " |")
    print("| seconds per answer (mean) | "
          + " | ".join(f"{statistics.mean(r['seconds'] for r in rows if r['mode'] == m):.2f}" for m in modes) + " |")
    cut = [r for r in rows if r["mode"] == "truncate"]
    print(f"\ntruncate: {sum(r['claim'] == 'absent-in-read' for r in cut)} answers were \"not in the part read\" "
          f"(qualified), {sum(r['claim'] == 'absent' for r in cut)} an unqualified \"not in the document\".")


def texts_seen(rows: list[dict]) -> list[str]:
    return [f"{name} ({next(r['tokens'] for r in rows if r['text'] == name)} tokens)"
            for name in dict.fromkeys(r["text"] for r in rows)]


def timing(session_factory, out: Path | None) -> None:
    rng = random.Random(3)
    load_t0 = time.perf_counter()
    session = session_factory()
    load_s = time.perf_counter() - load_t0
    text = texts("timing").get("GPL-3")
    if text is None:
        print("timing: GPL-3 is not on this machine", file=sys.stderr)
        return
    case = make_case("middle", text, rng, session, 8)
    gen = RunSettings().generation(session.generation_defaults)
    cache = RunSettings().cache()
    print(f"\n## Timing: GPL-3 ({len(session.document_ids(case['text']))} tokens), fact in the middle\n")
    print(f"model load: {load_s:.2f} s\n")
    print("| mode | first answer (s) | median of 5 (s) | runs (s) | answer |")
    print("|---|---:|---:|---|---|")
    for mode in ("parts", "truncate"):
        t0 = time.perf_counter()
        first = pipeline.ask(session, case["text"], case["question"], gen, cache, long=mode)
        first_s = time.perf_counter() - t0
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            answer = pipeline.ask(session, case["text"], case["question"], gen, cache, long=mode)
            runs.append(time.perf_counter() - t0)
        shown = answer.text if answer.text == first.text else f"{first.text} / {answer.text}"
        print(f"| {mode} | {first_s:.2f} | {statistics.median(runs):.2f} | "
              f"{', '.join(f'{r:.2f}' for r in runs)} | {shown} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--sample", choices=("A", "B", "timing"), action="append")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tables", type=Path, default=None, help="print the tables of rows saved with --out")
    args = parser.parse_args()
    if args.tables is not None:
        rows = [json.loads(line) for line in args.tables.read_text(encoding="utf-8").splitlines()]
        for sample in dict.fromkeys(r["sample"] for r in rows):
            print_tables([r for r in rows if r["sample"] == sample])
        return
    torch.set_num_threads(1)
    model = args.model or str(shipped_model())
    for sample in args.sample or ["A", "B", "timing"]:
        if sample == "timing":
            timing(lambda: Session(model), args.out)
        else:
            run_sample(sample, Session(model), args.out)


if __name__ == "__main__":
    main()
