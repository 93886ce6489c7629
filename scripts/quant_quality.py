"""Needle accuracy with quantized weights (issue 48): ``maskkv bench quality`` once per weight variant on the same
tasks, then every variant against the unquantized run task by task.

Each variant is ``MODE`` or ``MODE@DTYPE`` (``none``, ``int8``, ``int4``, ``none@bf16``, ...): one ``bench quality``
run into ``OUT/<variant>`` (a rerun reuses its rows). The report pairs the predictions by task, policy and budget:
each variant's accuracy with its 95% Wilson interval, and its difference from the reference variant with a 95%
interval for a difference of paired proportions (Newcombe's score method 10, from the two Wilson intervals and
the correlation of the pairs), the tasks only one of the two answered, and the exact sign test on those.

    python scripts/quant_quality.py --samples 250 --lengths 1024 --out runs/quant-quality
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from maskkv_cli.bench.paired import Z95, sign_test


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion, as fractions."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_difference(both: int, only_a: int, only_b: int, neither: int) -> tuple[float, float, float]:
    """(difference, low, high) of accuracy A - accuracy B over paired 0/1 scores, with Newcombe's (1998) method 10
    interval: the Wilson intervals of both proportions combined with the phi correlation of the pairs."""
    n = both + only_a + only_b + neither
    p1, p2 = (both + only_a) / n, (both + only_b) / n
    l1, u1 = wilson(both + only_a, n)
    l2, u2 = wilson(both + only_b, n)
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = (both * neither - only_a * only_b) / math.sqrt(margins) if margins else 0.0
    d = p1 - p2
    low = d - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    high = d + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return d, low, high


def run_variant(variant: str, args: argparse.Namespace) -> Path:
    """``bench quality`` of one weight variant into its folder (reused when its rows are there)."""
    mode, _, dtype = variant.partition("@")
    out = Path(args.out) / variant.replace("@", "-")
    cmd = [sys.executable, "-m", "maskkv_cli", "bench", "quality", "--tasks", args.tasks, "--lengths", args.lengths,
           "-n", str(args.samples), "--seed", str(args.seed), "--policies", args.policies, "--budgets", args.budgets,
           "--quantize", mode, "--dtype", dtype or "auto", "--out", str(out), "--json"]
    if args.model:
        cmd += ["--model", args.model]
    print(f"{variant}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def scores(folder: Path) -> dict[tuple[Any, ...], float]:
    """(task, length, policy, budget, task id) -> score, from a run's predictions.jsonl."""
    out = {}
    for line in (folder / "predictions.jsonl").read_text().splitlines():
        row = json.loads(line)
        out[(row["task"], row["length"], row["policy"], row["budget"], row["id"])] = float(row["score"])
    return out


def compare(reference: dict[tuple[Any, ...], float], other: dict[tuple[Any, ...], float]) -> list[dict[str, Any]]:
    """Per (task, length, policy, budget), and over all tasks of a (policy, budget): both accuracies and the paired
    difference ``other - reference``."""
    cells: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
    for key, ref in reference.items():
        if key in other:
            task, length, policy, budget, _ = key
            for cell in ((task, length, policy, budget), ("all", length, policy, budget)):
                cells.setdefault(cell, []).append((ref, other[key]))
    rows = []
    for (task, length, policy, budget), pairs in sorted(cells.items(), key=lambda kv: str(kv[0])):
        both = sum(1 for a, b in pairs if a == 1 and b == 1)
        only_ref = sum(1 for a, b in pairs if a == 1 and b != 1)
        only_other = sum(1 for a, b in pairs if a != 1 and b == 1)
        neither = len(pairs) - both - only_ref - only_other
        d, low, high = paired_difference(both, only_other, only_ref, neither)
        rows.append({"task": task, "length": length, "policy": policy, "budget": budget, "n": len(pairs),
                     "reference": (both + only_ref) / len(pairs), "accuracy": (both + only_other) / len(pairs),
                     "ci95": wilson(both + only_other, len(pairs)), "difference": d, "difference_ci95": (low, high),
                     "only_reference": only_ref, "only_this": only_other, "p": sign_test(only_other, only_ref)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="none,int8,int4,none@bf16")
    ap.add_argument("--reference", default="none")
    ap.add_argument("--tasks", default="niah_single,niah_multikey")
    ap.add_argument("--lengths", default="1024")
    ap.add_argument("--samples", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default="full,maskkv")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--model", default=None, help="a checkpoint folder [default: the embedded model]")
    ap.add_argument("--out", default="runs/quant-quality")
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    folders = {v: run_variant(v, args) for v in variants}
    reference = scores(folders[args.reference])
    report: dict[str, Any] = {"settings": vars(args), "variants": {}}
    print("| weights | task | policy | budget | n | accuracy (95% CI) | vs " + args.reference
          + " (95% CI) | only ref / only this | p |")
    print("|---|---|---|---|---|---|---|---|---|")
    for variant in variants:
        if variant == args.reference:
            continue
        rows = compare(reference, scores(folders[variant]))
        report["variants"][variant] = rows
        for r in rows:
            lo, hi = r["ci95"]
            dlo, dhi = r["difference_ci95"]
            print(f"| {variant} | {r['task']} {r['length']} | {r['policy']} | {r['budget'] or '-'} | {r['n']} | "
                  f"{100 * r['accuracy']:.1f} ({100 * lo:.1f}-{100 * hi:.1f}) | {100 * r['difference']:+.1f} "
                  f"({100 * dlo:+.1f} to {100 * dhi:+.1f}) | {r['only_reference']} / {r['only_this']} | "
                  f"{r['p']:.2g} |")
    (Path(args.out) / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
