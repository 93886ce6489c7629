"""The one driver of denoising loops: every loop is a generator, and every step of every running loop goes through
the engine together.

A loop (``llada.py``, ``dream.py``, ``llada2.py``) yields what it needs the forward to compute (``StepRequest``) and
is sent the logits back. ``step_round`` takes the pending request of every running generation, asks each one's
forward for its engine lane (``sampling/forward.py``), runs the prefill lanes in joined runs of up to
``engine.prefill.join_rows`` rows (``prefill_groups``; a longer prompt alone) and all step lanes in one step
(``engine/prefill.py``, ``engine/step.py``), and sends each loop its logits. ``drive`` runs one generation this
way; ``sampling/stream.py`` runs many, joining and leaving. A generation's own failure (a progress callback that
stops it, say) ends it alone; a failed shared forward (out of memory, ...) ends the generations in it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from maskkv_cli.engine.lanes import PrefillLane, StepLane
from maskkv_cli.engine.prefill import join_rows, prefill_lanes
from maskkv_cli.engine.step import step_logits
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.sampling.forward import Forward, Lane, StepRequest

if TYPE_CHECKING:
    from maskkv_cli.sampling.common import GenerationResult

# A denoising loop as a generator: it yields what it needs the forward to compute and is sent the logits back.
Loop = Generator[StepRequest, Tensor, None]


class Run(Protocol):
    """A generation's state as the driver sees it: its forward, and its result once its loop has ended."""

    forward: Forward

    def result(self) -> GenerationResult: ...


class Generation:
    """One running generation: its state, its loop and the loop's pending request. An error raised by the loop ends
    this generation only: ``error`` holds it."""

    def __init__(self, index: int, run: Run, loop: Loop) -> None:
        self.index, self.run, self.loop = index, run, loop
        self.request: StepRequest | None = None
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.advance(None)

    def advance(self, logits: Tensor | None) -> None:
        """Send the loop its logits (None: start it); keep its next request, or its result when it ends."""
        try:
            self.request = next(self.loop) if logits is None else self.loop.send(logits)
        except StopIteration:
            self.request = None
            self.result = self.run.result()
        except Exception as exc:  # noqa: BLE001 - the generation's own failure, handed to whoever waits for it
            self.fail(exc)

    def fail(self, exc: BaseException) -> None:
        self.request, self.error = None, exc
        self.loop.close()

    @property
    def done(self) -> bool:
        return self.request is None


def _deliver(gen: Generation, lane: Lane, output: object) -> None:
    try:
        logits = gen.run.forward.take(lane, output)
    except Exception as exc:  # noqa: BLE001
        gen.fail(exc)
        return
    assert gen.request is not None
    gen.advance(logits.to(gen.request.x.device))  # a model spread over devices ends on its last one


def _together(model: DiffusionLM, run: Callable[[DiffusionLM, list], list],  # type: ignore[type-arg]
              pairs: Sequence[tuple[Generation, Lane]]) -> None:
    try:
        outputs = run(model, [lane for _, lane in pairs])
    except Exception as exc:  # noqa: BLE001 - a failed shared forward ends its generations
        for gen, _ in pairs:
            gen.fail(exc)
        return
    for (gen, lane), output in zip(pairs, outputs, strict=True):
        _deliver(gen, lane, output)


def prefill_groups(pairs: Sequence[tuple[Generation, PrefillLane]],
                   cap: int) -> list[list[tuple[Generation, PrefillLane]]]:
    """The prefills of one round in runs that go through the engine together: consecutive lanes while their rows
    together stay within ``cap`` (``engine.prefill.join_rows``); a lane of more rows alone. Each lane's numbers are
    the same in any run (``models/rows.py``), so this decides only the speed."""
    groups: list[list[tuple[Generation, PrefillLane]]] = []
    rows = 0
    for gen, lane in pairs:
        n = lane.ids.shape[0] * (lane.ids.shape[1] - lane.first)
        if not groups or rows + n > cap:
            groups.append([])
            rows = 0
        groups[-1].append((gen, lane))
        rows += n
    return groups


def step_round(model: DiffusionLM, generations: Sequence[Generation]) -> None:
    """One step of every generation that has a request (see the module doc)."""
    prefills: list[tuple[Generation, PrefillLane]] = []
    steps: list[tuple[Generation, Lane]] = []
    for gen in generations:
        if gen.request is None:
            continue
        try:
            lane = gen.run.forward.lane(gen.request)
        except Exception as exc:  # noqa: BLE001
            gen.fail(exc)
            continue
        if lane is None:  # a compiled or captured step: its own fixed shapes
            try:
                logits = gen.run.forward.alone(gen.request)
            except Exception as exc:  # noqa: BLE001
                gen.fail(exc)
                continue
            gen.advance(logits.to(gen.request.x.device))
        elif isinstance(lane, PrefillLane):
            prefills.append((gen, lane))
        else:
            assert isinstance(lane, StepLane)
            steps.append((gen, lane))
    if prefills:
        for group in prefill_groups(prefills, join_rows(model)):
            _together(model, prefill_lanes, group)
    if steps:
        _together(model, step_logits, steps)


def drive(model: DiffusionLM, run: Run, loop: Loop) -> GenerationResult:
    """Run one loop to its end; the result of its generation (its error raised)."""
    gen = Generation(0, run, loop)
    while not gen.done:
        step_round(model, [gen])
    if gen.error is not None:
        raise gen.error
    assert gen.result is not None
    return gen.result
