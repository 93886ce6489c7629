"""How close to its limit line a batch could come with the engine's calls as they are: a group of jobs answered by
the stream, against the same group's prompts run through a loop with the least Python a round needs.

A group of ``scripts/bench_batch.py``'s jobs (the embedded model, short documents, a new question per job) is answered
as a batch worker answers it (``batch.answering.answer_jobs``), and the prompts and cache plans its stream opened are
kept. The same prompts then run through ``lean``: the engine's own calls, as the stream makes them (one
``prefill_lanes`` over every lane, then ``step_logits`` over one lane per sequence each step), with LLaDA's greedy
rule and schedule written for the batch as one object (one pick over every row, one top-k and one write of every
sequence's commits, the open positions of all sequences in one tensor), and none of the rest: no generation objects,
loops, events, step timings, statistics or results. Right after, the limit line of the group's size is timed
(``bench.limit.measure_batch_limit``). Each lean answer must equal the stream's, token for token (a group that
differs is counted and reported).

Reported (medians over the groups, in ms per group, and each over the limit line): the whole job
(``answer_jobs``: prompts, plans, stream, rows), the stream alone, the lean loop, the limit; and the engine's calls
within the stream and within the lean loop. What the stream takes above the lean loop is what a redesign of the
sampler and driver could save at most; what the lean loop takes above the limit, none could (the picks' float64
softmax, each sequence's own attention call and caches).

    OMP_NUM_THREADS=2 .venv/bin/python scripts/lean_rounds.py --groups 100
    OMP_NUM_THREADS=1 .venv/bin/python scripts/lean_rounds.py --groups 100 --out runs/lean-t1.json

Only the embedded model's bench settings (greedy LLaDA, low-confidence remasking, no threshold, one row per prompt)
are written in the lean loop. Run one at a time (docs/scale.md, Throughput).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent


def timed(fn: Callable[..., Any], spent: dict[str, float], part: Callable[[], str]) -> Callable[..., Any]:
    """``fn`` adding its time to ``spent[part()]``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            key = part()
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - started

    return call


def lean(model: Any, jobs: list[tuple[Any, Any, Any]], prefill: Callable[..., Any],
         steps: Callable[..., Any]) -> Any:
    """The responses (B, L) of ``jobs`` (prompt (1, M), generation settings, cache plan; greedy LLaDA) denoised
    together with the least Python a round needs (see the module doc); ``prefill`` and ``steps``: the engine's
    ``prefill_lanes`` and ``step_logits``."""
    import torch

    from maskkv_cli.engine.lanes import PrefillLane, RopeMemo, StepLane
    from maskkv_cli.engine.prefill import selection_sink
    from maskkv_cli.sampling.llada import transfer_schedule
    from maskkv_cli.sampling.picks import MaskedArgmax, Scratch

    gen = jobs[0][1]
    mask_id = model.config.mask_token_id
    rule, scratch = MaskedArgmax(mask_id), Scratch()
    size, length = len(jobs), gen.gen_length
    seqs = [torch.cat([p.reshape(1, -1), torch.full((1, length), mask_id, dtype=p.dtype)], 1) for p, _, _ in jobs]
    starts = [p.numel() for p, _, _ in jobs]
    response = torch.full((size, length), mask_id, dtype=seqs[0].dtype)
    probs = torch.full((size, length), float("nan"), dtype=torch.float64)
    lanes, sinks = [], []
    for (_, _, plan), seq, m in zip(jobs, seqs, starts, strict=True):
        sink, measure = selection_sink(plan.policy, plan.layer_budgets, plan.split, length, len(model.blocks),
                                       plan.online)
        sinks.append(sink)
        lanes.append(PrefillLane(seq, plan.split, torch.arange(m, m + gen.block_length), sink, measure=measure,
                                 rope_factor=plan.rope_factor))
    out = prefill(model, lanes)
    caches = [sink.finish(importance)[0] for sink, (_, importance) in zip(sinks, out, strict=True)]
    logits = torch.cat([lg for lg, _ in out], 1)
    tables = [RopeMemo() for _ in jobs]
    factors = [plan.rope_factor for _, _, plan in jobs]
    for blk in range(gen.n_blocks):
        lo = blk * gen.block_length
        rows = torch.arange(lo, lo + gen.block_length)[None].repeat(size, 1)  # each sequence's open positions
        for j, k in enumerate(transfer_schedule(gen.block_length, gen.steps_per_block)):
            if j > 0:
                for b in range(size):
                    seqs[b][0, starts[b] :] = response[b]
                lanes = [StepLane(seqs[b][:, starts[b] :], rows[b], starts[b], caches[b], rope_factor=factors[b],
                                  tables=tables[b]) for b in range(size)]
                logits = torch.cat(steps(model, lanes), 1)
            picked = rule(logits.reshape(-1, logits.shape[-1]), scratch)
            conf, tokens = picked.probs.view(size, -1), picked.tokens.view(size, -1)
            chosen = conf.topk(k, dim=1).indices
            at = rows.gather(1, chosen)
            response.scatter_(1, at, tokens.gather(1, chosen))
            probs.scatter_(1, at, conf.gather(1, chosen))
            rows = rows[torch.ones_like(rows, dtype=torch.bool).scatter_(1, chosen, False)].view(size, -1)
    return response


def main() -> None:
    sys.path.insert(0, str(SCRIPTS))
    from bench_batch import group_bench, group_parser, print_report

    args = group_parser(__doc__).parse_args()

    import torch

    import maskkv_cli.app.session as session_module
    import maskkv_cli.sampling.driver as driver
    import maskkv_cli.sampling.stream as stream
    from maskkv_cli.batch.answering import answer_jobs
    from maskkv_cli.bench.limit import measure_batch_limit
    from maskkv_cli.engine.prefill import prefill_lanes
    from maskkv_cli.engine.step import step_logits

    texts, groups, limits = group_bench(Path(tempfile.mkdtemp(prefix="lean-rounds-")), args.size)
    name = f"batch {args.size}"
    session, model = limits.session, limits.session.model

    where = ["stream"]  # whose engine calls are being timed
    spent: dict[str, float] = {}
    opened: list[tuple[Any, Any, Any]] = []
    finished: list[Any] = []
    open_generation, sample_many = stream.open_generation, session_module.sample_many

    def keep_opened(model: Any, prompt: Any, gen: Any, plan: Any, *rest: Any, **named: Any) -> Any:
        opened.append((prompt, gen, plan))
        return open_generation(model, prompt, gen, plan, *rest, **named)

    def keep_results(*given: Any, **named: Any) -> Any:
        results = sample_many(*given, **named)
        finished.extend(results)
        return results

    stream.open_generation = keep_opened
    session_module.sample_many = timed(keep_results, spent, lambda: "stream")
    engine = {"prefill": timed(prefill_lanes, spent, lambda: f"engine {where[0]}"),
              "steps": timed(step_logits, spent, lambda: f"engine {where[0]}")}
    driver.prefill_lanes, driver.step_logits = engine["prefill"], engine["steps"]

    rows: list[dict[str, float]] = []
    differed = 0
    for i in range(args.groups + 3):
        spent.clear()
        opened.clear()
        finished.clear()
        where[0] = "stream"
        started = time.perf_counter()
        answer_jobs(session, texts, groups[i % len(groups)], args.size)
        whole = time.perf_counter() - started
        where[0] = "lean"
        with torch.no_grad():
            started = time.perf_counter()
            response = lean(model, list(opened), engine["prefill"], engine["steps"])
            lean_s = time.perf_counter() - started
            limit = measure_batch_limit(model, limits.prompts[name], limits.gen, limits.budget).total_s
        if i < 3:
            continue
        differed += not torch.equal(response, torch.cat([r.tokens for r in finished]))
        rows.append({"answer_jobs": whole, "stream": spent["stream"], "lean": lean_s, "limit": limit,
                     "engine in the stream": spent["engine stream"], "engine in lean": spent["engine lean"]})
    report: dict[str, object] = {"groups": args.groups, "size": args.size, "threads": torch.get_num_threads(),
                                 "groups whose lean answers differed": differed}
    for key in rows[0]:
        report[f"{key} ms"] = round(statistics.median(row[key] for row in rows) * 1e3, 2)
        if key != "limit":
            report[f"{key} / limit"] = round(statistics.median(row[key] / row["limit"] for row in rows), 3)
    print_report(report, args.out)


if __name__ == "__main__":
    main()
