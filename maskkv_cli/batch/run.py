"""``run_batch``: plan the jobs, skip the finished ones, run the rest on a pool, write each row as it arrives.

No Rich or Typer here: progress goes to a callback, the command renders it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maskkv_cli.batch.dispatch import Pool, dispatch
from maskkv_cli.batch.documents import LoadedDocument, load_documents
from maskkv_cli.batch.folder import CONFIG_FILE, SUMMARY_FILE, AnswersFolder
from maskkv_cli.batch.jobs import AnswerSettings, Job, JobSpec, group_jobs, job_settings, plan_jobs
from maskkv_cli.batch.worker import WorkerSpec
from maskkv_cli.documents.model import format_page_ranges, pages_label
from maskkv_cli.errors import UsageError
from maskkv_cli.reports.answers import answer_line, cell_confidence, untrained_note
from maskkv_cli.runtime.devices import machine_info, resolve_device

if TYPE_CHECKING:
    from maskkv_cli.models.checkpoint import ModelFolder

DUPLICATES_NAMED = 20  # duplicate jobs summary.md names (then "and N more"; --json gives them all)


@dataclass(frozen=True)
class Runner:
    """Where the jobs run: this process (default), local processes (``devices``) or Ray (``ray`` address)."""

    devices: tuple[str, ...] = ()  # one worker process per entry ("cuda:0", or "cpu" repeated for --workers)
    ray: str | None = None  # "auto" or a cluster address
    workers: int | None = None  # with ray: how many actors (default: one per GPU, else per CPU)
    device: str = "auto"  # this process's device when neither of the above
    batch_size: int | None = 1  # jobs of equal settings a worker denoises together; None: as many as fit (auto)
    quiet: bool = False  # Ray's own log lines (its start, its warnings) left out: errors only

    @property
    def label(self) -> str:
        if self.ray:
            return f"ray {self.ray}"
        if self.devices:
            return f"{len(self.devices)} worker process(es): {','.join(self.devices)}"
        return f"this process ({self.device})"


@dataclass(frozen=True)
class BatchProgress:
    done: int  # finished now or earlier (including failures)
    failed: int
    left: int
    total: int
    reused: int
    jobs_per_minute: float  # jobs finished by this run per minute since the first job was sent
    eta_s: float | None
    phase: str = "run"  # "parse" while documents are read, then "run"
    row: dict[str, Any] | None = None  # the row just written


@dataclass
class BatchResult:
    folder: Path
    total: int
    ok: int
    failed: int
    reused: int
    ran: int
    duplicates: int
    seconds: float
    jobs_per_minute: float
    failures: list[dict[str, Any]] = field(default_factory=list)
    runner: str = ""
    answered: int = 0  # jobs run by a worker now (``ran`` also counts documents that failed to parse)
    low: int = 0  # answers (of every job, this run's and earlier ones) marked LOW CONFIDENCE
    untrained: int = 0  # the embedded model asked a question of another form than it was trained on
    batch_sizes: list[int] = field(default_factory=list)  # the batch sizes the jobs run now were answered at
    batch_note: str = ""  # how an automatic batch size was chosen (the first worker's line)
    same_as: dict[str, str] = field(default_factory=dict)  # a duplicate job's id -> the id answered for it

    def as_dict(self) -> dict[str, Any]:
        return {"out": str(self.folder), "jobs": self.total, "ok": self.ok, "failed": self.failed,
                "reused": self.reused, "ran": self.ran, "answered": self.answered, "duplicates": self.duplicates,
                "same_as": self.same_as,
                "seconds": round(self.seconds, 3), "jobs_per_minute": round(self.jobs_per_minute, 2),
                "runner": self.runner, "batch_sizes": self.batch_sizes, "low_confidence": self.low,
                "untrained_questions": self.untrained,
                "failures": [{"id": r["id"], "document": r["document"], "error": r["error"]} for r in self.failures]}


def resolve_dtype(dtype: str, device_kind: str, quantize: str = "none") -> str:
    """The precision a worker loads in: ``auto`` is bf16 on a GPU and fp32 on the CPU, bf16 there too with int4
    weights (as ``Session``: ``models.loading.parse_dtype``)."""
    if dtype != "auto":
        return dtype
    return "bf16" if device_kind == "cuda" or quantize == "int4" else "fp32"


def _row(job: Job, fields: dict[str, Any], attempts: int, gen_length: int | None,
         pages: Sequence[tuple[int, int, int]] = ()) -> dict[str, Any]:
    """A row of answers.jsonl: the job, and what answering it gave (what was read named by page when ``pages``,
    the document's page spans, are known)."""
    if pages and fields.get("read"):
        from maskkv_cli.app.pipeline import add_pages

        add_pages(fields, pages)
    return {"key": job.key, "id": job.id, "document": job.document, "document_sha": job.document_sha,
            "question": job.question, "answer": fields.get("answer"), "claim": fields.get("claim"),
            "confidence": fields.get("confidence"), "note": fields.get("note"), "read": fields.get("read"),
            "source": fields.get("source"), "parts": fields.get("parts"), "policy": job.settings.policy,
            "budget": fields.get("budget", job.settings.budget), "gen_length": gen_length,
            "prompt_tokens": fields.get("prompt_tokens"), "dropped_tokens": fields.get("dropped_tokens"),
            "rope_factor": fields.get("rope_factor"), "stats": fields.get("stats"), "notes": fields.get("notes", []),
            "error": fields.get("error"), "worker": fields.get("worker"), "seconds": fields.get("seconds"),
            "batch_size": fields.get("batch_size", 1), "attempts": attempts}


def worker_threads(workers: int) -> int:
    """Torch threads per local worker: the cores shared out (N workers never ask for more threads than there are
    cores), and no more than ``OMP_NUM_THREADS`` when it is set (on a machine shared with other work, one
    thread per worker is much faster than two that wait for each other: docs/scale.md)."""
    threads = max(1, (os.cpu_count() or 1) // workers)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(cap)) if cap.isdigit() and int(cap) > 0 else threads


def make_pool(runner: Runner, spec: WorkerSpec) -> tuple[Pool, str]:
    """The pool and the device kind its workers use ("cuda" or "cpu"), which enters the job keys."""
    if runner.ray:
        from maskkv_cli.batch.ray_pool import RayPool, connect

        connect(runner.ray, quiet=runner.quiet)  # joins the cluster unless this process already has
        pool = RayPool(spec, runner.workers)
        return pool, "cuda" if pool.gpus else "cpu"
    if runner.devices:
        from maskkv_cli.batch.local import ProcessPool

        kinds = {d.split(":")[0] for d in runner.devices}
        if len(kinds) > 1:
            raise UsageError("--devices mixes CPU and GPU workers; their answers can differ, run them separately")
        return ProcessPool(spec, list(runner.devices), threads=worker_threads(len(runner.devices))), kinds.pop()
    from dataclasses import replace

    from maskkv_cli.batch.local import InProcessPool

    device = resolve_device(runner.device)

    return InProcessPool(replace(spec, device=device)), device.split(":")[0]


def run_batch(
    specs: Sequence[JobSpec],
    settings: AnswerSettings,
    model_path: str | ModelFolder,
    out: Path,
    *,
    runner: Runner = Runner(),
    dtype: str = "auto",
    password: str | None = None,
    on_progress: Callable[[BatchProgress], None] | None = None,
    on_submit: Callable[[Pool, int, Job], None] | None = None,
    quantize: str = "none",
) -> BatchResult:
    """Answer every job not already finished in ``out``; returns the counts (failures are rows, not errors).
    ``model_path``: the ``ModelFolder`` the command chose, or a path (resolved here); ``quantize``: the weights'
    quantization every worker loads (none, int8, int4; part of every job's key)."""
    from maskkv_cli.app.run_settings import check_policy_family, family_defaults, resolve_generation
    from maskkv_cli.batch.answering import run_settings
    from maskkv_cli.models.checkpoint import ModelFolder
    from maskkv_cli.policies.base import check_policy
    from maskkv_cli.sampling.llada import GenerationConfig

    policies = {s.policy or settings.policy for s in specs}
    for policy in policies:
        check_policy(policy)
    model = ModelFolder.of(model_path)  # a path is resolved here, once; the workers get its name
    run_settings(settings).check_family(model.config.family)  # options the model's sampler does not take
    for policy in sorted(policies):  # a job's own policy too: one its model's cache cannot run stops the run here
        check_policy_family(policy, model.config.family)
    model_path = model.name
    model_id = model.fingerprint
    defaults = family_defaults(model.defaults.generation, model.config.family)
    tell = on_progress or (lambda event: None)
    total = len(specs)

    def parsed(doc: LoadedDocument) -> None:
        tell(BatchProgress(0, 0, total, total, 0, 0.0, None, phase="parse"))

    documents = load_documents([s.document for s in specs], password, parsed)
    shas = {path: doc.sha256 for path, doc in documents.items()}
    texts = {doc.sha256: doc.text for doc in documents.values() if not doc.error}
    spec = WorkerSpec(model_path=model_path, dtype=None if dtype == "auto" else dtype, quantize=quantize)
    pool, device_kind = make_pool(runner, spec)

    def generation(gen_length: int | None) -> tuple[int, int, int]:
        triple = resolve_generation(defaults, gen_length, settings.steps, settings.block_length)
        GenerationConfig(*triple)  # an impossible combination is a usage error now, not a failure of every job
        return triple

    jobs, same_as = plan_jobs(list(specs), shas, lambda s: job_settings(s, settings, generation), model_id,
                              resolve_dtype(dtype, device_kind, quantize), device_kind, quantize)
    started = time.perf_counter()
    # a row kept from an earlier run is named by this run's id and path for its job (same key: same content,
    # question and settings; the id or the file's place may have changed since)
    folder = AnswersFolder(out).open([job.key for job in jobs],
                                     {job.key: {"id": job.id, "document": job.document} for job in jobs})
    counts = {"ok": 0, "failed": 0, "ran": 0, "answered": 0}
    sizes: set[int] = set()
    batch_notes: list[str] = []
    failures: list[dict[str, Any]] = []
    first_sent: list[float] = []
    try:
        config = {"model": model_path, "model_id": model_id, "dtype": resolve_dtype(dtype, device_kind, quantize),
                  "quantize": quantize, "device": device_kind, "settings": settings.as_dict(),
                  "generation_defaults": defaults,
                  "runner": pool_label(pool, runner), "jobs": len(jobs), "machine": machine_info(),
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        folder.write_text(CONFIG_FILE, json.dumps(config, indent=2, default=str) + "\n")
        reused = sum(1 for job in jobs if job.key in folder.finished)
        counts["ok"] = reused

        def report(job: Job, fields: dict[str, Any], attempts: int) -> None:
            row = _row(job, fields, attempts, job.settings.gen_length, documents[job.document].pages)
            folder.append(row)
            if attempts > 0 and not row["error"]:
                sizes.add(int(row["batch_size"] or 1))
                if fields.get("batch_note") and not batch_notes:
                    batch_notes.append(fields["batch_note"])
            counts["ran"] += 1
            counts["answered"] += attempts > 0  # run by a worker (not a document that failed to parse)
            if row["error"]:
                counts["failed"] += 1
                failures.append(row)
            else:
                counts["ok"] += 1
            done = counts["ok"] + counts["failed"]
            elapsed = time.perf_counter() - (first_sent[0] if first_sent else started)
            rate = counts["answered"] / elapsed * 60 if elapsed > 0 and first_sent else 0.0
            left = len(jobs) - done
            tell(BatchProgress(done, counts["failed"], left, len(jobs), reused, rate,
                               left / rate * 60 if rate > 0 else None, row=row))

        todo = [job for job in jobs if job.key not in folder.finished]
        for job in todo:
            error = documents[job.document].error
            if error:
                report(job, {"answer": None, "error": error}, 0)
        runnable = [job for job in todo if not documents[job.document].error]
        runnable.sort(key=lambda job: job.document_sha)  # stable: a worker keeps one document at a time
        tell(BatchProgress(reused + counts["failed"], counts["failed"], len(runnable), len(jobs), reused, 0.0, None))
        if runnable:
            def submitted(worker: int, job: Job) -> None:
                if not first_sent:
                    first_sent.append(time.perf_counter())
                if on_submit is not None:
                    on_submit(pool, worker, job)

            try:
                dispatch(group_jobs(runnable, runner.batch_size), pool, texts, report, on_submit=submitted)
            finally:
                pool.close()
    finally:
        seconds = time.perf_counter() - (first_sent[0] if first_sent else started)
        answered_rows = [folder.rows[j.key] for j in jobs if j.key in folder.rows and not folder.rows[j.key]["error"]]
        result = BatchResult(folder=out, total=len(jobs), ok=counts["ok"], failed=counts["failed"],
                             reused=sum(1 for job in jobs if job.key in folder.finished), ran=counts["ran"],
                             duplicates=len(same_as), same_as=same_as, seconds=seconds,
                             jobs_per_minute=counts["answered"] / seconds * 60 if first_sent and seconds > 0 else 0.0,
                             failures=failures, runner=pool_label(pool, runner), answered=counts["answered"],
                             low=sum(1 for r in answered_rows if (r.get("confidence") or {}).get("low")
                                     and r.get("claim") != "untrained-question"),
                             untrained=sum(1 for r in answered_rows if r.get("claim") == "untrained-question"),
                             batch_sizes=sorted(sizes), batch_note=batch_notes[0] if batch_notes else "")
        shown = [folder.rows[j.key] for j in jobs if j.key in folder.rows]
        folder.write_text(SUMMARY_FILE, summary_markdown(result, config_of(model_path, settings, quantize), shown))
        folder.close()
    return result


def pool_label(pool: Any, runner: Runner) -> str:
    return getattr(pool, "kind", "") or runner.label


def config_of(model_path: str, settings: AnswerSettings, quantize: str = "none") -> dict[str, Any]:
    """What summary.md names: the model (with its weights' quantization when there is one) and the settings."""
    return {"model": model_path if quantize == "none" else f"{model_path} ({quantize} weights)", **settings.as_dict()}


def _shown(row: dict[str, Any]) -> str:
    """The answer as ``maskkv ask`` shows it (a cut named on its line), or why there is none."""
    if row.get("claim") is None:  # a row of a batch run before answers said what they claim
        return str(row.get("answer") or "")
    line = answer_line(row)
    if line is not None:
        return line
    return "(no answer)" if row["claim"] == "empty" else "(not shown: untrained question)"


def _read_cell(row: dict[str, Any]) -> str:
    read, source = row.get("read"), row.get("source") or {}
    if not read:
        return ""
    pages = read.get("pages")
    if read["complete"]:
        total = read.get("pages_total")
        what = "all" if pages is None else "its 1 page" if total == 1 else f"all {total} pages"
        what += f" in {read['parts']} parts" if read["parts"] > 1 else ""
    else:
        what = f"pages {format_page_ranges(pages)} of {read['pages_total']} (cut)" if pages is not None else "cut"
    if read["parts"] > 1 and source.get("pages") and row.get("claim") == "answer":
        what += f"; from {pages_label(source['pages'])}"
    return what


def _budget_label(config: dict[str, Any]) -> str:
    """The run's budget as its rows record it: the one given, the ratio, else the default (256) for a policy that
    evicts (summary.md said "budget default" over rows of 256)."""
    from maskkv_cli.defaults import DEFAULT_BUDGET
    from maskkv_cli.policies.base import get_policy

    if config.get("budget"):
        return str(config["budget"])
    if config.get("ratio"):
        return f"{config['ratio']} of each prompt"
    return f"{DEFAULT_BUDGET} (default)" if get_policy(config["policy"]).evicts else "none (the whole prompt kept)"


def summary_markdown(result: BatchResult, config: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Counts, the failures with their errors, and every answer (questions and answers cut to 120 characters)."""
    def cell(text: Any) -> str:
        value = "" if text is None else str(text).replace("\n", " ").replace("|", "\\|")
        return value if len(value) <= 120 else value[:117] + "..."

    lines = ["# maskkv batch", "",
             f"- model: `{config['model']}`; policy {config['policy']}, budget {_budget_label(config)}, "
             f"seed {config['seed']}",
             f"- runner: {result.runner}",
             f"- jobs: {result.total}; answered: {result.ok} ({result.reused} from earlier runs); failed: "
             f"{result.failed}; not run yet: {result.total - result.ok - result.failed}",
             f"- this run: {result.answered} jobs answered in {result.seconds:.1f} s from the first one sent "
             f"({result.jobs_per_minute:.1f} jobs per minute)" if result.ran else "- this run: no job was left to run",
             ""]
    if result.duplicates:
        pairs = [f"`{dropped}` (as `{kept}`)" for dropped, kept in list(result.same_as.items())[:DUPLICATES_NAMED]]
        more = f" and {result.duplicates - len(pairs)} more" if result.duplicates > len(pairs) else ""
        lines += [f"- {result.duplicates} duplicate job(s) in the input (the same document content, question and "
                  f"settings as another) were run once, their answer under the other's id: {', '.join(pairs)}{more}",
                  ""]
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["## Failed", "", "| id | document | error |", "|---|---|---|"]
        lines += [f"| {cell(r['id'])} | {cell(Path(r['document']).name)} | {cell(r['error'])} |" for r in failed]
        lines.append("")
    lines += ["## Answers", "",
              "Confidence: mean / lowest token probability, LOW when the lowest is under the model's cut. Read: the "
              "pages the model read (all, or what a cut left), and the pages the answer came from.", "",
              "| id | document | question | answer | confidence | read |", "|---|---|---|---|---|---|"]
    lines += [f"| {cell(r['id'])} | {cell(Path(r['document']).name)} | {cell(r['question'])} | "
              f"{cell(_shown(r))} | {cell_confidence(r)} | {cell(_read_cell(r))} |"
              for r in rows if not r.get("error")]
    if result.untrained:
        lines += ["", f"{result.untrained} question(s) are not of the form the embedded model was trained on: "
                  + untrained_note("")]
    return "\n".join(lines) + "\n"
