"""What the denoising loops share: the events, the results, the step meter, the bidirectional loops' state.

``Denoising`` holds one generation's sequence ``[prompt ; masks]``, its random generator, its forward
(``sampling/forward.py``: how its steps become engine lanes, as its ``engine.plan.CachePlan`` says) and the
``StepMeter`` that times the steps and fills the run statistics; the family loops (``llada.py``, ``dream.py``)
only decide which tokens to commit, and ``sampling/driver.py`` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from maskkv_cli.engine.plan import CachePlan
from maskkv_cli.engine.selection import LayerRecord
from maskkv_cli.errors import UsageError
from maskkv_cli.models.base import kv_bytes_per_token
from maskkv_cli.models.protocol import DiffusionLM
from maskkv_cli.models.quantize import held_bytes, quantization_of
from maskkv_cli.runtime.stats import RunStats, model_devices, now, peak_memory, reset_cuda_peaks
from maskkv_cli.sampling.forward import CachedForward, Forward
from maskkv_cli.sampling.picks import Scratch


@dataclass(frozen=True)
class Event:
    """Progress of a generation, for displays. ``kind``: prefill, step, done."""

    kind: str
    block: int = 0
    n_blocks: int = 0
    step: int = 0  # global step index (0 = the prefill)
    committed: int = 0  # tokens committed by this step
    masked_left: int = 0
    elapsed_s: float = 0.0
    # (B, n) the response after this step, the mask id where nothing is committed yet (prefill and step events; a
    # view of the sampler's sequence: copy what you keep): n = gen_length, a block-causal model's whole blocks after
    # the prompt, DiffusionGemma's canvases. ``maskkv serve`` streams committed text from it.
    tokens: Tensor | None = None


@dataclass
class GenerationResult:
    tokens: Tensor  # (B, n) response ids (cond batch only): n = gen_length (DiffusionGemma: its committed canvases)
    stats: RunStats
    records: list[LayerRecord] = field(default_factory=list)
    layer_budgets: list[int] | None = None
    # (B, gen_length) float64: probability of each token when it was committed (NaN: never committed)
    token_probs: Tensor | None = None
    plan: CachePlan | None = None  # how the prompt cache was run (policy, budget, importance source, ...)


def check_vocabulary(where: str, lowest: int, highest: int, vocab_size: int) -> None:
    """Refuse prompt ids whose lowest and highest are not both tokens of a vocabulary of ``vocab_size`` (the
    embedding's lookup said only "index out of range in self")."""
    if lowest < 0 or highest >= vocab_size:
        bad = lowest if lowest < 0 else highest
        raise UsageError(f"{where}: token id {bad} is not in the model's vocabulary (0 to {vocab_size - 1})")


def masked_sequence(model: DiffusionLM, prompt: Tensor, gen_length: int) -> tuple[Tensor, int]:
    """``[prompt ; gen_length masks]`` on the model's device (a 1-D prompt is one row) and the prompt length."""
    if prompt.dim() == 1:
        prompt = prompt[None]
    prompt = prompt.to(model.device)
    bsz, m = prompt.shape
    if m == 0:
        raise UsageError("the prompt is empty")
    masks = torch.full((bsz, gen_length), model.config.mask_token_id, dtype=prompt.dtype, device=prompt.device)
    return torch.cat([prompt, masks], 1), m


def open_positions(masked: Tensor, positions: Tensor) -> tuple[Tensor, Tensor | None]:
    """Of ``masked`` (B, n) (which positions of each row are masks; ``positions`` (n,): the response position of
    each column, ascending): the positions still masked in some row (those whose logits a step needs), and which of
    them are still masks in each row, None for one row (all of them)."""
    if masked.shape[0] == 1:
        return positions[masked[0]], None
    some = masked.any(0)
    return positions[some], masked[:, some]


def still_only(conf: Tensor, still: Tensor | None) -> Tensor:
    """``conf`` (B, n) with ``-inf`` where a position is no longer a mask (``open_positions``' still)."""
    return conf if still is None else torch.where(still, conf, float("-inf"))


def still_counts(still: Tensor | None, n: int) -> list[int]:
    """Each row's still-masked count among ``n`` open positions (one read from the device)."""
    return [n] if still is None else still.sum(1).tolist()


class StepMeter:
    """Times the steps (device-synchronised), emits events, and fills the run statistics at the end."""

    def __init__(self, model: DiffusionLM, stats: RunStats, on_event: Callable[[Event], None] | None,
                 prompt_len: int, forward: Forward) -> None:
        self.model, self.stats, self.prompt_len, self.forward = model, stats, prompt_len, forward
        self.emit = on_event
        self.device = model.device
        self.steps = 0
        reset_cuda_peaks(model_devices(model))
        self.start = now(self.device)
        # a plan without later-step functions (``none``: every step a full forward) runs eager whatever was asked
        stats.step_mode = forward.step_options.label if forward.policy.uses_cache else "eager"

    def step(self, t0: float, x: Tensor, commit: Tensor | int, block: int, n_blocks: int,
             t1: float | None = None) -> None:
        """Time the step that began at ``t0`` and ended at ``t1`` (None: now); ``commit``: what it committed (a
        mask, or a count)."""
        t1 = now(self.device) if t1 is None else t1
        setup = self.forward.setup_s  # one-time compilation / capture inside step 0: not the step's work
        if self.steps == 0:
            self.stats.prefill_s = t1 - t0 - setup
        else:
            self.stats.step_s.append(t1 - t0)
        if self.emit is not None:  # (the count of masks left reads the sequence: only for a listener)
            left = int((x[:, self.prompt_len :] == self.model.config.mask_token_id).sum())
            self.emit(Event("prefill" if self.steps == 0 else "step", block, n_blocks, self.steps,
                            commit if isinstance(commit, int) else int(commit.sum()), left, t1 - self.start - setup,
                            x[:, self.prompt_len :]))
        self.steps += 1

    def done(self) -> None:
        """End-of-run figures: time, memory, KV bytes kept vs what the full prompt cache would take."""
        stats, forward = self.stats, self.forward
        stats.setup_s = forward.setup_s
        stats.total_s = now(self.device) - self.start - forward.setup_s
        stats.steps_run = self.steps
        stats.peak_mem_bytes, stats.mem_kind = peak_memory(model_devices(self.model))
        if forward.cache is not None:
            stats.kv_entries = forward.cache.logical_entries()
            stats.kv_bytes = forward.cache.prompt_nbytes()
        stats.kv_full_bytes = kv_bytes_per_token(self.model) * forward.split * forward.batch
        stats.weights_bytes, stats.quantization = held_bytes(self.model), quantization_of(self.model)
        if self.emit is not None:
            self.emit(Event("done", 0, 0, self.steps, 0, 0, stats.total_s))


@dataclass(frozen=True)
class Slab:
    """Storage that generations stepping together keep their sequences (``tokens``, back to back) and token
    probabilities (``probs``) in, 1-D each, so that one write reaches all of them (``sampling/commits.py``)."""

    tokens: Tensor
    probs: Tensor


class Denoising:
    """One generation: the sequence ``x`` = ``[prompt ; gen_length masks]`` (prompt length ``m``), the random
    generator, the forward passes and the step meter. The loops read ``x`` and commit each step (``commit``,
    ``commit_top``, or through the driver with the generations beside it: ``sampling/commits.py``)."""

    def __init__(self, model: DiffusionLM, prompt: Tensor, gen_length: int, seed: int, plan: CachePlan,
                 on_event: Callable[[Event], None] | None, row_window: int | None = None) -> None:
        self.device = model.device
        self.x, self.m = masked_sequence(model, prompt, gen_length)
        if self.m != plan.prompt_len:
            raise ValueError(f"the cache plan is for a {plan.prompt_len}-token prompt, the prompt has {self.m}")
        self.mask_id = model.config.mask_token_id
        self.rng = torch.Generator(device=self.device).manual_seed(seed)
        self.plan = plan
        self.forward = CachedForward(model, plan, row_window)
        stats = RunStats(policy=plan.policy.name, prompt_len=self.m, gen_length=gen_length)
        self.meter = StepMeter(model, stats, on_event, self.m, self.forward)
        self.token_probs = torch.full((self.x.shape[0], gen_length), float("nan"), dtype=torch.float64,
                                      device=self.device)
        self.scratch = Scratch()  # loops stepping together are given one to share (``stream.py``)
        self.slab: Slab | None = None  # the storage shared with the generations beside it, where it has one
        self._row_views = self._views()

    def _views(self) -> list[tuple[Tensor, Tensor]]:
        """Each row's response and token probabilities as 1-D views: a commit writes them with one index_put each."""
        return [(self.x[b, self.m :], self.token_probs[b]) for b in range(self.x.shape[0])]

    def adopt(self, slab: Slab, start: int, probs_start: int) -> None:
        """Keep the sequence and the token probabilities in ``slab`` from these offsets on (before the loop starts:
        it reads ``x`` once)."""
        x = slab.tokens[start : start + self.x.numel()].view(self.x.shape)
        x.copy_(self.x)
        probs = slab.probs[probs_start : probs_start + self.token_probs.numel()].view(self.token_probs.shape)
        probs.copy_(self.token_probs)
        self.x, self.token_probs, self.slab = x, probs, slab
        self._row_views = self._views()

    def commit(self, rows: Tensor, commit: Tensor, x0: Tensor, chosen_prob: Tensor, t0: float, block: int,
               n_blocks: int) -> None:
        """Write the chosen tokens ``x0`` where ``commit`` is set, record their probabilities ``chosen_prob`` (which
        take no part in choosing), and time the step that began at ``t0``."""
        x, positions = self.x, self.m + rows
        x[:, positions] = torch.where(commit, x0, x[:, positions])
        self.token_probs[:, rows] = torch.where(commit, chosen_prob, self.token_probs[:, rows])
        self.meter.step(t0, x, commit, block, n_blocks)

    def commit_top(self, rows: Tensor, conf: Tensor, still: Tensor | None, counts: list[int], x0: Tensor,
                   chosen_prob: Tensor, t0: float, block: int, n_blocks: int) -> None:
        """``commit`` of the ``counts[b]`` most confident still-masked positions of each row (``conf`` -inf where a
        position is no longer a mask, ``still`` as ``open_positions`` gives it), written at topk's indices directly
        instead of through a mask over every open position."""
        committed = 0
        lefts = still_counts(still, conf.shape[1])
        for b, (k, left, (response, probs)) in enumerate(zip(counts, lefts, self._row_views, strict=True)):
            k = min(k, left)
            if k:
                chosen = conf[b].topk(k).indices
                at = rows.index_select(0, chosen)
                response.index_put_((at,), x0[b].index_select(0, chosen))
                probs.index_put_((at,), chosen_prob[b].index_select(0, chosen))
                committed += k
        self.meter.step(t0, self.x, committed, block, n_blocks)

    def result(self) -> GenerationResult:
        self.meter.done()
        return GenerationResult(self.x[:, self.m :].clone(), self.meter.stats, self.forward.records,
                                self.forward.layer_budgets, self.token_probs, self.plan)
