"""Throughput of ``maskkv batch``: local worker processes (1 and 2), Ray actors (1 and 2) and this process with
jobs denoised together (``--batch-size``: ``batch 1``, ``batch 8``, ...) on the same jobs.

Every configuration answers the same 200 jobs (10 short documents: two sentences of the packaged corpus around a
hidden number, 20 questions each; short so that all runs fit in minutes on 2 shared cores) with the embedded tiny
model, into a fresh results folder, in alternating order over ``--rounds`` rounds. Reported per run: jobs per
minute from the first job sent to the last row written (the steady state, model loading excluded) and the wall
time including starting the workers. The Ray cluster (2 CPUs) is started once, before the first round, and its
start-up is reported on its own.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_batch.py --out runs/bench-batch
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_batch.py --configs "batch 1,batch 8" --rounds 3
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_batch.py --configs "batch 1,batch 8,batch auto" \
        --docs 'licenses/*.txt' --questions qs.txt

``--docs GLOB --questions FILE`` answers every question about every document instead (``maskkv batch --docs
--questions``'s cross product), ``--jobs`` of them at most.

For the ``batch N`` configurations the report adds the limit line of the model's work
(``bench.limit.measure_batch_limit``: the bare forward passes of N sequences of the jobs' mean prompt length
with the run's generation settings and budget, no sampler, no bookkeeping), timed three times right before and
three times right after each run of the configuration (their median): as jobs per minute (the median of the
rounds) and measured / limit (the median of each round's limit over that round's rate).

``--paired N`` adds, for each ``batch N``, the engine's part of a run against the limit line in N pairs of timings
a fraction of a second apart (``BatchLimits.paired``): on a host whose speed drifts by tens of percent within
minutes, the rounds' measured / limit spreads widely, and pairs that close move together.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from maskkv_cli.batch.jobs import AnswerSettings, JobSpec, cross_product, read_questions
from maskkv_cli.batch.run import Runner, run_batch
from maskkv_cli.documents.corpus import load_corpus
from maskkv_cli.models.catalog import resolve_default_model

WORDS = ["apple", "river", "violin", "harbor", "lantern", "meadow", "copper", "falcon", "orchid", "glacier"]


def make_jobs(folder: Path, documents: int, questions: int, seed: int) -> list[JobSpec]:
    rng = random.Random(seed)
    corpus = load_corpus()
    specs: list[JobSpec] = []
    for d in range(documents):
        sentences = [p.split(". ")[0].rstrip(".") + "." for p in rng.sample(corpus, 2)]
        word = WORDS[d % len(WORDS)]
        sentences.insert(1, f"The special magic number for {word} is {rng.randrange(10000, 99999)}.")
        path = folder / f"doc{d:02d}.txt"
        path.write_text(" ".join(sentences) + "\n")
        for q in range(questions):
            asked = WORDS[(d + q) % len(WORDS)]
            specs.append(JobSpec(f"d{d}-q{q}", str(path), f"What is the special magic number for {asked}? ({q})"))
    return specs


class BatchLimits:
    """The limit line of each ``batch N``: N bare sequences of the jobs' mean prompt length (``rate(name, timings)``:
    jobs per minute at the median of ``seconds``' timings, after one warm-up per size at construction). The mean, not
    the median: jobs per minute is all the jobs' work over all their time, and each job's work grows with its own
    length (here the median, 77 tokens, lay under the mean, 81, which made the limit about 4% too fast). Timed in
    the rounds, three times right before and three times right after each run of its configuration, so that each
    measured / limit pairs timings taken seconds apart and centred on the run (this host's speed drifts by up to 30%
    within minutes)."""

    def __init__(self, names: list[str], specs: list[JobSpec], model_path: str, settings: AnswerSettings) -> None:
        import torch

        from maskkv_cli.app.pipeline import prepare
        from maskkv_cli.app.run_settings import RunSettings
        from maskkv_cli.app.session import Session
        from maskkv_cli.engine.plan import plan_cache

        self.model_path = model_path
        self.session = session = Session(model_path)
        run = RunSettings(policy=settings.policy, budget=settings.budget, gen_length=settings.gen_length,
                          steps=settings.steps, block_length=settings.block_length)
        self.gen, cache = run.generation(session.generation_defaults), run.cache()
        texts = {spec.document: Path(spec.document).read_text() for spec in specs}
        lengths = [len(prepare(session, texts[s.document], s.question, self.gen.gen_length).ids) for s in specs]
        m = round(sum(lengths) / len(lengths))
        plan = plan_cache(session.model, cache, m, model_path, block_length=self.gen.block_length)
        self.budget = plan.budget if plan.policy.evicts and plan.budget is not None else m
        self.prompts = {name: torch.randint(0, session.model.config.vocab_size, (int(name.split()[1]), m),
                                            generator=torch.Generator().manual_seed(0)) for name in names}
        for name in names:
            self.seconds(name)  # warm-up

    def seconds(self, name: str, repeats: int = 3) -> list[float]:
        """``repeats`` timings of ``name``'s limit line, in seconds per batch."""
        import torch

        from maskkv_cli.bench.limit import measure_batch_limit

        with torch.no_grad():
            return [measure_batch_limit(self.session.model, self.prompts[name], self.gen, self.budget).total_s
                    for _ in range(repeats)]

    def rate(self, name: str, timings: list[float]) -> float:
        """Jobs per minute of ``name``'s limit line at the median of ``timings`` (seconds per batch)."""
        return 60 * self.prompts[name].shape[0] / statistics.median(timings)

    def paired(self, name: str, specs: list[JobSpec], settings: AnswerSettings, pairs: int) -> dict[str, object]:
        """``name``'s groups of jobs answered as a worker answers them (``batch.answering.answer_jobs``, the call
        the batch runner makes per group, on this session's model), each timed right next to one timing of the
        limit line: ``pairs`` such pairs (after two warm-up pairs), cycling through the jobs in groups of the batch
        size. Each pair's two timings lie a fraction of a second apart, so the host's drift moves both; the median
        of the pairs' ratios is measured / limit for the engine's part of a run (row writing and dispatch left
        out)."""
        import time

        from maskkv_cli.batch.answering import answer_jobs

        size = self.prompts[name].shape[0]
        by_sha, groups = job_groups(specs, settings, size)
        ratios: list[float] = []
        for i in range(pairs + 2):
            started = time.perf_counter()
            answer_jobs(self.session, by_sha, groups[i % len(groups)], size)
            engine = time.perf_counter() - started
            (limit,) = self.seconds(name, repeats=1)
            if i >= 2:
                ratios.append(engine / limit)
        median, quartiles = median_and_quartiles(ratios)
        return {"pairs": pairs, "median": median, "quartiles": quartiles}


def job_groups(specs: list[JobSpec], settings: AnswerSettings,
               size: int) -> tuple[dict[str, str], list[list[dict[str, object]]]]:
    """The jobs as a batch worker receives them: the documents' texts by their sha256, and the jobs in groups of
    ``size`` (consecutive, a last short group left out), each job a message of its question, settings and
    document."""
    import hashlib

    texts = {spec.document: Path(spec.document).read_text() for spec in specs}
    shas = {doc: hashlib.sha256(text.encode()).hexdigest() for doc, text in texts.items()}
    by_sha = {shas[doc]: text for doc, text in texts.items()}
    groups: list[list[dict[str, object]]] = [
        [{"question": spec.question, "settings": settings.as_dict(), "document_sha": shas[spec.document]}
         for spec in specs[i : i + size]] for i in range(0, len(specs) - size + 1, size)]
    return by_sha, groups


def group_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the per-group scripts (``batch_parts.py``, ``lean_rounds.py``, ``trim_threshold_ab.py``): how
    many groups, their size, where to write the report; ``doc``: the script's docstring (its first line describes
    it)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--groups", type=int, default=100, help="groups timed (after 3 warm-up groups)")
    parser.add_argument("--size", type=int, default=8, help="jobs per group, answered together (--batch-size)")
    parser.add_argument("--out", type=Path, help="write the report here as JSON too")
    return parser


def group_bench(folder: Path, size: int, questions: int = 20) -> tuple[dict[str, str], list[list[dict[str, object]]],
                                                                     BatchLimits]:
    """What the per-group scripts (``ab_revisions.py``, ``batch_parts.py``, ``lean_rounds.py``) time: the bench's
    jobs (10 documents written into ``folder``, ``questions`` each) on the embedded model with the default settings,
    as a worker receives them in groups of ``size`` (``job_groups``), and the limit lines of ``batch {size}``."""
    specs = make_jobs(folder, 10, questions, seed=0)
    model_path, _ = resolve_default_model(None)
    settings = AnswerSettings(policy="maskkv", gen_length=None, steps=None, block_length=None)
    texts, groups = job_groups(specs, settings, size)
    return texts, groups, BatchLimits([f"batch {size}"], specs, model_path, settings)


def median_and_quartiles(values: list[float]) -> tuple[float, list[float]]:
    """The median of ``values`` and their first and third quartiles (the middle half), rounded to 3 places."""
    quartiles = statistics.quantiles(values, n=4)
    return round(statistics.median(values), 3), [round(quartiles[0], 3), round(quartiles[2], 3)]


def print_report(report: dict[str, object], out: Path | None) -> None:
    """Print ``report`` as JSON, and write it to ``out`` too where one is given (its folder made)."""
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-batch"))
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--docs", help="a glob of documents: their cross product with --questions are the jobs")
    parser.add_argument("--questions", type=Path, help="a file of questions, one per line (with --docs)")
    parser.add_argument("--policy", default="maskkv", help="the cache policy of every job (default: maskkv, as "
                        "maskkv batch runs; runs before 2026-12-06 used maskkv-plus)")
    parser.add_argument("--gen-length", type=int, help="answer tokens of every job, in as many steps, one block "
                        "(default: the model's)")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="after the rounds, time each batch N's groups of jobs (as a worker answers them) against "
                             "its limit line in N alternating pairs (BatchLimits.paired; default 0: not run)")
    parser.add_argument("--configs", default="local 1,local 2,ray 1,ray 2",
                        help="comma-separated, from: local 1, local 2, ray 1, ray 2, batch N (this process, "
                             "--batch-size N), batch auto (--batch-size auto), local W batch N (W worker processes, "
                             "--batch-size N)")
    args = parser.parse_args()
    order = [name.strip() for name in args.configs.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    if args.docs:
        if args.questions is None:
            parser.error("--docs needs --questions")
        specs = cross_product([args.docs], read_questions(args.questions))[: args.jobs]
    else:
        specs = make_jobs(work, 10, args.jobs // 10, seed=0)
    model, _ = resolve_default_model(None)
    n = args.gen_length
    settings = AnswerSettings(policy=args.policy, gen_length=n, steps=n, block_length=n)
    ray_start = 0.0
    uses_ray = any(name.startswith("ray") for name in order)
    if uses_ray:
        import ray

        started = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=str(work / "ray"))
        ray_start = time.perf_counter() - started
    configs = {"local 1": Runner(devices=("cpu",)), "local 2": Runner(devices=("cpu", "cpu")),
               "ray 1": Runner(ray="auto", workers=1), "ray 2": Runner(ray="auto", workers=2)}
    configs.update({name: Runner(device="cpu", batch_size=None if name == "batch auto" else int(name.split()[1]))
                    for name in order if name.startswith("batch ")})
    configs.update({name: Runner(devices=("cpu",) * int(name.split()[1]), batch_size=int(name.split()[3]))
                    for name in order if name.startswith("local ") and " batch " in name})
    sized = [n for n in order if n.startswith("batch ") and n != "batch auto"]
    limits = BatchLimits(sized, specs, model, settings) if sized else None
    runs: list[dict[str, object]] = []
    answers: dict[str, dict[str, str]] = {}
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            out = work / f"{name.replace(' ', '-')}-{r}"
            before = limits.seconds(name) if limits is not None and name in sized else []
            t0 = time.perf_counter()
            result = run_batch(specs, settings, model, out, runner=configs[name])
            wall = time.perf_counter() - t0
            rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
            answers.setdefault(name, {}).update({row["key"]: row["answer"] for row in rows})
            runs.append({"config": name, "round": r, "ok": result.ok, "failed": result.failed,
                         "jobs_per_minute": round(result.jobs_per_minute, 1), "steady_s": round(result.seconds, 2),
                         "wall_s": round(wall, 2), "runner": result.runner})
            runs[-1]["load_average"] = round(os.getloadavg()[0], 1)
            if result.batch_note:  # how ``auto`` chose its size
                runs[-1]["batch_note"] = result.batch_note
            if limits is not None and name in sized:
                runs[-1]["limit_jobs_per_minute"] = round(limits.rate(name, before + limits.seconds(name)), 1)
            print(json.dumps(runs[-1]), flush=True)
    if uses_ray:
        ray.shutdown()
    reference = answers[order[0]]
    same = {name: got == reference for name, got in answers.items()}
    summary: dict[str, dict[str, float]] = {}
    for name in order:  # pooled over the rounds: all jobs / all steady seconds
        mine = [run for run in runs if run["config"] == name]
        jobs = sum(int(run["ok"]) + int(run["failed"]) for run in mine)  # type: ignore[call-overload]
        steady = sum(float(run["steady_s"]) for run in mine)  # type: ignore[arg-type]
        summary[name] = {"jobs": jobs, "jobs_per_minute": round(jobs / steady * 60, 1),
                         "per_round": [run["jobs_per_minute"] for run in mine],  # type: ignore[dict-item]
                         "wall_s_median": statistics.median(float(run["wall_s"]) for run in mine)}  # type: ignore
    base = summary[order[0]]["jobs_per_minute"]
    for name in order:
        summary[name][f"rate_vs_{order[0].replace(' ', '_')}"] = round(summary[name]["jobs_per_minute"] / base, 3)
    for n in ("1", "2"):
        if f"ray {n}" in summary and f"local {n}" in summary:
            summary[f"ray {n}"]["rate_vs_local_same_n"] = round(
                summary[f"ray {n}"]["jobs_per_minute"] / summary[f"local {n}"]["jobs_per_minute"], 3)
    for name in sized:  # each round's limit against that round's run; the median of the rounds
        mine = [run for run in runs if run["config"] == name]
        limit = [float(run["limit_jobs_per_minute"]) for run in mine]  # type: ignore[arg-type]
        summary[name]["limit_jobs_per_minute"] = round(statistics.median(limit), 1)
        summary[name]["measured_over_limit"] = round(statistics.median(
            lim / float(run["jobs_per_minute"]) for lim, run in zip(limit, mine, strict=True)), 3)  # type: ignore
    for name in sized if args.paired and limits is not None else []:
        summary[name]["paired_over_limit"] = limits.paired(name, specs, settings, args.paired)  # type: ignore
    report = {"jobs_per_run": len(specs), "rounds": args.rounds, "load_average_after": os.getloadavg(),
              "ray_cluster_start_s": round(ray_start, 2),
              "answers_equal_local_1": same, "summary": summary, "runs": runs, "model": model}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-batch.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
