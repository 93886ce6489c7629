"""Choose the low-confidence threshold of answers on one sample and confirm it on a fresh one.

Usage: python scripts/confidence_threshold.py [--model PATH] [--out DIR]

Each sample holds, with the embedded tiny model (or --model) and ``ask``'s settings (the model's gen length,
steps and block; greedy):
- answerable needle questions: niah_single and niah_multikey tasks of 512, 1024 and 2048 tokens, hidden in the
  package's corpus and in the project's own docs (text the tiny model never saw), asked with the default
  policy at budget 256 (ask's default) and at 16 entries per head (more wrong answers);
- unanswerable questions: niah_single tasks whose needle sentence was removed (the key asked for is absent),
  and general questions ("What is this document about?") over the same texts: the one right answer to them is
  ``NO_ANSWER`` ("not in the document", which the embedded model gives to some questions since stage 17),
  anything else is wrong;
- absent keys among other keys' needles (``niah_none`` tasks: three distractor needles, none for the key asked
  about), the case stage 24's model still gets wrong; added on 2026-12-03, after the needle-removed questions
  had become too easy to tell cuts apart (3 wrong answers in 288), before this set was run on any model.

Sample A (seed 11) chooses the threshold: for the mean and for the minimum token probability, the cut in steps
of 0.05 that maximises Youden's J (share of wrong answers flagged minus share of correct answers flagged).
Sample B (seed 22, fixed before A was run) reports the same shares at the chosen cut.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from maskkv_cli.app import pipeline  # noqa: E402
from maskkv_cli.app.run_settings import RunSettings  # noqa: E402
from maskkv_cli.app.session import Session  # noqa: E402
from maskkv_cli.documents.corpus import split_paragraphs  # noqa: E402
from maskkv_cli.models.catalog import shipped_model  # noqa: E402
from maskkv_cli.tasks.metrics import is_no_answer, score  # noqa: E402
from maskkv_cli.tasks.synthetic import generate_tasks  # noqa: E402

LENGTHS = (512, 1024, 2048)
KINDS = ("niah_single", "niah_multikey")
PER_CELL = 4
GENERAL = ("What is this document about?", "Who wrote this text?", "What is the name of the license?",
           "Summarize the text in one sentence.")
SEEDS = {"A": 11, "B": 22}
SETS = ("answerable", "absent", "general", "absent among needles")  # the question sets of a sample


def docs_haystack() -> list[str]:
    paragraphs: list[str] = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        paragraphs += [p for p in split_paragraphs(path.read_text()) if len(p.split()) > 20 and "```" not in p]
    return paragraphs


def stats(conf) -> dict:
    """An answer's mean and lowest token probability (None for an empty answer)."""
    return {"mean": conf.mean if conf else None, "min": conf.min if conf else None}


def ask(session: Session, context: str, question: str, gen, cache) -> tuple[str, object]:
    a = pipeline.ask(session, context, question, gen, cache)
    return a.text, a.confidence


def run_sample(session: Session, seed: int) -> list[dict]:
    gen = RunSettings().generation(session.generation_defaults)
    rows: list[dict] = []
    haystacks = {"corpus": None, "docs": docs_haystack()}
    for hay_name, hay in haystacks.items():
        for length in LENGTHS:
            for kind in KINDS:
                tasks = generate_tasks(kind, PER_CELL, length, seed=seed, haystack=hay,
                                       count_tokens=session.count_tokens)
                for budget in (256, 16):
                    cache = RunSettings(budget=budget).cache()
                    for t in tasks:
                        text, conf = ask(session, t.context, t.input, gen, cache)
                        rows.append({"set": "answerable", "haystack": hay_name, "kind": kind, "length": length,
                                     "budget": budget, "answer": text, "gold": t.answers[0],
                                     "correct": score(t.dataset, text, list(t.answers)) > 0,
                                     **stats(conf)})
            cache = RunSettings(budget=256).cache()
            for i, t in enumerate(generate_tasks("niah_single", PER_CELL, length, seed=seed + 1000, haystack=hay,
                                                 count_tokens=session.count_tokens)):
                sentence = t.meta["needles"][0]["text"]
                absent = t.context.replace(sentence, " ")
                assert sentence not in absent
                text, conf = ask(session, absent, t.input, gen, cache)
                rows.append({"set": "absent", "haystack": hay_name, "length": length, "budget": 256,
                             "answer": text, "correct": is_no_answer(text),
                             **stats(conf)})
                q = GENERAL[i % len(GENERAL)]
                text, conf = ask(session, absent, q, gen, cache)
                rows.append({"set": "general", "haystack": hay_name, "length": length, "budget": 256,
                             "question": q, "answer": text, "correct": is_no_answer(text),
                             **stats(conf)})
            for t in generate_tasks("niah_none", PER_CELL, length, seed=seed + 2000, haystack=hay,
                                    count_tokens=session.count_tokens):
                text, conf = ask(session, t.context, t.input, gen, cache)
                rows.append({"set": "absent among needles", "haystack": hay_name, "length": length, "budget": 256,
                             "answer": text, "correct": is_no_answer(text),
                             **stats(conf)})
    return rows


def shares(rows: list[dict], stat: str, cut: float) -> tuple[float, float]:
    """(share of wrong answers flagged, share of correct answers flagged); an empty answer counts as flagged."""
    def flagged(r: dict) -> bool:
        return r[stat] is None or r[stat] < cut
    wrong = [r for r in rows if not r["correct"]]
    right = [r for r in rows if r["correct"]]
    return (sum(map(flagged, wrong)) / max(1, len(wrong)), sum(map(flagged, right)) / max(1, len(right)))


def describe(rows: list[dict]) -> dict:
    out: dict = {}
    groups = {"correct": [r for r in rows if r["correct"]],
              "wrong answerable": [r for r in rows if not r["correct"] and r["set"] == "answerable"]}
    groups.update({part: [r for r in rows if r["set"] == part] for part in SETS[1:]})  # every set but answerable
    for name, part in groups.items():
        means = [r["mean"] for r in part if r["mean"] is not None]
        mins = [r["min"] for r in part if r["min"] is not None]
        out[name] = {"n": len(part), "empty": sum(r["mean"] is None for r in part),
                     "mean_median": round(statistics.median(means), 3) if means else None,
                     "min_median": round(statistics.median(mins), 3) if mins else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(shipped_model()))
    parser.add_argument("--out", default="/tmp/confidence-threshold")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    session = Session(args.model)
    samples = {}
    for name, seed in SEEDS.items():
        samples[name] = run_sample(session, seed)
        (out / f"sample_{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples[name]))
        print(f"sample {name} (seed {seed}): {len(samples[name])} answers", json.dumps(describe(samples[name])),
              flush=True)
    cuts = [round(0.05 * i, 2) for i in range(1, 20)]
    best = {}
    for stat in ("mean", "min"):
        scored = [(shares(samples["A"], stat, c), c) for c in cuts]
        (tpr, fpr), cut = max(scored, key=lambda s: (s[0][0] - s[0][1], -s[1]))
        best[stat] = (tpr - fpr, cut)
        print(f"A {stat}: cut {cut}: wrong flagged {tpr:.1%}, correct flagged {fpr:.1%} (J {tpr - fpr:.3f})")
        for c in cuts:
            t, f = shares(samples["A"], stat, c)
            print(f"   {stat} < {c:.2f}: wrong flagged {t:.1%}, correct flagged {f:.1%}")
    stat = max(best, key=lambda s: best[s][0])
    cut = best[stat][1]
    tpr, fpr = shares(samples["B"], stat, cut)
    print(f"chosen on A: {stat} < {cut}; on B: wrong flagged {tpr:.1%}, correct flagged {fpr:.1%}")
    for name in ("A", "B"):
        for part in SETS:
            rows = [r for r in samples[name] if r["set"] == part]
            t, f = shares(rows, stat, cut)
            n_right = sum(r["correct"] for r in rows)
            print(f"  {name} {part}: n {len(rows)}, correct {n_right}, wrong flagged {t:.1%}, correct flagged {f:.1%}")


if __name__ == "__main__":
    main()
