"""Two revisions of maskkv timed in one process: groups of jobs answered by a git revision's code and by this
checkout's, alternating group by group, each pair against the batch's limit line timed right after.

Why one process: on this project's shared 2-core hosts the speed drifts by tens of percent within minutes, and one
process runs the same code up to 3% faster or slower than the next (measured 2026-12-07), so two revisions timed in
separate processes cannot tell a 2% change apart. Here the revision's package is exported (``git archive``) into a
temporary folder under another name (``maskkv_rev``: ``maskkv_cli`` renamed in its Python files), imported beside
``maskkv_cli``, and both answer the same groups of ``scripts/bench_batch.py``'s jobs (the embedded model, short
documents, a new question per job) as a worker answers a group (``batch.answering.answer_jobs``), in alternating
order; this checkout's limit line for the group size is timed after each pair. The revision must have
``batch.answering.answer_jobs`` and ``open_session`` as this checkout calls them (every revision since 2026-12-05).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/ab_revisions.py 66ab6fe --pairs 300
    OMP_NUM_THREADS=2 .venv/bin/python scripts/ab_revisions.py HEAD~3 --pairs 300 --size 8

Reported (medians of the pairs, with the middle half): this checkout's time over the revision's, and each one's
over the limit line; and whether both gave the same answers to every job (they should: behaviour is pinned).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REVISION_PACKAGE = "maskkv_rev"


def export_revision(revision: str, folder: Path) -> None:
    """The revision's ``maskkv_cli`` under ``folder`` as the package ``maskkv_rev``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "maskkv_cli"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    package = folder / REVISION_PACKAGE
    (folder / "maskkv_cli").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(path.read_text(encoding="utf-8").replace("maskkv_cli", REVISION_PACKAGE), encoding="utf-8")


def answerer(package: str, model_path: str, groups: list[list[dict[str, object]]], texts: dict[str, str],
             size: int) -> Callable[[int], list[str]]:
    """``answer(i)``: group ``i``'s answers by ``package``'s code on its own session of the model."""
    answering = importlib.import_module(f"{package}.batch.answering")
    session = answering.open_session(model_path, "cpu", None)

    def answer(i: int) -> list[str]:
        rows = answering.answer_jobs(session, texts, groups[i % len(groups)], size)
        return [str(row.get("answer")) for row in rows]

    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the git revision to compare this checkout with (a commit, a tag, HEAD~1)")
    parser.add_argument("--pairs", type=int, default=100, help="groups timed by both (after 3 warm-up groups)")
    parser.add_argument("--size", type=int, default=8, help="jobs per group, answered together (--batch-size)")
    parser.add_argument("--jobs", type=int, default=200, help="the bench's jobs, cycled through in groups")
    parser.add_argument("--out", type=Path, help="write the report here as JSON too")
    args = parser.parse_args()

    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_batch import group_bench, median_and_quartiles, print_report

    from maskkv_cli.bench.limit import measure_batch_limit

    work = Path(tempfile.mkdtemp(prefix="ab-revisions-"))
    export_revision(args.revision, work / "revision")
    sys.path.insert(0, str(work / "revision"))
    texts, groups, limits = group_bench(work, args.size, max(1, args.jobs // 10))
    model_path = limits.model_path
    name = f"batch {args.size}"
    answers = {"revision": answerer(REVISION_PACKAGE, model_path, groups, texts, args.size),
               "checkout": answerer("maskkv_cli", model_path, groups, texts, args.size)}
    ratios: dict[str, list[float]] = {"checkout / revision": [], "revision / limit": [], "checkout / limit": []}
    same = True
    for i in range(args.pairs + 3):
        seconds, got = {}, {}
        for who in ("revision", "checkout") if i % 2 else ("checkout", "revision"):
            started = time.perf_counter()
            got[who] = answers[who](i)
            seconds[who] = time.perf_counter() - started
        same = same and got["revision"] == got["checkout"]
        with torch.no_grad():
            limit = measure_batch_limit(limits.session.model, limits.prompts[name], limits.gen, limits.budget).total_s
        if i >= 3:
            ratios["checkout / revision"].append(seconds["checkout"] / seconds["revision"])
            ratios["revision / limit"].append(seconds["revision"] / limit)
            ratios["checkout / limit"].append(seconds["checkout"] / limit)
    report: dict[str, object] = {"revision": args.revision, "pairs": args.pairs, "size": args.size,
                                 "threads": torch.get_num_threads(), "same_answers": same,
                                 "load_average_after": os.getloadavg()}
    for key, values in ratios.items():
        median, middle = median_and_quartiles(values)
        report[key] = {"median": median, "middle_half": middle}
    print_report(report, args.out)


if __name__ == "__main__":
    main()
