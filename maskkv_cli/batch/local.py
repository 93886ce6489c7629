"""Pools on one machine: the driver's own process, or one spawned process per device (``--devices``/``--workers``).

Each worker process loads the model once, then takes jobs one at a time over its own pipe and sends rows back. A
worker receives a document's text only when it differs from its previous job's (jobs arrive grouped by document),
so a document asked many questions crosses the process boundary about once per worker.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import replace
from typing import Any

from maskkv_cli.batch.dispatch import Event
from maskkv_cli.batch.jobs import Unit
from maskkv_cli.batch.worker import Worker, WorkerSpec, one_line_error
from maskkv_cli.errors import MaskKVError

_POLL_S = 0.5


class InProcessPool:
    """One worker: the driver itself (no process boundary; the default)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.worker: Worker | None = None
        self._queued: list[tuple[int, Unit, Any]] = []

    @property
    def kind(self) -> str:
        return f"this process ({self.spec.device})"

    def start(self) -> list[int]:
        self.worker = Worker(self.spec)
        return [0]

    def submit(self, worker: int, job: Unit, text: Any) -> None:
        self._queued.append((worker, job, text))  # run in ``wait``, so that a submit returns at once as elsewhere

    def wait(self) -> list[Event]:
        assert self.worker is not None
        events = [Event("done", worker, self.worker.run(job.message(), text)) for worker, job, text in self._queued]
        self._queued = []
        return events

    def replace(self, worker: int) -> bool:
        return False

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        self.worker = None


def _process_main(spec: WorkerSpec, name: str, conn: Any) -> None:
    """A worker process: load the model, then answer ``(message, text or None)`` until told to stop (None)."""
    try:
        try:
            worker = Worker(spec, name)
        except Exception as exc:
            conn.send(("failed", one_line_error(exc)))
            return
        conn.send(("ready", None))
        text = ""
        while True:
            item = conn.recv()
            if item is None:
                return
            message, new_text = item
            if new_text is not None:
                text = new_text
            conn.send(("done", worker.run(message, text)))
    except (KeyboardInterrupt, EOFError, BrokenPipeError, ConnectionResetError):
        return  # Ctrl-C reaches the whole process group; or the driver is gone (killed): no traceback


class ProcessPool:
    """One spawned process per device; ``devices`` like ``["cuda:0", "cuda:1"]`` or ``["cpu"] * n``.

    Each worker has its own pipe: the driver sends a job and receives its row on the calling thread (no queue
    feeder threads in between), and a worker that dies shows up as the end of its pipe.
    """

    def __init__(self, spec: WorkerSpec, devices: list[str], threads: int | None = None,
                 max_replacements: int | None = None) -> None:
        self.spec = spec
        self.devices = devices
        self.threads = threads
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.device_of: dict[int, str] = {}
        self.last_sha: dict[int, str] = {}
        self.busy: set[int] = set()
        self.starting: set[int] = set()
        self.replacements_left = len(devices) * 2 if max_replacements is None else max_replacements
        self._next = 0

    @property
    def kind(self) -> str:
        return f"{len(self.devices)} worker process(es) on {','.join(self.devices)}, {self.threads} thread(s) each"

    def _spawn(self, device: str) -> int:
        wid = self._next
        self._next += 1
        spec = replace(self.spec, device=device, threads=self.threads)
        mine, theirs = self.ctx.Pipe()
        proc = self.ctx.Process(target=_process_main, args=(spec, str(wid), theirs), daemon=True,
                                name=f"maskkv-batch-{wid}")
        proc.start()
        theirs.close()  # the child holds its end: when it dies, recv() here ends with EOFError
        self.procs[wid], self.conns[wid], self.device_of[wid] = proc, mine, device
        self.starting.add(wid)
        return wid

    def start(self) -> list[int]:
        for device in self.devices:
            self._spawn(device)
        ready: list[int] = []
        while self.starting:  # every worker loads its model before the first job: a bad model fails once, clearly
            for event in self.wait():
                if event.kind == "ready":
                    ready.append(event.worker)
                elif event.kind == "lost":
                    self.close()
                    raise MaskKVError(f"a worker could not start on {self.device_of[event.worker]}: {event.reason}")
        return ready

    def submit(self, worker: int, job: Unit, text: Any) -> None:
        fresh = self.last_sha.get(worker) != job.document_sha
        self.conns[worker].send((job.message(), text if fresh else None))
        self.last_sha[worker] = job.document_sha
        self.busy.add(worker)

    def wait(self) -> list[Event]:
        from multiprocessing.connection import wait

        by_conn = {self.conns[wid]: wid for wid in self.busy | self.starting}
        while True:
            ready = wait(list(by_conn), timeout=_POLL_S)
            if ready:
                return [self._receive(by_conn[conn]) for conn in ready]

    def _receive(self, wid: int) -> Event:
        try:
            kind, payload = self.conns[wid].recv()
        except (EOFError, OSError):
            self.busy.discard(wid)
            self.starting.discard(wid)
            proc = self.procs[wid]
            proc.join(timeout=1)
            return Event("lost", wid, reason=f"worker process {proc.pid} on {self.device_of[wid]} exited with code "
                                             f"{proc.exitcode}")
        self.starting.discard(wid)
        if kind == "ready":
            return Event("ready", wid)
        if kind == "failed":
            return Event("lost", wid, reason=str(payload))
        self.busy.discard(wid)
        return Event("done", wid, payload)

    def replace(self, worker: int) -> bool:
        proc = self.procs.pop(worker, None)
        if proc is not None and proc.is_alive():
            proc.kill()
        conn = self.conns.pop(worker, None)
        if conn is not None:
            conn.close()
        if self.replacements_left <= 0:
            return False
        self.replacements_left -= 1
        self._spawn(self.device_of[worker])
        return True

    def pending(self) -> int:
        return len(self.starting)

    def close(self) -> None:
        """Idle workers stop on their own; a worker still busy (Ctrl-C, an error) is killed: its job is lost."""
        for wid, proc in self.procs.items():
            if wid in self.busy or wid in self.starting:
                proc.kill()
            elif proc.is_alive():
                try:
                    self.conns[wid].send(None)
                except OSError:  # a broken pipe: the process is killed below anyway
                    proc.kill()
        for proc in self.procs.values():
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self.conns.values():
            conn.close()
        self.procs.clear()
        self.conns.clear()
