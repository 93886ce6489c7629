"""One row per policy and budget, one column per task and length: a ``bench quality`` folder as the wide tables of
docs/tiny-model.md, with the false no-answers ("not in the document" to a single or multikey question) summed
from the rows.

    .venv/bin/python scripts/quality_table.py runs/heldout
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

ANSWERABLE = ("niah_single", "niah_multikey")


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def case(row: dict) -> str:
    return row["policy"] if row["budget"] is None else f"{row['policy']}@{row['budget']}"


def main(folder: Path) -> None:
    rows = jsonl(folder / "results.jsonl")
    columns = sorted({(r["task"], r["length"]) for r in rows})
    table: dict[str, dict[tuple[str, int], float]] = defaultdict(dict)
    for r in rows:
        table[case(r)][(r["task"], r["length"])] = r["accuracy"]
    false_no: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        if r["task"] in ANSWERABLE:
            false_no[case(r)][0] += int(r.get("no_answers") or 0)
            false_no[case(r)][1] += int(r["n"])
    order = sorted(table, key=lambda c: (c != "full", int(c.split("@")[1]) if "@" in c else 0, c))
    print("| case | " + " | ".join(f"{task} {length}" for task, length in columns) + " | false NO_ANSWER |")
    print("|---" * (len(columns) + 2) + "|")
    for c in order:
        cells = " | ".join("-" if k not in table[c] else f"{table[c][k]:.1f}" for k in columns)
        said, n = false_no[c]
        print(f"| {c} | {cells} | {said} of {n} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
