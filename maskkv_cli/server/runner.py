"""Requests run by a few worker threads, behind a bounded queue.

``workers`` requests run at once, each in its own worker thread (one by default: the model runs there; with a
batch size above 1 the server gives each of that many requests a thread, and their generations run together in the
session's ``GenerationService``). ``Runner.submit`` admits a request or refuses it at once when ``workers + queue``
requests are already in (``QueueFull``, which the app answers with 429 and ``Retry-After``). Each admitted request
is a ``Job``: its work runs in a worker with a ``check`` to call between denoising steps, which stops the generation
when the client has gone (``Job.cancel``) or the request's time limit has passed (the limit counts from admission,
waiting included). A job cancelled while it waits never runs.
"""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Cancelled", "Job", "QueueFull", "Runner", "ShuttingDown", "TimedOut"]

T = TypeVar("T")


class Cancelled(Exception):
    """The client went away; the generation stopped between two denoising steps."""


class ShuttingDown(Exception):
    """The server is stopping (Ctrl-C or SIGTERM): the request was refused, or its generation stopped between two
    denoising steps."""


class TimedOut(Exception):
    """The request ran past its time limit."""

    def __init__(self, limit_s: float) -> None:
        super().__init__(f"the request ran past the server's time limit of {limit_s:g} s")
        self.limit_s = limit_s


class QueueFull(Exception):
    """No room in the queue; ``retry_after`` is an estimate, in whole seconds, of when there will be."""

    def __init__(self, retry_after: int, capacity: int) -> None:
        super().__init__(f"the server is busy: {capacity} request{'s are' if capacity > 1 else ' is'} running or "
                         "waiting, its limit")
        self.retry_after = retry_after
        self.capacity = capacity


def without_frames(error: BaseException, keep_stack: bool) -> BaseException:
    """``error`` (and the exceptions it chains) without its traceback, the stack kept as text in a note where
    ``keep_stack`` (an error nobody foresaw, which the server's log prints).

    A traceback holds the frames it passed through, and each frame its caller and its local variables: the stopped
    generation, its prompt cache (gigabytes on a GPU), and the job, whose future holds the error again. That is a
    cycle, freed at the cycle collector's next full run, which may be long after the request was answered; without
    the traceback every one of them is freed when the request lets go of the error."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        link = pending.pop()
        if id(link) in seen:
            continue
        seen.add(id(link))
        if link.__traceback__ is not None:
            if keep_stack:
                link.add_note("Traceback (most recent call last):\n"
                              + "".join(traceback.format_tb(link.__traceback__)).rstrip())
            link.__traceback__ = None
        # both: ``raise A from B`` in a handler of C has B as its cause and C as its context, each with its frames
        pending += [e for e in (link.__cause__, link.__context__) if e is not None]
    return error


class Job(Generic[T]):
    """One admitted request: its work, its deadline, its cancellation flag, and the future of its result."""

    def __init__(self, limit_s: float, release: Callable[[Job[T]], None] | None = None) -> None:
        self.limit_s = limit_s
        self.deadline = time.monotonic() + limit_s
        self.cancelled = threading.Event()
        self.shutting_down = False
        self.future: Future[T] = Future()
        self._release = release  # gives a waiting job's queue place back (the runner's)

    def cancel(self) -> None:
        """The client has gone: the generation stops at its next step; a job still waiting never starts and gives
        its queue place back at once (it held it until a worker reached it, refusing others meanwhile)."""
        self.stop()
        if self._release is not None and not self.future.cancelled() and self.future.cancel():  # only while waiting
            self._release(self)

    def stop(self, shutting_down: bool = False) -> None:
        """Ask the generation to stop at its next step (or, waiting, to stop when a worker reaches it); with
        ``shutting_down`` because the server stops, not because the client went away."""
        if shutting_down:
            self.shutting_down = True
        self.cancelled.set()

    def check(self) -> None:
        """Raise ``Cancelled``, ``ShuttingDown`` or ``TimedOut`` when the job must stop; called by the work between
        steps."""
        if self.cancelled.is_set():
            raise ShuttingDown() if self.shutting_down else Cancelled()
        if time.monotonic() > self.deadline:
            raise TimedOut(self.limit_s)


@dataclass
class Counts:
    """What the runner has done since it started (``GET /health`` shows them)."""

    running: int = 0
    waiting: int = 0
    answered: int = 0
    refused: int = 0  # 429: the queue was full
    cancelled: int = 0  # the client went away
    timed_out: int = 0
    failed: int = 0  # an error answered to the client (a bad document, an engine error, ...)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Runner:
    """The worker threads and their bounded queue (``queue``: requests that may wait behind the running ones)."""

    def __init__(self, queue: int, limit_s: float, workers: int = 1) -> None:
        if queue < 0 or workers < 1:
            raise ValueError("queue must be >= 0 and workers >= 1")
        self.workers = workers
        self.capacity = workers + queue
        self.limit_s = limit_s
        self.counts = Counts()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="maskkv-generate")
        self._live: set[Job[Any]] = set()
        self._mean_s = 1.0  # running mean of a job's time, for Retry-After
        self._closed = False

    def submit(self, work: Callable[[Job[T]], T]) -> Job[T]:
        """Admit ``work`` (called in the worker with its ``Job``) or raise ``QueueFull`` at once."""
        with self._lock:
            busy = self.counts.running + self.counts.waiting
            if self._closed:
                raise ShuttingDown()
            if busy >= self.capacity:
                self.counts.refused += 1
                raise QueueFull(max(1, math.ceil(self._mean_s * busy / self.workers)), self.capacity)
            job: Job[T] = Job(self.limit_s, self._give_back)
            self.counts.waiting += 1
            self._live.add(job)
        self._pool.submit(self._run, job, work)
        return job

    def _give_back(self, job: Job[Any]) -> None:
        """A job cancelled while it waited (``Job.cancel``): its place in the queue is free now."""
        with self._lock:
            if job not in self._live:  # given back already
                return
            self.counts.waiting -= 1
            self.counts.cancelled += 1
            self._live.discard(job)

    def _run(self, job: Job[T], work: Callable[[Job[T]], T]) -> None:
        with self._lock:
            if not job.future.set_running_or_notify_cancel():  # cancelled while it waited: counted then
                return
            self.counts.waiting -= 1
            self.counts.running += 1
        start = time.monotonic()
        result: Any = None
        error: BaseException | None = None
        try:
            job.check()
            result = work(job)
        except BaseException as exc:  # handed to the waiting request, which answers it
            error = exc
        outcome = "answered" if error is None else {Cancelled: "cancelled", ShuttingDown: "cancelled",
                                                    TimedOut: "timed_out"}.get(type(error), "failed")
        with self._lock:  # the figures first: whoever waits on the future sees them up to date
            self.counts.running -= 1
            setattr(self.counts, outcome, getattr(self.counts, outcome) + 1)
            self._live.discard(job)
            if error is None:
                self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - start)
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(without_frames(error, keep_stack=outcome == "failed"))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {**self.counts.as_dict(), "capacity": self.capacity}

    def shut_down(self) -> None:
        """The server stops: refuse new work (``ShuttingDown``) and stop the running and waiting jobs at their next
        check, each answering ``ShuttingDown``. Returns at once."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for job in live:
            job.stop(shutting_down=True)

    def close(self) -> None:
        """``shut_down``, then wait for the workers."""
        self.shut_down()
        self._pool.shutdown(wait=True)
