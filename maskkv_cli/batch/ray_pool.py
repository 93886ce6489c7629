"""A pool of Ray actors: one per GPU of the cluster (``num_gpus=1``), else one per CPU slot, each holding the model.

The driver submits one job at a time to each idle actor and collects results with ``ray.wait``; only the
driver writes the results folder, so the cluster's nodes need no shared disk. A document's text is put in the
object store once (``ray.put``) however many jobs ask about it. Actors are created with ``max_restarts=0`` and
``max_task_retries=0``: when one dies (``ray.kill``, a crashed process, a lost node) its job comes back as a
lost event, ``dispatch`` retries it on another actor (at most twice) and the pool starts a replacement actor.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any

from maskkv_cli.batch.dispatch import Event
from maskkv_cli.batch.jobs import Unit
from maskkv_cli.batch.worker import Worker, WorkerSpec
from maskkv_cli.errors import MaskKVError, UsageError

RAY_EXTRA_HINT = "Ray is not installed: pip install 'maskkv[ray]'"
_WAIT_S = 1.0


def import_ray() -> Any:
    """The ``ray`` module, or a one-line error naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise UsageError(RAY_EXTRA_HINT) from None
    return ray


class BatchActor:
    """The actor's body: a ``Worker`` that lives as long as the actor."""

    def __init__(self, spec: WorkerSpec, name: str) -> None:
        self.worker = Worker(spec, name)

    def ready(self) -> str:
        return self.worker.name

    def run(self, message: dict[str, Any], text: str) -> dict[str, Any]:
        return self.worker.run(message, text)


REACH_S = 5.0  # how long a cluster's address may take to accept a connection (Ray itself retries for ever)


def ray_address(address: str) -> tuple[str, int] | None:
    """The (host, port) of a ``--ray`` address (``HOST:PORT`` or ``ray://HOST:PORT``), None for ``auto``; any other
    form is a usage error (Ray's own was a ValueError after the documents were read)."""
    if address == "auto":
        return None
    rest = address.removeprefix("ray://")
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--ray takes auto, HOST:PORT or ray://HOST:PORT (a running cluster's address); got "
                         f"{address!r}")
    return host.strip("[]"), int(port)


def connect(address: str, quiet: bool = False, **init_args: Any) -> bool:
    """Join the cluster at ``address`` ("auto": the one on this machine, else a new local one); True when this
    call started the connection (and the caller should shut it down). An address where nothing accepts a connection
    within ``REACH_S`` is refused at once: Ray's client waits for it without end. ``quiet``: Ray logs errors only
    (not "Started a local Ray instance", nor its warnings)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    place = ray_address(address)
    if place is not None:
        import socket

        try:
            socket.create_connection(place, timeout=REACH_S).close()
        except OSError as exc:
            raise UsageError(f"cannot reach the Ray cluster at {address} ({exc.strerror or exc}); start it with "
                             "`ray start --head` or pass --ray auto") from None
    try:
        ray.init(address=None if place is None else address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR if quiet else logging.INFO, **init_args)
    except (ConnectionError, ValueError) as exc:
        raise UsageError(f"cannot reach the Ray cluster at {address}: {exc}; start it with `ray start --head` "
                         "or pass --ray auto") from None
    return True


class RayPool:
    """``workers``: how many actors (default: one per GPU, else one per CPU of the cluster)."""

    def __init__(self, spec: WorkerSpec, workers: int | None = None, max_replacements: int | None = None) -> None:
        self.ray = import_ray()
        resources = self.ray.cluster_resources()
        self.gpus = int(resources.get("GPU", 0))
        cpus = max(1, int(resources.get("CPU", 1)))
        self.count = workers or (self.gpus if self.gpus else cpus)
        if self.gpus:
            options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 1}
            self.spec = replace(spec, device="cuda")
        else:  # the CPUs shared out between the actors (no more than one node has), one torch thread per CPU
            per_node = max([int(n.get("Resources", {}).get("CPU", 0)) for n in self.ray.nodes() if n.get("Alive")]
                           or [1])
            share = max(1, min(cpus // self.count, per_node))
            options = {"num_cpus": share}
            cap = os.environ.get("OMP_NUM_THREADS", "")  # as local workers: no more threads than the user allows
            threads = min(share, int(cap)) if cap.isdigit() and int(cap) > 0 else share
            self.spec = replace(spec, device="cpu", threads=spec.threads or threads)
        self.actor_class = self.ray.remote(BatchActor).options(max_restarts=0, max_task_retries=0, **options)
        self.actors: dict[int, Any] = {}
        self.starting: dict[Any, int] = {}  # ready() ref -> worker id
        self.running: dict[Any, int] = {}  # run() ref -> worker id
        self.refs: dict[str, Any] = {}  # document sha -> object ref of its text
        self.replacements_left = self.count * 2 if max_replacements is None else max_replacements
        self._next = 0

    @property
    def kind(self) -> str:
        each = "one GPU each" if self.gpus else f"{self.spec.threads} CPU thread(s) each"
        return f"{self.count} Ray actor(s), {each}"

    def _spawn(self) -> None:
        wid = self._next
        self._next += 1
        actor = self.actor_class.remote(self.spec, str(wid))
        self.actors[wid] = actor
        self.starting[actor.ready.remote()] = wid

    def start(self) -> list[int]:
        for _ in range(self.count):
            self._spawn()
        ready: list[int] = []
        while not ready:  # the first actor loads its model before any job: a bad model fails once, clearly;
            for event in self._collect(list(self.starting)):  # the others join as they become ready
                if event.kind == "lost":
                    self.close()
                    raise MaskKVError(f"a Ray actor could not start: {event.reason}")
                ready.append(event.worker)
        return ready

    def submit(self, worker: int, job: Unit, text: Any) -> None:
        ref = self.refs.get(job.document_sha)
        if ref is None:
            ref = self.refs[job.document_sha] = self.ray.put(text)
        self.running[self.actors[worker].run.remote(job.message(), ref)] = worker

    def actor(self, worker: int) -> Any:
        """The actor handle of a worker id (tests kill it with ``ray.kill``)."""
        return self.actors[worker]

    def _collect(self, refs: list[Any]) -> list[Event]:
        done, _ = self.ray.wait(refs, num_returns=1, timeout=_WAIT_S)
        events: list[Event] = []
        for ref in done:
            starting = ref in self.starting
            wid = self.starting.pop(ref) if starting else self.running.pop(ref)
            try:
                value = self.ray.get(ref)
            except self.ray.exceptions.RayError as exc:
                events.append(Event("lost", wid, reason=_first_line(exc)))
                continue
            events.append(Event("ready", wid) if starting else Event("done", wid, value))
        return events

    def wait(self) -> list[Event]:
        while True:
            events = self._collect([*self.running, *self.starting])
            if events:
                return events

    def replace(self, worker: int) -> bool:
        actor = self.actors.pop(worker, None)
        if actor is not None:
            self.ray.kill(actor, no_restart=True)
        if self.replacements_left <= 0:
            return False
        self.replacements_left -= 1
        self._spawn()
        return True

    def pending(self) -> int:
        return len(self.starting)

    def close(self) -> None:
        for actor in self.actors.values():
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors.clear()
        self.starting.clear()
        self.running.clear()
        self.refs.clear()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
