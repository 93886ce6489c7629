"""Jobs to workers: one job in flight per idle worker, results back to the driver, lost jobs retried.

A pool (in this process, local processes, Ray actors) starts workers, runs one job at a time on each and reports
``Event``s: a job done (its answer fields, which may carry a job's own error), a worker lost with its job
(a dead process, a killed actor, a lost node), or a new worker ready. ``dispatch`` owns the policy: a lost job
goes back to the front of the queue for the next idle worker, at most ``max_retries`` times, then it is
recorded as failed; a lost worker is replaced while the pool allows it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from maskkv_cli.batch.jobs import Job

MAX_RETRIES = 2


@dataclass
class Event:
    kind: str  # "done", "lost" or "ready"
    worker: int
    fields: dict[str, Any] = field(default_factory=dict)  # "done": the worker's answer fields
    reason: str = ""  # "lost": why


class Pool(Protocol):
    def start(self) -> list[int]:
        """Start the workers; return the ids of those ready now (others may report "ready" later)."""
        ...

    def submit(self, worker: int, job: Job, text: str) -> None: ...

    def wait(self) -> list[Event]:
        """Block until at least one event."""
        ...

    def replace(self, worker: int) -> bool:
        """Start a worker in place of a lost one (it reports "ready"); False when the pool gives up."""
        ...

    def pending(self) -> int:
        """Workers starting that have not reported "ready" yet."""
        ...

    def close(self) -> None: ...


Report = Callable[[Job, dict[str, Any], int], None]


def dispatch(jobs: Sequence[Job], pool: Pool, texts: dict[str, str], report: Report,
             max_retries: int = MAX_RETRIES, on_submit: Callable[[int, Job], None] | None = None) -> None:
    """Run every job on the pool; ``report(job, fields, attempts)`` is called once per job, in finishing order.

    ``texts`` maps a document's sha to its text. ``on_submit(worker, job)`` is a hook for tests and progress.
    """
    for job, fields, attempts in results(jobs, pool, texts, max_retries, on_submit):
        report(job, fields, attempts)


def results(jobs: Sequence[Job], pool: Pool, texts: dict[str, str], max_retries: int = MAX_RETRIES,
            on_submit: Callable[[int, Job], None] | None = None) -> Iterator[tuple[Job, dict[str, Any], int]]:
    """``dispatch`` as a generator: ``(job, fields, attempts)`` for every job, as each finishes."""
    queue = deque(jobs)
    idle = deque(pool.start())
    busy: dict[int, Job] = {}
    attempts: Counter[str] = Counter()
    while queue or busy:
        while queue and idle:
            worker, job = idle.popleft(), queue.popleft()
            pool.submit(worker, job, texts[job.document_sha])
            busy[worker] = job
            if on_submit is not None:
                on_submit(worker, job)
        if not busy and not pool.pending():
            for job in queue:
                yield job, {"answer": None, "error": "no worker left to run it (every worker was lost)"}, \
                    attempts[job.key]
            return
        for event in pool.wait():
            if event.kind == "ready":
                idle.append(event.worker)
                continue
            if event.worker not in busy:  # a worker lost while it was starting: it had no job
                continue
            job = busy.pop(event.worker)
            if event.kind == "done":
                idle.append(event.worker)
                yield job, event.fields, attempts[job.key] + 1
                continue
            attempts[job.key] += 1
            if attempts[job.key] <= max_retries:
                queue.appendleft(job)
            else:
                yield job, {"answer": None, "error": f"its worker was lost {attempts[job.key]} times (last: "
                                                     f"{event.reason})"}, attempts[job.key]
            pool.replace(event.worker)
