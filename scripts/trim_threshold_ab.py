"""Two glibc trim thresholds timed in one process: groups of batch jobs answered under each, in alternating blocks,
each group against the batch's limit line timed right after it.

The trim threshold (``runtime/allocator.py``) is how much free memory the heap keeps at its top; past it the top goes
back to the kernel, and the next allocations there fault their pages in again. A batch frees its caches and small
activations when its requests end, so the threshold decides whether the next batch reuses that memory. ``mallopt``
changes it at any time, so both settings run in one process, on the same model, on a host whose speed drifts: in
blocks of ``--block`` groups per setting (the first group of a block, which starts from the other setting's heap, is
not counted) until ``--groups`` are counted for each, the order of the two settings swapped every block. Each group
is one of ``scripts/bench_batch.py``'s (the embedded model, short documents, a new question per job), answered as a
worker answers it (``batch.answering.answer_jobs``); the limit line of its size (``bench.limit.measure_batch_limit``)
is timed right after it, under the same setting.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/trim_threshold_ab.py --groups 100
    OMP_NUM_THREADS=1 .venv/bin/python scripts/trim_threshold_ab.py --groups 100 --mib 8,64

Reported per setting: the median of group / limit, of the group's and the limit's times (ms), and the mean of the
minor page faults per group (``getrusage``). Linux with glibc only. Run one at a time (docs/scale.md, Throughput).
"""

from __future__ import annotations

import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent


def faults() -> int:
    """Minor page faults of this process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    sys.path.insert(0, str(SCRIPTS))
    from bench_batch import group_bench, group_parser, print_report

    parser = group_parser(__doc__)
    parser.add_argument("--block", type=int, default=6, help="groups per block, the first not counted (default 6)")
    parser.add_argument("--mib", default="8,64", help="the two trim thresholds, MiB (default 8,64)")
    args = parser.parse_args()

    import torch

    from maskkv_cli.batch.answering import answer_jobs
    from maskkv_cli.bench.limit import measure_batch_limit
    from maskkv_cli.runtime.allocator import M_TRIM_THRESHOLD, glibc

    libc = glibc()
    if libc is None:
        parser.error("the trim threshold exists only with glibc on Linux")
    settings = [int(m) for m in args.mib.split(",")]
    if len(settings) != 2:
        parser.error("--mib takes two thresholds, e.g. 8,64")
    if args.block < 2:
        parser.error("--block must be at least 2 (a block's first group is not counted)")
    blocks = -(-args.groups // (args.block - 1))
    texts, groups, limits = group_bench(Path(tempfile.mkdtemp(prefix="trim-ab-")), args.size)
    session, name = limits.session, f"batch {args.size}"
    rows: dict[int, list[tuple[float, float, int]]] = {mib: [] for mib in settings}
    done = 0
    for _ in range(3):  # warm-up
        answer_jobs(session, texts, groups[done % len(groups)], args.size)
        done += 1
    for block in range(blocks):
        for mib in settings if block % 2 == 0 else settings[::-1]:
            libc.mallopt(M_TRIM_THRESHOLD, mib << 20)
            for j in range(args.block):
                before, started = faults(), time.perf_counter()
                answer_jobs(session, texts, groups[done % len(groups)], args.size)
                took, faulted = time.perf_counter() - started, faults() - before
                done += 1
                with torch.no_grad():
                    limit = measure_batch_limit(session.model, limits.prompts[name], limits.gen, limits.budget)
                if j > 0:
                    rows[mib].append((took, limit.total_s, faulted))
    report: dict[str, object] = {"groups per setting": len(rows[settings[0]]), "size": args.size,
                                 "threads": torch.get_num_threads()}
    for mib, got in rows.items():
        report[f"trim {mib} MiB"] = {
            "group / limit": round(statistics.median(t / lim for t, lim, _ in got), 3),
            "group ms": round(statistics.median(t for t, _, _ in got) * 1e3, 2),
            "limit ms": round(statistics.median(lim for _, lim, _ in got) * 1e3, 2),
            "page faults per group": round(statistics.mean(f for _, _, f in got)),
        }
    print_report(report, args.out)


if __name__ == "__main__":
    main()
