"""Generations handed in by many threads, run by one thread in shared batches (continuous batching).

A ``GenerationService`` owns the model's forward passes: ``generate`` (called from any thread, e.g. a server's
request threads) queues one generation and blocks until it is done; the service's thread keeps up to
``batch_size`` generations running together (``stream.sample_stream``), taking new ones in as others finish. A
generation's tokens are those it gets alone. An error inside one generation (its progress callback stopping it,
say) is raised in its caller's thread only.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch
from torch import Tensor

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.sampling import SamplerOptions
from maskkv_cli.sampling.common import Event, GenerationResult
from maskkv_cli.sampling.llada import GenerationConfig
from maskkv_cli.sampling.stream import BatchJob, sample_stream

__all__ = ["GenerationService"]

_STOP = None  # queued by ``close``: the service's thread ends when nothing runs any more


class GenerationService:
    """One thread running every generation submitted to it, up to ``batch_size`` at a time."""

    def __init__(self, model: DiffusionLM, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.model, self.batch_size = model, batch_size
        self._queue: queue.Queue[tuple[int, BatchJob] | None] = queue.Queue()
        self._futures: dict[int, Future[GenerationResult]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="maskkv-batches", daemon=True)
        self._thread.start()

    def generate(self, prompt: Tensor, gen: GenerationConfig, plan: CachePlan,
                 on_event: Callable[[Event], None] | None = None,
                 options: SamplerOptions | None = None) -> GenerationResult:
        """Run one generation with the others in flight; blocks until it is done (its errors are raised here)."""
        future: Future[GenerationResult] = Future()
        with self._lock:
            if self._stopping:
                raise RuntimeError("the generation service is closed")
            index = next(self._ids)
            self._futures[index] = future
        self._queue.put((index, BatchJob(prompt, gen, plan, on_event, options)))
        return future.result()

    def close(self) -> None:
        """Finish what runs and what waits, then stop the thread."""
        with self._lock:
            self._stopping = True
        self._queue.put(_STOP)
        self._thread.join()

    # -- the service's thread ----------------------------------------------------------------------

    def _take(self, room: int, wait: bool) -> list[tuple[int, BatchJob]]:
        taken: list[tuple[int, BatchJob]] = []
        while len(taken) < room:
            try:
                item = self._queue.get(block=wait and not taken)
            except queue.Empty:
                break
            if item is _STOP:
                if taken or not wait:  # the stop waits until everything before it has run
                    self._queue.put(_STOP)
                    break
                return []
            taken.append(item)
        return taken

    def _finish(self, index: int, result: GenerationResult | None, error: BaseException | None) -> None:
        with self._lock:
            future = self._futures.pop(index)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def _run(self) -> None:
        with torch.no_grad():
            try:
                sample_stream(self.model, self._take, self.batch_size, self._finish)
            except BaseException as exc:  # a failure outside any one generation: every waiting caller hears it
                with self._lock:
                    waiting = list(self._futures.values())
                    self._futures.clear()
                for future in waiting:
                    future.set_exception(exc)
