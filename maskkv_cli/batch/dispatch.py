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

from maskkv_cli.batch.jobs import Job, JobGroup, Unit, unit_text

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

    def submit(self, worker: int, job: Unit, text: Any) -> None: ...

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


def dispatch(jobs: Sequence[Unit], pool: Pool, texts: dict[str, str], report: Report,
             max_retries: int = MAX_RETRIES, on_submit: Callable[[int, Job], None] | None = None) -> None:
    """Run every job on the pool; ``report(job, fields, attempts)`` is called once per job, in finishing order.

    ``texts`` maps a document's sha to its text. ``on_submit(worker, job)`` is a hook for tests and progress. A
    ``JobGroup`` is sent to one worker at once and reported job by job; a group that fails as a whole (an error
    before any of its answers) is run again job by job, so that one job's error stays that job's.
    """
    for job, fields, attempts in results(jobs, pool, texts, max_retries, on_submit):
        report(job, fields, attempts)


def results(jobs: Sequence[Unit], pool: Pool, texts: dict[str, str], max_retries: int = MAX_RETRIES,
            on_submit: Callable[[int, Job], None] | None = None) -> Iterator[tuple[Job, dict[str, Any], int]]:
    """``dispatch`` as a generator: ``(job, fields, attempts)`` for every job, as each finishes."""
    queue: deque[Unit] = deque(jobs)
    idle = deque(pool.start())
    busy: dict[int, Unit] = {}
    attempts: Counter[str] = Counter()
    while queue or busy:
        while queue and idle:
            worker, unit = idle.popleft(), queue.popleft()
            pool.submit(worker, unit, unit_text(unit, texts))
            busy[worker] = unit
            if on_submit is not None:
                for job in members(unit):
                    on_submit(worker, job)
        if not busy and not pool.pending():
            for unit in queue:
                for job in members(unit):
                    yield job, {"answer": None, "error": "no worker left to run it (every worker was lost)"}, \
                        attempts[unit.key]
            return
        for event in pool.wait():
            if event.kind == "ready":
                idle.append(event.worker)
                continue
            if event.worker not in busy:  # a worker lost while it was starting: it had no job
                continue
            unit = busy.pop(event.worker)
            if event.kind == "done":
                idle.append(event.worker)
                if not isinstance(unit, JobGroup):
                    yield unit, event.fields, attempts[unit.key] + 1
                elif "group" in event.fields:
                    shared = {k: event.fields[k] for k in ("worker", "seconds") if k in event.fields}
                    for job, fields in zip(unit.jobs, event.fields["group"], strict=True):
                        yield job, {**fields, **shared}, attempts[unit.key] + 1
                else:  # the group failed as a whole: each job again on its own
                    queue.extendleft(reversed(unit.jobs))
                continue
            attempts[unit.key] += 1
            if attempts[unit.key] <= max_retries:
                queue.appendleft(unit)
            else:
                for job in members(unit):
                    yield job, {"answer": None, "error": f"its worker was lost {attempts[unit.key]} times (last: "
                                                         f"{event.reason})"}, attempts[unit.key]
            pool.replace(event.worker)


def members(unit: Unit) -> tuple[Job, ...]:
    """The jobs a unit holds."""
    return unit.jobs if isinstance(unit, JobGroup) else (unit,)
