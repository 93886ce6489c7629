"""The one driver of denoising loops: every loop is a generator, and every step of every running loop goes through
the engine together.

A loop (``llada.py``, ``dream.py``, ``llada2.py``) yields what it needs the forward to compute (``StepRequest``) and
is sent the logits back. ``step_round`` takes the pending request of every running generation, asks each one's
forward for its engine lane (``sampling/forward.py``), runs the prefill lanes in joined runs of up to
``engine.prefill.join_rows`` rows (``prefill_groups``; a longer prompt alone) and all step lanes in one step
(``engine/prefill.py``, ``engine/step.py``), and sends each loop its logits, or, where its request names a greedy
rule (``StepRequest.pick``), that rule's picks, computed once over the rows of every lane of the run that names the
same rule (``sampling/picks.py``). A loop that then commits its most confident positions yields that commit
(``TopCommit``); ``commit_round`` runs the round's commits together (``sampling/commits.py``) and resumes each loop
to its next request. A loop that steps several sequences as one object (``sampling/cohort.py``) yields a
``ManyRequest``: each of its sequences' lanes goes into the round as any other lane, and once all have run it is
sent one pick over all their rows. ``drive`` runs one generation this way; ``sampling/stream.py`` runs many,
joining and leaving. A generation's own failure (a progress callback that stops it, say) ends it alone; a failed
shared forward (out of memory, ...) ends the generations in it.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from maskkv_cli.engine.lanes import PrefillLane
from maskkv_cli.engine.prefill import join_rows, prefill_lanes
from maskkv_cli.engine.step import step_logits
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.sampling.commits import TopCommit, commit_together
from maskkv_cli.sampling.forward import Forward, Lane, ManyRequest, StepRequest
from maskkv_cli.sampling.picks import Pick, Picked, Scratch, joined_span, pick_lanes, pick_one

if TYPE_CHECKING:
    from maskkv_cli.sampling.common import GenerationResult

# A denoising loop as a generator: it yields what it needs the forward to compute and is sent the logits back (its
# picks instead when its request names a greedy rule); a loop that commits its most confident positions yields that
# commit too (``TopCommit``), which the driver runs with the round's others (``sampling/commits.py``).
Reply = Tensor | Picked  # (the reply to a ``TopCommit``: the open positions still masked after it, or None)
Loop = Generator[StepRequest | TopCommit, Reply | None, None]


class Run(Protocol):
    """A generation's state as the driver sees it: its forward, and its result once its loop has ended."""

    forward: Forward

    def result(self) -> GenerationResult: ...


class Generation:
    """One running generation: its state, its loop and the loop's pending request. An error raised by the loop ends
    this generation only: ``error`` holds it."""

    def __init__(self, index: int, run: Run, loop: Loop) -> None:
        self.index, self.run, self.loop = index, run, loop
        scratch = getattr(run, "scratch", None)  # the loops' shared float64 work (``Scratch``), where they have one
        self.scratch: Scratch = scratch if isinstance(scratch, Scratch) else Scratch()
        self.request: StepRequest | ManyRequest | TopCommit | None = None
        self.result: GenerationResult | None = None
        self.error: BaseException | None = None
        self.advance(None)

    def advance(self, reply: Reply | None) -> None:
        """Send the loop its reply (None: start it); keep its next request, or its result when it ends."""
        try:
            self.request = next(self.loop) if reply is None else self.loop.send(reply)
        except StopIteration:
            self.request = None
            self.result = self.run.result()
        except Exception as exc:  # noqa: BLE001 - the generation's own failure, handed to whoever waits for it
            self.fail(exc)

    def answer(self, logits: Tensor, picked: Picked | None = None) -> None:
        """Send the loop its step's logits, or the picks its request asks for (``picked`` when the driver computed
        them with other lanes' rows), on the device of its sequence (a model spread over devices ends on its last)."""
        assert isinstance(self.request, StepRequest)
        device, pick = self.request.x.device, self.request.pick
        if pick is None:
            self.advance(logits.to(device))
            return
        try:
            mine = picked if picked is not None else pick_one(pick, logits, self.scratch)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return
        self.advance(mine.to(device))

    def answer_many(self, parts: Sequence[Tensor]) -> None:
        """Send a loop that steps several sequences (``ManyRequest``) its pick over all their rows at once: ``parts``
        are each sequence's logits (1, n, V), in order (one view of them where they lie back to back)."""
        request = self.request
        assert isinstance(request, ManyRequest)
        try:
            joined = joined_span(list(parts))
            if joined is None:
                joined = torch.cat(list(parts), 1)
            (picked,) = pick_lanes(request.pick, joined, [joined.numel() // joined.shape[-1]],
                                   [(len(parts), parts[0].shape[1])], self.scratch)
        except Exception as exc:  # noqa: BLE001
            self.fail(exc)
            return
        self.advance(picked.to(request.requests[0].x.device))

    def fail(self, exc: BaseException) -> None:
        self.request, self.error = None, exc
        self.loop.close()

    @property
    def done(self) -> bool:
        return self.request is None


def _shared_picks(gens: Sequence[Generation], logits: Sequence[Tensor]) -> dict[int, Picked]:
    """The picks of every generation whose request names a rule that at least one other one names too, each rule run
    once over the rows of all of them (when their logits lie back to back, as the engine's joined logits split per
    lane do), by position in ``gens``."""
    by_rule: dict[Pick, list[int]] = {}
    for i, gen in enumerate(gens):
        pick = gen.request.pick if isinstance(gen.request, StepRequest) else None
        if pick is not None:
            by_rule.setdefault(pick, []).append(i)
    out: dict[int, Picked] = {}
    for pick, members in by_rule.items():
        if len(members) < 2:
            continue
        parts = [logits[i] for i in members]
        joined = joined_span(parts)
        if joined is None:
            continue
        try:
            shared = pick_lanes(pick, joined, [p.numel() // p.shape[-1] for p in parts],
                                [tuple(p.shape[:-1]) for p in parts], gens[members[0]].scratch)
        except Exception:  # noqa: BLE001 - each loop then picks from its own logits (and fails alone)
            continue
        out.update(zip(members, shared, strict=True))
    return out


Slot = tuple[Generation, Lane, Forward, int]  # a lane of a round: its generation, the forward that made it (and takes
# its output), and which of the generation's sequences it is (0 for a loop of one)


def _together(model: DiffusionLM, run: Callable[[DiffusionLM, list], list],  # type: ignore[type-arg]
              slots: Sequence[Slot], taken: dict[int, dict[int, Tensor]]) -> None:
    """Run the lanes of ``slots`` through the engine in one call and put each lane's logits (its forward's share of
    the output) into ``taken[id(generation)][sequence]``; a failed shared forward ends the generations in it."""
    try:
        outputs = run(model, [lane for _, lane, _, _ in slots])
    except Exception as exc:  # noqa: BLE001 - a failed shared forward ends its generations
        for gen, _, _, _ in slots:
            gen.fail(exc)
        return
    for (gen, lane, forward, member), output in zip(slots, outputs, strict=True):
        if gen.error is not None:
            continue
        try:
            taken.setdefault(id(gen), {})[member] = forward.take(lane, output)
        except Exception as exc:  # noqa: BLE001
            gen.fail(exc)


def prefill_groups(slots: Sequence[Slot], cap: int) -> list[list[Slot]]:
    """The prefills of one round in runs that go through the engine together: consecutive lanes while their rows
    together stay within ``cap`` (``engine.prefill.join_rows``); a lane of more rows alone. Each lane's numbers are
    the same in any run (``models/rows.py``), so this decides only the speed."""
    groups: list[list[Slot]] = []
    rows = 0
    for slot in slots:
        lane = slot[1]
        assert isinstance(lane, PrefillLane)
        n = lane.ids.shape[0] * (lane.ids.shape[1] - lane.first)
        if not groups or rows + n > cap:
            groups.append([])
            rows = 0
        groups[-1].append(slot)
        rows += n
    return groups


def _lanes(gen: Generation) -> list[tuple[Lane | None, Forward, int]] | None:
    """The engine lanes of a generation's request (a lane None: its step runs alone); None when making them
    failed (the generation has failed)."""
    request = gen.request
    pairs: list[tuple[Forward, StepRequest]]
    if isinstance(request, ManyRequest):
        pairs = list(zip(request.forwards, request.requests, strict=True))
    else:
        assert isinstance(request, StepRequest)
        pairs = [(gen.run.forward, request)]
    try:
        return [(forward.lane(req), forward, i) for i, (forward, req) in enumerate(pairs)]
    except Exception as exc:  # noqa: BLE001
        gen.fail(exc)
        return None


def step_round(model: DiffusionLM, generations: Sequence[Generation]) -> None:
    """One step of every generation that has a request (see the module doc)."""
    prefills: list[Slot] = []
    steps: list[Slot] = []
    asking: list[Generation] = []
    for gen in generations:
        if not isinstance(gen.request, StepRequest | ManyRequest):
            continue
        lanes = _lanes(gen)
        if lanes is None:
            continue
        if lanes[0][0] is None:  # a compiled or captured step (its own fixed shapes), or a family without lanes
            assert isinstance(gen.request, StepRequest) and len(lanes) == 1
            try:
                logits = gen.run.forward.alone(gen.request)
            except Exception as exc:  # noqa: BLE001
                gen.fail(exc)
                continue
            gen.answer(logits)
            continue
        asking.append(gen)
        for lane, forward, member in lanes:
            assert lane is not None  # a loop of several sequences makes lanes for all of them
            (prefills if isinstance(lane, PrefillLane) else steps).append((gen, lane, forward, member))
    taken: dict[int, dict[int, Tensor]] = {}
    runs = prefill_groups(prefills, join_rows(model)) if prefills else []
    if steps:
        runs.append(steps)
    for run in runs:
        _together(model, prefill_lanes if run is not steps else step_logits, run, taken)
        _answer([gen for gen, _, _, _ in run if isinstance(gen.request, StepRequest)], taken)
    for gen in asking:  # a loop of several sequences, once every one of its lanes has run
        if isinstance(gen.request, ManyRequest) and gen.error is None:
            parts = taken[id(gen)]
            gen.answer_many([parts[member] for member in range(len(parts))])
    commit_round(generations)


def _answer(single: Sequence[Generation], taken: dict[int, dict[int, Tensor]]) -> None:
    """Send the loops of one sequence of an engine run their step's logits, or their picks: each rule's run once
    over the rows of every loop that names it (``_shared_picks``)."""
    alive = [gen for gen in single if gen.error is None]
    logits = [taken[id(gen)][0] for gen in alive]
    picks = _shared_picks(alive, logits)
    for i, (gen, own) in enumerate(zip(alive, logits, strict=True)):
        gen.answer(own, picks.get(i))


def commit_round(generations: Sequence[Generation]) -> None:
    """Run the commits the loops yielded after their picks, together (``commit_together``), and resume each loop to
    its next request (sent its open positions still masked where the commit found them, else nothing)."""
    while True:
        pending = [gen for gen in generations if isinstance(gen.request, TopCommit)]
        if not pending:
            return
        done = commit_together([(gen.run, gen.request) for gen in pending])  # type: ignore[misc]
        for gen, (error, left) in zip(pending, done, strict=True):
            if error is not None:
                gen.fail(error)
            else:
                gen.advance(left)  # its open positions still masked, where the commit found them


def drive(model: DiffusionLM, run: Run, loop: Loop) -> GenerationResult:
    """Run one loop to its end; the result of its generation (its error raised)."""
    gen = Generation(0, run, loop)
    while not gen.done:
        step_round(model, [gen])
    if gen.error is not None:
        raise gen.error
    assert gen.result is not None
    return gen.result
